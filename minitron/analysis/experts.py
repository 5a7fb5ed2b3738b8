"""Mixtures of experts on paper: parameters (total and active), FLOPs per token, the
expert-parallel all-to-all's bytes and the memory an ep rank holds.

A MoE block (``minitron/moe.py``) replaces the dense MLP with a router (E·h), E experts of
the MLP's kind (each h·W + f·h, W = f or 2f for SwiGLU; biases W + h when the model has
them), an optional shared MLP of width shared_experts·f (or its own, ``shared_ffn``) with
Qwen2-MoE's optional gate (h), and DeepSeek-V3's selection bias (E elements, no gradient).
A token uses the router, k experts and the shared MLP: its *active* parameters.

The all-to-all (``parallel/experts.py``): per MoE layer and microbatch, each ep rank sends
the E counts (int64) once and its token rows four times: dispatch (S rows out, R in) and
combine (R out, S in) forward, and the same two with the split sizes swapped backward.
Counted as ``Comm.all_to_all`` traces a call (the input tensor: the rows kept by the rank
itself included), a rank's traced bytes are ``8·E + (S + R + R + S)·h·b``, with S the rows
it routes and R the rows its experts receive; under ``--ep-overlap`` the same rows travel
in two messages each (:func:`all_to_all_calls`), so the bytes are the same. Balanced routing in expectation: R = S =
T·k dropless (T the microbatch's tokens), and (ep−1)/ep of them leave the rank.
"""
from __future__ import annotations

import math

from ..config import INDEX_BYTES, ModelConfig, ParallelConfig
from .params import params_on_rank


# --- parameters ----------------------------------------------------------------------------
def mlp_params(cfg: ModelConfig, ffn: int) -> int:
    """One MLP of the model's kind and width `ffn`: h·W + ffn·h (+ W + h biases)."""
    h, width = cfg.hidden, (2 * ffn if cfg.activation == "swiglu" else ffn)
    return h * width + ffn * h + ((width + h) if cfg.bias else 0)


def moe_layer_params(cfg: ModelConfig) -> dict:
    """A MoE block's MLP part, by piece: router, experts (all E), shared MLP, selection bias."""
    f = cfg.moe_ffn_hidden
    return {"router": cfg.experts * cfg.hidden, "experts": cfg.experts * mlp_params(cfg, f),
            "shared": (mlp_params(cfg, cfg.shared_ffn_hidden) + (cfg.hidden if cfg.shared_gate else 0)
                       if cfg.shared_experts else 0),
            "score_bias": cfg.experts}


def moe_blocks(cfg: ModelConfig) -> list[int]:
    """The indices of the MoE blocks."""
    return [i for i in range(cfg.layers) if cfg.is_moe_block(i)]


def total_params(cfg: ModelConfig) -> int:
    """Every parameter element of the model (the selection bias included): the one-device
    count of ``analysis.params.params_on_rank`` (which reads the model's blocks, experts
    included)."""
    return params_on_rank(cfg, ParallelConfig())


def active_params(cfg: ModelConfig) -> int:
    """The parameters one token's forward uses: every dense one, and in each MoE block the
    router, k experts and the shared MLP (the selection bias excluded: it only picks)."""
    n, pieces = len(moe_blocks(cfg)), moe_layer_params(cfg)
    unused = (cfg.experts - cfg.top_k) * mlp_params(cfg, cfg.moe_ffn_hidden) + pieces["score_bias"]
    return total_params(cfg) - n * unused


def active_flops_per_token(cfg: ModelConfig, training: bool = True) -> float:
    """FLOPs per token (2 per multiply-add) of the active weights — Kaplan et al.'s 2·N with
    N the active parameters less the tables only looked up (the input embedding unless
    tied to the output layer, learned positions; norms and biases, a tiny part, are in N) —
    plus attention's scores and weighted values, 4·s·h per layer (the causal square
    counted whole, as Megatron does); training: ×3 (forward, and backward's two)."""
    lookups = (0 if cfg.tied_embeddings else cfg.vocab * cfg.hidden) + (
        cfg.seq_len * cfg.hidden if cfg.positions == "learned" else 0)
    fwd = 2 * (active_params(cfg) - lookups) + 4 * cfg.seq_len * cfg.hidden * cfg.layers
    return 3 * fwd if training else fwd


