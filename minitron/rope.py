"""Rotary positions' frequencies, and their scaling for contexts longer than pre-training's.

Rotary embeddings (Su et al. 2021) turn the pair i of a head's d dimensions by p·θ_i,
θ_i = base^(−2i/d). A model pre-trained on a context of L tokens has seen only the angles
of positions below L; two ways of stretching it, both as transformers computes them
(``modeling_rope_utils.ROPE_INIT_FUNCTIONS``, which the tests compare against):

* ``llama3`` (Llama 3.1, Grattafiori et al. 2024): wavelengths 2π/θ_i longer than
  L/low_freq_factor are divided by `factor`, shorter than L/high_freq_factor kept, and
  those between interpolated smoothly; the attention is not rescaled.
* ``yarn`` (Peng et al. 2023, "YaRN"): the dimensions that turn fewer than beta_slow times
  over L are interpolated (θ/factor), those turning more than beta_fast times kept, a
  linear ramp between; cos and sin are multiplied by the attention factor
  ``0.1·ln(factor) + 1``.
"""
from __future__ import annotations

import math

import torch

from .config import ModelConfig


def default_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    """θ_i = base^(−2i/d), i < d/2, in float32 (as ``LlamaRotaryEmbedding``)."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def llama3_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Llama 3.1's scaled frequencies (transformers' ``_compute_llama3_parameters``)."""
    inv_freq = default_inv_freq(cfg.head_dim, cfg.rope_base)
    old, factor = cfg.rope_original_context, cfg.rope_factor
    low_wavelen, high_wavelen = old / cfg.rope_low_freq, old / cfg.rope_high_freq
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - cfg.rope_low_freq) / (cfg.rope_high_freq - cfg.rope_low_freq)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_dim(rotations: float, dim: int, base: float, context: int) -> float:
    """The dimension whose pair turns `rotations` times over `context` positions."""
    return (dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """YaRN's frequencies and attention factor (transformers' ``_compute_yarn_parameters``
    without mscale, truncating the correction range as its default does)."""
    dim, base, factor = cfg.head_dim, cfg.rope_base, cfg.rope_factor
    low = max(math.floor(_yarn_dim(cfg.rope_beta_fast, dim, base, cfg.rope_original_context)), 0)
    high = min(math.ceil(_yarn_dim(cfg.rope_beta_slow, dim, base, cfg.rope_original_context)), dim - 1)
    high = high + 0.001 if low == high else high  # as transformers: no singular ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp  # 1: keep θ_i; 0: interpolate θ_i / factor
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)


def rope_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(θ [d/2] in float32, the factor cos and sin are multiplied by) of the model's rotary
    positions: unscaled, or scaled by ``rope_scaling``."""
    if cfg.rope_scaling == "llama3":
        return llama3_inv_freq(cfg), 1.0
    if cfg.rope_scaling == "yarn":
        return yarn_inv_freq(cfg)
    return default_inv_freq(cfg.head_dim, cfg.rope_base), 1.0
