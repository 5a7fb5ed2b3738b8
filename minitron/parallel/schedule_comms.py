"""Where a schedule's sends and receives go, given each rank's compute order.

A compute order is a list of *units*: runs of compute actions that share one comm batch
before them (the receives they need) and one after them (the sends they produce). Usually
a unit is one action; the builders (`parallel/schedules.py`) pair actions where batching
them differently keeps a blocking runtime from stalling or deadlocking. Two placements:

* `with_comms`, lockstep: a receive right before the unit that consumes it, a send right
  after the unit that produces it (Megatron's batched p2p calls);
* `with_timed_comms`, by the dataflow timeline: for orders whose neighbours do not move
  in lockstep (interleaving when p does not divide m, the V schedules).

Both are public: the labs lay out a learner's compute order with them, as the engine
lays out its own. `schedule_check.validate` proves the result executable.
"""
from __future__ import annotations

from typing import Mapping

from ..placement import Placement
from .schedule_actions import Action, ScheduleError, default_costs


def neighbour(pl: Placement, rank: int, a: Action, step: int):
    """The (rank, chunk) holding the stage `step` (+1 or -1) away from `a`'s, or None
    past either end of the model."""
    s = pl.stage(rank, a.chunk) + step
    return pl.locate(s) if 0 <= s < pl.num_stages else None


def with_comms(p: int, v: int, rank: int, units: list, pl: Placement | None = None) -> tuple[Action, ...]:
    """Rank `rank`'s actions: `units` (its compute order) with what a unit consumes
    received right before it and what it produces sent right after, on placement `pl`
    (Megatron's loop by default). Consecutive comms form one batch: e.g. the 1F1B steady
    state's [send_fwd, recv_bwd] is Megatron's send_forward_recv_backward. A neighbouring
    stage on the same rank (the V's turn on rank p-1) is handed over without a message."""
    pl, out = pl or Placement("loop", p, v), []
    for unit in units:
        recvs, sends = [], []
        for a in unit:
            if a.op not in ("F", "B"):
                continue
            up, down = neighbour(pl, rank, a, -1), neighbour(pl, rank, a, +1)
            src, dst = (up, down) if a.op == "F" else (down, up)
            d = "fwd" if a.op == "F" else "bwd"
            if src is not None and src[0] != rank:
                recvs.append(Action("recv_" + d, a.mb, a.chunk, src[0]))
            if dst is not None and dst[0] != rank:
                sends.append(Action("send_" + d, a.mb, a.chunk, dst[0]))
        out += recvs + list(unit) + sends
    return tuple(out)


def _producer(pl: Placement, r: int, a: Action):
    """The compute on a neighbouring stage whose output `a` consumes: (rank, op, mb, chunk)."""
    nb = neighbour(pl, r, a, -1 if a.op == "F" else +1) if a.op in ("F", "B") else None
    return None if nb is None else (nb[0], a.op, a.mb, nb[1])


def _dataflow_ends(pl: Placement, orders: list, costs: Mapping[str, float]) -> dict:
    """Start and end time of every compute unit's actions when each rank runs its order as
    soon as the tensors it consumes exist (communication free): {(rank, op, mb, chunk):
    (unit start, end, unit end)}. A unit's actions run back to back once all the
    tensors the unit consumes from other units exist."""
    p, times = pl.p, {}
    pc, clock, progress = [0] * p, [0.0] * p, True
    while progress:
        progress = False
        for r in range(p):
            while pc[r] < len(orders[r]):
                unit = orders[r][pc[r]]
                inside = {(r, a.op, a.mb, a.chunk) for a in unit}
                deps = [d for a in unit for d in [_producer(pl, r, a)] if d is not None and d not in inside]
                if any(d not in times for d in deps):
                    break
                start = max([clock[r], *(times[d][2] for d in deps)])  # sent when its unit ends
                t, ends = start, []
                for a in unit:
                    t += costs[a.op]
                    ends.append(((r, a.op, a.mb, a.chunk), t))
                for key, e in ends:
                    times[key] = (start, e, t)
                clock[r] = t
                pc[r] += 1
                progress = True
    if any(pc[r] < len(orders[r]) for r in range(p)):
        raise ScheduleError("the compute orders wait on each other: no timeline exists")
    return times


def with_timed_comms(kind: str, p: int, v: int, orders: list, pl: Placement | None = None) -> tuple:
    """Every rank's actions: `orders` (one compute order per rank) with comms placed by the
    dataflow timeline on placement `pl` (Megatron's loop by default), for orders whose
    neighbours do not move in lockstep (interleaving with microbatch groups larger than p,
    when p does not divide m; the V schedules). Time the compute orders with free communication and the
    default costs; each message then gets one instant, the first at which neither its
    sender nor its receiver is inside a compute unit, from its producer's unit end to
    its consumer's unit start. Both ranks place it there, and the comms of one instant
    form one batch. Batches meet in the same order on every rank, whatever the real
    costs: blocking sends cannot deadlock (`schedule_check.validate` proves it) and messages on a
    channel keep their order. (The lockstep placement of `with_comms` makes ranks wait
    here, or deadlock.)"""
    costs, pl = default_costs(kind), pl or Placement("loop", p, v)
    times = _dataflow_ends(pl, orders, costs)
    spans = [sorted({(t0, t1) for (r, *_), (t0, _, t1) in times.items() if r == q}) for q in range(pl.p)]

    def free(q, t):  # rank q is between compute units at time t
        return not any(t0 < t < t1 for t0, t1 in spans[q])

    def instant(src, dst, t_sent, t_used):
        times_ = sorted({t_sent, t_used, *(t for sp in spans[src] + spans[dst] for t in sp
                                           if t_sent < t < t_used)})
        return next((t for t in times_ if free(src, t) and free(dst, t)), t_sent)

    rows = []
    for r, units in enumerate(orders):
        events = []
        for a in with_comms(p, v, r, [(a,) for unit in units for a in unit], pl):
            key = (r, a.op, a.mb, a.chunk)
            if a.is_compute:  # a compute starting at t runs after the batch at t
                events.append(((times[key][1] - costs[a.op], 1), a))
                continue
            op = "F" if a.op.endswith("fwd") else "B"
            here, compute = (r, op, a.mb, a.chunk), Action(op, a.mb, a.chunk)
            if a.op.startswith("recv"):
                there = _producer(pl, r, compute)
            else:
                q, c = neighbour(pl, r, compute, +1 if op == "F" else -1)
                there = (q, op, a.mb, c)
            src, dst = (here, there) if a.op.startswith("send") else (there, here)
            t_sent, t_used = times[src][2], times[dst][0]
            msg = (src[0], dst[0], a.op[-3:], a.mb)  # the same on both ends of the message
            events.append(((instant(src[0], dst[0], t_sent, t_used), 0, *msg), a))
        rows.append(tuple(a for _, a in sorted(events, key=lambda e: e[0])))
    return tuple(rows)
