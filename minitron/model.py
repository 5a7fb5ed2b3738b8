"""A decoder-only transformer, written once for every layout: GPT-2's block by default
(pre-LayerNorm, learned positions, GELU MLP of 4h, causal attention through
`scaled_dot_product_attention`), the Llama family's with the ModelConfig knobs (RMSNorm,
SwiGLU, rotary positions, grouped-query attention, no biases).

The single-device model is this class with every parallel degree 1: the tensor-parallel
operators become identities and one stage holds every layer. A pipeline stage is the
same class holding a contiguous range of layers (the embedding on the first stage, the
final norm, head and loss on the last). Parameter names are layout-independent
(`blocks.7.mlp.fc.weight` is layer 7 whatever stage holds it), and each weight is drawn
from its own seed and sliced, so every layout trains the very same model.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .config import ModelConfig, ParallelConfig
from .context import Context
from .mla import MLA
from .moe import MoE
from .mtp import MTP, AddToBackward, tokens_ahead
from .parallel import cube, summa
from .parallel import tensor as tp
from .parallel.ops import sharded_norm
from .context import make_param, shard_slice
from .parallel.context_parallel import (blockwise_window_attention, document_attention, local_positions, local_tokens,
                                       sees, ulysses_attention, usp_attention)
from .parallel.random import NO_KEY, Dropout
from .recompute import recompute
from .rope import default_inv_freq, rope_frequencies


def layers_for(layout: ParallelConfig):
    """The layer namespace of the layout, what the model is written against:
    ``linear_in`` / ``linear_out`` (the two linears of a pair; the caller adds
    ``linear_out``'s bias after ``leave``), ``enter`` / ``leave`` (into and out of the
    tensor-parallel region; ``leave_linear``: the second linear and the exit in one step,
    which --tp-overlap decomposes together), ``layer_norm``, ``embedding`` (also the output layer),
    ``position``, ``scatter``, ``logits``, ``loss``, ``boundary_shape`` (the hidden
    states between pipeline stages), ``keep_mask`` (which part of a dropout mask this
    rank draws) and ``ring_attention`` (attention under --cp). 1-D (Megatron) comes from
    ``parallel/tensor.py``; the 3-D cube (``--tp-mode 3d``) from ``parallel/cube.py``;
    2-D SUMMA and 2.5-D Tesseract (``--tp-mode 2d``, ``2.5d``) from ``parallel/summa.py``.
    A lab builds one with a learner's operator (``tensor.layers(f=...)``) and passes it in."""
    if layout.tp_mode == "3d":
        return cube.LAYERS
    if layout.tp_mode in ("2d", "2.5d"):
        return summa.LAYERS
    return tp.LAYERS


def rotary_angles(positions, head_dim: int, base: float, device, cfg: ModelConfig | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [s, head_dim] of the rotary angles p·θ_i, θ_i = base^(−2i/d) (Su et al.
    2021, Eq. 15), for the *global* positions `positions` of this rank's tokens (chunks r
    and 2N−1−r under context parallelism): every split of the sequence rotates a token by
    the angle of its own position. In Hugging Face's layout (each angle on dimensions i
    and i + d/2, ``emb = cat(freqs, freqs)``) and, as ``LlamaRotaryEmbedding``, computed
    in float32 whatever the model's dtype, so that a Llama checkpoint's logits agree.
    With `cfg`, its frequencies (scaled by ``rope_scaling``: ``rope.rope_frequencies``),
    cos and sin multiplied by the scaling's attention factor (YaRN). Positions [b, s] (one
    row each, --pack's positions in their documents) give [b, s, head_dim]."""
    if isinstance(positions, slice):
        positions = torch.arange(positions.start, positions.stop)
    inv_freq, factor = rope_frequencies(cfg) if cfg is not None else (default_inv_freq(head_dim, base), 1.0)
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # [s, d/2] (or [b, s, d/2] per row)
    emb = torch.cat([freqs, freqs], dim=-1).to(device)
    return emb.cos() * factor, emb.sin() * factor


