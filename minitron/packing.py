"""Packed documents and the document mask (``--pack``).

Pre-training packs whole documents into each sequence instead of cutting windows out of
one endless stream, and keeps the documents apart: Llama 3 (Dubey et al. 2024, §3.2) "use[s]
an attention mask that prevents self-attention between different documents within the same
sequence"; Megatron-LM spells it ``--reset-position-ids`` (positions restart with each
document), ``--reset-attention-mask`` (a token attends only to the earlier tokens of its own
document: the mask is block-diagonal causal) and ``--eod-mask-loss`` (no loss on predicting
the first token of the next document from the separator).

The corpus defines its document separator: byte 0x1E (ASCII's *record separator*) in a
byte corpus, the tokenizer's ``<|endoftext|>`` in a token file. A document is its tokens and the separator that ends it. A packed sequence starts at
a document's first token (drawn by (seed, step), like ``data.batch``'s windows) and runs on
through the documents after it; the last one is cut where the sequence ends (Megatron's
GPTDataset cuts its samples the same way), so no token is padding.

For the microbatch rows [b, s] the :class:`Documents` value holds, per token, its document
(``segments``), its position in it (``positions``) and its weight in the loss
(``loss_weight``: 0 on the separator, whose target is the next document's first token).
The loss is the mean over the *global batch's* counted tokens, as one device averages it:
each token's weight is T/N (T tokens in the global batch, N of them counted), the same on
every rank, so each rank's mean over its own tokens, times the weights, sums (over the data
and context ranks' average and the microbatches' 1/m) to the single device's mean. Every
rank counts N itself from the global batch's token ids: no communication.

The value is what travels with a microbatch (through the pipeline's stages too: every
stage reads its own copy, as Megatron's ``get_batch`` hands each stage the mask and
positions). Attention reads it: one device and the all-to-all build the dense mask
(:meth:`Documents.visible`); the ring asks, per pair of sequence chunks, whether the
documents leave the pair empty, whole or partly masked (:meth:`Documents.pair_kind`), and
passes only the chunks that some later query still sees.

Balanced per document (``--pack-balance document``). Context parallelism's chunks r and
2N−1−r of the whole sequence balance a causal mask over one stream, not over documents: a
rank whose chunks fall in short documents attends to few keys. Megatron-Core balances packed
(THD) batches per document instead: each document is padded to a multiple of 2N and rank r
takes chunks r and 2N−1−r of *every* document (``get_batch_on_this_cp_rank`` with
``cu_seqlens``, through Transformer Engine's ``thd_get_partitioned_indices``; the padding from
``pad_to_multiple_of = 2·cp`` in its packed datasets). Here the corpus pads (``pad_to``: the
separator id repeated after a document's own separator) so that every document but the row's
last, cut one spans a multiple of 2N; the padding belongs to the document it pads (after its
tokens: no real token sees it) and weighs 0 in the loss, which is therefore the unpadded
documents' loss. :meth:`Documents.cp_chunks` gives each chunk's tokens, row by row. The
single device reads the same padded rows (verify's reference: the same TrainConfig).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .config import ConfigError

SEPARATOR_BYTE = 0x1E  # ASCII's record separator: the byte corpus' end of a document
SEPARATOR_TOKEN = "<|endoftext|>"  # GPT-2's end of text: a tokenizer's end of a document


def separator_of(corpus) -> int | None:
    """The id that ends a document in `corpus`: byte 0x1E of a byte corpus, a token file's
    tokenizer's ``<|endoftext|>``; None where it has none."""
    if getattr(corpus, "unit", "") == "byte":
        return SEPARATOR_BYTE
    tok = corpus._tokenizer() if hasattr(corpus, "_tokenizer") else None
    return tok.token_to_id(SEPARATOR_TOKEN) if tok is not None else None


def _ids(corpus) -> np.ndarray:
    t = corpus.tokens
    return t.numpy() if isinstance(t, torch.Tensor) else np.asarray(t)


