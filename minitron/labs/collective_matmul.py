"""Lab 04d: the decomposed all-gather-matmul (Wang et al. 2022, "Overlap communication with
dependent computation via decomposition in large deep learning models"; the engine's
``minitron.parallel.collective_matmul.AllGatherMatmul``, ``--tp-overlap``).

The learner writes ``AllGatherMatmul``, a ``torch.autograd.Function`` with the engine's
signature: ``forward(ctx, x, weight, bias, comm)`` takes this rank's sequence shard
x [b, s/t, h] and returns ``F.linear`` of the whole sequence with the column-parallel weight
shard [d/t, h] (bias [d/t] or None): [b, s, d/t] — without an all-gather: the t shards travel
round the tensor ring by ``comm.shift`` (t−1 steps), each shift posted *before* the partial
product of the shard already held, and waited for only when the next shard is needed.
``backward(ctx, dy)`` is decomposed likewise: dX = the reduce-scatter of dY·W as a ring of
running sums, dW = Σ_c dY_cᵀ·X_c with the shards X_c gathered round the ring again.

Every rank `exec`s the source (``torch`` and ``F`` defined in it) and runs the class on
rank-dependent float64 data cut from one full input X [b, s, h], weight W [d, h], bias and
upstream gradient, against autograd of ``F.linear(X, W, B)`` on one device, through a
watched Comm: each shift posted, each wait, each matrix product (and the shard it
multiplies) written into one log in the order they happen. Checked, in order:

1. forward: no collective (``all_gather``) — the chunks go by ``comm.shift``; every shift
   waited for (the last chunk too); the output equal to this rank's columns of F.linear,
   each shard's product in that shard's rows (the chunk order); t−1 shifts of the shard;
   the first partial product the rank's own shard (the one that needs no wait); every
   shift in flight while a partial product runs (posted before it, waited after it) — so
   that all t−1 sends are issued before the last partial product;
2. backward: no collective either (the backward decomposed); every shift waited for;
   dX, dW and db equal to autograd's; 2(t−1) shifts (X re-gathered for dW, dY·W's running
   sums for dX); each shift in flight while a partial product runs;
3. with ``bias=None`` (the output layer calls it so) no bias in the output and None for db.

The ranks agree on the first problem (through the rendezvous store); otherwise the class
is handed to the engine (``tensor.layers(all_gather_matmul=...)``), a tiny GPT trains with
``--tp 4 --sp --tp-overlap`` and then ``--tp 2 --dp 2 --sp --tp-overlap`` for 2 float64
steps, and rank 0 compares each with the single-device model.

    result = check_all_gather_matmul(SOURCE)   # {"ok", "message", "max_loss_abs_diff", ...}
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ..config import ParallelConfig
from .runner import (LAB_GPT, LAB_GPT_STEPS, TOL, LabError, Tripwire, call, describe_calls, engine_piece, flags_of, loaded, run_sources,
                     swapped_on_each_layout, verdict_over_runs, watched)

MODEL = LAB_GPT
TRAIN = LAB_GPT_STEPS
NAME = "AllGatherMatmul"
TP = 4  # more than 2 tensor ranks: a ring hard-wired to one neighbour fails
LAYOUTS = (ParallelConfig(tp=TP, sp=True, tp_overlap=True, device="cpu"),
           ParallelConfig(tp=2, dp=TP // 2, sp=True, tp_overlap=True, device="cpu"))
B, S_LOCAL, H, D_LOCAL = 2, 3, 5, 4  # the unit checks' shapes: x [B, S_LOCAL, H], weight [D_LOCAL, H]
_CASE = itertools.count()  # the case number in this launch: the same on every rank
# the engine's own decomposition: not an answer to this lab (nor its ring helpers)
FORBIDDEN = ("minitron.parallel.collective_matmul",)
WATCHED = tuple(f"minitron.parallel.collective_matmul.{n}"
                for n in ("AllGatherMatmul", "all_gather_matmul", "ring_gather", "pass_on", "scatter_order"))
# the engine's row-parallel exit (MatmulReduceScatter) runs the ring helpers during training
ENGINE_EXIT = "minitron.parallel.collective_matmul.MatmulReduceScatter"
RING = ("post comm.shift(held, 'tp') for the next shard, multiply the shard you hold, then wait for the "
        "shift (Wang et al. 2022)")


def _close(a, b) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-10, atol=1e-10))


def _shape(t) -> str:
    return str(list(t.shape)) if isinstance(t, torch.Tensor) else repr(t)[:40]


class _Data:
    """One full input X [b, s, h], weight W [d, h], bias [d] and upstream gradient G [b, s, d]
    (the same on every rank); this rank's pieces and what autograd says it should get."""

    def __init__(self, t: int, r: int):
        self.t, self.r = t, r
        b, s, h, d = B, S_LOCAL * t, H, D_LOCAL * t
        g = torch.Generator().manual_seed(4321)
        self.X, self.W = torch.randn(b, s, h, generator=g, dtype=torch.float64), torch.randn(d, h, generator=g,
                                                                                                 dtype=torch.float64)
        self.Bias, self.G = torch.randn(d, generator=g, dtype=torch.float64), torch.randn(b, s, d, generator=g,
                                                                                            dtype=torch.float64)
        self.cols = slice(r * D_LOCAL, (r + 1) * D_LOCAL)
        self.shards = self.X.chunk(t, 1)
        X, W, Bias = (v.clone().requires_grad_() for v in (self.X, self.W, self.Bias))
        y = F.linear(X, W, Bias)
        dX, dW, dB = torch.autograd.grad(y, (X, W, Bias), self.G)  # dX: Σ over every rank's columns
        self.y = y.detach()[..., self.cols]
        self.dy = self.G[..., self.cols]
        self.dx = dX[:, r * S_LOCAL:(r + 1) * S_LOCAL]  # this rank's chunk of the sum: the reduce-scatter
        self.dw, self.db = dW[self.cols], dB[self.cols]

    def inputs(self, bias: bool = True):
        x = self.shards[self.r].clone().requires_grad_()
        w = self.W[self.cols].clone().requires_grad_()
        return x, w, self.Bias[self.cols].clone().requires_grad_() if bias else None

    def shard_of(self, t: torch.Tensor):
        """Which rank's shard of X `t` holds (its numbers, in any layout), or None."""
        if t.numel() != B * S_LOCAL * H or t.dtype != torch.float64:
            return None
        got = t.detach().reshape(-1).sort().values
        return next((c for c, s in enumerate(self.shards) if torch.equal(got, s.reshape(-1).sort().values)), None)


