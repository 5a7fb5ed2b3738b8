"""Hugging Face checkpoints in and out, by family: GPT-2, Llama and the Llama-shaped
Qwen2, Qwen3 and Mistral (``hf_families.py``: a table of what each adds to Llama, and the
``llama3`` / ``yarn`` rope scaling of any of them), the Llama-shaped mixtures Mixtral,
Qwen2-MoE and OLMoE (``hf_moe.py``: a table of what each MoE block holds), DeepSeek-V3
(``hf_deepseek.py``: multi-head latent attention, group-limited sigmoid routing, shared
experts, its names, shapes and config.json; no MTP modules, as transformers has none).

A directory with `config.json` and `model.safetensors` is all either side needs; its
``model_type`` picks the family. Each family is a name map (minitron's layout-independent
name, theirs, how it is stored), its config.json in both directions and its checks.

**GPT-2.** minitron's default block is GPT-2's architecture, so its weights map one to one
onto `transformers.GPT2LMHeadModel`'s. Three differences of storage, none of the model:

* GPT-2's linears are `Conv1D` modules whose weight is stored [in, out], the transpose
  of `nn.Linear`'s [out, in] that minitron keeps;
* GPT-2's `c_attn` lays its 3h outputs out as [q | k | v], each h wide and split into
  heads inside; minitron's QKV rows are head-major, [head][q|k|v][head_dim], so that a
  tensor-parallel rank's contiguous slice holds whole heads;
* the names (`transformer.h.3.mlp.c_fc` is minitron's `blocks.3.mlp.fc`).

**Llama** (`transformers.LlamaForCausalLM`; the model flags of ``config.LLAMA``): RMSNorm,
SwiGLU, rotary positions, grouped-query attention, no biases. Storage differences:

* q_proj, k_proj, v_proj become minitron's ``attn.q`` (the same rows) and ``attn.kv``,
  [kv head][k|v][head_dim], or with kv_heads == heads the head-major ``attn.qkv``;
* gate_proj and up_proj become one ``mlp.fc`` with interleaved rows [unit][gate|up];
* q and k rows are taken as they are: Hugging Face stores them for the rotate-half
  rotary convention (dimensions i and i + d/2 paired), which is minitron's
  (``model.rotate``), so no permutation (Meta's original files pair neighbours and are
  permuted by transformers' conversion script; tests/test_hf_llama.py checks logits).

**Qwen2, Qwen3, Mistral** (``hf_families.FAMILIES``) are read and written by the Llama
mapping with one knob each: Qwen2's q/k/v_proj biases join as their weights' rows do
(``attn.q.bias``, ``attn.kv.bias`` [kv head][k|v][d]); Qwen3's ``self_attn.q_norm`` /
``k_norm`` are ``attn.q_norm`` / ``k_norm`` and its ``head_dim`` (any family's) the
engine's ``head_width``; Mistral's ``sliding_window`` is ``window`` (W keys, the query's
own included, in both). An export picks the family whose knob the model has
(tests/test_hf_families.py).

**Mixtral, Qwen2-MoE, OLMoE** (``hf_moe.MOE_FAMILIES``) are the Llama mapping with each
MoE block's rows from the family's table: the router, the experts stacked, Qwen2-MoE's
gated shared expert; OLMoE's ``q_norm`` / ``k_norm`` over the whole projection are
``attn.q_norm`` / ``k_norm`` of heads·d and kv·d (``qk_norm_span`` "all")
(tests/test_hf_moe_families.py).

Loading returns full tensors under minitron's layout-independent names, the form a
checkpoint is assembled into (`checkpoint.assemble`), so `checkpoint.import_state` slices
them for any layout — tensor, pipeline, cube — exactly as it does a minitron checkpoint.
Nothing is downloaded: the directory must be on disk.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from . import hf_deepseek, hf_families, hf_moe
from .config import LLAMA, ConfigError, ModelConfig, validate_model

CONFIG, WEIGHTS = "config.json", "model.safetensors"
INDEX = "model.safetensors.index.json"  # a sharded save_pretrained: {"weight_map": {tensor: shard file}}
# GPT-2's activation names -> minitron's (the exact erf GeLU, or its tanh approximation)
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
# The config.json fields minitron reads beyond the sizes, and the JSON type each must have
# (null is read as absent): a wrong type is named, never Python's own exception text.
FIELD_TYPES = {"tie_word_embeddings": bool, "attention_bias": bool, "mlp_bias": bool, "scale_attn_weights": bool,
               "scale_attn_by_inverse_layer_idx": bool, "add_cross_attention": bool, "reorder_and_upcast_attn": bool,
               "rms_norm_eps": float, "layer_norm_epsilon": float, "rope_theta": float, "router_aux_loss_coef": float,
               "router_jitter_noise": float, "hidden_act": str, "activation_function": str, "rope_parameters": dict,
               "rope_scaling": dict, "num_local_experts": int, "num_experts_per_tok": int, "sliding_window": int,
               "pretraining_tp": int, "use_sliding_window": bool,
               # the MoE families' (hf_moe.MOE_FAMILIES)
               "num_experts": int, "norm_topk_prob": bool, "qkv_bias": bool, "moe_intermediate_size": int,
               "shared_expert_intermediate_size": int, "decoder_sparse_step": int, "mlp_only_layers": list,
               "clip_qkv": float,
               # rope scaling's options (hf_families.ROPE_KINDS), in rope_parameters or rope_scaling
               "rope_type": str, "type": str, "factor": float, "original_max_position_embeddings": int,
               "low_freq_factor": float, "high_freq_factor": float, "beta_fast": float, "beta_slow": float,
               "attention_factor": float}
ROPE_OPTIONS = ("rope_type", "type", "factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                "attention_factor")  # typed inside the rope objects only (a top-level "type" is another's)
POSITIVE = ("rms_norm_eps", "layer_norm_epsilon", "rope_theta")  # an epsilon or a rotary base of 0 or less
# Buffers some writers save beside the weights that minitron computes itself: GPT-2's causal
# mask (attn.bias, attn.masked_bias) and Llama's rotary frequencies (from rope_theta).
DERIVED = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


LLAMA_TYPES = tuple(hf_families.FAMILIES)  # model_types of the Llama-shaped families' config.json
# the sizes a DeepSeek-V3 config.json must give, each a positive integer
DEEPSEEK_SIZES = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size",
                  "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                  "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts")


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise ConfigError("Hugging Face checkpoints need the safetensors package: "
                          "pip install safetensors (or pip install -e .[test])") from None
    return safetensors.torch


def is_llama(cfg: ModelConfig) -> bool:
    """Whether `cfg` is of the Llama family (rotary positions; GPT-2 has learned ones)."""
    return cfg.positions == "rope"


def family_problem(cfg: ModelConfig) -> str:
    """'' when `cfg` is a GPT-2, a Llama-shaped family's or a DeepSeek-V3 model that Hugging Face
    can hold, else the reason."""
    if hf_deepseek.is_deepseek(cfg):  # not a Llama's or Mixtral's blocks: DeepseekV3ForCausalLM's
        return hf_deepseek.problem(cfg)
    if is_llama(cfg):
        want = {"norm": "rmsnorm", "activation": "swiglu", "bias": False}
        bad = [f"{k} {getattr(cfg, k)}" for k, v in want.items() if getattr(cfg, k) != v]
        if bad:
            return f"a Llama (rotary positions) needs RMSNorm, SwiGLU and no biases, not {', '.join(bad)}"
        if cfg.experts:
            return hf_moe.moe_problem(cfg)  # Mixtral, Qwen2-MoE or OLMoE: a Llama with experts
        return hf_families.family_problem(cfg)  # Llama, Qwen2, Qwen3 or Mistral
    if cfg.experts:
        return "experts are written in Mixtral's format, a Llama's (rotary positions, RMSNorm, SwiGLU, no biases)"
    want = {"norm": "layernorm", "bias": True, "kv_heads": cfg.heads if cfg.kv_heads else 0}
    bad = [f"{k} {getattr(cfg, k)}" for k, v in want.items() if getattr(cfg, k) != v]
    bad += ["activation swiglu"] if cfg.activation == "swiglu" else []
    return f"a GPT-2 (learned positions) needs LayerNorm, a GELU MLP, biases and every head, not {', '.join(bad)}" if bad else ""


def export_problem(cfg: ModelConfig) -> str:
    """'' when the family's config.json holds all of `cfg`, else what it cannot express:
    :func:`family_problem`'s reasons, then, generic over every field of ModelConfig, any
    field that would come back otherwise when the written config.json is read again (a
    field added to the engine is refused until a family writes it; those of INIT_APPLIES
    act in training only and need not come back)."""
    from .checkpoint import model_changes, model_record

    problem = family_problem(cfg)
    if problem:
        return problem
    c = hf_config(cfg, torch.float32)
    back = config_model(check_config(c, Path(cfg.name) / CONFIG), cfg.name, cfg.seq_len, cfg.dropout)
    lost = [ch for ch in model_changes(model_record(back), cfg) if ch[0] not in INIT_APPLIES]
    if lost:
        return (f"{c['architectures'][0]}'s config.json cannot express "
                + ", ".join(f"{k} {now} (it would load as {was})" for k, was, now in lost))
    return ""


# --- names and layouts ----------------------------------------------------------------
def name_map(cfg: ModelConfig) -> list[tuple[str, str, str]]:
    """(minitron name, Hugging Face name, kind) for every tensor of `cfg`'s family."""
    return llama_name_map(cfg) if is_llama(cfg) else gpt2_name_map(cfg)


