"""DeepSeek-V3 checkpoints (``transformers.DeepseekV3ForCausalLM``; DeepSeek-V3 tech report,
arXiv 2412.19437): multi-head latent attention (DeepSeek-V2, arXiv 2405.04434 §2.1), a first
``first_k_dense_replace`` dense blocks, then group-limited sigmoid routing with the selection
bias, routed scaling and shared experts. ``hf.py`` reads and writes the directory (config.json,
safetensors) and dispatches here for what this family's names, shapes and config hold.

Names: ``self_attn.q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` (or ``q_proj`` without a
query latent) / ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` / ``kv_b_proj`` / ``o_proj`` are
minitron's ``attn.q_a`` / ``q_a_norm`` / ``q_b`` (``q``) / ``kv_a`` / ``kv_a_norm`` / ``kv_b``
/ ``proj``, the same rows: head-major, the rotary dimensions interleaved as
``rope_interleave=True`` stores them (DeepSeek's own pairing, which ``mla.py`` computes: no
permutation); ``mlp.gate`` is the router, ``gate.e_score_correction_bias`` the selection
bias; every SwiGLU's gate and up rows are interleaved [unit][gate|up] into minitron's ``fc``
(the dense MLP's layout), the routed experts stacked as Mixtral's are (``hf_moe``).

The experts, two forms: the files ``save_pretrained`` writes (transformers 5) hold them per
index, ``mlp.experts.e.gate_proj`` / ``up_proj`` / ``down_proj``, which ``--init-from`` reads
and ``export`` writes; the state dict transformers builds in memory fuses them
(``experts.gate_up_proj`` [E, 2f, h], gate rows then up rows, ``experts.down_proj``
[E, h, f]), which :func:`from_hf` also takes (:func:`per_expert`).

Multi-token prediction: transformers' DeepseekV3ForCausalLM builds no MTP module (its
``num_nextn_predict_layers`` is read but computes nothing, and ``save_pretrained`` writes no
such weights), so ``--init-from`` gives a model with ``mtp_depths`` 0 (``--mtp-depths`` over
it is refused by ``hf.apply_flags``), and exporting a model with MTP depths is refused in
one line: its depths would be lost.
"""
from __future__ import annotations

import torch

from . import hf_moe
from .config import LLAMA, ConfigError, ModelConfig

DEEPSEEK_TYPES = ("deepseek_v3",)
# transformers' DeepseekV3Attention (as DeepSeek's own modeling_deepseek.py) builds its latent
# RMSNorms, q_a_layernorm and kv_a_layernorm, with the default epsilon whatever rms_norm_eps;
# minitron's MLA normalises with the model's one norm_eps, so only this epsilon is the same model
LATENT_EPS = 1e-6
_ATTN = {"q_a_proj": "q_a", "q_a_layernorm": "q_a_norm", "q_b_proj": "q_b", "q_proj": "q",
         "kv_a_proj_with_mqa": "kv_a", "kv_a_layernorm": "kv_a_norm", "kv_b_proj": "kv_b", "o_proj": "proj"}


def deepseek_knobs(cfg: ModelConfig) -> list[str]:
    """The DeepSeek-V3 fields `cfg` sets away from their defaults (what a Llama or Mixtral
    file cannot hold)."""
    knobs = {"attention": "standard", "mtp_depths": 0, "expert_groups": 0, "topk_groups": 0, "routed_scaling": 1.0,
             "dense_layers": 0}
    return [f"{k} {getattr(cfg, k)}" for k, v in knobs.items() if getattr(cfg, k) != v]


def is_deepseek(cfg: ModelConfig) -> bool:
    """A model with DeepSeek-V3's blocks: written (or refused) in this family's format."""
    return bool(deepseek_knobs(cfg))


