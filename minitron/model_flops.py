"""The model's FLOPs: the one formula the engine, its reports and the analysis count.

Matmuls only, per training step of any block `config.ModelConfig` describes (GPT-2,
Llama's grouped-query attention and SwiGLU, a mixture of experts, DeepSeek-V3's latent
attention and multi-token prediction, sliding windows). It lives beside the model: it
reads the model's description and nothing of a layout. `analysis/flops.py` holds the
papers' closed forms (Korthikanti et al. 2022, PTD-P Eq. 3) and the tests check them
against this.
"""
from __future__ import annotations

import functools

from .config import ModelConfig


def model_flops_per_step(model: ModelConfig, global_batch: int, recompute: str = "none",
                         head_dim: int | None = None, causal: bool = False,
                         documents: list[list[int]] | None = None) -> float:
    """FLOPs of one training step of `global_batch` sequences of any block this config
    describes — the one model-FLOPs formula of the engine and the analysis. Matmuls only
    (biases and norms are not counted, as the papers do not).

    Per token and layer, forward: QKV ``2h(q + 2kv)`` and output ``2qh`` with q = heads·d
    and kv = kv_heads·d (d = `head_dim`, default h/heads: grouped-query attention shrinks
    K and V); the attention core ``4·s·q`` (halved when `causal` counts only the unmasked
    half); an MLP of width f ``4hf`` (GELU: two matrices) or ``6hf`` (SwiGLU: gate, up,
    down); a mixture of experts only its *active* experts, ``(top_k·f_e + f_s)·(4 or 6)·h``
    (f_s the shared experts' width, ``shared_ffn_hidden``), the router ``2hE`` and a shared
    expert's gate ``2h`` (Qwen2-MoE). The logit layer ``2hV``. Training is 3× the forward; 4× for the
    layers under full recomputation (`recompute`), selective adds the attention core once.

    For GPT-2 shapes (multi-head, GELU 4h, dense) and no recomputation this is the model
    FLOPs of Korthikanti et al. 2022, ``72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))``, and with
    full recomputation PTD-P Eq. 3 (96 for 72); the tests check both.

    Packed documents (``--pack``; `documents`: the document lengths of each of the global
    batch's rows, ``packing.Documents.lengths``): attention runs per document, as a varlen
    kernel does (flash attention's ``cu_seqlens``, the engine's one-device path), so a row's
    core is the sum of its documents' cores, ``Σ sᵢ·core(sᵢ)`` — ``Σ 2·q·sᵢ²`` causal,
    not ``2·q·s²`` (:func:`attention_core_flops` at each document's length).
    """
    B, s, h, V = global_batch, model.seq_len, model.hidden, model.vocab
    d = head_dim or model.head_dim
    q, kv = model.heads * d, model.n_kv_heads * d
    mats = 3 if model.activation == "swiglu" else 2
    attn = 2 * h * (q + 2 * kv) + 2 * q * h
    dense = 2 * mats * h * model.ffn_hidden
    moe = 2 * mats * h * (model.top_k * model.moe_ffn_hidden + model.shared_ffn_hidden) + 2 * h * model.experts \
        + (2 * h if model.shared_gate else 0)  # Qwen2-MoE's shared-expert gate, h -> 1
    if model.attention == "mla":
        attn, mla_core = mla_flops_per_token(model, causal)
        cores = [mla_core] * model.layers
    else:
        cores = [_core_per_token(model, i, q, causal, documents) for i in range(model.layers)]
    layers = sum(attn + cores[i] + (moe if model.is_moe_block(i) else dense) for i in range(model.layers))
    core = sum(cores) / model.layers
    layers += model.mtp_depths * (attn + core + dense + 2 * 2 * h * h + 2 * h * V)  # MTP: M_k, a block, the head
    passes = {"none": 3, "selective": 3, "full": 4}[recompute]
    extra = model.layers * core if recompute == "selective" else 0.0
    return B * s * (passes * layers + extra + 3 * 2 * h * V)


