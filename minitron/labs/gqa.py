"""Lab 10a: the tensor-parallel attention with grouped key/value heads (the engine's
``minitron.parallel.tensor.block_rows`` and the gradient sum of ``ShardInfo.grad_sync``).

Grouped-query attention has ``kv`` key/value heads, each read by G = heads/kv query heads.
Under 1-D tensor parallelism rank r of t holds heads/t query heads and must hold the *whole*
key/value heads they read. The learner writes two functions:

* ``kv_rows(kv_heads, head_rows, t, r) -> (start, stop)``: the rows of the key/value weight
  ``[kv_heads·head_rows, h]`` (kv-head-major, ``head_rows`` = 2·d rows per head: its k and v)
  that rank r holds: kv/t whole heads when kv ≥ t (split), else kv head ``r // (t/kv)``,
  replicated on the t/kv neighbouring ranks that hold its query heads;
* ``sum_kv_grad(grad, comm, kv_heads, t) -> grad``: the gradient of this rank's copy once the
  copies' contributions are summed (each copy saw only its own queries): nothing when
  kv ≥ t, else one all-reduce over the t/kv ranks sharing the copy (axis ``tp_kv{t/kv}``,
  or ``tp`` when they are the whole tensor group).

Every rank ``exec``s the source and checks, armed with a :class:`~.runner.Tripwire` (the
engine's own pieces refused whatever the route):

1. ``kv_rows`` over every (kv, t) with kv | t or t | kv up to 16, several head sizes, every
   rank: the usual mistakes named (part of a head when kv < t, replicas interleaved
   ``r % kv`` instead of neighbouring, rows counted in heads);
2. ``sum_kv_grad`` on the 4 ranks as t = 4 and again as t = 2 (``--tp 2 --dp 2``), kv = 1,
   2, 4 each, with a gradient that differs per rank: the value against the sum over the
   copies (no sum, a mean, the whole tensor group, a t hard-wired to 4 named) and its calls
   from the trace (exactly one all-reduce on the copies' axis, copies grouped by the wrong
   factor named; none when split).

The ranks agree on the first problem found; otherwise both are swapped into the engine (a
layer namespace whose column-parallel linear takes its key/value rows from ``kv_rows`` and
whose weight's backward runs ``sum_kv_grad``; nothing is patched) and a small Llama trains
for 2 float64 steps under ``--tp 4`` with kv = 1 and 2 (replicated on 4 and on 2 ranks) and
``--tp 2 --dp 2`` with kv = 4 (split, two heads a rank), each against the single-device model (1e-9).

    result = check_gqa(SOURCE)   # {"ok", "message", "max_loss_abs_diff", "max_param_rel_diff"}
"""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from .. import optim
from ..config import ParallelConfig
from ..context import make_param
from ..parallel import tensor
from .runner import (TOL, LAB_LLAMA, TWO_FLOAT64_STEPS, LabError, Tripwire, agree, call, comm_on, describe_calls, load,
                     run_sources, traced, train_swapped, training_verdict, verdict_over_runs)

NAMES = ("kv_rows", "sum_kv_grad")
MODEL = LAB_LLAMA.replace(name="lab-gqa")
TRAIN = TWO_FLOAT64_STEPS
WORLD = 4
# (tp, kv heads) trained on the 4 ranks: one head replicated on all, each on a pair, two per rank (tp2 x dp2)
RUNS = ((4, 1), (4, 2), (2, 4))
FORBIDDEN = ("minitron.parallel.tensor.block_rows", "minitron.parallel.tensor.kv_share_axis",
             "minitron.parallel.tensor.ColumnParallelLinear", "minitron.optim.sync_replicated_grads",
             "minitron.analysis.context_parallel.kv_heads_per_rank", "minitron.labs.gqa")
_CASE = itertools.count()  # the case number in this launch: the same on every rank
RULE_ROWS = ("kv ≥ t: rank r holds heads r·kv/t .. (r+1)·kv/t − 1; kv < t: head r // (t/kv), on its t/kv "
             "neighbouring ranks; rows = heads × head_rows")


def _watch() -> Tripwire:
    """Armed only while the learner's code runs: the engine's pieces and the checker's answer."""
    return Tripwire({"minitron.parallel.tensor.block_rows": tensor.block_rows,
                     "minitron.parallel.tensor.kv_share_axis": tensor.kv_share_axis,
                     "minitron.optim.sync_replicated_grads": optim.sync_replicated_grads,
                     "minitron.labs.gqa": _rows, "minitron.labs.gqa.share": share, "minitron.labs.gqa.axis": _axis})


