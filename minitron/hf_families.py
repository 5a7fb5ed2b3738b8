"""The Llama-shaped Hugging Face families, each a row of what it adds to Llama, and the
rotary scaling their config.json may carry.

Qwen2, Qwen3 and Mistral are Llama's block (RMSNorm, SwiGLU, rotary positions,
grouped-query attention) with one difference each, a knob the engine already has
(``config.ModelConfig``); ``hf.py`` keeps the one Llama mapping and asks this table
what a family adds:

* **Qwen2** (``Qwen2ForCausalLM``): biases on q_proj, k_proj, v_proj and none elsewhere
  (``qkv_bias``); its config.json has no field for them, every Qwen2 has them.
* **Qwen3** (``Qwen3ForCausalLM``): RMSNorm over each head's d dimensions of q and k,
  before the rotation (``qk_norm``: ``self_attn.q_norm`` / ``k_norm``, weight [d]), and
  a head width set apart from hidden/heads (``head_dim``, read by every family into
  ``head_width``).
* **Mistral** (``MistralForCausalLM``): a sliding window on every layer. transformers'
  ``sliding_window_overlay`` lets query p see key j iff p − W < j ≤ p: W keys, itself
  included, the engine's ``window`` exactly (``context_parallel.window_mask``).

Rope scaling (``rope_parameters`` in transformers 5, ``rope_scaling`` in 4.x) of the
kinds ``rope.py`` computes, ``llama3`` and ``yarn``: each a table of its transformers
keys and the engine's fields, read and written by the same table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .config import ConfigError, ModelConfig


@dataclass(frozen=True)
class Family:
    """A Llama-shaped family: its transformers class, the engine knob it adds (at most
    one; "" for Llama itself) and the config.json fields it writes beside Llama's."""
    architecture: str
    knob: str
    fields: tuple = ()


FAMILIES = {
    "llama": Family("LlamaForCausalLM", ""),
    "qwen2": Family("Qwen2ForCausalLM", "qkv_bias", (("use_sliding_window", False), ("sliding_window", None))),
    "qwen3": Family("Qwen3ForCausalLM", "qk_norm", (("use_sliding_window", False), ("sliding_window", None))),
    "mistral": Family("MistralForCausalLM", "window"),
}
KNOBS = ("qkv_bias", "qk_norm", "window")  # the engine's fields a family may add

# transformers' rope_parameters keys of each scaling kind -> the engine's fields (rope.py)
ROPE_KINDS = {
    "llama3": {"factor": "rope_factor", "original_max_position_embeddings": "rope_original_context",
               "low_freq_factor": "rope_low_freq", "high_freq_factor": "rope_high_freq"},
    "yarn": {"factor": "rope_factor", "original_max_position_embeddings": "rope_original_context",
             "beta_fast": "rope_beta_fast", "beta_slow": "rope_beta_slow"},
}


def family_of(cfg: ModelConfig) -> str | None:
    """The model_type of the family that holds `cfg`'s knobs, or None (two knobs at once)."""
    held = {k for k in KNOBS if getattr(cfg, k)}
    return next((t for t, f in FAMILIES.items() if held == ({f.knob} - {""})), None)


def family_problem(cfg: ModelConfig) -> str:
    """'' when one family holds `cfg`'s knobs, else the reason, naming each family's."""
    if family_of(cfg) is not None:
        return ""
    held = ", ".join(k for k in KNOBS if getattr(cfg, k))
    each = ", ".join(f"{t} {f.knob}" for t, f in FAMILIES.items() if f.knob)
    return f"no Hugging Face family has {held} together (each holds one: {each})"


