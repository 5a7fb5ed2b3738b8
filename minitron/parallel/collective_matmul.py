"""Decomposed collective matmuls: communication hidden under the matmul it feeds
(Wang et al. 2022, "Overlap communication with dependent computation via decomposition in
large deep learning models"; PyTorch's async tensor parallelism, torchtitan's micro-pipelined
all-gather-matmul and matmul-reduce-scatter). ``--tp-overlap``, with ``--sp`` on 1-D tensor
parallelism.

Sequence parallelism's all-gather before a column-parallel linear and reduce-scatter after a
row-parallel one each wait for the whole collective before (or after) the matmul. Both split
along the sequence into the t shards of the tensor group, and a ring of t−1 point-to-point
steps (``Comm.shift``) moves one shard per step while the matmul of another runs:

* **all-gather-matmul** ``Y = [X_0 … X_{t−1}]·Aᵀ``: rank r starts with its own shard; at
  step k it posts the shift that brings shard r−k−1 from rank r−1 (and passes on the shard
  it holds), then multiplies shard r−k, and waits for the shift only when it needs the next
  shard (:func:`ring_gather`).
* **matmul-reduce-scatter** ``Z_r = Σ_j (X·Aᵀ)_j[chunk r]``: at step k rank r multiplies
  the chunk r+k+1 of its partial product, adds the running sum that rank r+1 sent, and sends
  the total on to rank r−1 while it multiplies the next chunk; after t steps the running sum
  of chunk r is complete on rank r (:func:`pass_on`).

The backward is decomposed likewise: the column-parallel linear's input gradient is a
matmul-reduce-scatter of dY·A and its weight gradient is summed chunk by chunk from the
input shards gathered again around the ring (both rings in one loop, in opposite
directions, told apart by their tags); the row-parallel linear's backward all-gathers dZ
around the ring, each arriving chunk multiplied for dX and for dW at once.

Bytes: a ring all-gather of t−1 steps sends (t−1) shards of N/t out of each rank, the
(t−1)/t·N of the collective it replaces; a ring reduce-scatter sends (t−1) chunks of N/t,
again (t−1)/t·N. What changes is the number of messages (t−1 sends and receives instead of
one call), not the bytes (``analysis/tensor_parallel.py``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .ops import wants_grad

AXIS, SEQ = "tp", 1  # the tensor group; the sequence dimension of [b, s, ·] activations
GATHER_TAG, SUM_TAG = 0, 1  # the two rings of a backward run at once between the same ranks


def ring_gather(x: torch.Tensor, comm, what: str):
    """Yield ``(c, X_c)`` for every rank c of the tensor group, this rank's own shard
    first: the shift that brings the next shard is posted *before* the current one is
    yielded, so it is in flight while the caller multiplies, and waited for only when the
    caller asks for the next (Wang et al. 2022, Fig. 4)."""
    n, r = comm.size(AXIS), comm.index(AXIS)
    held = x
    for k in range(n):
        coming = comm.shift(held, AXIS, 1, GATHER_TAG, labels={"collective": what, "chunk": k}) if k < n - 1 else None
        yield (r - k) % n, held
        held = coming.wait() if coming is not None else None


def scatter_order(comm) -> list[int]:
    """The chunks a rank multiplies in a ring reduce-scatter, in order: r+1, r+2, …, r (mod t),
    so that its own chunk, complete, comes last."""
    n, r = comm.size(AXIS), comm.index(AXIS)
    return [(r + k + 1) % n for k in range(n)]


def pass_on(comm, partial: torch.Tensor, arriving, k: int, what: str):
    """Step k of a ring reduce-scatter: this rank's `partial` product plus the running sum
    `arriving` from rank r+1 (a Pending, None at the first step), sent on to rank r−1.
    Returns ``(result, pending)``: at the last step the result (this rank's chunk, summed
    over the group) and None; before it None and the shift in flight."""
    total = partial if arriving is None else partial + arriving.wait()
    if k == comm.size(AXIS) - 1:
        return total, None
    return None, comm.shift(total, AXIS, -1, SUM_TAG, labels={"collective": what, "chunk": k})


class AllGatherMatmul(torch.autograd.Function):
    """Y = all-gather(X_r)·Aᵀ + b decomposed (``--tp-overlap``): the column-parallel entry of
    sequence parallelism, each shard multiplied while the next one travels. Saves the shard
    X_r only, as ``tensor._AllGatherLinear`` does."""

    @staticmethod
    def forward(fctx, x, weight, bias, comm):
        fctx.comm, fctx.has_bias = comm, bias is not None
        fctx.save_for_backward(x, weight)
        out = [None] * comm.size(AXIS)
        for c, xc in ring_gather(x, comm, "all_gather"):
            out[c] = F.linear(xc, weight, bias)
        return torch.cat(out, SEQ)

    @staticmethod
    def backward(fctx, dy):
        x, weight = fctx.saved_tensors
        comm = fctx.comm
        want_dx, want_dw = wants_grad(fctx, 0), wants_grad(fctx, 1)
        dys = dy.chunk(comm.size(AXIS), SEQ)
        gather = ring_gather(x, comm, "all_gather") if want_dw else None
        w = weight.to(dy.dtype)
        dx = dw = arriving = None
        for k, c in enumerate(scatter_order(comm)):
            if want_dw:  # dW += dY_cᵀ·X_c as shard c arrives (the re-gather of X, decomposed)
                j, xj = next(gather)
                part = dys[j].flatten(0, -2).t() @ xj.flatten(0, -2).to(dy.dtype)
                dw = part if dw is None else dw + part
            if want_dx:  # dX_r = Σ_j (dY·A)_j[chunk r]: matmul-reduce-scatter
                dx, arriving = pass_on(comm, dys[c] @ w, arriving, k, "reduce_scatter")
        db = dy.flatten(0, -2).sum(0) if fctx.has_bias and wants_grad(fctx, 2) else None
        return dx.to(x.dtype) if want_dx else None, dw, db, None


class MatmulReduceScatter(torch.autograd.Function):
    """Z = reduce-scatter(X·Aᵀ) along the sequence decomposed (``--tp-overlap``): the
    row-parallel exit of sequence parallelism (no bias: the caller adds it after the sum),
    each chunk's partial product computed while the running sum of the one before travels."""

    @staticmethod
    def forward(fctx, x, weight, comm):
        fctx.comm = comm
        fctx.save_for_backward(x, weight)
        xs = x.chunk(comm.size(AXIS), SEQ)
        out = arriving = None
        for k, c in enumerate(scatter_order(comm)):
            out, arriving = pass_on(comm, F.linear(xs[c], weight), arriving, k, "reduce_scatter")
        return out

    @staticmethod
    def backward(fctx, dz):
        x, weight = fctx.saved_tensors
        comm = fctx.comm
        want_dx, want_dw = wants_grad(fctx, 0), wants_grad(fctx, 1)
        xs = x.chunk(comm.size(AXIS), SEQ)
        w = weight.to(dz.dtype)
        dxs, dw = [None] * comm.size(AXIS), None
        for c, dzc in ring_gather(dz.contiguous(), comm, "all_gather"):  # dZ's all-gather, decomposed
            if want_dx:
                dxs[c] = dzc @ w
            if want_dw:
                part = dzc.flatten(0, -2).t() @ xs[c].flatten(0, -2).to(dz.dtype)
                dw = part if dw is None else dw + part
        return torch.cat(dxs, SEQ).to(x.dtype) if want_dx else None, dw, None


def all_gather_matmul(x, weight, bias, comm):
    """Column-parallel F.linear of a sequence shard x [b, s/t, h] → [b, s, d/t], decomposed."""
    return AllGatherMatmul.apply(x, weight, bias, comm)


def matmul_reduce_scatter(x, weight, comm):
    """Row-parallel F.linear of x [b, s, f/t] summed over the group → this rank's [b, s/t, h]
    (without bias), decomposed."""
    return MatmulReduceScatter.apply(x, weight, comm)