def _learner(watch: Tripwire, what: str, fn, *args):
    """`fn(*args)` of the learner's, watched (the engine's own piece refused, whatever the route)."""
    with watch.armed():
        return call(what, fn, *args)


def share(kv_heads: int, t: int) -> int:
    """Ranks holding one copy of a kv head: t/kv when kv < t, else 1."""
    return t // kv_heads if kv_heads < t else 1


def _rows(kv_heads: int, head_rows: int, t: int, r: int) -> tuple[int, int]:
    """The rows rank r holds (the checker's own answer, as the engine's block_rows)."""
    if kv_heads >= t:
        n = kv_heads // t
        return r * n * head_rows, (r + 1) * n * head_rows
    head = r // (t // kv_heads)
    return head * head_rows, (head + 1) * head_rows


def _axis(kv_heads: int, t: int) -> str:
    n = share(kv_heads, t)
    return "tp" if n == t else f"tp_kv{n}"


# --- 1. the rows ---------------------------------------------------------------------------------
def _as_rows(got, kv, head_rows, t, r) -> tuple[int, int]:
    if not (isinstance(got, (tuple, list)) and len(got) == 2
            and all(isinstance(x, int) or (isinstance(x, torch.Tensor) and x.numel() == 1) for x in got)):
        raise LabError(f"your kv_rows(kv_heads={kv}, head_rows={head_rows}, t={t}, r={r}) returned {got!r}: "
                       f"return the pair (start, stop) of row numbers")
    return int(got[0]), int(got[1])