def gpt2_name_map(cfg: ModelConfig) -> list[tuple[str, str, str]]:
    """(minitron name, GPT-2 name, kind) for every tensor; kind says how it is stored:
    'copy' as is, 'linear' transposed (Conv1D), 'qkv_weight'/'qkv_bias' reordered."""
    rows = [("wte.weight", "transformer.wte.weight", "copy"),
            ("wpe.weight", "transformer.wpe.weight", "copy")]
    for i in range(cfg.layers):
        b, h = f"blocks.{i}", f"transformer.h.{i}"
        rows += [(f"{b}.ln1.weight", f"{h}.ln_1.weight", "copy"), (f"{b}.ln1.bias", f"{h}.ln_1.bias", "copy"),
                 (f"{b}.attn.qkv.weight", f"{h}.attn.c_attn.weight", "qkv_weight"),
                 (f"{b}.attn.qkv.bias", f"{h}.attn.c_attn.bias", "qkv_bias"),
                 (f"{b}.attn.proj.weight", f"{h}.attn.c_proj.weight", "linear"),
                 (f"{b}.attn.proj.bias", f"{h}.attn.c_proj.bias", "copy"),
                 (f"{b}.ln2.weight", f"{h}.ln_2.weight", "copy"), (f"{b}.ln2.bias", f"{h}.ln_2.bias", "copy"),
                 (f"{b}.mlp.fc.weight", f"{h}.mlp.c_fc.weight", "linear"),
                 (f"{b}.mlp.fc.bias", f"{h}.mlp.c_fc.bias", "copy"),
                 (f"{b}.mlp.fc2.weight", f"{h}.mlp.c_proj.weight", "linear"),
                 (f"{b}.mlp.fc2.bias", f"{h}.mlp.c_proj.bias", "copy")]
    rows += [("ln_f.weight", "transformer.ln_f.weight", "copy"), ("ln_f.bias", "transformer.ln_f.bias", "copy")]
    if not cfg.tied_embeddings:
        rows.append(("lm_head.weight", "lm_head.weight", "copy"))
    return rows