def problem(cfg: ModelConfig) -> str:
    """'' when DeepseekV3ForCausalLM computes `cfg`'s model, else the reason (one line)."""
    if cfg.mtp_depths:
        return (f"transformers' DeepseekV3ForCausalLM has no multi-token prediction modules: mtp_depths "
                f"{cfg.mtp_depths} would be lost; export a model trained with --mtp-depths 0")
    want = {"attention": "mla", "norm": "rmsnorm", "activation": "swiglu", "bias": False, "router": "sigmoid",
            "moe_every": 1, "capacity_factor": 0.0, "kv_heads": 0, "qk_norm": False, "qkv_bias": False, "window": 0,
            "rope_scaling": ""}  # the gates: a sigmoid router's are renormalised under either gate_norm
    bad = [f"{k} {getattr(cfg, k)}" for k, v in want.items() if getattr(cfg, k) != v]
    bad += [f"norm_eps {cfg.norm_eps} (its latent norms use {LATENT_EPS}, as the deepseek-v3 preset)"] \
        if cfg.norm_eps != LATENT_EPS else []
    bad += ["gate_norm never (its gates are renormalised: norm_topk_prob true)"] if cfg.gate_norm == "never" else []
    bad += ["experts 0"] if not cfg.experts else []
    bad += ["shared_experts 0"] if cfg.experts and not cfg.shared_experts else []
    if bad:
        return (f"DeepseekV3ForCausalLM computes MLA, RMSNorm, SwiGLU, no biases, sigmoid-routed dropless experts "
                f"in every block after the dense ones with shared experts, full attention, plain rotary; not "
                f"{', '.join(bad)}")
    return ""


def model_config(c, seq_len: int = 0, name: str = "deepseek-v3-hf") -> ModelConfig:
    """The ModelConfig of a DeepSeek-V3 config: a ``config.json`` dict or a transformers
    ``DeepseekV3Config``. MTP is not computed by transformers: ``mtp_depths`` 0."""
    c = c if isinstance(c, dict) else c.to_dict()
    rope = c.get("rope_parameters") or {"rope_theta": c.get("rope_theta") or 10000.0}
    groups = c.get("n_group") or 0
    return ModelConfig(
        layers=c["num_hidden_layers"], hidden=c["hidden_size"], heads=c["num_attention_heads"],
        vocab=c["vocab_size"], seq_len=seq_len or c.get("max_position_embeddings") or 4096,
        ffn=c["intermediate_size"], norm_eps=float(c.get("rms_norm_eps") or LATENT_EPS),
        rope_base=float(rope.get("rope_theta") or 10000.0), attention="mla", q_lora_rank=c.get("q_lora_rank") or 0,
        kv_lora_rank=c["kv_lora_rank"], qk_nope_head_dim=c["qk_nope_head_dim"],
        qk_rope_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"], experts=c["n_routed_experts"],
        top_k=c["num_experts_per_tok"], moe_ffn=c["moe_intermediate_size"], shared_experts=c["n_shared_experts"],
        # one group (transformers' n_group 1) is no grouping: minitron's 0
        expert_groups=groups if groups > 1 else 0, topk_groups=(c.get("topk_group") or 0) if groups > 1 else 0,
        routed_scaling=float(c.get("routed_scaling_factor") or 1.0), dense_layers=c.get("first_k_dense_replace") or 0,
        router="sigmoid", aux_loss=0.0, name=name, **{**LLAMA, "tied_embeddings": c.get("tie_word_embeddings") is True})


def check_config(c: dict, where) -> None:
    """What transformers' DeepSeek-V3 computes that minitron does not: one ConfigError line each."""
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    kind = rope.get("rope_type") or rope.get("type") or "default"
    refusals = [
        (c.get("rope_interleave") is False, "rope_interleave false (rotate-half rotary rows)",
         "minitron's MLA pairs neighbouring rotary dimensions, DeepSeek's layout; save it with rope_interleave true"),
        (kind != "default", f"rope scaling of type '{kind}'",
         "minitron's MLA rotates with plain rotary angles (no yarn softmax scale); use rope_type default"),
        (c.get("norm_topk_prob") is False, "norm_topk_prob false",
         "minitron's sigmoid router renormalises the chosen gates (DeepSeek-V3 §2.1.2); set it to true"),
        (float(c.get("rms_norm_eps") or LATENT_EPS) != LATENT_EPS, f"rms_norm_eps {c.get('rms_norm_eps')}",
         f"its latent norms (q_a_layernorm, kv_a_layernorm) use {LATENT_EPS} and minitron's MLA one epsilon for "
         f"every norm; use rms_norm_eps {LATENT_EPS}"),
        (c.get("hidden_act", "silu") != "silu", f"hidden_act '{c.get('hidden_act')}'",
         "minitron's SwiGLU is silu only"),
        (bool(c.get("attention_bias")), "attention_bias true", "minitron's MLA has no biases"),
        (not c.get("n_shared_experts"), f"n_shared_experts {c.get('n_shared_experts')}",
         "minitron's DeepSeek-V3 has shared experts; give n_shared_experts 1 or more"),
        (c.get("pretraining_tp", 1) not in (1, None), f"pretraining_tp {c.get('pretraining_tp')}",
         "minitron computes the linears whole (pretraining_tp 1)"),
    ]
    for bad, what, fix in refusals:
        if bad:
            raise ConfigError(f"{where} has {what}: {fix}")
    E, k = c["n_routed_experts"], c["num_experts_per_tok"]
    if not 1 <= k <= E:
        raise ConfigError(f"{where} routes to {k} of {E} experts: num_experts_per_tok must be in 1..n_routed_experts")


