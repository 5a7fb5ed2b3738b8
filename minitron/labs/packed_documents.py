"""Lab 09c: the document mask of packed sequences on a context-parallel shard (the engine's
``minitron.packing.document_ids`` and the chunk pairs ``ChunkMask`` asks ``Documents`` about).

``--pack`` fills each sequence with whole documents, one after the other, and masks attention
at their boundaries: a token sees only the earlier tokens of its own document (block-diagonal
causal; Llama 3, Dubey et al. 2024, §3.2; Megatron's ``--reset-attention-mask``). A document
is its tokens and the separator that ends it. Under ``--cp N`` rank r holds chunks r and
2N−1−r of the 2N chunks of c tokens, and the ring passes a block of keys only to the queries
that see some of it. The learner writes:

* ``document_ids(x, separator) -> LongTensor [b, s]``: the document of each token of the rows
  x [b, s], 0, 1, .. along each row, a new one after each separator;
* ``visible(segments, cp, q_rank, q_slot, k_rank, k_slot) -> BoolTensor [b, c, c]``: True where
  query i of chunk `q_slot` (0: the rank's first chunk, 1: its second) of context rank
  `q_rank` may see key j of chunk `k_slot` of rank `k_rank`: the key at or before the query in
  the whole sequence, in the same document (`segments` [b, s]: whole rows' document ids;
  c = s / 2·cp).

Every rank ``exec``s the source and checks, armed with a :class:`~.runner.Tripwire`:

1. ``document_ids`` on rows of random document lengths (a document across a chunk boundary,
   one-token documents, a row with no separator, separators at a row's first and last token,
   two separator ids): the separator put in the next document and documents counted from 1
   named;
2. ``visible`` for every pair of chunks on the layout's cp (random documents, several c): a
   plain causal mask (attention across documents), local positions, a contiguous shard
   (chunk 2N−1−r forgotten), a cp hard-wired, the chunks swapped and the future seen named.

Then both go into a real ``--pack`` run: the Trainer builds each microbatch's documents with
the learner's ``document_ids`` (its ``document_ids=`` seam: positions restart and the loss
weights follow them), and the layer namespace's ring attention is handed documents whose
chunk pairs the learner's ``visible`` answers (the engine's ``ChunkMask`` asks which pairs
are empty, whole or masked, and the ring skips the empty ones). A small Llama trains 2 float64
steps under ``--cp 2 --dp 2`` and ``--cp 4`` against the single-device packed model (1e-9).

    result = check_packed_documents(SOURCE)   # {"ok", "message", "max_loss_abs_diff", ...}
"""
from __future__ import annotations

import dataclasses
import itertools
import random
from types import SimpleNamespace

import torch

from .. import packing
from ..config import ParallelConfig
from ..data import ByteCorpus
from ..parallel import context_parallel, tensor
from .runner import (TOL, LAB_LLAMA, TWO_FLOAT64_STEPS, LabError, Tripwire, agree, call, comm_on, layout_flags, loaded,
                     run_sources, train_swapped, training_verdict, verdict_over_runs)

NAMES = ("document_ids", "visible")
MODEL = LAB_LLAMA.replace(seq_len=32, name="lab-packed")
TRAIN = dataclasses.replace(TWO_FLOAT64_STEPS, pack=True)
# the notebook's ring of 2 (in 2 replicas), then a ring of 4 on the same ranks
LAYOUTS = (ParallelConfig(cp=2, dp=2, device="cpu"), ParallelConfig(cp=4, device="cpu"))
FORBIDDEN = ("minitron.packing.document_ids", "minitron.packing", "minitron.parallel.context_parallel.ChunkMask",
             "minitron.parallel.context_parallel.sees", "minitron.parallel.context_parallel.window_mask",
             "minitron.parallel.context_parallel.chunk_ids", "minitron.parallel.context_parallel.local_positions",
             "minitron.parallel.context_parallel.local_tokens", "minitron.labs.packed_documents")
SEPARATORS = (packing.SEPARATOR_BYTE, 7)  # the byte corpus' record separator, and another id
_CASE = itertools.count()


def _documents_text(n: int = 1500, seed: int = 0) -> bytes:
    """Short documents of words (3 to ~25 bytes), each ended by the record separator."""
    r = random.Random(seed)
    words = "the of and to in is was he for it with as his on be at by had".split()
    sep = chr(packing.SEPARATOR_BYTE)
    return "".join(" ".join(r.choice(words) for _ in range(r.randint(1, 4))) + "." + sep for _ in range(n)).encode()