def rotate(x, cos, sin):
    """x·cos + rotate_half(x)·sin: the rotary embedding in the rotate-half convention (the
    pairs are dimensions i and i + d/2 of a head, as Hugging Face stores Llama's q and k;
    Meta's original checkpoints pair neighbours i, i+1 and are permuted on conversion)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat([-x2, x1], dim=-1) * sin.to(x.dtype)


class Attention(nn.Module):
    """Causal self-attention; heads split over the tensor group (QKV column-parallel,
    output projection row-parallel: Megatron-LM Fig. 3b).

    Multi-head attention (kv_heads == heads, GPT-2) has one QKV linear whose rows are
    head-major, [head][q|k|v][head_dim], so a contiguous slice holds whole heads.

    Grouped-query attention (kv_heads < heads; Ainslie et al. 2023) has two: ``q``
    [heads·d, h], query head i in rows i·d.., and ``kv`` [2·kv·d, h], laid out
    [kv head][k|v][d]. Query head i reads kv head i // G (G = heads/kv), Hugging Face's
    order, so a contiguous slice of ``q`` holds whole query groups and the matching
    slice of ``kv`` their key/value heads. Under 1-D tensor parallelism with t ≤ kv each
    rank holds kv/t kv heads and their heads/t queries. With t > kv (which torchtitan and
    transformers refuse) each kv head is *replicated* on the t/kv neighbouring ranks that
    hold its queries (``tensor.block_rows``): the layer's ``kv`` weight costs t/kv times
    its 2·kv·d·h/t share on every rank (2·d·h elements instead of 2·kv·d·h/t), and each
    step all-reduces its gradient, 2·d·h(+2·d) elements, over exactly those t/kv ranks
    (axis 'tp_kv{t/kv}'; nothing when t/kv = 1). We chose replication over splitting a
    head's d dimensions (which would need a collective inside attention) because it
    keeps attention local to the rank, as for multi-head attention. Two linears instead
    of one fused: under --sp each all-gathers its input (one more all-gather of b·s·h
    per layer than a fused QKV); the names stay the same in every layout.

    Rotary positions (``positions="rope"``) rotate q and k after the projection, by the
    angles of the tokens' global positions (:func:`rotary_angles`).

    Long-context and family knobs: a head width d apart from h/heads (the projections are
    h -> heads·d and heads·d -> h); biases on Q, K, V only (``qkv_bias``, Qwen2); RMSNorm
    over each head's d of q and k before the rotation (``qk_norm``, Qwen3: weights [d],
    copied on every tensor rank, whose gradients are partial sums over its heads, so
    summed over 'tp'), or over the whole projection (``qk_norm_span="all"``, OLMoE:
    :class:`ProjectionNorm`, one all-reduce of a sum of squares per token over 'tp'); a
    sliding `window` (Mistral: a query sees its `window` latest keys)."""

    def __init__(self, name: str, cfg: ModelConfig, ctx: Context, layers, window: int = 0):
        super().__init__()
        h, std, d, qw = cfg.hidden, 0.02, cfg.head_dim, cfg.q_width
        self.head_dim, self.ctx, self.layers, self.window = d, ctx, layers, window
        self.rope_base = cfg.rope_base if cfg.positions == "rope" else None
        self.rope_cfg = cfg if cfg.rope_scaling else None
        self.grouped = cfg.n_kv_heads < cfg.heads
        qkv_bias = {} if cfg.bias or cfg.qkv_bias else {"bias": False}
        if self.grouped:
            self.q = layers.linear_in(f"{name}.q", h, qw, ctx, std, **qkv_bias)
            self.kv = layers.linear_in(f"{name}.kv", h, 2 * cfg.n_kv_heads * d, ctx, std, **qkv_bias,
                                       blocks=cfg.n_kv_heads)
        else:
            self.qkv = layers.linear_in(f"{name}.qkv", h, 3 * qw, ctx, std, **qkv_bias)
        self.proj = layers.linear_out(f"{name}.proj", qw, h, ctx, std / math.sqrt(2 * cfg.layers), **_bias(cfg))
        self.drop = Dropout(f"{name}.probs", cfg.dropout, ctx, layers.keep_mask, inside=True)  # per-rank stream
        if cfg.qk_norm and cfg.qk_norm_span == "all":  # OLMoE: over the whole projection
            self.q_norm, self.k_norm = (ProjectionNorm(f"{name}.{n}", heads * d, ctx, cfg.norm_eps)
                                        for n, heads in (("q_norm", cfg.heads), ("k_norm", cfg.n_kv_heads)))
        elif cfg.qk_norm:
            self.q_norm, self.k_norm = HeadNorm(f"{name}.q_norm", d, ctx, cfg.norm_eps), HeadNorm(
                f"{name}.k_norm", d, ctx, cfg.norm_eps)

    def split_heads(self, x, docs=None):
        """The projections' output [b, s, ·] -> q [b, nh, s, d], k and v [b, kv, s, d] (this
        rank's heads), rotated by their positions with rotary embeddings (with --pack, the
        positions in their documents: ``docs``, the microbatch's ``packing.Documents``)."""
        if self.grouped:
            q, kv = x
            q = rearrange(q, "b s (nh d) -> b nh s d", d=self.head_dim)
            k, v = rearrange(kv, "b s (nkv two d) -> two b nkv s d", two=2, d=self.head_dim)
        else:
            q, k, v = rearrange(x, "b s (nh three d) -> three b nh s d", three=3, d=self.head_dim)
        if hasattr(self, "q_norm"):  # Qwen3, OLMoE: q and k normalised, then rotated
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_base is not None:
            # global positions of this rank's tokens (chunks r and 2N-1-r under --cp);
            # under --sp the column-parallel linear has gathered the whole sequence
            pos = local_positions(q.shape[-2], self.ctx.comm) if docs is None else \
                local_tokens(docs.positions, self.ctx.comm, docs=docs)  # [b, s]: each token's place in its document
            cos, sin = rotary_angles(pos, self.head_dim, self.rope_base, q.device, self.rope_cfg)
            if docs is not None:  # per row: [b, 1 (heads), s, d]
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        return q, k, v

    def core(self, qkv, key=NO_KEY, docs=None):
        """softmax(QK^T/sqrt(d))V on this rank's heads: the part selective recompute redoes.
        With dropout the core is written out, so that the mask comes from our streams
        (SDPA's internal dropout cannot be given a generator); otherwise SDPA. With
        context parallelism, ring attention over the context group (its keys and values
        travel; parallel/context_parallel.py), Ulysses' all-to-all or USP's both. A sliding window masks the keys beyond it;
        with --pack `docs` masks the keys of other documents (block-diagonal causal)."""
        q, k, v = self.split_heads(qkv, docs)
        win = {"window": self.window} if self.window else {}
        if docs is not None:
            win["docs"] = docs
        if self.ctx.layout.cp > 1 and self.ctx.layout.cp_mode == "a2a":
            y = ulysses_attention(q, k, v, self.ctx.comm, **win)  # heads over the context ranks (Ulysses)
        elif self.ctx.layout.cp > 1 and self.ctx.layout.cp_mode == "usp":  # both: heads over a row, a ring per column
            y = usp_attention(q, k, v, self.ctx.comm, ring=self.layers.ring_attention, **win)
        elif self.ctx.layout.cp > 1:
            y = self.layers.ring_attention(q, k, v, self.ctx.comm, **win)
        elif self.training and self.drop.p > 0:
            s, group = q.shape[-2], q.shape[1] // k.shape[1]
            if group > 1:  # query head i on kv head i // G (repeat_interleave copies even for 1)
                k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            # an additive mask, a constant: autograd saves nothing for it (masked_fill on the
            # scores would keep its s x s boolean mask for backward, bytes the memory formula has not)
            mask = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(
                ~sees(s, self.window, docs, q.device), float("-inf"))
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim)) + mask
            y = self.drop(att.softmax(dim=-1), key) @ v
        elif docs is not None:  # block-diagonal causal: each document alone (a varlen kernel's Σ sᵢ² work)
            y = document_attention(q, k, v, docs, self.window)
        elif self.window:  # only the blocks of keys in reach (its FLOPs are a window's, not s²)
            y = blockwise_window_attention(q, k, v, self.window)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.grouped)
        return rearrange(y, "b nh s d -> b s (nh d)")

    def forward(self, x, key=NO_KEY, docs=None):
        x = self.layers.enter(x, self.ctx)
        qkv = (self.q(x), self.kv(x)) if self.grouped else self.qkv(x)
        if self.ctx.layout.recompute == "selective" and self.training:
            y = recompute(self.core, qkv, key, docs, hooks=self.ctx.saved_tensors)
        else:
            y = self.core(qkv, key, docs)
        return add_bias(self.layers.leave_linear(self.proj, y, self.ctx), self.proj)


