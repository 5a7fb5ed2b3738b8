"""A mixture-of-experts MLP: a router, E experts of the block's MLP kind, optional shared
experts (Shazeer et al. 2017; GShard, Lepikhin et al. 2021; Switch, Fedus et al. 2022;
Mixtral, Jiang et al. 2024; DeepSeek-V3, 2024).

Each token's hidden state x goes to the k experts of highest score, and the MoE's output
is ``Σ_j g_j · expert_{e_j}(x)`` (+ the shared experts' MLP on every token):

* **router**: a linear h → E (no bias), scores softmax (Switch, Mixtral) or sigmoid
  (DeepSeek-V3); the top-k by score, ties broken by the lower index (a stable sort, so
  every layout picks the same experts); gates the chosen scores, renormalized to sum 1
  when k > 1 (for softmax that is Mixtral's softmax over the chosen k), or whatever k with
  ``gate_norm="always"`` (transformers' Mixtral: a top-1 gate is then 1), or never with
  ``gate_norm="never"`` (Qwen2-MoE and OLMoE: the softmax over all E experts, as chosen).
* **group-limited routing** (DeepSeek-V3 §2.1.2, ``expert_groups``, ``topk_groups``): the
  E experts in G groups of consecutive indices (a node's experts); each token first picks
  its best ``topk_groups`` groups, then its k experts inside them (:func:`group_mask`), and
  its gates are scaled by ``routed_scaling``. Under expert parallelism a rank holds whole
  groups (or a group spans ep/G ranks), so a token's rows reach at most
  ``analysis.experts.dispatch_fan_out`` ranks.
* **balancing loss** (Switch Eq. 4, GShard's form, with top-k as Megatron-Core counts it):
  ``α·E·Σ_i f_i·P_i`` with f_i = (tokens sent to expert i)/(T·k), P_i the mean score of
  expert i; added to the training objective with the loss's own weight (1/m per
  microbatch). It enters the backward where it arises (:class:`AttachAux`: the same idea as
  Megatron-Core's ``MoEAuxLossAutoScaler``), so every pipeline stage adds its own; the
  logged loss stays the language-model loss.
* **auxiliary-loss-free balancing** (DeepSeek-V3 §2.1.2): a bias b_i added to the scores
  for the *choice* only (not the gates), moved by ±γ after each step toward balance,
  from the step's counts over the whole global batch (:meth:`MoE.update_bias`): the same
  on every rank. It is a parameter without gradient, so checkpoints and the oracle see it.
* **capacity** (``capacity_factor`` > 0; GShard §2.2): each expert takes at most
  ``C = ⌈k·T·cf/E⌉`` of the T tokens routed together, first choices before second ones,
  then by token order; a dropped choice adds nothing (the token goes on through the
  residual). T is the tokens of one microbatch on one data replica: exactly the token
  set a single device routes together when it runs that microbatch, so every layout drops
  the same tokens. 0: dropless.

Experts are stacked parameters ``experts.fc.weight`` [E, W, h] (W = f, or 2f for SwiGLU
with gate and up rows interleaved as in the dense MLP) and ``experts.fc2.weight`` [E, h, f];
under expert parallelism each ep rank holds E/ep of them (``parallel/experts.py`` moves the
tokens), and under 1-D tensor parallelism each expert is split over the tensor group like
the dense MLP (W's rows, f's columns; see :class:`MoE`).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .context import Context, make_param, shard_slice
from .parallel import tensor as tp
from .parallel.expert_overlap import overlapped_token_dispatch
from .parallel.experts import local_experts, token_dispatch

EXPERT_DATA_AXES = ("dp", "cp")  # an expert's copies: not over ep, which splits the experts


class AttachAux(torch.autograd.Function):
    """Identity on `x` forward; backward passes x's gradient through and gives the
    auxiliary loss `aux` the gradient `weight` (its weight in the step's objective), so an
    auxiliary loss reaches the backward from any pipeline stage without being sent on."""

    @staticmethod
    def forward(fctx, x, aux, weight: float):
        fctx.weight = weight
        fctx.save_for_backward(aux)
        return x.view_as(x)

    @staticmethod
    def backward(fctx, g):
        (aux,) = fctx.saved_tensors
        return g, torch.full_like(aux, fctx.weight), None


def top(x: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the k largest entries of each row, ties to the lower index (stable)."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]


def group_mask(choice: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """[T, E] bool: the experts inside each token's `topk_groups` best groups (DeepSeek-V3
    §2.1.2, node-limited routing; transformers' ``DeepseekV3TopkRouter``). The E experts
    lie in G equal groups of consecutive indices; a group's score is the sum of its two
    highest selection scores (the biased ones), the groups ranked with ties to the lower."""
    T, G = choice.shape[0], cfg.expert_groups
    grouped = choice.view(T, G, cfg.experts // G)
    score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [T, G]
    chosen = torch.zeros(T, G, dtype=torch.bool, device=choice.device)
    chosen.scatter_(1, top(score, cfg.topk_groups or G), True)
    return chosen.repeat_interleave(cfg.experts // G, dim=1)


def route(logits: torch.Tensor, cfg: ModelConfig, bias: torch.Tensor | None = None):
    """Top-k routing of T tokens' router logits [T, E]: returns (scores [T, E], the
    experts [T, k], the gates [T, k]). Ties go to the lower expert index (stable sort).
    With expert groups the choice is limited to each token's best groups
    (:func:`group_mask`); the gates are then scaled by ``routed_scaling``. A layer namespace
    may carry its own ``route`` of this contract (lab 11b, through ``Trainer(layers=...)``)."""
    scores = logits.softmax(-1) if cfg.router == "softmax" else logits.sigmoid()
    choice = (scores if bias is None else scores + bias).detach()
    if cfg.expert_groups > 1:
        choice = choice.masked_fill(~group_mask(choice, cfg), float("-inf"))
    experts = top(choice, cfg.top_k)
    gates = scores.gather(1, experts)
    if renormalised(cfg):
        gates = gates / gates.sum(-1, keepdim=True)
    return scores, experts, gates if cfg.routed_scaling == 1.0 else gates * cfg.routed_scaling


def renormalised(cfg: ModelConfig) -> bool:
    """Whether the chosen gates are divided by their sum: gate_norm "always", never with
    "never" (Qwen2-MoE's and OLMoE's norm_topk_prob false), else ("auto") when k > 1 or sigmoid."""
    if cfg.gate_norm in ("always", "never"):
        return cfg.gate_norm == "always"
    return cfg.top_k > 1 or cfg.router == "sigmoid"


def capacity(cfg: ModelConfig, tokens: int) -> int:
    """Tokens one expert takes from `tokens` routed together: ⌈k·T·cf/E⌉ (0: no limit)."""
    if not cfg.capacity_factor:
        return tokens * cfg.top_k
    return math.ceil(cfg.top_k * tokens * cfg.capacity_factor / cfg.experts)


def keep_mask(experts: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """[T, k] bool: which choices fit their expert's capacity. Priority: all first choices
    in token order, then all second choices, ... (GShard's order)."""
    T, k = experts.shape
    if not cfg.capacity_factor:
        return torch.ones_like(experts, dtype=torch.bool)
    onehot = F.one_hot(experts.t().reshape(-1), cfg.experts)  # [k·T, E], choice-major
    position = (onehot.cumsum(0) * onehot).sum(-1) - 1  # place of each choice in its expert's queue
    return (position < capacity(cfg, T)).view(k, T).t()


def balancing_loss(scores: torch.Tensor, experts: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """α·E·Σ_i f_i·P_i (Switch Eq. 4): f_i the fraction of the T·k choices that picked
    expert i (no gradient), P_i expert i's mean score (softmax; sigmoid scores normalized
    per token, as DeepSeek-V3's sequence-wise loss does)."""
    T = scores.shape[0]
    probs = scores if cfg.router == "softmax" else scores / scores.sum(-1, keepdim=True)
    f = torch.bincount(experts.flatten(), minlength=cfg.experts).to(scores.dtype) / (T * cfg.top_k)
    return cfg.aux_loss * cfg.experts * (f * probs.mean(0)).sum()


class MoE(nn.Module):
    """The mixture of experts of block `name` (``blocks.i.mlp``), in place of its MLP.

    Tensor parallelism (1-D): *expert-tensor parallelism* — every expert is split over the
    tensor group exactly as the dense MLP (fc column-, fc2 row-parallel) and the tokens
    enter and leave through the layout's f and g (with --sp, the sequence is gathered
    before the router and reduce-scattered after), so every tensor rank routes the same
    tokens the same way and dispatches them to its own slice of the experts, over the ep
    ranks of its tensor index. We chose it over placing whole experts on tensor ranks
    because the dense MLP's operators, sequence parallelism and the routing carry over
    unchanged and exactly; the price is that each tensor rank sends every token it routes
    (t copies of the dispatch). The gates multiply partial sums, so the router's gradient
    is a partial sum too: it is summed over the tensor group (``grad_sync``), and the
    balancing loss, computed alike on every tensor rank, enters each backward with 1/t.

    `dense_mlp`: the dense MLP class (``model.MLP``), for the shared experts: one MLP of
    width ``shared_ffn_hidden`` (shared_experts·f_moe, DeepSeek-MoE's shared experts, or a
    width of its own) on every token, its output scaled per token by sigmoid(x·w) with
    ``shared_gate`` (Qwen2-MoE's ``shared_expert_gate``, w [1, h]).
    """

    def __init__(self, name: str, cfg: ModelConfig, ctx: Context, layers, dense_mlp=None):
        super().__init__()
        self.cfg, self.ctx, self.layers, self.name = cfg, ctx, layers, name
        comm, E, h, f = ctx.comm, cfg.experts, cfg.hidden, cfg.moe_ffn_hidden
        t, t_rank = ctx.tp, ctx.tp_rank
        self.swiglu = cfg.activation == "swiglu"
        width = 2 * f if self.swiglu else f
        self.experts_here = local_experts(E, comm)
        tp_sync = dict(replicas=("tp",), grad_sync=("tp",)) if t > 1 else {}
        self.router = make_param(f"{name}.router.weight", (E, h), (), ctx, 0.02, **tp_sync)
        # DeepSeek-V3's selection bias: no gradient, moved by update_bias; the same everywhere
        self.score_bias = make_param(f"{name}.router.score_bias", (E,), (), ctx, kind="zeros",
                                     replicas=("tp",) if t > 1 else ())
        self.score_bias.requires_grad_(False)
        ex, w_rows, f_cols = self.experts_here, shard_slice(width, t, t_rank), shard_slice(f, t, t_rank)
        std2 = 0.02 / math.sqrt(2 * cfg.layers)
        expert = dict(data_axes=EXPERT_DATA_AXES)
        self.fc = make_param(f"{name}.experts.fc.weight", (E, width, h), (ex, w_rows), ctx, 0.02, **expert)
        self.fc2 = make_param(f"{name}.experts.fc2.weight", (E, h, f), (ex, slice(0, h), f_cols), ctx, std2,
                              **expert)
        self.fc_bias = self.fc2_bias = None
        if cfg.bias:  # fc2's bias is added once, on tensor rank 0, and summed over the group
            self.fc_bias = make_param(f"{name}.experts.fc.bias", (E, width), (ex, w_rows), ctx, kind="zeros",
                                      **expert)
            self.fc2_bias = make_param(f"{name}.experts.fc2.bias", (E, h), (ex,), ctx, kind="zeros",
                                       **expert, **tp_sync)
        self.shared = self.shared_gate = None
        if cfg.shared_experts and dense_mlp is not None:
            self.shared = dense_mlp(f"{name}.shared", cfg.replace(ffn=cfg.shared_ffn_hidden), ctx, layers)
        if self.shared is not None and cfg.shared_gate:  # Qwen2-MoE: copied on every tensor rank, as a norm
            self.shared_gate = make_param(f"{name}.shared_gate.weight", (1, h), (), ctx, 0.02, **tp.replicated(ctx))
        self.reset_stats()

    @property
    def layer(self) -> int:
        """The index of this MoE's block in the model."""
        return int(self.name.split(".")[1])

    # --- what a step saw (the run report's load balance, the bias update) --------------------
    def reset_stats(self) -> None:
        """Zero the step's routing counts (the Trainer calls it before each step)."""
        E = self.cfg.experts
        self.routed = torch.zeros(E, dtype=torch.float64)  # choices per expert, before capacity
        self.kept = torch.zeros(E, dtype=torch.float64)  # choices an expert took (after capacity)
        self.dispatches: list[tuple[list, list]] = []  # per forward: (E counts sent, rows sent to each ep rank)

    @torch.no_grad()
    def update_bias(self, routed: torch.Tensor) -> None:
        """DeepSeek-V3's step: b_i += γ·sign(mean load − load_i), from the global batch's
        choices per expert `routed` (the same tensor on every rank)."""
        gamma = self.cfg.bias_update
        if gamma:
            load = routed.to(self.score_bias.dtype)
            self.score_bias += gamma * torch.sign(load.mean() - load)

    # --- forward --------------------------------------------------------------------------
    def enter(self, x):
        """Into the tensor-parallel region with every token of the microbatch (--sp: gathered)."""
        if self.ctx.tp > 1 and self.ctx.layout.sp:
            return tp.gather(x, self.ctx.comm, "tp", tp.SEQ)
        return self.layers.enter(x, self.ctx)

    def experts_forward(self, rows: torch.Tensor, counts) -> torch.Tensor:
        """This rank's experts on their rows (grouped by expert, `counts` rows each), one
        expert at a time: each stacked weight is unbound once, so its backward stacks the
        experts' gradients once (indexing ``fc[j]`` per expert would build a zero gradient of
        the whole stack for each). On a CPU this beats padding every expert to the busiest
        one and two batched matmuls (0.13 s against 0.16 s per layer, llama-small, 8 experts).
        SwiGLU's interleaved [unit][gate|up] rows are regrouped once into [gate | up]
        halves, so that the activation reads contiguous memory."""
        w, b1 = self.fc, self.fc_bias
        if self.swiglu:
            w = w.unflatten(1, (-1, 2)).transpose(1, 2).flatten(1, 2)
            b1 = None if b1 is None else b1.unflatten(1, (-1, 2)).transpose(1, 2).flatten(1, 2)
        b1 = None if b1 is None else b1.unbind(0)
        b2 = self.fc2_bias.unbind(0) if self.fc2_bias is not None and self.ctx.tp_rank == 0 else None  # once over tp
        outs = list(rows.split(list(counts)))
        ws, w2s = w.unbind(0), self.fc2.unbind(0)
        for j, x in enumerate(outs):
            y = x @ ws[j].t()
            y = self._act(y if b1 is None else y + b1[j])
            y = y @ w2s[j].t()
            outs[j] = y if b2 is None else y + b2[j]
        return torch.cat(outs) if outs else rows[:0]

    def _act(self, y):
        """The MLP kind's nonlinearity: SwiGLU on [gate | up] halves (see experts_forward),
        or GELU (erf, or GPT-2's tanh approximation)."""
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(y, approximate="tanh" if self.cfg.activation == "gelu_tanh" else "none")

    def forward(self, x):
        cfg, ctx = self.cfg, self.ctx
        xt = self.enter(x)
        b, s, h = xt.shape
        tokens = xt.reshape(b * s, h)
        # the selection bias: zero unless moved (bias_update) or loaded (a DeepSeek-V3 checkpoint);
        # a layer namespace may bring its own routing of route's contract (a lab's, lab 11b)
        router = getattr(self.layers, "route", route)
        scores, experts, gates = router(tokens @ self.router.t(), cfg, self.score_bias)
        keep = keep_mask(experts, cfg)
        # permute, dispatch, the local experts, combine, un-permute (parallel/experts.py); a layer
        # namespace may bring its own of the same contract (a lab's, through Trainer(layers=...))
        # (--ep-overlap: the all-to-alls in two halves under the experts, parallel/expert_overlap.py)
        dispatch = getattr(self.layers, "token_dispatch",
                           overlapped_token_dispatch if ctx.layout.ep_overlap else token_dispatch)
        y = dispatch(tokens, experts, gates, keep, cfg.experts, ctx.comm, self.experts_forward)
        y = self.layers.leave(y.view(b, s, h), ctx)
        if self.training and torch.is_grad_enabled() and cfg.aux_loss:
            aux = balancing_loss(scores, experts, cfg)
            y = AttachAux.apply(y, aux, 1.0 / (ctx.microbatches * ctx.tp))
        if self.training and ctx.comm.phase == "fwd":  # a training forward (not a recompute's rerun)
            choice = experts.flatten()
            counts = torch.bincount(choice[keep.flatten()], minlength=cfg.experts)
            self.routed += torch.bincount(choice, minlength=cfg.experts).double().cpu()
            self.kept += counts.double().cpu()
            self.dispatches.append((counts.tolist(), counts.view(ctx.comm.size("ep"), -1).sum(1).tolist()))
        if self.shared_gate is not None:  # Qwen2-MoE: sigmoid(shared_expert_gate(x)) · shared_expert(x)
            y = y + torch.sigmoid(x @ self.shared_gate.t()) * self.shared(x)
        elif self.shared is not None:
            y = y + self.shared(x)
        return y


def moe_layers(chunks) -> list[MoE]:
    """The MoE blocks of model chunks, in layer order."""
    return sorted((m for c in chunks for m in c.modules() if isinstance(m, MoE)),
                  key=lambda m: int(m.name.split(".")[1]))
