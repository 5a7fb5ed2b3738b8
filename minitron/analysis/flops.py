"""Floating-point operations of GPT training, and what they mean in days.

A matrix multiply of [m, k] by [k, n] costs 2·m·n·k FLOPs (a multiply and an add per
term). One transformer layer's forward pass on b sequences of s tokens (PTD-P §5.1)::

    QKV 6bsh² + scores QKᵀ 2bs²h + attention·V 2bs²h + projection 2bsh² + MLP 16bsh²
    = 24·b·s·h² + 4·b·s²·h

The backward pass costs twice the forward (a gradient for the input and one for the
weight), and full activation recomputation runs the forward once more: 4× forward in
all, 3× without recomputation. Adding the logit layer (2·b·s·h·V forward, 3× with its
backward, never recomputed) gives PTD-P Eq. 3::

    F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))          (with recomputation)
    F = 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))          (without: "model FLOPs")

and, since F ≈ 8·(tokens)·P with P ≈ 12·l·h², the training time of T tokens on n GPUs
that each sustain X FLOP/s (PTD-P §5.1)::

    time ≈ 8·T·P / (n·X)
"""
from __future__ import annotations

from ..config import ModelConfig
from ..model_flops import model_flops_per_step

__all__ = [
    "recompute_policy",
    "layer_forward_flops",
    "logit_forward_flops",
    "flops_per_iteration",
    "model_flops_per_iteration",
    "hardware_flops_per_iteration",
    "training_time_s",
    "transformer_flops_per_iteration",
]

SECONDS_PER_DAY = 86_400


def layer_forward_flops(b: int, s: int, h: int, ffn: int | None = None) -> float:
    """Forward FLOPs of one transformer layer: ``24·b·s·h² + 4·b·s²·h`` (PTD-P §5.1).

    With an MLP of width `ffn` other than 4h the matrix part is ``8bsh² + 4bsh·ffn``.
    """
    f = 4 * h if ffn is None else ffn
    return 8 * b * s * h * h + 4 * b * s * h * f + 4 * b * s * s * h


def logit_forward_flops(b: int, s: int, h: int, vocab: int) -> float:
    """Forward FLOPs of the output layer: ``2·b·s·h·V``."""
    return 2 * b * s * h * vocab


def flops_per_iteration(model: ModelConfig, global_batch: int, recompute: bool = True) -> float:
    """FLOPs of one training iteration of `global_batch` sequences.

    ``recompute=True``: PTD-P Eq. 3, ``96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))``.
    ``recompute=False``: model FLOPs, ``72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))``.
    Both assume a 4h MLP and use the unpadded vocabulary, as the paper does.
    """
    B, s, l, h, V = global_batch, model.seq_len, model.layers, model.hidden, model.vocab
    if recompute:
        return 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    return model_flops_per_step(model, global_batch)


def model_flops_per_iteration(model: ModelConfig, global_batch: int) -> float:
    """Model FLOPs (no recomputation counted): Eq. 3 with 72 and ``V/(12·l·h)``."""
    return flops_per_iteration(model, global_batch, recompute=False)


def hardware_flops_per_iteration(model: ModelConfig, global_batch: int, recompute: str = "full") -> float:
    """FLOPs a GPU really executes, for any MLP width and recomputation policy.

    ``none``: 3 × (layers + logits) forward; ``full``: layers 4× forward, logits 3×;
    ``selective`` (Korthikanti et al. 2022): 3× plus one more forward of the attention
    core (QKᵀ and attention·V, ``4·b·s²·h`` per layer).
    """
    B, s, l, h = global_batch, model.seq_len, model.layers, model.hidden
    layer = layer_forward_flops(B, s, h, model.ffn_hidden)
    logits = logit_forward_flops(B, s, h, model.vocab)
    passes = {"none": 3, "selective": 3, "full": 4}[recompute_policy(recompute)]
    extra = l * 4 * B * s * s * h if recompute_policy(recompute) == "selective" else 0
    return passes * l * layer + 3 * logits + extra


def training_time_s(tokens: float, params: float, n_gpus: int, flops_per_gpu: float) -> float:
    """Training time in seconds, ``8·T·P / (n·X)`` (PTD-P §5.1).

    `tokens` T, `params` P, `n_gpus` n, and `flops_per_gpu` X, the FLOP/s each GPU
    sustains (e.g. 140e12). The 8 is 2 (multiply-add) × 4 (forward, recomputed
    forward and a backward of twice the cost).
    """
    return 8 * tokens * params / (n_gpus * flops_per_gpu)


def recompute_policy(recompute) -> str:
    """Normalise a recomputation argument: True -> 'full', False/None -> 'none'."""
    if recompute is True:
        return "full"
    if recompute is False or recompute is None:
        return "none"
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"unknown recompute policy '{recompute}': use none, selective or full")
    return recompute


def transformer_flops_per_iteration(model: ModelConfig, global_batch: int, recompute: str | bool = "none",
                                    head_dim: int | None = None, causal: bool = False,
                                    documents: list[list[int]] | None = None) -> float:
    """FLOPs of one training iteration of any block :class:`ModelConfig` describes
    (grouped-query attention, SwiGLU or GELU MLPs, the active experts of a mixture), with
    `recompute` as a policy name or a bool: the engine's one formula,
    :func:`minitron.model_flops.model_flops_per_step`, whose docstring derives it. For GPT-2
    shapes it is PTD-P Eq. 3 (``recompute="full"``) and Korthikanti's model FLOPs
    (``"none"``); tests/test_throughput_model.py checks both. `documents`: packed rows'
    document lengths, each attended on its own.
    """
    return model_flops_per_step(model, global_batch, recompute_policy(recompute), head_dim, causal, documents)
