"""3-D tensor parallelism on a q×q×q cube (Bian et al. 2021, "Maximizing Parallelism in
Distributed Training for Huge Neural Networks").

A rank of the cube has coordinates (i, j, k); the grid's axes 'cube_i', 'cube_j' and
'cube_k' are the lines through it along which one coordinate varies. Every tensor is
split over all q³ ranks, so compute, parameters and activations are perfectly balanced.

**Placements.** A placement is a value ``(a, c)`` naming two of the axes (j and k, in some
order); i always splits the batch further and the weights' shared dimension.
An activation ``[b, s, h]`` in placement (a, c) is split by batch (whole sequences) into
q² pieces over (i, a) — piece ``i·q + index(a)`` — and by hidden into q slices over c.
The residual stream lives in ``FIRST = (j, k)``.

**Linear3D** ``Y = X·W`` on placement (a, c). W (h_in × h_out) is split by rows over
(c, i) and by columns over a:

=========  ====================================  ===========================
forward    all-gather X along the a-line (batch)  [b/q, s, h_in/q]
           all-gather W along the i-line (rows)   [h_in/q, h_out/q]
           local matmul: partial sums over c      [b/q, s, h_out/q]
           reduce-scatter along the c-line        [b/q², s, h_out/q]
backward   all-gather dY along c; reduce-scatter dX along a; reduce-scatter dW along i
=========  ====================================  ===========================

The output is in placement (c, a): the next linear uses the swapped roles, so the pairs
QKV→proj and fc→fc2 return to the first placement and nothing is ever transposed. Each
step is a tiny autograd Function over :mod:`minitron.comm` (`tensor.gather` and
`tensor.reduce_scatter`, shared with 1-D sequence parallelism); autograd's own matmul
backward supplies the mirror.

**Attention** needs no collective: the QKV rows of ``model.py`` are head-major
(``[head][q|k|v][head_dim]``), so the QKV output's slice over a holds whole heads, and
the batch pieces are whole sequences.

**Vectors** (biases, LayerNorm weight and bias, the position embedding) are split
like the hidden slice they act on and replicated on the plane of the two other axes;
each copy sees other rows of the batch, so their gradients are summed over that plane
(ShardInfo.grad_sync: one all-reduce per line of the plane, done by
``optim.sync_replicated_grads``; ShardInfo.replicas lets the exact global norm count
one copy).

**LayerNorm3D** sums ``x`` and ``x²`` over the local hidden slice and all-reduces these
two statistics along the hidden-split line (one call forward, one in backward).

**Embedding and output layer: vocabulary-parallel on the cube.** The token embedding
``wte [V, h]`` is split by vocabulary rows into q² pieces over (j, i) and by hidden over
k — every element lives on exactly one rank. The lookup is the linear ``onehot(ids)·wte``
on placement (k, j): the ids need no gather (every rank holds its data-parallel
microbatch), the weight is all-gathered along i (vocabulary rows), and the partial sums
are reduce-scattered along j, landing in the residual placement (j, k). The output layer
is ``logits = x·wteᵀ`` on placement (j, k) with the *same* local shard: all-gather x along
j, all-gather the weight along i (again its vocabulary rows: for ``wteᵀ`` the i-split
sits on the column side, a legal variant of the placement), reduce-scatter along k. The
logits ``[b/q², s, V/q]`` are split by vocabulary over j, so the cross-entropy is
Megatron's vocabulary-parallel one along the j-line (max, target logit, sum of
exponentials; padded ids masked). Because the embedding and the head hold the same
shard, tied embeddings need nothing special. The vocabulary is padded to a multiple
of q². Each rank's loss is the mean over its batch piece; a scalar all-reduce over the
(i, k) plane makes every rank hold the global mean (its backward passes 1/q² down).

**--tp-overlap** hides the product's calls under its own matmuls (:class:`_OverlappedProduct`,
behind :func:`cube_product`, in every Linear3D and the output layer; the paper's "custom
communication schedule that overlaps computation and communication"). Forward: X's gather
along a and the gather along i of the first half of W's local output rows are posted
together and waited together, so the two lines carry their blocks at once; the second
half's gather is posted before the first half's product and waited after it, so a product
runs under a weight gather (split along the output columns, the halves' products need no
sum: they are concatenated; Wang et al. 2022's decomposition, as the 1-D --tp-overlap).
Backward, in the order of Colossal-AI's ``linear_3d``: dX's reduce-scatter along a is posted
as soon as dX is computed and waited only after dW's product has run under it. The bytes
are the plain schedule's; the forward's weight gather is two calls of half the bytes
(:func:`weight_pieces`; one where the local rows are odd), as ``analysis/cube.py`` counts
them. X's gather is not split: its product with the first weight half needs all of it.
The embedding's lookup, the norms and the loss, with no product to hide under, stay as
they are.

With q = 1 every collective is a no-op and these layers are the single-device ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import pad_vocab
from ..context import Context, make_param, shard_slice
from .layers import Layers, grid_layers
from .ops import (MeanOverAxes, bias_keywords, compute_dtype, gather, grouped_rows, over_tokens, reduce_scatter,
                  sharded_norm, vocab_parallel_cross_entropy, wants_grad)
from .random import draw

I, J, K = "cube_i", "cube_j", "cube_k"
BATCH = 0  # activations are [b, s, h]: the batch (whole sequences) is dim 0


@dataclass(frozen=True)
class Placement:
    """Placement (a, c) of an activation: batch split over (i, a), hidden over c."""

    a: str
    c: str

    def swap(self) -> "Placement":
        """The placement of a Linear3D's output: (c, a)."""
        return Placement(self.c, self.a)

    def batch_piece(self, comm) -> int:
        """Index of this rank's batch piece (of q²): i·q + index(a)."""
        return comm.index(I) * comm.size(I) + comm.index(self.a)


