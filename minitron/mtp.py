"""Multi-token prediction (MTP; DeepSeek-V3 §2.2, after Gloeckle et al. 2024): D sequential
modules on the last pipeline stage that predict the tokens after the next one, sharing
the model's embedding and output layer (``mtp_depths`` = D, ``mtp_weight`` = λ).

Depth k (1..D) at position i: h'_i = M_k [RMSNorm(h_i^{k−1}); RMSNorm(Emb(t_{i+k}))] (the
two normalized states concatenated, 2h, projected back to h by M_k), then one transformer
block, h^k = TRM_k(h'), then its own final norm and the *shared* output layer predict
t_{i+k+1}. h^0 is the main model's last hidden state (before its final norm). The tokens
t_{i+k} and t_{i+k+1} are read off the targets (t_{j+1} is target j), so the last stage
needs no token ids: :func:`tokens_ahead` lays the D tokens ahead of each target beside it,
read off the whole row *before* --cp cuts it into a rank's chunks (:func:`targets_on_rank`,
the Trainer's), so a rank's positions read the tokens ahead that other context ranks hold.
The sequence keeps its length (Megatron-Core's rolled inputs): the positions without a
token k ahead read a rolled-in token and weigh 0 in the loss (the others s/(s−k), so the
mean over a rank's tokens, averaged over the context ranks, is the mean over the s−k
scored positions), and the causal mask keeps them from reaching the others; sequence-
parallel shards stay whole, and under --cp the depth's block attends like any block. The
MTP loss, λ/D · Σ_k L_k (each L_k the mean cross-entropy over the positions that have a
target), is added to the objective in the backward only (:class:`AddToBackward`): the
logged loss stays the language model's, and evaluation and generation (a model in
``eval()``) never run the modules.

Under tensor parallelism the projection M_k is replicated (2h·h weights on every tensor
rank, its gradient summed under --sp like a norm's): it maps the block's input as the
block holds it, the whole sequence or the --sp shard. Under pipelines the last stage needs
the embedding. In Megatron's loop it is on another rank: the last stage keeps a copy of
``wte`` whose gradient is summed with the first stage's over the 'embed' axis, the path of
a tied embedding (``model.GPT``). In the V of zb-v and dualpipe-v the last stage shares
pipeline rank 0 with the first: it reads that chunk's ``wte`` itself (no copy, nothing on
the 'embed' axis), whose gradient sums both uses locally. Each depth's block is the
model's *dense* block (DeepSeek-V3's is a MoE block; a mixture here would have to be
priced by the analysis' dense twin, not written).
"""
from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .context import Context
from .mla import ReplicatedLinear
from .parallel.context_parallel import local_positions, local_tokens
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

    def loss(self, h, ahead, embed, lm_head, key=NO_KEY):
        """λ/D · Σ_k L_k from the main model's last hidden states `h` (this rank's, as the
        blocks hold them), the microbatch's tokens `ahead` [b, s_rank, 1 + D] (this context
        rank's positions of :func:`tokens_ahead`, whole under --sp), the shared embedding
        `embed` (token ids -> this rank's hidden states) and output layer `lm_head`."""
        total, ctx, n = 0.0, self.ctx, ahead.shape[1]
        pos = local_positions(n, ctx.comm, ahead.device)  # the global positions of this rank's tokens
        pos = torch.arange(pos.start, pos.stop, device=ahead.device) if isinstance(pos, slice) else pos
        s = n * ctx.comm.size("cp")
        for k, depth in enumerate(self.depths, start=1):
            h = depth(h, embed(ahead[..., k - 1]), key)  # Emb(t_{i+k}) at position i
            logits = self.layers.logits(depth.norm(h), lm_head, ctx)
            scored = (pos < s - k).to(logits.dtype) * (s / (s - k))  # those with a token k+1 ahead
            total = total + self.layers.loss(logits, ahead[..., k], lm_head, ctx,
                                             weights=scored.expand(ahead.shape[:2]))
        return total * (self.cfg.mtp_weight / len(self.depths))


def tokens_ahead(targets, depths: int):
    """Whole rows of targets [b, s] -> [b, s, 1 + D]: column j the target j positions
    ahead (t_{i+1+j}; rolled in from the row's start past its end, where the loss weighs
    0), column 0 the targets themselves."""
    return torch.stack([targets.roll(-j, dims=1) for j in range(depths + 1)], dim=-1)


def targets_on_rank(targets, depths: int, comm):
    """This context rank's targets of whole rows [b, s]: its chunks of
    :func:`tokens_ahead` with D depths (of the targets alone without MTP). The tokens ahead
    are taken before the rows are cut: a rank's last positions read the next chunk's."""
    return local_tokens(tokens_ahead(targets, depths) if depths else targets, comm)