CORPUS = ByteCorpus(_documents_text(), "lab documents")


def _watch() -> Tripwire:
    return Tripwire({"minitron.packing": packing,
                     "minitron.parallel.context_parallel.ChunkMask": context_parallel.ChunkMask,
                     "minitron.parallel.context_parallel.sees": context_parallel.sees,
                     "minitron.parallel.context_parallel.window_mask": context_parallel.window_mask,
                     "minitron.parallel.context_parallel.chunk_ids": context_parallel.chunk_ids,
                     "minitron.parallel.context_parallel.local_positions": context_parallel.local_positions,
                     "minitron.parallel.context_parallel.local_tokens": context_parallel.local_tokens,
                     "minitron.labs.packed_documents": _document_ids,
                     "minitron.labs.packed_documents._visible": _visible})


def _learner(lab, what: str, fn, *args):
    with lab.watch.armed():
        return call(what, fn, *args)


# --- the checker's own answers ------------------------------------------------------------------
def _document_ids(x: torch.Tensor, separator: int, after: bool = True, first: int = 0) -> torch.Tensor:
    """0, 1, .. along each row; `after`: a new document after each separator (else at it)."""
    sep = (x == separator).long()
    if not after:
        return sep.cumsum(1) + first
    new = torch.zeros_like(sep)
    new[:, 1:] = sep[:, :-1]
    return new.cumsum(1) + first


def _chunk(cp: int, r: int, slot: int, mirror_of: int | None = None, layout: str = "balanced") -> int:
    """The global chunk (of 2·cp) of rank r's chunk `slot`; the usual mistakes by keyword."""
    if layout == "contiguous":
        return 2 * r + slot
    if layout == "swapped":
        slot = 1 - slot
    return r if slot == 0 else 2 * (mirror_of or cp) - 1 - r


def _visible(seg, cp, qr, qs, kr, ks, docs=True, local=False, future=False, **chunking) -> torch.Tensor | None:
    """[b, c, c]: query chunk (qr, qs) sees key chunk (kr, ks): causal and in one document
    (None where a mistake's chunk lies outside the sequence)."""
    c = seg.shape[1] // (2 * cp)
    ar = torch.arange(c)
    if local:
        qp, kp = qs * c + ar, ks * c + ar
    else:
        qp, kp = _chunk(cp, qr, qs, **chunking) * c + ar, _chunk(cp, kr, ks, **chunking) * c + ar
    if int(qp.max()) >= seg.shape[1] or int(kp.max()) >= seg.shape[1]:
        return None
    order = (kp[None, :] >= qp[:, None]) if future else (kp[None, :] <= qp[:, None])
    same = seg[:, qp, None] == seg[:, None, kp] if docs else torch.ones(seg.shape[0], c, c, dtype=torch.bool)
    return order[None] & same


# --- the unit checks ----------------------------------------------------------------------------------
def _row(s: int, sep: int, g: random.Random, lengths=None) -> list[int]:
    """A row of s tokens: documents of `lengths` (random, 1 to 9: a one-token document is a
    lone separator), each ended by `sep`, the last one cut at s."""
    out = []
    while len(out) < s:
        n = lengths.pop(0) if lengths else g.randint(1, 9)
        out += [g.choice([t for t in range(40, 120) if t != sep]) for _ in range(n - 1)] + [sep]
    return out[:s]


