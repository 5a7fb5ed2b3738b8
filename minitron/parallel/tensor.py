"""1-D tensor parallelism (Shoeybi et al. 2019, "Megatron-LM", §3).

The two conjugate operators of Fig. 3 of the paper, and the layers built from them:

    f: identity forward, all-reduce backward  (enters a parallel region)
    g: all-reduce forward, identity backward  (leaves a parallel region)

A column-parallel linear (output features split) followed by a row-parallel linear
(input features split) needs one g at the end of the pair and one f at its start, so
an MLP or an attention block costs one all-reduce forward and one backward.

Sequence parallelism (Korthikanti et al. 2022, §4.2.2) replaces f by an all-gather
along the sequence (reduce-scatter backward) and g by a reduce-scatter along the
sequence (all-gather backward), so that LayerNorm and dropout run on 1/t of the
tokens. The all-gather is fused into the column-parallel linear that follows it
(`_AllGatherLinear`), as in Megatron: the linear keeps only this rank's sequence shard
for its backward and all-gathers it again there for the weight gradient. That is what
makes Table 2's ``34/t`` hold, at the price of one more all-gather per column-parallel
linear in the backward. Hidden states are [batch, seq, hidden]; the sequence is dim 1.
With --tp-overlap both collectives are decomposed into chunks on a ring under the matmuls
they feed or follow (``collective_matmul.py``): the column-parallel entry through
:func:`entry_linear`, the row-parallel exit fused with its linear in :func:`leave_linear`.

With t = 1 every operator is the identity: the single-device model is this model.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..config import pad_vocab
from ..context import Context, make_param, shard_slice
from .collective_matmul import AllGatherMatmul, matmul_reduce_scatter
from .context_parallel import combine as online_softmax_combine
from .context_parallel import ring_attention
from .fp8 import TensorScaling, fp8_linear, fp8_state
from .layers import Layers
from .ops import (_AllGather, _ReduceScatter, _VocabParallelCrossEntropy, gather, grouped_rows,  # noqa: F401 (a lab watches them here)
                  reduce_scatter, vocab_parallel_cross_entropy, wants_grad)
from .random import draw

SEQ = 1  # the sequence dimension of [b, s, h] hidden states


class _F(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(fctx, x, comm):
        fctx.comm = comm
        return x

    @staticmethod
    def backward(fctx, dy):
        return fctx.comm.all_reduce(dy.contiguous(), "tp", activation=True), None


class _G(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(fctx, x, comm):
        return comm.all_reduce(x.contiguous(), "tp", activation=True)

    @staticmethod
    def backward(fctx, dy):
        return dy, None


class _SplitSeq(torch.autograd.Function):
    """Keep this rank's slice of the sequence forward; all-gather the gradient backward."""

    @staticmethod
    def forward(fctx, x, comm):
        fctx.comm = comm
        n, i = comm.size("tp"), comm.index("tp")
        return x[:, shard_slice(x.shape[SEQ], n, i)].contiguous()

    @staticmethod
    def backward(fctx, dy):
        return fctx.comm.all_gather(dy.contiguous(), "tp", dim=SEQ, activation=True), None


@dataclass(frozen=True)
class Ops:
    """The autograd operators the 1-D layers are built from (each a
    ``torch.autograd.Function``): the engine's by default, a learner's in a lab
    (:func:`layers` puts them in a layer namespace; nothing is patched)."""

    f: type  # f.apply(x, comm): identity forward, all-reduce backward
    g: type  # g.apply(x, comm): all-reduce forward, identity backward
    all_gather_linear: type  # .apply(x, weight, bias, comm): --sp's column-parallel entry
    vocab_cross_entropy: type  # .apply(logits, target, start, vocab, comm): per-token loss
    all_gather_matmul: type = AllGatherMatmul  # .apply(x, weight, bias, comm): --sp's entry under --tp-overlap
    fp8_scaling: TensorScaling = TensorScaling()  # --fp8-recipe tensorwise's amax, quantize and formats


def enter_region(x, ctx: Context, ops: Ops | None = None):
    """Into a tensor-parallel region: f. With --sp nothing happens here: the
    column-parallel linear that follows all-gathers the sequence itself, fused with its
    matmul (`_AllGatherLinear`), so x stays this rank's sequence shard."""
    if ctx.tp == 1 or ctx.layout.sp:
        return x
    return (ops or OPS).f.apply(x, ctx.comm)


