"""Scaling runs: a series of layouts measured with the same engine, each measured row set
beside what a throughput model of *this* machine predicts for it.

A **series** is a list of layouts and a rule for the global batch:

* **weak scaling** keeps the work per rank fixed: the global batch grows with the number
  of ranks (``base_batch × world``), so every rank does the FLOPs of ``base_batch``
  sequences whatever the layout; ideal: the step time stays flat;
* **strong scaling** keeps the global batch fixed: ideal, the step time falls as 1/world.

Every point is a real run (``sweep_job`` on real ranks: warm-up, then the median step
time, one rank per core thread), with the bytes each axis sent in one step read from the
communication trace and the peak resident memory of the ranks.

The **machine profile** (:class:`MachineProfile`, ``minitron sweep --measure-machine``)
is what the prediction knows about the machine, all of it measured here, none of it
fitted to the sweep's own rows: the model FLOP/s of a one-rank training step of the
sweep's model (one thread), the number of cores, and for each collective a latency α and
a time per byte β fitted by least squares to timings, at several sizes, of the calls the
engine makes (plain ``torch.distributed``; the reduce-scatter as ``comm.reduce_scatter_single``
does it): the α–β model, ``t = α + β·bytes`` per call at a given group size.

The **prediction** of a point (:func:`predict_step`), for the slowest rank:

* compute: the rank's share of the model FLOPs at the measured one-rank rate, slowed by
  ``world / cores`` when there are more ranks than cores (they take turns on a core),
  stretched by the pipeline bubble ``(p − 1)/(v·m)`` when there is a pipeline;
* communication: every call the traced step made, priced with the α–β fit of its
  operation and group size (taken back to a core per rank where the group was measured
  with more ranks than cores), slowed by ``world / cores`` like the compute, never
  overlapped (gloo runs the collective on the caller's core, and there is no spare core
  to hide it on).
"""
from __future__ import annotations

import json
import os
import re
import resource
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from ..config import ConfigError, ModelConfig, ParallelConfig, TrainConfig

SERIES = ("weak", "strong")
# The local series of the scaling lesson: 1 -> 2 -> 4 -> 8 ranks; data, tensor, pipeline
# and one composed layout.
DEFAULT_LAYOUTS = ("dp1", "dp2", "tp2", "pp2", "dp4", "dp2.tp2.pp2")
PROFILE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "send")
PROFILE_SIZES = (1 << 10, 1 << 14, 1 << 17, 1 << 19)  # float32 elements per call


@dataclass(frozen=True)
class MachineProfile:
    """What the local throughput model knows about a machine (all measured, see module doc).

    ``links[op][n] = [alpha_s, seconds_per_byte]``: one call of ``op`` in a group of n
    ranks, bytes counted as the trace counts them (the caller's tensor).
    """

    name: str
    cores: int
    step_flops_per_s: float
    model: str
    links: dict = field(default_factory=dict)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)

    @staticmethod
    def load(path: str) -> "MachineProfile":
        """Read a profile written by ``save`` (ConfigError naming the file when it is not one)."""
        try:
            with open(path) as f:
                d = json.load(f)
            d["links"] = {op: {int(n): ab for n, ab in v.items()} for op, v in d["links"].items()}
            return MachineProfile(**d)
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise ConfigError(f"--machine {path}: not a machine profile ({e}); "
                              f"write one with `minitron sweep --measure-machine {path}`") from None

    def call_seconds(self, op: str, n: int, nbytes: int) -> float:
        """α + β·bytes for one call with a core per rank; a group size that was not measured
        takes the nearest one measured, scaled by the ring's steps ((n−1) of them, twice for
        all-reduce). A group measured with more ranks than cores ran oversubscribed: its fit
        is divided by that factor here, which :func:`predict_step` applies for the layout."""
        fits = self.links.get("send" if op in ("send", "recv") else op)
        if not fits:
            return 0.0
        near = min(fits, key=lambda k: (abs(k - n), k))
        alpha, beta = fits[near]
        scale = (n - 1) / (near - 1) if near > 1 and n > 1 else 1.0
        measured_oversubscribed = max(1.0, near / self.cores)
        return (scale * alpha + scale * (near / n if op != "send" else 1.0) * beta * nbytes) / measured_oversubscribed


