"""Mixtral checkpoints (Jiang et al. 2024; ``transformers.MixtralForCausalLM``): a Llama
whose every MLP is a mixture of E SwiGLU experts, top-k with Mixtral's softmax over the
chosen k. ``hf.py`` reads and writes the Llama part; this module holds what the experts add.

We chose Mixtral among the families transformers ships (Qwen2-MoE, OLMoE, DeepSeek) because
its blocks are exactly the Llama blocks of ``hf.py`` with the MLP swapped: no shared expert
(Qwen2-MoE has a gated one), no normalization of q and k (OLMoE), no grouped routing
(DeepSeek-V3); so every difference from a dense Llama is the MoE itself.

On disk (the original Mixtral names, which ``save_pretrained`` still writes) a MoE block
``model.layers.i.block_sparse_moe`` has ``gate.weight`` [E, h] (minitron's router) and per
expert e ``experts.e.w1.weight`` (gate) [f, h], ``w3`` (up) [f, h], ``w2`` (down) [h, f];
minitron stacks them: ``experts.fc.weight`` [E, 2f, h] with gate and up rows interleaved
[unit][gate|up] (the dense MLP's layout) and ``experts.fc2.weight`` [E, h, f]. Mixtral has
no selection bias: it is loaded as zeros and not written.

``transformers``' Mixtral takes its router's softmax and its RMSNorms in float32 whatever
the model's dtype (guards for bf16): minitron computes them in the model's dtype, so a
float64 ``transformers`` model agrees with minitron to float32's rounding (about 1e-8
here); with those modules computing in float64 it agrees to 1e-9 (``tests/test_moe.py``).
"""
from __future__ import annotations

import torch

from .config import ConfigError, ModelConfig

MIXTRAL_TYPES = ("mixtral",)


def is_mixtral(cfg: ModelConfig) -> bool:
    """A Llama-shaped model with experts: Mixtral's family."""
    return cfg.experts > 0 and cfg.positions == "rope"


def moe_problem(cfg: ModelConfig) -> str:
    """'' when Mixtral's format can hold `cfg`'s experts, else the reason."""
    want = {"moe_every": 1, "shared_experts": 0, "router": "softmax", "bias_update": 0.0, "capacity_factor": 0.0,
            "moe_ffn": 0}
    bad = [f"{k} {getattr(cfg, k)}" for k, v in want.items() if getattr(cfg, k) != v]
    if bad:
        return (f"Mixtral's experts are in every block, softmax-routed, dropless, without shared experts or a "
                f"selection bias, of the dense FFN size, not {', '.join(bad)}")
    if cfg.top_k == 1 and cfg.gate_norm != "always":
        return ("Mixtral renormalises the top-k scores, so its top-1 gate is 1, and this model's is the softmax "
                "score (gate_norm auto): train it with --gate-norm always")
    return ""


def block_rows(cfg: ModelConfig, i: int) -> list[tuple[str, str, str]]:
    """(minitron name, Mixtral names, kind) of block i's mixture: the router ('copy'), the
    experts' gate and up ('experts_in': all w1 and w3), down ('experts_out': all w2), and
    the selection bias ('zeros': not in Mixtral's files)."""
    b, m = f"blocks.{i}.mlp", f"model.layers.{i}.block_sparse_moe"
    w = lambda k: ",".join(f"{m}.experts.{e}.{k}.weight" for e in range(cfg.experts))  # noqa: E731
    return [(f"{b}.router.weight", f"{m}.gate.weight", "copy"),
            (f"{b}.experts.fc.weight", w("w1") + "," + w("w3"), "experts_in"),
            (f"{b}.experts.fc2.weight", w("w2"), "experts_out"),
            (f"{b}.router.score_bias", "", "zeros")]


def from_hf(parts: list[torch.Tensor], kind: str, cfg: ModelConfig) -> torch.Tensor:
    """Mixtral's tensors of one row of :func:`block_rows` -> minitron's stacked tensor."""
    E = cfg.experts
    if kind == "experts_in":  # per expert [unit][gate|up]
        gate, up = parts[:E], parts[E:]
        return torch.stack([torch.stack([g, u], dim=1).reshape(-1, g.shape[1]) for g, u in zip(gate, up)])
    if kind == "experts_out":
        return torch.stack(parts)
    if kind == "zeros":
        return torch.zeros(E, dtype=parts[0].dtype if parts else torch.float32)
    return parts[0]


def to_hf(t: torch.Tensor, kind: str, cfg: ModelConfig) -> list[torch.Tensor]:
    """The inverse of :func:`from_hf`: Mixtral's tensors, in the order of the row's names."""
    if kind == "experts_in":
        pairs = t.reshape(cfg.experts, -1, 2, t.shape[-1])
        return [pairs[e, :, 0] for e in range(cfg.experts)] + [pairs[e, :, 1] for e in range(cfg.experts)]
    if kind == "experts_out":
        return list(t.unbind(0))
    if kind == "zeros":
        return []
    return [t]


def shapes(cfg: ModelConfig, i: int) -> dict[str, tuple]:
    """{Mixtral name: shape} of block i's mixture."""
    h, f, m = cfg.hidden, cfg.moe_ffn_hidden, f"model.layers.{i}.block_sparse_moe"
    out = {f"{m}.gate.weight": (cfg.experts, h)}
    for e in range(cfg.experts):
        out.update({f"{m}.experts.{e}.w1.weight": (f, h), f"{m}.experts.{e}.w3.weight": (f, h),
                    f"{m}.experts.{e}.w2.weight": (h, f)})
    return out


def config_fields(cfg: ModelConfig) -> dict:
    """What a Mixtral `config.json` adds to a Llama one."""
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": cfg.experts,
            "num_experts_per_tok": cfg.top_k, "router_aux_loss_coef": cfg.aux_loss, "router_jitter_noise": 0.0,
            "output_router_logits": False, "sliding_window": None}


def model_fields(c: dict, where) -> dict:
    """The ModelConfig fields of a Mixtral `config.json`'s experts; ConfigError (one line)
    for what minitron does not compute."""
    if c.get("sliding_window"):
        raise ConfigError(f"{where} has sliding_window {c['sliding_window']}: minitron's attention is full causal; "
                          f"set it to null")
    if c.get("router_jitter_noise"):
        raise ConfigError(f"{where} has router_jitter_noise {c['router_jitter_noise']}: minitron's router has no "
                          f"jitter; set it to 0")
    E, k = int(c.get("num_local_experts") or 8), int(c.get("num_experts_per_tok") or 2)
    if not 1 <= k <= E:
        raise ConfigError(f"{where} routes to {k} of {E} experts: num_experts_per_tok must be in 1..num_local_experts")
    aux = c.get("router_aux_loss_coef")
    # transformers' Mixtral renormalises the top-k scores whatever k (a top-1 gate is 1): gate_norm "always"
    return {"experts": E, "top_k": k, "aux_loss": 0.001 if aux is None else float(aux), "gate_norm": "always"}
