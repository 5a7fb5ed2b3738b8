"""Activation memory per rank under context parallelism, measured on real ranks.

One launch of 4 gloo ranks; for each sequence length, the same microbatch (one sequence
per rank) under cp = 1 (dp = 4), cp = 2 (dp = 2) and cp = 4. Each rank measures the peak
bytes saved for the backward in one training step (``minitron.tools.measure``), next to the
analysis (``memory_on_rank``). Prints a markdown table.

    .venv/bin/python benchmarks/bench_context_parallel.py [--seq-lens 1024,2048,4096]
    .venv/bin/python benchmarks/bench_context_parallel.py --smoke   # one short sequence (the test suite's)
"""
from __future__ import annotations

import argparse

from minitron.analysis import memory_on_rank
from minitron.comm import Comm
from minitron.config import ModelConfig, ParallelConfig, TrainConfig
from minitron.grid import ProcessGrid
from minitron.tools.testing import run_on_ranks

LAYOUTS = [ParallelConfig(dp=4), ParallelConfig(cp=2, dp=2), ParallelConfig(cp=4)]


def model(s: int) -> ModelConfig:
    return ModelConfig(layers=2, hidden=32, heads=4, seq_len=s, vocab=256, name=f"tiny-s{s}")


def job(comm, seq_lens):
    from minitron.data import load_corpus
    from minitron.tools.measure import measure_step_memory
    from minitron.train import Trainer

    corpus, out = load_corpus(""), {}
    for s in seq_lens:
        for lay in LAYOUTS:
            grid = ProcessGrid(dp=lay.dp, cp=lay.cp, rank=comm.grid.rank).build_groups()
            tr = Trainer(model(s), lay, TrainConfig(global_batch=lay.dp, progress=False), Comm(grid), corpus)
            out[(s, lay.cp)] = measure_step_memory(tr)["activations_bytes"]
            del tr
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-lens", default="1024,2048,4096")
    ap.add_argument("--smoke", action="store_true", help="one short sequence: checks the script runs")
    args = ap.parse_args()
    seq_lens = [64] if args.smoke else [int(x) for x in args.seq_lens.split(",")]
    res = run_on_ranks(job, ParallelConfig(cp=4), seq_lens)
    print("| s | cp | activations per rank (measured, max over ranks) | analysis | cp=1 / this |")
    print("|---|---|---|---|---|")
    for s in seq_lens:
        base = max(r[(s, 1)] for r in res.values())
        for lay in LAYOUTS:
            got = max(r[(s, lay.cp)] for r in res.values())
            want = memory_on_rank(model(s), lay, TrainConfig(global_batch=lay.dp))["activations_bytes"]
            print(f"| {s} | {lay.cp} | {got / 2**20:.2f} MiB | {want / 2**20:.2f} MiB | {base / got:.3f} |")


if __name__ == "__main__":
    main()
