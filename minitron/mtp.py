"""Multi-token prediction (MTP; DeepSeek-V3 §2.2, after Gloeckle et al. 2024): D sequential
modules on the last pipeline stage that predict the tokens after the next one, sharing
the model's embedding and output layer (``mtp_depths`` = D, ``mtp_weight`` = λ).

Depth k (1..D) at position i: h'_i = M_k [RMSNorm(h_i^{k−1}); RMSNorm(Emb(t_{i+k}))] (the
two normalized states concatenated, 2h, projected back to h by M_k), then one transformer
block, h^k = TRM_k(h'), then its own final norm and the *shared* output layer predict
t_{i+k+1}. h^0 is the main model's last hidden state (before its final norm). The tokens
t_{i+k} and t_{i+k+1} are read off the targets (t_{j+1} is target j), so the last stage
needs no token ids. The sequence keeps its length (Megatron-Core's rolled inputs): the
positions without a token k ahead read a rolled-in token and are left out of the loss,
and the causal mask keeps them from reaching the others; sequence-parallel shards stay
whole. The MTP loss, λ/D · Σ_k L_k (each L_k the mean cross-entropy over the positions
that have a target), is added to the objective in the backward only
(:class:`AddToBackward`): the logged loss stays the language model's, and evaluation and
generation (a model in ``eval()``) never run the modules.

Under tensor parallelism the projection M_k is replicated (2h·h weights on every tensor
rank, its gradient summed under --sp like a norm's): it maps the block's input as the
block holds it, the whole sequence or the --sp shard. Under pipelines the last stage needs
the embedding: it keeps a copy of ``wte`` whose gradient is summed with the first
stage's over the 'embed' axis, the path of a tied embedding (``model.GPT``). Each depth's
block is the model's *dense* block (DeepSeek-V3's is a MoE block; a mixture here would
have to be priced by the analysis' dense twin, not written).
"""
from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .context import Context
from .mla import ReplicatedLinear
from .parallel.random import NO_KEY


class AddToBackward(torch.autograd.Function):
    """`loss` forward; backward, the gradient of ``loss + extra``: `extra` (the MTP loss)
    joins the objective without changing the logged value."""

    @staticmethod
    def forward(fctx, loss, extra):
        return loss.view_as(loss)

    @staticmethod
    def backward(fctx, g):
        return g, g


class Depth(nn.Module):
    """MTP module k: the two norms, the projection M_k and one block (``blocks.{L+k}``)."""

    def __init__(self, k: int, cfg: ModelConfig, ctx: Context, layers, block_cls):
        super().__init__()
        norm = dict(kind="rmsnorm", eps=cfg.norm_eps, bias=False)
        self.hnorm = layers.layer_norm(f"mtp.{k}.hnorm", cfg.hidden, ctx, **norm)
        self.enorm = layers.layer_norm(f"mtp.{k}.enorm", cfg.hidden, ctx, **norm)
        self.proj = ReplicatedLinear(f"mtp.{k}.proj", 2 * cfg.hidden, cfg.hidden, ctx)
        self.block = block_cls(cfg.layers + k - 1, cfg.replace(experts=0), ctx, layers)
        self.norm = layers.layer_norm(f"mtp.{k}.norm", cfg.hidden, ctx, **norm)

    def forward(self, h, e, key=NO_KEY):
        return self.block(self.proj(torch.cat([self.hnorm(h), self.enorm(e)], dim=-1)), key)


class MTP(nn.Module):
    """The D depths on the last stage; :meth:`loss` runs them after the main model."""

    def __init__(self, cfg: ModelConfig, ctx: Context, layers, block_cls):
        super().__init__()
        self.cfg, self.ctx, self.layers = cfg, ctx, layers
        self.depths = nn.ModuleList(Depth(k, cfg, ctx, layers, block_cls) for k in range(1, cfg.mtp_depths + 1))

    def loss(self, h, targets, embed, lm_head, key=NO_KEY):
        """λ/D · Σ_k L_k from the main model's last hidden states `h` (this rank's, as the
        blocks hold them), the microbatch's `targets` [b, s] (whole on every rank), the
        shared embedding `embed` (token ids -> this rank's hidden states) and output layer
        `lm_head`."""
        s, total, ctx = targets.shape[1], 0.0, self.ctx
        for k, depth in enumerate(self.depths, start=1):
            h = depth(h, embed(targets.roll(-(k - 1), dims=1)), key)  # Emb(t_{i+k}) at position i
            logits = self.layers.logits(depth.norm(h), lm_head, ctx)[:, : s - k]  # those with a token k+1 ahead
            total = total + self.layers.loss(logits, targets[:, k:], lm_head, ctx)
        return total * (self.cfg.mtp_weight / len(self.depths))
