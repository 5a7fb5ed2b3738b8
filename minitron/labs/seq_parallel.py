"""Lab 04c: sequence parallelism's all-gather linear (Korthikanti et al. 2022, §4.2.2; the
engine's ``minitron.parallel.tensor._AllGatherLinear``).

The learner writes ``AllGatherLinear``, a ``torch.autograd.Function`` with the engine's
signature: ``forward(ctx, x, weight, bias, comm)`` takes this rank's sequence shard
x [b, s/t, h], all-gathers it along 'tp' on dim 1 and returns ``F.linear`` of the whole
sequence with the column-parallel weight shard [d/t, h] (and bias [d/t] or None):
[b, s, d/t]. It keeps only the shard for the backward; ``backward(ctx, dy)`` all-gathers
the shard again for dW = dYᵀ·X, reduce-scatters dX = dY·W back to the sequence shard,
returns db = dY summed (None without a bias) and None for `comm`.

Every rank `exec`s the source (``torch`` and ``F`` = ``torch.nn.functional`` are
defined in it) and checks the class on rank-dependent float64 data cut from one full
input X [b, s, h], weight W [d, h], bias and upstream gradient, against autograd of
``F.linear(X, W, B)`` on one device:

1. the forward returns [b, s, d/t] equal to this rank's columns of F.linear(X, W, B),
   with exactly one all-gather on 'tp' (of the shard);
2. what the forward saved for the backward (``save_for_backward``, through
   ``torch.autograd.graph.saved_tensors_hooks``, and tensors kept as ctx attributes),
   parameters aside, is at most the shard: the gathered input [b, s, h] is t× that;
3. the backward returns dX with the shard's shape and value (the reduce-scatter of
   dY·W), dW and db of this rank's columns, communicating one all-gather of the shard
   and one reduce-scatter of [b, s, h], nothing else;
4. with ``bias=None`` (the output layer calls it so) it returns None for db.

A wrong number is diagnosed against the usual mistakes (dX not summed over the ranks or
left whole, dW from this rank's tokens only or a mean where the sum is, no bias gradient). The ranks agree on the
first problem found (through the rendezvous store) and all stop there; otherwise the
class is swapped into the engine, a tiny GPT trains with ``--tp 4 --sp`` for 2 float64
steps, and rank 0 compares it with the single-device model.

    result = check_all_gather_linear(SOURCE)   # {"ok", "message", "max_loss_abs_diff", ...}
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from ..config import ParallelConfig
from .runner import (LAB_GPT, LAB_GPT_STEPS, TOL, LabError, Tripwire, agree, call, describe_calls, flags_of, loaded, run_sources,
                     swapped_on_each_layout, verdict_over_runs, watched)

MODEL = LAB_GPT
TRAIN = LAB_GPT_STEPS
NAME = "AllGatherLinear"
TP = 4  # tensor-parallel ranks: more than 2, so that nothing hard-wired to 2 passes
# the notebook's layout, then 2 tensor ranks in each of 2 replicas: shards of another length, and a
# collective over the launch's ranks instead of the 'tp' group, are seen there
LAYOUTS = (ParallelConfig(tp=TP, sp=True, device="cpu"), ParallelConfig(tp=2, dp=TP // 2, sp=True, device="cpu"))
B, S_LOCAL, H, D_LOCAL = 2, 3, 5, 4  # the unit checks' shapes: x [B, S_LOCAL, H], weight [D_LOCAL, H]
_CASE = itertools.count()  # the case number in this launch: the same on every rank
# the engine's own version of the piece: not an answer to this lab
FORBIDDEN = ("minitron.parallel.tensor._AllGatherLinear", "minitron.parallel.tensor.all_gather_linear")
REDUCE_SCATTER = ("the backward of an all-gather is a reduce-scatter: comm.reduce_scatter(dY·W, 'tp', dim=1) "
                  "sums the ranks' partial dX and leaves each rank its sequence shard")


def _close(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and a.shape == b.shape
            and bool(torch.allclose(a, b, rtol=1e-10, atol=1e-10)))


def _shape(t) -> str:
    return str(list(t.shape)) if isinstance(t, torch.Tensor) else repr(t)[:40]


class _Data:
    """One full input X [b, s, h], weight W [d, h], bias [d] and upstream gradient
    G [b, s, d] (the same on every rank); this rank's pieces and what it should get."""

    def __init__(self, t: int, r: int):
        self.t, self.r = t, r
        b, s, h, d = B, S_LOCAL * t, H, D_LOCAL * t
        g = torch.Generator().manual_seed(1234)
        self.X = torch.randn(b, s, h, generator=g, dtype=torch.float64)
        self.W = torch.randn(d, h, generator=g, dtype=torch.float64)
        self.Bias = torch.randn(d, generator=g, dtype=torch.float64)
        self.G = torch.randn(b, s, d, generator=g, dtype=torch.float64)
        self.seq = slice(r * S_LOCAL, (r + 1) * S_LOCAL)
        self.cols = slice(r * D_LOCAL, (r + 1) * D_LOCAL)
        X, W, Bias = (v.clone().requires_grad_() for v in (self.X, self.W, self.Bias))
        y = F.linear(X, W, Bias)
        dX, dW, dB = torch.autograd.grad(y, (X, W, Bias), self.G)
        self.y = y.detach()[..., self.cols]
        self.dx, self.dw, self.db = dX[:, self.seq], dW[self.cols], dB[self.cols]
        self.dy = self.G[..., self.cols]
        # the usual mistakes
        self.dx_partial = (self.dy @ self.W[self.cols])[:, self.seq]  # dY_r·W_r, not summed over ranks
        x2 = self.X[:, self.seq].flatten(0, 1)
        self.dw_local = self.dy[:, self.seq].flatten(0, 1).t() @ x2  # this rank's tokens only

    def inputs(self, bias: bool = True):
        x = self.X[:, self.seq].clone().requires_grad_()
        w = self.W[self.cols].clone().requires_grad_()
        b = self.Bias[self.cols].clone().requires_grad_() if bias else None
        return x, w, b


