"""The Llama-shaped mixtures of experts transformers ships, each a row of :data:`MOE_FAMILIES`
(what its MoE block is called, its experts' names, the engine knobs it fixes): Mixtral (Jiang
et al. 2024; ``MixtralForCausalLM``), Qwen2-MoE (``Qwen2MoeForCausalLM``) and OLMoE
(Muennighoff et al. 2024; ``OlmoeForCausalLM``). ``hf.py`` reads and writes the Llama part;
this module holds what the experts add.

* **Mixtral**: every MLP a mixture of E SwiGLU experts, top-k with the softmax over the
  chosen k (transformers renormalises the top-k scores whatever k: ``gate_norm`` "always").
  Its blocks are exactly the Llama blocks with the MLP swapped (no shared expert, no q/k
  norm, no grouped routing): every difference from a dense Llama is the MoE itself.
* **Qwen2-MoE**: Qwen2's q/k/v biases (its config's ``qkv_bias``); a softmax router whose
  top-k probabilities are renormalised only with ``norm_topk_prob`` (false by default:
  ``gate_norm`` "never"); one shared expert of its own width
  (``shared_expert_intermediate_size``: ``shared_ffn``) whose output is scaled by
  ``sigmoid(shared_expert_gate(x))`` (``shared_gate``); MoE blocks every
  ``decoder_sparse_step`` (``moe_every``) except ``mlp_only_layers`` (``dense_blocks``),
  whose dense MLP is ``intermediate_size`` wide, the experts ``moe_intermediate_size``.
* **OLMoE**: RMSNorm of q and k over the whole projection, heads·d and kv·d features
  (``qk_norm_span`` "all", not Qwen3's per head), before the rotation; softmax top-k
  without renormalisation by default; every block a MoE of ``intermediate_size`` experts.

On disk a MoE block ``model.layers.i.<block>`` has the router ``gate.weight`` [E, h] and per
expert e its gate, up and down projections (Mixtral's original ``w1``, ``w3``, ``w2``, which
``save_pretrained`` still writes; ``gate_proj``, ``up_proj``, ``down_proj`` for the others);
minitron stacks them: ``experts.fc.weight`` [E, 2f, h] with gate and up rows interleaved
[unit][gate|up] (the dense MLP's layout) and ``experts.fc2.weight`` [E, h, f]. Qwen2-MoE's
``shared_expert`` is minitron's ``shared`` MLP (gate and up interleaved likewise) and its
``shared_expert_gate.weight`` [1, h] the ``shared_gate``. None of them has a selection
bias: it is loaded as zeros and not written.

``transformers`` takes these routers' softmax and the RMSNorms in float32 whatever the
model's dtype (guards for bf16): minitron computes them in the model's dtype, so a float64
``transformers`` model agrees with minitron to float32's rounding (about 1e-8 here); with
those modules computing in float64 it agrees to 1e-9 (``tests/test_moe.py``,
``tests/test_hf_moe_families.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ConfigError, ModelConfig


@dataclass(frozen=True)
class MoeFamily:
    """A Llama-shaped MoE family: its class, its MoE block's module name, one expert's
    (gate, up, down) names, its shared expert's module ("" none), and the engine fields
    it fixes ({field: value}; a model with another value is not of the family)."""
    architecture: str
    block: str
    leaves: tuple
    shared: str
    fixed: dict


_ROUTED = {"router": "softmax", "bias_update": 0.0, "capacity_factor": 0.0}
MOE_FAMILIES = {
    "mixtral": MoeFamily("MixtralForCausalLM", "block_sparse_moe", ("w1", "w3", "w2"), "",
                         {**_ROUTED, "moe_every": 1, "dense_blocks": "", "shared_experts": 0, "moe_ffn": 0,
                          "qkv_bias": False, "qk_norm": False}),
    "qwen2_moe": MoeFamily("Qwen2MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), "shared_expert",
                           {**_ROUTED, "shared_experts": 1, "shared_gate": True, "qk_norm": False, "head_width": 0,
                            "window": 0}),
    "olmoe": MoeFamily("OlmoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), "",
                       {**_ROUTED, "moe_every": 1, "dense_blocks": "", "shared_experts": 0, "moe_ffn": 0,
                        "qkv_bias": False, "qk_norm": True, "qk_norm_span": "all", "head_width": 0, "window": 0}),
}
MOE_TYPES = tuple(MOE_FAMILIES)
# the knob that tells each family apart from Mixtral's plain mixture (a model holds at most one)
FAMILY_KNOBS = {"qwen2_moe": "shared_gate", "olmoe": "qk_norm"}


def family_of(cfg: ModelConfig) -> str | None:
    """The model_type of the MoE family `cfg`'s telling knob names (Mixtral without one), or
    None when it holds two families' knobs."""
    held = [t for t, knob in FAMILY_KNOBS.items() if getattr(cfg, knob)]
    return None if len(held) > 1 else (held[0] if held else "mixtral")


