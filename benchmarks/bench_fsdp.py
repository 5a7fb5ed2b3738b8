"""minitron's ZeRO-3 beside PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

    .venv/bin/python benchmarks/bench_fsdp.py                 # 2 ranks, the table
    .venv/bin/python benchmarks/bench_fsdp.py --ranks 4
    .venv/bin/python benchmarks/bench_fsdp.py --write benchmarks/data_parallel.md
    .venv/bin/python benchmarks/bench_fsdp.py --smoke         # tiny model, one round

The same GPT (minitron's single-device class, the same initial weights) on the same data
slices, on d gloo ranks (one thread each). minitron: ``Trainer`` with ``--dp d --zero 3``
(blocks gathered before their forward and backward, freed after, next block prefetched;
gradients reduce-scattered unit by unit; sharded AdamW; exact global clipping). FSDP2:
``fully_shard`` on every block and on the root (per-parameter dim-0 shards as DTensors,
prefetch of the next block, reshard after forward), ``clip_grad_norm_`` and
``torch.optim.AdamW`` on the shards. A step is forward + backward of every microbatch,
clipping and the optimizer step (minitron's also all-reduces the loss for its log).

The two alternate within every round, in a rotated order, with barriers around; a round's
time of a variant is the slower rank's; the ratio reported is the median over rounds of the
per-round ratio minitron / FSDP2 (paired: a shared machine's slow drifts cancel).
Memory, measured the same way for both: one step under ``torch.profiler`` with
``profile_memory`` (``export_memory_timeline``), the peak of the bytes alive on a rank
during the step; and the model states a rank keeps between steps (its parameter,
gradient and AdamW shards).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from harness import paired_ratio, publish, slowest_rank_rounds  # noqa: E402
from minitron.config import ParallelConfig, TrainConfig, preset  # noqa: E402

VARIANTS = ("minitron zero3", "torch fsdp2")


class FSDP2Run:
    """The same model and data as a minitron Trainer, trained under FSDP2."""

    def __init__(self, model_cfg, train: TrainConfig, trainer, d: int):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from minitron.context import Context
        from minitron.model import GPT

        self.tr, self.train = trainer, train  # minitron's trainer gives this rank's batches
        self.gpt = GPT(model_cfg, Context(seed=train.seed))
        mesh = init_device_mesh("cpu", (d,))
        for block in self.gpt.blocks.values():
            fully_shard(block, mesh=mesh)
        fully_shard(self.gpt, mesh=mesh)
        params = list(self.gpt.parameters())
        decay = [p for p in params if p.dim() >= 2]
        other = [p for p in params if p.dim() < 2]
        self.params = params
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": train.weight_decay},
                                      {"params": other, "weight_decay": 0.0}],
                                     lr=train.lr, betas=(0.9, 0.95), eps=1e-8)

    def step(self, step: int) -> float:
        from minitron.optim import lr_at

        mbs = self.tr.microbatches(step)
        total = torch.zeros((), dtype=torch.float64)
        for x, y in mbs:
            loss = self.gpt(x, y) / len(mbs)
            loss.backward()
            total += loss.detach().double()
        torch.nn.utils.clip_grad_norm_(self.params, self.train.clip)
        for g in self.opt.param_groups:
            g["lr"] = lr_at(step, self.train)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        comm = self.tr.comm  # the global mean loss, as minitron's step returns it
        comm.all_reduce(total, "dp")
        return float(total) / comm.size("dp")

    def state_bytes(self) -> int:
        """Parameter, gradient and AdamW shards this rank keeps between steps."""
        local = [p.to_local() for p in self.params]
        opt = [t.to_local() if hasattr(t, "to_local") else t
               for s in self.opt.state.values() for k, t in s.items() if k != "step"]
        return sum(t.numel() * t.element_size() for t in local + opt)  # grads are freed (set_to_none)


def minitron_state_bytes(tr) -> int:
    dp, opt = tr.dp, tr.optimizer
    return sum(t.numel() * t.element_size() for t in (dp.param_shard, dp.shard_grad, opt.exp_avg, opt.exp_avg_sq))


def peak_step_bytes(run_step, step: int) -> int | None:
    """The most bytes alive on this rank during one step, from torch.profiler's memory timeline
    (None when the profiler cannot build the timeline: its CPU memory analysis sometimes
    fails on allocations it did not see begin; the step itself has run)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        run_step(step)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (deprecated for CUDA snapshots; the CPU has no other)
        path = os.path.join(tmp, "timeline.json")
        try:
            prof.export_memory_timeline(path, device="cpu")
        except Exception as e:  # a private analysis of torch's; report, do not fail the run
            print(f"note: no memory timeline for this step ({type(e).__name__}: {e})", file=sys.stderr)
            return None
        _, sizes = json.load(open(path))
    return max(sum(row) for row in sizes) if sizes else 0


