"""Text into a :class:`~minitron.data.TokenFile`: `minitron tokenize`.

Trains a byte-level BPE tokenizer (GPT-2 style, Hugging Face `tokenizers`, locally: no
download) on a text source, tokenizes the text once, and writes three files:

* `out.bin` — the ids, flat, uint16 when the vocabulary fits (else uint32);
* `out.json` — the sidecar `load_corpus` reads: dtype, vocabulary, tokenizer file;
* `out.tokenizer.json` — the tokenizer, for decoding samples (and encoding prompts).

Byte-level BPE starts from the 256 byte values, so any UTF-8 text round-trips exactly.
Then `minitron train --data out.bin --vocab N` trains on it like on any corpus.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .config import ConfigError
from .data import read_text_source, sidecar_path

# The largest vocabulary `minitron tokenize` trains: 16x the largest in common use (~256k);
# the tokenizers library aborts in native code when asked for counts near 2^32.
MAX_VOCAB = 1 << 22
CHUNK_LINES = 4096  # lines per encode_batch item: the library encodes items in parallel


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ConfigError("the tokenize command needs the tokenizers package: "
                          "pip install -e .[course] (or pip install tokenizers)") from None
    return tokenizers


def _chunks(text: str) -> list[str]:
    lines = text.splitlines(keepends=True)
    return ["".join(lines[i:i + CHUNK_LINES]) for i in range(0, len(lines), CHUNK_LINES)]


def tokenize(source: str, out_path: str, vocab_size: int = 4096, tokenizer: str = "") -> dict:
    """Train a byte-level BPE of `vocab_size` on `source` (a text file, a folder of .txt,
    or "" for the built-in Shakespeare) and write `out_path` (.bin), its sidecar and tokenizer.
    With `tokenizer` (an existing Hugging Face tokenizer.json, e.g. GPT-2's) encode with it
    instead of training one, so that the ids are those a pretrained model knows.

    Returns {"tokens", "vocab", "bytes", "bytes_per_token", "dtype", "out", "sidecar", "tokenizer"}.
    """
    out = Path(out_path)
    if out.suffix != ".bin":
        raise ConfigError(f"--out {out_path} must end in .bin: e.g. --out {out.with_suffix('.bin')}")
    if not tokenizer and vocab_size < 257:
        raise ConfigError(f"--vocab {vocab_size} must be at least 257 (the 256 byte values and one merge)")
    if not tokenizer and vocab_size > MAX_VOCAB:
        raise ConfigError(f"--vocab {vocab_size} is more than the {MAX_VOCAB:,} trained here (the largest "
                          f"vocabularies in use have about 256,000 tokens; the library aborts far below 2^32): "
                          f"ask for fewer")
    tk = _tokenizers()
    data, _ = read_text_source(source)
    text = data.decode("utf-8")
    chunks = _chunks(text)

    if tokenizer:
        if not Path(tokenizer).is_file():
            raise ConfigError(f"--tokenizer {tokenizer} does not exist: give a tokenizer.json (e.g. GPT-2's)")
        try:
            tok = tk.Tokenizer.from_file(tokenizer)
        except Exception as e:
            raise ConfigError(f"--tokenizer {tokenizer} is not a tokenizer.json ({type(e).__name__})") from None
    else:
        tok = tk.Tokenizer(tk.models.BPE())
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=[],
                                         initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(chunks, trainer=trainer, length=len(chunks))

    vocab = tok.get_vocab_size()  # may be below vocab_size when the text has few merges left
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    ids = np.concatenate([np.asarray(e.ids, dtype=dtype) for e in tok.encode_batch(chunks)]
                         or [np.empty(0, dtype=dtype)])
    out.parent.mkdir(parents=True, exist_ok=True)
    tok_path = out.with_suffix(".tokenizer.json")
    tok.save(str(tok_path))
    ids.tofile(out)
    side = sidecar_path(out)
    side.write_text(json.dumps({"dtype": np.dtype(dtype).name, "vocab": vocab, "tokenizer": tok_path.name,
                                "tokens": int(len(ids)), "source": source or "shakespeare (built-in)"},
                               indent=1) + "\n")
    return {"tokens": int(len(ids)), "vocab": vocab, "bytes": len(data),
            "bytes_per_token": len(data) / max(1, len(ids)), "dtype": np.dtype(dtype).name,
            "out": str(out), "sidecar": str(side), "tokenizer": str(tok_path)}
