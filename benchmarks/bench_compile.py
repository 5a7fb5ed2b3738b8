"""Eager vs `--compile` minitron, side by side in one run (steps alternate, medians).

    .venv/bin/python benchmarks/bench_compile.py --model small --steps 10
    .venv/bin/python benchmarks/bench_compile.py --model medium --steps 5 --global-batch 8
    .venv/bin/python benchmarks/bench_compile.py --smoke      # tiny model, one step (the tests)

Prints one JSON line: median step time of each and their ratio (compiled / eager), with
the matmul probe's FLOP/s sampled between the steps, and the MFU of each.
"""
import argparse
import json
import torch

from minitron.tools.bench import MatmulProbe, alternate
from minitron.config import ParallelConfig, TrainConfig, preset
from minitron.model_flops import model_flops_per_step
from minitron.train import Trainer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smoke", action="store_true",
                    help="the tiny model, one step of each, after one warm-up (what the tests run)")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.steps, args.warmup, args.global_batch = "tiny", 1, 1, 4
    torch.set_num_threads(args.threads)
    model, train = preset(args.model), TrainConfig(global_batch=args.global_batch, progress=False)
    probe = MatmulProbe()
    s = alternate({"eager": Trainer(model, ParallelConfig(), train).step_async,
                   "compiled": Trainer(model, ParallelConfig(compile=True), train).step_async,
                   "peak": probe}, torch.device("cpu"), args.warmup, args.steps)
    peak, flops = probe.flops / s["peak"], model_flops_per_step(model, args.global_batch)
    print(json.dumps({"model": model.name, "threads": args.threads, "eager_step_s": s["eager"],
                      "compiled_step_s": s["compiled"], "compiled_over_eager": s["compiled"] / s["eager"],
                      "peak_flops_per_s": peak, "mfu_eager": flops / s["eager"] / peak,
                      "mfu_compiled": flops / s["compiled"] / peak}))


if __name__ == "__main__":
    main()