def _qkv_rows(t: torch.Tensor, heads: int, to_hf: bool) -> torch.Tensor:
    """Reorder the 3h rows of a QKV weight or bias: head-major [head][q|k|v][d] (minitron)
    <-> [q|k|v][head][d] (GPT-2)."""
    rest = t.shape[1:]
    if to_hf:
        return t.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(-1, *rest)
    return t.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(-1, *rest)


def llama_name_map(cfg: ModelConfig) -> list[tuple[str, str, str]]:
    """(minitron name, Llama name, kind) for every tensor. A kind 'join:...' is one minitron
    tensor made of several of theirs (its Llama name lists them, comma-separated):
    'kv' (k_proj, v_proj -> [kv head][k|v][d]), 'qkv' (q, k, v -> [head][q|k|v][d]),
    'swiglu' (gate_proj, up_proj -> [unit][gate|up]); 'copy' as is (nn.Linear is [out, in])."""
    rows = [("wte.weight", "model.embed_tokens.weight", "copy")]
    for i in range(cfg.layers):
        b, h = f"blocks.{i}", f"model.layers.{i}"
        a = f"{h}.self_attn"
        attn = []
        for p in ("weight", "bias") if cfg.qkv_bias else ("weight",):  # Qwen2's biases: laid out as the rows
            if cfg.n_kv_heads < cfg.heads:
                attn += [(f"{b}.attn.q.{p}", f"{a}.q_proj.{p}", "copy"),
                         (f"{b}.attn.kv.{p}", f"{a}.k_proj.{p},{a}.v_proj.{p}", "join:kv")]
            else:
                attn += [(f"{b}.attn.qkv.{p}", f"{a}.q_proj.{p},{a}.k_proj.{p},{a}.v_proj.{p}", "join:qkv")]
        if cfg.qk_norm:  # Qwen3's per-head norms of q and k, OLMoE's over the whole projection
            attn += [(f"{b}.attn.{n}.weight", f"{a}.{n}.weight", "copy") for n in ("q_norm", "k_norm")]
        mlp = hf_moe.block_rows(cfg, i) if cfg.is_moe_block(i) else [
            (f"{b}.mlp.fc.weight", f"{h}.mlp.gate_proj.weight,{h}.mlp.up_proj.weight", "join:swiglu"),
            (f"{b}.mlp.fc2.weight", f"{h}.mlp.down_proj.weight", "copy")]
        rows += [(f"{b}.ln1.weight", f"{h}.input_layernorm.weight", "copy"), *attn,
                 (f"{b}.attn.proj.weight", f"{a}.o_proj.weight", "copy"),
                 (f"{b}.ln2.weight", f"{h}.post_attention_layernorm.weight", "copy"), *mlp]
    rows.append(("ln_f.weight", "model.norm.weight", "copy"))
    if not cfg.tied_embeddings:
        rows.append(("lm_head.weight", "lm_head.weight", "copy"))
    return rows


def _join(parts: list[torch.Tensor], heads: int) -> torch.Tensor:
    """Their tensors [n·d, h] each -> one with rows interleaved by `heads` blocks:
    [block][part 0 | part 1 | ...][d] (for SwiGLU, heads = f units of one row each)."""
    return torch.stack([p.reshape(heads, -1, *p.shape[1:]) for p in parts], dim=1).reshape(-1, *parts[0].shape[1:])


def _split(t: torch.Tensor, n: int, heads: int) -> list[torch.Tensor]:
    """The inverse of :func:`_join`: n tensors of [heads·d, h]."""
    blocks = t.reshape(heads, n, -1, *t.shape[1:])
    return [blocks[:, j].reshape(-1, *t.shape[1:]) for j in range(n)]


def _join_heads(kind: str, cfg: ModelConfig) -> int:
    return {"join:kv": cfg.n_kv_heads, "join:qkv": cfg.heads, "join:swiglu": cfg.ffn_hidden}[kind]


