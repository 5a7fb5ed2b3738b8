"""Context parallelism: the sequence split over `cp` ranks, attention computed by a ring.

Sequence parallelism (Korthikanti et al. 2022) splits the sequence only around LayerNorm
and dropout; attention still sees every token on every tensor rank. Context parallelism
splits the whole layer: each of the N ranks of a context group holds s/N tokens of every
sequence from the embedding to the loss. Everything but attention is token-wise and
needs nothing; attention needs every earlier key and value, which travel around a ring
(Liu et al. 2023, "Ring Attention with Blockwise Transformers"), in Megatron-Core's form:

Load balance. Under a causal mask the last tokens attend to the most keys. The sequence
is cut into 2N chunks of c = s/(2N) tokens and rank r holds chunks r and 2N−1−r (one
early, one late), so every rank does the same attention work. Its local sequence is the
two chunks one after the other: positions ``local_positions`` and tokens
``local_tokens`` pick them out of the full sequence.

Forward (``ring_attention``). Each rank starts with its own K and V (one [b, nh, 2c, dk+dv]
message, joined along the width: MLA's values are narrower than its keys, ``mla.py``) and
passes them on N−1 times: at ring step i it holds the blocks of rank
src = r − i (mod N) and sends them to r+1 while it computes with them (the send and
receive are posted before the computation and waited for after it: overlap). Which
block pairs are needed follows from the chunk indices:

* i = 0, its own blocks: causal attention on the local sequence (chunk r before chunk
  2N−1−r: the mask is the ordinary lower triangle);
* src < r: both query chunks see src's *first* chunk whole and its second (2N−1−src,
  later than both) not at all: all queries × the first half of K, V, no mask;
* src > r: the first query chunk r is earlier than both of src's chunks (skipped); the
  second, 2N−1−r, sees both whole: the second half of the queries × all of K, V.

So each step after the first is half a block pair of work, on every rank. The partial
results are combined by the online softmax: a block gives its output O_b (normalised
within the block) and the log-sum-exp L_b of its scores per query; with the running
(O, L), ``L' = log(e^L + e^{L_b})`` and ``O' = e^{L−L'}·O + e^{L_b−L'}·O_b``, exact.

Backward. Flash attention's backward per block pair, with the final L and
D = rowsum(dO ∘ O): P = exp(QKᵀ/√d − L), dV = PᵀdO, dP = dO·Vᵀ, dS = P∘(dP − D),
dQ = dS·K/√d, dK = dSᵀQ/√d. K and V go around the ring again (N−1 sends: nothing but
the local blocks was kept, so memory stays 1/N), and so do the gradients of the visiting
blocks: the accumulator of block o is started on rank o+1, travels with the block and
finally returns to o, N−1 sends of the same size. Per rank, per layer and microbatch:
N−1 sends (and receives) of 2·b·(s/N)·(h/t) elements forward (b·(s/N)·kv_t·(dk+dv) in
general), 2(N−1) backward
(``minitron.analysis.context_parallel``). The communication goes through the door
(``Comm.p2p`` on axis 'cp'), so a traced step shows every byte.

USP (``--cp-mode usp --cp-a2a U``, Fang & Zhao 2024, arXiv 2405.07719) composes the
two: the N ranks form a U × R grid (cp rank u + U·j); Ulysses' all-to-all over the U
ranks of a row (axis 'cp_a2a') gathers their tokens onto 1/U of the heads, then the ring
above runs over the R ranks of a column ('cp_ring') on those heads. The tokens stay where
the ring puts them (chunks r and 2N−1−r): the row of j holds chunks U·j … U·j+U−1 and
their mirrors, which are the ring's own load-balanced pair j and 2R−1−j of 2R
(:func:`usp_attention`), so a window or packed documents mask that ring as they would the
whole ring's. A larger U moves bytes from the ring to the all-to-all: of a rank's s/N tokens
the all-to-all sends (U−1)/U off the rank (its call bytes stay the same), and the ring's hops,
R−1 = N/U − 1, fall.

Weights are replicated over the context group and see different tokens; their gradients
are averaged over the context and data ranks together ('dp_cp', ``parallel/data.py``),
as each rank's loss is the mean over its own s/N tokens of each sequence.
"""
from __future__ import annotations

import functools
import math

import torch

from ..comm import Comm
from ..grid import CP_SUB_AXES

AXIS = "cp"
A2A_AXIS, RING_AXIS = CP_SUB_AXES  # USP's all-to-all rows and ring columns of the cp ranks


# --- which tokens a context rank holds ------------------------------------------------------------
def chunk_ids(n: int, r: int) -> tuple[int, int]:
    """The two chunks (of 2n) of the sequence that context rank r holds: r and 2n−1−r."""
    return r, 2 * n - 1 - r


def local_tokens(t: torch.Tensor, comm: Comm, dim: int = 1, docs=None) -> torch.Tensor:
    """This context rank's tokens of full sequences `t` (the sequence along `dim`):
    chunks r and 2N−1−r, concatenated; `t` itself without context parallelism. With `docs`
    balanced per document (--pack-balance document, rows [b, s] along dim 1), chunks r and
    2N−1−r of every document (:func:`document_index`)."""
    n = comm.size(AXIS)
    if n == 1:
        return t
    if docs is not None and docs.balance == "document":
        return t.gather(1, document_index(docs, n, comm.index(AXIS)).to(t.device))
    parts = t.chunk(2 * n, dim=dim)
    a, b = chunk_ids(n, comm.index(AXIS))
    return torch.cat([parts[a], parts[b]], dim=dim).contiguous()