class _Log(TorchDispatchMode):
    """The events of one pass, in the order they happen: ('shift', k) posted, ('wait', k) and
    ('mm', shard) — a matrix product begins, with the rank whose shard of X it multiplies
    (forward; None otherwise)."""

    def __init__(self, data: _Data | None):
        super().__init__()
        self.data, self.events = data, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("mm", "addmm", "bmm", "baddbmm"):
            shards = [self.data.shard_of(a) for a in args if isinstance(a, torch.Tensor)] if self.data else []
            self.events.append(("mm", next((c for c in shards if c is not None), None)))
        return func(*args, **(kwargs or {}))


class _Waited:
    """A shift in flight (the Comm's Pending) whose ``wait`` the log sees."""

    def __init__(self, pending, k: int, log: _Log):
        self._pending, self._k, self._log, self.waited = pending, k, log, False

    def wait(self):
        self.waited = True
        self._log.events.append(("wait", self._k))
        return self._pending.wait()

    def __getattr__(self, name):  # .result read without a wait: the buffer, maybe not yet filled
        return getattr(self._pending, name)


class _Watched:
    """The Comm the unit checks hand the learner: the real one (every byte through it, traced),
    each ``shift`` logged and its Pending watched for its wait."""

    def __init__(self, comm, log: _Log):
        self._comm, self.log, self.shifts = comm, log, []

    def shift(self, *args, **kwargs):
        self.log.events.append(("shift", len(self.shifts)))
        self.shifts.append(_Waited(self._comm.shift(*args, **kwargs), len(self.shifts), self.log))
        return self.shifts[-1]

    def settle(self) -> list[int]:
        """Wait for the shifts the learner left in flight (so that the ranks stay in step);
        their numbers."""
        left = [w._k for w in self.shifts if not w.waited]
        for k in left:
            self.shifts[k]._pending.wait()
        return left

    def __getattr__(self, name):
        return getattr(self._comm, name)


def _probe(cls):
    """A subclass of the learner's class whose backward records what the learner's returned
    (`.got`) and hands autograd only gradients of the right shapes (the checker says what is
    wrong, not autograd)."""

    class Probe(cls):
        got = None

        @staticmethod
        def backward(ctx, *grads):
            Probe.got = out = cls.backward(ctx, *grads)
            if not isinstance(out, tuple) or len(out) != 4:
                return None, None, None, None
            return tuple(g if isinstance(g, torch.Tensor) and ref is not None and g.shape == ref.shape else None
                         for g, ref in zip(out, ctx.probe_inputs))

    return Probe


def _overlap(events, shifts: int, what: str) -> str:
    """'' when each of the `shifts` shifts has a matrix product between its post and its
    wait, else the first that has none."""
    for k in range(shifts):
        posted, waited = events.index(("shift", k)), events.index(("wait", k))
        if not any(e[0] == "mm" for e in events[posted:waited]):
            return (f"your {what}'s chunks do not overlap: shift {k} is waited for before any partial product ran "
                    f"while it travelled (no overlap — a ring done serially is an all-gather in t−1 pieces): {RING}")
    return ""