def to_hf(full: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """minitron's full tensors {name: tensor} -> the family's Hugging Face state dict."""
    if hf_deepseek.is_deepseek(cfg):
        return hf_deepseek.to_hf(full, cfg)
    if is_llama(cfg):
        out = {}
        for mine, theirs, kind in llama_name_map(cfg):
            names = [n for n in theirs.split(",") if n]
            parts = (_split(full[mine], len(names), _join_heads(kind, cfg)) if kind.startswith("join")
                     else hf_moe.to_hf(full[mine], kind, cfg))
            out.update({n: p.contiguous().clone() for n, p in zip(names, parts)})
        return out
    out = {}
    for mine, theirs, kind in name_map(cfg):
        t = full[mine]
        if kind == "qkv_weight":
            t = _qkv_rows(t, cfg.heads, to_hf=True).t()
        elif kind == "qkv_bias":
            t = _qkv_rows(t, cfg.heads, to_hf=True)
        elif kind == "linear":
            t = t.t()
        out[theirs] = t.contiguous().clone()
    return out


def from_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The family's Hugging Face state dict -> minitron's full tensors (GPT-2's positions
    cut to cfg.seq_len)."""
    if hf_deepseek.is_deepseek(cfg):
        return hf_deepseek.from_hf(state, cfg)
    if is_llama(cfg):
        out = {}
        for mine, theirs, kind in llama_name_map(cfg):
            parts = [state[n] for n in theirs.split(",") if n]
            out[mine] = (_join(parts, _join_heads(kind, cfg)) if kind.startswith("join")
                         else hf_moe.from_hf(parts, kind, cfg)).contiguous()
        return out
    out = {}
    for mine, theirs, kind in name_map(cfg):
        t = state[theirs]
        if kind == "qkv_weight":
            t = _qkv_rows(t.t(), cfg.heads, to_hf=False)
        elif kind == "qkv_bias":
            t = _qkv_rows(t, cfg.heads, to_hf=False)
        elif kind == "linear":
            t = t.t()
        elif mine == "wpe.weight":
            t = t[: cfg.seq_len]  # a shorter context than GPT-2's n_positions uses the first rows
        out[mine] = t.contiguous()
    return out


# --- config ----------------------------------------------------------------------------
def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """The family's `config.json` for minitron model `cfg`."""
    if hf_deepseek.is_deepseek(cfg):
        return hf_deepseek.config_fields(cfg, dtype)
    if is_llama(cfg):
        return llama_config(cfg, dtype)
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": cfg.vocab, "n_positions": cfg.seq_len, "n_embd": cfg.hidden,
            "n_layer": cfg.layers, "n_head": cfg.heads, "n_inner": cfg.ffn_hidden,
            "activation_function": {"gelu": "gelu", "gelu_tanh": "gelu_new"}[cfg.activation],
            "layer_norm_epsilon": cfg.norm_eps, "tie_word_embeddings": cfg.tied_embeddings,
            "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "initializer_range": 0.02,
            "bos_token_id": None, "eos_token_id": None, "dtype": str(dtype).removeprefix("torch.")}


def llama_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """A Llama-shaped `config.json` (``LlamaForCausalLM``, or the Qwen2, Qwen3, Mistral class
    that holds `cfg`'s knob: ``hf_families``; with experts the MoE family's: ``hf_moe``) for
    minitron model `cfg`; the rotary base both
    as transformers 5 writes it (``rope_parameters``, with its scaling) and as 4.x reads it."""
    family = hf_families.config_fields(cfg) if hf_families.family_of(cfg) else {}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": cfg.vocab, "hidden_size": cfg.hidden, "intermediate_size": cfg.ffn_hidden,
            "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
            "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.seq_len, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_base, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
            "attention_bias": False, "mlp_bias": False, "attention_dropout": cfg.dropout,
            "tie_word_embeddings": cfg.tied_embeddings, "initializer_range": 0.02,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
            "dtype": str(dtype).removeprefix("torch."), **family,
            **(hf_moe.config_fields(cfg) if cfg.experts else {})}


def _check_types(c: dict, where) -> None:
    """Every field of FIELD_TYPES that is set has its JSON type, and those of POSITIVE are
    positive finite numbers; else one line naming the field and its value."""
    words = {bool: "true or false", float: "a number", str: "a string", dict: "an object", int: "an integer",
             list: "a list"}
    fields = dict(c)
    for r in ("rope_parameters", "rope_scaling"):
        if isinstance(c.get(r), dict):
            fields.update({f"{r}.{k}": v for k, v in c[r].items()})
    for k, v in fields.items():
        kind = FIELD_TYPES.get(k.split(".")[-1]) if "." in k or k not in ROPE_OPTIONS else None
        if kind is None or v is None:
            continue
        ok = isinstance(v, kind) if kind in (bool, str, dict, list) else not isinstance(v, bool) and (
            isinstance(v, int) if kind is int else isinstance(v, (int, float)) and math.isfinite(v))
        if not ok:
            raise ConfigError(f"{where} has {k} = {json.dumps(v)[:40]}: it must be {words[kind]}; save the model again")
        if k.split(".")[-1] in POSITIVE and v <= 0:
            raise ConfigError(f"{where} has {k} = {v}: it must be positive; save the model again")


