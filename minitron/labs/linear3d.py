"""Lab 05: the 3-D linear on the q×q×q cube (Bian et al. 2021; the engine's
``minitron.parallel.cube.Linear3D``).

The learner writes ``Linear3DFunction``, a ``torch.autograd.Function`` computing
``Y = X·Wᵀ`` for a linear on placement (a, c) (the axis names, e.g. ``"cube_j"``,
``"cube_k"``; ``I = "cube_i"``) with three collectives in each direction:

=========  =========================================================================
forward    all-gather x along a (batch, dim 0); all-gather the weight along i (its
           input columns, dim 1); ``F.linear``; reduce-scatter the partial sums along c
backward   all-gather dy along c; reduce-scatter dx along a; reduce-scatter dw along i
=========  =========================================================================

The checker runs on 8 gloo ranks (q = 2) in one launch:

1. for both placements of a linear (FIRST = (j, k) and SECOND = (k, j)), float64: the
   traced calls of the forward and of the backward against ``analysis.cube.linear_calls``
   (op, axis and bytes), the output against ``F.linear`` on the gathered tensors, and the
   input, weight and bias gradients against autograd's on one device;
2. a 2-layer GPT on the cube (``--tp 8 --tp-mode 3d``) with the learner's linear in
   every attention and MLP layer (``cube.layers(linear=...)``, passed to the Trainer),
   2 float64 steps against the single-device model.

    result = check_linear3d(SOURCE)   # {"ok", "message", "calls", "max_loss_abs_diff", ...}
"""
from __future__ import annotations

import itertools
import re
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..analysis.cube import linear_calls
from ..config import ModelConfig, ParallelConfig, TrainConfig
from ..context import shard_slice
from ..parallel import cube
from .runner import (TOL, LabError, Tripwire, agree, call, describe, fail, load, run_sources, training_verdict,
                     versus_one_device, watched)

MODEL = ModelConfig(layers=2, hidden=16, heads=4, seq_len=8, vocab=256, name="lab")
TRAIN = TrainConfig(steps=2, global_batch=8, microbatches=2, dtype="float64", warmup=1, progress=False,
                    eval_every=0, sample_tokens=0)
LAYOUT = ParallelConfig(tp=8, tp_mode="3d", device="cpu")
# (batch, sequence, d_in, d_out): a square one (a transposed weight block still runs) and a wide one
SHAPES = [(4, 3, 8, 8), (8, 2, 8, 16)]
NAMES = ("Linear3DFunction",)
# the engine's own 3-D linear and the differentiable collectives it is made of: not an answer
FORBIDDEN = ("minitron.parallel.cube.Linear3D", "minitron.parallel.cube.cube_product",
             "minitron.parallel.cube._OverlappedProduct", "minitron.parallel.tensor.gather",
             "minitron.parallel.tensor.reduce_scatter", "minitron.parallel.tensor._AllGather",
             "minitron.parallel.tensor._ReduceScatter")
DIRECTION = {"fwd": "forward", "bwd": "backward"}
_CASE = itertools.count()  # the case number in this launch: the same on every rank (agree's keys)


def learner_namespace() -> dict:
    return {"torch": torch, "F": F, "I": cube.I, "J": cube.J, "K": cube.K}


def learner_linear(fn):
    """The engine's Linear3D module (parameters, placement, bias) computing ``X·Wᵀ`` with the
    learner's autograd Function: what ``cube.layers(linear=...)`` builds the model from."""

    class YourLinear3D(cube.Linear3D):
        def forward(self, x):
            y = fn.apply(x, self.weight, self.comm, self.placement.a, self.placement.c)
            return y if self.skip_bias_add else y + self.bias

    return YourLinear3D


# --- one linear against F.linear ------------------------------------------------------------------
def _blocks(comm, placement, b, d_in, d_out):
    """This rank's slices: (x rows, x cols), (y rows, y cols), (w rows, w cols) of the full
    tensors (module docstring of minitron.parallel.cube)."""
    q = comm.size(cube.I)
    i, a, c = comm.index(cube.I), comm.index(placement.a), comm.index(placement.c)
    x = (shard_slice(b, q * q, i * q + a), shard_slice(d_in, q, c))
    y = (shard_slice(b, q * q, i * q + c), shard_slice(d_out, q, a))
    w = (shard_slice(d_out, q, a), shard_slice(d_in, q * q, c * q + i))
    return x, y, w