FIRST = Placement(J, K)  # the residual stream, LayerNorms, the embedding's output
SECOND = FIRST.swap()  # inside attention and the MLP (QKV and fc outputs)


def cube_q(ctx: Context) -> int:
    return ctx.layout.cube_q


def on_plane(ctx: Context, *axes: str) -> dict:
    """make_param keywords for a vector replicated on the plane spanned by `axes`:
    its gradient is summed there and the norm counts one copy."""
    if cube_q(ctx) == 1:
        return {}
    return {"replicas": axes, "grad_sync": axes}


# --- the cube's product ----------------------------------------------------------------------
WEIGHT_PIECES = 2  # --tp-overlap's forward: the local weight's output rows gathered in this many pieces


def weight_pieces(rows: int, overlap: bool) -> int:
    """How many pieces a cube product's forward gathers its weight in: `rows` local output
    rows (the torch weight's dim 0) split in WEIGHT_PIECES under --tp-overlap when they
    divide evenly (every piece then has the same bytes on every rank), else one."""
    return WEIGHT_PIECES if overlap and rows % WEIGHT_PIECES == 0 else 1


class _OverlappedProduct(torch.autograd.Function):
    """``reduce-scatter_c(gather_a(X)·gather_i(W)ᵀ)``, the cube's product, with --tp-overlap's
    schedule (the 3-D paper's "custom communication schedule that overlaps computation and
    communication"). Forward: X's gather along `x_axis` and the gather along i of the first
    piece of W's local output rows (:func:`weight_pieces`) posted together and waited
    together; then piece p+1's gather is posted before piece p's partial product and waited
    after it, so the weight's later pieces travel under the product (the decomposition of
    Wang et al. 2022, as the 1-D --tp-overlap; output columns need no sum, so the pieces'
    products are concatenated). Backward (the order of Colossal-AI's ``linear_3d``): after
    dY's gather, dX's reduce-scatter along `x_axis` posted as soon as dX is computed and
    waited only after dW's product has run under it (dW's reduce-scatter along i posted
    then too). The bytes, dtypes and backward calls are the plain schedule's
    (:func:`cube_product` without `overlap`); the forward's weight gather is
    :func:`weight_pieces` calls of a piece each, as ``analysis/cube.py`` counts them. The
    gathered blocks are saved, as F.linear saves them."""

    @staticmethod
    def forward(fctx, x, weight, comm, x_axis: str, w_dim: int, out_axis: str):
        pieces = weight.chunk(weight_pieces(weight.shape[0], True))  # output rows: products need no sum
        # gathered along its rows (w_dim 0, the output layer's wte), a piece holds q blocks, one per i
        blocks = comm.size(I) if w_dim == 0 else 1
        gx = comm.all_gather(x, x_axis, BATCH, async_op=True, activation=True)
        gw = comm.all_gather(pieces[0].contiguous(), I, w_dim, async_op=True)  # a parameter: the master dtype
        cdt = compute_dtype(x)
        x_all = gx.wait()
        xc, ys, ws = x_all.to(cdt), [], []
        for p in range(len(pieces)):
            w_p = gw.wait()
            if p + 1 < len(pieces):  # in flight while piece p's product runs
                gw = comm.all_gather(pieces[p + 1].contiguous(), I, w_dim, async_op=True)
            ys.append(F.linear(xc, w_p.to(cdt)).unflatten(-1, (blocks, -1)))
            ws.append(w_p.unflatten(0, (blocks, -1)))
        # each i-block's rows back in order: the plain gather's output columns and weight
        y = torch.cat(ys, -1).flatten(-2)
        w_all = torch.cat(ws, 1).flatten(0, 1)
        y = comm.reduce_scatter(y, out_axis, BATCH, activation=True)
        fctx.save_for_backward(x_all, w_all)
        fctx.comm, fctx.axes, fctx.w_dim, fctx.cdt = comm, (x_axis, out_axis), w_dim, cdt
        return y

    @staticmethod
    def backward(fctx, dy):
        x_all, w_all = fctx.saved_tensors
        comm, (x_axis, out_axis), cdt = fctx.comm, fctx.axes, fctx.cdt
        dy = comm.all_gather(dy.contiguous(), out_axis, BATCH, activation=True).to(cdt)
        dx = dw = None
        if wants_grad(fctx, 0):  # in flight while dW's product runs
            dx = comm.reduce_scatter((dy @ w_all.to(cdt)).to(x_all.dtype), x_axis, BATCH, async_op=True,
                                     activation=True)
        if wants_grad(fctx, 1):
            dw = comm.reduce_scatter(over_tokens(dy, x_all.to(cdt)).to(w_all.dtype), I, fctx.w_dim, async_op=True)
        return (dx.wait() if dx is not None else None), (dw.wait() if dw is not None else None), None, None, None, None