def model_fields(c: dict, where, seq_len: int | None = None) -> dict:
    """The engine fields a Llama-shaped family's `config.json` sets beyond Llama's sizes (for
    a context of `seq_len`): its knob, the head width, the rope scaling; ConfigError (one line) for what the engine
    does not compute."""
    kind = c.get("model_type")
    sliding = c.get("use_sliding_window") or "sliding_attention" in (c.get("layer_types") or ())
    if kind in ("qwen2", "qwen3") and sliding:
        raise ConfigError(f"{where} has use_sliding_window (or sliding layer_types): minitron loads {kind}'s "
                          f"full attention only; set use_sliding_window to false")
    if kind == "qwen3" and c.get("attention_bias"):
        raise ConfigError(f"{where} has attention_bias: minitron's Qwen3 has no biases; use a model without them")
    h, nh = int(c["hidden_size"]), int(c["num_attention_heads"])
    d = c.get("head_dim")
    out = {"head_width": d if d is not None and (d != h // nh or h % nh) else 0, **rope_fields(c, where)}
    if kind == "qwen2":
        out["qkv_bias"] = True
    if kind == "qwen3":
        out["qk_norm"] = True
    if kind == "mistral" and c.get("sliding_window"):
        # a window over the whole context (`seq_len`, or the checkpoint's) is full attention: held as the context
        out["window"] = min(int(c["sliding_window"]), seq_len or int(c.get("max_position_embeddings", 2048)))
    return out


def _rope_params(c: dict) -> dict:
    """transformers 5's ``rope_parameters`` merged under 4.x's ``rope_scaling`` (which names
    its kind ``rope_type`` or ``type``)."""
    scaling = dict(c.get("rope_scaling") or {})
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    return {**(c.get("rope_parameters") or {}), **scaling}


def rope_fields(c: dict, where) -> dict:
    """rope_base and, when scaled, rope_scaling and its fields (ROPE_KINDS) of a config.json;
    one line for a kind or an option rope.py does not compute."""
    p = _rope_params(c)
    base = float(p.get("rope_theta", c.get("rope_theta", 10000.0)))
    kind = p.get("rope_type", "default")
    if kind == "default":
        return {"rope_base": base}
    if kind not in ROPE_KINDS:
        raise ConfigError(f"{where} has a rope scaling of type '{kind}': minitron computes "
                          f"{', '.join(ROPE_KINDS)} and the default; use a model with one of them")
    unsupported = [k for k in ("mscale", "mscale_all_dim") if p.get(k)] + (
        ["partial_rotary_factor"] if p.get("partial_rotary_factor", 1.0) != 1.0 else []) + (
        ["truncate false"] if p.get("truncate", True) is False else [])
    if unsupported:
        raise ConfigError(f"{where} sets {', '.join(unsupported)} in its {kind} rope scaling: minitron computes "
                          f"{kind} without them; use a model without them")
    n_pos = int(c.get("max_position_embeddings", 2048))
    # transformers: a top-level original_max_position_embeddings first (Phi-3), then the kind's, then the context
    p["original_max_position_embeddings"] = c.get("original_max_position_embeddings") or p.get(
        "original_max_position_embeddings") or n_pos
    if kind == "yarn" and p.get("factor") is None:  # transformers: the context over the original one
        p["factor"] = n_pos / p["original_max_position_embeddings"]
    missing = [k for k in ROPE_KINDS[kind] if p.get(k) is None and not (kind == "yarn" and k.startswith("beta"))]
    if missing:
        raise ConfigError(f"{where} has a {kind} rope scaling without {', '.join(missing)}: save the model again")
    fields = {mine: p[theirs] for theirs, mine in ROPE_KINDS[kind].items() if p.get(theirs) is not None}
    fields = {k: int(v) if k == "rope_original_context" else float(v) for k, v in fields.items()}
    factor = fields["rope_factor"]
    if kind == "yarn" and p.get("attention_factor") is not None and not math.isclose(
            p["attention_factor"], 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0, rel_tol=0, abs_tol=1e-12):
        raise ConfigError(f"{where} sets yarn's attention_factor {p['attention_factor']}: minitron computes "
                          f"0.1·ln(factor) + 1; drop attention_factor")
    return {"rope_base": base, "rope_scaling": kind, **fields}


def rope_parameters(cfg: ModelConfig) -> dict:
    """The ``rope_parameters`` of `cfg` as transformers 5 writes them (the inverse of
    :func:`rope_fields`)."""
    kind = cfg.rope_scaling or "default"
    return {"rope_type": kind, "rope_theta": cfg.rope_base,
            **{theirs: getattr(cfg, mine) for theirs, mine in ROPE_KINDS.get(kind, {}).items()}}


def config_fields(cfg: ModelConfig) -> dict:
    """What `cfg`'s family writes into a Llama config.json: its class and model_type, its
    own fields, the rope parameters (call only when :func:`family_of` names a family)."""
    kind = family_of(cfg)
    fam = FAMILIES[kind]
    own = dict(fam.fields)
    if kind == "mistral":
        own["sliding_window"] = cfg.window
    if kind == "qwen3":
        own["attention_bias"] = False
    rope = rope_parameters(cfg)  # and as 4.x reads a scaling (transformers 5 takes it as rope_parameters)
    return {"architectures": [fam.architecture], "model_type": kind, "rope_parameters": rope,
            "rope_scaling": rope if cfg.rope_scaling else None, **own}