class HeadNorm(nn.Module):
    """RMSNorm over each head's d dimensions (Qwen3's q_norm, k_norm), weight [d]: copied on
    every tensor rank, each copy's gradient a partial sum over the rank's heads, so summed
    over 'tp' (``ShardInfo.grad_sync``) before the optimizer step."""

    def __init__(self, name: str, d: int, ctx: Context, eps: float):
        super().__init__()
        copies = {"replicas": ("tp",), "grad_sync": ("tp",)} if ctx.tp > 1 else {}
        self.weight, self.eps = make_param(f"{name}.weight", (d,), (), ctx, kind="ones", **copies), eps

    def forward(self, x):
        return tp.rms_norm(x, self.weight, self.eps)


class ProjectionNorm(nn.Module):
    """RMSNorm over all heads of q (or k) at once, n = heads·d features (OLMoE's q_norm and
    k_norm, weight [n]; Groeneveld et al. 2024 normalise the whole projection, not each head).
    Under 1-D tensor parallelism a rank holds its heads' slice of the weight (no copies) and
    the sum of squares is all-reduced over 'tp' (forward, and Σ(g·x̂) in backward:
    ``ops.ShardedRMSNormFn``, the 2-D and 3-D modes' split-hidden RMSNorm)."""

    def __init__(self, name: str, n: int, ctx: Context, eps: float):
        super().__init__()
        self.n, self.eps, self.comm = n, eps, ctx.comm
        self.weight = make_param(f"{name}.weight", (n,), (shard_slice(n, ctx.tp, ctx.tp_rank),), ctx, kind="ones")

    def forward(self, x):
        """x [b, heads here, s, d] normalised over (heads here, d) and the other ranks' heads."""
        flat = rearrange(x, "b nh s d -> b s (nh d)")
        y = sharded_norm(flat, self.weight, None, self.comm, "tp", self.n, self.eps, rms=True)
        return rearrange(y, "b s (nh d) -> b nh s d", d=x.shape[-1])