def _probe(cls):
    """A subclass of the learner's class whose backward records what the learner's
    returned (`.got`) and hands autograd only gradients of the right shapes, so that
    the checker, not autograd, says what is wrong."""

    class Probe(cls):
        got = None

        @staticmethod
        def backward(ctx, *grads):
            out = cls.backward(ctx, *grads)
            Probe.got = out
            if not isinstance(out, tuple) or len(out) != 4:
                return None, None, None, None
            x, w, b, _ = ctx.probe_inputs
            return tuple(g if isinstance(g, torch.Tensor) and ref is not None and g.shape == ref.shape else None
                         for g, ref in zip(out, (x, w, b, None)))

    return Probe


def _saved(y, saved: list, params) -> list[torch.Tensor]:
    """The tensors the forward kept for the backward (saved or set on ctx), but for
    the parameters (and views of them)."""
    kept = list(saved)
    for v in vars(y.grad_fn).values() if y.grad_fn is not None else ():
        items = v if isinstance(v, (list, tuple)) else [v]
        kept += [t for t in items if isinstance(t, torch.Tensor)]
    ptrs = {p.untyped_storage().data_ptr() for p in params if p is not None}
    seen, out = set(), []
    for t in kept:  # a tensor both saved and kept on ctx counts once
        key = (t.untyped_storage().data_ptr(), tuple(t.shape))
        if t.untyped_storage().data_ptr() not in ptrs and key not in seen:
            seen.add(key)
            out.append(t)
    return out


def _forward(comm, probe, data: _Data, bias: bool = True):
    x, w, b = data.inputs(bias)
    saved: list = []
    n = len(comm.trace.records)

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = call(f"your {NAME}.forward", probe.apply, x, w, b, comm)
    calls = comm.trace.records[n:]
    if not isinstance(y, torch.Tensor):
        return y, (x, w, b), calls, []
    kept = _saved(y, saved, (w, b))
    if y.grad_fn is not None:
        y.grad_fn.probe_inputs = (x, w, b, None)
    return y, (x, w, b), calls, kept