def bench_job(comm, args, corpus):
    from minitron.train import Trainer

    model = preset(args.model)
    train = TrainConfig(steps=10**6, global_batch=args.global_batch, microbatches=args.microbatches, warmup=10,
                    eval_every=0, progress=False, sample_tokens=0)
    d = comm.size("dp")
    mini = Trainer(model, ParallelConfig(dp=d, zero=3), train, comm, corpus)
    fsdp = FSDP2Run(model, train, mini, d)
    steps = {"minitron zero3": mini.step, "torch fsdp2": fsdp.step}
    first = {v: steps[v](0) for v in VARIANTS}  # step 0 of both (also a warm-up): the same loss
    times = {v: [] for v in VARIANTS}
    k = 1
    for r in range(args.warmup + args.rounds):
        order = VARIANTS[r % 2:] + VARIANTS[:r % 2]
        for v in order:
            comm.barrier()
            t0 = time.perf_counter()
            for i in range(args.steps):
                steps[v](k + i)
            dt = (time.perf_counter() - t0) / args.steps
            comm.barrier()
            if r >= args.warmup:
                times[v].append(dt)
        k += args.steps
    peak = {v: peak_step_bytes(steps[v], k) for v in VARIANTS}
    state = {"minitron zero3": minitron_state_bytes(mini), "torch fsdp2": fsdp.state_bytes()}
    return {"times": times, "first_loss": first, "peak_bytes": peak, "state_bytes": state,
            "gathered_peak": mini.dp.peak_gathered_bytes}


def summarize(results: dict) -> dict:
    ranks = sorted(results)
    rounds = slowest_rank_rounds(results, VARIANTS)
    a, b = VARIANTS
    return {"step_s": {v: statistics.median(x) for v, x in rounds.items()},
            "rounds": len(rounds[a]),
            "minitron_over_fsdp2": paired_ratio(rounds[a], rounds[b]),
            "first_loss": results[0]["first_loss"],
            "peak_bytes": {v: max((results[r]["peak_bytes"][v] or 0 for r in ranks), default=0) or None
                           for v in VARIANTS},
            "state_bytes": {v: max(results[r]["state_bytes"][v] for r in ranks) for v in VARIANTS},
            "minitron_gathered_peak": max(results[r]["gathered_peak"] for r in ranks)}


def markdown(s: dict, args, command: str) -> str:
    from minitron.analysis.params import params_on_rank

    model = preset(args.model)
    n = params_on_rank(model, ParallelConfig())
    r = s["minitron_over_fsdp2"]
    lines = [f"Command: `{command}`  ",
             f"Machine: {os.cpu_count()}-core CPU VM, torch {torch.__version__}, gloo, {args.ranks} ranks × 1 thread; "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC (other processes share the cores)  ",
             f"Model: `{args.model}` ({n / 1e6:.2f} M parameters), global batch {args.global_batch} × {model.seq_len} "
             f"tokens, {args.microbatches} microbatch(es); {s['rounds']} rounds × {args.steps} step(s) after "
             f"{args.warmup} warm-up round(s). Step 0's loss: minitron {s['first_loss']['minitron zero3']:.6f}, "
             f"FSDP2 {s['first_loss']['torch fsdp2']:.6f}.",
             "",
             "| variant | median step (ms) | peak bytes in a step (MiB) | model states kept (MiB) |",
             "|---|---:|---:|---:|"]
    for v in VARIANTS:
        peak = s["peak_bytes"][v]
        lines.append(f"| {v} | {1e3 * s['step_s'][v]:.1f} | {'n/a' if peak is None else f'{peak / 2**20:.2f}'} | "
                     f"{s['state_bytes'][v] / 2**20:.2f} |")
    lines += ["", f"minitron / FSDP2 step time: **{r['paired_median']:.3f}** (median of per-round ratios), "
                  f"{r['ratio_of_medians']:.3f} (ratio of medians).", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--steps", type=int, default=1, help="steps per variant per round")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds")
    ap.add_argument("--write", default="", help="append the results as markdown to this file")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny model, one round of one step: does it run?")
    args = ap.parse_args(argv)
    if args.ranks < 2:
        print(f"error: --ranks {args.ranks}: sharding needs 2 or more ranks", file=sys.stderr)
        return 2
    if args.global_batch % (args.ranks * args.microbatches):
        print(f"error: --global-batch {args.global_batch} is not divisible by ranks*microbatches = "
              f"{args.ranks * args.microbatches}", file=sys.stderr)
        return 2
    if args.smoke:
        args.model, args.global_batch, args.microbatches = "tiny", 2 * args.ranks, 1
        args.rounds, args.warmup, args.steps = 1, 0, 1

    from minitron.data import load_corpus
    from minitron.tools.testing import run_on_ranks

    results = run_on_ranks(bench_job, ParallelConfig(dp=args.ranks, device="cpu"), args, load_corpus(""))
    s = summarize(results)
    command = "python benchmarks/bench_fsdp.py " + " ".join(argv if argv is not None else sys.argv[1:])
    md = markdown(s, args, command.strip())
    publish(md, s, args.json, args.write)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