def _rows(s: int, sep: int, seed: int) -> torch.Tensor:
    """Rows the learner cannot special-case: random documents, one spanning the middle (a chunk
    boundary), one-token documents, no separator, separators first and last."""
    g = random.Random(seed)
    rows = [_row(s, sep, g), _row(s, sep, g, [s // 2 - 2, 7, 1, 1]), [g.randint(40, 119) for _ in range(s)],
            [sep] + _row(s - 1, sep, g), _row(s - 1, sep, g, [3, 1, 5]) + [sep]]
    rows[2] = [t if t != sep else t + 1 for t in rows[2]]
    return torch.tensor(rows)


def _check_document_ids(lab) -> str:
    for sep, s in itertools.product(SEPARATORS, (8, 24)):
        x = _rows(s, sep, seed=sep + s)
        x0 = x.clone()
        got = _learner(lab, "your document_ids", lab.document_ids, x, sep)
        if not torch.equal(x, x0):
            return "your document_ids changed x in place: return a new tensor (the engine still reads the tokens)"
        if not isinstance(got, torch.Tensor) or got.shape != x.shape or got.is_floating_point():
            return (f"your document_ids returned {_what(got)} for x {list(x.shape)}: return an integer tensor of "
                    f"the rows' shape, each token's document")
        want, got = _document_ids(x, sep), got.long()
        if torch.equal(got, want):
            continue
        bad = int((got != want).any(1).float().argmax())
        where = (f"your document_ids (separator {sep}) gave row {x[bad].tolist()} the documents {got[bad].tolist()}, "
                 f"want {want[bad].tolist()}")
        if torch.equal(got, _document_ids(x, sep, after=False)):
            return (f"{where}: the separator put in the next document; a document is its tokens and the separator "
                    f"that ends it (the separator's target is the next document's first token, weighted 0)")
        if torch.equal(got, _document_ids(x, sep, first=1)) or torch.equal(got, _document_ids(x, sep, False, 1)):
            return f"{where}: documents counted from 1; each row's first document is 0"
        return f"{where} (0, 1, .. along each row, a new document after each separator)"
    return ""


def _what(got) -> str:
    return f"{got.dtype} {list(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__


MISTAKES = (  # (what the learner's mask equals, the line naming it)
    (dict(docs=False), "a plain causal mask: attention across documents; a key is visible only in its query's "
                       "document (segments equal)"),
    (dict(local=True), "positions local to the rank's shard; compare the tokens' global positions (chunk r, then "
                       "chunk 2N−1−r of 2N) and read segments there"),
    (dict(layout="contiguous"), "a contiguous shard (chunks 2r and 2r+1): chunk 2N−1−r forgotten; rank r holds "
                                "chunks r and 2N−1−r of 2N (the causal load balance)"),
    (dict(layout="swapped"), "the rank's two chunks swapped: slot 0 is chunk r, slot 1 is chunk 2N−1−r"),
    (dict(future=True), "keys after the query seen: a query sees the keys at or before it"),
)


def _same(got: dict, seg, cp, **mistake) -> bool:
    """Whether the learner's masks of every chunk pair (`got`) are those of `mistake`."""
    for pair, m in got.items():
        want = _visible(seg, cp, *pair, **mistake)
        if want is None or not torch.equal(m, want):
            return False
    return True


def _masks(lab, seg, cp: int) -> dict | str:
    """{(q_rank, q_slot, k_rank, k_slot): the learner's mask} of every chunk pair, or the problem."""
    c, seg0, got = seg.shape[1] // (2 * cp), seg.clone(), {}
    for pair in itertools.product(range(cp), (0, 1), range(cp), (0, 1)):
        m = _learner(lab, "your visible", lab.visible, seg, cp, *pair)
        if not torch.equal(seg, seg0):
            return "your visible changed segments in place: return a new tensor"
        if not isinstance(m, torch.Tensor) or m.shape != (seg.shape[0], c, c):
            return (f"your visible(segments {list(seg.shape)}, cp={cp}, q_rank={pair[0]}, q_slot={pair[1]}, "
                    f"k_rank={pair[2]}, k_slot={pair[3]}) returned {_what(m)}: return a boolean tensor [b, c, c] "
                    f"with c = s / 2·cp = {c}")
        got[pair] = m.bool()
    return got


def _check_visible(lab, cp: int) -> str:
    g = random.Random(cp)
    for c in (1, 3, 4):
        seg = _document_ids(_rows(2 * cp * c, 0, seed=g.randint(0, 10**6)), 0)
        got = _masks(lab, seg, cp)
        if isinstance(got, str):
            return got
        if _same(got, seg, cp):
            continue
        where = f"your visible (cp = {cp}, chunks of c = {c})"
        for kw, line in MISTAKES:
            if _same(got, seg, cp, **kw):
                return f"{where}: {line}"
        for other in (1, 2, 3, 4, 8):
            if other != cp and _same(got, seg, cp, mirror_of=other):
                return f"{where} gives cp = {other}'s chunks: a cp hard-wired; the second chunk is 2N−1−r with N = cp"
        pair = next(p for p, m in got.items() if not torch.equal(m, _visible(seg, cp, *p)))
        return (f"{where} is wrong for q_rank={pair[0]}, q_slot={pair[1]}, k_rank={pair[2]}, k_slot={pair[3]}: "
                f"{got[pair].int().tolist()[0]}, want {_visible(seg, cp, *pair).int().tolist()[0]} (the key at or "
                f"before the query in the whole sequence, in its document)")
    return ""


# --- inside the engine ----------------------------------------------------------------------------
def _owner(n: int, a: int) -> tuple[int, int]:
    """(rank, slot) holding global chunk a of 2n: rank a's first chunk, or rank 2n−1−a's second."""
    return (a, 0) if a < n else (2 * n - 1 - a, 1)


@dataclasses.dataclass(frozen=True)
class _LearnersMask:
    """A microbatch's documents as the engine's ring asks about them (``ChunkMask`` asks
    ``pair_kind`` which chunk pairs are empty, whole or masked, and ``visible`` for a masked
    pair's tokens), answered by the learner's ``visible``; made per attention call."""

    segments: torch.Tensor
    n: int
    lab: SimpleNamespace
    balance: str = "sequence"  # the lab's chunks are the row's (packing.Documents.balance)

    def _block(self, a: int, b: int) -> torch.Tensor:
        (qr, qs), (kr, ks) = _owner(self.n, a), _owner(self.n, b)
        got = _learner(self.lab, "your visible", self.lab.visible, self.segments, self.n, qr, qs, kr, ks)
        c = self.segments.shape[1] // (2 * self.n)
        if not isinstance(got, torch.Tensor) or got.shape != (self.segments.shape[0], c, c):
            raise LabError(f"your visible returned {_what(got)} inside the engine: return a boolean tensor [b, c, c]")
        return got.bool().to(self.segments.device)

    def pair_kind(self, a: int, b: int, c: int) -> str:
        m = self._block(a, b)
        return "none" if not bool(m.any()) else "full" if bool(m.all()) else "masked"

    def visible(self, q: slice, k: slice) -> torch.Tensor:
        c = q.stop - q.start
        return self._block(q.start // c, k.start // c).unsqueeze(1)


def _layers(lab):
    """The engine's layers, their ring attention handed the learner's mask (nothing patched)."""
    def ring(q, k, v, comm, window=0, docs=None):
        mask = None if docs is None else _LearnersMask(docs.segments, comm.size("cp"), lab)
        return context_parallel.ring_attention(q, k, v, comm, window=window, docs=mask)
    return SimpleNamespace(**{**vars(tensor.layers()), "ring_attention": ring})


def _job(comm, source: str, timeout: float) -> dict | None:
    key = f"packed-documents/{next(_CASE)}"
    watch = _watch()
    ids, visible = loaded(comm, source, NAMES, {"torch": torch}, watch, key, timeout)
    lab = SimpleNamespace(document_ids=ids, visible=visible, watch=watch)
    try:
        problem = _check_document_ids(lab)
    except LabError as e:
        problem = str(e)
    agree(comm, f"{key}/ids", problem, timeout)
    runs = []
    for i, layout in enumerate(LAYOUTS):
        c = comm if i == 0 else comm_on(comm, layout)
        try:
            problem = _check_visible(lab, layout.cp)
        except LabError as e:
            problem = str(e)
        agree(comm, f"{key}/{i}", f"{layout_flags(layout)}: {problem}" if problem and i else problem, timeout)
        res = train_swapped(c, MODEL, layout, TRAIN, corpus=CORPUS, layers=_layers(lab),
                            document_ids=lambda x, sep: _learner(lab, "your document_ids", ids, x, sep))
        runs.append((layout_flags(layout), training_verdict(res, "document_ids and visible", "", TOL)))
    if comm.grid.rank != 0:
        return None
    return verdict_over_runs(runs, "your document_ids and visible train exactly like the single-device packed model "
                                   "(--cp 2 --dp 2 and --cp 4: the ring skips the chunk pairs your mask leaves empty)")


def check_packed_documents_all(sources: list[str], timeout: float = 90) -> list[dict]:
    """`check_packed_documents` for several sources, in as few launches as their outcomes allow."""
    return run_sources(_job, LAYOUTS[0], sources, timeout, timeout, forbidden=FORBIDDEN, names=NAMES)


def check_packed_documents(source: str, timeout: float = 90) -> dict:
    """Lab 09c: check `document_ids` and `visible` defined in `source` (each token's document,
    and the visible keys of a pair of chunks of a context-parallel shard) on 4 gloo ranks, then
    train a small packed Llama with them (``--cp 2 --dp 2`` and ``--cp 4``, float64, 2 steps
    each) against the single-device packed model. Returns {"ok", "message",
    "max_loss_abs_diff", "max_param_rel_diff"}, or {"ok": False, "message"} naming the first
    problem."""
    return check_packed_documents_all([source], timeout)[0]