# --- the all-to-all ------------------------------------------------------------------------
def all_to_all_bytes(sent_rows: int, received_rows: int, cfg: ModelConfig, dtype_bytes: int) -> int:
    """A rank's traced all-to-all bytes for one MoE layer and microbatch, forward and
    backward: the E counts (int64) and the token rows of dispatch and combine, both ways."""
    return cfg.experts * INDEX_BYTES + 2 * (sent_rows + received_rows) * cfg.hidden * dtype_bytes


def all_to_all_calls(ep_overlap: bool = False) -> int:
    """A rank's all-to-all calls per MoE layer and microbatch: the counts once, dispatch
    and combine forward and backward (5); under ``--ep-overlap`` each of those four in two
    halves by local expert (9: the same bytes, ``parallel/expert_overlap.py``)."""
    return 1 + 4 * (2 if ep_overlap else 1)


def dispatch_rows(counts: list[list[int]], ep_rank: int) -> tuple[int, int]:
    """(rows sent, rows received) by ep rank `ep_rank`, from every ep rank's kept choices
    per expert ``counts[r][e]`` (experts in ep blocks: rank r holds E/ep consecutive ones)."""
    ep, E = len(counts), len(counts[0])
    mine = range(ep_rank * E // ep, (ep_rank + 1) * E // ep)
    return sum(counts[ep_rank]), sum(counts[r][e] for r in range(ep) for e in mine)


def step_all_to_all_bytes(counts_per_call: list[list[list[int]]], ep_rank: int, cfg: ModelConfig,
                          dtype_bytes: int) -> int:
    """A rank's all-to-all bytes over a step: one ``counts`` matrix (every ep rank's kept
    choices per expert) per MoE layer and microbatch it ran."""
    return sum(all_to_all_bytes(*dispatch_rows(c, ep_rank), cfg, dtype_bytes) for c in counts_per_call)


def balanced_all_to_all_bytes(cfg: ModelConfig, tokens: int, dtype_bytes: int) -> float:
    """The expected bytes per MoE layer and microbatch of a rank routing `tokens` tokens when
    routing is balanced: S = R = T·k (capped at E·C with a capacity factor)."""
    rows = tokens * cfg.top_k
    if cfg.capacity_factor:
        rows = min(rows, cfg.experts * math.ceil(cfg.top_k * tokens * cfg.capacity_factor / cfg.experts))
    return all_to_all_bytes(rows, rows, cfg, dtype_bytes)


def dispatch_fan_out(cfg: ModelConfig, ep: int) -> int:
    """The most ep ranks one token's rows are sent to: min(k, ep) without groups; with G
    groups of which a token may use `topk_groups` (DeepSeek-V3's node-limited routing),
    each group on one rank (G a multiple of ep) or on ep/G ranks, at most
    topk_groups·max(1, ep/G) ranks (DeepSeek-V3: 4 of the 8 nodes)."""
    if cfg.expert_groups <= 1:
        return min(cfg.top_k, ep)
    groups = cfg.topk_groups or cfg.expert_groups
    return min(cfg.top_k, ep, groups * max(1, ep // cfg.expert_groups))


def wire_fraction(ep: int) -> float:
    """The part of a balanced dispatch that leaves the rank: (ep−1)/ep."""
    return (ep - 1) / ep


# --- memory --------------------------------------------------------------------------------
def expert_params_on_rank(cfg: ModelConfig, ep: int = 1, tp: int = 1, moe_layers: int | None = None) -> int:
    """Expert elements an (ep, tp) rank holds: E/ep experts of each of its MoE blocks, each
    split over the tensor group (fc2's bias whole on every tensor rank)."""
    n = len(moe_blocks(cfg)) if moe_layers is None else moe_layers
    h, f = cfg.hidden, cfg.moe_ffn_hidden
    width = 2 * f if cfg.activation == "swiglu" else f
    one = (h * width + f * h) // tp + ((width // tp + h) if cfg.bias else 0)
    return n * (cfg.experts // ep) * one


def moe_memory_on_rank(cfg: ModelConfig, ep: int = 1, tp: int = 1, dtype_bytes: int = 4,
                       moe_layers: int | None = None) -> dict:
    """Bytes of the experts' model states on one rank (parameters, gradients, AdamW's two
    moments, all in the training dtype as the engine holds them), and what one device
    holding every expert would need: the saving of sharding the experts over ep."""
    here = expert_params_on_rank(cfg, ep, tp, moe_layers)
    whole = expert_params_on_rank(cfg, 1, tp, moe_layers)
    return {"expert_params": here, "bytes": 4 * here * dtype_bytes, "bytes_without_ep": 4 * whole * dtype_bytes}
