"""minitron's mixture of experts against `transformers.MixtralForCausalLM`: one training step
on one device, the same config, weights and batch, the two alternating round by round
(paired ratios).

    .venv/bin/python benchmarks/bench_moe.py --model llama-small --experts 8 --rounds 20
    .venv/bin/python benchmarks/bench_moe.py --smoke      # moe-tiny, one round (the tests)

The model is a Llama preset whose MLPs become E SwiGLU experts, top-2 (Mixtral's block).
A step is forward, backward, global-norm clipping and AdamW on both sides (minitron's
``Trainer.step``, dropless, with its Switch balancing loss; transformers' model with its
own load-balancing loss (``output_router_logits``), ``torch.optim.AdamW`` and
``clip_grad_norm_``, SDPA attention, its default experts implementation). Prints the
markdown block RESULTS.md records (``--json``: the summary); the ratio is minitron /
transformers (below 1: minitron faster).
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
    """transformers' MixtralForCausalLM holding `tr`'s weights (written by minitron's export
    in Mixtral's file format and read by transformers, which fuses the experts), and its AdamW."""
    import tempfile

    import transformers

    full = {p.shard.name: p.detach().clone() for p in tr.params}
    with tempfile.TemporaryDirectory() as d:
        hf.save(d, full, cfg)
        model = transformers.MixtralForCausalLM.from_pretrained(d, attn_implementation="sdpa", dtype=torch.float32)
    model.train()
    return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-small", help="a Llama preset (its MLPs become experts)")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default="", help="append the markdown to this file (e.g. benchmarks/RESULTS.md)")
    ap.add_argument("--smoke", action="store_true", help="moe-tiny, one round after one warm-up")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.experts, args.rounds, args.warmup, args.global_batch, args.out = "moe-tiny", 4, 1, 1, 4, ""
    torch.set_num_threads(args.threads)
    cfg = preset(args.model)
    if cfg.positions != "rope":
        raise SystemExit(f"bench_moe.py: --model {args.model} is not Llama-shaped (choose llama-tiny, llama-small)")
    cfg = cfg.replace(experts=args.experts, top_k=args.top_k, name=f"{cfg.name}-{args.experts}x")
    train = TrainConfig(global_batch=args.global_batch, lr=1e-3, warmup=0, min_lr=1e-3, progress=False,
                        eval_every=0, weight_decay=0.1, clip=1.0)
    tr = Trainer(cfg, ParallelConfig(device="cpu"), train)
    theirs, opt = transformers_twin(tr, cfg, train.lr, train.weight_decay)

    def hf_step(i):
        x, y = tr.local_batch(i)
        out = theirs(x, output_router_logits=True)
        loss = F.cross_entropy(out.logits.flatten(0, 1), y.flatten())
        (loss + cfg.aux_loss * out.aux_loss).backward()
        torch.nn.utils.clip_grad_norm_(theirs.parameters(), train.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    race_versus_transformers(tr, hf_step, args, "bench_moe.py", "MoE training step: minitron vs "
                             "transformers.MixtralForCausalLM",
                             f"{cfg.name} (h {cfg.hidden}, {cfg.layers} layers, {cfg.heads} heads, {cfg.n_kv_heads} "
                             f"kv heads, {cfg.experts} experts of ffn {cfg.moe_ffn_hidden}, top-{cfg.top_k}, s "
                             f"{cfg.seq_len})", {"model": cfg.name, "experts": cfg.experts, "top_k": cfg.top_k})


if __name__ == "__main__":
    main()
