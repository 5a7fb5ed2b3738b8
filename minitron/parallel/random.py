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
the tensor rank to the key. The key (step, microbatch) is an argument of the model's
forward (``GPT.forward(x, targets, key)``), handed down to every layer: there is nothing
to save or restore, recomputation calls the block again with the same key and draws the
same mask, whatever the pipeline schedule ran in between, and recomputation
(``minitron/recompute.py``) needs no RNG bookkeeping.

This module knows no tensor-parallel scheme. Which part of a mask a rank draws is the
layer namespace's ``keep_mask(ctx, site, key, shape, p, device, inside)``: 1-D in
``parallel/tensor.py``, the cube's in ``parallel/cube.py``, the SUMMA grid's in
``parallel/summa.py``; each draws with :func:`draw` below.

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
NO_KEY = (0, 0)  # the key of a forward that names none (step 0, microbatch 0)


def mask_seed(seed: int, site: str, key, rank: int | None = None) -> int:
    """The 63-bit seed of one mask: a hash of (seed, step, microbatch, site[, rank])."""
    text = repr((seed, tuple(key), site, rank)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def draw(seed: int, site: str, key, shape, p: float, device, rank: int | None = None) -> torch.Tensor:
    """A boolean keep-mask of `shape` (True with probability 1 - p), a pure function of
    (seed, key, site[, rank]); drawn in float32 on `device`."""
    g = torch.Generator(device=device).manual_seed(mask_seed(seed, site, key, rank))
    return torch.rand(tuple(shape), generator=g, dtype=torch.float32, device=device) >= p


class _Dropout(torch.autograd.Function):
    """y = x · keep / (1 − p), saving only the boolean mask (1 byte per element)."""

    @staticmethod
    def forward(fctx, x, keep, scale):
        fctx.save_for_backward(keep)
        fctx.scale = scale
        return x * keep * scale

    @staticmethod
    def backward(fctx, dy):
        (keep,) = fctx.saved_tensors
        return dy * keep * fctx.scale, None, None


class Dropout(nn.Module):
    """Dropout at a named site. `keep_mask`: the layer namespace's (which part of the mask
    this rank draws); `inside=True`: inside the tensor-parallel region (the attention
    probabilities of this rank's heads), else outside it."""

    def __init__(self, site: str, p: float, ctx, keep_mask, inside: bool = False):
        super().__init__()
        self.site, self.p, self.ctx, self.keep_mask, self.inside = site, p, ctx, keep_mask, inside

    def forward(self, x, key=NO_KEY):
        """`key`: the microbatch's dropout key (step, microbatch of the global batch)."""
        if not self.training or self.p == 0:
            return x
        keep = self.keep_mask(self.ctx, self.site, key, x.shape, self.p, x.device, self.inside)
        return _Dropout.apply(x, keep, 1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"{self.site}, p={self.p}, {'inside' if self.inside else 'outside'} the region"