class PackedCorpus:
    """A corpus (or one split of it) read as whole documents: where each one starts, and
    the packed rows of a global batch (:meth:`batch`). `ids_of`: the rule giving each token its
    document (default :func:`document_ids`)."""

    def __init__(self, corpus, seq_len: int, what: str = "the corpus", ids_of=None, pad_to: int = 0,
                 balance: str = "sequence"):
        sep = separator_of(corpus)
        if sep is None:
            raise ConfigError(f"--pack needs a document separator and {what} defines none: tokenize with a "
                              f"tokenizer that has {SEPARATOR_TOKEN} (minitron tokenize --tokenizer FILE), or drop --pack")
        ids = _ids(corpus)
        ends = np.flatnonzero(ids == sep)
        starts = np.concatenate([[0], ends + 1])
        self.starts = starts[starts <= len(ids) - seq_len - 1]  # a whole sequence (and its last target) fits
        if not len(ends) or not len(self.starts):
            name = "byte 0x1E (ASCII's record separator)" if sep == SEPARATOR_BYTE and corpus.unit == "byte" \
                else f"token {sep} ({SEPARATOR_TOKEN})"
            raise ConfigError(f"--pack: {what} has no document separator ({name}) with a whole sequence of "
                              f"--seq-len {seq_len} after it: end each document with it, or drop --pack")
        self.corpus, self.seq_len, self.separator = corpus, seq_len, sep
        self.ids_of = ids_of or document_ids  # a lab passes a learner's (the Trainer's ``document_ids=``)
        self.ends, self.pad_to, self.balance = ends, pad_to, balance  # padding: module docstring

    def _row(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The s + 1 tokens from document start `start` on, each document padded up to a
        multiple of ``pad_to`` with the separator (none without ``pad_to``), and which are padding."""
        n = self.seq_len + 1
        if not self.pad_to:
            return self.corpus.window(start, n), torch.zeros(n, dtype=torch.bool)
        parts, pads, got, p = [], [], 0, start
        while got < n:
            after = self.ends[np.searchsorted(self.ends, p):]
            end = int(after[0]) + 1 if len(after) else p + n - got  # past this document's separator
            doc = self.corpus.window(p, min(end - p, n - got))
            pad = min(-(end - p) % self.pad_to, n - got - len(doc))
            parts += [doc, torch.full((pad,), self.separator, dtype=doc.dtype)]
            pads += [torch.zeros(len(doc), dtype=torch.bool), torch.ones(pad, dtype=torch.bool)]
            got, p = got + len(doc) + pad, end
        return torch.cat(parts), torch.cat(pads)

    def batch(self, global_batch: int, seed: int, step: int, rows: slice | None = None):
        """Inputs and targets [rows, s] of the global batch of `step`, each row starting at a
        document's first token, and their :class:`Documents` (loss weights counted over the
        whole global batch)."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        pick = torch.randint(0, len(self.starts), (global_batch,), generator=g)
        xy, pads = (torch.stack(t) for t in zip(*(self._row(int(self.starts[i])) for i in pick)))
        x, y = xy[:, :-1], xy[:, 1:]
        counted = int((x != self.separator).sum())
        rows = rows or slice(0, global_batch)
        return x[rows], y[rows], Documents.of(x[rows], self.separator, x.numel() / max(counted, 1), self.ids_of,
                                              pads[rows, :-1], self.balance)


def document_ids(x: torch.Tensor, separator: int) -> torch.Tensor:
    """The document of each token of the rows `x` [b, s]: 0, 1, .. along a row, a new one
    after each separator (a document is its tokens and the separator that ends it)."""
    new = torch.zeros_like(x, dtype=torch.long)
    new[:, 1:] = (x[:, :-1] == separator).long()
    return new.cumsum(1)