def _bias(cfg: ModelConfig) -> dict:
    """A linear's ``bias`` keyword: nothing for GPT-2's default (a lab's linear keeps the
    engine's signature), ``bias=False`` without biases."""
    return {} if cfg.bias else {"bias": False}


def add_bias(y, linear):
    """y + the bias of the second linear of a pair (added after the reduction), if any."""
    return y if linear.bias is None else y + linear.bias


class MLP(nn.Module):
    """h -> f -> h, column- then row-parallel (Megatron-LM Fig. 3a): GELU (f = 4h in GPT-2)
    or SwiGLU ``fc2(silu(gate·x) ∘ (up·x))`` (Shazeer 2020; Llama).

    SwiGLU's gate and up are one column-parallel linear ``fc`` [2f, h] whose rows are
    stored interleaved, [unit j][gate|up]: row 2j is gate unit j, row 2j+1 up unit j, so
    any contiguous slice of rows (a tensor rank's, a grid column's) holds matching pairs,
    whatever the number of ranks; one matmul, one communication. The linear computes with
    its local rows regrouped [gate rows | up rows] (``parts=2``), so the two halves of its
    output are contiguous blocks."""

    def __init__(self, name: str, cfg: ModelConfig, ctx: Context, layers):
        super().__init__()
        self.ctx, self.layers = ctx, layers
        self.swiglu = cfg.activation == "swiglu"
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"  # GPT-2's gelu_new
        width = 2 * cfg.ffn_hidden if self.swiglu else cfg.ffn_hidden
        self.fc = layers.linear_in(f"{name}.fc", cfg.hidden, width, ctx, **_bias(cfg),
                                   **({"parts": 2} if self.swiglu else {}))
        self.fc2 = layers.linear_out(f"{name}.fc2", cfg.ffn_hidden, cfg.hidden, ctx,
                                     0.02 / math.sqrt(2 * cfg.layers), **_bias(cfg))

    def activation(self, y):
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)  # this rank's gate units, then the same units' up
            return F.silu(gate) * up
        return F.gelu(y, approximate=self.approximate)

    def forward(self, x):
        y = self.activation(self.fc(self.layers.enter(x, self.ctx)))
        return add_bias(self.layers.leave_linear(self.fc2, y, self.ctx), self.fc2)


def norm(name: str, cfg: ModelConfig, ctx: Context, layers):
    """The block's normalization: LayerNorm (GPT-2) or RMSNorm (Llama), from the layout's layers."""
    return layers.layer_norm(name, cfg.hidden, ctx, kind=cfg.norm, eps=cfg.norm_eps, bias=cfg.bias)


