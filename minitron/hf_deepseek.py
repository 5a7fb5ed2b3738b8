"""DeepSeek-V3 weights (``transformers.DeepseekV3ForCausalLM``) <-> minitron's names: the
state dict transformers builds in memory (its experts fused: ``experts.gate_up_proj``
[E, 2f, h], gate rows then up rows, and ``experts.down_proj`` [E, h, f]) and its config
fields. Not yet wired into ``hf.py``'s ``--init-from`` and ``export`` (the files
``save_pretrained`` writes split the experts per index).

Names: ``self_attn.q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` / ``kv_a_proj_with_mqa``
/ ``kv_a_layernorm`` / ``kv_b_proj`` / ``o_proj`` are minitron's ``attn.q_a`` / ``q_a_norm``
/ ``q_b`` / ``kv_a`` / ``kv_a_norm`` / ``kv_b`` / ``proj`` (the same rows: head-major, the
rotary dimensions interleaved as ``rope_interleave=True`` stores them); ``mlp.gate`` is the
router, ``gate.e_score_correction_bias`` the selection bias; the SwiGLU gate and up rows
are interleaved [unit][gate|up] into minitron's ``fc`` (the dense MLP's layout).
"""
from __future__ import annotations

import torch

from .config import LLAMA, ModelConfig

_ATTN = {"q_a_proj": "q_a", "q_a_layernorm": "q_a_norm", "q_b_proj": "q_b", "q_proj": "q",
         "kv_a_proj_with_mqa": "kv_a", "kv_a_layernorm": "kv_a_norm", "kv_b_proj": "kv_b", "o_proj": "proj"}


def deepseek_knobs(cfg: ModelConfig) -> list[str]:
    """The DeepSeek-V3 fields `cfg` sets away from their defaults (what a Llama or Mixtral
    file cannot hold)."""
    knobs = {"attention": "standard", "mtp_depths": 0, "expert_groups": 0, "topk_groups": 0, "routed_scaling": 1.0,
             "dense_layers": 0}
    return [f"{k} {getattr(cfg, k)}" for k, v in knobs.items() if getattr(cfg, k) != v]


def model_config(c, seq_len: int = 0, name: str = "deepseek-v3-hf") -> ModelConfig:
    """The ModelConfig of a transformers ``DeepseekV3Config`` (an object with its fields)."""
    return ModelConfig(
        layers=c.num_hidden_layers, hidden=c.hidden_size, heads=c.num_attention_heads, vocab=c.vocab_size,
        seq_len=seq_len or c.max_position_embeddings, ffn=c.intermediate_size, norm_eps=c.rms_norm_eps,
        rope_base=float(c.rope_parameters["rope_theta"]), attention="mla", q_lora_rank=c.q_lora_rank or 0,
        kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim,
        v_head_dim=c.v_head_dim, experts=c.n_routed_experts, top_k=c.num_experts_per_tok,
        moe_ffn=c.moe_intermediate_size, shared_experts=c.n_shared_experts, expert_groups=c.n_group,
        topk_groups=c.topk_group, routed_scaling=c.routed_scaling_factor, dense_layers=c.first_k_dense_replace,
        router="sigmoid", aux_loss=0.0, name=name, **{**LLAMA, "tied_embeddings": bool(c.tie_word_embeddings)})


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[f, h] gate and up rows -> [2f, h] rows [unit][gate|up] (minitron's SwiGLU ``fc``)."""
    return torch.stack([gate, up], dim=-2).flatten(-3, -2)


def _mlp(state: dict, src: str, dst: str) -> dict:
    return {f"{dst}.fc.weight": _interleave(state[f"{src}.gate_proj.weight"], state[f"{src}.up_proj.weight"]),
            f"{dst}.fc2.weight": state[f"{src}.down_proj.weight"]}


def _block(state: dict, i: int, cfg: ModelConfig) -> dict:
    src, dst = f"model.layers.{i}", f"blocks.{i}"
    out = {f"{dst}.ln1.weight": state[f"{src}.input_layernorm.weight"],
           f"{dst}.ln2.weight": state[f"{src}.post_attention_layernorm.weight"]}
    for hf_name, mine in _ATTN.items():
        if f"{src}.self_attn.{hf_name}.weight" in state:
            out[f"{dst}.attn.{mine}.weight"] = state[f"{src}.self_attn.{hf_name}.weight"]
    if not cfg.is_moe_block(i):
        return {**out, **_mlp(state, f"{src}.mlp", f"{dst}.mlp")}
    fused, f = state[f"{src}.mlp.experts.gate_up_proj"], cfg.moe_ffn_hidden
    return {**out, **_mlp(state, f"{src}.mlp.shared_experts", f"{dst}.mlp.shared"),
            f"{dst}.mlp.router.weight": state[f"{src}.mlp.gate.weight"],
            f"{dst}.mlp.router.score_bias": state[f"{src}.mlp.gate.e_score_correction_bias"],
            f"{dst}.mlp.experts.fc.weight": _interleave(fused[:, :f], fused[:, f:]),
            f"{dst}.mlp.experts.fc2.weight": state[f"{src}.mlp.experts.down_proj"]}


def from_hf(state: dict, cfg: ModelConfig) -> dict:
    """{minitron name: tensor} from a DeepseekV3ForCausalLM state dict (in memory)."""
    out = {"wte.weight": state["model.embed_tokens.weight"], "ln_f.weight": state["model.norm.weight"]}
    if not cfg.tied_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(cfg.layers):
        out.update(_block(state, i, cfg))
    return out