def _core_per_token(model: ModelConfig, i: int, q: int, causal: bool, documents) -> float:
    """Block `i`'s attention core per token of the step: a whole sequence's, or with packed
    `documents` each document's at its own length, averaged over the rows' tokens."""
    if documents is None:
        return attention_core_flops(model, i, q, causal)
    total = sum(n * attention_core_flops(model, i, q, causal, n) for row in documents for n in row)
    return total / sum(n for row in documents for n in row)


def attention_core_flops(model: ModelConfig, i: int, q: int, causal: bool = False, s: int | None = None) -> float:
    """Forward FLOPs per token of block `i`'s attention core, softmax(QKᵀ)V, with query
    width `q` = heads·d: ``4·s·q`` (QKᵀ and PV, 2·d each per query-key pair and head),
    halved when `causal` counts only the unmasked half. A sliding window W (``window_of``)
    runs only the block pairs in reach, in blocks of β (``window_block``: the largest
    divisor of s not above W): ``4·q·β²·P/s`` for the P block pairs — about 2·W, not s,
    keys per query, whatever `causal` says (the blocks are what runs). `s`: the sequence
    (or one packed document) attended over, default ``seq_len``."""
    s, w = s or model.seq_len, model.window_of(i)
    if not w:
        return 4 * s * q * (0.5 if causal else 1.0)
    return 4 * q * _window_block_pairs(s, w) / s


@functools.lru_cache(maxsize=None)
def _window_block_pairs(s: int, w: int) -> int:
    """β²·P of a window W over s tokens: β the largest divisor of s not above W, P the block
    pairs in reach (cached: the planner asks it of every layout, layer and document)."""
    beta = max(b for b in range(1, min(s, w) + 1) if s % b == 0)
    n, ahead = s // beta, -(-(w - 1) // beta)
    pairs = sum(min(a, ahead) + 1 for a in range(n))  # query block a meets key blocks a − ahead .. a
    return beta * beta * pairs


def keys_per_query(model: ModelConfig, i: int, causal: bool = False, s: int | None = None) -> float:
    """Keys each query of block `i` meets, averaged over the queries: its attention core
    (:func:`attention_core_flops`) over the 4 FLOPs a query-key pair costs per query
    width — s (``s/2`` when `causal` skips the masked half) for global attention, the
    block pairs in reach (about 2·W) under a window; `s` a whole sequence or one packed
    document. What the throughput model prices the attention products and the score
    matrix with."""
    return attention_core_flops(model, i, 1, causal, s) / 4


def packed_rows(seq_len: int, doc_len: int, rows: int = 1) -> list[list[int]]:
    """`rows` sequences of `seq_len` tokens packed with documents of `doc_len` tokens (the
    last one cut short): the ``documents`` of :func:`model_flops_per_step` when only the
    mean document length is known (the planner's ``--doc-len``)."""
    row = [doc_len] * (seq_len // doc_len) + ([seq_len % doc_len] if seq_len % doc_len else [])
    return [list(row) for _ in range(rows)]


def mla_flops_per_token(model: ModelConfig, causal: bool = False) -> tuple[float, float]:
    """Multi-head latent attention's forward FLOPs per token and layer (mla.py): the
    projections, 2·(h·(q_lora + kv_lora + rope) + q_lora·heads·(nope + rope) +
    kv_lora·heads·(nope + v) + heads·v·h) (queries projected directly without q_lora), and
    the core, 2·s·heads·(nope + rope) for the scores and 2·s·heads·v for the values
    (halved when `causal`)."""
    h, n, r, qr = model.hidden, model.heads, model.kv_lora_rank, model.q_lora_rank
    dn, dr, dv = model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim
    queries = h * qr + qr * n * (dn + dr) if qr else h * n * (dn + dr)
    proj = 2 * (queries + h * (r + dr) + r * n * (dn + dv) + n * dv * h)
    return proj, 2 * model.seq_len * n * (dn + dr + dv) * (0.5 if causal else 1.0)
