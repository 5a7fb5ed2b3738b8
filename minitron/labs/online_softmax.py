"""Lab 09: the online softmax that ring attention combines its blocks with (the engine's
``minitron.parallel.context_parallel.combine``).

Under context parallelism a rank's queries meet the keys and values block by block, as
they travel around the ring. Each block gives its attention output O_b, normalised
within the block, and the log-sum-exp L_b of each query's scores over the block. The
learner writes ``combine(out, lse, out_b, lse_b) -> (out, lse)``: the running pair (O, L)
merged with a block's, exactly, without ever forming the scores of the blocks seen
before: ``L' = log(e^L + e^{L_b})`` and ``O' = e^{L−L'}·O + e^{L_b−L'}·O_b``
(out [.., sq, d], lse [.., sq]).

Every rank ``exec``s the source (``torch`` is defined in it) and checks the function on
float64 blocks of one attention problem against full softmax attention:

1. two blocks combined give the attention over both (output and log-sum-exp; the value
   returned is a pair of the inputs' shapes);
2. three blocks folded in either order give full attention (the combination is exact
   and order-free);
3. scores around +1000 (log-sum-exps that overflow ``exp``) still give it, the two blocks
   merged in either order (one side's log-sum-exp hundreds above the other's): the
   rescaling must be by differences from L' = log(e^L + e^{L_b}), never by e^L itself nor
   relative to one side alone;
4. blocks of grouped-query attention, [b, kv, G, sq, d] (five dimensions, as the engine
   passes them when there are fewer key/value heads than query heads), give it too.

A wrong number is diagnosed against the usual mistakes (outputs added or averaged, the
log-sum-exps added or maxed, one maximum for all the queries, a rescaling relative to one
side alone, dimensions counted from the front, an input changed in place).
The ranks agree on the first problem found; otherwise the function is swapped into the
engine, a tiny GPT trains with ``--cp 2 --dp 2`` and then ``--cp 4`` (every rank combining
its ring's blocks with it: a query meets two blocks, then four) for 2 float64 steps each,
and rank 0 compares each run with the single-device model.

    result = check_online_softmax(SOURCE)   # {"ok", "message", "max_loss_abs_diff", ...}
"""
from __future__ import annotations

import itertools

import torch

from ..config import ParallelConfig, TrainConfig
from ..parallel import context_parallel, tensor
from ..parallel.context_parallel import block_attention
from .runner import (LAB_GPT, TOL, LabError, Tripwire, agree, call, comm_on, flags_of, layout_flags, load, run_sources, train_swapped,
                     training_verdict, verdict_over_runs)

MODEL = LAB_GPT
TRAIN = TrainConfig(steps=2, global_batch=2, dtype="float64", lr=1e-2, warmup=1, progress=False,
                    eval_every=0, sample_tokens=0)
NAME = "combine"
SCALE = 0.5
BLOCKS = ((0, 5), (5, 9), (9, 12))  # three blocks of 12 keys
_CASE = itertools.count()  # the case number in this launch: the same on every rank
# the notebook's ring of 2 (in 2 replicas), then a ring of 4: a combine right only for the pair a
# ring of 2 folds (one diagonal block and one full block) fails there
LAYOUTS = (ParallelConfig(cp=2, dp=2, device="cpu"), ParallelConfig(cp=4, device="cpu"))
# the engine's own version of the piece: not an answer to this lab
FORBIDDEN = ("minitron.parallel.context_parallel.combine",)
RULE = "L' = log(e^L + e^L_b) (torch.logaddexp) and O' = e^(L - L')·O + e^(L_b - L')·O_b"


def _close(a, b) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-10, atol=1e-10))


class _Problem:
    """Queries [2, 3, 6, 4] and 12 keys and values; `big` scales the scores to ~1000;
    `heads` = (kv, G) gives grouped-query blocks [2, kv, G, 6, 4] (the engine's layout when
    key/value heads are shared)."""

    def __init__(self, big: bool = False, heads: tuple = (3,)):
        g = torch.Generator().manual_seed(7)
        self.q = torch.randn(2, *heads, 6, 4, generator=g, dtype=torch.float64) * (60.0 if big else 1.0)
        self.k = torch.randn(2, *heads, 12, 4, generator=g, dtype=torch.float64) * (6.0 if big else 1.0)
        self.v = torch.randn(2, *heads, 12, 4, generator=g, dtype=torch.float64)

    def block(self, a: int, b: int):
        """(O_b, L_b) of keys [a, b): the engine's block attention, not the learner's."""
        return block_attention(self.q, self.k[..., a:b, :], self.v[..., a:b, :], SCALE, causal=False)

    def full(self, a: int = 0, b: int = 12):
        """Attention over keys [a, b) in one piece: (O, L)."""
        s = self.q @ self.k[..., a:b, :].transpose(-2, -1) * SCALE
        return torch.softmax(s, dim=-1) @ self.v[..., a:b, :], torch.logsumexp(s, dim=-1)


