"""What lesson 0 runs on its ranks: the collectives one by one, a ring all-reduce written
with send/recv through the engine's communication door (so that every step is traced),
timings of plain ``torch.distributed`` calls, and the α–β cost model fitted to them.

Launch the job with :func:`minitron.tools.testing.run_on_ranks`::

    out = run_on_ranks(collectives_job, ParallelConfig(dp=2, tp=2), SIZES, 5, trace=True)

The α–β model: a message of n bytes between two ranks costs ``α + n/β`` (α the latency
of one step, β the bandwidth). A ring all-reduce over p ranks takes ``2(p − 1)`` steps,
each moving ``n/p`` bytes, so it costs ``2(p − 1)·α + 2(p − 1)/p · n/β``; an all-gather
or a reduce-scatter of a total of n bytes is half of that.
"""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

# message sizes (bytes) the lesson times: 1 KiB to 4 MiB
SIZES = [2 ** k for k in range(10, 23, 2)]


def _steps(op: str, p: int) -> tuple[float, float]:
    """(latency steps, bandwidth factor) of a ring `op` over p ranks."""
    if op == "all_reduce":
        return 2 * (p - 1), 2 * (p - 1) / p
    if op in ("all_gather", "reduce_scatter"):
        return p - 1, (p - 1) / p
    if op == "send":
        return 1, 1.0
    raise ValueError(f"unknown op {op!r}: use all_reduce, all_gather, reduce_scatter or send")


def alpha_beta_time(op: str, nbytes: float, p: int, alpha: float, beta: float) -> float:
    """Seconds the α–β model gives for a ring `op` of `nbytes` (the whole buffer: the
    all-reduce's tensor, the all-gather's output, the reduce-scatter's input) over p
    ranks, with latency `alpha` (s) and bandwidth `beta` (bytes/s)."""
    steps, factor = _steps(op, p)
    return steps * alpha + factor * nbytes / beta


def fit_alpha_beta(op: str, sizes, seconds, p: int) -> tuple[float, float]:
    """Least-squares fit of the α–β model to measured times of a ring `op`:
    returns (alpha in s, beta in bytes/s)."""
    steps, factor = _steps(op, p)
    slope, intercept = np.polyfit(np.asarray(sizes, float), np.asarray(seconds, float), 1)
    return max(intercept, 0.0) / steps, factor / slope


def _bits(x: float) -> list[int]:
    """The ranks whose value 2**rank was summed into `x`."""
    v = int(round(x))
    return [r for r in range(v.bit_length()) if v >> r & 1]


def ring_all_reduce(comm, x: torch.Tensor, axis: str = "world") -> tuple[torch.Tensor, list]:
    """Sum `x` over the ranks of `axis` with the ring algorithm, written with send/recv
    through `comm` (each message is traced, labelled with its phase, step and chunk).

    Returns the result and, after every step, the chunks this rank holds (a list of
    per-step lists of chunk tensors). `x` is cut into p chunks along dim 0."""
    p, r = comm.size(axis), comm.index(axis)
    chunks = [c.clone() for c in x.chunk(p)]
    nxt, prv = (r + 1) % p, (r - 1) % p
    history = []
    for phase in ("reduce-scatter", "all-gather"):
        for s in range(p - 1):
            if phase == "reduce-scatter":
                send_c, recv_c = (r - s) % p, (r - s - 1) % p
            else:
                send_c, recv_c = (r + 1 - s) % p, (r - s) % p
            buf = torch.empty_like(chunks[recv_c])
            labels = dict(phase=phase, ring_step=s)
            works = comm.p2p([("send", chunks[send_c], nxt, {**labels, "chunk": send_c}),
                              ("recv", buf, prv, {**labels, "chunk": recv_c})], axis=axis)
            for w in works:
                w.wait()
            chunks[recv_c] = chunks[recv_c] + buf if phase == "reduce-scatter" else buf
            history.append(dict(phase=phase, step=s, chunks=[c.clone() for c in chunks]))
    return torch.cat(chunks), history


