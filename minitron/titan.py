"""torchtitan's Llama 3 checkpoints in and out (``torch.distributed.checkpoint``).

torchtitan's checkpointer writes a model's weights with DCP under the module's own
state-dict keys (``tok_embeddings.weight``, ``layers.3.attention.qkv_linear.wq.weight``,
...; its fused QKV projection saves as the stock wq / wk / wv). Those keys name the same
tensors as Hugging Face's Llama, so the one table below maps torchtitan's names onto
Hugging Face's, and ``hf.py``'s Llama mapping (the one home of how minitron joins q, k, v
and the SwiGLU rows) does the rest. One storage difference, of the model's rotary
convention: torchtitan rotates neighbouring dimensions (2i, 2i + 1) as complex numbers
(Meta's original Llama), Hugging Face and minitron rotate i with i + d/2 (``model.rotate``),
so wq's and wk's rows are permuted within each head exactly as transformers' Llama
conversion script does (torchtitan's own ``Llama3StateDictAdapter`` does the same).

A torchtitan checkpoint's other entries (optimizer, lr scheduler, data loader, train
state) are not read: only the model's keys are loaded, each checked for its shape.
tests/test_titan.py checks logits both ways against torchtitan's Llama 3 model.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from . import dcp_format, hf
from .config import LLAMA, ConfigError, ModelConfig

# torchtitan's Llama 3 state-dict key -> Hugging Face Llama's ({} is the block's index)
TITAN_TO_HF = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.attention.qkv_linear.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.qkv_linear.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.qkv_linear.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
ROTATED = {"wq": "heads", "wk": "n_kv_heads"}  # rows paired by the rotary embedding, and their head count
# the engine's fields torchtitan's Llama 3 has no counterpart of (hf.py's families and mixtures have)
NOT_HELD = ("experts", "qkv_bias", "qk_norm", "window", "head_width", "mtp_depths")


def problem(cfg: ModelConfig) -> str:
    """'' when torchtitan's Llama 3 holds all of model `cfg`, else what it does not."""
    said = hf.export_problem(cfg) if hf.is_llama(cfg) else "it has learned positions (a GPT-2)"
    if said:
        return f"not a Llama: {said}"
    extra = [f"{f} {getattr(cfg, f)}" for f in NOT_HELD if getattr(cfg, f)]
    extra += [f"rope scaling {cfg.rope_scaling}"] if cfg.rope_scaling not in ("", "llama3") else []
    return f"torchtitan's Llama 3 has no {', '.join(extra)}" if extra else ""


def _check(cfg: ModelConfig) -> None:
    said = problem(cfg)
    if said:
        raise ConfigError(f"model {cfg.name} cannot be read or written as torchtitan's Llama 3: {said}")


def names(cfg: ModelConfig) -> dict[str, str]:
    """{torchtitan key: Hugging Face name} of every tensor of Llama `cfg` (a tied model's
    ``lm_head.weight`` is its embedding, so it is not a tensor of its own)."""
    out = {}
    for titan, theirs in TITAN_TO_HF.items():
        for i in range(cfg.layers) if "{}" in titan else [None]:
            out[titan.format(i)] = theirs.format(i)
    if cfg.tied_embeddings:
        del out["lm_head.weight"]
    return out


def _heads(key: str, cfg: ModelConfig) -> int | None:
    """The head count of a rotated projection's key (wq, wk), else None."""
    kind = key.rsplit(".", 2)[-2]
    return getattr(cfg, ROTATED[kind]) if kind in ROTATED else None