def _check_forward(data: _Data, y, calls, saved) -> str:
    t, r = data.t, data.r
    want = [B, S_LOCAL * t, D_LOCAL]
    if not isinstance(y, torch.Tensor) or list(y.shape) != want:
        got = f"a tensor of shape {_shape(y)}" if isinstance(y, torch.Tensor) else repr(y)[:60]
        hint = (": gather along the sequence, dim 1 (comm.all_gather(x, 'tp', dim=1))"
                if isinstance(y, torch.Tensor) and list(y.shape) in ([B * t, S_LOCAL, D_LOCAL],
                                                                     [B, S_LOCAL, D_LOCAL]) else "")
        return (f"your {NAME}.forward returned {got} for a shard x [{B}, {S_LOCAL}, {H}] and a weight "
                f"[{D_LOCAL}, {H}] on {t} ranks: return F.linear of the whole gathered sequence, [b, s, d/t] = "
                f"{want}{hint}")
    if y.grad_fn is None:
        return (f"your {NAME}.forward returned a tensor without a gradient: use {NAME}.apply's autograd "
                f"(return a new tensor from forward, not a detached one)")
    if not _close(y.detach(), data.y):
        i = int((y.detach() - data.y).abs().argmax())
        return (f"your forward's output on tp rank {r} differs from F.linear on the gathered input (this "
                f"rank's columns) by {float((y.detach() - data.y).reshape(-1)[i]):.3g}: the gathered sequence "
                f"is every rank's shard in rank order (comm.all_gather(x, 'tp', dim=1))")
    gathers = [c for c in calls if c["op"] == "all_gather" and c["axis"] == "tp"]
    if len(calls) != 1 or len(gathers) != 1:
        return (f"your forward communicates {describe_calls(calls)}: it needs exactly one all-gather of the shard "
                f"[{B}, {S_LOCAL}, {H}] on 'tp'")
    gathered = B * S_LOCAL * t * H
    if any(s.numel() >= gathered for s in saved):
        return (f"your forward saves the gathered input [b, s, h] ({t}× the shard): save the shard and "
                f"all-gather it again in backward — that is what makes Table 2's 34/t hold")
    kept = sum(s.numel() for s in saved)
    if kept > B * S_LOCAL * H:
        return (f"your forward keeps {kept} numbers for the backward beside the weight ("
                + ", ".join(_shape(s) for s in saved) + f"): the shard x [{B}, {S_LOCAL}, {H}] "
                f"({B * S_LOCAL * H}) is all the backward needs")
    return ""


