"""FP8's effect on a model's numbers: the same GPT from the same seed trained in fp32, bf16
and each FP8 recipe (``--precision fp8 --fp8-recipe R``), single process; the final
validation loss of each and its gap to bf16's, with the step time on this machine. On a
CPU the FP8 GEMMs are emulated (quantize, dequantize, multiply in fp32): the time is the
emulation's cost, not a speed claim.

    .venv/bin/python benchmarks/bench_fp8.py --steps 120            # make run's model (small, s 64)
    .venv/bin/python benchmarks/bench_fp8.py --smoke                # tiny model, two steps (the tests)

Prints one line per run and a JSON line with them all.
"""
import argparse
import json
import time

import torch

from minitron.config import FP8_RECIPES, ParallelConfig, TrainConfig, preset
from minitron.train import Trainer

RUNS = {"fp32": ("fp32", "tensorwise"), "bf16": ("bf16", "tensorwise"), **{r: ("fp8", r) for r in FP8_RECIPES}}


def run(model, precision: str, recipe: str, train: TrainConfig) -> dict:
    """Train one run; its final validation loss and median step time."""
    tr = Trainer(model, ParallelConfig(precision=precision, fp8_recipe=recipe, device="cpu"), train)
    times, losses = [], []
    for i in range(train.steps):
        t0 = time.perf_counter()
        losses.append(tr.step(i))
        times.append(time.perf_counter() - t0)
    name = precision if precision != "fp8" else f"fp8 {recipe}"
    return {"run": name, "final_train_loss": losses[-1], "val_loss": tr.evaluate(),
            "step_s": sorted(times)[len(times) // 2]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--seq-len", type=int, default=64)  # make run's
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", nargs="+", default=list(RUNS), help="of " + ", ".join(RUNS))
    ap.add_argument("--smoke", action="store_true", help="the tiny model, two steps of each run")
    args = ap.parse_args()
    for name in args.runs:
        if name not in RUNS:
            ap.exit(2, f"unknown run {name}: choose from {', '.join(RUNS)}\n")
    if args.smoke:
        args.model, args.steps, args.global_batch, args.seq_len = "tiny", 2, 4, 32
    torch.set_num_threads(args.threads)
    train = TrainConfig(steps=args.steps, global_batch=args.global_batch, lr=args.lr, progress=False,
                        eval_every=0, sample_tokens=0, eval_batches=4 if args.smoke else 20)
    rows = []
    for precision, recipe in (RUNS[n] for n in args.runs):
        rows.append(run(preset(args.model).replace(seq_len=args.seq_len), precision, recipe, train))
        bf16 = next((r["val_loss"] for r in rows if r["run"] == "bf16"), None)
        gap = f"{(rows[-1]['val_loss'] / bf16 - 1):+.2%} vs bf16" if bf16 else ""
        print(f"{rows[-1]['run']:>16}: val loss {rows[-1]['val_loss']:.4f} {gap}, "
              f"{rows[-1]['step_s']:.3f} s/step", flush=True)
    print(json.dumps({"model": args.model, "seq_len": args.seq_len, "steps": args.steps, "global_batch": args.global_batch, "runs": rows}))


if __name__ == "__main__":
    main()
