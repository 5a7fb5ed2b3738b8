"""What inference keeps per token: every layer's keys and values (the KV cache).

Standard attention caches each layer's keys and values of its kv heads, 2·kv_heads·d elements
per token (multi-head attention: kv_heads = heads; grouped-query attention, Ainslie et al. 2023:
fewer). Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434 §2.1.1-2.1.3; ``mla.py``)
caches the latent c_KV and the decoupled rotary key k_R, which every head shares: kv_lora + rope
elements per token and layer, from which each head's key and value are decompressed (or, at
inference, the up-projections absorbed into the query and output projections). The MTP depths
(``mtp.py``) do not run at inference and cache nothing.
"""
from __future__ import annotations

from ..config import ModelConfig


def kv_elements_per_token(model: ModelConfig) -> int:
    """Elements one token adds to one layer's cache: 2·kv_heads·d, or kv_lora + rope for MLA."""
    if model.attention == "mla":
        return model.kv_lora_rank + model.qk_rope_head_dim
    return 2 * model.n_kv_heads * model.head_dim


def decompressed_kv_elements_per_token(model: ModelConfig, kv_heads: int | None = None) -> int:
    """An MLA model's keys and values cached as standard attention would cache them, for
    `kv_heads` heads (all of them by default: multi-head; fewer: grouped-query): each head's
    key [k_nope, k_R] (nope + rope) and value (v) per token and layer."""
    n = model.heads if kv_heads is None else kv_heads
    return n * (model.qk_nope_head_dim + model.qk_rope_head_dim + model.v_head_dim)


def kv_cache_bytes_per_token(model: ModelConfig, dtype_bytes: int = 2, elements: int | None = None) -> int:
    """Bytes one token adds to the whole cache (every layer) at `dtype_bytes` per element;
    `elements` per token and layer (default :func:`kv_elements_per_token`)."""
    per_layer = kv_elements_per_token(model) if elements is None else elements
    return model.layers * per_layer * dtype_bytes