def _combine(fn, first, second):
    before = [t.clone() for t in (*first, *second)]
    out = call(f"your {NAME}", fn, *first, *second)
    for name, was, now in zip(("out", "lse", "out_b", "lse_b"), before, (*first, *second)):
        if not torch.equal(was, now):
            raise LabError(f"your {NAME} changed its input {name} in place: return new tensors (the engine "
                           f"still uses its inputs afterwards: autograd saved them, the ring passes blocks on)")
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
        raise LabError(f"your {NAME} returned {type(out).__name__}"
                       f"{'' if not isinstance(out, tuple) else f' of {len(out)}'}: return the pair (out, lse)")
    if out[0].shape != first[0].shape or out[1].shape != first[1].shape:
        raise LabError(f"your {NAME} returned out {list(out[0].shape)} and lse {list(out[1].shape)} for out "
                       f"{list(first[0].shape)} and lse {list(first[1].shape)}: return them in the same shapes")
    return out


def _diagnose(got, want, first, second) -> str:
    """What is wrong with a combination of two blocks, against the usual mistakes."""
    (o, l), (wo, wl) = got, want
    (o1, l1), (o2, l2) = first, second
    if not _close(l, wl):
        if _close(l, l1 + l2):
            return (f"your lse is the sum L + L_b: the log of a sum of exponentials is not the sum of the logs; "
                    f"{RULE}")
        if _close(l, torch.maximum(l1, l2)):
            return f"your lse is max(L, L_b), the larger block's alone: {RULE}"
        if not bool(torch.isfinite(l).all()):
            return f"your lse is not finite: {RULE}"
        return (f"your lse differs from the log-sum-exp over both blocks by {float((l - wl).abs().max()):.3g}: "
                f"{RULE}")
    if _close(o, o1 + o2):
        return (f"your out is O + O_b: each block's output is normalised within its block, so weight it by its "
                f"share of the total, {RULE}")
    if _close(o, (o1 + o2) / 2):
        return f"your out averages the two blocks equally: weight each by its share of the total, {RULE}"
    return (f"your out differs from attention over both blocks by {float((o - wo).abs().max()):.3g} (the lse is "
            f"right): {RULE}")


def _unit_check(fn) -> str:
    """'' when `fn` passes every unit check, else the first problem."""
    p = _Problem()
    b1, b2, b3 = (p.block(a, b) for a, b in BLOCKS)
    got, want = _combine(fn, b1, b2), p.full(0, 9)
    if not (_close(got[0], want[0]) and _close(got[1], want[1])):
        return _diagnose(got, want, b1, b2)
    full = p.full()
    for order, blocks in (("in order", (b1, b2, b3)), ("in reverse order", (b3, b2, b1))):
        acc = blocks[0]
        for blk in blocks[1:]:
            acc = _combine(fn, acc, blk)
        if not (_close(acc[0], full[0]) and _close(acc[1], full[1])):
            return (f"three blocks folded {order} differ from full attention by "
                    f"{float((acc[0] - full[0]).abs().max()):.3g}: the combination must be exact in any order, {RULE}")
    big = _Problem(big=True)
    early, late = big.block(*BLOCKS[0]), big.block(BLOCKS[1][0], BLOCKS[2][1])
    # both orders: the running L hundreds above the block's L_b, and below it (a one-sided
    # rescaling, e^(L_b - L) or e^(L - L_b), overflows in one of them)
    for first, second in ((early, late), (late, early)):
        got, want = _combine(fn, first, second), big.full()
        if not (_close(got[0], want[0]) and _close(got[1], want[1])):
            if bool(torch.isneginf(got[1]).any()) and bool(torch.isfinite(want[1]).all()):
                return (f"with scores around {float(first[1].max()):.0f} your lse is -inf for some queries: one "
                        f"maximum over all the queries (lse.max()) leaves e^(L - max) = 0 for those far below it; "
                        f"rescale each query by its own, e^(L - L'), with L' from torch.logaddexp")
            if not all(bool(torch.isfinite(t).all()) for t in got):
                return _non_finite(fn, got, first, second)
            return _diagnose(got, want, first, second)
    grouped = _Problem(heads=(2, 3))  # [b, kv, G, sq, d]: five dimensions
    b1, b2 = grouped.block(*BLOCKS[0]), grouped.block(BLOCKS[1][0], BLOCKS[2][1])
    try:
        got = _combine(fn, b1, b2)
    except LabError as e:
        return _FRONT if "size of tensor" in str(e) else str(e)
    want = grouped.full()
    if not (_close(got[0], want[0]) and _close(got[1], want[1])):
        return f"{_FRONT}: yours differs from attention over both blocks by {float((got[0] - want[0]).abs().max()):.3g}"
    return ""