def _check_backward(data: _Data, got, calls, bias: bool = True) -> str:
    t, r = data.t, data.r
    if not isinstance(got, tuple) or len(got) != 4:
        n = len(got) if isinstance(got, tuple) else 1
        return (f"your {NAME}.backward returned {n} value(s): return 4, the gradients of x, weight and bias, "
                f"then None for comm")
    dx, dw, db, _ = got
    if not isinstance(dx, torch.Tensor):
        return f"your backward returns {dx!r} for dX: return dX, the shard's gradient [b, s/t, h]"
    if list(dx.shape) == [B, S_LOCAL * t, H]:
        return (f"your backward returns dX of shape {list(dx.shape)}, the whole sequence, for the shard x "
                f"[{B}, {S_LOCAL}, {H}]: {REDUCE_SCATTER}")
    if t != 2 and list(dx.shape) == [B, S_LOCAL * t // 2, H]:
        return (f"your backward returns dX of shape {list(dx.shape)}, half the sequence, on {t} ranks: as if there "
                f"were 2 ranks; each of the t = comm.size('tp') = {t} ranks keeps s/t = {S_LOCAL} tokens: "
                f"{REDUCE_SCATTER}")
    if dx.shape != data.dx.shape:
        return (f"your backward returns dX of shape {list(dx.shape)} for the shard x [{B}, {S_LOCAL}, {H}]: "
                f"{REDUCE_SCATTER}")
    if _close(dx, data.dx_partial):
        return f"your dX on tp rank {r} is this rank's dY·W alone, not summed over the tensor ranks: {REDUCE_SCATTER}"
    if not _close(dx, data.dx):
        return (f"your dX on tp rank {r} differs from autograd's (the gathered input's gradient, this rank's "
                f"sequence shard) by {float((dx - data.dx).abs().max()):.3g}: dX = reduce-scatter(dY·W)")
    if not isinstance(dw, torch.Tensor) or dw.shape != data.dw.shape:
        return (f"your backward returns a weight gradient of {_shape(dw)} for a weight of "
                f"[{D_LOCAL}, {H}]: dW = dYᵀ·X over all b·s tokens of the gathered X")
    if _close(dw, data.dw_local):
        return (f"your weight gradient uses only this rank's sequence shard of X (and of dY): dW = dYᵀ·X sums "
                f"over every token, so all-gather the saved shard again in backward (comm.all_gather(x, 'tp', "
                f"dim=1))")
    for n, over in ((B, f"the batch (b = {B})"), (B * S_LOCAL * t, f"every token (b·s = {B * S_LOCAL * t})")):
        if _close(dw * n, data.dw):
            return (f"your weight gradient is autograd's divided by {n}, a mean over {over}: the loss already "
                    f"averages, so dW = dYᵀ·X sums over every token of the gathered X")
    if not _close(dw, data.dw):
        return (f"your weight gradient on tp rank {r} differs from autograd's by "
                f"{float((dw - data.dw).abs().max()):.3g}: dW = dYᵀ·X with X all-gathered again")
    if bias:
        if db is None:
            return ("your backward returns None for the bias gradient: return dY summed over the batch and the "
                    "sequence, dY.sum((0, 1)) (None only when bias is None)")
        if not _close(db, data.db):
            return (f"your bias gradient ({_shape(db)}) on tp rank {r} differs from autograd's [{D_LOCAL}]: "
                    f"db = dY.sum((0, 1)), this rank's columns of dY over every token")
    elif db is not None:
        return ("called with bias=None (as the output layer calls it) your backward returns a bias gradient: "
                "return None for db then")
    ops = sorted((c["op"], c["axis"], str(c["shape"])) for c in calls)
    want = sorted([("all_gather", "tp", str([B, S_LOCAL, H])), ("reduce_scatter", "tp", str([B, S_LOCAL * t, H]))])
    if ops != want:
        if any(c["op"] == "all_reduce" for c in calls):
            return (f"your backward communicates {describe_calls(calls)}: {REDUCE_SCATTER} (an all-reduce moves twice "
                    f"the bytes and leaves every rank the whole sequence)")
        return (f"your backward communicates {describe_calls(calls)}: it needs one all-gather of the saved shard "
                f"[{B}, {S_LOCAL}, {H}] (for dW) and one reduce-scatter of dY·W [{B}, {S_LOCAL * t}, {H}] on 'tp'")
    return ""


def _backward(comm, probe, y, data: _Data, bias: bool = True) -> str:
    x, w, b = y.grad_fn.probe_inputs[:3]
    n = len(comm.trace.records)
    probe.got = None
    leaves = [v for v in (x, w, b) if v is not None]
    try:
        call(f"your {NAME}.backward",
             lambda: torch.autograd.grad(y, leaves, data.dy, allow_unused=True))
    except LabError as e:
        mine = comm.trace.records[n:]
        if "shapes cannot be multiplied" in str(e) and not any(c["op"] == "all_gather" for c in mine):
            raise LabError(f"{e} — dW = dYᵀ·X needs X for the whole sequence: all-gather the saved shard "
                           f"again (comm.all_gather(x, 'tp', dim=1))") from None
        raise
    return _check_backward(data, probe.got, comm.trace.records[n:], bias)


def _unit_check(comm, cls) -> str:
    """'' when the class passes every unit check on this rank, else the first problem."""
    data = _Data(comm.size("tp"), comm.index("tp"))
    probe = _probe(cls)
    y, _, calls, saved = _forward(comm, probe, data)
    problem = _check_forward(data, y, calls, saved) or _backward(comm, probe, y, data)
    if problem:
        return problem
    y, _, _, _ = _forward(comm, probe, data, bias=False)
    if not isinstance(y, torch.Tensor) or y.grad_fn is None or not _close(y.detach(), data.y - data.Bias[data.cols]):
        return (f"called with bias=None (as the output layer calls it) your forward returns "
                f"{_shape(y)}: F.linear(x, weight, None) has no bias")
    return _backward(comm, probe, y, data, bias=False)


def _job(comm, source: str, timeout: float) -> dict | None:
    from ..parallel import tensor

    case = next(_CASE)
    watch = Tripwire(watched("minitron.parallel.tensor._AllGatherLinear"))
    cls, = loaded(comm, source, (NAME,), {"torch": torch, "F": F}, watch, f"sp/{case}", timeout)
    runs = swapped_on_each_layout(comm, LAYOUTS, f"sp/{case}", timeout, watch, lambda c: _unit_check(c, cls),
                                  tensor.layers(all_gather_linear=cls), NAME, MODEL, TRAIN, TOL)
    if comm.grid.rank != 0:
        return None
    return verdict_over_runs(runs, f"your {NAME} trains exactly like the single-device model ({flags_of(runs)})")


def check_all_gather_linear_all(sources: list[str], timeout: float = 60) -> list[dict]:
    """`check_all_gather_linear` for several sources, in as few launches as their outcomes allow."""
    return run_sources(_job, LAYOUTS[0], sources, timeout, timeout,
                       forbidden=FORBIDDEN, names=(NAME,))


def check_all_gather_linear(source: str, timeout: float = 60) -> dict:
    """Lab 04c: check the class `AllGatherLinear` defined in `source` on 4 gloo ranks
    against autograd of ``F.linear`` on the gathered input (output, what the forward
    saves, dX, dW, db, what each pass communicates, bias=None), then train a tiny GPT
    with it in place of the engine's (``--tp 4 --sp``, float64, 2 steps) and compare with
    the single-device model; then the same on ``--tp 2 --dp 2 --sp``. Returns {"ok", "message", "max_loss_abs_diff",
    "max_param_rel_diff"}, or {"ok": False, "message"} naming the first problem, also
    when the code does not compile, raises, returns a wrong shape or runs past `timeout`
    seconds."""
    return check_all_gather_linear_all([source], timeout)[0]