class Block(nn.Module):
    def __init__(self, i: int, cfg: ModelConfig, ctx: Context, layers):
        super().__init__()
        self.ln1 = norm(f"blocks.{i}.ln1", cfg, ctx, layers)
        self.attn = MLA(f"blocks.{i}.attn", cfg, ctx, layers, rotary_angles) if cfg.attention == "mla" else Attention(
            f"blocks.{i}.attn", cfg, ctx, layers, window=cfg.window_of(i))  # latent attention (mla.py) or the standard kind
        self.ln2 = norm(f"blocks.{i}.ln2", cfg, ctx, layers)
        # a mixture of experts in place of the MLP where the config says so (moe.py)
        self.mlp = MoE(f"blocks.{i}.mlp", cfg, ctx, layers, MLP) if cfg.is_moe_block(i) else MLP(
            f"blocks.{i}.mlp", cfg, ctx, layers)
        self.drop1 = Dropout(f"blocks.{i}.attn.out", cfg.dropout, ctx, layers.keep_mask)  # shared stream
        self.drop2 = Dropout(f"blocks.{i}.mlp.out", cfg.dropout, ctx, layers.keep_mask)

    def forward(self, x, key=NO_KEY, docs=None):
        """`key` (step, microbatch) picks the dropout masks: recomputation passes the same.
        `docs`: the microbatch's documents (--pack), which attention masks by."""
        x = x + self.drop1(self.attn(self.ln1(x), key, **({"docs": docs} if docs is not None else {})), key)
        return x + self.drop2(self.mlp(self.ln2(x)), key)


