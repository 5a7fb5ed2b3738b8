"""minitron's Llama against `transformers.LlamaForCausalLM`: one training step on one device,
the same config, weights and batch, the two alternating round by round (paired ratios).

    .venv/bin/python benchmarks/bench_llama.py --model llama-small --rounds 20
    .venv/bin/python benchmarks/bench_llama.py --smoke      # llama-tiny, one round (the tests)

A step is forward, backward, global-norm clipping and AdamW on both sides (minitron's
``Trainer.step``; transformers' model with ``torch.optim.AdamW`` and ``clip_grad_norm_``,
SDPA attention). Prints the markdown block RESULTS.md records (``--json``: the summary);
the ratio is minitron / transformers (below 1: minitron faster).
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import race_versus_transformers  # noqa: E402

from minitron import hf  # noqa: E402
from minitron.config import ParallelConfig, TrainConfig, preset  # noqa: E402
from minitron.train import Trainer  # noqa: E402


def transformers_twin(tr, cfg, lr: float, weight_decay: float):
    """transformers' LlamaForCausalLM holding `tr`'s weights, and its AdamW."""
    import transformers

    keep = {k: v for k, v in hf.llama_config(cfg, torch.float32).items() if k not in ("architectures", "dtype")}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**keep, attn_implementation="sdpa"))
    full = {p.shard.name: p.detach().clone() for p in tr.params}
    model.load_state_dict(hf.to_hf(full, cfg), strict=True)
    model.train()
    return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-small")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default="", help="append the markdown to this file (e.g. benchmarks/RESULTS.md)")
    ap.add_argument("--smoke", action="store_true", help="llama-tiny, one round after one warm-up")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.rounds, args.warmup, args.global_batch, args.out = "llama-tiny", 1, 1, 4, ""
    torch.set_num_threads(args.threads)
    cfg = preset(args.model)
    if cfg.positions != "rope":
        raise SystemExit(f"bench_llama.py: --model {args.model} is not a Llama (choose llama-tiny, llama-small)")
    train = TrainConfig(global_batch=args.global_batch, lr=1e-3, warmup=0, min_lr=1e-3, progress=False,
                        eval_every=0, weight_decay=0.1, clip=1.0)
    tr = Trainer(cfg, ParallelConfig(device="cpu"), train)
    theirs, opt = transformers_twin(tr, cfg, train.lr, train.weight_decay)

    def hf_step(i):
        x, y = tr.local_batch(i)
        loss = F.cross_entropy(theirs(x).logits.flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(theirs.parameters(), train.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    race_versus_transformers(tr, hf_step, args, "bench_llama.py", "Llama training step: minitron vs "
                             "transformers.LlamaForCausalLM",
                             f"{cfg.name} (h {cfg.hidden}, {cfg.layers} layers, {cfg.heads} heads, {cfg.n_kv_heads} "
                             f"kv heads, ffn {cfg.ffn_hidden}, s {cfg.seq_len})", {"model": cfg.name})


if __name__ == "__main__":
    main()
