"""GPT-2 checkpoints in the Hugging Face format, in and out.

minitron's GPT is GPT-2's architecture, so its weights map one to one onto
`transformers.GPT2LMHeadModel`'s; a directory with `config.json` and `model.safetensors`
is all either side needs. Three differences of storage, none of the model:

* GPT-2's linears are `Conv1D` modules whose weight is stored [in, out], the transpose
  of `nn.Linear`'s [out, in] that minitron keeps;
* GPT-2's `c_attn` lays its 3h outputs out as [q | k | v], each h wide and split into
  heads inside; minitron's QKV rows are head-major, [head][q|k|v][head_dim], so that a
  tensor-parallel rank's contiguous slice holds whole heads;
* the names (`transformer.h.3.mlp.c_fc` is minitron's `blocks.3.mlp.fc`).

Loading returns full tensors under minitron's layout-independent names, the form a
checkpoint is assembled into (`checkpoint.assemble`), so `checkpoint.import_state` slices
them for any layout — tensor, pipeline, cube — exactly as it does a minitron checkpoint.
Nothing is downloaded: the directory must be on disk.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .config import ConfigError, ModelConfig

CONFIG, WEIGHTS = "config.json", "model.safetensors"
# GPT-2's activation names -> minitron's (the exact erf GeLU, or its tanh approximation)
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
LAYER_NORM_EPS = 1e-5  # minitron's LayerNorm epsilon (parallel/tensor.py, parallel/cube.py)


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise ConfigError("Hugging Face checkpoints need the safetensors package: "
                          "pip install safetensors (or pip install -e .[test])") from None
    return safetensors.torch


# --- names and layouts ----------------------------------------------------------------
def name_map(cfg: ModelConfig) -> list[tuple[str, str, str]]:
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


def to_hf(full: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """minitron's full tensors {name: tensor} -> GPT-2's state dict."""
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
    """GPT-2's state dict -> minitron's full tensors (positions cut to cfg.seq_len)."""
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
    """A GPT-2 `config.json` for minitron model `cfg`."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": cfg.vocab, "n_positions": cfg.seq_len, "n_embd": cfg.hidden,
            "n_layer": cfg.layers, "n_head": cfg.heads, "n_inner": cfg.ffn_hidden,
            "activation_function": {"gelu": "gelu", "gelu_tanh": "gelu_new"}[cfg.activation],
            "layer_norm_epsilon": LAYER_NORM_EPS, "tie_word_embeddings": cfg.tied_embeddings,
            "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "initializer_range": 0.02,
            "bos_token_id": None, "eos_token_id": None, "dtype": str(dtype).removeprefix("torch.")}


def read_config(hf_dir: str) -> dict:
    """`config.json` of a GPT-2 directory, checked; ConfigError (one line) otherwise."""
    d = Path(hf_dir)
    if not d.is_dir():
        raise ConfigError(f"--init-from {hf_dir} is not a directory: give a folder with {CONFIG} and {WEIGHTS}")
    for f in (CONFIG, WEIGHTS):
        if not (d / f).is_file():
            raise ConfigError(f"--init-from {hf_dir} has no {f}: save the model there with "
                              f"save_pretrained (safetensors) or `minitron export --hf {hf_dir}`")
    try:
        c = json.loads((d / CONFIG).read_text())
    except json.JSONDecodeError:
        raise ConfigError(f"{d / CONFIG} is not valid JSON: save the model again") from None
    arch = c.get("model_type")
    if arch != "gpt2":
        raise ConfigError(f"{d / CONFIG} is a '{arch}' model: minitron loads GPT-2 (model_type gpt2) checkpoints only")
    act = c.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise ConfigError(f"{d / CONFIG} uses activation '{act}': minitron has {', '.join(ACTIVATIONS)}")
    eps = c.get("layer_norm_epsilon", 1e-5)
    if abs(eps - LAYER_NORM_EPS) > 1e-12:
        raise ConfigError(f"{d / CONFIG} has layer_norm_epsilon {eps}: minitron's LayerNorm uses {LAYER_NORM_EPS}")
    if c.get("scale_attn_by_inverse_layer_idx") or not c.get("scale_attn_weights", True) or c.get("add_cross_attention"):
        raise ConfigError(f"{d / CONFIG} changes GPT-2's attention (scale_attn_* / add_cross_attention): "
                          f"minitron has only the standard 1/sqrt(d) causal self-attention")
    return c