def _calls_problem(comm, placement, phase: str, shape, e: int) -> str:
    """'' when the traced calls of one direction are linear_calls' (op, axis, bytes)."""
    b, s, d_in, d_out = shape
    q = comm.size(cube.I)
    want = [c for c in linear_calls(b, s, d_in, d_out, q, e, (placement.a, placement.c)) if c["phase"] == phase]
    got = [r for r in comm.trace.records if r["phase"] == phase]
    key = lambda r: (r["op"], r["axis"], r["bytes"])  # noqa: E731
    missing = Counter(map(key, want)) - Counter(map(key, got))
    extra = Counter(map(key, got)) - Counter(map(key, want))
    if not missing and not extra:
        return ""
    where = f"{DIRECTION[phase]} of a linear on placement (a, c) = ({placement.a}, {placement.c})"
    yours = ", ".join(f"{op} along {ax} ({n} B)" for op, ax, n in sorted(extra.elements())) or "nothing else"
    if missing:
        op, ax, n = sorted(missing)[0]
        what = next(c["what"].split(": ")[-1] for c in want if key(c) == (op, ax, n))
        alike = [k for k in extra if k[0] == op and k[2] == n]
        if alike:
            return (f"{where}: the {what} goes along {alike[0][1]} instead of {ax} (a = {placement.a}, "
                    f"c = {placement.c}, i = {cube.I})")
        same_axis = [k for k in extra if k[1] == ax and k[0] != op]
        if same_axis:
            return (f"{where}: the {what} ({op} along {ax}) is an {same_axis[0][0].replace('_', '-')} in your code: the "
                    f"3-D linear needs the {op.replace('_', '-')} there")
        return f"{where}: the {what} ({op} along {ax}, {n} bytes) is missing; you issue: {yours}"
    return f"{where}: extra calls {yours}: the 3-D linear has three in each direction"


# autograd's refusal of a gradient whose shape is not its input's (index 0: x, 1: the weight)
_BAD_GRAD = re.compile(r"invalid gradient at index ([01]) - got \[([\d, ]*)\] but expected shape compatible with "
                       r"\[([\d, ]*)\]")
_GRAD_FIX = {"0": ("input", "[b/q², s, d_in/q]", "reduce-scatter the gathered input gradient along a on dim 0 (the "
                   "batch rows), where the forward gathered x"),
             "1": ("weight", "[d_out/q, d_in/q²]", "reduce-scatter the gathered weight gradient along i on dim 1 "
                   "(the input columns), where the forward gathered the weight")}


def _named_gradient_shape(where: str, message: str) -> str:
    """autograd's refusal of a gradient of the wrong shape said as the block it should be,
    or `message` unchanged."""
    bad = _BAD_GRAD.search(message)
    if not bad:
        return message
    name, block, fix = _GRAD_FIX[bad.group(1)]
    return (f"{where}: your backward returns a {name} gradient of shape [{bad.group(2)}], the {name} block's is "
            f"[{bad.group(3)}] {block}: {fix}")


def _close(a, b) -> bool:
    return a.shape == b.shape and bool((a - b).abs().max() <= 1e-10 * b.abs().max().clamp_min(1e-30))


