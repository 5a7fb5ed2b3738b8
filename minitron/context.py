"""What a layer needs to know about the run: the grid, the communication door, the
layout, the dtype and the seed. One object, passed down at construction (no globals).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch

from .comm import Comm
from .config import DTYPES, ParallelConfig

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPES}  # --dtype's tensors


@dataclass
class Context:
    comm: Comm = field(default_factory=Comm)
    layout: ParallelConfig = field(default_factory=ParallelConfig)
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    seed: int = 1234
    init: str = "global"  # "global": draw the full tensor and slice; "shard": draw the local shard
    # saved-tensor hooks the step runs under (a memory meter's), which activation
    # recomputation applies to what it saves again in the backward (Trainer.step sets it)
    saved_tensors: tuple | None = None
    # microbatches of a step on each data replica: a microbatch's loss enters the step's
    # objective with weight 1/m, and so do the auxiliary losses of its MoE blocks
    microbatches: int = 1

    def autocast(self):
        """bf16 compute with fp32 master weights (--precision bf16): autocast on the run's
        device; a no-op context in fp32."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.layout.precision == "bf16")

    @property
    def grid(self):
        return self.comm.grid

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def tp_rank(self) -> int:
        return self.comm.index("tp")


@dataclass(frozen=True)
class ShardInfo:
    """Where a local parameter sits in the full (single-device) tensor.

    `name` is the parameter's layout-independent name; `full_shape` the logical shape;
    `slices` the region of the full tensor this rank holds (the local tensor may be
    larger: padded vocabulary rows lie beyond the region); `replicas` the axes over
    which identical copies live (gradient norms count one copy); `grad_sync` the axes
    over which gradients must be summed before the optimizer step (e.g. LayerNorm
    under sequence parallelism, the tied embedding between first and last stage);
    `data_axes` the axes whose ranks hold the same values and see different tokens, over
    which the gradient is averaged (every dense parameter: dp, cp and ep; an expert,
    split over ep: dp and cp only; ``ProcessGrid.data_axis`` names the group).
    """

    name: str
    full_shape: tuple
    slices: tuple
    replicas: tuple = ()
    grad_sync: tuple = ()
    data_axes: tuple = ("dp", "cp", "ep")

    @property
    def local_region(self) -> tuple:
        return tuple(slice(0, s.stop - s.start) for s in self.slices)


def param_seed(seed: int, name: str) -> int:
    """A per-parameter seed: weights never depend on how many ranks build the model."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def init_full(name: str, shape, std: float, ctx: Context, kind: str = "normal") -> torch.Tensor:
    """The full (unsharded) initial value of parameter `name`, from its own RNG stream
    (on the meta device, only its shape: the model's description without its values)."""
    if torch.device(ctx.device).type == "meta":
        return torch.empty(shape, dtype=ctx.dtype, device="meta")
    if kind == "zeros":
        return torch.zeros(shape, dtype=ctx.dtype, device=ctx.device)
    if kind == "ones":
        return torch.ones(shape, dtype=ctx.dtype, device=ctx.device)
    g = torch.Generator().manual_seed(param_seed(ctx.seed, name))
    return (torch.randn(shape, generator=g, dtype=torch.float64) * std).to(ctx.dtype).to(ctx.device)


def make_param(name: str, full_shape, slices, ctx: Context, std: float = 0.02, kind: str = "normal",
               local_shape=None, replicas=(), grad_sync=(), data_axes=("dp", "cp", "ep")) -> torch.nn.Parameter:
    """Create the local shard of parameter `name`: the full tensor's `slices`, zero-padded
    up to `local_shape`. Tags the parameter with its :class:`ShardInfo`."""
    full_shape = tuple(full_shape)
    slices = tuple(slices) + tuple(slice(0, n) for n in full_shape[len(slices):])
    region = tuple(s.stop - s.start for s in slices)
    local_shape = tuple(local_shape or region)
    if ctx.init == "shard" and kind == "normal":
        shard_name = name + "|" + ",".join(f"{s.start}:{s.stop}" for s in slices)
        value = init_full(shard_name, region, std, ctx, kind)
    else:
        value = init_full(name, full_shape, std, ctx, kind)[slices]
    local = torch.zeros(local_shape, dtype=ctx.dtype, device=ctx.device)
    local[tuple(slice(0, r) for r in region)] = value
    p = torch.nn.Parameter(local)
    p.shard = ShardInfo(name, full_shape, slices, tuple(replicas), tuple(grad_sync), tuple(data_axes))
    return p


def shard_slice(n: int, parts: int, index: int) -> slice:
    """The index-th of `parts` equal contiguous pieces of range(n)."""
    size = n // parts
    return slice(index * size, (index + 1) * size)