def cube_product(x, weight, comm, x_axis: str, w_dim: int, out_axis: str, overlap: bool = False):
    """The cube's product of local blocks: X all-gathered along `x_axis` (batch), the torch
    weight block along i (on its dim `w_dim`), multiplied (``x·wᵀ``: partial sums) and
    reduce-scattered along `out_axis` (batch). `overlap` (--tp-overlap): the same calls in
    :class:`_OverlappedProduct`'s order."""
    if overlap:
        return _OverlappedProduct.apply(x, weight, comm, x_axis, w_dim, out_axis)
    x = gather(x, comm, x_axis, BATCH)
    w = gather(weight, comm, I, w_dim, param=True)
    return reduce_scatter(F.linear(x, w), comm, out_axis, BATCH)


# --- layers -----------------------------------------------------------------------------
class Linear3D(nn.Module):
    """``Y = X·W + bias`` on placement (a, c); the output is in placement (c, a).

    The torch weight is ``[d_out, d_in]`` (= Wᵀ): this rank holds output rows
    ``shard_slice(d_out, q, a)`` and input columns ``shard_slice(d_in, q², c·q + i)`` — a slice of
    the single-device weight. The bias ``[d_out/q]`` (slice a) is replicated on the
    (i, c) plane. With `skip_bias_add` the caller adds ``.bias`` (the model's second
    linear of a pair does, to read the same in 1-D and 3-D).
    """

    def __init__(self, name: str, d_in: int, d_out: int, ctx: Context, placement: Placement,
                 std: float = 0.02, skip_bias_add: bool = False, bias: bool = True, parts: int = 1):
        super().__init__()
        q, comm = cube_q(ctx), ctx.comm
        self.comm, self.placement, self.skip_bias_add = comm, placement, skip_bias_add or not bias
        self.parts = parts  # rows interleaved by parts, the output grouped by part (tensor.grouped_rows)
        self.overlap = ctx.layout.tp_overlap  # gathers at once, W's second half under the first's product
        a, c, i = comm.index(placement.a), comm.index(placement.c), comm.index(I)
        rows, cols = shard_slice(d_out, q, a), shard_slice(d_in, q * q, c * q + i)
        self.weight = make_param(f"{name}.weight", (d_out, d_in), (rows, cols), ctx, std)
        self.bias = (make_param(f"{name}.bias", (d_out,), (rows,), ctx, kind="zeros", **on_plane(ctx, I, placement.c))
                     if bias else None)

    def forward(self, x):
        # X gathered to [b/q, s, d_in/q] (batch block i, features c), W's columns to [d_out/q, d_in/q]
        # (rows a, columns c); the product reduce-scattered to [b/q², s, d_out/q]. The rows are regrouped
        # before the gather along the columns: the same block either way
        pl = self.placement
        y = cube_product(x, grouped_rows(self.weight, self.parts), self.comm, pl.a, 1, pl.c, self.overlap)
        return y if self.skip_bias_add else y + grouped_rows(self.bias, self.parts)