def moe_problem(cfg: ModelConfig) -> str:
    """'' when one MoE family's format holds `cfg`'s experts, else the reason (one line)."""
    kind = family_of(cfg)
    if kind is None:
        each = ", ".join(f"{t} {k}" for t, k in FAMILY_KNOBS.items())
        return f"no Hugging Face MoE family has {' and '.join(FAMILY_KNOBS.values())} together (each holds one: {each})"
    fam = MOE_FAMILIES[kind]
    said = lambda k, v: f"{k} {v if v != '' else repr(v)}"  # noqa: E731 (an empty text shows as '')
    bad = [said(k, getattr(cfg, k)) for k, v in fam.fixed.items() if getattr(cfg, k) != v]
    bad += ["gate_norm never"] if kind == "mixtral" and cfg.gate_norm == "never" else []
    if bad:
        return f"{fam.architecture} holds {', '.join(said(k, v) for k, v in fam.fixed.items())}, not {', '.join(bad)}"
    if cfg.top_k == 1 and cfg.gate_norm == "auto" and kind == "mixtral":
        return ("Mixtral renormalises the top-k scores, so its top-1 gate is 1, and this model's is the softmax "
                "score (gate_norm auto): train it with --gate-norm always")
    if cfg.top_k == 1 and cfg.gate_norm == "auto":  # norm_topk_prob says which: 1, or the softmax score
        return (f"{fam.architecture}'s top-1 gate is 1 (norm_topk_prob) or the softmax score, and this model's "
                f"is chosen by gate_norm auto: train it with --gate-norm always or never")
    return ""