def _to_half_split(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows [head][pair i][2] (torchtitan, neighbours rotated) -> [head][2][i] (rotate-half)."""
    return w.reshape(heads, -1, 2, w.shape[1]).transpose(1, 2).reshape(w.shape)


def _to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of :func:`_to_half_split`."""
    return w.reshape(heads, 2, -1, w.shape[1]).transpose(1, 2).reshape(w.shape)


def from_titan(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """torchtitan's Llama 3 state dict -> minitron's full tensors {name: tensor}."""
    _check(cfg)
    theirs = {}
    for key, hf_name in names(cfg).items():
        heads = _heads(key, cfg)
        theirs[hf_name] = state[key] if heads is None else _to_half_split(state[key], heads)
    return hf.from_hf(theirs, cfg)


def to_titan(full: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """minitron's full tensors -> torchtitan's Llama 3 state dict (a tied model's
    ``lm_head.weight`` is the embedding, as torchtitan's tied module holds it)."""
    _check(cfg)
    theirs = hf.to_hf(full, cfg)
    out = {}
    for key, hf_name in names(cfg).items():
        heads = _heads(key, cfg)
        out[key] = theirs[hf_name] if heads is None else _to_pairs(theirs[hf_name], heads).contiguous()
    if cfg.tied_embeddings:
        out["lm_head.weight"] = out["tok_embeddings.weight"]
    return out


def model_config(titan_cfg, seq_len: int) -> ModelConfig:
    """The minitron ModelConfig of torchtitan's ``Llama3Model.Config`` (read by attribute, so
    the engine does not import torchtitan), with a context of `seq_len`."""
    attn, rope = titan_cfg.layers[0].attention, titan_cfg.layers[0].attention.rope
    if rope.scaling not in ("none", "llama"):
        raise ConfigError(f"torchtitan rope scaling '{rope.scaling}' is not read here: use 'none' or 'llama'")
    scaling = {} if rope.scaling == "none" else dict(  # Llama 3.1's, as hf_families.ROPE_KINDS["llama3"]
        rope_scaling="llama3", rope_factor=rope.scaling_factor, rope_low_freq=rope.low_freq_factor,
        rope_high_freq=rope.high_freq_factor, rope_original_context=rope.original_max_position_embeddings)
    if attn.qk_norm is not None or attn.head_dim not in (None, titan_cfg.dim // attn.n_heads):
        raise ConfigError("torchtitan's q/k norms and a head_dim other than dim / n_heads are not read here: "
                          "use a plain Llama 3 config")
    kv = attn.n_kv_heads or attn.n_heads
    return ModelConfig(layers=len(titan_cfg.layers), hidden=titan_cfg.dim, heads=attn.n_heads,
                       kv_heads=0 if kv == attn.n_heads else kv, seq_len=seq_len, vocab=titan_cfg.vocab_size,
                       ffn=titan_cfg.layers[0].feed_forward.w1.out_features,
                       norm_eps=titan_cfg.norm.eps, rope_base=float(rope.theta), name="llama3-torchtitan",
                       **scaling, **{**LLAMA, "tied_embeddings": titan_cfg.enable_weight_tying})


def load_dcp(path: str | Path, cfg: ModelConfig) -> dict[str, dict]:
    """The model weights of torchtitan DCP checkpoint folder `path` as minitron's full
    tensors, in ``checkpoint.assemble``'s form {name: {"param": T}} (ready for
    ``checkpoint.import_state`` into any layout). Each key is checked for presence and
    shape first (one line naming the first that differs); its other entries are not read."""
    _check(cfg)
    md = dcp_format.read_metadata(Path(path))
    held = md.state_dict_metadata
    shapes = hf.llama_shapes(cfg)
    state = {}
    for key, hf_name in names(cfg).items():
        if key not in held:
            raise ConfigError(f"{path} holds no '{key}': not a torchtitan Llama 3 checkpoint of this model "
                              f"({cfg.layers} layers); check the folder and the model's size")
        size = tuple(getattr(held[key], "size", ()))
        if size != tuple(shapes[hf_name]):
            raise ConfigError(f"{path}: '{key}' is {list(size)}, the model needs {list(shapes[hf_name])}: "
                              f"check the model's size")
        state[key] = torch.empty(size, dtype=held[key].properties.dtype)
    with warnings.catch_warnings():  # one process: DCP warns that no process group is used
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    return {name: {"param": t} for name, t in from_titan(state, cfg).items()}


def save_dcp(path: str | Path, full: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Write minitron's full tensors {name: tensor} to folder `path` as torchtitan's
    checkpointer writes model weights: DCP, torchtitan's keys (one process)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(to_titan(full, cfg), storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
