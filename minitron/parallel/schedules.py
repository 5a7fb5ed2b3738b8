"""Pipeline schedules as data: the builders.

`make_schedule(kind, p, v, m)` is the one pure function that makes a schedule (the value:
`parallel/schedule_actions.py`). Each kind's generator gives a rank's compute order;
`parallel/schedule_comms.py` places the sends and receives; the runtime executes the
result, `parallel/schedule_check.validate` proves it executable, and
`analysis/pipeline_sim.simulate` times it.

Stages. With p ranks and v chunks per rank there are p*v virtual stages, and a
`Placement` says which one each (rank, local chunk) holds. Megatron's interleaved *loop*
puts stage s on rank s % p as local chunk s // p, so `stage(rank, chunk) = chunk*p + rank`
and activations flow s -> s+1: rank r sends forward to rank r+1, and rank p-1 sends chunk
c's output to rank 0's chunk c+1. The *V* placement of ZB-V and DualPipe-V (v = 2) gives
rank r the stages r and 2p-1-r: activations go down the ranks through chunk 0 and come
back up through chunk 1, the hand-over from stage p-1 to stage p stays on rank p-1 (no
message), and the first and the last stage (the loss) share rank 0.
"""
from __future__ import annotations

from collections import deque

from ..config import V_SCHEDULES, min_microbatches
from ..placement import PLACEMENTS, Placement, placement_for  # noqa: F401  (the schedule's placement)
from .schedule_actions import KINDS, Action, Schedule
from .schedule_comms import with_comms, with_timed_comms


# ----------------------------------------------------------------------------------
# generators. Each returns a rank's compute order as *units* (`schedule_comms`): usually
# one action; the pairs below are where batching them differently keeps a blocking
# runtime from stalling or deadlocking.


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
        actions = with_timed_comms(kind, p, v, orders, pl)
    elif kind == "interleaved" and v > 1 and m % p:  # timed action by action
        actions = with_timed_comms(kind, p, v, [[(a,) for u in units for a in u] for units in orders])
    else:
        actions = tuple(with_comms(p, v, r, units) for r, units in enumerate(orders))
    return Schedule(kind, p, v, m, actions, overlapped)