def _positive_ints(c: dict, required, optional, where) -> None:
    """Each of `required` (and each of `optional` that is set) a positive integer, or one line
    naming the field (a malformed config.json must not surface as Python's own error)."""
    for k in (*required, *optional):
        v = c.get(k)
        if v is None and k in optional:
            continue
        if k not in c:
            raise ConfigError(f"{where} has no '{k}': it is not a complete config; save the model with "
                              f"save_pretrained or `minitron export --hf`")
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(f"{where} has {k} = {v!r}: it must be a positive integer; save the model again")


def _check_llama(c: dict, where) -> None:
    """A Llama config.json minitron computes exactly, or one line saying what it lacks."""
    for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size"):
        if k not in c:
            raise ConfigError(f"{where} has no '{k}': it is not a complete Llama config; save the model with "
                              f"save_pretrained or `minitron export --hf`")
    _positive_ints(c, ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size"),
                   ("num_key_value_heads", "max_position_embeddings", "head_dim"), where)
    hf_families.model_fields(c, where)  # the family's own refusals, the rope scaling's kind and options
    if c.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where} uses hidden_act '{c.get('hidden_act')}': minitron's SwiGLU is silu only")
    if c.get("attention_bias") or c.get("mlp_bias"):
        raise ConfigError(f"{where} has attention_bias or mlp_bias: minitron's Llama has no biases")
    h, nh = int(c["hidden_size"]), int(c["num_attention_heads"])
    kv = int(c.get("num_key_value_heads") or nh)
    if c.get("head_dim") is None and h % nh:
        raise ConfigError(f"{where} has hidden_size {h} for {nh} heads and no head_dim: give head_dim")
    if nh % kv:
        raise ConfigError(f"{where} has {kv} key/value heads for {nh} query heads: no layout can group them "
                          f"(num_key_value_heads must divide num_attention_heads)")
    if c.get("pretraining_tp", 1) not in (1, None):
        raise ConfigError(f"{where} has pretraining_tp {c['pretraining_tp']}: minitron computes the linears "
                          f"whole (pretraining_tp 1)")


