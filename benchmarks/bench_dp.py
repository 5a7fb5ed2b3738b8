"""Data parallelism, side by side in one process tree: minitron's bucketed all-reduce vs
``torch.nn.parallel.DistributedDataParallel``, naive vs bucketed, ZeRO-1, and dp=2 over dp=1.

    .venv/bin/python benchmarks/bench_dp.py                       # print the table
    .venv/bin/python benchmarks/bench_dp.py --write benchmarks/data_parallel.md

Two gloo ranks (one thread each) build every variant on the same model and the same global
batch, then time them interleaved: each round runs every variant for `--steps` steps, in a
rotated order, with barriers around; the figure of a variant is the median over rounds of
the slower rank's mean step time. A step is the whole ``Trainer.step_async``: batch, forward,
backward, gradient sync, clipping, AdamW, the loss all-reduce; a round ends by waiting for
what is still in flight (ZeRO-1's last parameter all-gather), so of a round's `--steps`
all-gathers all but the last overlap the next forward, as in a training run. The DDP variant is the same
Trainer with its model wrapped in DDP (``no_sync`` on all but the last microbatch) and
minitron's synchroniser replaced by a no-op, so only the gradient sync differs.
dp=1 runs on rank 0 while rank 1 waits: `weak` keeps the per-replica batch (global/2),
`strong` the whole global batch. `dp=2 no sync` runs both replicas with no gradient sync at
all (not a correct training, a timing): it splits the weak-scaling loss into what two
replicas cost each other on a shared machine (no sync / dp=1 weak) and what the
communication adds (bucketed / no sync).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from harness import cpu_name, paired_ratio, publish, slowest_rank_rounds  # noqa: E402
from minitron.comm import Comm  # noqa: E402
from minitron.config import ParallelConfig, TrainConfig, preset  # noqa: E402
from minitron.optim import sync_replicated_grads  # noqa: E402


class ChunkInDDP(DistributedDataParallel):
    """DistributedDataParallel around a minitron model chunk, which the training loop
    still reads as one: whether it holds the first and the last stage."""

    @property
    def first(self) -> bool:
        return self.module.first

    @property
    def last(self) -> bool:
        return self.module.last


class DDPSync:
    """The Trainer's data-parallel interface on top of DistributedDataParallel."""

    def __init__(self, ddp, params, comm):
        self.ddp, self.params, self.comm = ddp, params, comm

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def microbatch(self, last: bool):
        return contextlib.nullcontext() if last else self.ddp.no_sync()

    def finish(self):
        sync_replicated_grads(self.params, self.comm)

    def wait_params(self):
        """Nothing in flight: DDP's parameters are always whole."""

    materialize = wait_params


class NoSync(DDPSync):
    """No gradient sync at all (timing only: what two replicas cost without communication)."""

    def __init__(self, params, comm):
        super().__init__(None, params, comm)

    def microbatch(self, last: bool):
        return contextlib.nullcontext()


def build(name, comm, model, train, corpus, bucket_mb):
    """(trainer, ranks that run it) of variant `name`."""
    from minitron.train import Trainer

    dp2 = lambda **kw: ParallelConfig(dp=2, bucket_mb=bucket_mb, **kw)  # noqa: E731
    if name == "minitron bucketed":
        return Trainer(model, dp2(dp_impl="bucketed"), train, comm, corpus), (0, 1)
    if name == "minitron naive":
        return Trainer(model, dp2(dp_impl="naive"), train, comm, corpus), (0, 1)
    if name.startswith("minitron zero"):  # zero1, zero2, zero3
        return Trainer(model, dp2(dp_impl="bucketed", zero=int(name[-1])), train, comm, corpus), (0, 1)
    if name == "torch DDP":
        tr = Trainer(model, dp2(dp_impl="naive"), train, comm, corpus)
        ddp = ChunkInDDP(tr.chunks[0], process_group=comm.group("dp"), bucket_cap_mb=bucket_mb,
                         gradient_as_bucket_view=True)
        tr.chunks = [ddp]
        tr.dp = DDPSync(ddp, tr.params, comm)
        return tr, (0, 1)
    if name == "dp=2 no sync":
        return Trainer(model, dp2(dp_impl="naive"), train, comm, corpus,
                       data_parallel=lambda params, c, layout, chunks: NoSync(params, c)), (0, 1)
    if name in ("dp=1 weak", "dp=1 strong"):
        gb = train.global_batch // 2 if name == "dp=1 weak" else train.global_batch
        if comm.grid.rank != 0:
            return None, (0,)
        return Trainer(model, ParallelConfig(), train.replace(global_batch=gb), Comm(), corpus), (0,)
    raise ValueError(name)


VARIANTS = ["minitron bucketed", "torch DDP", "minitron naive", "minitron zero1", "minitron zero2",
            "minitron zero3", "dp=2 no sync", "dp=1 weak", "dp=1 strong"]