def model_config(hf_dir: str, seq_len: int | None = None, dropout: float | None = None) -> ModelConfig:
    """The minitron ModelConfig of a GPT-2 directory; `seq_len` may shorten the context."""
    c = read_config(hf_dir)
    n_pos = int(c.get("n_positions", 1024))
    if seq_len is not None and not 0 < seq_len <= n_pos:
        raise ConfigError(f"--seq-len {seq_len} exceeds the checkpoint's {n_pos} positions: use {n_pos} or less")
    h = int(c["n_embd"])
    return ModelConfig(layers=int(c["n_layer"]), hidden=h, heads=int(c["n_head"]), seq_len=seq_len or n_pos,
                       vocab=int(c["vocab_size"]), ffn=int(c.get("n_inner") or 4 * h),
                       tied_embeddings=bool(c.get("tie_word_embeddings", True)),
                       dropout=dropout or 0.0, activation=ACTIVATIONS[c.get("activation_function", "gelu_new")],
                       name=Path(hf_dir).name or "gpt2")


def check_model(hf_dir: str, cfg: ModelConfig) -> None:
    """Raise ConfigError unless model `cfg` is the one stored in `hf_dir` (same shapes)."""
    stored = model_config(hf_dir, cfg.seq_len, cfg.dropout)
    for k in ("layers", "hidden", "heads", "vocab", "ffn_hidden", "tied_embeddings", "activation"):
        if getattr(stored, k) != getattr(cfg, k):
            raise ConfigError(f"--init-from {hf_dir} holds a model with {k} {getattr(stored, k)}, "
                              f"not {getattr(cfg, k)}: drop the model flags and let the checkpoint decide")


def _stored_name(name: str, names) -> str:
    """GPT-2's original files name tensors without the "transformer." prefix ("h.0.ln_1.weight")."""
    return name if name in names or name.startswith("lm_head.") else name.removeprefix("transformer.")


def check_weights(hf_dir: str, cfg: ModelConfig) -> None:
    """Every tensor model `cfg` needs is in `hf_dir`'s safetensors with the right shape;
    reads only the file's header, so it is cheap before any rank starts."""
    from safetensors import safe_open

    _safetensors()
    path = Path(hf_dir) / WEIGHTS
    try:
        with safe_open(str(path), "pt") as f:
            names = set(f.keys())
            shapes = {n: tuple(f.get_slice(n).get_shape()) for n in names}
    except Exception as e:  # truncated file, not safetensors, ...
        raise ConfigError(f"{path} cannot be read ({type(e).__name__}): save the model again") from None
    for mine, theirs, kind in name_map(cfg):
        stored = _stored_name(theirs, names)
        if stored not in names:
            raise ConfigError(f"{path} has no tensor '{theirs}': it is not a GPT-2 of its config.json "
                              f"(layers {cfg.layers}, tied {cfg.tied_embeddings}); save it again")
        got, want = shapes[stored], _hf_shape(mine, kind, cfg)
        if mine == "wpe.weight":
            got = (min(got[0], cfg.seq_len),) + got[1:]  # more positions than used is fine
        if got != want:
            raise ConfigError(f"{path}: '{theirs}' has shape {list(shapes[stored])}, config.json implies "
                              f"{list(want)}: the weights and the config do not belong together")


def load_full(hf_dir: str, cfg: ModelConfig) -> dict[str, dict]:
    """The GPT-2 weights of `hf_dir` as full minitron tensors, in `checkpoint.assemble`'s
    form {name: {"param": tensor}}, ready for `checkpoint.import_state` into any layout."""
    check_weights(hf_dir, cfg)
    state = _safetensors().load_file(str(Path(hf_dir) / WEIGHTS))
    state = {theirs: state[_stored_name(theirs, state)] for _, theirs, _ in name_map(cfg)}
    return {k: {"param": v} for k, v in from_hf(state, cfg).items()}


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
    Returns {"dir", "tensors", "params", "dtype"}."""
    d = Path(hf_dir)
    d.mkdir(parents=True, exist_ok=True)
    state = to_hf(full, cfg)
    dtype = next(iter(state.values())).dtype
    _safetensors().save_file(state, str(d / WEIGHTS), metadata={"format": "pt"})
    (d / CONFIG).write_text(json.dumps(hf_config(cfg, dtype), indent=1) + "\n")
    return {"dir": str(d), "tensors": len(state), "params": sum(t.numel() for t in state.values()),
            "dtype": str(dtype).removeprefix("torch.")}
