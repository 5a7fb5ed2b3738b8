"""2-D tensor parallelism on a q×q grid (SUMMA, as in Optimus: Xu et al. 2021, "An
Efficient 2D Method for Training Super-Large Deep Learning Models") and 2.5-D on q×q×d
(Tesseract: Wang et al. 2021, "Tesseract: Parallelize the Tensor Parallelism
Efficiently"). 2-D is the depth d = 1 case of 2.5-D: one module for both.

**The grid.** A tensor rank has coordinates (r, c, k): row, column and depth
(``tp_rank = c + q·r + q²·k``, ``ProcessGrid.summa_coord``). The grid's axis
'summa_row' is the line through a rank along which c varies (its grid row),
'summa_col' the line along which r varies, 'summa_dep' the line along which k varies.

**Blocks.** An activation ``[b, s, h]`` is split by batch (whole sequences) into q·d
pieces — piece ``k·q + r`` — and by hidden into q slices — slice c. Every element of
an activation lives on exactly one rank. A weight ``W [h_in, h_out]`` is split into q×q
blocks, block (r, c) on rank (r, c, k) for every depth k: the d copies of the 2-D grid
hold the same weights, each works on 1/d of the batch, and the weight gradients are
summed over the depth once per step (Tesseract §3; ``ShardInfo.grad_sync``, like the
data-parallel all-reduce inside the tensor group). With d = 1 that sum is a no-op.

**SUMMA** ``Y = X·W`` (Optimus §3.1, Alg. 1): ``Y(r, c) = Σ_l X(r, l)·W(l, c)``. For
l = 0..q−1, the rank in column l broadcasts its X block along its row, the rank in row
l its W block along its column, and every rank adds the product of the two blocks it
received. The output is in the input's layout (batch r, hidden slice c): the next
linear needs nothing. Backward (Optimus Alg. 2 and 3, Colossal-AI's
``Matmul_ABT_2D`` / ``Matmul_ATB_2D``), from the local X and W only (nothing gathered
is kept)::

    dX(r, l) = Σ_c dY(r, c)·W(l, c)ᵀ   for l: broadcast W(l, c) along the column,
                                       multiply, reduce along the row to column l
    dW(l, c) = Σ_r X(r, l)ᵀ·dY(r, c)   for l: broadcast X(r, l) along the row,
                                       multiply, reduce along the column to row l

Each rank sends and receives ``(q−1)/q²·(|X| + |W|)`` elements per product forward
(q broadcasts of a block along each line), twice that backward.

**Attention** needs no collective: the QKV rows of ``model.py`` are head-major, so
hidden slice c of the QKV output holds whole heads (heads divisible by q), and batch
pieces are whole sequences.

**Vectors** (biases, LayerNorm weight and bias, the position embedding) are split like
the hidden slice c they act on and replicated over the column and the depth; each copy
sees other rows of the batch, so their gradients are summed over both.

**LayerNorm** sums ``x`` and ``x²`` over the local hidden slice and all-reduces the two
statistics along the row (``ops.ShardedLayerNormFn``, the same function as on the cube).

**Embedding and output layer.** ``wte [V', h]`` (V' = V padded to a multiple of q) is
split like a weight: vocabulary rows r, hidden slice c. The lookup is the product
``onehot(ids)·wte`` with the ids on every rank: each rank looks up its depth's b/d
sequences in its vocabulary slice, and a reduce-scatter along the column sums the
slices and hands rank (r, c) batch piece r (backward: an all-gather). The output layer
is ``logits = x·wteᵀ``, SUMMA's A·Bᵀ: for l, the rank in row l broadcasts its wte block
along the column, every rank multiplies, and the partial logits are reduced along the
row to column l. Rank (r, c) ends with the logits of batch piece r for vocabulary
slice c, so the cross-entropy is Megatron's vocabulary-parallel one along the row.
The same shard serves the lookup and the output layer: tied embeddings need nothing
special. Each rank's loss is the mean over its batch piece; a scalar all-reduce over
the column and the depth gives every rank the global mean.

**--tp-overlap** runs the same calls in another order: each SUMMA step's broadcasts
are posted (async) before the product of the step before runs, and each step's reduce is
waited only after the next step's product (:func:`summa_steps`, :class:`Sums`), forward
and backward, in the linears and the output layer alike. The messages and their bytes are
the plain schedule's, so ``analysis/summa.py`` counts both; the embedding's
reduce-scatter and the norms' all-reduces, with no product to hide under, stay as they are.

With q = d = 1 every collective is a no-op and these are the single-device layers.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from ..config import pad_vocab
from ..context import Context, make_param, shard_slice
from .layers import Layers, grid_layers
from .ops import (MeanOverAxes, bias_keywords, compute_dtype, grouped_rows, over_tokens, reduce_scatter, sharded_norm,
                  vocab_parallel_cross_entropy, wants_grad)
from .random import draw

ROW, COL, DEP = "summa_row", "summa_col", "summa_dep"
BATCH = 0  # activations are [b, s, h]: the batch (whole sequences) is dim 0


def grid_of(comm) -> tuple[int, int, int, int]:
    """(q, r, c, k) of this rank: the grid's edge, its row, column and depth."""
    return comm.size(ROW), comm.index(COL), comm.index(ROW), comm.index(DEP)


