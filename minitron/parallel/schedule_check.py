"""Proof that a schedule can run: symbolic execution on a virtual clock.

`validate` checks the point-to-point contract of `parallel/schedule_actions.py` without a
process: every stage runs F and B (and W for the split-backward kinds) once per
microbatch, each rank's order respects its data dependencies, every send meets its
receive, and the whole pipeline finishes under blocking (rendezvous) and eager sends.
`execute` is the virtual clock itself; the simulator (`analysis/pipeline_sim.py`) times a
schedule with it under real or uniform costs.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable

from .schedule_actions import KINDS, SPLIT_BACKWARD, Action, Schedule, ScheduleError
from .schedule_comms import neighbour, with_comms


def _expected_actions(s: Schedule) -> Counter:
    """Every (rank, action) a complete schedule of this shape contains exactly once."""
    ops = "FBW" if s.kind in SPLIT_BACKWARD else "FB"
    units = [(Action(op, i, c),) for c in range(s.v) for i in range(s.m) for op in ops]
    return Counter((r, str(a)) for r in range(s.p)
                   for a in with_comms(s.p, s.v, r, units, s.placement))


def _check_complete(s: Schedule) -> None:
    """One row per rank, and each rank's actions exactly the expected ones, each once."""
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
                nb = neighbour(s.placement, r, a, -1 if a.op == "F" else +1)
                if nb is not None:
                    reqs.append(("recv_" + ("fwd" if a.op == "F" else "bwd"), a.chunk) if nb[0] != r
                                else (a.op, nb[1]))
            for req, c in reqs:
                if req is not None and (req, (a.mb, c)) not in seen:
                    raise ScheduleError(f"rank {r}: {a} runs before "
                                        f"{req}{a.mb}.c{c}")
            seen.add((a.op, key))


def _matches(s: Schedule, src: int, send: Action, dst: int, recv: Action) -> bool:
    """Whether `send` on rank `src` and `recv` on rank `dst` carry the same tensor."""
    step = 1 if send.op == "send_fwd" else -1
    return (recv.op == "recv" + send.op[4:] and recv.mb == send.mb
            and s.stage(dst, recv.chunk) == s.stage(src, send.chunk) + step)


def execute(s: Schedule, cost: Callable[[int, Action], float], eager: bool):
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
        execute(s, lambda r, a: 1.0, eager)
    return s