def leave_region(x, ctx: Context, ops: Ops | None = None):
    """Out of a tensor-parallel region: g, or the sequence reduce-scatter with --sp."""
    if ctx.tp == 1:
        return x
    return reduce_scatter(x, ctx.comm, "tp", SEQ) if ctx.layout.sp else (ops or OPS).g.apply(x, ctx.comm)


class _AllGatherLinear(torch.autograd.Function):
    """Y = all-gather(X_r) · Aᵀ + b: sequence parallelism's entry into a column-parallel
    linear, with the all-gather fused into the linear (Korthikanti et al. 2022, §4.2.2;
    Megatron-Core's ``LinearWithGradAccumulationAndAsyncCommunication``).

    An all-gather followed by F.linear would save the gathered input, b·s·h, for the
    weight gradient. This keeps only this rank's shard X_r, b·s·h/t, and all-gathers it
    again in the backward: activation memory traded for one more all-gather of the
    shard. The input gradient dY·A is reduce-scattered back to the sequence shard, as
    the backward of the forward's all-gather. As in Megatron, the re-gather overlaps the
    dY·A matmul and the reduce-scatter overlaps the weight gradient (async collectives).
    """

    @staticmethod
    def forward(fctx, x, weight, bias, comm):
        fctx.comm, fctx.has_bias = comm, bias is not None
        fctx.save_for_backward(x, weight)  # the shard, not the gathered input
        return F.linear(comm.all_gather(x, "tp", SEQ, activation=True), weight, bias)

    @staticmethod
    def backward(fctx, dy):
        x, weight = fctx.saved_tensors
        want_dx, want_dw = wants_grad(fctx, 0), wants_grad(fctx, 1)
        comm, dx = fctx.comm, None
        dy2 = dy.flatten(0, -2)  # [b·s, d/t]; products in dY's dtype (bf16 under autocast)
        # Megatron's overlap: the re-gather of X runs while dY·A is computed, the
        # reduce-scatter of dX while dW is; each waits only when its result is needed.
        gathering = comm.all_gather(x, "tp", SEQ, async_op=True, activation=True) if want_dw else None
        if want_dx:  # returned in the input's dtype, as the forward gathered it
            dx = comm.reduce_scatter(dy @ weight.to(dy.dtype), "tp", SEQ, async_op=True, activation=True)
        dw = dy2.t() @ gathering.wait().flatten(0, -2).to(dy.dtype) if want_dw else None
        db = dy2.sum(0) if fctx.has_bias and wants_grad(fctx, 2) else None
        return dx.wait().to(x.dtype) if want_dx else None, dw, db, None


def all_gather_linear(x, weight, bias, ctx: Context, ops: Ops | None = None):
    """Column-parallel F.linear on a sequence shard x [b, s/t, h] under --sp: [b, s, d/t]."""
    return (ops or OPS).all_gather_linear.apply(x, weight, bias, ctx.comm)


def entry_linear(x, weight, bias, ctx: Context, ops: Ops | None = None):
    """The column-parallel linear that enters the region under --sp: :func:`all_gather_linear`,
    or with --tp-overlap its all-gather decomposed under the matmul (``collective_matmul``)."""
    if ctx.layout.tp_overlap:
        return (ops or OPS).all_gather_matmul.apply(x, weight, bias, ctx.comm)
    return all_gather_linear(x, weight, bias, ctx, ops)


def leave_linear(linear, x, ctx: Context, ops: Ops | None = None):
    """The second linear of a pair and the exit from the region (the caller adds its bias):
    ``leave_region(linear(x))``; with --tp-overlap one operation, the row-parallel matmul
    decomposed with sequence parallelism's reduce-scatter (``collective_matmul``)."""
    overlap = ctx.tp > 1 and ctx.layout.sp and ctx.layout.tp_overlap
    if overlap and isinstance(linear, RowParallelLinear) and linear.fp8 is None:
        return matmul_reduce_scatter(x, linear.weight, ctx.comm)
    return leave_region(linear(x), ctx, ops)