def _timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def collectives_job(comm, sizes=SIZES, repeats: int = 5) -> dict:
    """Lesson 0's work on one rank (run it with ``run_on_ranks(..., trace=True)``).

    Returns a dict with: ``tour`` (each collective's input and output on this rank),
    ``ring`` (the chunks after every step of a ring all-reduce of 2**rank, and whether it
    equals ``dist.all_reduce``), ``ring_records`` (the trace of the ring's messages),
    ``times`` (seconds of each repeat of a plain all_reduce / all_gather of each size),
    and ``door`` (the engine's calls on the tp and dp axes, and their trace records)."""
    rank, p = dist.get_rank(), dist.get_world_size()
    out = {"rank": rank, "world": p, "tour": _tour(rank, p)}
    out["ring"], out["ring_records"] = _traced_ring(comm, rank, p)
    out["times"] = _timings(sizes, repeats, p)
    out["door"] = _door(comm, rank)
    return out


def _tour(rank: int, p: int) -> dict:
    """1. The collectives, one by one, on tiny tensors: {name: (this rank's input, its output)}."""
    tour = {}
    x = torch.tensor([float(rank + 1)])
    y = x.clone()
    dist.all_reduce(y)
    tour["all_reduce"] = (x.tolist(), y.tolist())
    x = torch.tensor([10.0 * rank + c for c in range(p)])
    y = torch.empty(1)
    dist.reduce_scatter_single(y, x)
    tour["reduce_scatter"] = (x.tolist(), y.tolist())
    x = torch.tensor([float(rank + 1)])
    y = torch.empty(p)
    dist.all_gather_single(y, x)
    tour["all_gather"] = (x.tolist(), y.tolist())
    x = torch.tensor([float(rank + 1)])
    y = x.clone()
    dist.broadcast(y, src=2 % p)
    tour["broadcast"] = (x.tolist(), y.tolist())
    x = torch.tensor([float(rank + 1)])
    y = torch.empty(1)
    reqs = [dist.isend(x, (rank + 1) % p), dist.irecv(y, (rank - 1) % p)]
    for q in reqs:
        q.wait()
    tour["send_recv"] = (x.tolist(), y.tolist())
    return tour


def _traced_ring(comm, rank: int, p: int) -> tuple[dict, list]:
    """2. A ring all-reduce of 2**rank through the engine's door, traced: (the chunks each
    rank holds after every step and whether the result equals ``dist.all_reduce``, the
    trace records of its messages)."""
    n_before = len(comm.trace.records) if comm.trace is not None else 0
    x = torch.full((p,), 2.0 ** rank)
    result, history = ring_all_reduce(comm, x, "world")
    ref = x.clone()
    dist.all_reduce(ref)
    ring = dict(equal=bool(torch.equal(result, ref)), result=result.tolist(),
                steps=[dict(phase=h["phase"], step=h["step"],
                            holds=[_bits(float(c[0])) for c in h["chunks"]]) for h in history])
    return ring, (comm.trace.records[n_before:] if comm.trace is not None else [])


def _timings(sizes, repeats: int, p: int) -> dict:
    """3. Timings of plain torch.distributed calls: {op: {bytes: [seconds of each repeat]}}."""
    times = {"all_reduce": {}, "all_gather": {}}
    for n in sizes:
        t = torch.ones(n // 4)
        times["all_reduce"][n] = _timed(lambda: dist.all_reduce(t), repeats)
        shard, full = torch.ones(n // 4 // p), torch.empty(n // 4 // p * p)
        times["all_gather"][n] = _timed(lambda: dist.all_gather_single(full, shard), repeats)
    return times


def _door(comm, rank: int) -> dict:
    """4. The engine's door: the same calls by axis name, traced."""
    n_before = len(comm.trace.records) if comm.trace is not None else 0
    v = torch.tensor([float(rank + 1)])
    door = {"coords": vars(comm.grid.coord()),
            "tp_group": comm.grid.axis_ranks("tp"), "dp_group": comm.grid.axis_ranks("dp"),
            "tp_sum": comm.all_reduce(v.clone(), "tp").tolist(),
            "dp_gather": comm.all_gather(v.clone(), "dp").tolist(),
            "pp_sum": comm.all_reduce(v.clone(), "pp").tolist()}
    door["records"] = comm.trace.records[n_before:] if comm.trace is not None else []
    return door


def best_over_repeats(results: dict, op: str) -> tuple[list[int], list[float]]:
    """(sizes, seconds): for each size, the fastest repeat of the slowest rank's time (a
    collective is done when its last rank is; the fastest repeat is the one least
    disturbed by other processes on the machine)."""
    ranks = sorted(results)
    sizes = sorted(results[ranks[0]]["times"][op])
    secs = []
    for n in sizes:
        per_rep = zip(*(results[r]["times"][op][n] for r in ranks))
        secs.append(min(max(t) for t in per_rep))
    return sizes, secs
