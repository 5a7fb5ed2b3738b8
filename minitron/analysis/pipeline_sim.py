"""A pipeline schedule timed: the cost simulator and the schedule's text report.

`simulate` runs a schedule (`parallel/schedules.make_schedule`) on the virtual clock of
`parallel/schedule_check.execute`, each compute action priced by its op (uniform costs by
default, or measured ones), communication free. From the timeline: the makespan, busy and
idle time per rank, the bubble fraction (PTD-P's t_pb/t_id) and the peak of stashed
microbatches; `analysis/bubble.py` holds the papers' closed forms it is checked against.
`describe` and `to_json` are what `minitron schedule` prints.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Union

from ..parallel.schedule_actions import Action, Schedule, default_costs
from ..parallel.schedule_check import execute

Costs = Union[Mapping[str, float], Callable[[int, Action], float], None]  # by op, per action, or the default


@dataclass(frozen=True)
class Simulation:
    """A schedule's simulated step: each rank's (action, start, end), and what they add up to."""
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
    for r, a, t0, t1 in execute(schedule, cost, eager):
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
    """The schedule, its bubble and peak stash as `minitron schedule --json` prints them."""
    sim = simulate(schedule) if sim is None else sim
    s = schedule
    return {"kind": s.kind, "p": s.p, "v": s.v, "m": s.m,
            "bubble_fraction": sim.bubble_fraction,
            "peak_stashed": list(sim.peak_stashed),
            "makespan": sim.makespan,
            "actions": [[str(a) for a in row] for row in s.actions]}