def parse_layout(spec: str) -> ParallelConfig:
    """``dp2.tp2.pp2`` (any order, any subset; ``.v2`` interleaved chunks, ``.sp`` sequence
    parallelism, ``.3d`` the cube) -> ParallelConfig; ConfigError on anything else."""
    kw: dict = {"dp": 1, "tp": 1, "pp": 1}
    for part in spec.split("."):
        m = re.fullmatch(r"(dp|tp|pp|v)(\d+)", part)
        if m:
            kw["vpp" if m[1] == "v" else m[1]] = int(m[2])
        elif part == "sp":
            kw["sp"] = True
        elif part == "3d":
            kw["tp_mode"] = "3d"
        else:
            raise ConfigError(f"layout '{spec}': '{part}' is not dpN, tpN, ppN, vN, sp or 3d "
                              f"(e.g. dp2.tp2.pp2)")
    if kw.get("vpp", 1) > 1:
        kw["schedule"] = "interleaved"
    return ParallelConfig(**kw)


def point_config(model: ModelConfig, layout: ParallelConfig, series: str, base_batch: int,
                 steps: int, microbatches: int) -> TrainConfig:
    """The TrainConfig of one point of a series (see the module doc for weak and strong)."""
    if series not in SERIES:
        raise ConfigError(f"--series {series}: choose weak or strong")
    batch = base_batch * layout.world if series == "weak" else base_batch
    m = max(microbatches, layout.pp) if layout.pp > 1 else 1
    while (batch // layout.dp) % m:
        m += 1
    return TrainConfig(steps=steps, global_batch=batch, microbatches=m, eval_every=0, progress=False,
                       warmup=0)


# ---- the machine -------------------------------------------------------------------------

def _time_calls(fn, reps: int) -> float:
    import torch.distributed as dist

    fn()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    dist.barrier()
    return (time.perf_counter() - t0) / reps


def links_job(comm, sizes=PROFILE_SIZES, reps: int = 20) -> dict:
    """On every rank of one group: seconds per call of each collective as the engine makes
    it (float32) at each size; rank 0 fits ``t = α + β·bytes``."""
    import torch.distributed as dist

    from ..comm import reduce_scatter_single

    torch.set_num_threads(1)
    n, rank = dist.get_world_size(), dist.get_rank()
    out: dict = {}
    for op in PROFILE_OPS:
        xs, ts = [], []
        for size in sizes:
            x = torch.ones(size)
            if op == "all_reduce":
                fn = lambda: dist.all_reduce(x)  # noqa: E731
            elif op == "all_gather":
                buf = torch.empty(size * n)
                fn = lambda: dist.all_gather_single(buf, x)  # noqa: E731
            elif op == "reduce_scatter":
                big, part = torch.ones(size * n), torch.empty(size)
                fn = lambda: reduce_scatter_single(part, big)  # noqa: E731  (the engine's: see comm)
                x = big
            else:  # a ring of sends: each rank sends to the next, receives from the previous
                buf = torch.empty(size)
                fn = lambda: [w.wait() for w in dist.batch_isend_irecv(  # noqa: E731
                    [dist.P2POp(dist.isend, x, (rank + 1) % n), dist.P2POp(dist.irecv, buf, (rank - 1) % n)])]
            xs.append(x.numel() * x.element_size())
            ts.append(_time_calls(fn, reps))
        out[op] = _fit_line(xs, ts)
    return out if rank == 0 else None


def _fit_line(xs: list, ts: list) -> list:
    """Least squares t = a + b·x (a, b clipped at 0: a negative latency means noise)."""
    mx, mt = statistics.fmean(xs), statistics.fmean(ts)
    b = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / sum((x - mx) ** 2 for x in xs)
    return [max(0.0, mt - b * mx), max(0.0, b)]


def step_rate(model: ModelConfig, batch: int, steps: int = 4, corpus=None) -> float:
    """Model FLOP/s of a one-rank training step on one thread (median of `steps`)."""
    from ..analysis.flops import model_flops_per_iteration
    from ..train import Trainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tr = Trainer(model, ParallelConfig(), TrainConfig(steps=steps + 1, global_batch=batch,
                                                          eval_every=0, progress=False, warmup=0), corpus=corpus)
        tr.step(0)
        times = []
        for i in range(1, steps + 1):
            t0 = time.perf_counter()
            tr.step(i)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return model_flops_per_iteration(model, batch) / statistics.median(times)


def measure_machine(model: ModelConfig, batch: int, groups=(2, 4), name: str = "this machine",
                    corpus=None) -> MachineProfile:
    """Measure a :class:`MachineProfile`: the one-rank step rate of `model` at `batch`, and
    the α–β fit of each collective on gloo groups of each size in `groups`."""
    from .testing import run_on_ranks

    links: dict = {op: {} for op in PROFILE_OPS}
    for n in groups:
        fit = run_on_ranks(links_job, ParallelConfig(dp=n))[0]
        for op, ab in fit.items():
            links[op][n] = ab
    return MachineProfile(name=name, cores=os.cpu_count() or 1, step_flops_per_s=step_rate(model, batch, corpus=corpus),
                          model=model.name, links=links)


# ---- the prediction ----------------------------------------------------------------------

def predict_step(model: ModelConfig, layout: ParallelConfig, train: TrainConfig, machine: MachineProfile,
                 calls: list[dict]) -> dict:
    """Predicted step seconds of one point (see the module doc): compute, communication,
    bubble and their sum. `calls`: the slowest rank's traced calls of one step."""
    from ..analysis.bubble import bubble_fraction
    from ..analysis.flops import model_flops_per_iteration

    share = model_flops_per_iteration(model, train.global_batch) / layout.world
    oversubscribed = max(1.0, layout.world / machine.cores)
    compute = share / machine.step_flops_per_s * oversubscribed
    bubble = 0.0
    if layout.pp > 1:
        bubble = compute * bubble_fraction(layout.schedule, layout.pp, train.microbatches, layout.vpp)
    comm = sum(machine.call_seconds(c["op"], c["n"], c["bytes"]) for c in calls) * oversubscribed
    return {"compute_s": compute, "bubble_s": bubble, "comm_s": comm, "step_s": compute + bubble + comm}


def analysed_calls(model: ModelConfig, layout: ParallelConfig, train: TrainConfig) -> list[list[dict]]:
    """Each pipeline stage's calls of one step from the analysis (``comm_items``, which a traced
    step equals exactly), in the form :func:`predict_step` takes: op, bytes per call, group size."""
    from ..analysis.comm import comm_items
    from ..grid import ProcessGrid

    grid = ProcessGrid.for_layout(layout)
    stages = []
    for stage in range(layout.pp):
        calls = []
        for item in comm_items(model, layout, train, pp_rank=stage):
            if not item["calls"]:
                continue
            n = 2 if item["op"] in ("send", "recv") else grid.axis_size(item["axis"])
            calls += [{"op": item["op"], "axis": item["axis"], "bytes": item["bytes"] // item["calls"], "n": n}] * item["calls"]
        stages.append(calls)
    return stages


def plan_on_machine(model: ModelConfig, ranks: int, base_batch: int, machine: MachineProfile,
                    series: str = "weak", microbatches: int = 2) -> list[dict]:
    """Every data × tensor (1-D, with sequence parallelism) × pipeline layout of `ranks` ranks,
    predicted on a measured machine without running it (calls from the analysis), fastest
    first; layouts the engine would refuse are left out."""
    from ..config import validate

    rows = []
    for tp in (t for t in range(1, ranks + 1) if ranks % t == 0):
        for pp in (q for q in range(1, ranks // tp + 1) if (ranks // tp) % q == 0):
            layout = ParallelConfig(dp=ranks // (tp * pp), tp=tp, pp=pp, sp=tp > 1)
            train = point_config(model, layout, series, base_batch, 1, microbatches)
            try:
                validate(model, layout, train)
            except ConfigError:
                continue
            pred = max((predict_step(model, layout, train, machine, calls) for calls in
                        analysed_calls(model, layout, train)), key=lambda r: r["step_s"])
            rows.append({"layout": layout.describe(), "dp": layout.dp, "tp": tp, "pp": pp,
                         "global_batch": train.global_batch, "microbatches": train.microbatches, **pred,
                         "tokens_per_s": train.global_batch * model.seq_len / pred["step_s"]})
    return sorted(rows, key=lambda r: -r["tokens_per_s"])


# ---- one point ---------------------------------------------------------------------------

def sweep_job(comm, model, layout, train, corpus, extra) -> dict | None:
    """One point, on every rank: warm-up, timed steps (barrier around each), then one traced
    step; rank 0 returns the row (step time, tokens/s, MFU, bytes per axis, peak memory)."""
    import torch.distributed as dist

    from ..analysis.flops import model_flops_per_iteration
    from ..train import Trainer

    torch.set_num_threads(1)
    tr = Trainer(model, layout, train, comm, corpus)
    from ..comm import CommTrace

    comm, trace = tr.comm, tr.comm.trace or CommTrace()
    warmup, steps = extra.get("warmup", 2), extra.get("steps", 5)
    times = []
    with comm.tracing(None):  # time the steps without recording them
        for i in range(warmup + steps):
            comm.barrier()
            t0 = time.perf_counter()
            tr.step(i)
            comm.barrier()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    trace.records.clear()
    with comm.tracing(trace):
        tr.step(warmup + steps)
    # each call with its group's size (a send is between two ranks)
    calls = [{"op": c["op"], "axis": c["axis"], "bytes": c["bytes"],
              "n": 2 if c["op"] in ("send", "recv") else comm.size(c["axis"])}
             for c in trace.records]
    bytes_by_axis: dict = {}
    for c in calls:
        bytes_by_axis[c.get("axis", "?")] = bytes_by_axis.get(c.get("axis", "?"), 0) + c["bytes"]
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0], dtype=torch.float64)
    every_calls = [None] * comm.grid.world if comm.grid.world > 1 else [calls]
    if comm.grid.world > 1:
        dist.all_reduce(rss, op=dist.ReduceOp.MAX)
        dist.all_gather_object(every_calls, calls)
    if comm.grid.rank != 0:
        return None
    step_s = statistics.median(times)
    return {"layout": layout.describe(), "world": layout.world, "global_batch": train.global_batch,
            "microbatches": train.microbatches, "step_s": step_s,
            "tokens_per_s": train.global_batch * model.seq_len / step_s,
            "model_flops_per_s": model_flops_per_iteration(model, train.global_batch) / step_s,
            "bytes_per_axis": bytes_by_axis, "peak_rss_bytes": int(rss.item()),
            "calls_per_rank": every_calls}


def finish_row(row: dict, model: ModelConfig, layout: ParallelConfig, train: TrainConfig, series: str,
               machine: MachineProfile | None, one_rank_step_s: float | None) -> dict:
    """Add MFU (against the one-rank rate × world), efficiency vs one rank and the prediction
    (for the rank whose traced calls predict the longest step)."""
    calls = row.pop("calls_per_rank")
    row.update(series=series, model=model.name)
    if one_rank_step_s:
        ideal = one_rank_step_s if series == "weak" else one_rank_step_s / layout.world
        row["speedup"] = (one_rank_step_s * (layout.world if series == "weak" else 1)) / row["step_s"]
        row["efficiency"] = ideal / row["step_s"]
    if machine is not None:
        preds = [predict_step(model, layout, train, machine, c) for c in calls]
        pred = max(preds, key=lambda p: p["step_s"])
        row["mfu"] = row["model_flops_per_s"] / (machine.step_flops_per_s * min(layout.world, machine.cores))
        row["predicted"] = pred
        row["predicted_step_s"] = pred["step_s"]
        row["prediction_error"] = pred["step_s"] / row["step_s"] - 1
    return row