@dataclasses.dataclass(frozen=True)
class Documents:
    """The documents of a microbatch's rows [b, s] (whole sequences, before any split):
    ``segments`` (the document of each token, 0, 1, .. along a row), ``positions`` (its
    position in its document) and ``loss_weight`` (T/N, 0 on a separator: module docstring);
    ``balance``: how context parallelism splits the rows ('sequence': chunks r and 2N−1−r of
    the row; 'document': of every document, :meth:`cp_chunks`)."""

    segments: torch.Tensor
    positions: torch.Tensor
    loss_weight: torch.Tensor
    balance: str = "sequence"

    @staticmethod
    def of(x: torch.Tensor, separator: int, scale: float = 1.0, ids=document_ids, pads: torch.Tensor | None = None,
           balance: str = "sequence") -> "Documents":
        """The documents of token rows `x` [b, s] (`ids`: each token's document, by default
        a new one after each separator, :func:`document_ids`); positions restart where the
        document changes (Megatron's reset_position_ids). `pads` [b, s]: the padding tokens,
        which continue the document they pad (module docstring)."""
        seg = torch.as_tensor(ids(x, separator)).long()
        new = torch.ones_like(seg, dtype=torch.bool)
        new[:, 1:] = seg[:, 1:] != seg[:, :-1]
        if pads is not None:
            new[:, 1:] &= ~pads[:, 1:]
            seg = new.long().cumsum(1) - 1
        idx = torch.arange(x.shape[1]).expand_as(x)
        start = torch.cummax(idx * new, dim=1).values  # the first token of each token's document
        return Documents(seg, idx - start, (x != separator).double() * scale, balance)

    def chunk(self, m: int) -> list["Documents"]:
        """The documents of the `m` microbatches (rows split as ``Tensor.chunk``)."""
        parts = [t.chunk(m) for t in (self.segments, self.positions, self.loss_weight)]
        return [Documents(*p, self.balance) for p in zip(*parts)]

    def to(self, device) -> "Documents":
        return Documents(*(t.to(device) for t in (self.segments, self.positions, self.loss_weight)), self.balance)

    def cp_chunks(self, n: int) -> torch.Tensor:
        """[2n, b, s/(2n)]: the tokens (indices into the row) of chunk a of every document of
        each row, one document after the other — rank r of n holds chunks r and 2n−1−r
        (Transformer Engine's ``thd_get_partitioned_indices``, which lays a rank's two chunks of
        each document side by side; here its early chunks come first, then its late ones,
        the halves the ring reads). Every document must span a multiple of 2n (``pad_to``)."""
        rows = []
        for lengths in self.lengths():
            if any(n_ % (2 * n) for n_ in lengths):
                raise ValueError(f"--pack-balance document needs documents padded to a multiple of 2*cp = {2 * n} "
                                 f"(lengths {lengths})")
            starts = np.cumsum([0] + lengths[:-1])
            rows.append([torch.cat([torch.arange(o + a * (n_ // (2 * n)), o + (a + 1) * (n_ // (2 * n)))
                                    for o, n_ in zip(starts, lengths)]) for a in range(2 * n)])
        return torch.stack([torch.stack(chunks) for chunks in rows], dim=1).to(self.segments.device)

    def lengths(self) -> list[list[int]]:
        """Each row's document lengths, in order (what the analysis of the ring reads)."""
        return [torch.unique_consecutive(row, return_counts=True)[1].tolist() for row in self.segments]

    def visible(self, q: torch.Tensor | slice, k: torch.Tensor | slice) -> torch.Tensor:
        """[b, 1, |q|, |k|], True where query token q_i and key token k_j (indices into the
        sequence) are in the same document (causality is the caller's)."""
        sq, sk = self.segments[:, q], self.segments[:, k]
        return (sq[:, :, None] == sk[:, None, :]).unsqueeze(1)

    def pair_kind(self, a: int, b: int, c: int) -> str:
        """How the documents let query chunk `a` see key chunk `b` (chunks of c tokens; any
        order), in every row at once: 'none' (no pair in one document), 'full' (every pair)
        or 'masked'. Documents are contiguous, so the end tokens decide: a pair exists iff
        the document of the chunk that comes first reaches into the other one."""
        seg = self.segments
        lo, hi = min(a, b), max(a, b)
        if a != b and not bool((seg[:, (lo + 1) * c - 1] == seg[:, hi * c]).any()):
            return "none"
        return "full" if bool((seg[:, lo * c] == seg[:, (hi + 1) * c - 1]).all()) else "masked"