def local_positions(n_local: int, comm: Comm, device=None):
    """The positions of this rank's `n_local` tokens in the full sequence: ``slice(0,
    n_local)`` without context parallelism (the sequence is whole), else the indices
    of chunks r and 2N−1−r (the sequence cut into 2N chunks of n_local/2 tokens)."""
    n = comm.size(AXIS)
    if n == 1:
        return slice(0, n_local)
    c = n_local // 2
    a, b = chunk_ids(n, comm.index(AXIS))
    return torch.cat([torch.arange(a * c, (a + 1) * c), torch.arange(b * c, (b + 1) * c)]).to(device)


def document_index(docs, n: int, r: int, chunks: torch.Tensor | None = None) -> torch.Tensor:
    """[b, s/n]: the tokens (indices into each row) that context rank r of n holds when the
    chunks are balanced per document (``packing.Documents.cp_chunks``, or `chunks` already
    read from it; Megatron-Core's THD split): chunk r of every document, then chunk 2n−1−r."""
    chunks = docs.cp_chunks(n) if chunks is None else chunks
    a, b = chunk_ids(n, r)
    return torch.cat([chunks[a], chunks[b]], dim=-1)


# --- one block pair -----------------------------------------------------------------------------------
def _causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    """True where a query may not see a key (the upper triangle)."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1)


def window_mask(sq: int, sk: int, q0: int, k0: int, window: int, device=None) -> torch.Tensor:
    """True where a query may not see a key under a causal sliding window (Mistral;
    transformers' ``sliding_window_overlay``): queries at positions q0.. and keys at k0..
    of the sequence; query p sees key j iff p − window < j ≤ p."""
    dist = (torch.arange(q0, q0 + sq, device=device)[:, None] - torch.arange(k0, k0 + sk, device=device)[None, :])
    return (dist < 0) | (dist >= window)


def block_attention(q, k, v, scale: float, causal: bool, mask: torch.Tensor | None = None):
    """Attention of queries `q` [.., sq, d] on one block of keys and values [.., sk, d]:
    the block's output O_b, normalised within the block, and the log-sum-exp L_b of
    each query's scores (the statistics the online softmax combines). `mask` (True: not
    seen) instead of the causal triangle, filled with the dtype's lowest finite value: a
    query that sees no key of the block gets L_b at that value, which the combination
    weighs exactly 0 (and autograd differentiates without a NaN)."""
    s = (q @ k.transpose(-2, -1)) * scale
    if causal:
        s = s.masked_fill(_causal_mask(s.shape[-2], s.shape[-1], s.device), float("-inf"))
    if mask is not None:
        s = s.masked_fill(mask, torch.finfo(s.dtype).min)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse


def combine(out, lse, out_b, lse_b):
    """The online-softmax combination of a running (O, L) with a block's (O_b, L_b)
    (Milakov & Gimelshein 2018; flash attention): exact, in any order."""
    new = torch.logaddexp(lse, lse_b)
    return (torch.exp(lse - new).unsqueeze(-1) * out + torch.exp(lse_b - new).unsqueeze(-1) * out_b), new


def block_attention_backward(q, k, v, dout, lse, delta, scale: float, causal: bool, mask=None):
    """Gradients (dQ, dK, dV) of one block pair, from the *final* log-sum-exp `lse` and
    delta = rowsum(dO ∘ O) (flash attention's backward: P is recomputed, never kept)."""
    s = (q @ k.transpose(-2, -1)) * scale
    if causal:
        s = s.masked_fill(_causal_mask(s.shape[-2], s.shape[-1], s.device), float("-inf"))
    if mask is not None:
        s = s.masked_fill(mask, torch.finfo(s.dtype).min)
    p = torch.exp(s - lse.unsqueeze(-1))
    dv = p.transpose(-2, -1) @ dout
    ds = p * (dout @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    dk = (ds.transpose(-2, -1) @ q) * scale
    if dk.shape != k.shape:  # grouped queries [.., kv, G, s, d] on one key/value head [.., kv, 1, s, d]
        dk, dv = dk.sum(-3, keepdim=True), dv.sum(-3, keepdim=True)
    return (ds @ k) * scale, dk, dv


# --- the ring ---------------------------------------------------------------------------------------------
def _exchange(comm: Comm, t: torch.Tensor, axis: str = AXIS):
    """Send `t` to the next rank of the ring on `axis` and receive the previous rank's into a
    new buffer; returns (buffer, handles). Posted now, waited for after the computation."""
    n, r = comm.size(axis), comm.index(axis)
    buf = torch.empty_like(t)
    return buf, comm.p2p([("send", t, (r + 1) % n), ("recv", buf, (r - 1) % n)], axis)


def _wait(handles) -> None:
    for w in handles:
        w.wait()


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """Blocks and softmax statistics in fp32 at least (bf16 inputs under autocast)."""
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


def _grouped_q(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Queries [b, nh, s, d] as [b, kv, G, s, d] (G = nh/kv queries per key/value head,
    consecutive: Hugging Face's ``repeat_kv`` order); unchanged with as many kv heads."""
    return q if q.shape[1] == kv_heads else q.unflatten(1, (kv_heads, q.shape[1] // kv_heads))


def _kv_message(k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Keys [b, kv, s, dk] and values [b, kv, s, dv] as one message [b, kv, s, dk+dv]
    (MLA's value heads are narrower than its query/key heads, so they are joined along
    the width, not stacked); [b, kv, 1, s, dk+dv] under grouped-query attention, so that
    a block broadcasts over the G queries of its group: the ring carries the kv heads
    only, never copies for each query head."""
    kv = torch.cat([k, v], dim=-1)
    return kv if k.shape[1] == heads else kv.unsqueeze(2)


def _kv_parts(kv: torch.Tensor, dk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of a message of :func:`_kv_message` (views): the first `dk`
    columns, the rest."""
    return kv[..., :dk], kv[..., dk:]


class _RingAttention(torch.autograd.Function):
    """Causal attention of local queries on the keys and values of the whole context
    group, with load-balanced chunks (see the module docstring); the ring runs on `axis`
    ('cp', or USP's 'cp_ring')."""

    @staticmethod
    def forward(fctx, q, k, v, comm: Comm, combine=combine, axis: str = AXIS):
        n, r = comm.size(axis), comm.index(axis)
        dtype, cd = q.dtype, _compute_dtype(q)
        c, scale = q.shape[-2] // 2, 1.0 / math.sqrt(q.shape[-1])
        heads = q.shape[1]
        with torch.autocast(q.device.type, enabled=False):
            # one message per hop, in the activations' dtype: only the key/value heads travel
            kv, dk = _kv_message(k, v, heads), k.shape[-1]
            qc = _grouped_q(q, k.shape[1]).to(cd)
            out = lse = None
            for i in range(n):
                nxt, handles = _exchange(comm, kv, axis) if i < n - 1 else (None, [])
                src = (r - i) % n
                kc, vc = (t.to(cd) for t in _kv_parts(kv, dk))
                if i == 0:  # own blocks: the ordinary causal mask on the local sequence
                    out, lse = block_attention(qc, kc, vc, scale, causal=True)
                elif src < r:  # every query sees src's early chunk; its late one is in the future
                    out, lse = combine(out, lse, *block_attention(qc, kc[..., :c, :], vc[..., :c, :],
                                                                  scale, causal=False))
                else:  # only the late query chunk sees src's chunks, both whole
                    o, l = combine(out[..., c:, :], lse[..., c:], *block_attention(qc[..., c:, :], kc, vc,
                                                                                  scale, causal=False))
                    out, lse = torch.cat([out[..., :c, :], o], dim=-2), torch.cat([lse[..., :c], l], dim=-1)
                _wait(handles)
                kv = nxt
            # laid out [b, s, nh, d] in memory, as SDPA's output: the caller's "b nh s d -> b s (nh d)"
            # is then a view, and what is saved here is the projection's input (no second copy)
            out = out.flatten(1, 2) if out.dim() == 5 else out
            out = out.to(dtype).transpose(1, 2).contiguous().transpose(1, 2)
        fctx.comm, fctx.axis = comm, axis
        fctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(fctx, dout):
        q, k, v, out, lse = fctx.saved_tensors
        comm, axis = fctx.comm, fctx.axis
        n, r = comm.size(axis), comm.index(axis)
        dtype, cd = q.dtype, _compute_dtype(q)
        c, scale = q.shape[-2] // 2, 1.0 / math.sqrt(q.shape[-1])
        with torch.autocast(q.device.type, enabled=False):
            heads, kv_heads = q.shape[1], k.shape[1]
            dout, q, out = (_grouped_q(t, kv_heads) for t in (dout.to(cd), q.to(cd), out))
            delta = (dout * out.to(cd)).sum(-1)
            dq = torch.zeros_like(q)
            kv, width = _kv_message(k, v, heads), k.shape[-1]  # travels again in the activations' dtype
            own = acc = None
            acc_handles: list = []
            for i in range(n):
                nxt, handles = _exchange(comm, kv, axis) if i < n - 1 else (None, [])
                src = (r - i) % n
                kc, vc = (t.to(cd) for t in _kv_parts(kv, width))
                if i == 0:
                    dq_b, dk, dv = block_attention_backward(q, kc, vc, dout, lse, delta, scale, causal=True)
                    dq += dq_b
                    own = torch.cat([dk, dv], dim=-1)
                else:
                    # the gradient of src's blocks from this rank (accumulated in the compute dtype)
                    if src < r:
                        dq_b, dk, dv = block_attention_backward(q, kc[..., :c, :], vc[..., :c, :], dout,
                                                                lse, delta, scale, causal=False)
                        dq += dq_b
                        blk = torch.zeros(kv.shape, dtype=cd, device=kc.device)
                        blk[..., :c, :] = torch.cat([dk, dv], dim=-1)
                    else:
                        dq_b, dk, dv = block_attention_backward(q[..., c:, :], kc, vc, dout[..., c:, :],
                                                                lse[..., c:], delta[..., c:], scale, causal=False)
                        dq[..., c:, :] += dq_b
                        blk = torch.cat([dk, dv], dim=-1)
                    if i > 1:  # add what the ranks before us contributed to src's blocks
                        _wait(acc_handles)
                        blk += acc
                    # pass it on: the next rank holds src's blocks at step i+1; after the last
                    # step it is src itself, which adds the sum to its own
                    acc, acc_handles = _exchange(comm, blk, axis)
                _wait(handles)
                kv = nxt
            _wait(acc_handles)
            if acc is not None:
                own += acc
            if dq.dim() == 5:  # back from the grouped layout
                dq, own = dq.flatten(1, 2), own.squeeze(2)
        dk, dv = _kv_parts(own, width)
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), None, None, None


# --- the ring under a sliding window or a document mask ------------------------------------------
# With a window of W keys a query chunk sees only the chunks within W tokens before it; with
# packed documents (--pack, packing.py) only the chunks its documents reach back to. So each
# of a rank's two chunks travels only as far as the last rank whose queries reach it (its
# *reach*, in ring steps) and then stops: fewer hops of K and V (forward and backward),
# block pairs the mask leaves empty skipped (no FLOPs), and the gradient accumulator of a
# chunk sent straight home from the last rank that used it (the whole ring's last hop, when
# the chunk went all the way round). Without either every chunk goes all the way
# (:class:`_RingAttention`). Under a window which pairs a chunk reaches is integer arithmetic
# on chunk indices, so a dry run on fake tensors follows it; documents are data, the same on
# every rank of the context group (they hold the same rows): each decides alike.
def pair_kind(a: int, b: int, c: int, window: int) -> str:
    """How query chunk `a` sees key chunk `b` (chunks of c tokens) under a causal window of
    `window` keys: 'none' (no pair in reach), 'full' (every pair) or 'masked'."""
    near, far = (a - b) * c - (c - 1), (a - b) * c + (c - 1)  # the least and largest query-key distance
    if far < 0 or near >= window:
        return "none"
    return "full" if near >= 0 and far < window else "masked"


class ChunkMask:
    """Which key chunks each query chunk sees, of the 2N chunks of c tokens: causal, with a
    sliding `window` (0: none) and the microbatch's documents `docs` (None: one stream).
    ``kinds[(a, b)]`` is 'none', 'full' or 'masked' (:func:`pair_kind`, ``Documents.pair_kind``:
    a pair is empty if either mask empties it, whole if both leave it whole), ``reach[(src,
    slot)]`` the last ring step at which a rank needs chunk `slot` (0: early, 1: late) of rank
    src's keys and values (rank src + j holds it at step j); `axis` the ring's ranks ('cp', or
    USP's 'cp_ring'). Built once per attention call."""

    def __init__(self, n: int, c: int, window: int = 0, docs=None, axis: str = AXIS):
        self.n, self.c, self.window, self.docs, self.axis = n, c, window, docs, axis
        # balanced per document (--pack-balance document): chunk a is chunk a of every document,
        # its tokens [b, c] per row (Documents.cp_chunks); the pairs are read off the masks
        self.tokens = docs.cp_chunks(n) if docs is not None and docs.balance == "document" else None
        self.kinds = {(a, b): self._kind(a, b) for a in range(2 * n) for b in range(2 * n)}
        self.reach = {(src, slot): max(j for j in range(n) if any(
            self.kinds[(a, chunk_ids(n, src)[slot])] != "none" for a in chunk_ids(n, (src + j) % n)))
            for src in range(n) for slot in (0, 1)}

    def _kind(self, a: int, b: int) -> str:
        if self.tokens is not None:
            seen = self._visible(a, b)
            return "none" if not bool(seen.any()) else "full" if bool(seen.all()) else "masked"
        kind = pair_kind(a, b, self.c, self.window or 2 * self.n * self.c)  # no window: causal only
        if self.docs is None or kind == "none":
            return kind
        doc = self.docs.pair_kind(a, b, self.c)
        return "none" if doc == "none" else "full" if kind == doc == "full" else "masked"

    def mask(self, a: int, b: int, device, grouped: bool) -> torch.Tensor | None:
        """True where query chunk a may not see key chunk b: [c, c], [b, 1, c, c] with
        documents ([b, 1, 1, c, c] for grouped queries); None for a whole pair."""
        if self.kinds[(a, b)] != "masked":
            return None
        if self.tokens is not None:
            m = ~self._visible(a, b).to(device).unsqueeze(1)
            return m.unsqueeze(1) if grouped else m
        c = self.c
        m = window_mask(c, c, a * c, b * c, self.window or 2 * self.n * c, device)
        if self.docs is not None:
            m = m | ~self.docs.visible(slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c))
            m = m.unsqueeze(1) if grouped else m
        return m


    def _visible(self, a: int, b: int) -> torch.Tensor:
        """[b, c, c], balanced per document: True where a query of chunk a sees a key of chunk
        b (its own document, not later in the row)."""
        qi, ki = self.tokens[a], self.tokens[b]
        seg = self.docs.segments
        same = seg.gather(1, qi)[:, :, None] == seg.gather(1, ki)[:, None, :]
        return same & (ki[:, None, :] <= qi[:, :, None])


@functools.lru_cache(maxsize=4096)
def chunk_reach(n: int, src: int, slot: int, c: int, window: int) -> int:
    """The last ring step at which a rank needs chunk `slot` (0: early, 1: late) of rank
    `src`'s keys and values under a causal window (:class:`ChunkMask`'s reach)."""
    return ChunkMask(n, c, window).reach[(src, slot)]


def sees(s: int, window: int, docs, device) -> torch.Tensor:
    """True where a query of a whole sequence of `s` tokens may see a key: causal, within a
    sliding `window` (0: none) and, with `docs` (packing.Documents), in its own document:
    [s, s], or [b, 1, s, s] per row (SDPA's boolean ``attn_mask``)."""
    ok = ~window_mask(s, s, 0, 0, window or s, device)
    return ok if docs is None else ok & docs.visible(slice(0, s), slice(0, s))


def window_block(s: int, window: int) -> int:
    """The block of :func:`blockwise_window_attention`: the largest divisor of s not above
    the window (a query block then reaches its own key block and the one before)."""
    return max(b for b in range(1, min(s, window) + 1) if s % b == 0)


def blockwise_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """Causal sliding-window attention of a whole sequence (q [b, nh, s, d], k, v [b, kv,
    s, d]) in blocks of ``window_block(s, W)`` tokens: each query block meets only the key
    blocks in reach (:func:`pair_kind`), combined by the online softmax, so the work is
    about 2·W·s query-key pairs instead of s² (Beltagy et al. 2020; Mistral). Plain
    matmuls, differentiated by autograd: the one-device kernel of a windowed layer, whose
    FLOPs PyTorch's ``FlopCounterMode`` counts (``model_flops.attention_core_flops``)."""
    s, scale = q.shape[-2], 1.0 / math.sqrt(q.shape[-1])
    c = window_block(s, window)
    ahead = -(-(window - 1) // c)  # key blocks before a query block that the window reaches
    qg, (kg, vg) = _grouped_q(q, k.shape[1]), _kv_parts(_kv_message(k, v, q.shape[1]), k.shape[-1])
    outs = []
    for a in range(s // c):
        acc = None
        for b in range(max(0, a - ahead), a + 1):
            kind = pair_kind(a, b, c, window)
            if kind == "none":
                continue
            mask = window_mask(c, c, a * c, b * c, window, q.device) if kind == "masked" else None
            blk = block_attention(qg[..., a * c:(a + 1) * c, :], kg[..., b * c:(b + 1) * c, :],
                                  vg[..., b * c:(b + 1) * c, :], scale, causal=False, mask=mask)
            acc = blk if acc is None else combine(*acc, *blk)
        outs.append(acc[0])
    y = torch.cat(outs, dim=-2)
    return y.flatten(1, 2) if y.dim() == 5 else y


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs, window: int = 0) -> torch.Tensor:
    """Block-diagonal causal attention of whole packed rows (q [b, nh, s, d], k, v [b, kv, s,
    d]; `docs` their ``packing.Documents``) computed document by document, as a varlen
    kernel does (flash attention's ``cu_seqlens``; Megatron-Core's packed THD batches): each
    document's causal attention alone (:func:`blockwise_window_attention`: one block, or under
    a sliding `window` its blocks in reach), so the work is Σ sᵢ² query-key pairs, not s².
    Plain matmuls, which PyTorch's ``FlopCounterMode`` counts (CPU's fused SDPA it does not
    see): ``model_flops.model_flops_per_step(documents=)``."""
    rows = []
    for r, lengths in enumerate(docs.lengths()):
        outs, start = [], 0
        for n in lengths:
            outs.append(blockwise_window_attention(*(t[r:r + 1, :, start:start + n] for t in (q, k, v)),
                                                   window or n))
            start += n
        rows.append(torch.cat(outs, dim=-2))
    return torch.cat(rows, dim=0)


def _reaching(rule: ChunkMask, src: int, past: int) -> list[int]:
    """The slots of rank src's chunks whose reach is beyond step `past`."""
    return [k for k in (0, 1) if rule.reach[(src, k)] > past]


def _select(msg: torch.Tensor, held: list[int], want: list[int], c: int) -> torch.Tensor:
    """The chunks `want` of a message holding the chunks `held` (one after the other)."""
    if want == held:
        return msg
    return torch.cat([msg[..., held.index(k) * c:(held.index(k) + 1) * c, :] for k in want], dim=-2).contiguous()


def _pass_on(comm: Comm, msg, held: list[int], step: int, like: torch.Tensor, rule: ChunkMask):
    """Step `step`'s hop: send on the chunks of the held message that reach further,
    receive those of the previous rank's; returns (buffer, its chunks, handles)."""
    n, r, c = comm.size(rule.axis), comm.index(rule.axis), rule.c
    send, recv = _reaching(rule, (r - step) % n, step), _reaching(rule, (r - 1 - step) % n, step)
    ops, buf = [], None
    if send:
        ops.append(("send", _select(msg, held, send, c), (r + 1) % n))
    if recv:
        buf = like.new_empty((*like.shape[:-2], len(recv) * c, like.shape[-1]))
        ops.append(("recv", buf, (r - 1) % n))
    return buf, recv, comm.p2p(ops, rule.axis)


def _pairs(comm: Comm, src: int, held: list[int], rule: ChunkMask, device, grouped: bool):
    """(query slot, index of the key chunk in the message, mask or None) of each block pair
    in reach between this rank's query chunks and rank src's held key chunks."""
    n, r = comm.size(rule.axis), comm.index(rule.axis)
    out = []
    for idx, k in enumerate(held):
        b = chunk_ids(n, src)[k]
        for qa, a in enumerate(chunk_ids(n, r)):
            if rule.kinds[(a, b)] != "none":
                out.append((qa, idx, rule.mask(a, b, device, grouped)))
    return out


def _halves(t: torch.Tensor, c: int) -> list[torch.Tensor]:
    """The two chunks (early, late) of a rank's local sequence, along dim −2."""
    return [t[..., :c, :], t[..., c:, :]]


class _MaskedRing(torch.autograd.Function):
    """Ring attention under a sliding window or a document mask (`rule`, a :class:`ChunkMask`):
    each chunk of keys and values travels only to the ranks whose queries it reaches (see
    the section above)."""

    @staticmethod
    def forward(fctx, q, k, v, comm: Comm, rule: ChunkMask, combine=combine):
        n, r = comm.size(rule.axis), comm.index(rule.axis)
        dtype, cd = q.dtype, _compute_dtype(q)
        c, scale = q.shape[-2] // 2, 1.0 / math.sqrt(q.shape[-1])
        with torch.autocast(q.device.type, enabled=False):
            msg, held, dk = _kv_message(k, v, q.shape[1]), [0, 1], k.shape[-1]
            like, qs = msg, _halves(_grouped_q(q, k.shape[1]).to(cd), c)
            acc: list = [None, None]
            for i in range(n):
                src = (r - i) % n
                nxt, nxt_held, handles = _pass_on(comm, msg, held, i, like, rule) if i < n - 1 else (None, [], [])
                for qa, idx, mask in _pairs(comm, src, held, rule, q.device, qs[0].dim() == 5):
                    kc, vc = (t[..., idx * c:(idx + 1) * c, :].to(cd) for t in _kv_parts(msg, dk))
                    o, lse = block_attention(qs[qa], kc, vc, scale, causal=False, mask=mask)
                    acc[qa] = (o, lse) if acc[qa] is None else combine(*acc[qa], o, lse)
                _wait(handles)
                msg, held = nxt, nxt_held
            out, lse = torch.cat([acc[0][0], acc[1][0]], dim=-2), torch.cat([acc[0][1], acc[1][1]], dim=-1)
            out = out.flatten(1, 2) if out.dim() == 5 else out
            out = out.to(dtype).transpose(1, 2).contiguous().transpose(1, 2)
        fctx.comm, fctx.rule = comm, rule
        fctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(fctx, dout):
        q, k, v, out, lse = fctx.saved_tensors
        comm, rule = fctx.comm, fctx.rule
        n, r = comm.size(rule.axis), comm.index(rule.axis)
        dtype, cd = q.dtype, _compute_dtype(q)
        c, scale = q.shape[-2] // 2, 1.0 / math.sqrt(q.shape[-1])
        with torch.autocast(q.device.type, enabled=False):
            heads = q.shape[1]
            dout, q, out = (_grouped_q(t, k.shape[1]) for t in (dout.to(cd), q.to(cd), out))
            delta = (dout * out.to(cd)).sum(-1)
            qs, douts = _halves(q, c), _halves(dout, c)
            lses, deltas = [lse[..., :c], lse[..., c:]], [delta[..., :c], delta[..., c:]]
            dq = [torch.zeros_like(t) for t in qs]
            msg, held, width = _kv_message(k, v, heads), [0, 1], k.shape[-1]
            like, ring = msg, _AccumulatorRing(comm, rule)
            for i in range(n):
                src = (r - i) % n
                nxt, nxt_held, handles = _pass_on(comm, msg, held, i, like, rule) if i < n - 1 else (None, [], [])
                grads = {s_: torch.zeros((*like.shape[:-2], c, like.shape[-1]), dtype=cd, device=q.device)
                         for s_ in held}
                for qa, idx, mask in _pairs(comm, src, held, rule, q.device, qs[0].dim() == 5):
                    kc, vc = (t[..., idx * c:(idx + 1) * c, :].to(cd) for t in _kv_parts(msg, width))
                    dq_b, dk, dv = block_attention_backward(qs[qa], kc, vc, douts[qa], lses[qa], deltas[qa],
                                                            scale, causal=False, mask=mask)
                    dq[qa] += dq_b
                    grads[held[idx]] += torch.cat([dk, dv], dim=-1)
                ring.step(i, held, grads)
                _wait(handles)
                msg, held = nxt, nxt_held
            own = ring.finish()
            dq = torch.cat(dq, dim=-2)
            if dq.dim() == 5:
                dq, own = dq.flatten(1, 2), own.squeeze(2)
        dk, dv = _kv_parts(own, width)
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), None, None, None


class _AccumulatorRing:
    """The dK, dV of each visiting chunk in the masked ring's backward: started on the
    first rank the chunk visits, passed on with it while it travels, and sent home to its
    owner from the last rank that used it. One per backward call (no state kept after)."""

    def __init__(self, comm: Comm, rule: ChunkMask):
        self.comm, self.c, self.rule = comm, rule.c, rule
        self.own = self.incoming = None
        self.home: list = []
        self.handles: list = []

    def step(self, i: int, held: list[int], grads: dict) -> None:
        """Step `i`: this rank's gradients `grads` of the held chunks (its own at step 0)."""
        n, r = self.comm.size(self.rule.axis), self.comm.index(self.rule.axis)
        if i == 0:
            self.own = torch.cat([grads[0], grads[1]], dim=-2)
            return
        _wait(self.handles)
        if self.incoming is not None:  # what the ranks before us added to these chunks
            for s_, part in zip(self.incoming[1], _split(self.incoming[0], self.c)):
                grads[s_] += part
        src = (r - i) % n
        onward = _reaching(self.rule, src, i)
        homeward = [s_ for s_ in held if s_ not in onward]
        ops = []
        for peer, slots in (((r + 1) % n, onward), (src, homeward)):
            if slots:
                ops.append(("send", torch.cat([grads[s_] for s_ in slots], dim=-2).contiguous(), peer))
        self.incoming = self._receive(ops, i, self.own)
        self.handles = self.comm.p2p(ops, self.rule.axis)

    def _receive(self, ops: list, i: int, like: torch.Tensor):
        """Post-to-be receives of step i: the previous rank's onward accumulators (returned,
        for step i+1) and this rank's own chunks whose last user sends them home now."""
        n, r = self.comm.size(self.rule.axis), self.comm.index(self.rule.axis)
        ring = _reaching(self.rule, (r - 1 - i) % n, i)
        mine = [s_ for s_ in (0, 1) if self.rule.reach[(r, s_)] == i]
        bufs = []
        for peer, slots in (((r - 1) % n, ring), ((r + i) % n, mine)):
            buf = like.new_empty((*like.shape[:-2], len(slots) * self.c, like.shape[-1])) if slots else None
            if slots:
                ops.append(("recv", buf, peer))
            bufs.append((buf, slots))
        if mine:
            self.home.append(bufs[1])
        return bufs[0] if ring else None

    def finish(self) -> torch.Tensor:
        """This rank's own dK, dV [2, .., 2c, d]: its own share plus every visitor's."""
        _wait(self.handles)
        for buf, slots in self.home:
            for s_, part in zip(slots, _split(buf, self.c)):
                self.own[..., s_ * self.c:(s_ + 1) * self.c, :] += part
        return self.own


def _split(t: torch.Tensor, c: int) -> list[torch.Tensor]:
    return list(t.split(c, dim=-2))


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, combine=combine,
                   window: int = 0, docs=None, axis: str = AXIS) -> torch.Tensor:
    """Causal softmax(QKᵀ/√d)V for this context rank's queries [b, nh, 2c, d] against the
    keys [b, kv, 2c, d] and values [b, kv, 2c, dv] (MLA: dv ≠ d) of every rank of the 'cp' axis (each holding chunks r
    and 2N−1−r of the sequence; kv < nh: grouped-query attention, query head i on kv head
    i // (nh/kv), and only the kv heads travel). Equal to full causal attention on the
    whole sequence, sliced. `combine`: the online-softmax combination of the forward (a
    lab passes a learner's). A sliding `window` or the microbatch's documents `docs` (--pack,
    ``packing.Documents`` of whole rows): the ring of :class:`_MaskedRing`, which passes
    only the chunks the mask lets later queries see. `axis`: the ring's ranks ('cp', or
    USP's 'cp_ring')."""
    n = comm.size(axis)
    if n == 1:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, enable_gqa=k.shape[1] != q.shape[1],
            **({"is_causal": True} if docs is None and not window else {"attn_mask": sees(q.shape[-2], window, docs,
                                                                                          q.device)}))
    if window or docs is not None:
        return _MaskedRing.apply(q, k, v, comm, ChunkMask(n, q.shape[-2] // 2, window, docs, axis), combine)
    return _RingAttention.apply(q, k, v, comm, combine, axis)


# --- all-to-all (Ulysses) -------------------------------------------------------------------------
# DeepSpeed-Ulysses (Jacobs et al. 2023, §3.1): instead of passing keys and values around a
# ring, one all-to-all turns this rank's sequence shard of every (local) head into the
# whole sequence of 1/N of the heads; attention is then the single-device computation on
# those heads, and a second all-to-all turns its output back into the sequence shard.
# Tokens keep the ring's placement (chunks r and 2N−1−r), so everything outside
# attention is the same for both modes; the gathered sequence is put in order locally.
# Per layer and microbatch each rank sends (all_to_all's call bytes: the whole tensor,
# its own block included) Q, K and V (K and V joined along the width, one call) and
# receives the output: forward ``b·(s/N)·d·(2·nh + 2·kv_sent)`` elements (MLA: queries
# and keys of width dk, values and output dv) (nh, kv: the rank's query and kv heads after
# tensor parallelism; kv_sent = kv, or N when N > kv and each kv head is replicated to
# the N/kv ranks of its queries), and the same again in the backward for the gradients
# (``analysis.context_parallel.a2a_comm_items``).


def _natural_order(chunks: list[int], c: int, device) -> torch.Tensor:
    """Positions, in the gathered order (the chunks `chunks` of c tokens one after the
    other: rank 0's two, rank 1's, ...), of the tokens in the order of the sequence:
    ``gathered[:, :, order]`` is the gathered tokens sorted by position (Ulysses: the
    whole sequence; USP's row: the ring's chunk pair j, 2R−1−j)."""
    gathered = torch.cat([torch.arange(a * c, (a + 1) * c) for a in chunks])
    return torch.argsort(gathered).to(device)


def _gathered_chunks(comm: Comm, axis: str) -> list[int]:
    """The chunks the all-to-all on `axis` gathers, in its order: each rank's two
    (:func:`chunk_ids` of its cp rank), rank by rank ('cp': Ulysses' whole sequence;
    'cp_a2a': USP's row, cp ranks U·j … U·j+U−1, which hold chunks U·j … U·j+U−1 and their
    mirrors: sorted, the ring's load-balanced pair j and 2R−1−j of 2R)."""
    n = comm.size(AXIS)
    return [a for r in comm.grid.axis_ranks(axis, comm.grid.rank) for a in chunk_ids(n, comm.grid.coord(r).cp)]


class _SeqToHeads(torch.autograd.Function):
    """[b, H, s/N, d] (this rank's tokens of H heads) -> [b, H/N, s, d] (every token of its
    H/N heads, in gathered order) over the N ranks of `axis`; backward the inverse all-to-all."""

    @staticmethod
    def forward(fctx, x, comm, axis):
        fctx.comm, fctx.axis = comm, axis
        return _seq_to_heads(x, comm, axis)

    @staticmethod
    def backward(fctx, dy):
        return _heads_to_seq(dy, fctx.comm, fctx.axis), None, None


class _HeadsToSeq(torch.autograd.Function):
    """The inverse of :class:`_SeqToHeads`: [b, H/N, s, d] -> [b, H, s/N, d]."""

    @staticmethod
    def forward(fctx, y, comm, axis):
        fctx.comm, fctx.axis = comm, axis
        return _heads_to_seq(y, comm, axis)

    @staticmethod
    def backward(fctx, dx):
        return _seq_to_heads(dx, fctx.comm, fctx.axis), None, None


def _seq_to_heads(x, comm, axis=AXIS):
    n = comm.size(axis)
    b, h, s, d = x.shape
    blocks = x.reshape(b, n, h // n, s, d).transpose(0, 1).contiguous()  # head block j goes to rank j
    got = comm.all_to_all(blocks, axis, activation=True)  # [n (source rank), b, h/n, s/N, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _heads_to_seq(y, comm, axis=AXIS):
    n = comm.size(axis)
    b, h, s, d = y.shape
    blocks = y.reshape(b, h, n, s // n, d).permute(2, 0, 1, 3, 4).contiguous()  # sequence block j to rank j
    got = comm.all_to_all(blocks, axis, activation=True)  # [n (source: its heads), b, h, s/N, d]
    return got.transpose(0, 1).reshape(b, n * h, s // n, d)


def _over_heads(q, k, v, comm: Comm, axis: str, attend, docs=None) -> torch.Tensor:
    """`attend(q, k, v)` on 1/N of the heads and the tokens of the N ranks of `axis`, in the
    order of the sequence: the all-to-all there (K and V joined along the width in one, a kv
    head sent to each rank of its queries when there are fewer than N), the all-to-all back
    (`docs` balanced per document: each row's own order, :func:`_document_order`)."""
    n = comm.size(axis)
    kv = torch.cat([k, v], dim=-1)  # one all-to-all for both: [b, kv, 2c, dk+dv] (MLA: dv != dk)
    if kv.shape[1] < n:  # too few kv heads to split: each one to the ranks of its query heads
        kv = kv.repeat_interleave(n // kv.shape[1], dim=1)
    order = _natural_order(_gathered_chunks(comm, axis), q.shape[-2] // 2, q.device) if docs is None or \
        docs.balance != "document" else _document_order(docs, comm.size(AXIS), q.device)
    qh = _take(_SeqToHeads.apply(q, comm, axis), order)
    kh, vh = _kv_parts(_take(_SeqToHeads.apply(kv, comm, axis), order), k.shape[-1])
    return _HeadsToSeq.apply(_take(attend(qh, kh, vh), torch.argsort(order, dim=-1)), comm, axis)


def _document_order(docs, n: int, device) -> torch.Tensor:
    """[b, s]: :func:`_natural_order` of each row when the chunks are balanced per document
    (the gathered tokens: each rank's :func:`document_index`, rank by rank)."""
    chunks = docs.cp_chunks(n)
    return torch.argsort(torch.cat([document_index(docs, n, r, chunks) for r in range(n)], dim=-1), dim=-1).to(device)


def _take(t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The tokens of [b, h, s, d] in `order` along s: one order [s], or one per row [b, s]."""
    if order.dim() == 1:
        return t[:, :, order]
    return t.gather(2, order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[-1]))


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, window: int = 0,
                      docs=None) -> torch.Tensor:
    """Causal attention of this context rank's tokens (q, k [b, nh | kv, 2c, dk], v [b, kv, 2c, dv]:
    chunks r and 2N−1−r) by all-to-all (Ulysses): heads split over the 'cp' axis during
    attention. With kv < N (and N a multiple of kv) each kv head is sent to the N/kv
    ranks holding its queries (its gradient summed back by the backward's all-to-all).
    A sliding `window` and the documents `docs` (--pack) mask the gathered sequence as on one device."""
    if comm.size(AXIS) == 1:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                enable_gqa=k.shape[1] != q.shape[1])

    def attend(qh, kh, vh):  # the single device's attention on the whole sequence of these heads
        s = qh.shape[-2]
        mask = {"attn_mask": sees(s, window, docs, q.device)} if window or docs is not None else {"is_causal": True}
        return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, **mask,
                                                                enable_gqa=kh.shape[1] != qh.shape[1])
    return _over_heads(q, k, v, comm, AXIS, attend, docs)


def usp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, ring=ring_attention,
                  window: int = 0, docs=None) -> torch.Tensor:
    """Causal attention by USP (Fang & Zhao 2024, ``--cp-mode usp``): the cp ranks a U × R
    grid (``grid.py``: cp rank u + U·j); the all-to-all over the U ranks of this rank's row
    ('cp_a2a') turns [b, nh, s/N, d] into [b, nh/U, s/R, d], the ring's chunk pair j,
    2R−1−j of the sequence (:func:`_gathered_chunks`); `ring` (:func:`ring_attention`, or a
    layer namespace's) over the R ranks of its column ('cp_ring') on those heads; the
    all-to-all back. Per layer and microbatch: Ulysses' calls with the heads over U, and
    the ring's with N = R on max(kv, U)/U key/value heads (``analysis.context_parallel.usp_comm_items``).
    A sliding `window` and the microbatch's documents `docs` (--pack, whole rows): the ring's own
    (:class:`_MaskedRing`), its chunks being the sequence's 2R. After the all-to-all this rank
    holds chunks j and 2R−1−j of them, the positions of ring rank j, so the documents of
    whole rows decide its pairs and reach as the plain ring's (every rank of the column
    holds the same rows: each skips alike)."""
    win = {"window": window} if window else {}
    if docs is not None:
        win["docs"] = docs
    return _over_heads(q, k, v, comm, A2A_AXIS, lambda qh, kh, vh: ring(qh, kh, vh, comm, axis=RING_AXIS, **win))