def config_fields(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """The config.json of model `cfg` as ``DeepseekV3Config.save_pretrained`` writes it."""
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": cfg.vocab,
            "hidden_size": cfg.hidden, "intermediate_size": cfg.ffn_hidden, "moe_intermediate_size": cfg.moe_ffn_hidden,
            "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.heads,
            "n_shared_experts": cfg.shared_experts, "n_routed_experts": cfg.experts,
            "routed_scaling_factor": cfg.routed_scaling, "kv_lora_rank": cfg.kv_lora_rank,
            "q_lora_rank": cfg.q_lora_rank or None, "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "v_head_dim": cfg.v_head_dim, "qk_nope_head_dim": cfg.qk_nope_head_dim,
            "qk_head_dim": cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, "head_dim": cfg.qk_rope_head_dim,
            "n_group": cfg.expert_groups or 1, "topk_group": cfg.topk_groups or cfg.expert_groups or 1,
            "num_experts_per_tok": cfg.top_k, "first_k_dense_replace": cfg.dense_layers, "norm_topk_prob": True,
            "hidden_act": "silu", "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_base, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
            "rope_interleave": True, "attention_bias": False, "attention_dropout": cfg.dropout,
            "num_nextn_predict_layers": 0, "tie_word_embeddings": cfg.tied_embeddings, "initializer_range": 0.02,
            "pretraining_tp": 1, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
            "dtype": str(dtype).removeprefix("torch.")}


def name_rows(cfg: ModelConfig) -> list[tuple[str, list[str], str]]:
    """(minitron name, their names, kind) for every tensor: 'copy' one to one, 'swiglu'
    (gate_proj, up_proj -> [unit][gate|up]), 'experts_in' / 'experts_out' (every expert's
    gate then up, or down, stacked: ``hf_moe``)."""
    rows = [("wte.weight", ["model.embed_tokens.weight"], "copy"), ("ln_f.weight", ["model.norm.weight"], "copy")]
    if not cfg.tied_embeddings:
        rows.append(("lm_head.weight", ["lm_head.weight"], "copy"))
    attn = ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
    attn += ["q_a_proj", "q_a_layernorm", "q_b_proj"] if cfg.q_lora_rank else ["q_proj"]
    for i in range(cfg.layers):
        src, dst = f"model.layers.{i}", f"blocks.{i}"
        rows += [(f"{dst}.ln1.weight", [f"{src}.input_layernorm.weight"], "copy"),
                 (f"{dst}.ln2.weight", [f"{src}.post_attention_layernorm.weight"], "copy")]
        rows += [(f"{dst}.attn.{_ATTN[a]}.weight", [f"{src}.self_attn.{a}.weight"], "copy") for a in attn]
        if not cfg.is_moe_block(i):
            rows += _mlp_rows(f"{src}.mlp", f"{dst}.mlp")
            continue
        m, w = f"{src}.mlp", lambda k: [f"{src}.mlp.experts.{e}.{k}.weight" for e in range(cfg.experts)]  # noqa: E731
        rows += [*_mlp_rows(f"{m}.shared_experts", f"{dst}.mlp.shared"),
                 (f"{dst}.mlp.router.weight", [f"{m}.gate.weight"], "copy"),
                 (f"{dst}.mlp.router.score_bias", [f"{m}.gate.e_score_correction_bias"], "copy"),
                 (f"{dst}.mlp.experts.fc.weight", w("gate_proj") + w("up_proj"), "experts_in"),
                 (f"{dst}.mlp.experts.fc2.weight", w("down_proj"), "experts_out")]
    return rows


