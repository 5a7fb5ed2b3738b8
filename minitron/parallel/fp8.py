"""FP8 linears (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"): the recipes of
today's H100 and Blackwell runs, emulated exactly on a CPU, the real kernel on a GPU.

Formats. E4M3 (``torch.float8_e4m3fn``: max 448, no infinities, 3 mantissa bits) for
weights and activations; E5M2 (``torch.float8_e5m2``: max 57,344, 2 mantissa bits) where
gradients need range. A tensor is *quantized* as ``q = fp8(clamp(x·s, ±max))`` with a scale
s, and *dequantized* as ``q / s``. The scale (torchao's ``amax_to_scale``) is
``s = max_fp8 / max(amax, 1e-12)``, computed in float64 and kept in float32, as the scales
an FP8 GEMM takes; values beyond ±max saturate.

Recipes (``--fp8-recipe``), one :class:`Recipe` each:

* ``tensorwise``: one scale per tensor from its current amax (torchao's default, TE's
  "current scaling"); E4M3 forward, E5M2 for the output gradient.
* ``delayed``: one scale per tensor from an amax *history* (Transformer Engine's
  ``DelayedScaling``: ``amax_history_len`` = 1,024 steps, ``amax_compute_algo="max"``,
  margin 0; scale 1 while the history is empty). A step quantizes with the scale of the
  history before it and records its amaxes (max over its microbatches); at the step's end
  they are reduced over every rank that shares the tensors and pushed into the history
  (TE's roll: newest first). Output gradients are recorded and scaled in the units of the
  global loss's gradient (a data replica's or context rank's loss is the mean of its share),
  so that the history, and every scale from it, is the single device's. The history is a parameter without gradient, so checkpoints
  keep it and a resume is exact. E4M3 forward, E5M2 backward (TE's ``Format.HYBRID``).
* ``rowwise``: one scale per row of each GEMM operand along that GEMM's reduction dim
  (torchao's ``rowwise``: axiswise, E4M3 everywhere, scales floored to a power of two).
* ``mxfp8``: the OCP Microscaling spec v1.0: blocks of 32 consecutive elements along the
  reduction dim, one shared E8M0 scale per block, ``X = 2^(floor(log2 amax) − 8)`` (8: the
  exponent of E4M3's largest normal, the spec's §6.3 rounding), elements ``fp8(x / X)``
  saturated; E4M3 everywhere (TE's ``MXFP8BlockScaling`` default).

The GEMM. The emulation multiplies the dequantized operands in the working dtype (float64
under ``--dtype float64``: exact products of FP8 grid values, only the accumulation rounds),
which is what an FP8 GEMM with wide accumulation computes. On a GPU with FP8
(``torch._scaled_mm``, compute capability 8.9+) tensorwise and rowwise run the real kernel
on the same quantized operands.

Layouts. A scale must not depend on the layout, so every layout quantizes exactly as one
device. Where the tensor's rows or columns an amax spans are split over ranks (tokens over
``cp``; a column-parallel weight's rows and its output gradient over ``tp``; a
row-parallel weight's columns and its input over ``tp``) the amax is all-reduced (MAX) over
those axes through ``Comm`` (:class:`Shards`). Rowwise amaxes along an unsplit dim and MX
blocks inside a shard are local by construction (``config.validate`` refuses a shard that
would split a block). Embedding, output layer, router, norms and the routed experts stay in
the working dtype.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..comm import Comm
from ..config import FP8_RECIPES, MX_BLOCK, ParallelConfig
from ..context import Context, make_param
from .ops import wants_grad

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12  # torchao's floor on an amax: an all-zero tensor gets a finite scale
AMAX_HISTORY_LEN = 1024  # Transformer Engine's DelayedScaling default
MX_EMAX = 8  # the exponent of E4M3's largest normal (448 = 1.75 * 2^8)
X, W, DY = 0, 1, 2  # the three tensors of a linear: rows of a delayed history


@dataclass(frozen=True)
class Recipe:
    """What a recipe quantizes how: `granularity` 'tensor', 'row' or 'block' (MX);
    `forward` the format of inputs and weights, `grad` of the output gradient; `pow2`
    scales floored to a power of two; `delayed` scales from the amax history."""

    name: str
    granularity: str
    forward: torch.dtype = E4M3
    grad: torch.dtype = E5M2
    pow2: bool = False
    delayed: bool = False


RECIPES = {
    "tensorwise": Recipe("tensorwise", "tensor"),
    "delayed": Recipe("delayed", "tensor", delayed=True),
    "rowwise": Recipe("rowwise", "row", grad=E4M3, pow2=True),
    "mxfp8": Recipe("mxfp8", "block", grad=E4M3),
}


# --- quantization: the one home of the numerics ----------------------------------------
def amax_to_scale(amax: torch.Tensor, fmt: torch.dtype, pow2: bool = False) -> torch.Tensor:
    """max_fp8 / max(amax, 1e-12) in float64, kept in float32 (torchao's convention);
    `pow2`: floored to a power of two (torchao's rowwise)."""
    s = (torch.finfo(fmt).max / amax.double().clamp_min(EPS)).float()
    return torch.exp2(torch.floor(torch.log2(s))) if pow2 else s


def wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor is scaled in before the cast: float32, float64 kept."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def to_fp8(x: torch.Tensor, scale: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """fp8(clamp(x·scale, ±max)): saturated, round to nearest even."""
    top = torch.finfo(fmt).max
    return (x.to(wide(x.dtype)) * scale.to(wide(x.dtype))).clamp(-top, top).to(fmt)


@dataclass
class Quantized:
    """An FP8 tensor and its scales: ``data / scale`` (tensor, row), or for MX blocks of
    32 along `dim`, ``data · scale`` with one E8M0 `scale` per block."""

    data: torch.Tensor
    scale: torch.Tensor
    mx_dim: int | None = None

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        if self.mx_dim is None:
            return self.data.to(dtype) / self.scale.to(dtype)
        per_element = self.scale.to(dtype).repeat_interleave(MX_BLOCK, dim=self.mx_dim)
        return self.data.to(dtype) * per_element


def quantize_scaled(x: torch.Tensor, amax: torch.Tensor, fmt: torch.dtype, pow2: bool = False) -> Quantized:
    """x with the scale of `amax` (a scalar, or one per row broadcasting against x)."""
    scale = amax_to_scale(amax, fmt, pow2)
    return Quantized(to_fp8(x, scale, fmt), scale)


def tensorwise_format(role: str) -> torch.dtype:
    """The format tensorwise scaling quantizes a linear's `role` in ('input', 'weight',
    'grad', the output gradient): E4M3 forward, E5M2 where gradients need range."""
    r = RECIPES["tensorwise"]
    return r.grad if role == "grad" else r.forward


def tensorwise_quantize(x: torch.Tensor, amax: torch.Tensor, fmt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(the FP8 values, the scale) of x with the scale of `amax`: :func:`quantize_scaled`."""
    q = quantize_scaled(x, amax, fmt)
    return q.data, q.scale


def mx_scale(amax: torch.Tensor) -> torch.Tensor:
    """OCP MX v1.0's shared scale of a block: 2^(floor(log2 amax) − emax_E4M3), in E8M0
    (exponents −127..127; an all-zero block takes the smallest)."""
    _, e = torch.frexp(amax)  # amax = m·2^e, m in [0.5, 1): floor(log2 amax) = e − 1, exactly
    e = torch.where(amax > 0, e - 1 - MX_EMAX, -127).clamp(-127, 127)
    return torch.exp2(e.to(torch.float32)).to(torch.float8_e8m0fnu)


def quantize_mx(x: torch.Tensor, dim: int) -> Quantized:
    """MXFP8: blocks of 32 along `dim` (x.shape[dim] a multiple of 32), E4M3 elements."""
    dim = dim % x.dim()
    blocks = x.unflatten(dim, (-1, MX_BLOCK))
    scale = mx_scale(blocks.abs().amax(dim + 1))
    inv = scale.to(wide(x.dtype)).reciprocal().unsqueeze(dim + 1)  # exact: a power of two
    return Quantized(to_fp8(blocks, inv, E4M3).flatten(dim, dim + 1), scale, dim)


def gathers_fp8_weights(layout: ParallelConfig) -> bool:
    """ZeRO-3 all-gathers the FP8 linears' weights in FP8 (1 byte an element, with one
    scale per weight from an amax reduction) under tensorwise scaling: torchao's
    ``enable_fsdp_float8_all_gather`` with precomputed scales. The other recipes gather
    in the working dtype: delayed's weight amax feeds its history, rowwise's and MX's
    scales follow rows and blocks that ZeRO's flat shards cut across."""
    return layout.precision == "fp8" and layout.fp8_recipe == "tensorwise" and layout.zero == 3


# --- which ranks share a tensor ---------------------------------------------------------
@dataclass(frozen=True)
class Shards:
    """The grid axes that split each dim of a linear's GEMMs: `tokens` (the rows of X and
    dY: 'cp' under context parallelism), `k` (the input features: 'tp' for a row-parallel
    linear), `m` (the output features: 'tp' for a column-parallel one). An amax over a dim
    is all-reduced (MAX) over its axes."""

    tokens: tuple = ()
    k: tuple = ()
    m: tuple = ()

    def of(self, tensor: int, dim: int) -> tuple:
        """The axes splitting `dim` of tensor X [tokens, k], W [m, k] or dY [tokens, m]."""
        return ((self.tokens, self.k), (self.m, self.k), (self.tokens, self.m))[tensor][dim]


def global_amax(x: torch.Tensor, comm: Comm, axes, dims=None) -> torch.Tensor:
    """max|x| over `dims` (all: a scalar; else kept as size-1 dims), all-reduced (MAX) over
    the `axes` that split them: the amax the single device sees."""
    a = x.detach().abs().amax() if dims is None else x.detach().abs().amax(dims, keepdim=True)
    a = a.contiguous()
    for axis in axes:
        comm.all_reduce(a, axis, op="max")
    return a


ROLES = ("input", "weight", "grad")  # X, W, DY as tensorwise's `fmt` names them


@dataclass(frozen=True)
class TensorScaling:
    """Tensorwise (current) scaling's three steps, as functions: the engine's by default;
    lab 07a hands a learner's to ``tensor.layers(fp8_scaling=...)`` (nothing is patched).
    `amax(x, comm, axes)`: max|x| of the single-device tensor; `quantize(x, amax, fmt)`:
    (the FP8 values, the float32 scale); `fmt(role)`: the format of 'input', 'weight', 'grad'."""

    amax: Callable = global_amax
    quantize: Callable = tensorwise_quantize
    fmt: Callable = tensorwise_format


class Fp8State(nn.Module):
    """One linear's FP8 scaling: its recipe, the axes that split its tensors and, under
    ``delayed``, its amax history [3, 1024] (rows X, W, dY; newest first; a parameter
    without gradient, replicated, so the checkpoint holds it) and this step's amaxes."""

    def __init__(self, name: str, recipe: str, shards: Shards, ctx: Context, scaling: TensorScaling | None = None):
        super().__init__()
        self.recipe, self.shards, self.comm = RECIPES[recipe], shards, ctx.comm
        self.scaling = scaling or TensorScaling()  # tensorwise's steps (a lab's, or the engine's)
        # ZeRO-3 all-gathers this weight in FP8 (parallel/fp8_gather.py): the gather computes
        # its scale and hands it over (`weight_scale`, set while the weight is gathered)
        self.weight_gathered = gathers_fp8_weights(ctx.layout)
        self.weight_scale: torch.Tensor | None = None
        self.amax_history = None
        if self.recipe.delayed:
            self.amax_history = make_param(f"{name}.amax_history", (3, AMAX_HISTORY_LEN), (), ctx, kind="zeros",
                                      replicas=("tp",) if ctx.tp > 1 else ())
            self.amax_history.requires_grad_(False)
            self.step_amax = torch.zeros(3, dtype=torch.float64, device=ctx.device)
            # a rank's loss is its share's mean: its output gradients are (replicas · cp) times
            # those of the global loss, which the history records (as one device sees them)
            self.grad_unit = float(ctx.layout.data_replicas * ctx.layout.cp)

    def fmt(self, tensor: int) -> torch.dtype:
        if self.recipe.name == "tensorwise":
            return self.scaling.fmt(ROLES[tensor])
        return self.recipe.grad if tensor == DY else self.recipe.forward

    def tensor_scaled(self, x: torch.Tensor, tensor: int, record: bool) -> Quantized:
        """Tensorwise or delayed: the scale of the whole (single-device) tensor."""
        if tensor == W and self.weight_gathered:
            return self.gathered_weight(x)
        if not self.recipe.delayed:
            axes = tuple(dict.fromkeys(self.shards.of(tensor, 0) + self.shards.of(tensor, 1)))
            s = self.scaling
            return Quantized(*s.quantize(x, s.amax(x, self.comm, axes), self.fmt(tensor)))
        unit = self.grad_unit if tensor == DY else 1.0
        if record:  # this rank's amax; reduced over the sharing ranks at the step's end
            self.step_amax[tensor] = torch.maximum(self.step_amax[tensor], x.detach().abs().amax().double() / unit)
        past = self.amax_history[tensor].max()  # scale 1 while the history is empty (TE's initial scale)
        scale = torch.where(past > 0, amax_to_scale(past, self.fmt(tensor)), 1.0) / unit
        return Quantized(to_fp8(x, scale, self.fmt(tensor)), scale)

    def gathered_weight(self, w: torch.Tensor) -> Quantized:
        """The weight ZeRO-3 gathered in FP8: its values lie on the grid of the scale the
        gather computed from the whole weight's amax, so quantizing them again with that
        scale gives back the gathered bytes. A dry run (the analysis) has no gather: it
        takes the scale of its fake weight, with no communication, as the gather's own
        amax reduction is counted with ZeRO's calls."""
        scale = self.weight_scale
        if scale is None:
            if not self.comm.dry:
                raise RuntimeError("an FP8 weight that ZeRO-3 gathers in FP8 was used without its gather's scale")
            scale = amax_to_scale(w.detach().abs().amax(), self.fmt(W))
        return Quantized(to_fp8(w, scale, self.fmt(W)), scale)

    @staticmethod
    def requantize(x: torch.Tensor, scale: torch.Tensor, fmt: torch.dtype) -> Quantized:
        """x quantized again in `fmt` with the scale its forward computed (the backward
        keeps x in the working dtype, not its FP8 copy)."""
        return Quantized(to_fp8(x, scale, fmt), scale)

    def along(self, x: torch.Tensor, tensor: int, dim: int) -> Quantized:
        """Rowwise or MX: `tensor` x (2-D, as X [tokens, k], W [m, k], dY [tokens, m])
        quantized along its `dim`, the GEMM's reduction dim, and laid out with that dim
        last (transposed when it is 0), ready for :func:`gemm`."""
        if self.recipe.granularity == "block":
            q = quantize_mx(x, dim)
        else:
            amax = global_amax(x, self.comm, self.shards.of(tensor, dim), dims=dim)
            q = quantize_scaled(x, amax, self.fmt(tensor), pow2=self.recipe.pow2)
        return transpose(q) if dim == 0 else q

    @torch.no_grad()
    def roll(self, amax: torch.Tensor) -> None:
        """Delayed: push the step's reduced amaxes [3] into the history (newest first)."""
        self.amax_history.copy_(torch.cat([amax.to(self.amax_history.dtype)[:, None], self.amax_history[:, :-1]], 1))
        self.step_amax.zero_()


# --- the GEMM: real kernel where there is one, else the exact emulation ---------------
def has_fp8_kernel(t: torch.Tensor) -> bool:
    """A GPU with FP8 tensor cores and ``torch._scaled_mm`` (compute capability 8.9+)."""
    return (t.is_cuda and hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(t.device) >= (8, 9))


def gemm(a: Quantized, b: Quantized, dtype: torch.dtype) -> torch.Tensor:
    """a [r, k] · bᵀ (b [c, k]), both quantized along k: ``torch._scaled_mm`` on an FP8
    GPU (tensor and row scales, k a multiple of 16), else the dequantized product in
    `dtype` (exact products, wide accumulation)."""
    dims_ok = a.data.shape[1] % 16 == 0 and b.data.shape[0] % 16 == 0
    if has_fp8_kernel(a.data) and a.mx_dim is None and dims_ok and dtype != torch.float64:
        rowwise = a.scale.dim() > 0
        out = torch.bfloat16 if rowwise else dtype
        sa = a.scale.float().reciprocal().reshape(-1, 1) if rowwise else a.scale.float().reciprocal()
        sb = b.scale.float().reciprocal().reshape(1, -1) if rowwise else b.scale.float().reciprocal()
        return torch._scaled_mm(a.data.contiguous(), b.data.contiguous().t(), scale_a=sa, scale_b=sb,
                                out_dtype=out).to(dtype)
    return a.dequantize(dtype) @ b.dequantize(dtype).t()


class _Fp8Linear(torch.autograd.Function):
    """Y = X Wᵀ with both quantized per the recipe; backward dX = dY W and dW = dYᵀ X with
    dY quantized too (E5M2 under tensorwise and delayed). Tensor scales are computed once
    and reused by the backward; rowwise and MX operands are quantized along each GEMM's
    own reduction dim (torchao's axiswise casts). Saves X and W in the working dtype."""

    @staticmethod
    def forward(fctx, x, weight, state: Fp8State, record: bool):
        x2 = x.reshape(-1, x.shape[-1])
        fctx.state, fctx.shape = state, x.shape
        if state.recipe.granularity == "tensor":
            xq, wq = state.tensor_scaled(x2, X, record), state.tensor_scaled(weight, W, record)
            fctx.scales = (xq.scale, wq.scale)
        else:
            xq, wq = state.along(x2, X, 1), state.along(weight, W, 1)
        fctx.save_for_backward(x2, weight)
        return gemm(xq, wq, x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(fctx, dy):
        x2, weight = fctx.saved_tensors
        state, dx, dw = fctx.state, None, None
        dy2 = dy.reshape(-1, dy.shape[-1])
        want_dx, want_dw = wants_grad(fctx, 0), wants_grad(fctx, 1)
        if state.recipe.granularity == "tensor":
            dyq = state.tensor_scaled(dy2, DY, record=True)
            sx, sw = fctx.scales
            xq, wq = state.requantize(x2, sx, state.fmt(X)), state.requantize(weight, sw, state.fmt(W))
            if want_dx:
                dx = gemm(dyq, transpose(wq), dy.dtype)
            if want_dw:
                dw = gemm(transpose(dyq), transpose(xq), dy.dtype)
        else:
            if want_dx:  # reduction over the output features
                dx = gemm(state.along(dy2, DY, 1), state.along(weight, W, 0), dy.dtype)
            if want_dw:  # reduction over the tokens
                dw = gemm(state.along(dy2, DY, 0), state.along(x2, X, 0), dy.dtype)
        dx = dx.reshape(fctx.shape) if dx is not None else None
        return dx, dw, None, None


def transpose(q: Quantized) -> Quantized:
    """A quantized 2-D operand transposed, with its scales (one, per row, or per block)."""
    scale = q.scale.t() if q.scale.dim() == 2 else q.scale
    return Quantized(q.data.t().contiguous(), scale, None if q.mx_dim is None else 1 - q.mx_dim)


def fp8_linear(x, weight, bias, state: Fp8State, record: bool = True):
    """F.linear(x, weight, bias) with the GEMMs in FP8 per `state`'s recipe; the bias in
    the working dtype. `record`: a training forward (delayed records its amaxes)."""
    y = _Fp8Linear.apply(x, weight, state, record)
    return y if bias is None else y + bias


def fp8_state(name: str, ctx: Context, k_split: bool = False, m_split: bool = False,
              scaling: TensorScaling | None = None) -> Fp8State | None:
    """The FP8 state of linear `name` under ``--precision fp8`` (None otherwise): its input
    features split over tp (`k_split`, row-parallel) or its output features
    (`m_split`, column-parallel), its tokens over cp; `scaling`: tensorwise's steps."""
    if ctx.layout.precision != "fp8":
        return None
    tp = ("tp",) if ctx.tp > 1 else ()
    shards = Shards(tokens=("cp",) if ctx.layout.cp > 1 else (), k=tp if k_split else (), m=tp if m_split else ())
    return Fp8State(name, ctx.layout.fp8_recipe, shards, ctx, scaling)


# --- delayed scaling's step end -------------------------------------------------------
def delayed_states(chunks) -> list[Fp8State]:
    """The delayed-scaling states of model `chunks`, in module order."""
    return [m for c in chunks for m in c.modules() if isinstance(m, Fp8State) and m.recipe.delayed]


def history_axes(sizes: dict) -> tuple:
    """The axes (of a grid's `sizes`) whose ranks share a linear's tensors (tensor shards,
    sequence chunks, data replicas): a step's amaxes are reduced over them, one all-reduce
    (MAX) of :func:`history_reduce_bytes` each."""
    return tuple(a for a in ("tp", "cp", "ep", "dp") if sizes.get(a, 1) > 1)


def end_step(chunks, comm: Comm) -> None:
    """Delayed scaling at a step's end: every linear's amaxes of the step [n, 3], one
    all-reduce (MAX) per sharing axis (:func:`history_axes`), then each history rolls."""
    states = delayed_states(chunks)
    if not states:
        return
    amax = torch.stack([s.step_amax for s in states])
    for axis in history_axes(comm.grid.sizes()):
        comm.all_reduce(amax, axis, op="max")
    for s, a in zip(states, amax):
        s.roll(a)


def history_reduce_bytes(n_linears: int) -> int:
    """Bytes of one delayed step-end all-reduce per axis: n linears × 3 float64 amaxes."""
    return n_linears * 3 * 8


def describe(recipe: str) -> str:
    """One line on a recipe's formats and scales (the run report, docs)."""
    r = RECIPES[recipe]
    gran = {"tensor": "one scale per tensor", "row": "one scale per row",
            "block": f"one E8M0 scale per {MX_BLOCK} elements"}[r.granularity]
    names = {E4M3: "E4M3", E5M2: "E5M2"}
    hist = f", amax history of {AMAX_HISTORY_LEN} steps (max)" if r.delayed else ""
    return f"{recipe}: {gran}{hist}; {names[r.forward]} forward, {names[r.grad]} gradients"


assert tuple(RECIPES) == FP8_RECIPES
assert math.isclose(torch.finfo(E4M3).max, 448.0) and math.isclose(torch.finfo(E5M2).max, 57344.0)