def _unit(comm, fn, placement, shape, case: int, watch: Tripwire) -> None:
    """One linear on `placement` against F.linear on the gathered tensors; raises LabError
    on every rank (the first rank's problem) when something is wrong (`watch`: armed
    while the learner's forward and backward run)."""
    b, s, d_in, d_out = shape
    X, W, B, dY, (Xr, Wr, Br) = _reference(shape)
    (xr, xc), (yr, yc), (wr, wc) = _blocks(comm, placement, b, d_in, d_out)
    x = X[xr][..., xc].clone().requires_grad_()
    w = W[wr][:, wc].clone().requires_grad_()
    bias = B[yc].clone().requires_grad_()
    tag = f"{placement.a}-{shape}"
    y = _learner_forward(comm, fn, placement, x, w, f"linear3d/{case}/fwd-raised-{tag}", watch)
    where = f"placement (a, c) = ({placement.a}, {placement.c}), x [b={b}, s={s}, {d_in}], W [{d_out}, {d_in}]"
    problem = _calls_problem(comm, placement, "fwd", shape, 8) or _output_problem(where, y, F.linear(X, W)[yr][..., yc])
    agree(comm, f"linear3d/{case}/fwd-{tag}", problem, 60)
    _learner_backward(comm, y, bias, dY[yr][..., yc], f"linear3d/{case}/bwd-raised-{tag}", where, watch)
    problem = _calls_problem(comm, placement, "bwd", shape, 8)
    checks = (("input", x.grad, Xr.grad[xr][..., xc], "reduce-scatter the gathered input gradient along a"),
              ("weight", w.grad, Wr.grad[wr][:, wc], "the gathered weight gradient holds this rank's batch "
               "block only: reduce-scatter it along i (dim 1)"))
    problem = problem or _gradient_problem(where, checks) or _bias_problem(comm, placement, where, bias, Br.grad[yc])
    agree(comm, f"linear3d/{case}/bwd-{tag}", problem, 60)


def _reference(shape) -> tuple:
    """The full float64 tensors of one case (X, W, bias, output gradient) and leaf copies
    of X, W, bias holding autograd's gradients of F.linear on one device."""
    b, s, d_in, d_out = shape
    g = torch.Generator().manual_seed(1234 + d_in * d_out)
    X = torch.randn(b, s, d_in, generator=g, dtype=torch.float64)
    W = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    B = torch.randn(d_out, generator=g, dtype=torch.float64)
    dY = torch.randn(b, s, d_out, generator=g, dtype=torch.float64)
    Xr, Wr, Br = X.clone().requires_grad_(), W.clone().requires_grad_(), B.clone().requires_grad_()
    F.linear(Xr, Wr, Br).backward(dY)
    return X, W, B, dY, (Xr, Wr, Br)


def _learner_forward(comm, fn, placement, x, w, key: str, watch: Tripwire):
    """The learner's forward on this rank's blocks, traced from a clear trace; a LabError
    it raises reaches every rank (through the ranks' agreement, `key`), with a hint when
    a block was gathered on the wrong dim."""
    comm.trace.records.clear()
    try:
        with comm.in_phase("fwd"), watch.armed():
            y = call("Linear3DFunction.forward", fn.apply, x, w, comm, placement.a, placement.c)
    except LabError as e:  # through the ranks' agreement: a rank whose code raised alone still reports
        said = str(e)
        if "shapes cannot be multiplied" in said:  # a block gathered on the wrong dim
            said += (f" — gathered on the wrong dim? x [b/q², s, d_in/q] is gathered along a on dim 0 (the batch) into "
                     f"[b/q, s, d_in/q], the weight [d_out/q, d_in/q²] along i on dim 1 (its input columns) into "
                     f"[d_out/q, d_in/q]")
        agree(comm, key, said, 60)
    agree(comm, key, "", 60)
    return y


def _output_problem(where: str, y, want_y) -> str:
    """'' when the learner's output `y` is this rank's block of F.linear(X, W)."""
    if not isinstance(y, torch.Tensor) or y.shape != want_y.shape:
        got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
        return (f"{where}: your forward returns {got}, this rank's output block is {tuple(want_y.shape)} "
                f"[b/q², s, d_out/q] in placement (c, a)")
    if not _close(y.detach(), want_y):
        return (f"{where}: your calls are right but the output differs from F.linear(X, W) on the gathered "
                f"tensors by {float((y.detach() - want_y).abs().max()):.3g}: the gathered weight block is "
                f"[d_out/q, d_in/q] (torch's [out, in]), so the local product is F.linear(x, w), not x @ w")
    return ""


