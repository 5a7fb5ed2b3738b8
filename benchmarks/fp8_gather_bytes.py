"""ZeRO-3's data-parallel bytes per step with FP8 weights on the wire, against fp32 and a
recipe that gathers in the working dtype (rowwise): the analysis, which
``tests/test_fp8.py`` holds equal to a traced step. Nothing is timed.

    PYTHONPATH=. .venv/bin/python benchmarks/fp8_gather_bytes.py [--models small gpt-1.3b] [--smoke]
"""
from __future__ import annotations

import argparse

from minitron.analysis.comm import comm_bytes_per_step
from minitron.config import PRESETS, ParallelConfig, TrainConfig

RUNS = (("fp32", {}), ("fp8 rowwise", dict(precision="fp8", fp8_recipe="rowwise")),
        ("fp8 tensorwise", dict(precision="fp8", fp8_recipe="tensorwise")))


def row(model, tp: int, train: TrainConfig) -> dict:
    """{run: (dp all-gather bytes, dp all-reduce bytes)} of rank 0 under dp2 × tp, ZeRO-3."""
    out = {}
    for label, kw in RUNS:
        b = comm_bytes_per_step(model, ParallelConfig(dp=2, tp=tp, zero=3, **kw), train, 0)["dp"]
        out[label] = (b.get("all_gather", 0), b.get("all_reduce", 0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["small", "gpt-1.3b"], choices=sorted(PRESETS))
    ap.add_argument("--smoke", action="store_true", help="the tiny model, tp 1 only")
    args = ap.parse_args()
    models, tps = (["tiny"], (1,)) if args.smoke else (args.models, (1, 2))
    train = TrainConfig(global_batch=16, microbatches=2)
    print("| model | tp | all-gather fp32 | all-gather fp8 rowwise | all-gather fp8 tensorwise | tensorwise / fp32 "
          "| amax all-reduce (dp) |")
    print("|---|---|---|---|---|---|---|")
    for name in models:
        for tp in tps:
            r = row(PRESETS[name], tp, train)
            fp32, rw, tw = (r[k][0] for k, _ in RUNS)
            amax = r["fp8 tensorwise"][1] - r["fp32"][1]  # beyond the gradient norm's
            print(f"| {name} | {tp} | {fp32:,} | {rw:,} | {tw:,} | {tw / fp32:.3f} | {amax} B |")


if __name__ == "__main__":
    main()