def batch_piece(comm) -> int:
    """Index of this rank's batch piece (of q·d): k·q + r."""
    q, r, _, k = grid_of(comm)
    return k * q + r


def replicated_over(ctx: Context, *axes: str) -> dict:
    """make_param keywords for a parameter copied along `axes` (those of more than one
    rank): its gradient is summed there and the norm counts one copy."""
    axes = tuple(a for a in axes if ctx.comm.size(a) > 1)
    return {"replicas": axes, "grad_sync": axes} if axes else {}


# --- SUMMA products -----------------------------------------------------------------------
def _broadcast_block(t: torch.Tensor, comm, axis: str, src: int):
    """The block of the rank at position `src` of `axis`, on every rank of the line: a
    Pending (posted now, waited by the caller)."""
    buf = t if comm.index(axis) == src else torch.empty_like(t)
    return comm.broadcast(buf, axis, src, async_op=True)


def summa_steps(q: int, post, overlap: bool):
    """SUMMA's steps l = 0..q−1 with their broadcast blocks: yields ``(l, blocks)``, where
    ``post(l)`` posts step l's broadcasts and returns their Pendings. Without `overlap`
    each step's are posted and waited before its product; with it (``--tp-overlap``) step
    l+1's are posted *before* step l's blocks are handed to the caller, so they travel
    while the caller multiplies, and are waited only when the caller asks for step l+1
    (a look-ahead of one step: the communication of step l+1 hidden under the computation
    of step l, as Wang et al. 2022 hide a decomposed collective's chunks)."""
    coming = post(0)
    for l in range(q):
        blocks = [p.wait() for p in coming]
        if overlap and l + 1 < q:
            coming = post(l + 1)  # in flight under step l's product
        yield l, blocks
        if not overlap and l + 1 < q:
            coming = post(l + 1)


class Sums:
    """The partial products of SUMMA's steps reduced along `axis` into position l at step
    l; this rank keeps the one of step `mine`. Without `overlap` each reduce is waited at
    once; with it each is waited only after the next step's product has been computed, so
    it travels under that product."""

    def __init__(self, comm, axis: str, mine: int, overlap: bool):
        self.comm, self.axis, self.mine, self.overlap = comm, axis, mine, overlap
        self.flying, self.kept = None, None

    def add(self, part: torch.Tensor, l: int) -> None:
        """Post step l's reduce of `part` (and wait the one before it, now under no product)."""
        pending = self.comm.reduce(part, self.axis, l, async_op=True)
        if not self.overlap:
            pending.wait()
            pending = None
        if self.flying is not None:
            self.flying.wait()
        self.flying = pending
        if l == self.mine:
            self.kept = part

    def result(self) -> torch.Tensor:
        """This rank's sum, every reduce done."""
        if self.flying is not None:
            self.flying.wait()
            self.flying = None
        return self.kept


