"""Pipeline schedules as data.

A schedule is a pure value: for every pipeline rank, the ordered list of actions it
performs in one training step (a forward/backward of microbatch k on a model chunk,
or the send/receive of an activation or a gradient). The same value is executed by
the runtime, timed by `simulate`, proven executable by `validate` and drawn by `viz`.

Stages. With p ranks and v chunks per rank there are p*v virtual stages, and a
`Placement` says which one each (rank, local chunk) holds. Megatron's interleaved *loop*
puts stage s on rank s % p as local chunk s // p, so `stage(rank, chunk) = chunk*p + rank`
and activations flow s -> s+1: rank r sends forward to rank r+1, and rank p-1 sends chunk
c's output to rank 0's chunk c+1. The *V* placement of ZB-V and DualPipe-V (v = 2) gives
rank r the stages r and 2p-1-r: activations go down the ranks through chunk 0 and come
back up through chunk 1, the hand-over from stage p-1 to stage p stays on rank p-1 (no
message), and the first and the last stage (the loss) share rank 0.

Point-to-point contract between a schedule and the runtime (`validate` proves it):
  * A rank executes `Schedule.steps(rank)` in order. A step is a compute action or a
    batch: a maximal run of consecutive comm actions, posted in list order as one
    `torch.distributed.batch_isend_irecv` and waited on (all of it) before the next
    step. Tensors received in a batch are consumed by the compute that follows.
  * Messages between two ranks match in posting order (NCCL, and gloo with the
    default tag): the k-th send from r to q is the k-th receive on q from r. The
    schedule makes each such pair agree on direction, microbatch and stage.
  * It never deadlocks, whether a send completes only once its receive is posted
    (rendezvous: a batch finishes when every partner op has been posted) or at once
    (eager). So the runtime may block on every batch, and needs no tags or threads.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Mapping, Union

from ..config import SCHEDULES, V_SCHEDULES, min_microbatches
from ..placement import PLACEMENTS, Placement, placement_for  # noqa: F401  (the schedule's placement)

KINDS = SCHEDULES  # the schedule names, defined once in config
SPLIT_BACKWARD = ("zb-h1", *V_SCHEDULES)  # B is the input gradient, W the weight gradients
COMPUTE_OPS = ("F", "B", "W")
COMM_OPS = ("send_fwd", "recv_fwd", "send_bwd", "recv_bwd")


class ScheduleError(ValueError):
    """A schedule that cannot be executed (missing action, bad order, deadlock)."""


@dataclass(frozen=True)
class Action:
    """One thing a rank does: compute (F, B, W) or move a tensor (send/recv).

    `chunk` is always the *local* chunk on the rank that performs the action; for a
    send/recv it is the chunk that produced or will consume the tensor. `peer` is the
    pipeline rank at the other end of a send/recv, None for compute.
    In the split-backward kinds (zb-h1, zb-v, dualpipe-v) B is the input-gradient pass
    and W the weight-gradient pass; in the other kinds B is the full backward and there
    is no W.
    """
    op: str
    mb: int
    chunk: int = 0
    peer: int | None = None

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE_OPS

    def __str__(self) -> str:
        s = f"{self.op}{self.mb}.c{self.chunk}"
        if self.peer is None:
            return s
        return s + ("->" if self.op.startswith("send") else "<-") + str(self.peer)


Step = Union[Action, tuple]  # a compute Action, or a tuple of comm Actions (one batch)

@dataclass(frozen=True)
class Schedule:
    """`actions`: one ordered tuple per pipeline rank. `overlapped`: per rank, the
    (F, B) pairs that run as one overlapped F&B unit (DualPipe-V); on a GPU their compute
    and communication would overlap, on the CPU the runtime runs them one after the
    other and the pair is only a pairing in the schedule (the simulator prices it
    with an ``F&B`` cost when given)."""
    kind: str
    p: int
    v: int
    m: int
    actions: tuple[tuple[Action, ...], ...]  # one ordered tuple per pipeline rank
    overlapped: tuple[tuple[tuple[Action, Action], ...], ...] = ()

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    @cached_property
    def placement(self) -> Placement:
        return placement_for(self.kind, self.p, self.v)

    def stage(self, rank: int, chunk: int) -> int:
        return self.placement.stage(rank, chunk)

    def is_first(self, rank: int, chunk: int) -> bool:
        return self.placement.chunk_ends(rank, chunk)[0]

    def is_last(self, rank: int, chunk: int) -> bool:
        return self.placement.chunk_ends(rank, chunk)[1]

    def compute_actions(self, rank: int) -> tuple[Action, ...]:
        return tuple(a for a in self.actions[rank] if a.is_compute)

    def steps(self, rank: int) -> tuple[Step, ...]:
        """The rank's actions with each run of consecutive comm actions batched into a
        tuple: the runtime posts such a tuple as one batch_isend_irecv and waits."""
        out, batch = [], []
        for a in self.actions[rank]:
            if a.is_compute:
                if batch:
                    out.append(tuple(batch))
                    batch = []
                out.append(a)
            else:
                batch.append(a)
        if batch:
            out.append(tuple(batch))
        return tuple(out)


# ----------------------------------------------------------------------------------
# generators. Each returns a rank's compute order as *units*: runs of compute actions
# that share one comm batch before them (the receives they need) and one after them
# (the sends they produce). Usually a unit is one action; the pairs below are where
# batching them differently keeps a blocking runtime from stalling or deadlocking.


def _one_f_one_b(fwd: list, bwd: list, warmup: int, pair: bool = False) -> list:
    """Warm-up forwards, then one forward and one backward at a time (steady state),
    then the remaining backwards (cool-down): at most warmup+1 microbatches stashed.
    With `pair` each steady (F, B) is one unit, as Megatron's interleaved schedule
    batches send_forward_backward_recv_forward_backward."""
    n = len(fwd)
    steady = [(fwd[warmup + i], bwd[i]) for i in range(n - warmup)]
    if not pair:
        steady = [(a,) for fb in steady for a in fb]
    return [(f,) for f in fwd[:warmup]] + steady + [(b,) for b in bwd[n - warmup:]]


def interleaved_groups(p: int, m: int) -> list[int]:
    """Sizes of the microbatch groups that interleaving runs through chunk 0, chunk 1, ...
    before moving to the next group (Megatron-Core's `microbatch_group_size_per_vp_stage`;
    torch.distributed.pipelining's rounds).

    There are m // p groups (rounds) of sizes as equal as possible, larger ones first:
    [p, p, ...] when p divides m (PTD-P's original schedule), [6] for m=6, p=4, [5, 4]
    for m=9. Every group holds at least p microbatches, so a chunk's output is back on
    rank 0 (after its trip through the p ranks) by the time the group moves on to the
    next chunk: no dependency bubble. No group is larger than the first, which sets the
    warm-up (`num_warmup`): a larger later group would need its last chunk's backward
    before the last rank's warm-up had produced the forward it needs."""
    rounds = max(m // p, 1)
    q, extra = divmod(m, rounds)
    return [q + 1] * extra + [q] * (rounds - extra)


def num_warmup(kind: str, p: int, v: int, m: int, rank: int) -> int:
    """Forwards rank r runs before its steady state (PTD-P §2.2): all m in GPipe;
    p-r-1 in 1F1B and ZB-H1, the forwards still in flight downstream when the first
    gradient could come back; (p-r-1)*2 + (v-1)*g in interleaved, with g the first
    microbatch group's size (`interleaved_groups`; g = p when p divides m),
    where the (v-1)*g forwards fill the other chunks of the first group of
    microbatches and each downstream rank adds 2: the activation's trip to the last
    stage and the gradient's trip back. Interleaved with v = 1 is 1F1B.
    Capped at the m*v forwards there are."""
    if kind == "interleaved" and v == 1:
        kind = "1f1b"
    n = {"gpipe": m, "1f1b": p - rank - 1, "zb-h1": p - rank - 1,
         "interleaved": (p - rank - 1) * 2 + (v - 1) * interleaved_groups(p, m)[0]}[kind]
    return min(n, m * v)


def _gpipe(p, v, m, rank):
    """GPipe: all forwards, then all backwards. Stashes all m microbatches."""
    return [(Action(op, i),) for op in "FB" for i in range(m)]


def _1f1b(p, v, m, rank):
    """PipeDream-Flush (PTD-P §2.2.1): after min(p-r-1, m) warm-up forwards rank r's
    first backward is due as soon as its gradient could arrive. Same bubble as
    GPipe, (p-1)/m, but at most p microbatches stashed instead of m."""
    fwd = [Action("F", i) for i in range(m)]
    bwd = [Action("B", i) for i in range(m)]
    return _one_f_one_b(fwd, bwd, num_warmup("1f1b", p, v, m, rank))


def interleaved_order(p: int, v: int, m: int) -> list[tuple[int, int]]:
    """The (microbatch, chunk) order of interleaved forwards, the same on every rank:
    each group of `interleaved_groups` goes through chunk 0, then chunk 1, ...
    E.g. p=2, v=2, m=5 (groups [3, 2]): (0,0) (1,0) (2,0) (0,1) (1,1) (2,1) (3,0) (4,0)
    (3,1) (4,1). Backwards take the same order with chunk c mirrored to v-1-c."""
    order, start = [], 0
    for g in interleaved_groups(p, m):
        order += [(start + i, c) for c in range(v) for i in range(g)]
        start += g
    return order


def _interleaved(p, v, m, rank):
    """Interleaved 1F1B (PTD-P §2.2.2): each rank holds v chunks and runs microbatches
    in groups (of p when p divides m; see `interleaved_groups`) through chunk 0, then
    chunk 1, ...; backwards mirror that order.
    The bubble shrinks to (p-1)/(v*m) for v times more p2p messages; the warm-up is
    longer (see `num_warmup`). Steady (F, B) pairs share their comm batches:
    receiving the next gradient before the next forward is what lets rank p-1 accept
    a gradient from rank 0 (chunk c+1 -> c) without a blocking send deadlocking.
    With one chunk per rank (v = 1) it is 1F1B, action for action."""
    if v == 1:
        return _1f1b(p, v, m, rank)
    order = interleaved_order(p, v, m)
    fwd = [Action("F", i, c) for i, c in order]
    bwd = [Action("B", i, v - 1 - c) for i, c in order]
    return _one_f_one_b(fwd, bwd, num_warmup("interleaved", p, v, m, rank), pair=True)


def _zb_h1(p, v, m, rank):
    """ZB-H1 (Qi et al. 2024): split the backward into B (input gradient, on the
    critical path) and W (weight gradient, needed only by the optimizer). F and B
    keep the 1F1B order, so peak memory is 1F1B's; rank r defers r of its W's past
    its last B, where they fill the cool-down waits, and the bubble becomes
    (p-1)(T_F+T_B-T_W): a third of 1F1B's when T_F=T_B=T_W.
    In the steady state the upstream rank is ready for a gradient one W after it is
    produced, so a blocking send would idle that long: (B, W) is one unit and the
    gradient leaves after the W. The last steady B sends at once: its receiver is
    already in cool-down, waiting."""
    last_steady = m - num_warmup("zb-h1", p, v, m, rank) - 1
    units = []
    for (a,) in _1f1b(p, v, m, rank):
        if a.op == "B" and a.mb >= rank:
            w = Action("W", a.mb - rank)
            units += [(a, w)] if a.mb < last_steady else [(a,), (w,)]
        else:
            units.append((a,))
    return units + [(Action("W", i),) for i in range(max(m - rank, 0), m)]


def _zb_v(p, v, m, rank):
    """ZB-V (Qi et al., the V-shaped zero-bubble schedule): V placement, backward split
    into B and W. Rank r first runs chunk-0 forwards until the first microbatch has come
    back through chunk 1: 2(p-r)-1 of them, then r (F1, F0) pairs; then p-r times
    (F1, B1, W1) as chunk 1's first gradients arrive; the steady state repeats
    (F0, B0, W0, F1, B1, W1); the cool-down runs the last r (B0, B1) with their W's
    deferred, then p-r (B0, W) and the remaining W's fill the drain. Per rank at most 2p
    chunk-microbatches are in flight (p stages' worth of layers, 1F1B's memory), and with
    T_F = T_B = T_W the only idle time left is the fill: the last rank's first forward
    starts p-1 chunk-forwards late (see `v_bubble`). Needs m >= p."""
    n = {"F": [0, 0], "B": [0, 0], "W": [0, 0]}
    units = []

    def run(op, c):
        units.append((Action(op, n[op][c], c),))
        n[op][c] += 1

    def f(c):
        if n["F"][c] < m:
            run("F", c)

    for _ in range(2 * (p - rank) - 1):
        f(0)
    for _ in range(rank):
        f(1)
        f(0)
    for _ in range(p - rank):
        f(1)
        run("B", 1)
        run("W", 1)
    while n["F"][1] < m:
        f(0)
        for c in (0, 1):
            if c == 1:
                f(1)
            run("B", c)
            run("W", c)
    for _ in range(rank):
        run("B", 0)
        run("B", 1)
    for _ in range(p - rank):
        run("B", 0)
        run("W", 0)
    for c in (1, 0):
        while n["W"][c] < m:
            run("W", c)
    return units


def _dualpipe_v(p, v, m, rank):
    """DualPipe-V (DeepSeek-V3's DualPipe cut in half, the V form of its schedule): V
    placement, and in the steady state each forward of one chunk is paired with the full
    backward (B, then W) of the other chunk of another microbatch: one F&B unit. On a GPU
    the two halves overlap, the forward's compute hiding the backward's communication
    (DeepSeek-V3 §3.2.1). On the CPU the runtime runs the unit's actions one after the
    other; the overlap is only a pairing in the schedule (`Schedule.overlapped`), which
    the simulator prices with an ``F&B`` cost. The eight phases of rank r (p ranks, m
    microbatches):

    1. 2(p-r-1) chunk-0 forwards;  2. r+1 times (F0, F1);
    3. p-r-1 times (B1, W1, F1): zero-bubble backwards fill the wait for gradients;
    4. m-2p+r+1 times (F0 & B1, F1 & B0): the steady state, all overlapped
       (rank p-1's first F0, B1 run apart: nothing to overlap with yet);
    5. p-r-1 times (B1, F1 & B0);  6. r+1 times (B1, B0), the second half with W deferred;
    7. p-r-1 times (W, B0) with W deferred;  8. the r+1 W's left.

    Needs m >= 2p (`config.min_microbatches`)."""
    n = {"F": [0, 0], "B": [0, 0]}
    units, deferred, pairs = [], deque(), []

    def fwd(c):
        n["F"][c] += 1
        return Action("F", n["F"][c] - 1, c)

    def bwd(c, split=False):  # split: W deferred (zero bubble), else the full backward
        n["B"][c] += 1
        b, w = Action("B", n["B"][c] - 1, c), Action("W", n["B"][c] - 1, c)
        if split:
            deferred.append(w)
            return (b,)
        return (b, w)

    def pair(cf, cb):
        f, bw = fwd(cf), bwd(cb)
        pairs.append((f, bw[0]))
        units.append((f, *bw))

    for _ in range(2 * (p - rank - 1)):
        units.append((fwd(0),))
    for _ in range(rank + 1):
        units += [(fwd(0),), (fwd(1),)]
    for _ in range(p - rank - 1):
        units += [bwd(1, split=True), (deferred.popleft(),), (fwd(1),)]
    for i in range(m - 2 * p + rank + 1):
        if i == 0 and rank == p - 1:
            units += [(fwd(0),), bwd(1)]
        else:
            pair(0, 1)
        pair(1, 0)
    for _ in range(p - rank - 1):
        units.append(bwd(1))
        pair(1, 0)
    split, steps = False, rank + 1
    for i in range(steps):
        split = split or (i == steps // 2 and rank % 2 == 1)
        units.append(bwd(1, split))
        split = split or (i == steps // 2 and rank % 2 == 0)
        units.append(bwd(0, split))
    for _ in range(p - rank - 1):
        units += [(deferred.popleft(),), bwd(0, split=True)]
    units += [(w,) for w in deferred]
    return units, pairs


_ORDERS = {"gpipe": _gpipe, "1f1b": _1f1b, "interleaved": _interleaved, "zb-h1": _zb_h1,
           "zb-v": _zb_v, "dualpipe-v": _dualpipe_v}


def _neighbour(pl: Placement, rank: int, a: Action, step: int):
    """The (rank, chunk) holding the stage `step` (+1 or -1) away from `a`'s, or None
    past either end of the model."""
    s = pl.stage(rank, a.chunk) + step
    return pl.locate(s) if 0 <= s < pl.num_stages else None


def _with_comms(p: int, v: int, rank: int, units: list, pl: Placement | None = None) -> tuple[Action, ...]:
    """(`pl`: the placement, Megatron's loop by default.) Receive what a unit consumes right before it, send what it produces right after.
    Consecutive comms form one batch: e.g. the 1F1B steady state's
    [send_fwd, recv_bwd] is Megatron's send_forward_recv_backward. A neighbouring stage
    on the same rank (the V's turn on rank p-1) is handed over without a message."""
    pl, out = pl or Placement("loop", p, v), []
    for unit in units:
        recvs, sends = [], []
        for a in unit:
            if a.op not in ("F", "B"):
                continue
            up, down = _neighbour(pl, rank, a, -1), _neighbour(pl, rank, a, +1)
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
    nb = _neighbour(pl, r, a, -1 if a.op == "F" else +1) if a.op in ("F", "B") else None
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


def _with_timed_comms(kind: str, p: int, v: int, m: int, orders: list, pl: Placement | None = None) -> tuple:
    """(`pl`: the placement, Megatron's loop by default.) Comms placed by the dataflow timeline, for orders whose neighbours do not move in
    lockstep (interleaving with microbatch groups larger than p, when p does not
    divide m; the V schedules). Time the compute orders with free communication and the
    default costs; each message then gets one instant, the first at which neither its
    sender nor its receiver is inside a compute unit, from its producer's unit end to
    its consumer's unit start. Both ranks place it there, and the comms of one instant
    form one batch. Batches meet in the same order on every rank, whatever the real
    costs: blocking sends cannot deadlock (`validate` proves it) and messages on a
    channel keep their order. (The lockstep placement of `_with_comms` makes ranks wait
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
        for a in _with_comms(p, v, r, [(a,) for unit in units for a in unit], pl):
            key = (r, a.op, a.mb, a.chunk)
            if a.is_compute:  # a compute starting at t runs after the batch at t
                events.append(((times[key][1] - costs[a.op], 1), a))
                continue
            op = "F" if a.op.endswith("fwd") else "B"
            here, compute = (r, op, a.mb, a.chunk), Action(op, a.mb, a.chunk)
            if a.op.startswith("recv"):
                there = _producer(pl, r, compute)
            else:
                q, c = _neighbour(pl, r, compute, +1 if op == "F" else -1)
                there = (q, op, a.mb, c)
            src, dst = (here, there) if a.op.startswith("send") else (there, here)
            t_sent, t_used = times[src][2], times[dst][0]
            msg = (src[0], dst[0], a.op[-3:], a.mb)  # the same on both ends of the message
            events.append(((instant(src[0], dst[0], t_sent, t_used), 0, *msg), a))
        rows.append(tuple(a for _, a in sorted(events, key=lambda e: e[0])))
    return tuple(rows)


def make_schedule(kind: str, p: int, v: int = 1, m: int | None = None) -> Schedule:
    """The schedule of one training step: p pipeline ranks, v chunks per rank,
    m microbatches (default p, the fewest that fill the pipeline). Interleaving takes
    any m >= p (`interleaved_groups`); with v = 1 it is 1F1B."""
    m = (min_microbatches(kind, p) if kind in V_SCHEDULES else p) if m is None else m
    if kind not in _ORDERS:
        raise ValueError(f"unknown schedule {kind!r}; choose one of {', '.join(KINDS)}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"schedule needs p, v, m >= 1, got p={p}, v={v}, m={m}")
    if kind in V_SCHEDULES:
        if v != 2 or p < 2:
            raise ValueError(f"{kind} places two chunks per rank in a V (stages r and 2p-1-r) on "
                             f"p >= 2 ranks, got p={p}, v={v}; use v=2 (--vpp 2)")
        least = min_microbatches(kind, p)
        if m < least:
            raise ValueError(f"{kind} needs at least {least} microbatches on p={p} ranks, got m={m}; "
                             f"use m >= {least}")
    elif kind == "interleaved" and v > 1:
        if p < 2:
            raise ValueError(f"interleaved with v={v} chunks needs p >= 2 pipeline ranks, "
                             f"got p={p}; use v=1 or more ranks")
        if m < p:
            raise ValueError(f"interleaved needs at least p={p} microbatches, got m={m}; "
                             f"use m >= {p}, or 1f1b")
    elif v != 1:
        raise ValueError(f"{kind} has one chunk per rank (v=1), got v={v}; "
                         "use interleaved for v > 1")
    pl, overlapped = placement_for(kind, p, v), ()
    orders = [_ORDERS[kind](p, v, m, r) for r in range(p)]
    if kind == "dualpipe-v":
        overlapped = tuple(tuple(pairs) for _, pairs in orders)
        orders = [units for units, _ in orders]
    if kind in V_SCHEDULES:
        actions = _with_timed_comms(kind, p, v, m, orders, pl)
    elif kind == "interleaved" and v > 1 and m % p:  # timed action by action
        actions = _with_timed_comms(kind, p, v, m, [[(a,) for u in units for a in u] for units in orders])
    else:
        actions = tuple(_with_comms(p, v, r, units) for r, units in enumerate(orders))
    return Schedule(kind, p, v, m, actions, overlapped)


# ----------------------------------------------------------------------------------
# validation


def _expected_actions(s: Schedule) -> Counter:
    """Every (rank, action) a complete schedule of this shape contains exactly once."""
    ops = "FBW" if s.kind in SPLIT_BACKWARD else "FB"
    units = [(Action(op, i, c),) for c in range(s.v) for i in range(s.m) for op in ops]
    return Counter((r, str(a)) for r in range(s.p)
                   for a in _with_comms(s.p, s.v, r, units, s.placement))


def _check_complete(s: Schedule) -> None:
    if len(s.actions) != s.p:
        raise ScheduleError(f"schedule has {len(s.actions)} ranks, expected p={s.p}")
    have = Counter((r, str(a)) for r in range(s.p) for a in s.actions[r])
    want = _expected_actions(s)
    for problem, diff in (("unexpected or repeated", have - want),
                          ("missing", want - have)):
        if diff:
            r, a = min(diff)
            raise ScheduleError(f"rank {r}: {problem} {a}")


def _check_order(s: Schedule) -> None:
    """Within a rank: a tensor is received (or, from a stage on the same rank, computed)
    before it is used, produced before it is sent, and the forward precedes B which
    precedes W."""
    needs = {"send_fwd": "F", "B": "F", "send_bwd": "B", "W": "B"}
    for r in range(s.p):
        seen = set()
        for a in s.actions[r]:
            key = (a.mb, a.chunk)
            reqs = [(needs.get(a.op), a.chunk)]
            if a.op in ("F", "B"):  # the tensor from the neighbouring stage
                nb = _neighbour(s.placement, r, a, -1 if a.op == "F" else +1)
                if nb is not None:
                    reqs.append(("recv_" + ("fwd" if a.op == "F" else "bwd"), a.chunk) if nb[0] != r
                                else (a.op, nb[1]))
            for req, c in reqs:
                if req is not None and (req, (a.mb, c)) not in seen:
                    raise ScheduleError(f"rank {r}: {a} runs before "
                                        f"{req}{a.mb}.c{c}")
            seen.add((a.op, key))


def _matches(s: Schedule, src: int, send: Action, dst: int, recv: Action) -> bool:
    step = 1 if send.op == "send_fwd" else -1
    return (recv.op == "recv" + send.op[4:] and recv.mb == send.mb
            and s.stage(dst, recv.chunk) == s.stage(src, send.chunk) + step)


def _execute(s: Schedule, cost: Callable[[int, Action], float], eager: bool):
    """Run the schedule on a virtual clock; returns (rank, action, start, end) for
    every compute action. Each rank walks its `steps`; a comm batch is posted at the
    rank's clock and finishes when all its ops have: a send once its receive is posted
    (or at once when `eager`), a receive once its send is posted. Messages on a
    (src, dst) channel match in FIFO order. Raises ScheduleError on deadlock."""
    steps = [s.steps(r) for r in range(s.p)]
    pc, clock = [0] * s.p, [0.0] * s.p
    posted = [None] * s.p             # per rank: [(op, channel, index, post time)]
    chan = {}                          # (src, dst) -> {"send": [...], "recv": [...]}
    timeline = []

    def post(r, a):
        src, dst = (r, a.peer) if a.op.startswith("send") else (a.peer, r)
        side = "send" if a.op.startswith("send") else "recv"
        q = chan.setdefault((src, dst), {"send": [], "recv": []})[side]
        q.append((a, clock[r]))
        return (a, (src, dst), len(q) - 1, clock[r])

    def done_at(r, a, ch, k, t):
        side, other = ("send", "recv") if a.op.startswith("send") else ("recv", "send")
        q = chan[ch][other]
        if len(q) <= k:
            return t if eager and side == "send" else None
        (b, tb) = q[k]
        send, recv = (a, b) if side == "send" else (b, a)
        if not _matches(s, ch[0], send, ch[1], recv):
            raise ScheduleError(f"ranks {ch[0]}->{ch[1]}: {send} on rank {ch[0]} "
                                f"meets {recv} on rank {ch[1]}")
        return t if eager and side == "send" else max(t, tb)

    progress = True
    while progress:
        progress = False
        for r in range(s.p):
            while pc[r] < len(steps[r]):
                step = steps[r][pc[r]]
                if isinstance(step, Action):
                    t0 = clock[r]
                    clock[r] += cost(r, step)
                    timeline.append((r, step, t0, clock[r]))
                else:
                    if posted[r] is None:
                        posted[r] = [post(r, a) for a in step]
                    ends = [done_at(r, *op) for op in posted[r]]
                    if None in ends:
                        break
                    clock[r], posted[r] = max([clock[r], *ends]), None
                pc[r] += 1
                progress = True

    stuck = [r for r in range(s.p) if pc[r] < len(steps[r])]
    if stuck:
        mode = "eager" if eager else "blocking"
        waits = "; ".join(f"rank {r} at [{', '.join(map(str, steps[r][pc[r]]))}]"
                          for r in stuck)
        raise ScheduleError(f"deadlock with {mode} sends: {waits}")
    for (src, dst), q in chan.items():
        if len(q["send"]) != len(q["recv"]):
            raise ScheduleError(f"ranks {src}->{dst}: {len(q['send'])} sends but "
                                f"{len(q['recv'])} receives")
    return timeline


def validate(schedule: Schedule) -> Schedule:
    """Prove the schedule executable, or raise ScheduleError saying why: every stage
    runs F and B (and W for the split-backward kinds) once per microbatch, each rank's order respects its
    data dependencies, every send meets its receive, and the whole pipeline finishes
    with blocking (rendezvous, batched) and with eager point-to-point semantics."""
    s = schedule
    if s.kind not in KINDS:
        raise ScheduleError(f"unknown schedule kind {s.kind!r}")
    _check_complete(s)
    _check_order(s)
    for eager in (False, True):
        _execute(s, lambda r, a: 1.0, eager)
    return s


# ----------------------------------------------------------------------------------
# simulation

Costs = Union[Mapping[str, float], Callable[[int, Action], float], None]


def default_costs(kind: str) -> dict[str, float]:
    """Uniform costs: backward twice the forward; the split-backward kinds (zb-h1, zb-v,
    dualpipe-v) split it into B=W=1."""
    return {"F": 1, "B": 1, "W": 1} if kind in SPLIT_BACKWARD else {"F": 1, "B": 2, "W": 0}


@dataclass(frozen=True)
class Simulation:
    schedule: Schedule
    timeline: tuple[tuple[tuple[Action, float, float], ...], ...]  # per rank
    makespan: float
    busy: tuple[float, ...]
    idle: tuple[float, ...]
    bubble_fraction: float
    peak_stashed: tuple[int, ...]

    def records(self) -> list[dict]:
        """The timeline as the runtime's measured `--timeline` records."""
        return [{"rank": r, "op": a.op, "mb": a.mb, "chunk": a.chunk,
                 "start": t0, "end": t1}
                for r, row in enumerate(self.timeline) for a, t0, t1 in row]


def peak_stashed(schedule: Schedule, rank: int) -> int:
    """Most microbatch-chunks whose forward ran and whose B has not: 1F1B's rank 0
    holds min(p, m), GPipe's m. A chunk holds 1/v of a rank's layers: interleaved
    rank 0 holds up to p*v + p - 1 chunks, p*(1 + (p-1)/(p*v)) stages' worth
    (Korthikanti et al.). In zb-h1 a layer's input stays alive until W; like
    Qi et al. we count activations only up to B, which frees the bulk of them."""
    live = peak = 0
    for a in schedule.compute_actions(rank):
        live += {"F": 1, "B": -1}.get(a.op, 0)
        peak = max(peak, live)
    return peak


def _overlap_priced(schedule: Schedule, costs: Mapping[str, float]) -> Callable[[int, Action], float]:
    """Costs by op; with an ``F&B`` cost, each overlapped unit (a forward, and the full
    backward B + W it is paired with: `Schedule.overlapped`) takes ``F&B`` in all, each
    action its share in proportion to its own cost. No comm batch lies inside a unit,
    so on the timeline the unit is one block of length F&B."""
    plain = lambda r, a: costs.get(a.op, 0.0)  # noqa: E731
    if "F&B" not in costs or not schedule.overlapped:
        return plain
    alone = costs.get("F", 0.0) + costs.get("B", 0.0) + costs.get("W", 0.0)
    scale = costs["F&B"] / alone
    paired = {(r, a) for r, pairs in enumerate(schedule.overlapped) for f, b in pairs
              for a in (f, b, Action("W", b.mb, b.chunk))}
    return lambda r, a: plain(r, a) * (scale if (r, a) in paired else 1.0)


def simulate(schedule: Schedule, costs: Costs = None, eager: bool = False
             ) -> Simulation:
    """Time the schedule: each compute action costs `costs[op]` (or `costs(rank,
    action)` for measured times), communication is free. P2p follows the runtime:
    a batch waits until its partners have posted (`eager=True`: sends never wait).
    With the default costs both give the ideal dataflow timeline, so
    bubble_fraction = (makespan - busy) / busy of the busiest rank, PTD-P's t_pb/t_id,
    is exactly (p-1)/m for gpipe and 1f1b, (p-1)/(v*m) for interleaved (per-chunk
    costs F=1, B=2) and (p-1)/(3m) for zb-h1 when m >= p; zb-v idles (p-1)·F per rank
    (m >= 2p-1) and dualpipe-v 2(p-1)·F, DeepSeek-V3's (PP/2-1)(F&B+B-3W) with PP = 2p,
    F&B = F+B+W and B the full backward (the V kinds' default costs F = B = W = 1)."""
    costs = default_costs(schedule.kind) if costs is None else costs
    cost = costs if callable(costs) else _overlap_priced(schedule, costs)
    rows = [[] for _ in range(schedule.p)]
    for r, a, t0, t1 in _execute(schedule, cost, eager):
        rows[r].append((a, t0, t1))
    makespan = max((t1 for row in rows for _, _, t1 in row), default=0.0)
    busy = tuple(sum(t1 - t0 for _, t0, t1 in row) for row in rows)
    top = max(busy)
    return Simulation(
        schedule=schedule,
        timeline=tuple(tuple(row) for row in rows),
        makespan=makespan,
        busy=busy,
        idle=tuple(makespan - b for b in busy),
        bubble_fraction=(makespan - top) / top if top else 0.0,
        peak_stashed=tuple(peak_stashed(schedule, r) for r in range(schedule.p)),
    )


# ----------------------------------------------------------------------------------
# reporting


def _short(s: Schedule, a: Action) -> str:
    return str(a) if s.v > 1 else f"{a.op}{a.mb}"


def _row(s: Schedule, rank: int) -> list[str]:
    """A rank's compute actions, an overlapped F&B pair written as one: F3.c0&B1.c1."""
    paired = dict(s.overlapped[rank]) if s.overlapped else {}
    partners = set(paired.values())
    return [_short(s, a) + (f"&{_short(s, paired[a])}" if a in paired else "")
            for a in s.compute_actions(rank) if a not in partners]


def describe(schedule: Schedule, sim: Simulation | None = None) -> str:
    """One line per rank with its compute actions (DualPipe-V's overlapped pairs as F&B),
    then the bubble and peak stash."""
    sim = simulate(schedule) if sim is None else sim
    s = schedule
    lines = [f"{s.kind} p={s.p} v={s.v} m={s.m}"]
    lines += [f"rank {r}: " + " ".join(_row(s, r)) for r in range(s.p)]
    lines.append(f"bubble fraction {sim.bubble_fraction:.4f}, "
                 f"peak stashed per rank {list(sim.peak_stashed)}")
    return "\n".join(lines)


def to_json(schedule: Schedule, sim: Simulation | None = None) -> dict:
    sim = simulate(schedule) if sim is None else sim
    s = schedule
    return {"kind": s.kind, "p": s.p, "v": s.v, "m": s.m,
            "bubble_fraction": sim.bubble_fraction,
            "peak_stashed": list(sim.peak_stashed),
            "makespan": sim.makespan,
            "actions": [[str(a) for a in row] for row in s.actions]}
