"""Random numbers for dropout under tensor parallelism, and their replay.

Where a dropout mask must agree across the tensor group and where it must not:

* **Outside** the tensor-parallel region (the embedding's dropout, the residual dropouts
  after attention and after the MLP) every tensor rank holds the same activations and
  must drop the same elements, or the replicas drift apart: a stream **shared** by the
  tensor group. With sequence parallelism a rank holds 1/t of the tokens and applies
  its shard of that shared mask.
* **Inside** the region (attention probabilities of this rank's heads) each rank holds
  different activations, and its mask must be independent of the other ranks': a
  **per-tensor-rank** stream.
* **Activation recomputation** must draw the very same masks again.

Megatron keeps two stateful CUDA generators (the default one, shared, and a "model
parallel" one seeded with seed + 2718 + tp_rank) and its checkpoint function saves and
restores both. minitron makes a mask a *pure function of its key* instead::

    keep = rand(shape, generator=Generator().manual_seed(H(seed, step, microbatch, site))) >= p

`site` names the layer and the place (``blocks.3.attn.probs``); the per-rank stream adds
the tensor rank to the key. There is nothing to save or restore: recomputation calls
the block again with the same key and draws the same mask, whatever the pipeline
schedule ran in between, and `torch.utils.checkpoint` needs no RNG bookkeeping.

Two modes (``ParallelConfig.dropout_rng``, ``--dropout-rng``):

* ``"tensor"`` (Megatron's; the default for ``minitron train``): a rank draws only the
  part of a mask it applies inside the region, from its own stream. Cheap, and the same
  model *in distribution*, but t = 2 drops other attention weights than t = 1, so a run
  is not bit-identical to one device.
* ``"global"`` (the default for ``minitron verify``): every mask is the single-device
  mask, drawn whole from the shared stream and sliced (heads inside the region). Equal to
  one device to float rounding at any t, at the price of t times the random numbers for
  the attention mask (b·a·s² per layer on every rank instead of b·a·s²/t).

Outside the region both modes draw the shared mask whole and, under ``--sp``, keep the
rank's sequence shard (b·s·h random numbers per site, as without ``--sp``). With t = 1
both modes are the single-device model. Masks are drawn in float32 on the activations'
device, so they do not depend on the dtype; a CUDA run draws other masks than a CPU run.
"""
from __future__ import annotations

import hashlib

import torch
from torch import nn

MODES = ("tensor", "global")


class DropoutRNG:
    """The dropout key of the microbatch being run, and masks drawn from it.

    Whatever runs a microbatch's forward (the Trainer; a pipeline runtime for each
    microbatch on each chunk) calls :meth:`begin` first; the model reads :meth:`key`
    once per forward and hands it to every layer as an argument, so a recomputed layer
    sees the key of its own microbatch whenever its backward runs.
    """

    def __init__(self, ctx):
        self.ctx = ctx  # seed, tensor degree and rank, and the layout's dropout_rng mode
        self.step = 0
        self.microbatch = 0

    def begin(self, step: int, microbatch: int) -> None:
        """Masks of the next forward: global step, and the microbatch's index in the
        global batch (data-parallel rank · microbatches + k: layout-independent)."""
        self.step, self.microbatch = step, microbatch

    def key(self) -> tuple[int, int]:
        return (self.step, self.microbatch)

    def seed(self, site: str, key, rank: int | None = None) -> int:
        """The 63-bit seed of one mask: a hash of (seed, step, microbatch, site[, rank])."""
        text = repr((self.ctx.seed, tuple(key), site, rank)).encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1

    def draw(self, site: str, key, shape, p: float, device, rank: int | None = None) -> torch.Tensor:
        g = torch.Generator(device=device).manual_seed(self.seed(site, key, rank))
        return torch.rand(tuple(shape), generator=g, dtype=torch.float32, device=device) >= p

    def keep_mask(self, site: str, key, shape, p: float, device, split_dim: int | None = None,
                  per_rank: bool = False) -> torch.Tensor:
        """Boolean keep-mask for a local tensor of `shape`.

        `split_dim`: the local tensor is this rank's 1/t slice of the full one along that
        dim (heads inside the region, the sequence under --sp); None: it is whole.
        `per_rank`: inside the region, where mode 'tensor' draws from the rank's stream.
        """
        t, r = self.ctx.tp, self.ctx.tp_rank
        if self.ctx.layout.tp_mode == "3d" and t > 1:  # every tensor is split on the cube
            from .cube import keep_mask

            return keep_mask(self, site, key, shape, p, device, inside=per_rank)
        if self.ctx.layout.tp_mode in ("2d", "2.5d") and t > 1:  # and on the SUMMA grid
            from .summa import keep_mask as summa_keep_mask

            return summa_keep_mask(self, site, key, shape, p, device, inside=per_rank)
        if split_dim is None or t == 1:
            return self.draw(site, key, shape, p, device)
        if per_rank and self.ctx.layout.dropout_rng == "tensor":
            return self.draw(site, key, shape, p, device, rank=r)
        full = list(shape)
        full[split_dim] *= t
        n = shape[split_dim]
        return self.draw(site, key, full, p, device).narrow(split_dim, r * n, n).contiguous()


class _Dropout(torch.autograd.Function):
    """y = x · keep / (1 − p), saving only the boolean mask (1 byte per element)."""

    @staticmethod
    def forward(ctx, x, keep, scale):
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return x * keep * scale

    @staticmethod
    def backward(ctx, dy):
        (keep,) = ctx.saved_tensors
        return dy * keep * ctx.scale, None, None


class Dropout(nn.Module):
    """Dropout at a named site. `inside=True`: inside the tensor-parallel region, dim 1
    of the input split over the tensor group (heads of [b, heads, s, s]); otherwise
    outside, the input whole or, under --sp, a shard of the sequence (dim 1 of [b, s, h])."""

    def __init__(self, site: str, p: float, ctx, inside: bool = False):
        super().__init__()
        self.site, self.p, self.ctx, self.inside = site, p, ctx, inside

    def forward(self, x, key=None):
        if not self.training or self.p == 0:
            return x
        key = self.ctx.rng.key() if key is None else key
        split = 1 if (self.inside or self.ctx.layout.sp) else None
        keep = self.ctx.rng.keep_mask(self.site, key, x.shape, self.p, x.device, split, per_rank=self.inside)
        return _Dropout.apply(x, keep, 1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"{self.site}, p={self.p}, {'inside' if self.inside else 'outside'} the region"