def read_config(hf_dir: str) -> dict:
    """`config.json` of a directory of a family minitron loads, checked; ConfigError (one line) otherwise."""
    d = Path(hf_dir)
    if not d.is_dir():
        raise ConfigError(f"--init-from {hf_dir} is not a directory: give a folder with {CONFIG} and {WEIGHTS}")
    for f in (CONFIG, WEIGHTS):
        if not (d / f).is_file() and not (f == WEIGHTS and (d / INDEX).is_file()):
            raise ConfigError(f"--init-from {hf_dir} has no {f}" + (f" (nor {INDEX} with its shards)" if f == WEIGHTS
                              else "") + f": save the model there with save_pretrained (safetensors) or "
                              f"`minitron export --hf {hf_dir}`")
    try:
        c = json.loads((d / CONFIG).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConfigError(f"{d / CONFIG} is not valid JSON: save the model again") from None
    if not isinstance(c, dict):
        raise ConfigError(f"{d / CONFIG} is not a JSON object of settings: save the model again")
    return check_config(c, d / CONFIG)


def check_config(c: dict, where) -> dict:
    """A family's config.json (as a dict), checked: the family known, every size a positive
    integer, every typed field of its type, nothing minitron does not compute."""
    _check_types(c, where)
    d = Path(str(where)).parent
    arch = c.get("model_type")
    if arch in LLAMA_TYPES + hf_moe.MOE_TYPES:
        _check_llama(c, d / CONFIG)
        if arch in hf_moe.MOE_TYPES:
            hf_moe.model_fields(c, d / CONFIG)
        return c
    if arch in hf_deepseek.DEEPSEEK_TYPES:
        _positive_ints(c, DEEPSEEK_SIZES, ("max_position_embeddings", "q_lora_rank", "n_group", "topk_group"),
                       d / CONFIG)
        hf_deepseek.check_config(c, d / CONFIG)
        return c
    if arch != "gpt2":
        known = ", ".join(("gpt2", *LLAMA_TYPES, *hf_moe.MOE_TYPES, *hf_deepseek.DEEPSEEK_TYPES))
        raise ConfigError(f"{d / CONFIG} is a '{arch}' model: minitron loads the model_types {known} only; "
                          f"use a checkpoint of one of them")
    _positive_ints(c, ("n_embd", "n_layer", "n_head", "vocab_size"), ("n_positions", "n_inner"), d / CONFIG)
    act = c.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise ConfigError(f"{d / CONFIG} uses activation '{act}': minitron has {', '.join(ACTIVATIONS)}")
    if c.get("scale_attn_by_inverse_layer_idx") or not c.get("scale_attn_weights", True) or c.get("add_cross_attention"):
        raise ConfigError(f"{d / CONFIG} changes GPT-2's attention (scale_attn_* / add_cross_attention): "
                          f"minitron has only the standard 1/sqrt(d) causal self-attention")
    return c


def model_config(hf_dir: str, seq_len: int | None = None, dropout: float | None = None) -> ModelConfig:
    """The minitron ModelConfig of a GPT-2, Llama-shaped, Mixtral, Qwen2-MoE, OLMoE or DeepSeek-V3 directory; `seq_len`
    may shorten the context.
    It passes the engine's own checks (``config.validate_model``), or one line naming the file."""
    cfg = config_model(read_config(hf_dir), hf_dir, seq_len, dropout)
    try:
        validate_model(cfg)
    except ConfigError as e:
        raise ConfigError(f"{Path(hf_dir) / CONFIG} describes a model minitron cannot build: {e}") from None
    return cfg


def config_model(c: dict, hf_dir: str, seq_len: int | None = None, dropout: float | None = None) -> ModelConfig:
    """The ModelConfig of a checked config.json `c` (of directory `hf_dir`)."""
    if c.get("model_type") in LLAMA_TYPES:
        return _llama_model_config(c, hf_dir, seq_len, dropout)
    if c.get("model_type") in hf_moe.MOE_TYPES:  # a Llama with experts
        return _llama_model_config(c, hf_dir, seq_len, dropout).replace(**hf_moe.model_fields(c, hf_dir))
    if c.get("model_type") in hf_deepseek.DEEPSEEK_TYPES:
        return hf_deepseek.model_config(c, _context(c, seq_len, 4096), Path(hf_dir).name or "deepseek-v3").replace(
            dropout=dropout or 0.0)
    n_pos = int(c.get("n_positions", 1024))
    if seq_len is not None and not 0 < seq_len <= n_pos:
        raise ConfigError(f"--seq-len {seq_len} exceeds the checkpoint's {n_pos} positions: use {n_pos} or less")
    h = int(c["n_embd"])
    return ModelConfig(layers=int(c["n_layer"]), hidden=h, heads=int(c["n_head"]), seq_len=seq_len or n_pos,
                       vocab=int(c["vocab_size"]), ffn=int(c.get("n_inner") or 4 * h),
                       tied_embeddings=c.get("tie_word_embeddings") is not False,
                       dropout=dropout or 0.0, activation=ACTIVATIONS[c.get("activation_function", "gelu_new")],
                       norm_eps=float(c.get("layer_norm_epsilon") or 1e-5), name=Path(hf_dir).name or "gpt2")


def _context(c: dict, seq_len: int | None, default: int) -> int:
    """The context of a rotary config.json: `seq_len`, at most its max_position_embeddings
    (`default` when absent), or all of them."""
    n_pos = int(c.get("max_position_embeddings") or default)
    if seq_len is not None and not 0 < seq_len <= n_pos:
        raise ConfigError(f"--seq-len {seq_len} exceeds the checkpoint's max_position_embeddings {n_pos}: "
                          f"use {n_pos} or less")
    return seq_len or n_pos


def _llama_model_config(c: dict, hf_dir: str, seq_len: int | None, dropout: float | None) -> ModelConfig:
    nh = int(c["num_attention_heads"])
    kv = int(c.get("num_key_value_heads") or nh)
    return ModelConfig(layers=int(c["num_hidden_layers"]), hidden=int(c["hidden_size"]), heads=nh,
                       kv_heads=0 if kv == nh else kv, ffn=int(c["intermediate_size"]),
                       seq_len=_context(c, seq_len, 2048), vocab=int(c["vocab_size"]),
                       norm_eps=float(c.get("rms_norm_eps") or 1e-6), dropout=dropout or 0.0,
                       name=Path(hf_dir).name or "llama", **hf_families.model_fields(c, Path(hf_dir) / CONFIG, seq_len),
                       **{**LLAMA, "tied_embeddings": c.get("tie_word_embeddings") is True})


# Model fields a run may set over an --init-from directory: they change neither the loaded
# parameters nor the function they compute (dropout, the balancing loss's weight and the
# speed of DeepSeek-V3's selection-bias update act in training only; the name is a label).
# Every other field the directory decides.
INIT_APPLIES = ("name", "dropout", "aux_loss", "bias_update")


def apply_flags(hf_dir: str, stored: ModelConfig, given: dict) -> ModelConfig:
    """Model `stored` (of `hf_dir`) with the model flags `given` ({field: value}) applied:
    those of INIT_APPLIES are; any other that differs from the directory's is refused in
    one line naming each such field with both values (never silently ignored)."""
    from .checkpoint import model_changes, model_flag, model_record

    wanted = stored.replace(**given)
    changes = [c for c in model_changes(model_record(stored), wanted) if c[0] not in INIT_APPLIES]
    if changes:
        said = ", ".join(f"{k} {was}, not {now}" for k, was, now in changes)
        flags = " ".join(model_flag(k, now).split(" ")[0] for k, _, now in changes)
        raise ConfigError(f"--init-from {hf_dir} holds a model with {said}: the directory decides these; drop "
                          f"{flags} (only --{', --'.join(f.replace('_', '-') for f in INIT_APPLIES[1:])} and a "
                          f"shorter --seq-len apply to it)")
    return wanted


def _stored_name(name: str, names) -> str:
    """GPT-2's original files name tensors without the "transformer." prefix ("h.0.ln_1.weight")."""
    return name if name in names or name.startswith("lm_head.") else name.removeprefix("transformer.")


def weight_files(hf_dir: str) -> dict[str, Path]:
    """{tensor name: the safetensors file holding it}: model.safetensors, or the shards a
    sharded save_pretrained lists in model.safetensors.index.json (its "weight_map")."""
    d = Path(hf_dir)
    if (d / WEIGHTS).is_file() or not (d / INDEX).is_file():
        return {name: d / WEIGHTS for name in _header(d / WEIGHTS)}
    try:
        wmap = json.loads((d / INDEX).read_text()).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        wmap = None
    if not isinstance(wmap, dict) or not all(isinstance(f, str) and Path(f).name == f for f in wmap.values()):
        raise ConfigError(f"{d / INDEX} has no valid weight_map (tensor -> shard file in the same folder): "
                          f"save the model again")
    out = {}
    for f in sorted(set(wmap.values())):
        held = _header(d / f)
        out.update({name: d / f for name in held})
        lost = [n for n, g in wmap.items() if g == f and n not in held]
        if lost:
            raise ConfigError(f"{d / INDEX} places '{lost[0]}' in {f}, which does not hold it: save the model again")
    return out


def _header(path: Path) -> dict[str, tuple]:
    """{name: shape} of one safetensors file, from its header only."""
    from safetensors import safe_open

    _safetensors()
    if not path.is_file():
        raise ConfigError(f"{path} does not exist (its index names it): copy every shard of the model")
    try:
        with safe_open(str(path), "pt") as f:
            return {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    except Exception as e:  # truncated file, not safetensors, ...
        raise ConfigError(f"{path} cannot be read ({type(e).__name__}): save the model again") from None


def shapes_in_files(hf_dir: str) -> dict[str, tuple]:
    """{name: shape} of every tensor of `hf_dir` (one file or the shards of an index)."""
    files = weight_files(hf_dir)
    out = {}
    for f in sorted(set(files.values())):
        out.update(_header(f))
    return out


def expected_shapes(cfg: ModelConfig, names) -> dict[str, tuple]:
    """{their name as stored: shape} of every tensor model `cfg` needs (GPT-2's positions:
    as many rows as the file holds, at least seq_len; ConfigError for a missing tensor)."""
    if hf_deepseek.is_deepseek(cfg):
        return hf_deepseek.shapes(cfg)
    if is_llama(cfg):
        return llama_shapes(cfg)
    out = {}
    for mine, theirs, kind in name_map(cfg):
        stored = _stored_name(theirs, names)
        out[stored] = _hf_shape(mine, kind, cfg)
    return out


def _check_counts(cfg: ModelConfig, names, where) -> None:
    """The layers and experts config.json declares are those the files hold, checked on the
    names alone before any list of a model's tensors is made (a billion layers declared
    over two must be refused at once, not enumerated)."""
    layers = {int(m.group(1)) for n in names if (m := re.search(r"(?:^|\.)(?:h|layers)\.(\d+)\.", n))}
    if len(layers) != cfg.layers or (layers and max(layers) != cfg.layers - 1):
        raise ConfigError(f"{where} declares {cfg.layers} layers but the weights hold {len(layers)}"
                          f"{f' (numbered up to {max(layers)})' if layers else ''}: the weights and the config "
                          f"do not belong together")
    experts = {int(m.group(1)) for n in names if (m := re.search(r"\.experts\.(\d+)\.", n))}
    if len(experts) != cfg.experts or (experts and max(experts) != cfg.experts - 1):
        raise ConfigError(f"{where} declares {cfg.experts} experts but the weights hold {len(experts)}"
                          f"{f' (numbered up to {max(experts)})' if experts else ''}: the weights and the config "
                          f"do not belong together")


def check_weights(hf_dir: str, cfg: ModelConfig) -> None:
    """Every tensor model `cfg` needs is in `hf_dir`'s safetensors with the right shape, and
    every tensor there is one it needs (or a buffer of DERIVED); reads only the files'
    headers, so it is cheap before any rank starts."""
    shapes = shapes_in_files(hf_dir)
    where = Path(hf_dir) / (WEIGHTS if (Path(hf_dir) / WEIGHTS).is_file() else INDEX)
    _check_counts(cfg, shapes, Path(hf_dir) / CONFIG)
    want = expected_shapes(cfg, shapes)
    family = "DeepSeek-V3" if hf_deepseek.is_deepseek(cfg) else "Llama" if is_llama(cfg) else "GPT-2"
    for name, shape in want.items():
        if name not in shapes:
            raise ConfigError(f"{where} has no tensor '{name}': it is not the {family} of its config.json "
                              f"(layers {cfg.layers}, tied {cfg.tied_embeddings}); save it again")
        got = shapes[name]
        if name.endswith("wpe.weight"):
            got = (min(got[0], cfg.seq_len),) + got[1:]  # more positions than used is fine
        if got != shape:
            raise ConfigError(f"{where}: '{name}' has shape {list(shapes[name])}, config.json implies "
                              f"{list(shape)}: the weights and the config do not belong together")
    extra = sorted(n for n in shapes if n not in want and not n.endswith(DERIVED)
                   and not (n == "lm_head.weight" and cfg.tied_embeddings))
    if extra:
        raise ConfigError(f"{where} holds {len(extra)} tensor(s) its config.json does not account for "
                          f"({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''}): the weights and the config do "
                          f"not belong together; save the model again")


def check_values(hf_dir: str, cfg: ModelConfig) -> None:
    """Every tensor of `hf_dir` is finite, and a tied config's output matrix, if the files
    hold one, is the embedding (a distinct one would be dropped without a word). Reads
    each tensor once; run before any rank starts."""
    from safetensors import safe_open

    files = weight_files(hf_dir)
    emb = "model.embed_tokens.weight" if is_llama(cfg) else _stored_name("transformer.wte.weight", files)
    for path in sorted(set(files.values())):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    raise ConfigError(f"{path} holds non-finite values in '{name}': the model is broken; "
                                      f"use another checkpoint")
    if cfg.tied_embeddings and "lm_head.weight" in files and emb in files:
        head, wte = (_tensor(files[n], n) for n in ("lm_head.weight", emb))
        if not torch.equal(head, wte):
            raise ConfigError(f"{Path(hf_dir) / CONFIG} ties the output to the embedding (tie_word_embeddings) but "
                              f"the weights hold a distinct lm_head.weight: set tie_word_embeddings to false to "
                              f"load it untied, or drop lm_head.weight")


def _tensor(path: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.get_tensor(name)


def load_state(hf_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of `hf_dir` (one file or the shards of an index)."""
    files = weight_files(hf_dir)
    state = {}
    for path in sorted(set(files.values())):
        state.update(_safetensors().load_file(str(path)))
    return state


def load_full(hf_dir: str, cfg: ModelConfig) -> dict[str, dict]:
    """The weights of `hf_dir` as full minitron tensors, in `checkpoint.assemble`'s form
    {name: {"param": tensor}}, ready for `checkpoint.import_state` into any layout
    (checked first: names, shapes, nothing unaccounted for, finite values)."""
    check_weights(hf_dir, cfg)
    state = load_state(hf_dir)
    bad = next((n for n, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())), None)
    if bad:
        raise ConfigError(f"{hf_dir} holds non-finite values in '{bad}': the model is broken; use another checkpoint")
    if not is_llama(cfg):
        state = {theirs: state[_stored_name(theirs, state)] for _, theirs, _ in name_map(cfg)}
    return {k: {"param": v} for k, v in from_hf(state, cfg).items()}


def llama_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """{Llama tensor name: shape} of every tensor model `cfg` needs."""
    h, f, v, d = cfg.hidden, cfg.ffn_hidden, cfg.vocab, cfg.head_dim
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.tied_embeddings:
        out["lm_head.weight"] = (v, h)
    for i in range(cfg.layers):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        out.update({f"model.layers.{i}.input_layernorm.weight": (h,),
                    f"model.layers.{i}.post_attention_layernorm.weight": (h,),
                    f"{a}.q_proj.weight": (cfg.heads * d, h), f"{a}.k_proj.weight": (cfg.n_kv_heads * d, h),
                    f"{a}.v_proj.weight": (cfg.n_kv_heads * d, h), f"{a}.o_proj.weight": (h, cfg.heads * d)})
        if cfg.qkv_bias:
            out.update({f"{a}.q_proj.bias": (cfg.heads * d,), f"{a}.k_proj.bias": (cfg.n_kv_heads * d,),
                        f"{a}.v_proj.bias": (cfg.n_kv_heads * d,)})
        if cfg.qk_norm:  # each head's d (Qwen3) or the whole projection (OLMoE)
            whole = cfg.qk_norm_span == "all"
            out.update({f"{a}.q_norm.weight": (cfg.heads * d if whole else d,),
                        f"{a}.k_norm.weight": (cfg.n_kv_heads * d if whole else d,)})
        out.update(hf_moe.shapes(cfg, i) if cfg.is_moe_block(i) else {
            f"{m}.gate_proj.weight": (f, h), f"{m}.up_proj.weight": (f, h), f"{m}.down_proj.weight": (h, f)})
    return out


def _hf_shape(mine: str, kind: str, cfg: ModelConfig) -> tuple:
    h, f, v = cfg.hidden, cfg.ffn_hidden, cfg.vocab
    if kind == "qkv_weight":
        return (h, 3 * h)
    if kind == "qkv_bias":
        return (3 * h,)
    leaf = mine.split(".")[-2] if mine.count(".") else mine
    shapes = {"wte.weight": (v, h), "lm_head.weight": (v, h), "wpe.weight": (cfg.seq_len, h)}
    if mine in shapes:
        return shapes[mine]
    if kind == "linear":
        return {"proj": (h, h), "fc": (h, f), "fc2": (f, h)}[leaf]
    return {"fc": (f,)}.get(leaf, (h,))


def save(hf_dir: str, full: dict[str, torch.Tensor], cfg: ModelConfig) -> dict:
    """Write `config.json` and `model.safetensors` for `full` ({minitron name: tensor}).
    Returns {"dir", "tensors", "params", "dtype", "class"} (the transformers class that loads it)."""
    problem = export_problem(cfg)
    if problem:
        raise ConfigError(f"cannot export this model to Hugging Face: {problem}")
    d = Path(hf_dir)
    d.mkdir(parents=True, exist_ok=True)
    state = to_hf(full, cfg)
    dtype = next(iter(state.values())).dtype
    _safetensors().save_file(state, str(d / WEIGHTS), metadata={"format": "pt"})
    (d / CONFIG).write_text(json.dumps(hf_config(cfg, dtype), indent=1) + "\n")
    return {"dir": str(d), "tensors": len(state), "params": sum(t.numel() for t in state.values()),
            "dtype": str(dtype).removeprefix("torch."),
            "class": hf_config(cfg, dtype)["architectures"][0]}