def _waits(comm: _Watched, t: int, what: str) -> str:
    left = comm.settle()
    if not left:
        return ""
    last = len(comm.shifts) - 1
    if left == [last] and what == "forward":
        return (f"the last chunk is never waited for: your forward reads shift {last}'s buffer without its wait() "
                f"(the shard may not have arrived): wait for every shift before you use what it brings")
    return (f"your {what} never waits for shift(s) {left} of {len(comm.shifts)}: wait() for each before you use "
            f"what it brings (the last chunk too)")


def _collectives(calls, what: str) -> str:
    whole = [c for c in calls if c["op"] not in ("send", "recv")]
    if not whole:
        return ""
    if what == "backward":
        return (f"the backward is not decomposed: it communicates {describe_calls(whole)}; decompose it too — dX as "
                f"a ring of running sums of dY·W (comm.shift(total, 'tp', -1, tag=1)) and X re-gathered round the "
                f"ring for dW (comm.shift(held, 'tp', 1, tag=0))")
    return (f"your forward communicates {describe_calls(whole)}: the decomposed all-gather-matmul has no "
            f"collective — the t shards go round the ring by comm.shift, t−1 steps: {RING}")


def _chunk_order(data: _Data, y, expected) -> str:
    t = data.t
    got, want = y.detach().chunk(t, 1), expected.chunk(t, 1)
    for p in range(t):
        if not _close(got[p], want[p]):
            q = next((q for q in range(t) if _close(got[p], want[q])), None)
            if q is not None:
                return (f"chunk order wrong: on tp rank {data.r} rows {p * S_LOCAL}..{(p + 1) * S_LOCAL - 1} of your "
                        f"output hold the product of rank {q}'s shard, not rank {p}'s: at ring step k the shard you "
                        f"hold came from rank (r − k) mod t; write its product into that rank's rows")
            i = int((got[p] - want[p]).abs().argmax())
            return (f"your forward's output on tp rank {data.r} differs from F.linear on the gathered input (this "
                    f"rank's columns) by {float((got[p] - want[p]).reshape(-1)[i]):.3g} in rows of rank {p}'s shard")
    return ""


def _check_forward(data: _Data, y, comm: _Watched, calls, bias: bool) -> str:
    t, r = data.t, data.r
    want = [B, S_LOCAL * t, D_LOCAL]
    if not isinstance(y, torch.Tensor) or list(y.shape) != want or y.grad_fn is None:
        got = f"a tensor of shape {_shape(y)}" if isinstance(y, torch.Tensor) else repr(y)[:60]
        return (f"your {NAME}.forward returned {got}{'' if not isinstance(y, torch.Tensor) or y.grad_fn else ' without a gradient'}"
                f" for a shard x [{B}, {S_LOCAL}, {H}] and a weight [{D_LOCAL}, {H}] on {t} ranks: return F.linear "
                f"of the whole sequence, [b, s, d/t] = {want}, from {NAME}.apply's forward")
    expected = data.y if bias else data.y - data.Bias[data.cols]
    problem = _collectives(calls, "forward") or _waits(comm, t, "forward") or _chunk_order(data, y, expected)
    if problem:
        return problem
    sends = [c for c in calls if c["op"] == "send"]
    if len(sends) != t - 1 or any(list(c["shape"]) != [B, S_LOCAL, H] for c in sends):
        return (f"your forward sends {describe_calls(sends)}: the ring moves one shard [{B}, {S_LOCAL}, {H}] per step, "
                f"t − 1 = {t - 1} shifts on 'tp'")
    events = comm.log.events
    first = next((e[1] for e in events if e[0] == "mm"), None)
    if first != r:
        what = f"rank {first}'s shard, which had to travel" if first is not None else "no shard of X"
        return (f"the wrong shard multiplied first: tp rank {r} first multiplies {what} (nothing hides the first "
                f"transfer): multiply your own shard first, while the shard of rank r−1 travels")
    return _overlap(events, t - 1, "forward")