def bench_job(comm, args, corpus):
    model = preset(args.model)
    train = TrainConfig(steps=10**6, global_batch=args.global_batch, microbatches=args.microbatches,
                    warmup=10, eval_every=0, progress=False, sample_tokens=0)
    variants = [v for v in VARIANTS if v in args.variants]
    built = {v: build(v, comm, model, train, corpus, args.bucket_mb) for v in variants}
    times = {v: [] for v in variants}
    step = {v: 0 for v in variants}
    for r in range(args.warmup + args.rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]  # rotate: no fixed neighbour
        for v in order:
            tr, ranks = built[v]
            comm.barrier()
            t0 = time.perf_counter()
            if comm.grid.rank in ranks:
                for _ in range(args.steps):
                    tr.step_async(step[v])  # as the training loop: ZeRO-1's all-gather overlaps the next forward
                    step[v] += 1
                tr.optimizer.wait_params()  # nothing left in flight when the round's clock stops
            dt = (time.perf_counter() - t0) / args.steps
            comm.barrier()
            if r >= args.warmup and comm.grid.rank in ranks:
                times[v].append(dt)
    return {"times": times, "threads": torch.get_num_threads()}


RATIOS = {  # name: (numerator, denominator, factor)
    "bucketed_over_ddp": ("minitron bucketed", "torch DDP", 1),
    "naive_over_bucketed": ("minitron naive", "minitron bucketed", 1),
    "zero1_over_bucketed": ("minitron zero1", "minitron bucketed", 1),
    "zero2_over_bucketed": ("minitron zero2", "minitron bucketed", 1),
    "zero3_over_bucketed": ("minitron zero3", "minitron bucketed", 1),
    "weak_scaling_efficiency": ("dp=1 weak", "minitron bucketed", 1),
    "no_sync_over_dp1_weak": ("dp=2 no sync", "dp=1 weak", 1),
    "bucketed_over_no_sync": ("minitron bucketed", "dp=2 no sync", 1),
    "strong_scaling_speedup": ("dp=1 strong", "minitron bucketed", 1),
    "strong_scaling_efficiency": ("dp=1 strong", "minitron bucketed", 0.5),
}


def summarize(results: dict, args) -> dict:
    """Per variant, the median over rounds of the slower rank's step time; per ratio, the
    median over rounds of the ratio within a round (paired: slow drifts of a shared
    machine cancel) and the ratio of the medians."""
    rounds = slowest_rank_rounds(results)
    s = {"step_s": {v: statistics.median(x) for v, x in rounds.items()}, "rounds": len(next(iter(rounds.values())))}
    for name, (a, b, f) in RATIOS.items():
        if a in rounds and b in rounds:
            s[name] = paired_ratio(rounds[a], rounds[b], f)
    return s


def markdown(s: dict, args, command: str) -> str:
    model = preset(args.model)
    from minitron.analysis.params import params_on_rank

    n = params_on_rank(model, ParallelConfig())
    lines = [
        f"Command: `{command}`  ",
        f"Machine: {cpu_name()}, {os.cpu_count()} cores; torch {torch.__version__}, gloo, 2 ranks × 1 thread; "
        f"{datetime.date.today().isoformat()}; load average {args.load[0]:.1f} before, {args.load[1]:.1f} after "
        f"(other processes share the 2 cores)  ",
        f"Model: `{args.model}` ({n / 1e6:.2f} M parameters, {4 * n / 2**20:.1f} MiB of fp32 gradients), "
        f"global batch {args.global_batch} × {model.seq_len} tokens, {args.microbatches} microbatch(es), "
        f"bucket {args.bucket_mb} MB (minitron `--bucket-mb` and DDP `bucket_cap_mb`); "
        f"{args.rounds} rounds × {args.steps} steps after {args.warmup} warm-up round(s).",
        "",
        "| variant | median step (ms) | relative to minitron bucketed |",
        "|---|---:|---:|",
    ]
    b = s["step_s"].get("minitron bucketed")
    for v, x in s["step_s"].items():
        lines.append(f"| {v} | {1e3 * x:.1f} | {x / b:.3f} |" if b else f"| {v} | {1e3 * x:.1f} | |")
    lines.append("")
    lines += ["| ratio | median of per-round ratios | ratio of medians |", "|---|---:|---:|"]
    for k in RATIOS:
        if k in s:
            lines.append(f"| {k.replace('_', ' ')} | **{s[k]['paired_median']:.3f}** | {s[k]['ratio_of_medians']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=4, help="steps per variant per round")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--write", default="", help="append the results as markdown to this file")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny model, one round of one step: does it run?")
    args = ap.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",")]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        print(f"unknown variant {unknown[0]}: choose from {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    if args.smoke:
        args.model, args.global_batch, args.microbatches = "tiny", 4, 2
        args.rounds, args.warmup, args.steps = 1, 0, 1

    from minitron.data import load_corpus
    from minitron.tools.testing import run_on_ranks

    corpus = load_corpus("")
    load0 = os.getloadavg()[0]
    results = run_on_ranks(bench_job, ParallelConfig(dp=2), args, corpus)
    args.load = (load0, os.getloadavg()[0])
    s = summarize(results, args)
    command = "python benchmarks/bench_dp.py " + " ".join(argv if argv is not None else sys.argv[1:])
    md = markdown(s, args, command.strip())
    publish(md, s, args.json, args.write)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