def _learner_backward(comm, y, bias, dy, key: str, where: str, watch: Tripwire) -> None:
    """The learner's backward of ``y + bias`` from `dy`, traced from a clear trace; a
    LabError it raises reaches every rank (`key`), a gradient of the wrong shape named as
    the block it should be."""
    comm.trace.records.clear()
    try:
        with comm.in_phase("bwd"), watch.armed():
            out = y + bias
            call("Linear3DFunction.backward", out.backward, dy)
    except LabError as e:
        agree(comm, key, _named_gradient_shape(where, str(e)), 60)
    agree(comm, key, "", 60)


def _gradient_problem(where: str, checks) -> str:
    """'' when every (name, got, want, hint) gradient of `checks` is autograd's."""
    for name, got, want, hint in checks:
        if got is None:
            return f"{where}: your backward returns no {name} gradient (None)"
        if got.shape != want.shape:
            return (f"{where}: your {name} gradient has shape {tuple(got.shape)}, the {name}'s is "
                    f"{tuple(want.shape)}")
        if not _close(got, want):
            return (f"{where}: your {name} gradient differs from autograd's on one device by "
                    f"{float((got - want).abs().max()):.3g}: {hint}")
    return ""


def _bias_problem(comm, placement, where: str, bias, want) -> str:
    """'' when the bias gradient summed over the (i, c) plane is autograd's: the bias
    copies on that plane see the other batch blocks."""
    db = bias.grad.clone()
    for axis in (cube.I, placement.c):
        dist.all_reduce(db, group=comm.group(axis))  # aside, not traced
    if not _close(db, want):
        return (f"{where}: the bias gradient summed over the (i, c) plane differs from autograd's by "
                f"{float((db - want).abs().max()):.3g}: does your output block hold the "
                "right batch rows?")
    return ""


def _job(comm, source: str, timeout: float) -> dict | None:
    from ..train import Trainer

    case = next(_CASE)
    engine_linear = {"minitron.parallel.cube.Linear3D.forward": cube.Linear3D.forward}
    units = Tripwire({**engine_linear, **watched("minitron.parallel.cube.cube_product",
                                                 "minitron.parallel.tensor._AllGather",
                                                 "minitron.parallel.tensor._ReduceScatter")})
    with units.armed():
        fn = load(source, NAMES, learner_namespace())["Linear3DFunction"]
    for placement in (cube.FIRST, cube.SECOND):
        for shape in SHAPES:
            _unit(comm, fn, placement, shape, case, units)
    comm.trace.records.clear()
    with Tripwire(engine_linear).armed():  # the model's other layers use the engine's collectives
        tr = Trainer(MODEL, LAYOUT, TRAIN, comm, layers=cube.layers(linear=learner_linear(fn)))
        losses = [tr.step(i) for i in range(TRAIN.steps)]
    res = versus_one_device(comm, tr, losses, MODEL, TRAIN)
    verdict = training_verdict(res, "3-D linear", "your 3-D linear issues the analysis' three collectives in "
                               "each direction, equals F.linear and autograd on both placements, and trains a GPT "
                               "on the 2x2x2 cube exactly like the single-device model", TOL)
    if verdict is not None:
        calls = linear_calls(*SHAPES[0], comm.size(cube.I))
        verdict["calls"] = {DIRECTION[ph]: sum(c["calls"] for c in calls if c["phase"] == ph) for ph in DIRECTION}
    return verdict


def check_linear3d_all(sources: list, timeout: float = 90) -> list[dict]:
    """`check_linear3d` of several sources in as few launches of 8 ranks as their outcomes allow."""
    return run_sources(_job, LAYOUT, sources, timeout, timeout, forbidden=FORBIDDEN, names=NAMES)


def check_linear3d(source: str, timeout: float = 90) -> dict:
    """Lab 05: the learner's `Linear3DFunction` on 8 gloo ranks (q = 2): calls per
    direction vs ``analysis.cube.linear_calls``, output and input/weight/bias gradients vs
    ``F.linear`` and autograd (both placements, float64), then a 2-layer GPT on the cube with
    it, 2 float64 steps vs the single-device model. Returns {"ok", "message", "calls",
    "max_loss_abs_diff", "max_param_rel_diff"} or {"ok": False, "message"}."""
    try:
        return check_linear3d_all([source], timeout)[0]
    except Exception as e:  # a surprise in the checker itself
        return fail(describe(e))