def block_rows(cfg: ModelConfig, i: int) -> list[tuple[str, str, str]]:
    """(minitron name, the family's names, kind) of block i's mixture: the router ('copy'),
    the experts' gate and up ('experts_in': every gate, then every up), down ('experts_out'),
    the shared expert's gate and up ('swiglu') and down, its gate ('copy'), and the
    selection bias ('zeros': in no family's files)."""
    fam = MOE_FAMILIES[family_of(cfg)]
    b, m = f"blocks.{i}.mlp", f"model.layers.{i}.{fam.block}"
    gate, up, down = fam.leaves
    w = lambda k: ",".join(f"{m}.experts.{e}.{k}.weight" for e in range(cfg.experts))  # noqa: E731
    rows = [(f"{b}.router.weight", f"{m}.gate.weight", "copy"),
            (f"{b}.experts.fc.weight", w(gate) + "," + w(up), "experts_in"),
            (f"{b}.experts.fc2.weight", w(down), "experts_out"),
            (f"{b}.router.score_bias", "", "zeros")]
    if fam.shared:
        s = f"{m}.{fam.shared}"
        rows += [(f"{b}.shared.fc.weight", f"{s}.gate_proj.weight,{s}.up_proj.weight", "swiglu"),
                 (f"{b}.shared.fc2.weight", f"{s}.down_proj.weight", "copy"),
                 (f"{b}.shared_gate.weight", f"{m}.shared_expert_gate.weight", "copy")]
    return rows


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[f, h] gate and up rows -> [2f, h] rows [unit][gate|up] (minitron's SwiGLU ``fc``)."""
    return torch.stack([gate, up], dim=1).reshape(-1, gate.shape[1])


def from_hf(parts: list[torch.Tensor], kind: str, cfg: ModelConfig) -> torch.Tensor:
    """The family's tensors of one row of :func:`block_rows` -> minitron's (stacked) tensor."""
    E = cfg.experts
    if kind == "experts_in":  # per expert [unit][gate|up]
        return torch.stack([_interleave(g, u) for g, u in zip(parts[:E], parts[E:])])
    if kind == "swiglu":
        return _interleave(*parts)
    if kind == "experts_out":
        return torch.stack(parts)
    if kind == "zeros":
        return torch.zeros(E, dtype=parts[0].dtype if parts else torch.float32)
    return parts[0]


def to_hf(t: torch.Tensor, kind: str, cfg: ModelConfig) -> list[torch.Tensor]:
    """The inverse of :func:`from_hf`: the family's tensors, in the order of the row's names."""
    if kind in ("experts_in", "swiglu"):
        pairs = t.reshape(-1, t.shape[-2] // 2, 2, t.shape[-1])  # [experts (1 for swiglu)][unit][gate|up][h]
        return [p[:, 0] for p in pairs] + [p[:, 1] for p in pairs]
    if kind == "experts_out":
        return list(t.unbind(0))
    if kind == "zeros":
        return []
    return [t]


def shapes(cfg: ModelConfig, i: int) -> dict[str, tuple]:
    """{the family's name: shape} of block i's mixture (:func:`block_rows`' tensors)."""
    fam = MOE_FAMILIES[family_of(cfg)]
    h, f, m = cfg.hidden, cfg.moe_ffn_hidden, f"model.layers.{i}.{fam.block}"
    gate, up, down = fam.leaves
    out = {f"{m}.gate.weight": (cfg.experts, h)}
    for e in range(cfg.experts):
        out.update({f"{m}.experts.{e}.{gate}.weight": (f, h), f"{m}.experts.{e}.{up}.weight": (f, h),
                    f"{m}.experts.{e}.{down}.weight": (h, f)})
    if fam.shared:
        fs, sh = cfg.shared_ffn_hidden, f"{m}.{fam.shared}"
        out.update({f"{sh}.gate_proj.weight": (fs, h), f"{sh}.up_proj.weight": (fs, h),
                    f"{sh}.down_proj.weight": (h, fs), f"{m}.shared_expert_gate.weight": (1, h)})
    return out


def config_fields(cfg: ModelConfig) -> dict:
    """What the family's `config.json` adds to (or changes in) a Llama one."""
    kind = family_of(cfg)
    out = {"architectures": [MOE_FAMILIES[kind].architecture], "model_type": kind, "num_experts_per_tok": cfg.top_k,
           "router_aux_loss_coef": cfg.aux_loss, "output_router_logits": False}
    if kind == "mixtral":
        return {**out, "num_local_experts": cfg.experts, "router_jitter_noise": 0.0, "sliding_window": None}
    out.update(num_experts=cfg.experts, norm_topk_prob=cfg.gate_norm == "always" or (
        cfg.gate_norm == "auto" and cfg.top_k > 1))
    if kind == "olmoe":  # its experts are intermediate_size wide; it has no other MLP
        return {**out, "intermediate_size": cfg.moe_ffn_hidden, "attention_bias": False, "clip_qkv": None}
    return {**out, "qkv_bias": cfg.qkv_bias, "moe_intermediate_size": cfg.moe_ffn_hidden,
            "shared_expert_intermediate_size": cfg.shared_ffn_hidden, "decoder_sparse_step": cfg.moe_every,
            "mlp_only_layers": list(cfg.dense_block_ids), "use_sliding_window": False, "sliding_window": None}


def model_fields(c: dict, where) -> dict:
    """The ModelConfig fields of a MoE family's `config.json` beyond Llama's; ConfigError
    (one line) for what minitron does not compute."""
    kind = c.get("model_type")
    refusals = [
        (c.get("sliding_window") and kind == "mixtral", f"sliding_window {c.get('sliding_window')}",
         "minitron's attention is full causal; set it to null"),
        (c.get("use_sliding_window"), "use_sliding_window", "minitron loads its full attention only; set it to false"),
        (c.get("router_jitter_noise"), f"router_jitter_noise {c.get('router_jitter_noise')}",
         "minitron's router has no jitter; set it to 0"),
        (c.get("clip_qkv") is not None, f"clip_qkv {c.get('clip_qkv')}",
         "minitron does not clip q, k, v; set it to null"),
    ]
    for bad, what, fix in refusals:
        if bad:
            raise ConfigError(f"{where} has {what}: {fix}")
    E = int(c.get("num_local_experts") or c.get("num_experts") or 8)
    k = int(c.get("num_experts_per_tok") or 2)
    if not 1 <= k <= E:
        raise ConfigError(f"{where} routes to {k} of {E} experts: num_experts_per_tok must be in 1..{E} (the experts)")
    aux = c.get("router_aux_loss_coef")
    out = {"experts": E, "top_k": k, "aux_loss": 0.001 if aux is None else float(aux)}
    if kind == "mixtral":  # transformers renormalises the top-k scores whatever k (a top-1 gate is 1)
        return {**out, "gate_norm": "always"}
    out["gate_norm"] = "always" if c.get("norm_topk_prob") else "never"
    if kind == "olmoe":
        return {**out, "qk_norm": True, "qk_norm_span": "all"}
    mlp_only = c.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in mlp_only):
        raise ConfigError(f"{where} has mlp_only_layers {mlp_only!r}: it must be a list of layer indices")
    for field in ("moe_intermediate_size", "shared_expert_intermediate_size", "decoder_sparse_step"):
        if not isinstance(c.get(field), int) or isinstance(c.get(field), bool) or c[field] <= 0:
            raise ConfigError(f"{where} has {field} = {c.get(field)!r}: it must be a positive integer; save it again")
    return {**out, "qkv_bias": c.get("qkv_bias", True) is not False, "moe_ffn": c["moe_intermediate_size"],
            "shared_experts": 1, "shared_ffn": c["shared_expert_intermediate_size"], "shared_gate": True,
            "moe_every": c["decoder_sparse_step"], "dense_blocks": ",".join(str(i) for i in sorted(set(mlp_only)))}
