"""Multi-head latent attention (MLA; DeepSeek-V2, arXiv 2405.04434 §2.1; DeepSeek-V3 §2.1.1),
the attention of a block with ``attention="mla"``, in place of ``model.Attention``.

Keys and values are compressed into one latent per token, c_KV = RMSNorm(W_DKV·x) of
width ``kv_lora_rank`` (the down-projection ``kv_a``); each head's key (no positions) and
value are decompressed from it (the up-projection ``kv_b``, rows [head][k_nope | v]).
The rotary part of the key is *decoupled*: one key k_R = RoPE(W_KR·x) of width
``qk_rope_head_dim``, computed with the latent (``kv_a``'s last rows) and shared by every
head. Queries likewise: c_Q = RMSNorm(W_DQ·x) of width ``q_lora_rank`` (``q_a``), then
``q_b`` (rows [head][q_nope | q_rope]); with ``q_lora_rank = 0`` (DeepSeek-V2-Lite) the
queries are one projection ``q``. Head i attends with q_i = [q_nope_i, RoPE(q_rope_i)]
and k_i = [k_nope_i, k_R], scale 1/√(qk_nope + qk_rope), values of width ``v_head_dim``;
the heads' outputs go through ``proj`` (W_O). No biases. Inference would cache only
c_KV and k_R per token (512 + 64 in DeepSeek-V3). The rotary dimensions are paired
interleaved (i, i+1), DeepSeek's layout (transformers' ``rope_interleave=True``), so its
checkpoints load without a permutation.

Tensor parallelism (1-D): heads split. ``q_b``, ``kv_b`` (or ``q``) are column-parallel
(whole heads per rank), ``proj`` row-parallel, as in Megatron's attention. The down-
projections ``q_a``, ``kv_a`` and the latent norms are *replicated*: they are small
(h·(q_lora + kv_lora + rope) against the up-projections' heads·d·(q_lora + kv_lora)) and
every head reads the whole latent and the shared rotary key, so a split would need a
collective to rebuild the latent before any head could use it. They run on the block's
input as the block holds it, and the tensor-parallel region is entered at the *latents*:
without --sp on the whole sequence, f applied to c_Q, c_KV and k_R (their gradients,
partial sums over the heads, all-reduced; the replicated weights' gradients are then
whole on every rank); with --sp on this rank's sequence shard, the up-projections all-
gathering the latents (b·s·(q_lora + kv_lora + rope) instead of b·s·h; Megatron-Core's
MLA does the same) and the replicated weights' gradients summed over the tensor group, as
a LayerNorm's. Pipelines need nothing of their own; the analysis reads all of it off the
model (``analysis/dry_run.py``).

Context parallelism (--cp; ``parallel/context_parallel.py``). The projections, the latents
and their norms are per token, so they run on the rank's own tokens; the rotary angles are
those of the tokens' global positions (chunks r and 2N−1−r, ``local_positions``); only
the attention core spans the context group. It runs on the *decompressed* heads, by
standard attention's ring (Liu et al. 2023) or all-to-all (Ulysses, arXiv 2309.14509),
which join K [.., dn+dr] and V [.., dv] into one message along the width. What the ring
passes is a choice: these per-head K and V, heads/t·(dn + dr + dv) elements per token,
or the latent c_KV and the shared k_R, (kv_lora + dr) per token, every receiver
decompressing each visiting block with ``kv_b`` and the backward returning the latent's
gradient. The latent is the smaller message (71× for DeepSeek-V3 at t = 1, 8.9× at t = 8:
``analysis.context_parallel.cp_message_elements``, which prices both), but it costs each
rank the up-projection of every block it receives, forward and again backward (N times
the decompression, ≈ kv_lora/c of a block pair's attention for chunks of c tokens), and a
ring of its own. The heads are passed: the one ring, proven on every mask, runs unchanged
and computes nothing twice; the latent ring is the better trade where the link, not the
FLOPs, bounds the step, and is priced, not built.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .config import ModelConfig
from .context import Context, make_param
from .parallel import tensor as tp
from .parallel.context_parallel import local_positions, ulysses_attention, usp_attention
from .parallel.random import NO_KEY
from .recompute import recompute


class ReplicatedLinear(nn.Module):
    """y = x·Wᵀ with the whole weight on every tensor rank (MLA's down-projections): its
    gradient summed over the tensor group under --sp (each copy saw its tokens only)."""

    def __init__(self, name: str, d_in: int, d_out: int, ctx: Context, std: float = 0.02):
        super().__init__()
        self.weight = make_param(f"{name}.weight", (d_out, d_in), (), ctx, std, **tp.replicated(ctx))

    def forward(self, x):
        return F.linear(x, self.weight)


def rotate_interleaved(x, cos, sin):
    """The rotary embedding on interleaved pairs (x_2i, x_2i+1), each turned by angle i
    (DeepSeek's layout; transformers' ``apply_rotary_pos_emb_interleave``): `cos`, `sin`
    [s, d] are Hugging Face's ``cat(freqs, freqs)``, of which the first half is used.
    The output lists the pairs' first elements, then their second ones."""
    c, s = cos[..., : x.shape[-1] // 2].to(x.dtype), sin[..., : x.shape[-1] // 2].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class MLA(nn.Module):
    """Multi-head latent attention of block `name` (``blocks.i.attn``); see the module's
    docstring. `rotary_angles`: the model's (``model.rotary_angles``), so that every
    attention kind turns a position by the same angles."""

    def __init__(self, name: str, cfg: ModelConfig, ctx: Context, layers, rotary_angles):
        super().__init__()
        self.ctx, self.layers, self.angles, self.rope_base = ctx, layers, rotary_angles, cfg.rope_base
        h, nh, std = cfg.hidden, cfg.heads, 0.02
        self.dn, self.dr, self.dv, self.r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        norm = dict(kind="rmsnorm", eps=cfg.norm_eps, bias=False)
        if cfg.q_lora_rank:
            self.q_a = ReplicatedLinear(f"{name}.q_a", h, cfg.q_lora_rank, ctx, std)
            self.q_a_norm = layers.layer_norm(f"{name}.q_a_norm", cfg.q_lora_rank, ctx, **norm)
            self.q_b = layers.linear_in(f"{name}.q_b", cfg.q_lora_rank, nh * (self.dn + self.dr), ctx, std, bias=False)
        else:
            self.q = layers.linear_in(f"{name}.q", h, nh * (self.dn + self.dr), ctx, std, bias=False)
        self.kv_a = ReplicatedLinear(f"{name}.kv_a", h, self.r + self.dr, ctx, std)
        self.kv_a_norm = layers.layer_norm(f"{name}.kv_a_norm", self.r, ctx, **norm)
        self.kv_b = layers.linear_in(f"{name}.kv_b", self.r, nh * (self.dn + self.dv), ctx, std, bias=False)
        self.proj = layers.linear_out(f"{name}.proj", nh * self.dv, h, ctx, std / math.sqrt(2 * cfg.layers),
                                      bias=False)

    def whole(self, x):
        """A latent into the tensor-parallel region: f (the up-projections' entry); with
        --sp the shared rotary key, which no linear gathers, is all-gathered here."""
        if self.ctx.tp > 1 and self.ctx.layout.sp:
            return tp.gather(x, self.ctx.comm, "tp", tp.SEQ)
        return self.layers.enter(x, self.ctx)

    def project(self, x):
        """The block's input -> (this rank's heads' queries [b, s, nh·(dn+dr)], keys and
        values [b, s, nh·(dn+dv)], the shared rotary key [b, s, dr], not yet rotated)."""
        ckv, k_rope = self.kv_a(x).split([self.r, self.dr], dim=-1)
        kv = self.kv_b(self.layers.enter(self.kv_a_norm(ckv), self.ctx))
        if hasattr(self, "q_a"):
            q = self.q_b(self.layers.enter(self.q_a_norm(self.q_a(x)), self.ctx))
        else:
            q = self.q(self.layers.enter(x, self.ctx))
        return q, kv, self.whole(k_rope)

    def core(self, parts, key=NO_KEY):
        """softmax(q_i·k_iᵀ/√(dn+dr))·v_i on this rank's heads: the part selective
        recompute redoes. The rotary angles are those of the tokens' global positions."""
        q, kv, k_rope = parts
        q_nope, q_rope = rearrange(q, "b s (nh d) -> b nh s d", d=self.dn + self.dr).split([self.dn, self.dr], -1)
        k_nope, v = rearrange(kv, "b s (nh d) -> b nh s d", d=self.dn + self.dv).split([self.dn, self.dv], -1)
        cos, sin = self.angles(local_positions(q.shape[1], self.ctx.comm), self.dr, self.rope_base, q.device)
        q_rope, k_rope = rotate_interleaved(q_rope, cos, sin), rotate_interleaved(k_rope[:, None], cos, sin)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        return rearrange(self.attend(q, k, v), "b nh s d -> b s (nh d)")

    def attend(self, q, k, v):
        """Causal attention of the decompressed heads (q, k [b, nh, s, dn+dr], v [b, nh, s, dv]),
        scale 1/√(dn+dr): on this rank's tokens alone, or under --cp over the context group,
        by the ring, the all-to-all or USP of standard attention (all take dv ≠ dk)."""
        layout = self.ctx.layout
        if layout.cp > 1 and layout.cp_mode == "a2a":
            return ulysses_attention(q, k, v, self.ctx.comm)
        if layout.cp > 1 and layout.cp_mode == "usp":
            return usp_attention(q, k, v, self.ctx.comm, ring=self.layers.ring_attention)
        if layout.cp > 1:
            return self.layers.ring_attention(q, k, v, self.ctx.comm)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=(self.dn + self.dr) ** -0.5)

    def forward(self, x, key=NO_KEY):
        parts = self.project(x)
        if self.ctx.layout.recompute == "selective" and self.training:
            y = recompute(self.core, parts, key, hooks=self.ctx.saved_tensors)
        else:
            y = self.core(parts, key)
        return self.layers.leave_linear(self.proj, y, self.ctx)