_FRONT = (f"on grouped-query blocks out [b, kv, G, sq, d], lse [b, kv, G, sq] your {NAME} fails: it counts "
          "dimensions from the front (unsqueeze(3), [:, :, :, None]), which fits 4-D blocks only; count from the end, "
          "unsqueeze(-1)")


def _non_finite(fn, got, first, second) -> str:
    """Why `fn` gave inf or nan on log-sum-exps around +1000: e^L itself overflows (it also
    does when L and L_b are equal), or it rescales relative to one side alone (then only
    when the other side is hundreds above it)."""
    shift = float(first[1].max())
    o, l = first
    try:
        level = _combine(fn, (o, l.clone()), (o, l.clone()))  # L = L_b around +1000: only e^L overflows
    except LabError:
        level = (o, l)
    if not all(bool(torch.isfinite(t).all()) for t in level):
        return (f"with scores around {shift:.0f} your {NAME} gives inf or nan: e^L overflows; "
                f"rescale by differences, e^(L - L'), with L' from torch.logaddexp")
    bad = ~(torch.isfinite(got[1]) & torch.isfinite(got[0]).all(-1))  # the queries that overflowed
    gap = (second[1] - first[1])[bad] if bool(bad.any()) else second[1] - first[1]  # L_b - L there
    up = float(gap.flatten()[gap.abs().argmax()])
    side, other = ("L", "L_b") if up > 0 else ("L_b", "L")
    return (f"your {NAME} gives inf or nan when {other} exceeds {side} by {abs(up):.0f}: you rescale relative to "
            f"{side} alone (e^({other} - {side}) overflows past 709); rescale relative to "
            f"L' = torch.logaddexp(L, L_b), never below either side")


def _job(comm, source: str, timeout: float) -> dict | None:
    case = next(_CASE)
    watch = Tripwire({"minitron.parallel.context_parallel.combine": context_parallel.combine})
    try:
        with watch.armed():
            fn = load(source, (NAME,), {"torch": torch})[NAME]
            problem = _unit_check(fn)
    except LabError as e:  # the learner's code raised or returned a malformed value
        problem = str(e)
    agree(comm, f"online-softmax/{case}", problem, timeout)
    runs = []  # every rank trains every layout (they stay in step); rank 0 judges at the end
    for i, layout in enumerate(LAYOUTS):
        res = train_swapped(comm if i == 0 else comm_on(comm, layout), MODEL, layout,
                            TRAIN.replace(global_batch=TRAIN.global_batch * layout.dp), watch,
                            layers=tensor.layers(combine=fn))
        runs.append((layout_flags(layout), training_verdict(res, NAME, "", TOL)))
    if comm.grid.rank != 0:
        return None
    return verdict_over_runs(runs, f"your {NAME} trains exactly like the single-device model ({flags_of(runs)}: ring "
                                   f"attention)")


def check_online_softmax_all(sources: list[str], timeout: float = 60) -> list[dict]:
    """`check_online_softmax` for several sources, in as few launches as their outcomes allow."""
    return run_sources(_job, LAYOUTS[0], sources, timeout, timeout, forbidden=FORBIDDEN, names=(NAME,))


def check_online_softmax(source: str, timeout: float = 60) -> dict:
    """Lab 09: check the function `combine` defined in `source` against full softmax
    attention (two blocks, three in either order, scores around +1000 in either order,
    grouped-query blocks of five dimensions), then train a tiny GPT with it in place of the
    engine's on 4 gloo ranks, twice: ``--cp 2 --dp 2`` (two blocks a query meets), then
    ``--cp 4`` (four: the pair folded three times); float64, 2 steps each, against the
    single-device model. Returns {"ok", "message", "max_loss_abs_diff",
    "max_param_rel_diff"}, or {"ok": False, "message"} naming the first problem, also when
    the code does not compile, raises, returns something malformed or runs past `timeout`
    seconds."""
    return check_online_softmax_all([source], timeout)[0]