def _diagnose_rows(got, kv, head_rows, t, r) -> str:
    want = _rows(kv, head_rows, t, r)
    where = f"kv_rows(kv_heads={kv}, head_rows={head_rows}, t={t}, r={r}) gave rows {got[0]}..{got[1]}"
    n_rows = kv * head_rows
    if kv < t and got == (r * n_rows // t, (r + 1) * n_rows // t):
        return (f"your {where}: {n_rows // t} rows, part of a kv head. Every query head reads all d dimensions "
                f"of its kv head, so a rank holds whole heads: with kv < t, copy kv head r // (t/kv) onto the t/kv "
                f"ranks of its query heads")
    if kv < t and got == ((r % kv) * head_rows, (r % kv + 1) * head_rows) and r % kv != r // (t // kv):
        return (f"your {where}: kv head {r % kv}, but rank {r}'s query heads read kv head {r // (t // kv)} "
                f"(query head i reads kv head i // G, and rank r holds query heads r·heads/t ..): the copies of a "
                f"kv head sit on neighbouring ranks, head r // (t/kv)")
    if kv >= t and got == (r * kv // t, (r + 1) * kv // t):
        return f"your {where}: that counts heads, not rows: a kv head is head_rows rows ({head_rows})"
    if got[1] - got[0] != want[1] - want[0]:
        return (f"your {where}: {got[1] - got[0]} rows, but a rank holds {max(1, kv // t)} whole kv head(s) of "
                f"{head_rows} rows ({RULE_ROWS})")
    return f"your {where}, want {want[0]}..{want[1]} ({RULE_ROWS})"


def _check_rows(fn, watch: Tripwire) -> str:
    for kv in (1, 2, 3, 4, 6, 8, 12, 16):
        for t in (1, 2, 3, 4, 6, 8, 16):
            if kv % t and t % kv:
                continue
            for head_rows in (2, 12, 2 * (kv + t + 1)):
                for r in range(t):
                    got = _as_rows(_learner(watch, "your kv_rows", fn, kv, head_rows, t, r), kv, head_rows, t, r)
                    if got != _rows(kv, head_rows, t, r):
                        return _diagnose_rows(got, kv, head_rows, t, r)
    return ""


# --- 2. the gradient sum ---------------------------------------------------------------------------
def _check_sums(fn, comm, watch: Tripwire) -> str:
    """The sum at t = 4 (the notebook's) and at t = 2 on the same ranks (``--tp 2 --dp 2``),
    each with kv = 1, 2, 4: a sum right only at t = 4 (t hard-wired) fails at t = 2."""
    problem = _check_sum(fn, comm, watch)
    if problem:
        return problem
    problem = _check_sum(fn, comm_on(comm, ParallelConfig(tp=2, dp=WORLD // 2, device="cpu")), watch)
    return problem and f"{problem} (right at t = 4, wrong at t = 2: is t = 4 hard-wired?)"


def _check_sum(fn, comm, watch: Tripwire) -> str:
    t, r = comm.size("tp"), comm.index("tp")
    for kv in (1, 2, 4):
        n = share(kv, t)
        grads = [torch.arange(1.0, 37.0, dtype=torch.float64).reshape(6, 6) * (q + 1) ** 2 for q in range(t)]
        mine = grads[r].clone()
        got, calls = traced(comm, _learner, watch, "your sum_kv_grad", fn, mine, comm, kv, t)
        if not isinstance(got, torch.Tensor) or got.shape != grads[r].shape:
            return (f"your sum_kv_grad(kv_heads={kv}, t={t}) returned "
                    f"{type(got).__name__ if not isinstance(got, torch.Tensor) else list(got.shape)}: return the "
                    f"gradient, shaped like the one it was given ({list(grads[r].shape)})")
        wrong = _wrong_group(calls, kv, t)
        if wrong:
            return wrong
        group = [q for q in range(t) if q // n == r // n]
        want = sum(grads[q] for q in group)
        if not torch.allclose(got, want, rtol=1e-12, atol=0):
            every = sum(grads)
            if n == 1:
                return (f"your sum_kv_grad(kv_heads={kv}, t={t}) "
                        f"{'communicates ' + describe_calls(calls) if calls else 'changes the gradient'}: with kv ≥ t "
                        f"each rank's kv heads are its own (no copies), so return the gradient as it is")
            if torch.allclose(got, grads[r], rtol=1e-12, atol=0):
                return (f"your sum_kv_grad(kv_heads={kv}, t={t}) leaves rank {r}'s gradient as it is: its kv head "
                        f"has {n} copies and each saw only its own query heads' gradient: sum them over the {n} "
                        f"ranks that share it (axis '{_axis(kv, t)}')")
            if n > 1 and torch.allclose(got, want / n, rtol=1e-12, atol=0):
                return (f"your sum_kv_grad(kv_heads={kv}, t={t}) averages the {n} copies: each copy saw different "
                        f"queries, so their contributions add up: sum, do not divide")
            if n < t and torch.allclose(got, every, rtol=1e-12, atol=0):
                return (f"your sum_kv_grad(kv_heads={kv}, t={t}) sums over all {t} tensor ranks: that adds the "
                        f"gradients of other kv heads; sum only over the {n} copies of this rank's head "
                        f"(axis '{_axis(kv, t)}')")
            return (f"your sum_kv_grad(kv_heads={kv}, t={t}) gives rank {r} a gradient off by "
                    f"{float((got - want).abs().max()):.3g}: it is the sum over the {n} ranks holding the same "
                    f"copy (axis '{_axis(kv, t)}')")
        if n == 1 and calls:
            return (f"your sum_kv_grad(kv_heads={kv}, t={t}) communicates {describe_calls(calls)}: with kv ≥ t every "
                    f"rank's kv heads are its own, nothing to sum")
        if n > 1 and [(c["op"], c["axis"]) for c in calls] != [("all_reduce", _axis(kv, t))]:
            return (f"your sum_kv_grad(kv_heads={kv}, t={t}) communicates {describe_calls(calls)}: it is exactly one "
                    f"all-reduce on '{_axis(kv, t)}' (the {n} ranks sharing the copy)")
    return ""


def _wrong_group(calls, kv: int, t: int) -> str:
    """The copies grouped by the wrong factor (kv_heads, or heads per rank, for t/kv), read
    from the trace: one all-reduce on a 'tp_kv' axis other than the copies'."""
    axes = [c["axis"] for c in calls if c["op"] == "all_reduce"]
    right = _axis(kv, t) if share(kv, t) > 1 else None
    if len(axes) != 1 or axes[0] == right or not axes[0].startswith("tp_kv"):
        return ""
    n = share(kv, t)
    by = f"kv_heads = {kv}" if axes[0] == f"tp_kv{kv}" else axes[0][len("tp_kv"):]
    return (f"your sum_kv_grad(kv_heads={kv}, t={t}) sums over '{axes[0]}': the copies grouped by {by}, the wrong "
            f"factor; a kv head has t/kv = {n} cop{'ies' if n > 1 else 'y'}"
            + (f", on the ranks of axis '{right}'" if right else ": nothing to sum when kv ≥ t"))


# --- 3. inside the engine ------------------------------------------------------------------------
class _SumKVGrad(torch.autograd.Function):
    """The learner's key/value weight: itself forward; backward, the learner's sum over its copies."""

    @staticmethod
    def forward(ctx, w, lab):
        ctx.lab = lab
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        lab = ctx.lab
        return _learner(lab.watch, "your sum_kv_grad", lab.sum_kv_grad, grad.clone(), lab.comm, lab.kv, lab.t), None


def _column_linear(kv_rows, sum_kv_grad, watch):
    """A column-parallel linear: the engine's, except the key/value weight (``blocks``: its kv
    heads), whose rows come from the learner's kv_rows and whose gradient goes through the
    learner's sum_kv_grad (so its ShardInfo carries no grad_sync: the engine sums nothing)."""

    def build(name, d_in, d_out, ctx, std=0.02, ops=None, bias=True, blocks=0, parts=1):
        if not blocks:
            return tensor.ColumnParallelLinear(name, d_in, d_out, ctx, std, ops, bias, blocks, parts)
        return _KVLinear(name, d_in, d_out, ctx, std, blocks, kv_rows, sum_kv_grad, watch)

    return build


class _KVLinear(torch.nn.Module):
    def __init__(self, name, d_in, d_out, ctx, std, blocks, kv_rows, sum_kv_grad, watch):
        super().__init__()
        t = ctx.tp
        start, stop = _as_rows(_learner(watch, "your kv_rows", kv_rows, blocks, d_out // blocks, t, ctx.tp_rank),
                               blocks, d_out // blocks, t, ctx.tp_rank)
        copies = {"replicas": (_axis(blocks, t),)} if share(blocks, t) > 1 else {}
        self.weight = make_param(f"{name}.weight", (d_out, d_in), (slice(start, stop),), ctx, std, **copies)
        self.bias = None
        self.lab = SimpleNamespace(sum_kv_grad=sum_kv_grad, comm=ctx.comm, kv=blocks, t=t, watch=watch)

    def forward(self, x):
        return F.linear(x, _SumKVGrad.apply(self.weight, self.lab))


def _job(comm, source: str, timeout: float) -> dict | None:
    case = next(_CASE)
    watch = _watch()
    try:
        with watch.armed():
            ns = load(source, NAMES, {"torch": torch})
        problem = _check_rows(ns["kv_rows"], watch) or _check_sums(ns["sum_kv_grad"], comm, watch)
    except LabError as e:
        problem = str(e)
    agree(comm, f"gqa/{case}", problem, timeout)
    layers = SimpleNamespace(**{**vars(tensor.layers()),
                                "linear_in": _column_linear(ns["kv_rows"], ns["sum_kv_grad"], watch)})
    verdicts = []  # every rank trains every run (they stay in step); rank 0 judges at the end
    for tp, kv in RUNS:
        layout = ParallelConfig(tp=tp, dp=WORLD // tp, device="cpu")
        res = train_swapped(comm_on(comm, layout), MODEL.replace(kv_heads=kv), layout,
                            TRAIN.replace(global_batch=2 * layout.dp), layers=layers)
        verdicts.append((f"--tp {tp} with {kv} kv head(s)", training_verdict(res, "kv_rows and sum_kv_grad", "", TOL)))
    if comm.grid.rank != 0:
        return None
    return verdict_over_runs(verdicts, "your kv_rows and sum_kv_grad train exactly like the single-device model "
                                       "(--tp 4 with 1 and 2 kv heads: replicated; --tp 2 --dp 2 with 4: split)")


def check_gqa_all(sources: list[str], timeout: float = 90) -> list[dict]:
    """`check_gqa` for several sources, in as few launches as their outcomes allow."""
    return run_sources(_job, ParallelConfig(tp=WORLD, device="cpu"), sources, timeout, timeout,
                       forbidden=FORBIDDEN, names=NAMES)


def check_gqa(source: str, timeout: float = 90) -> dict:
    """Lab 10a: check `kv_rows` and `sum_kv_grad` defined in `source` (the rows of the
    key/value weight a tensor rank holds, split or replicated, and the gradient sum over a
    replicated head's copies) on 4 gloo ranks, then train a small Llama with them inside
    the engine (``--tp 4`` with 1 and 2 kv heads, ``--tp 2 --dp 2`` with 4; float64, 2 steps
    each) against the single-device model. Returns {"ok", "message",
    "max_loss_abs_diff", "max_param_rel_diff"}, or {"ok": False, "message"} naming the first
    problem (also when the code does not compile, is a stub, uses the engine's own piece,
    raises or runs past `timeout` seconds)."""
    return check_gqa_all([source], timeout)[0]
