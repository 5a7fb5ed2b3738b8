"""The first run's anchor: nanoGPT's CPU recipe beside minitron, same corpus, one process.

nanoGPT's README trains a character-level Shakespeare model on a laptop CPU with
4 layers, 4 heads, width 128, context 64, batch 12, 2,000 iterations, dropout 0, learning
rate 1e-3 warmed up over 100 iterations and decayed (cosine) to 1e-4 at 2,000: validation
loss about 1.88 nats per character. This script runs that recipe twice, steps alternating:

* ``plain``: a plain-PyTorch GPT written the way nanoGPT writes it (no biases, tied input
  and output embeddings, residual projections initialised at 0.02/sqrt(2·layers), AdamW
  betas (0.9, 0.99), weight decay 0.1 on matrices, clipping at 1.0);
* ``minitron``: the engine's Trainer on one process with the same sizes, batches, steps and
  learning-rate schedule (minitron's own model: biases, untied head, betas (0.9, 0.95)).

Both read minitron's built-in corpus (the complete works, bytes: nats per byte = nats per
character for this ASCII text), the same batches (``minitron.data.batch``), and are
evaluated on the same 20 held-out batches (nanoGPT's ``eval_iters=20`` on the CPU).

    .venv/bin/python benchmarks/bench_first_run.py                 # the recipe, both (minutes)
    .venv/bin/python benchmarks/bench_first_run.py --variants plain --steps 500
    .venv/bin/python benchmarks/bench_first_run.py --smoke         # 3 steps of a tiny model (the tests)

Prints a line per evaluation and one JSON line at the end: per variant the validation
losses, the tokens processed, the seconds spent in its own steps and tokens/s.
"""
import argparse
import json
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from minitron.config import ModelConfig, ParallelConfig, TrainConfig
from minitron.data import VALIDATION_STEP, batch, load_corpus
from minitron.train import Trainer, sample

VARIANTS = ("plain", "minitron")


class Block(nn.Module):
    """Pre-LN block, no biases (nanoGPT's ``bias=False``)."""

    def __init__(self, h: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h, bias=False), nn.LayerNorm(h, bias=False)
        self.qkv, self.proj = nn.Linear(h, 3 * h, bias=False), nn.Linear(h, h, bias=False)
        self.fc, self.fc2 = nn.Linear(h, 4 * h, bias=False), nn.Linear(4 * h, h, bias=False)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class CharGPT(nn.Module):
    """nanoGPT's shape in plain PyTorch: tied embeddings, scaled residual init."""

    def __init__(self, m: ModelConfig, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.wte, self.wpe = nn.Embedding(m.vocab, m.hidden), nn.Embedding(m.seq_len, m.hidden)
        self.blocks = nn.ModuleList(Block(m.hidden, m.heads) for _ in range(m.layers))
        self.ln_f = nn.LayerNorm(m.hidden, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # residual projections shrink with depth (GPT-2's 1/sqrt(2 layers))
                std = 0.02 / math.sqrt(2 * m.layers) if name.endswith(("proj.weight", "fc2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe.weight[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()  # the head is the input embedding
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def nanogpt_lr(it: int, lr: float, min_lr: float, warmup: int, decay: int) -> float:
    """nanoGPT's schedule: linear warm-up, cosine to min_lr at `decay`."""
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    ratio = min(1.0, (it - warmup) / max(1, decay - warmup))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


class Plain:
    def __init__(self, m: ModelConfig, t: TrainConfig, corpus):
        self.m, self.t = m, t
        self.train_data, self.val_data = corpus.split()
        self.net = CharGPT(m, t.seed)
        decay = [p for p in self.net.parameters() if p.dim() >= 2]
        other = [p for p in self.net.parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                                      {"params": other, "weight_decay": 0.0}], lr=t.lr, betas=(0.9, 0.99))

    def step(self, i: int) -> float:
        for g in self.opt.param_groups:
            g["lr"] = nanogpt_lr(i, self.t.lr, self.t.min_lr, self.t.warmup, self.t.steps)
        x, y = batch(self.train_data, self.m.seq_len, self.t.global_batch, self.t.seed, i)
        loss = self.net(x, y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.t.clip)
        self.opt.step()
        return loss.item()

    @torch.no_grad()
    def evaluate(self) -> float:
        self.net.eval()
        # the same held-out batches as Trainer.evaluate draws
        losses = [float(self.net(*batch(self.val_data, self.m.seq_len, self.t.global_batch, self.t.seed,
                                        VALIDATION_STEP + i))) for i in range(self.t.eval_batches)]
        self.net.train()
        return sum(losses) / len(losses)


class Engine:
    def __init__(self, m: ModelConfig, t: TrainConfig, corpus):
        self.tr = Trainer(m, ParallelConfig(), t, corpus=corpus)

    def step(self, i: int) -> float:
        return float(self.tr.step(i))

    def evaluate(self) -> float:
        return self.tr.evaluate()

    def sample(self, n: int) -> str:
        return sample(self.tr.chunks[0], n=n, corpus=self.tr.corpus)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-batches", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="a tiny model, 3 steps of each (what the tests run)")
    args = ap.parse_args()
    for v in args.variants:
        if v not in VARIANTS:
            sys.exit(f"unknown variant {v}: choose from {', '.join(VARIANTS)}")
    if args.smoke:
        args.layers, args.hidden, args.heads, args.seq_len, args.batch = 1, 32, 2, 16, 4
        args.steps, args.warmup, args.eval_every, args.eval_batches = 3, 1, 3, 2
    torch.set_num_threads(args.threads)
    m = ModelConfig(layers=args.layers, hidden=args.hidden, heads=args.heads, seq_len=args.seq_len,
                    vocab=256, dropout=0.0, name="nanogpt-cpu")
    t = TrainConfig(steps=args.steps, global_batch=args.batch, lr=args.lr, min_lr=args.min_lr,
                    warmup=args.warmup, weight_decay=0.1, clip=1.0, eval_batches=args.eval_batches,
                    progress=False)
    corpus = load_corpus("")
    runs = {"plain": Plain, "minitron": Engine}
    runs = {v: runs[v](m, t, corpus) for v in args.variants}
    out = {v: {"val": {0: r.evaluate()}, "seconds": 0.0} for v, r in runs.items()}
    for i in range(args.steps):
        for v, r in runs.items():  # alternate: both see the same machine load
            t0 = time.perf_counter()
            r.step(i)
            out[v]["seconds"] += time.perf_counter() - t0
        if (i + 1) % args.eval_every == 0 or i + 1 == args.steps:
            for v, r in runs.items():
                out[v]["val"][i + 1] = r.evaluate()
            print(f"step {i + 1}: " + ", ".join(f"{v} val {o['val'][i + 1]:.3f}" for v, o in out.items()),
                  flush=True)
    tokens = args.steps * args.batch * args.seq_len
    for v, o in out.items():
        o.update(tokens=tokens, tokens_per_s=tokens / o["seconds"], final_val=o["val"][args.steps])
    if "minitron" in runs:
        out["minitron"]["sample"] = runs["minitron"].sample(60 if args.smoke else 300)
    print(json.dumps({"model": {"layers": m.layers, "hidden": m.hidden, "heads": m.heads, "seq_len": m.seq_len},
                      "batch": args.batch, "steps": args.steps, "lr": args.lr, "min_lr": args.min_lr,
                      "warmup": args.warmup, "threads": args.threads, "runs": out}))


if __name__ == "__main__":
    main()
