"""minitron's pipeline runtime vs torch.distributed.pipelining, side by side on 2 ranks.

Both run the very same stage modules (minitron GPT chunks: embedding on the first stage,
head on the last) with the same microbatches, gloo, CPU:

* minitron: ``PipelineRuntime.run`` executing ``make_schedule("1f1b" | "interleaved")``
  (loss inside the last stage);
* torch: ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` over ``PipelineStage``s
  (``loss_fn`` = cross-entropy of the last stage's logits).

A timed step is the forward and backward of all microbatches (gradients zeroed before;
no optimizer). The two engines alternate step by step so that load on a shared machine
hits both alike; the median over the steps is reported. Results go to
benchmarks/pipeline.md (command, machine, date).

    python benchmarks/bench_pipeline.py --model small --global-batch 16 --microbatches 4 8 --steps 20

With ``--timeline FILE`` it instead reads a ``minitron train --timeline`` file and sets each
rank's measured idle time beside the simulator's for the same schedule replayed with the
measured durations (`timeline_vs_simulation`):

    python benchmarks/bench_pipeline.py --timeline t.jsonl --schedule zb-v --pp 2 --vpp 2 --microbatches 8
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from harness import checkout_commit, cpu_name, paired_ratio  # noqa: E402
from minitron.config import ParallelConfig, preset  # noqa: E402
from minitron.tools.testing import run_on_ranks  # noqa: E402


def _chunks(model, layout, comm, dtype=torch.float32):
    from minitron.context import Context
    from minitron.model import GPT
    from minitron.placement import stage_layers

    ctx = Context(comm, layout, dtype)
    stages, r, p = stage_layers(model, layout), comm.index("pp"), layout.pp
    return [GPT(model, ctx, stages[c * p + r], first=c * p + r == 0, last=c * p + r == len(stages) - 1)
            for c in range(layout.vpp)], ctx


def bench_job(comm, model, cases, global_batch, steps, warmup):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    from minitron.data import batch, load_corpus
    from minitron.parallel.data import NaiveDataParallel
    from minitron.parallel.pipeline import PipelineRuntime

    corpus = load_corpus("")
    x, y = batch(corpus.split()[0], model.seq_len, global_batch, 0, 0, range(global_batch))
    out = []
    for kind, v, m in cases:
        layout = ParallelConfig(pp=2, vpp=v, schedule=kind)
        mine, ctx = _chunks(model, layout, comm)
        theirs, _ = _chunks(model, layout, comm)
        runtime = PipelineRuntime(mine, ctx, layout, m, record=False)
        dp = NaiveDataParallel([p for c in mine for p in c.parameters()], comm)
        mbs = list(zip(x.chunk(m), y.chunk(m)))

        p, r = 2, comm.index("pp")
        stages = [PipelineStage(c, c_i * p + r, p * v, torch.device("cpu"), group=comm.group("pp"))
                  for c_i, c in enumerate(theirs)]

        def loss_fn(logits, target):
            return F.cross_entropy(logits.flatten(0, 1), target.flatten())

        sched = (Schedule1F1B(stages[0], m, loss_fn=loss_fn) if v == 1
                 else ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn))

        def step_minitron():
            for c in mine:
                c.zero_grad(set_to_none=True)
            runtime.run(mbs, dp)

        def step_torch():
            for c in theirs:
                c.zero_grad(set_to_none=True)
            if r == 0:
                sched.step(x)
            elif r == p - 1:
                sched.step(target=y)
            else:
                sched.step()

        times = {"minitron": [], "torch": []}
        for i in range(warmup + steps):
            for name, fn in (("minitron", step_minitron), ("torch", step_torch)):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                dist.barrier()
                if i >= warmup:
                    times[name].append(time.perf_counter() - t0)
        out.append({"schedule": kind, "v": v, "m": m,
                    "minitron_s": statistics.median(times["minitron"]),
                    "torch_s": statistics.median(times["torch"]),
                    "minitron_min_s": min(times["minitron"]), "torch_min_s": min(times["torch"]),
                    # each torch step over the minitron step right before it: robust to load drift
                    "paired_ratio": paired_ratio(times["torch"], times["minitron"])["paired_median"]})
    return out


SCHEDULES = {"1f1b": 1, "interleaved": 2}  # schedule -> chunks per rank


def timeline_vs_simulation(records, kind: str, p: int, v: int, m: int) -> list[dict]:
    """Per step and pipeline rank of a ``minitron train --timeline`` file: the measured idle
    time (the step's span over all ranks minus the rank's compute) beside the simulator's,
    which replays the same schedule with each action's *measured* duration and free
    communication: the idle the dependencies alone cost. The difference is time spent
    waiting for messages and, with more ranks than cores, for a core."""
    from minitron.analysis.pipeline_sim import simulate
    from minitron.parallel.schedules import make_schedule

    s = make_schedule(kind, p, v, m)
    out = []
    for step in sorted({r["step"] for r in records}):
        recs = [r for r in records if r["step"] == step]
        dur = {(r["rank"], r["op"], r["mb"], r["chunk"]): r["end"] - r["start"] for r in recs}
        span = max(r["end"] for r in recs) - min(r["start"] for r in recs)
        sim = simulate(s, lambda rank, a: dur[(rank, a.op, a.mb, a.chunk)])
        for rank in range(p):
            busy = sum(d for key, d in dur.items() if key[0] == rank)
            out.append({"step": step, "rank": rank, "busy_s": busy, "measured_idle_s": span - busy,
                        "simulated_idle_s": sim.idle[rank], "span_s": span, "simulated_span_s": sim.makespan})
    return out


def _timeline_report(path: str, kind: str, p: int, v: int, m: int) -> str:
    """`timeline_vs_simulation` of a timeline file as a markdown table (the first step, which
    includes warm-up, left out)."""
    from minitron.viz.pipeline import load_timeline

    rows = [r for r in timeline_vs_simulation(load_timeline(path), kind, p, v, m) if r["step"] > 0]
    lines = ["| step | rank | compute ms | idle measured ms | idle simulated ms (measured durations) "
             "| step span measured / simulated ms |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['step']} | {r['rank']} | {1e3 * r['busy_s']:.1f} | {1e3 * r['measured_idle_s']:.1f} "
                     f"| {1e3 * r['simulated_idle_s']:.1f} | {1e3 * r['span_s']:.1f} / {1e3 * r['simulated_span_s']:.1f} |")
    tot = {k: sum(r[k] for r in rows) for k in ("busy_s", "measured_idle_s", "simulated_idle_s")}
    lines.append(f"\nAll steps and ranks: compute {1e3 * tot['busy_s']:.0f} ms, idle measured "
                 f"{1e3 * tot['measured_idle_s']:.0f} ms, simulated {1e3 * tot['simulated_idle_s']:.0f} ms.")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES),
                    help=f"which of {', '.join(SCHEDULES)} to run")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "pipeline.md"),
                    help="results file to write ('' for none)")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny model, one step of each case, no results file (what the tests run)")
    ap.add_argument("--timeline", default="",
                    help="instead: compare a `minitron train --timeline` file with the simulator "
                         "(--schedule, --pp, --vpp, one --microbatches)")
    ap.add_argument("--schedule", default="zb-v")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--vpp", type=int, default=2)
    args = ap.parse_args(argv)
    if args.timeline:
        print(_timeline_report(args.timeline, args.schedule, args.pp, args.vpp, args.microbatches[0]))
        return
    unknown = [k for k in args.schedules if k not in SCHEDULES]
    if unknown:
        sys.exit(f"unknown schedule {', '.join(unknown)}: choose from {', '.join(SCHEDULES)}")
    if args.smoke:
        args.model, args.global_batch, args.microbatches = "tiny", 4, [2]
        args.steps, args.warmup, args.out = 1, 0, ""
    model = preset(args.model)
    if args.smoke:
        model = model.replace(layers=4)  # 2 ranks x 2 chunks
    cases = [(kind, SCHEDULES[kind], m) for m in args.microbatches for kind in args.schedules]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    load0, rev = os.getloadavg()[0], checkout_commit()  # the code measured: the commit at the start
    res = run_on_ranks(bench_job, ParallelConfig(pp=2), model, cases, args.global_batch, args.steps,
                       args.warmup)[0]
    rows = ["| schedule | v | m | minitron step, median (min) ms | torch.distributed.pipelining, median (min) ms "
            "| torch / minitron, paired median |",
            "|---|---|---|---|---|---|"]
    for r in res:
        rows.append(f"| {r['schedule']} | {r['v']} | {r['m']} | {1e3 * r['minitron_s']:.1f} "
                    f"({1e3 * r['minitron_min_s']:.1f}) | {1e3 * r['torch_s']:.1f} ({1e3 * r['torch_min_s']:.1f}) "
                    f"| {r['paired_ratio']:.2f} |")
    cpu = cpu_name()
    cmd = "python benchmarks/bench_pipeline.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = "\n".join([
        "# Pipeline runtime: minitron vs torch.distributed.pipelining",
        "",
        f"Command: `{cmd.strip()}`  ",
        f"Machine: {cpu}, {os.cpu_count()} cores (shared), torch {torch.__version__}, gloo, 2 ranks, "
        f"1 thread each; load average {load0:.1f} before, {os.getloadavg()[0]:.1f} after  ",
        f"Date: {datetime.date.today().isoformat()}, commit {rev}  ",
        f"Model: `{args.model}` ({model.layers} layers, h={model.hidden}, s={model.seq_len}), "
        f"global batch {args.global_batch}, float32",
        "",
        "A step is forward + backward of all m microbatches through the same GPT stage modules "
        "(no optimizer), the two engines alternating step by step; the ratio is the median over steps of "
        "each torch step's time over the minitron step just before it (> 1: minitron faster).",
        "",
        *rows,
        "",
    ])
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
