"""ZeRO-3's all-gather of FP8 weights: half the bytes of a bf16 gather, a quarter of fp32's.

Under tensorwise scaling the linear quantizes its weight with one scale from the whole
weight's amax before every GEMM. ZeRO-3 gathers that weight just before; gathering it
already quantized moves 1 byte an element instead of the working dtype's (torchao's
``enable_fsdp_float8_all_gather`` with ``precompute_float8_dynamic_scale_for_fsdp``;
Megatron-Core's ``--fp8-param-gather``). What must stay exact is the scale: it is the
single device's only if every rank quantizes its shard with the amax of the *whole*
weight, so a unit's gather starts with one all-reduce (MAX) of its weights' shard amaxes
over the data-parallel shards and over the tensor ranks that split each weight. The
weights do not change within a step, so that reduction runs once per unit per step (the
backward's re-gather reuses the scales).

Each rank then casts its shard ``fp8(clamp(w·s, ±448))`` (E4M3), all-gathers the bytes and
writes ``q / s`` into the unit's full buffer; the linear takes the scale from here
(``Fp8State.weight_scale``) instead of reducing the amax itself, and quantizing ``q / s``
with ``s`` gives back q: the GEMM sees the very operand one device quantizes. Master
weights, gradients and optimizer state stay in the working dtype; a checkpoint's gather
(``materialize``) gathers the exact values.
"""
from __future__ import annotations

import torch

from ..comm import Comm
from .fp8 import E4M3, W, Fp8State, Quantized, amax_to_scale, to_fp8


class Fp8WeightGather:
    """The FP8 gather of one ZeRO-3 unit whose parameters are all FP8 linears' weights.

    `weights`: ``[(offset in the unit's flat buffer, numel, Fp8State)]``; `k`: this rank's
    share of the unit (``numel / d``), starting at ``rank · k``; `axis`: the data axis the
    unit is sharded over."""

    def __init__(self, weights: list[tuple[int, int, Fp8State]], rank: int, k: int, comm: Comm, axis: str):
        self.weights, self.lo, self.k, self.comm = weights, rank * k, k, comm
        # the amax of a weight spans its shards over `axis` and the tensor ranks splitting it
        tp = {a for _, _, st in weights for a in st.shards.of(W, 0) + st.shards.of(W, 1)}
        self.axes = (axis, *sorted(tp))
        self.scales: list[torch.Tensor] | None = None  # this step's, once reduced

    def _pieces(self):
        """(weight index, slice of this rank's shard, slice of the weight's place) where
        each weight meets this rank's share of the unit."""
        for i, (off, n, _) in enumerate(self.weights):
            lo, hi = max(off, self.lo), min(off + n, self.lo + self.k)
            if lo < hi:
                yield i, slice(lo - self.lo, hi - self.lo)

    def _reduce_scales(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """Each weight's tensorwise scale from its global amax: one all-reduce (MAX) of the
        unit's shard amaxes per axis, in the working dtype (a MAX is exact in it)."""
        amax = torch.zeros(len(self.weights), dtype=shard.dtype, device=shard.device)
        for i, piece in self._pieces():
            amax[i] = shard[piece].detach().abs().amax()
        for a in self.axes:
            self.comm.all_reduce(amax, a, op="max")
        return [amax_to_scale(a, st.fmt(W)) for a, (_, _, st) in zip(amax, self.weights)]

    def encode(self, shard: torch.Tensor) -> torch.Tensor:
        """This rank's share of the unit (`shard`, k elements) as k FP8 bytes, each weight's
        piece at its scale (padding stays 0); the scales are reduced on the step's first call."""
        if self.scales is None:
            self.scales = self._reduce_scales(shard)
        out = torch.zeros(self.k, dtype=torch.uint8, device=shard.device)
        for i, piece in self._pieces():
            st = self.weights[i][2]
            out[piece] = to_fp8(shard[piece].detach(), self.scales[i], st.fmt(W)).view(torch.uint8)
        return out

    def decode(self, gathered: torch.Tensor, full: torch.Tensor) -> None:
        """The gathered bytes (the whole unit) into its full buffer as ``q / s``, and each
        linear handed its scale."""
        with torch.no_grad():
            for (off, n, st), s in zip(self.weights, self.scales):
                q = gathered[off:off + n].view(st.fmt(W))
                full[off:off + n] = Quantized(q, s).dequantize(full.dtype)
                st.weight_scale = s

    def release(self) -> None:
        """The unit freed: no linear keeps a scale for a weight that is not gathered."""
        for _, _, st in self.weights:
            st.weight_scale = None

    def new_step(self) -> None:
        """The weights may have changed (an optimizer step, a load): reduce the scales anew."""
        self.scales = None


def fp8_weights(units) -> dict:
    """{weight parameter: its Fp8State} of the linears in ZeRO `units` whose weights ZeRO-3
    gathers in FP8 (``Fp8State.weight_gathered``)."""
    out = {}
    for mod, _, _ in units:
        for m in mod.modules():
            st = getattr(m, "fp8", None)
            if isinstance(st, Fp8State) and st.weight_gathered:
                out[m.weight] = st
    return out


def split_fp8_units(units, weights: dict) -> list:
    """Each unit holding FP8-gathered `weights` as two units of the same module: its FP8
    weights (gathered in FP8), then the rest (in the working dtype); others unchanged."""
    out = []
    for mod, ps, kind in units:
        fp8 = [p for p in ps if p in weights]
        rest = [p for p in ps if p not in weights]
        out += [(mod, part, kind) for part in (fp8, rest) if part] if fp8 else [(mod, ps, kind)]
    return out


assert E4M3 is torch.float8_e4m3fn