class GPT(nn.Module):
    """The GPT, or one pipeline stage of it (`layer_ids`: the global indices it holds),
    built from the layer namespace `layers` (default: the layout's, :func:`layers_for`).

    forward(x, targets, key): on the first stage `x` is token ids [b, s], else the hidden
    states from the previous stage; on the last stage returns the mean loss over the
    microbatch's tokens (or logits when `targets` is None), else the hidden states.
    `key` = (step, microbatch of the global batch) picks every dropout mask. `docs` (--pack:
    the microbatch's ``packing.Documents``, whole rows) restarts the positions per document,
    keeps attention inside each and weighs the loss. With multi-token prediction the
    targets may be [b, s, 1 + D] (``mtp.tokens_ahead``: the tokens ahead beside each
    target, as the Trainer hands them to a context rank); [b, s] are whole rows.

    `embedding`: the first stage's ``wte`` when this rank holds it in another chunk (the V
    placement's rank 0), which the last stage's multi-token prediction reads itself: no
    copy, no sum over 'embed' (the Trainer passes it; ``placement.Placement``).
    """

    def __init__(self, cfg: ModelConfig, ctx: Context | None = None, layer_ids=None,
                 first: bool = True, last: bool = True, *, layers=None, embedding=None):
        super().__init__()
        ctx = ctx or Context()
        self.cfg, self.ctx, self.first, self.last = cfg, ctx, first, last
        self.layers = layers = layers or layers_for(ctx.layout)
        self.layer_ids = list(range(cfg.layers) if layer_ids is None else layer_ids)
        # the last stage's copy of the embedding (tied, or read by multi-token prediction) sums with the
        # first's, when the two are on different pipeline ranks (the grid's 'embed' group: not in a V)
        copied = not (first and last) and ctx.comm.size("embed") > 1
        tied_sync = ("embed",) if (cfg.tied_embeddings or cfg.mtp_depths) and copied else ()
        if first:
            self.wte = layers.embedding("wte", cfg.vocab, cfg.hidden, ctx, grad_sync=tied_sync)
            if cfg.positions == "learned":  # rotary positions have no table (Attention rotates q, k)
                self.wpe = layers.position("wpe.weight", cfg.seq_len, cfg.hidden, ctx, 0.01)
            self.drop = Dropout("embed", cfg.dropout, ctx, layers.keep_mask)
        self.blocks = nn.ModuleDict({str(i): Block(i, cfg, ctx, layers) for i in self.layer_ids})
        if last:
            self.ln_f = norm("ln_f", cfg, ctx, layers)
            if not cfg.tied_embeddings:
                self.lm_head = layers.embedding("lm_head", cfg.vocab, cfg.hidden, ctx)
            elif not first:  # the last stage keeps its own copy of the tied embedding
                self.lm_head = layers.embedding("wte", cfg.vocab, cfg.hidden, ctx, grad_sync=tied_sync)
            else:
                self.lm_head = self.wte
        self.mtp = MTP(cfg, ctx, layers, Block) if last and cfg.mtp_depths else None  # mtp.py
        if self.mtp is not None and not first and not cfg.tied_embeddings:  # the first stage's, or a copy
            self.mtp_wte = embedding if embedding is not None else layers.embedding(
                "wte", cfg.vocab, cfg.hidden, ctx, grad_sync=tied_sync)

    def mtp_embed(self, idx):
        """Multi-token prediction's embedding of token ids: the model's own table, or the
        last stage's copy of it; onto this rank's sequence shard with --sp."""
        table = self.wte if self.first else (self.lm_head if self.cfg.tied_embeddings else self.mtp_wte)
        return self.layers.scatter(table(idx), self.ctx)

    def embed(self, idx, key=NO_KEY, docs=None):
        # positions of this rank's tokens (chunks r and 2N-1-r under context parallelism);
        # with --pack each token's position in its document (Megatron's reset_position_ids)
        x = self.wte(idx)
        if self.cfg.positions == "learned":
            pos = local_positions(idx.shape[1], self.ctx.comm, self.wpe.device) if docs is None else \
                local_tokens(docs.positions, self.ctx.comm, docs=docs).to(self.wpe.device)
            x = x + self.wpe[pos]
        return self.drop(self.layers.scatter(x, self.ctx), key)  # on the sequence shard with --sp

    def run_block(self, block, x, key=NO_KEY, docs=None):
        if self.ctx.layout.recompute == "full" and self.training:  # (recompute runs it plainly without grad)
            return recompute(block, x, key, docs, hooks=self.ctx.saved_tensors)
        return block(x, key, docs)

    def head(self, x):
        """Final LayerNorm and the vocabulary-parallel output layer: local logits."""
        return self.layers.logits(self.ln_f(x), self.lm_head, self.ctx)

    def loss(self, logits, targets, docs=None):
        """Mean cross-entropy over the microbatch's tokens (vocab-parallel when split); with
        --pack weighted by ``docs.loss_weight`` (this rank's tokens of it: packing.py)."""
        if docs is None:
            return self.layers.loss(logits, targets, self.lm_head, self.ctx)
        weights = local_tokens(docs.loss_weight, self.ctx.comm, docs=docs)
        return self.layers.loss(logits, targets, self.lm_head, self.ctx, weights=weights)

    def boundary_shape(self, micro_batch: int) -> tuple:
        """Shape of this rank's hidden states between pipeline stages."""
        tokens = self.cfg.seq_len // self.ctx.layout.cp  # this context rank's share of the sequence
        return self.layers.boundary_shape(micro_batch, tokens, self.cfg.hidden, self.ctx)

    def forward(self, x, targets=None, key=NO_KEY, docs=None):
        if self.first:
            x = self.embed(x, key, docs)
        for block in self.blocks.values():
            x = self.run_block(block, x, key, docs)
        if not self.last:
            return x
        logits = self.head(x)
        if targets is None:
            return logits
        ahead = targets if targets.dim() == 3 else None  # [b, s, 1 + D]: the tokens ahead beside each target
        loss = self.loss(logits, targets if ahead is None else ahead[..., 0], docs)
        if self.mtp is not None and self.training:  # the MTP loss joins the backward only (mtp.py)
            if ahead is None:
                ahead = self.whole_rows_ahead(targets)
            loss = AddToBackward.apply(loss, self.mtp.loss(x, ahead, self.mtp_embed, self.lm_head, key))
        return loss

    def whole_rows_ahead(self, targets):
        """Multi-token prediction's tokens ahead of [b, s] targets, which must be whole rows:
        a context rank's chunks have lost the tokens other ranks hold (``mtp.targets_on_rank``)."""
        if self.ctx.comm.size("cp") > 1:
            raise ValueError("under --cp multi-token prediction needs the tokens ahead taken from whole rows: "
                             "pass the targets of mtp.targets_on_rank")
        return tokens_ahead(targets, self.cfg.mtp_depths)

    @torch.no_grad()
    def generate(self, idx, n: int, temperature: float = 0.8, top_k: int = 40, generator=None):
        """Sample `n` tokens after `idx` [1, t] (single-stage, tensor degree 1 models)."""
        for _ in range(n):
            logits = self(idx[:, -self.cfg.seq_len:])[:, -1, : self.cfg.vocab] / temperature
            v, _ = torch.topk(logits, min(top_k, logits.shape[-1]))
            logits[logits < v[:, [-1]]] = float("-inf")
            probs = F.softmax(logits.float(), dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx


def num_params(model: nn.Module) -> int:
    """Local parameter elements (a tied weight counts once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