class _SummaAB(torch.autograd.Function):
    """``Y = X·W`` on the grid, W given as the torch weight block ``[d_out/q, d_in/q]``
    (= W(r, c)ᵀ); see the module docstring. Activations travel in the compute dtype
    (bf16 under autocast), the weight and its gradient in the master dtype. `overlap`
    (--tp-overlap): each step's broadcasts posted under the product before it, each
    reduce waited under the product after it (:func:`summa_steps`, :class:`Sums`)."""

    @staticmethod
    def forward(fctx, x, weight, comm, overlap=False):
        q, r, c, _ = grid_of(comm)
        cdt = compute_dtype(x)
        xs, w = x.detach().to(cdt).contiguous(), weight.detach()
        y = None
        post = lambda l: (_broadcast_block(xs, comm, ROW, l), _broadcast_block(w, comm, COL, l))  # X(r, l), W(l, c)ᵀ
        for l, (x_l, w_l) in summa_steps(q, post, overlap):
            part = F.linear(x_l, w_l.to(cdt))
            y = part if y is None else y.add_(part)
        fctx.save_for_backward(x, weight)  # the local blocks only: the backward broadcasts again
        fctx.comm, fctx.cdt, fctx.overlap = comm, cdt, overlap
        return y

    @staticmethod
    def backward(fctx, dy):
        x, weight = fctx.saved_tensors
        comm, cdt, overlap = fctx.comm, fctx.cdt, fctx.overlap
        q, r, c, _ = grid_of(comm)
        dy = dy.to(cdt).contiguous()
        dx = dw = None
        if wants_grad(fctx, 0):  # dX(r, l) = Σ_c dY(r, c)·W(l, c)ᵀ, summed along the row into column l
            sums, w = Sums(comm, ROW, c, overlap), weight.detach()
            for l, (w_l,) in summa_steps(q, lambda l: (_broadcast_block(w, comm, COL, l),), overlap):
                sums.add((dy @ w_l.to(cdt)).contiguous(), l)
            dx = sums.result().to(x.dtype)
        if wants_grad(fctx, 1):  # dW(l, c) = Σ_r X(r, l)ᵀ·dY(r, c), summed along the column into row l
            sums, xs = Sums(comm, COL, r, overlap), x.detach().to(cdt).contiguous()
            for l, (x_l,) in summa_steps(q, lambda l: (_broadcast_block(xs, comm, ROW, l),), overlap):
                sums.add(over_tokens(dy, x_l).to(weight.dtype), l)
            dw = sums.result()
        return dx, dw, None, None


class _SummaABT(torch.autograd.Function):
    """``Z = X·Bᵀ`` on the grid with B ``[n/q, d/q]`` block (r, c) on rank (r, c) (the
    output layer, B = wte): Z(r, c) = Σ_l X(r, l)·B(c, l)ᵀ. For l: broadcast B(l, c)
    along the column, multiply, reduce along the row to column l. Backward: dX =
    dZ·B (broadcast dZ(r, l) along the row and B(l, c) along the column) and
    dB(l, c) = Σ_r dZ(r, l)ᵀ·X(r, c) (reduced along the column to row l). `overlap` as
    for :class:`_SummaAB`."""

    @staticmethod
    def forward(fctx, x, weight, comm, overlap=False):
        q, r, c, _ = grid_of(comm)
        cdt = compute_dtype(x)
        xs, w = x.detach().to(cdt), weight.detach()
        sums = Sums(comm, ROW, c, overlap)
        for l, (w_l,) in summa_steps(q, lambda l: (_broadcast_block(w, comm, COL, l),), overlap):  # B(l, c)
            sums.add(F.linear(xs, w_l.to(cdt)).contiguous(), l)  # Z(r, l), partial over c
        fctx.save_for_backward(x, weight)
        fctx.comm, fctx.cdt, fctx.overlap = comm, cdt, overlap
        return sums.result()

    @staticmethod
    def backward(fctx, dz):
        x, weight = fctx.saved_tensors
        comm, cdt, overlap = fctx.comm, fctx.cdt, fctx.overlap
        q, r, c, _ = grid_of(comm)
        dz, xs, w = dz.to(cdt).contiguous(), x.detach().to(cdt), weight.detach()
        want_x, want_w = wants_grad(fctx, 0), wants_grad(fctx, 1)
        sums = Sums(comm, COL, r, overlap) if want_w else None
        post = lambda l: (_broadcast_block(dz, comm, ROW, l),  # dZ(r, l), and B(l, c)
                          *((_broadcast_block(w, comm, COL, l),) if want_x else ()))
        dx = None
        for l, (dz_l, *w_l) in summa_steps(q, post, overlap):
            if want_x:
                part = dz_l @ w_l[0].to(cdt)
                dx = part if dx is None else dx.add_(part)
            if want_w:
                sums.add(over_tokens(dz_l, xs).to(weight.dtype), l)
        return (dx.to(x.dtype) if dx is not None else None), sums.result() if want_w else None, None, None


def summa_linear(x, weight, comm, overlap: bool = False):
    """Differentiable SUMMA product ``x·weightᵀ`` of the local blocks (no bias); `overlap`:
    --tp-overlap's schedule (the same calls, each in flight under a product)."""
    return _SummaAB.apply(x, weight, comm, overlap)


