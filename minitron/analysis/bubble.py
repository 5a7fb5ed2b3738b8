"""The pipeline bubble and the activations a schedule keeps in flight, in closed form.

With p stages and m microbatches per iteration, every schedule that flushes the
pipeline at the end of an iteration leaves each stage idle while the pipeline fills
and drains. The *bubble fraction* is that idle time divided by the ideal compute time
``m·(T_F + T_B + T_W)`` of a stage (PTD-P §2.2):

================  =====================================================  ==============
schedule          bubble fraction                                        peak in flight
================  =====================================================  ==============
gpipe             (p−1)/m                                                m
1f1b              (p−1)/m             (PipeDream-Flush: same bubble)     min(p, m)
interleaved       (p−1)/(v·m)         (v model chunks per rank)          p·(1+(p−1)/(p·v))
zb-h1             (p−1)(T_F+T_B−T_W) / (m(T_F+T_B+T_W))  (Qi et al. 2024) min(p, m)
zb-v              (p−1)·T_F/2 / (m(T_F+T_B+T_W))  (T_F = T_B = T_W)      min(m+1, 2p)/2
dualpipe-v        (p−1)(T_F&B+T_B−2T_W)/2 / (m(T_F+T_B+T_W))             (2p+1)/2
================  =====================================================  ==============

The V schedules (rank r holds stages r and 2p−1−r, two chunks of half a rank's layers
each, so a chunk's F, B, W take half of the stage times T_F, T_B, T_W): ZB-V (Qi et al.)
is built for T_F = T_B = T_W; then its only idle time is the fill, the last rank's first
chunk-forward starting p−1 chunk-forwards late: (p−1)·T_F/2, a sixth of 1F1B's
(p−1)(T_F+T_B+T_W) (the simulator reproduces it exactly for every m ≥ 2p−1; other costs:
simulate the schedule). DualPipe-V (DeepSeek-V3's table, with PP = 2p stages, chunk times
F, B = full backward, W, and F&B an overlapped forward-and-backward pair):
(PP/2−1)(F&B + B − 3W) = (p−1)(T_F&B + T_B + T_W − 3T_W)/2, where T_F&B defaults to
T_F + T_B + T_W, the pair run one after the other as on the CPU (then the formula is
exact under T_F = T_B = T_W). Its stash is PP + 1 = 2p + 1 chunk-microbatches on every rank,
ZB-V's 2p on the middle ranks: 1F1B's memory in stage units, DualPipe-V half a stage more.

For zero-bubble, T_B is the backward for the *input* gradient and T_W the backward for
the *weight* gradient; deferring W fills part of the drain, so with T_F = T_B = T_W the
bubble is a third of 1F1B's at the same peak memory. For the other schedules the
backward is one step of T_B + T_W and the bubble does not depend on the timings.

"Peak in flight" is the largest number of microbatches whose forward activations the
first stage (the worst one) stashes at once, counted in units of one full stage
(all of its chunks). For interleaving it follows from Megatron's warm-up of
``(p−r−1)·2 + (v−1)·p`` chunk-forwards on rank r plus the one forward of the steady
state, each holding 1/v of a stage: on rank 0 that is ``(v·p + p − 1)/v``
= ``p·(1 + (p−1)/(p·v))``, the factor of Korthikanti et al. (2022, §4.2.3, where the
interleaving degree is called m). When p does not divide m, microbatches go through the
chunks in m // p groups of at least p (`first_group`): the bubble stays (p−1)/(v·m) and
the warm-up holds the larger first group g in place of p.
"""
from __future__ import annotations

from ..config import SCHEDULES, V_SCHEDULES

__all__ = ["SCHEDULES", "bubble_fraction", "bubble_time", "first_group", "ideal_bubble", "peak_stashed_microbatches",
           "stashed_on_rank", "v_bubble"]


def _check(kind: str, p: int, m: int, v: int) -> None:
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule '{kind}': choose one of {', '.join(SCHEDULES)}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"p, m and v must be at least 1 (got p={p}, m={m}, v={v})")


def bubble_fraction(kind: str, p: int, m: int, v: int = 1, t_f: float = 1.0, t_b: float = 2.0,
                    t_w: float = 0.0) -> float:
    """Idle time of a stage over its ideal compute time, for one iteration.

    gpipe, 1f1b: ``(p−1)/m``; interleaved: ``(p−1)/(v·m)`` (PTD-P §2.2.2; for any
    m ≥ p with eager sends, see `minitron.parallel.schedules.interleaved_groups`);
    zb-h1: ``(p−1)·(T_F + T_B − T_W) / (m·(T_F + T_B + T_W))`` (Qi et al. 2024, with
    `t_b` the input-gradient and `t_w` the weight-gradient part of the backward; the
    defaults T_W = 0 give back 1F1B's bubble).
    """
    _check(kind, p, m, v)
    if kind == "interleaved":
        return (p - 1) / (v * m)
    if kind == "zb-h1":
        return (p - 1) * (t_f + t_b - t_w) / (m * (t_f + t_b + t_w))
    if kind in V_SCHEDULES:
        return v_bubble(kind, p, t_f, t_b, t_w) / (m * (t_f + t_b + t_w))
    return (p - 1) / m