class LayerNorm3D(nn.Module):
    """LayerNorm (or RMSNorm: ``kind="rmsnorm"``, weight only) of an activation in placement
    (a, c): hidden slice c; weight and bias ``[h/q]`` replicated on the (i, a) plane."""

    def __init__(self, name: str, h: int, ctx: Context, placement: Placement = FIRST, eps: float = 1e-5,
                 kind: str = "layernorm", bias: bool = True):
        super().__init__()
        q, comm = cube_q(ctx), ctx.comm
        self.comm, self.placement, self.h, self.eps, self.rms = comm, placement, h, eps, kind == "rmsnorm"
        cols = shard_slice(h, q, comm.index(placement.c))
        plane = on_plane(ctx, I, placement.a)
        self.weight = make_param(f"{name}.weight", (h,), (cols,), ctx, kind="ones", **plane)
        self.bias = (make_param(f"{name}.bias", (h,), (cols,), ctx, kind="zeros", **plane)
                     if bias and not self.rms else None)

    def forward(self, x):
        return sharded_norm(x, self.weight, self.bias, self.comm, self.placement.c, self.h, self.eps, self.rms)


class Embedding3D(nn.Module):
    """Token embedding ``wte [V, h]`` on the cube, vocabulary-parallel (see the module
    docstring); also the output layer (:meth:`logits`, :meth:`loss`).

    Local shard: vocabulary rows ``[(j·q + i)·V'/q², +V'/q²)`` (V' = V padded to a
    multiple of q², padded rows zero) × hidden slice k.
    """

    def __init__(self, name: str, vocab: int, h: int, ctx: Context, std: float = 0.02, grad_sync=()):
        super().__init__()
        q, comm = cube_q(ctx), ctx.comm
        self.comm, self.vocab, self.q = comm, vocab, q
        self.overlap = ctx.layout.tp_overlap  # the output layer's product too
        self.padded = pad_vocab(vocab, q * q)
        per = self.padded // (q * q)
        i, j, k = comm.index(I), comm.index(J), comm.index(K)
        first = (j * q + i) * per
        rows = slice(min(first, vocab), min(first + per, vocab))
        self.start = j * self.padded // q  # first id of the gathered block (vocabulary slice j)
        self.weight = make_param(f"{name}.weight", (vocab, h), (rows, shard_slice(h, q, k)), ctx, std,
                                 local_shape=(per, h // q), grad_sync=grad_sync,
                                 replicas=("embed",) if grad_sync and comm.index("embed") else ())

    def forward(self, idx):
        """Token ids [b, s] (the whole data-parallel microbatch) -> [b/q², s, h/q] in
        placement (j, k). This rank looks up batch block i in its vocabulary slice j."""
        ids = idx[shard_slice(idx.shape[0], self.q, self.comm.index(I))]  # no communication
        w = gather(self.weight, self.comm, I, 0, param=True)  # [V'/q, h/q]: vocabulary slice j, hidden k
        local = ids - self.start
        outside = (local < 0) | (local >= w.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), w).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter(out, self.comm, J, BATCH)

    def logits(self, x):
        """x [b/q², s, h/q] in placement (j, k) -> local logits [b/q², s, V'/q] (batch piece
        (i, k), vocabulary slice j): a Linear3D on placement (j, k) with weight wteᵀ."""
        # x gathered to [b/q, s, h/q], the vocabulary rows of wte to [V'/q, h/q]
        return cube_product(x, self.weight, self.comm, J, 0, K, self.overlap)

    def loss(self, logits, targets):
        """Mean cross-entropy of the whole microbatch (targets [b, s], every rank)."""
        q, comm = self.q, self.comm
        tgt = targets[shard_slice(targets.shape[0], q * q, SECOND.batch_piece(comm))]
        per_token = vocab_parallel_cross_entropy(logits.flatten(0, 1), tgt.flatten(), self.start,
                                                 self.vocab, comm, axis=J)
        return MeanOverAxes.apply(per_token.mean(), comm, (I, K))