def _check_backward(data: _Data, got, comm: _Watched, calls, bias: bool) -> str:
    t, r = data.t, data.r
    problem = _collectives(calls, "backward") or _waits(comm, t, "backward")
    if problem:
        return problem
    if not isinstance(got, tuple) or len(got) != 4:
        n = len(got) if isinstance(got, tuple) else 1
        return f"your {NAME}.backward returned {n} value(s): return 4, the gradients of x, weight and bias, then None"
    dx, dw, db, _ = got
    if not _close(dx, data.dx):
        how = (f"of shape {_shape(dx)}" if not isinstance(dx, torch.Tensor) or dx.shape != data.dx.shape
               else f"differing from autograd's by {float((dx - data.dx).abs().max()):.3g}")
        return (f"your dX on tp rank {r} is {how}: dX = this rank's chunk of Σ_ranks dY·W, [{B}, {S_LOCAL}, {H}] — "
                f"at step k add the product of chunk r+k+1 to the running sum from rank r+1 and pass it to rank r−1")
    if not _close(dw, data.dw):
        how = (f"of shape {_shape(dw)}" if not isinstance(dw, torch.Tensor) or dw.shape != data.dw.shape
               else f"differing from autograd's by {float((dw - data.dw).abs().max()):.3g}")
        return (f"your weight gradient on tp rank {r} is {how}: dW = Σ_c dY_cᵀ·X_c over every shard c, X "
                f"re-gathered round the ring (the forward saves only the shard)")
    if bias and not _close(db, data.db):
        return f"your bias gradient is {_shape(db)} on tp rank {r}: db = dY.sum((0, 1)) (None only when bias is None)"
    if not bias and db is not None:
        return "called with bias=None (as the output layer calls it) your backward returns a bias gradient: return None"
    sends = [c for c in calls if c["op"] == "send"]
    if len(sends) != 2 * (t - 1):
        return (f"your backward sends {len(sends)} chunks on {t} ranks: it runs two rings of t − 1 = {t - 1} shifts, "
                f"X re-gathered for dW (save only the shard) and dY·W's running sums for dX")
    return _overlap(comm.log.events, 2 * (t - 1), "backward")


def _pass(comm, probe, data: _Data, bias: bool) -> str:
    """One forward and backward of the learner's class on this rank, watched; '' or the problem."""
    x, w, b = data.inputs(bias)
    fwd, n = _Log(data), len(comm.trace.records)
    watched_comm = _Watched(comm, fwd)
    with fwd:
        y = call(f"your {NAME}.forward", probe.apply, x, w, b, watched_comm)
    problem = _check_forward(data, y, watched_comm, comm.trace.records[n:], bias)
    if problem and not bias and isinstance(y, torch.Tensor) and _close(y.detach(), data.y):
        problem = "called with bias=None (as the output layer calls it) your forward adds a bias: F.linear(x, w, None)"
    if problem:
        return problem
    y.grad_fn.probe_inputs = (x, w, b, None)
    bwd = _Log(None)
    watched_comm.log, watched_comm.shifts, n = bwd, [], len(comm.trace.records)
    probe.got = None
    with bwd:
        call(f"your {NAME}.backward",
             lambda: torch.autograd.grad(y, [v for v in (x, w, b) if v is not None], data.dy, allow_unused=True))
    return _check_backward(data, probe.got, watched_comm, comm.trace.records[n:], bias)


def _unit_check(comm, cls) -> str:
    """'' when the class passes every unit check on this rank, else the first problem."""
    data, probe = _Data(comm.size("tp"), comm.index("tp")), _probe(cls)
    return _pass(comm, probe, data, True) or _pass(comm, probe, data, False)


def _job(comm, source: str, timeout: float) -> dict | None:
    from ..parallel import tensor

    case = next(_CASE)
    watch = Tripwire(watched(*WATCHED), allowed=(engine_piece(ENGINE_EXIT),))
    cls, = loaded(comm, source, (NAME,), {"torch": torch, "F": F}, watch, f"agmm/{case}", timeout)
    runs = swapped_on_each_layout(comm, LAYOUTS, f"agmm/{case}", timeout, watch, lambda c: _unit_check(c, cls),
                                  tensor.layers(all_gather_matmul=cls), NAME, MODEL, TRAIN, TOL)
    if comm.grid.rank != 0:
        return None
    return verdict_over_runs(runs, f"your {NAME} trains exactly like the single-device model ({flags_of(runs)})")


def check_all_gather_matmul_all(sources: list[str], timeout: float = 60) -> list[dict]:
    """`check_all_gather_matmul` for several sources, in as few launches as their outcomes allow."""
    return run_sources(_job, LAYOUTS[0], sources, timeout, timeout, forbidden=FORBIDDEN, names=(NAME,))


def check_all_gather_matmul(source: str, timeout: float = 60) -> dict:
    """Lab 04d: check the class `AllGatherMatmul` defined in `source` on 4 gloo ranks against
    autograd of ``F.linear`` on the gathered input — output and chunk order, dX, dW, db, no
    collective in either pass, every shift waited for, the own shard multiplied first, every
    shift in flight under a partial product, bias=None — then train a tiny GPT with it in the
    engine's place (``--tp 4 --sp --tp-overlap``, then ``--tp 2 --dp 2 --sp --tp-overlap``,
    float64, 2 steps) against the single-device model. Returns {"ok", "message",
    "max_loss_abs_diff", "max_param_rel_diff"}, or {"ok": False, "message"} naming the first
    problem (also when the code does not compile, raises or runs past `timeout` seconds)."""
    return check_all_gather_matmul_all([source], timeout)[0]