# The bubble on an ideal machine as the report and the schedule command state it: a backward
# twice the forward, split into equal halves B and W where the schedule splits it (Qi et al.'s
# T_F = T_B = T_W), so the fraction depends on p, v and m only.
IDEAL_BUBBLE = {"gpipe": "(p-1)/m", "1f1b": "(p-1)/m", "interleaved": "(p-1)/(v*m)", "zb-h1": "(p-1)/(3*m)",
                "zb-v": "(p-1)/(6*m)", "dualpipe-v": "(p-1)/(3*m)"}


def ideal_bubble(kind: str, p: int, m: int, v: int = 1) -> tuple[float, str]:
    """(bubble fraction, its formula in p, v, m) of `kind` on an ideal machine: the backward
    twice the forward, T_B = T_W = T_F where the schedule splits it (zb-h1 and the V
    schedules; their paper's assumption), one T_B = 2T_F step otherwise."""
    split = kind == "zb-h1" or kind in V_SCHEDULES
    costs = (1.0, 1.0, 1.0) if split else (1.0, 2.0, 0.0)
    return bubble_fraction(kind, p, m, v, *costs), IDEAL_BUBBLE[kind]


def v_bubble(kind: str, p: int, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0,
             t_fb: float | None = None) -> float:
    """Idle time per rank of one iteration of a V schedule on p ranks, from the times of a
    whole stage (a rank's layers; each chunk takes half): ZB-V ``(p−1)·t_f/2`` (Qi et al.:
    exact when t_f = t_b = t_w, the costs it is built for); DualPipe-V DeepSeek-V3's
    ``(PP/2−1)(F&B + B − 3W)`` with PP = 2p stages, B the full backward:
    ``(p−1)(t_fb + t_b + t_w − 3·t_w)/2``, `t_fb` the overlapped pair of a forward and a full
    backward (default t_f + t_b + t_w: no overlap, as the CPU runs it). The same
    microbatch-independent idle for every m the schedule takes (m ≥ 2p − 1 for ZB-V)."""
    if kind == "zb-v":
        return (p - 1) * t_f / 2
    if kind == "dualpipe-v":
        fb = t_f + t_b + t_w if t_fb is None else t_fb
        return (p - 1) * (fb + t_b + t_w - 3 * t_w) / 2
    raise ValueError(f"{kind!r} is not a V schedule: choose one of {', '.join(V_SCHEDULES)}")


def bubble_time(kind: str, p: int, m: int, v: int = 1, t_f: float = 1.0, t_b: float = 2.0,
                t_w: float = 0.0) -> float:
    """The idle time itself: `bubble_fraction` × ``m·(t_f + t_b + t_w)`` (per-microbatch
    times of a whole stage). The planner's price of a schedule's bubble, for every kind."""
    return bubble_fraction(kind, p, m, v, t_f, t_b, t_w) * m * (t_f + t_b + t_w)


def stashed_on_rank(kind: str, p: int, m: int, v: int = 1, rank: int = 0) -> float:
    """Peak microbatches of forward activations held by pipeline rank `rank`, in units
    of one full stage (for interleaving: chunk-microbatches divided by v).

    gpipe m; 1f1b and zb-h1 ``min(p − r, m)``; zb-v ``min(m + 1 + r, 2p)/2``; dualpipe-v
    ``(2p + 1)/2`` (DeepSeek-V3's PP + 1 with PP = 2p stages); interleaved
    ``min((p−r−1)·2 + (v−1)·g + 1, v·m) / v`` with g the first microbatch group
    (`first_group`: p when p divides m).
    """
    _check(kind, p, m, v)
    if not 0 <= rank < p:
        raise ValueError(f"pipeline rank {rank} outside 0..{p - 1}")
    if kind == "gpipe":
        return float(m)
    if kind == "zb-v":  # chunk-microbatches, half a stage each
        return min(m + 1 + rank, 2 * p) / 2
    if kind == "dualpipe-v":
        return (2 * p + 1) / 2
    if kind == "interleaved" and v > 1:
        return min((p - rank - 1) * 2 + (v - 1) * first_group(p, m) + 1, v * m) / v
    return float(min(p - rank, m))


def first_group(p: int, m: int) -> int:
    """Microbatches in interleaving's first group: p when p divides m; otherwise the
    m // p groups (rounds) share m as evenly as possible, larger first (Megatron-Core's
    microbatch_group_size_per_vp_stage, PyTorch's rounds), so ``ceil(m / (m // p))``."""
    rounds = max(m // p, 1)
    return -(-m // rounds)


def peak_stashed_microbatches(kind: str, p: int, m: int, v: int = 1) -> float:
    """Peak microbatches of stashed activations over all stages (the first stage's).

    gpipe ``m``; 1f1b, zb-h1 ``min(p, m)``; interleaved ``min(v·g + 2p − g − 1, v·m)/v``
    (= p·(1 + (p−1)/(p·v)) when p divides m, g = p), in units of one full stage.
    """
    return max(stashed_on_rank(kind, p, m, v, r) for r in range(p))