def _mlp_rows(src: str, dst: str) -> list[tuple[str, list[str], str]]:
    return [(f"{dst}.fc.weight", [f"{src}.gate_proj.weight", f"{src}.up_proj.weight"], "swiglu"),
            (f"{dst}.fc2.weight", [f"{src}.down_proj.weight"], "copy")]


def shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """{their name: shape} of every tensor model `cfg` needs, from the sizes alone."""
    h, v, H, r = cfg.hidden, cfg.vocab, cfg.heads, cfg.qk_rope_head_dim
    q, kv, f, mf = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.ffn_hidden, cfg.moe_ffn_hidden
    qk = H * (cfg.qk_nope_head_dim + r)
    attn = {"kv_a_proj_with_mqa": (kv + r, h), "kv_a_layernorm": (kv,), "o_proj": (h, H * cfg.v_head_dim),
            "kv_b_proj": (H * (cfg.qk_nope_head_dim + cfg.v_head_dim), kv),
            **({"q_a_proj": (q, h), "q_a_layernorm": (q,), "q_b_proj": (qk, q)} if q else {"q_proj": (qk, h)})}

    def mlp(width):
        return {"gate_proj": (width, h), "up_proj": (width, h), "down_proj": (h, width)}

    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
           **({} if cfg.tied_embeddings else {"lm_head.weight": (v, h)})}
    for i in range(cfg.layers):
        s = f"model.layers.{i}"
        out.update({f"{s}.input_layernorm.weight": (h,), f"{s}.post_attention_layernorm.weight": (h,),
                    **{f"{s}.self_attn.{a}.weight": shape for a, shape in attn.items()}})
        if not cfg.is_moe_block(i):
            out.update({f"{s}.mlp.{k}.weight": shape for k, shape in mlp(f).items()})
            continue
        out.update({f"{s}.mlp.gate.weight": (cfg.experts, h), f"{s}.mlp.gate.e_score_correction_bias": (cfg.experts,),
                    **{f"{s}.mlp.shared_experts.{k}.weight": sh for k, sh in mlp(mf * cfg.shared_experts).items()},
                    **{f"{s}.mlp.experts.{e}.{k}.weight": sh for e in range(cfg.experts) for k, sh in mlp(mf).items()}})
    return out


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[f, h] gate and up rows -> [2f, h] rows [unit][gate|up] (minitron's SwiGLU ``fc``)."""
    return torch.stack([gate, up], dim=-2).flatten(-3, -2)


def per_expert(state: dict, cfg: ModelConfig) -> dict:
    """A state dict with transformers' in-memory fused experts (``experts.gate_up_proj``,
    ``experts.down_proj``) split per index as ``save_pretrained`` writes them; others as they are."""
    out, f = {}, cfg.moe_ffn_hidden
    for name, t in state.items():
        stem, _, leaf = name.rpartition(".experts.")
        if leaf == "gate_up_proj":
            out.update({f"{stem}.experts.{e}.{k}.weight": t[e, rows] for e in range(t.shape[0])
                        for k, rows in (("gate_proj", slice(0, f)), ("up_proj", slice(f, 2 * f)))})
        elif leaf == "down_proj":
            out.update({f"{stem}.experts.{e}.down_proj.weight": t[e] for e in range(t.shape[0])})
        else:
            out[name] = t
    return out


def from_hf(state: dict, cfg: ModelConfig) -> dict:
    """{minitron name: tensor} from a DeepseekV3ForCausalLM state dict: the files' (experts
    per index) or the in-memory one (fused experts)."""
    state = per_expert(state, cfg)
    out = {}
    for mine, theirs, kind in name_rows(cfg):
        parts = [state[n] for n in theirs]
        out[mine] = (_interleave(*parts) if kind == "swiglu" else parts[0] if kind == "copy"
                     else hf_moe.from_hf(parts, kind, cfg)).contiguous()
    return out


def to_hf(full: dict, cfg: ModelConfig) -> dict:
    """The inverse of :func:`from_hf`: minitron's full tensors -> the files' state dict."""
    out = {}
    for mine, theirs, kind in name_rows(cfg):
        t = full[mine]
        parts = (list(t.reshape(-1, 2, t.shape[-1]).unbind(1)) if kind == "swiglu" else [t] if kind == "copy"
                 else hf_moe.to_hf(t, kind, cfg))
        out.update({n: p.contiguous().clone() for n, p in zip(theirs, parts)})
    return out