# --- layers ---------------------------------------------------------------------------------
class LinearSumma(nn.Module):
    """``Y = X·W + bias`` on the grid. The torch weight is ``[d_out, d_in]`` (= Wᵀ):
    this rank holds output rows ``shard_slice(d_out, q, c)`` and input columns
    ``shard_slice(d_in, q, r)`` — W's block (r, c), a slice of the single-device weight —
    on every depth. The bias ``[d_out/q]`` (slice c) is replicated over the column and
    the depth. With `skip_bias_add` the caller adds ``.bias`` (the second linear of a
    pair, to read the same in every layout)."""

    def __init__(self, name: str, d_in: int, d_out: int, ctx: Context, std: float = 0.02,
                 skip_bias_add: bool = False, bias: bool = True, parts: int = 1):
        super().__init__()
        self.comm, self.skip_bias_add = ctx.comm, skip_bias_add or not bias
        self.overlap = ctx.layout.tp_overlap  # SUMMA's steps each in flight under a product
        self.parts = parts  # rows interleaved by parts, the output grouped by part (tensor.grouped_rows)
        q, r, c, _ = grid_of(ctx.comm)
        rows, cols = shard_slice(d_out, q, c), shard_slice(d_in, q, r)
        self.weight = make_param(f"{name}.weight", (d_out, d_in), (rows, cols), ctx, std,
                                 **replicated_over(ctx, DEP))
        self.bias = make_param(f"{name}.bias", (d_out,), (rows,), ctx, kind="zeros",
                               **replicated_over(ctx, COL, DEP)) if bias else None

    def forward(self, x):
        # every rank of a grid column holds the same rows: regrouping each block keeps them aligned
        y = summa_linear(x, grouped_rows(self.weight, self.parts), self.comm, self.overlap)
        return y if self.skip_bias_add else y + grouped_rows(self.bias, self.parts)


class LayerNormSumma(nn.Module):
    """LayerNorm (or RMSNorm: ``kind="rmsnorm"``, weight only) of a block (batch piece,
    hidden slice c): statistics all-reduced along the row; weight and bias ``[h/q]``
    replicated over the column and the depth."""

    def __init__(self, name: str, h: int, ctx: Context, eps: float = 1e-5, kind: str = "layernorm",
                 bias: bool = True):
        super().__init__()
        self.comm, self.h, self.eps, self.rms = ctx.comm, h, eps, kind == "rmsnorm"
        q, _, c, _ = grid_of(ctx.comm)
        cols, copies = shard_slice(h, q, c), replicated_over(ctx, COL, DEP)
        self.weight = make_param(f"{name}.weight", (h,), (cols,), ctx, kind="ones", **copies)
        self.bias = (make_param(f"{name}.bias", (h,), (cols,), ctx, kind="zeros", **copies)
                     if bias and not self.rms else None)

    def forward(self, x):
        return sharded_norm(x, self.weight, self.bias, self.comm, ROW, self.h, self.eps, self.rms)