def scatter_sequence(x, ctx: Context):
    """Replicated [b, s, h] -> this rank's sequence shard (used after the embedding)."""
    return _SplitSeq.apply(x, ctx.comm) if ctx.tp > 1 and ctx.layout.sp else x


def kv_share_axis(share: int, t: int) -> str:
    """The axis of the `share` neighbouring tensor ranks that hold one replicated block
    (a key/value head when t > kv_heads; ``ProcessGrid``'s 'tp_kv{share}'): 'tp' itself
    when they are the whole tensor group."""
    return "tp" if share == t else f"tp_kv{share}"


def block_rows(d_out: int, blocks: int, ctx: Context) -> tuple[slice, dict]:
    """This rank's rows of a [d_out, ·] weight made of `blocks` equal blocks that must stay
    whole (0: any contiguous split), and make_param's keywords for its copies.

    With blocks ≥ t a rank holds blocks/t whole blocks. With blocks < t (grouped-query
    attention's key/value heads when t > kv_heads) block ``r // (t/blocks)`` is
    *replicated* on the t/blocks neighbouring ranks that hold its query heads: each copy
    sees only those queries, so its gradient is a partial sum, summed over exactly
    those ranks (axis ``tp_kv{t/blocks}``) before the optimizer step."""
    t, r = ctx.tp, ctx.tp_rank
    if not blocks or blocks >= t:
        return shard_slice(d_out, t, r), {}
    share = t // blocks
    axis = kv_share_axis(share, t)
    size = d_out // blocks
    return slice((r // share) * size, (r // share + 1) * size), {"replicas": (axis,), "grad_sync": (axis,)}


class ColumnParallelLinear(nn.Module):
    """Y = X A with A's columns (output features) split over the tensor group: rank r
    holds rows [r·d_out/t, (r+1)·d_out/t) of the full [d_out, d_in] weight and its bias.
    Blocks that must stay whole (heads) are laid out block-major by the caller; with
    `blocks` < t each block is replicated on t/blocks ranks (:func:`block_rows`).
    ``bias=False``: no bias (``.bias`` is None). ``parts``: rows stored interleaved by parts,
    output grouped by part (:func:`grouped_rows`)."""

    def __init__(self, name: str, d_in: int, d_out: int, ctx: Context, std: float = 0.02,
                 ops: Ops | None = None, bias: bool = True, blocks: int = 0, parts: int = 1):
        super().__init__()
        rows, copies = block_rows(d_out, blocks, ctx)
        self.weight = make_param(f"{name}.weight", (d_out, d_in), (rows,), ctx, std, **copies)
        self.bias = make_param(f"{name}.bias", (d_out,), (rows,), ctx, kind="zeros", **copies) if bias else None
        self.ctx, self.ops, self.parts = ctx, ops or OPS, parts
        self.fp8 = fp8_state(f"{name}.fp8", ctx, m_split=True,  # --precision fp8: output features over tp
                             scaling=self.ops.fp8_scaling)

    def forward(self, x):
        """x after enter_region: whole (f), or with --sp this rank's sequence shard,
        all-gathered here (`_AllGatherLinear`; under FP8 a plain all-gather, then the FP8
        linear on the whole sequence, which saves the gathered input)."""
        w, b = grouped_rows(self.weight, self.parts), grouped_rows(self.bias, self.parts)
        sp = self.ctx.tp > 1 and self.ctx.layout.sp
        if self.fp8 is not None:
            x = gather(x, self.ctx.comm, "tp", SEQ) if sp else x
            return fp8_linear(x, w, b, self.fp8, record=self.training)
        if sp:
            return entry_linear(x, w, b, self.ctx, self.ops)
        return F.linear(x, w, b)


class RowParallelLinear(nn.Module):
    """Y = X A with A's rows (input features) split; the caller reduces the partial
    sums (leave_region) and only then adds the bias, which is replicated."""

    def __init__(self, name: str, d_in: int, d_out: int, ctx: Context, std: float = 0.02, bias: bool = True,
                 ops: Ops | None = None):
        super().__init__()
        t, r = ctx.tp, ctx.tp_rank
        self.weight = make_param(f"{name}.weight", (d_out, d_in), (slice(0, d_out), shard_slice(d_in, t, r)), ctx, std)
        self.bias = make_param(f"{name}.bias", (d_out,), (), ctx, kind="zeros", **replicated(ctx)) if bias else None
        self.fp8 = fp8_state(f"{name}.fp8", ctx, k_split=True,  # --precision fp8: input features over tp
                             scaling=(ops or OPS).fp8_scaling)

    def forward(self, x):
        if self.fp8 is not None:
            return fp8_linear(x, self.weight, None, self.fp8, record=self.training)
        return F.linear(x, self.weight)  # partial sum: bias after the reduction


def replicated(ctx: Context) -> dict:
    """A parameter copied on every tensor rank. Under sequence parallelism each copy
    sees only its tokens, so its gradient must be summed over the tensor group."""
    if ctx.tp == 1:
        return {}
    return {"replicas": ("tp",), "grad_sync": ("tp",) if ctx.layout.sp else ()}


class LayerNorm(nn.Module):
    """LayerNorm with replicated weight and bias (whole hidden on every rank); ``bias=False``:
    weight only."""

    def __init__(self, name: str, h: int, ctx: Context, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = make_param(f"{name}.weight", (h,), (), ctx, kind="ones", **replicated(ctx))
        self.bias = make_param(f"{name}.bias", (h,), (), ctx, kind="zeros", **replicated(ctx)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


def rms_norm(x, weight, eps: float):
    """x / sqrt(mean(x²) + eps) · weight (Zhang & Sennrich 2019), over the last dimension;
    16-bit inputs normalised in float32 (as Llama's RMSNorm), float64 kept in float64."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm (Llama) with a replicated weight; no bias, no mean subtracted."""

    def __init__(self, name: str, h: int, ctx: Context, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = make_param(f"{name}.weight", (h,), (), ctx, kind="ones", **replicated(ctx))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def norm(name: str, h: int, ctx: Context, kind: str = "layernorm", eps: float = 1e-5, bias: bool = True):
    """The block's normalization (the namespace's ``layer_norm``): LayerNorm or RMSNorm."""
    return RMSNorm(name, h, ctx, eps) if kind == "rmsnorm" else LayerNorm(name, h, ctx, eps, bias)


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary (rows) split over the tensor group.

    The vocabulary is padded to a multiple of t; padded rows are zero and never
    looked up. Each rank embeds the tokens in its range (others give zero) and g sums.
    """

    def __init__(self, name: str, vocab: int, h: int, ctx: Context, std: float = 0.02, grad_sync=(),
                 ops: Ops | None = None):
        super().__init__()
        t, r = ctx.tp, ctx.tp_rank
        self.vocab, self.per_rank = vocab, pad_vocab(vocab, t) // t
        self.start = r * self.per_rank
        rows = slice(min(self.start, vocab), min(self.start + self.per_rank, vocab))
        self.weight = make_param(f"{name}.weight", (vocab, h), (rows,), ctx, std,
                                 local_shape=(self.per_rank, h), grad_sync=grad_sync,
                                 replicas=("embed",) if grad_sync and ctx.comm.index("embed") else ())
        self.ctx, self.ops = ctx, ops or OPS

    def forward(self, idx):
        if self.ctx.tp == 1:
            return F.embedding(idx, self.weight)
        local = idx - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.ops.g.apply(out, self.ctx.comm)


# --- the layer namespace the model is written against (see model.py) ------------------
def position_embedding(name: str, seq_len: int, h: int, ctx: Context, std: float = 0.01):
    """wpe [s, h], replicated; used before the sequence is split, so its gradient is
    already whole on every rank."""
    return make_param(name, (seq_len, h), (), ctx, std, replicas=("tp",) if ctx.tp > 1 else ())


def output_logits(x, head: VocabParallelEmbedding, ctx: Context, ops: Ops | None = None):
    """The output layer on the vocabulary-split weight: local logits [b, s, V/t] (a
    column-parallel linear without bias: with --sp it too keeps only the shard)."""
    if ctx.tp > 1 and ctx.layout.sp:
        return entry_linear(x, head.weight, None, ctx, ops)
    return F.linear(enter_region(x, ctx, ops), head.weight)


def output_loss(logits, targets, head: VocabParallelEmbedding, ctx: Context, ops: Ops | None = None,
                weights: torch.Tensor | None = None):
    """Mean cross-entropy over the tokens (vocabulary-parallel when t > 1); with `weights`
    (one per target, --pack's ``Documents.loss_weight``) the mean of weight × cross-entropy."""
    flat, tgt = logits.flatten(0, 1), targets.flatten()
    if ctx.tp == 1:
        per_token = F.cross_entropy(flat, tgt, reduction="mean" if weights is None else "none")
    else:
        per_token = (ops or OPS).vocab_cross_entropy.apply(flat, tgt, head.start, head.vocab, ctx.comm)
    return per_token.mean() if weights is None else (per_token * weights.flatten().to(per_token.dtype)).mean()


def keep_mask(ctx: Context, site: str, key, shape, p: float, device, inside: bool = False) -> torch.Tensor:
    """Dropout keep-mask for a local tensor of `shape` (see parallel/random.py).

    `inside`: inside the tensor-parallel region, dim 1 (heads) split over the tensor
    group, where mode 'tensor' draws from this rank's own stream. Outside, the tensor is
    whole, or under --sp this rank's sequence shard (dim 1) of the shared mask."""
    t, r = ctx.tp, ctx.tp_rank
    split_dim = 1 if (inside or ctx.layout.sp) else None
    if split_dim is None or t == 1:
        return draw(ctx.seed, site, key, shape, p, device)
    if inside and ctx.layout.dropout_rng == "tensor":
        return draw(ctx.seed, site, key, shape, p, device, rank=r)
    full = list(shape)
    full[split_dim] *= t
    n = shape[split_dim]
    # a copy of this rank's part, always: a view (what .contiguous() returns when the part is
    # already contiguous, e.g. one sequence) would keep the whole mask alive while saved
    return draw(ctx.seed, site, key, full, p, device).narrow(split_dim, r * n, n).clone(
        memory_format=torch.contiguous_format)


def boundary_shape(micro_batch: int, seq_len: int, h: int, ctx: Context) -> tuple:
    """The hidden states between pipeline stages ([b, s/t, h] with --sp)."""
    return (micro_batch, seq_len // ctx.tp if ctx.layout.sp else seq_len, h)


OPS = Ops(f=_F, g=_G, all_gather_linear=_AllGatherLinear, vocab_cross_entropy=_VocabParallelCrossEntropy)


def layers(*, f=_F, g=_G, all_gather_linear=_AllGatherLinear, vocab_cross_entropy=_VocabParallelCrossEntropy,
           combine=online_softmax_combine, all_gather_matmul=AllGatherMatmul,
           fp8_scaling: TensorScaling = TensorScaling()) -> Layers:
    """The 1-D layer namespace built from these operators: the engine's by default; a lab
    passes a learner's f, g (Megatron-LM Fig. 3), fused all-gather linear (--sp), decomposed
    all-gather-matmul (--sp --tp-overlap), vocabulary-parallel cross-entropy, online-softmax
    `combine` (ring attention under --cp, which composes with 1-D only) or tensorwise FP8
    scaling (`fp8_scaling`: its amax, quantize and formats) and hands the namespace to
    ``Trainer(..., layers=...)``."""
    ops = Ops(f, g, all_gather_linear, vocab_cross_entropy, all_gather_matmul, fp8_scaling)
    return Layers(
        name="1d",
        linear_in=partial(ColumnParallelLinear, ops=ops),  # the first linear of a pair: output features split
        linear_out=partial(RowParallelLinear, ops=ops),  # the second: partial sums; the caller leaves, then adds .bias
        enter=partial(enter_region, ops=ops),
        leave=partial(leave_region, ops=ops),
        leave_linear=partial(leave_linear, ops=ops),
        layer_norm=norm,
        embedding=partial(VocabParallelEmbedding, ops=ops),
        position=position_embedding,
        scatter=scatter_sequence,
        logits=partial(output_logits, ops=ops),
        loss=partial(output_loss, ops=ops),
        boundary_shape=boundary_shape,
        keep_mask=keep_mask,
        ring_attention=partial(ring_attention, combine=combine),
    )


LAYERS = layers()