# --- dropout masks on the cube --------------------------------------------------------
def keep_mask(ctx: Context, site: str, key, shape, p: float, device, inside: bool = False) -> torch.Tensor:
    """Dropout keep-mask for a local tensor of the cube (the namespace's ``keep_mask``; see parallel/random.py).

    Every element of an activation lives on exactly one cube rank, so there is no copy
    whose mask must agree. Outside attention the tensor is ``[b/q², s, h/q]`` in placement
    (j, k); inside, the attention probabilities ``[b/q², heads/q, s, s]`` are in placement
    (k, j) (heads split over j). Mode 'tensor' draws the local mask from the rank's own
    stream; mode 'global' draws the single-device mask and keeps this rank's block."""
    if ctx.tp == 1:  # the single-device mask
        return draw(ctx.seed, site, key, shape, p, device)
    if ctx.layout.dropout_rng == "tensor":
        return draw(ctx.seed, site, key, shape, p, device, rank=ctx.tp_rank)
    q, comm = cube_q(ctx), ctx.comm
    placement, split_dim = (SECOND, 1) if inside else (FIRST, len(shape) - 1)
    full = list(shape)
    full[0] *= q * q
    full[split_dim] *= q
    b, n = shape[0], shape[split_dim]
    mask = draw(ctx.seed, site, key, full, p, device)
    mask = mask.narrow(0, placement.batch_piece(comm) * b, b)
    return mask.narrow(split_dim, comm.index(placement.c) * n, n).contiguous()


# --- the layer namespace the model is written against (see model.py) ------------------
def position_embedding(name: str, seq_len: int, h: int, ctx: Context, std: float = 0.01):
    """wpe [s, h]: hidden slice k, replicated on the (i, j) plane (added to the
    embedding output in placement (j, k))."""
    cols = shard_slice(h, cube_q(ctx), ctx.comm.index(K))
    return make_param(name, (seq_len, h), (slice(0, seq_len), cols), ctx, std, **on_plane(ctx, I, J))


def boundary_shape(micro_batch: int, seq_len: int, h: int, ctx: Context) -> tuple:
    """The local hidden states between pipeline stages: [b/q², s, h/q] in placement (j, k)."""
    q = cube_q(ctx)
    return (micro_batch // (q * q), seq_len, h // q)


def layers(*, linear=Linear3D) -> Layers:
    """The cube's layer namespace. `linear`: the 3-D linear module, called as
    ``linear(name, d_in, d_out, ctx, placement, std, skip_bias_add=...)`` (``Linear3D``'s
    signature): the engine's by default, a learner's in a lab (its forward all-gathers X
    along a and W along i and reduce-scatters along c; its backward the mirror)."""
    return grid_layers(
        "3d",
        linear_in=lambda name, d_in, d_out, ctx, std=0.02, bias=True, blocks=0, parts=1: linear(
            name, d_in, d_out, ctx, FIRST, std, **bias_keywords(bias), **({"parts": parts} if parts > 1 else {})),
        linear_out=lambda name, d_in, d_out, ctx, std=0.02, bias=True: linear(
            name, d_in, d_out, ctx, SECOND, std, skip_bias_add=True, **bias_keywords(bias)),
        layer_norm=lambda name, h, ctx, kind="layernorm", eps=1e-5, bias=True: LayerNorm3D(
            name, h, ctx, FIRST, eps, kind, bias),
        embedding=Embedding3D, position=position_embedding, boundary_shape=boundary_shape,
        keep_mask=keep_mask)


LAYERS = layers()