class EmbeddingSumma(nn.Module):
    """Token embedding ``wte [V, h]`` on the grid, also the output layer (:meth:`logits`,
    :meth:`loss`); see the module docstring. Local shard: vocabulary rows
    ``[r·V'/q, (r+1)·V'/q)`` (padded rows zero) × hidden slice c, on every depth."""

    def __init__(self, name: str, vocab: int, h: int, ctx: Context, std: float = 0.02, grad_sync=()):
        super().__init__()
        comm = self.comm = ctx.comm
        q, r, c, k = grid_of(comm)
        self.vocab, self.q, self.depth = vocab, q, comm.size(DEP)
        self.overlap = ctx.layout.tp_overlap  # the output layer's SUMMA steps too
        self.padded = pad_vocab(vocab, q)
        per = self.padded // q
        self.first = r * per  # first id of this rank's vocabulary rows (the lookup)
        self.start = c * per  # first id of this rank's logits (vocabulary slice c)
        rows = slice(min(self.first, vocab), min(self.first + per, vocab))
        depth = replicated_over(ctx, DEP)
        tied = ("embed",) if grad_sync and comm.index("embed") else ()
        self.weight = make_param(f"{name}.weight", (vocab, h), (rows, shard_slice(h, q, c)), ctx, std,
                                 local_shape=(per, h // q),
                                 grad_sync=tuple(grad_sync) + depth.get("grad_sync", ()),
                                 replicas=tied + depth.get("replicas", ()))

    def forward(self, idx):
        """Token ids [b, s] (the whole data-parallel microbatch) -> [b/(q·d), s, h/q]:
        look up this depth's sequences in the local vocabulary rows, then sum the
        vocabulary slices and scatter the batch along the column."""
        _, _, _, k = grid_of(self.comm)
        ids = idx[shard_slice(idx.shape[0], self.depth, k)]  # no communication
        local = ids - self.first
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter(out, self.comm, COL, BATCH)

    def logits(self, x):
        """x [b/(q·d), s, h/q] -> local logits [b/(q·d), s, V'/q] (batch piece, vocabulary
        slice c): SUMMA's A·Bᵀ with B = wte."""
        return _SummaABT.apply(x, self.weight, self.comm, self.overlap)

    def loss(self, logits, targets):
        """Mean cross-entropy of the whole microbatch (targets [b, s], every rank)."""
        comm = self.comm
        tgt = targets[shard_slice(targets.shape[0], self.q * self.depth, batch_piece(comm))]
        per_token = vocab_parallel_cross_entropy(logits.flatten(0, 1), tgt.flatten(), self.start,
                                                 self.vocab, comm, axis=ROW)
        return MeanOverAxes.apply(per_token.mean(), comm, (COL, DEP))


# --- dropout masks on the grid ----------------------------------------------------------------
def keep_mask(ctx: Context, site: str, key, shape, p: float, device, inside: bool = False) -> torch.Tensor:
    """Dropout keep-mask for a local tensor of the grid (the namespace's ``keep_mask``; see parallel/random.py).

    Every element of an activation lives on one rank: ``[b/(q·d), s, h/q]`` outside
    attention (hidden slice c), ``[b/(q·d), heads/q, s, s]`` inside (heads slice c).
    Mode 'tensor' draws the local mask from the rank's own stream; mode 'global' draws
    the single-device mask and keeps this rank's block."""
    if ctx.tp == 1:  # the single-device mask
        return draw(ctx.seed, site, key, shape, p, device)
    if ctx.layout.dropout_rng == "tensor":
        return draw(ctx.seed, site, key, shape, p, device, rank=ctx.tp_rank)
    comm = ctx.comm
    q, _, c, _ = grid_of(comm)
    split_dim = 1 if inside else len(shape) - 1
    full = list(shape)
    full[0] *= q * comm.size(DEP)
    full[split_dim] *= q
    b, n = shape[0], shape[split_dim]
    mask = draw(ctx.seed, site, key, full, p, device).narrow(0, batch_piece(comm) * b, b)
    return mask.narrow(split_dim, c * n, n).contiguous()


# --- the layer namespace the model is written against (see model.py) ----------------------
def position_embedding(name: str, seq_len: int, h: int, ctx: Context, std: float = 0.01):
    """wpe [s, h]: hidden slice c, replicated over the column and the depth."""
    q, _, c, _ = grid_of(ctx.comm)
    return make_param(name, (seq_len, h), (slice(0, seq_len), shard_slice(h, q, c)), ctx, std,
                      **replicated_over(ctx, COL, DEP))


def boundary_shape(micro_batch: int, seq_len: int, h: int, ctx: Context) -> tuple:
    """The local hidden states between pipeline stages: [b/(q·d), s, h/q]."""
    q, depth = ctx.comm.size(ROW), ctx.comm.size(DEP)
    return (micro_batch // (q * depth), seq_len, h // q)


def layers(*, linear=LinearSumma) -> Layers:
    """The SUMMA grid's layer namespace (2-D and 2.5-D). `linear`: the SUMMA linear
    module, called as ``linear(name, d_in, d_out, ctx, std, skip_bias_add=...)``
    (``LinearSumma``'s signature): the engine's by default, a learner's in a lab."""
    return grid_layers(
        "2d",
        linear_in=lambda name, d_in, d_out, ctx, std=0.02, bias=True, blocks=0, parts=1: linear(
            name, d_in, d_out, ctx, std, **bias_keywords(bias), **({"parts": parts} if parts > 1 else {})),
        linear_out=lambda name, d_in, d_out, ctx, std=0.02, bias=True: linear(
            name, d_in, d_out, ctx, std, skip_bias_add=True, **bias_keywords(bias)),
        layer_norm=lambda name, h, ctx, kind="layernorm", eps=1e-5, bias=True: LayerNormSumma(
            name, h, ctx, eps, kind, bias), embedding=EmbeddingSumma, position=position_embedding,
        boundary_shape=boundary_shape, keep_mask=keep_mask)


LAYERS = layers()
