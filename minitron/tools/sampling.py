"""`minitron sample`: text from a trained model, whatever layout trained it.

A minitron checkpoint is layout-independent (every rank's shards carry their place in
the full tensor), so the shards of dp2·tp2·pp2 assemble into the single-device GPT as
readily as those of one process; a GPT-2 directory (Hugging Face format) loads the same
way. The text is encoded and decoded with, in this order: `--tokenizer FILE` (a Hugging
Face `tokenizer.json`), the tokenizer of a token file given with `--data`, the
`tokenizer.json` inside the GPT-2 directory, or bytes (the built-in corpus' tokens).
"""
from __future__ import annotations

from pathlib import Path

from ..config import ConfigError, ModelConfig, TrainConfig
from ..data import ByteCorpus, TokenFile, load_corpus


# Tokens one `minitron sample` generates: a long text, not a typo's hours of forward passes.
MAX_TOKENS = 100_000


class TokenizerCodec:
    """encode/decode through a Hugging Face `tokenizer.json` (the `tokenizers` package)."""

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError("a tokenizer.json needs the tokenizers package: pip install tokenizers") from None
        if not Path(path).is_file():
            raise ConfigError(f"--tokenizer {path} does not exist: give a tokenizer.json")
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:
            raise ConfigError(f"--tokenizer {path} is not a tokenizer.json ({type(e).__name__})") from None
        self.vocab = self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


def model_from_checkpoint(ckpt: str) -> tuple[ModelConfig, dict, int]:
    """(model config, full weights {name: {"param": T}}, seed) of a checkpoint folder, or of
    the newest checkpoint of a --ckpt-dir."""
    from ..checkpoint import check, latest, load_full, model_from_record

    path = Path(ckpt)
    if not (path / "meta.json").exists():
        if not path.is_dir():
            raise ConfigError(f"--ckpt-dir {ckpt} does not exist: give the folder `minitron train --ckpt-dir` wrote")
        path = latest(ckpt)
        if path is None:
            raise ConfigError(f"--ckpt-dir {ckpt} holds no checkpoint (no 'latest'): train with --ckpt-dir {ckpt} first")
    meta = check(path)
    try:
        cfg = model_from_record(meta["model"])
    except (TypeError, ValueError) as e:
        raise ConfigError(f"checkpoint {path}'s model description is not valid ({e}): it was edited; "
                          f"use another checkpoint") from None
    return cfg, load_full(path), int(meta.get("seed", 1234))


def load_model(ckpt_dir: str = "", init_from: str = "", dtype: str = "float32"):
    """The single-device GPT of a minitron checkpoint or of a GPT-2 directory, and its config."""
    from ..train import single_device_model

    if bool(ckpt_dir) == bool(init_from):
        raise ConfigError("give the weights to sample from: --ckpt-dir DIR (minitron) or --init-from DIR (GPT-2)")
    if init_from:
        from ..hf import check_values, load_full, model_config

        cfg = model_config(init_from)
        full, seed = load_full(init_from, cfg), 1234
        check_values(init_from, cfg)
    else:
        cfg, full, seed = model_from_checkpoint(ckpt_dir)
    return single_device_model(cfg, full, TrainConfig(dtype=dtype, seed=seed)), cfg


def codec_for(cfg: ModelConfig, tokenizer: str = "", data: str = "", init_from: str = ""):
    """The encoder/decoder of the text (see the module's docstring for the order); its
    vocabulary must be the model's."""
    if tokenizer:
        codec = TokenizerCodec(tokenizer)
    elif data:
        codec = load_corpus(data)
        if isinstance(codec, TokenFile) and not codec.tokenizer:
            raise ConfigError(f"--data {data} has no tokenizer beside it: give --tokenizer tokenizer.json")
    elif init_from and (Path(init_from) / "tokenizer.json").is_file():
        codec = TokenizerCodec(str(Path(init_from) / "tokenizer.json"))
    else:
        codec = ByteCorpus
        if cfg.vocab != ByteCorpus.vocab:  # a model of subword tokens: bytes would be noise
            raise ConfigError(f"the model's vocabulary is {cfg.vocab}, not bytes (256): give the tokenizer it "
                              f"was trained with (--data TOKENS.bin or --tokenizer tokenizer.json)")
    if codec.vocab > cfg.vocab:
        raise ConfigError(f"the tokenizer has {codec.vocab} tokens but the model's vocabulary is {cfg.vocab}: "
                          f"give the tokenizer the model was trained with (--tokenizer or --data)")
    return codec


def sample_text(args) -> str:
    """`minitron sample`'s text: load, check, generate (all before printing anything)."""
    from ..train import sample

    if not args.temperature > 0 or args.temperature == float("inf"):
        raise ConfigError(f"--temperature must be a positive finite number (got {args.temperature})")
    if args.top_k < 1 or args.tokens < 1:
        raise ConfigError("--top-k and --tokens must be at least 1")
    if args.tokens > MAX_TOKENS:
        raise ConfigError(f"--tokens {args.tokens} is more than the {MAX_TOKENS:,} sampled here (one forward pass per "
                          f"token: hours on a CPU): ask for fewer, or sample several times")
    gpt, cfg = load_model(args.ckpt_dir, args.init_from, args.dtype)
    codec = codec_for(cfg, args.tokenizer, args.data, args.init_from)
    text = sample(gpt, args.prompt, args.tokens, args.seed, codec, args.temperature, args.top_k)
    if text is None:
        raise ConfigError("the prompt encodes to no tokens: give a non-empty --prompt")
    return text
