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

Forward (``ring_attention``). Each rank starts with its own K and V (one [2, b, nh, 2c, d]
message) and passes them on N−1 times: at ring step i it holds the blocks of rank
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
N−1 sends (and receives) of 2·b·(s/N)·(h/t) elements forward, 2(N−1) backward
(``minitron.analysis.context_parallel``). The communication goes through the door
(``Comm.p2p`` on axis 'cp'), so a traced step shows every byte.

Weights are replicated over the context group and see different tokens; their gradients
are averaged over the context and data ranks together ('dp_cp', ``parallel/data.py``),
as each rank's loss is the mean over its own s/N tokens of each sequence.
"""
from __future__ import annotations

import math

import torch

from ..comm import Comm

AXIS = "cp"


# --- which tokens a context rank holds ------------------------------------------------------------
def chunk_ids(n: int, r: int) -> tuple[int, int]:
    """The two chunks (of 2n) of the sequence that context rank r holds: r and 2n−1−r."""
    return r, 2 * n - 1 - r


def local_tokens(t: torch.Tensor, comm: Comm, dim: int = 1) -> torch.Tensor:
    """This context rank's tokens of full sequences `t` (the sequence along `dim`):
    chunks r and 2N−1−r, concatenated; `t` itself without context parallelism."""
    n = comm.size(AXIS)
    if n == 1:
        return t
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


# --- one block pair -----------------------------------------------------------------------------------
def _causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    """True where a query may not see a key (the upper triangle)."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1)


def block_attention(q, k, v, scale: float, causal: bool):
    """Attention of queries `q` [.., sq, d] on one block of keys and values [.., sk, d]:
    the block's output O_b, normalised within the block, and the log-sum-exp L_b of
    each query's scores (the statistics the online softmax combines)."""
    s = (q @ k.transpose(-2, -1)) * scale
    if causal:
        s = s.masked_fill(_causal_mask(s.shape[-2], s.shape[-1], s.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse


def combine(out, lse, out_b, lse_b):
    """The online-softmax combination of a running (O, L) with a block's (O_b, L_b)
    (Milakov & Gimelshein 2018; flash attention): exact, in any order."""
    new = torch.logaddexp(lse, lse_b)
    return (torch.exp(lse - new).unsqueeze(-1) * out + torch.exp(lse_b - new).unsqueeze(-1) * out_b), new


def block_attention_backward(q, k, v, dout, lse, delta, scale: float, causal: bool):
    """Gradients (dQ, dK, dV) of one block pair, from the *final* log-sum-exp `lse` and
    delta = rowsum(dO ∘ O) (flash attention's backward: P is recomputed, never kept)."""
    s = (q @ k.transpose(-2, -1)) * scale
    if causal:
        s = s.masked_fill(_causal_mask(s.shape[-2], s.shape[-1], s.device), float("-inf"))
    p = torch.exp(s - lse.unsqueeze(-1))
    dv = p.transpose(-2, -1) @ dout
    ds = p * (dout @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    dk = (ds.transpose(-2, -1) @ q) * scale
    if dk.shape != k.shape:  # grouped queries [.., kv, G, s, d] on one key/value head [.., kv, 1, s, d]
        dk, dv = dk.sum(-3, keepdim=True), dv.sum(-3, keepdim=True)
    return (ds @ k) * scale, dk, dv


# --- the ring ---------------------------------------------------------------------------------------------
def _exchange(comm: Comm, t: torch.Tensor):
    """Send `t` to the next rank of the ring and receive the previous rank's into a new
    buffer; returns (buffer, handles). Posted now, waited for after the computation."""
    n, r = comm.size(AXIS), comm.index(AXIS)
    buf = torch.empty_like(t)
    return buf, comm.p2p([("send", t, (r + 1) % n), ("recv", buf, (r - 1) % n)], AXIS)


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


def _grouped_kv(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """Stacked keys and values [2, b, kv, s, d] as [2, b, kv, 1, s, d] under grouped-query
    attention, so that a block broadcasts over the G queries of its group: the ring
    carries the kv heads only, never copies for each query head."""
    return kv if kv.shape[2] == heads else kv.unsqueeze(3)


class _RingAttention(torch.autograd.Function):
    """Causal attention of local queries on the keys and values of the whole context
    group, with load-balanced chunks (see the module docstring)."""

    @staticmethod
    def forward(fctx, q, k, v, comm: Comm, combine=combine):
        n, r = comm.size(AXIS), comm.index(AXIS)
        dtype, cd = q.dtype, _compute_dtype(q)
        c, scale = q.shape[-2] // 2, 1.0 / math.sqrt(q.shape[-1])
        heads = q.shape[1]
        with torch.autocast(q.device.type, enabled=False):
            # one message per hop, in the activations' dtype: only the key/value heads travel
            kv = _grouped_kv(torch.stack([k, v]), heads)
            qc = _grouped_q(q, k.shape[1]).to(cd)
            out = lse = None
            for i in range(n):
                nxt, handles = _exchange(comm, kv) if i < n - 1 else (None, [])
                src = (r - i) % n
                kc, vc = kv[0].to(cd), kv[1].to(cd)
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
        fctx.comm = comm
        fctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(fctx, dout):
        q, k, v, out, lse = fctx.saved_tensors
        comm = fctx.comm
        n, r = comm.size(AXIS), comm.index(AXIS)
        dtype, cd = q.dtype, _compute_dtype(q)
        c, scale = q.shape[-2] // 2, 1.0 / math.sqrt(q.shape[-1])
        with torch.autocast(q.device.type, enabled=False):
            heads, kv_heads = q.shape[1], k.shape[1]
            dout, q, out = (_grouped_q(t, kv_heads) for t in (dout.to(cd), q.to(cd), out))
            delta = (dout * out.to(cd)).sum(-1)
            dq = torch.zeros_like(q)
            kv = _grouped_kv(torch.stack([k, v]), heads)  # travels again in the activations' dtype
            own = acc = None
            acc_handles: list = []
            for i in range(n):
                nxt, handles = _exchange(comm, kv) if i < n - 1 else (None, [])
                src = (r - i) % n
                kc, vc = kv[0].to(cd), kv[1].to(cd)
                if i == 0:
                    dq_b, dk, dv = block_attention_backward(q, kc, vc, dout, lse, delta, scale, causal=True)
                    dq += dq_b
                    own = torch.stack([dk, dv])
                else:
                    # the gradient of src's blocks from this rank (accumulated in the compute dtype)
                    blk = torch.zeros((2, *kc.shape), dtype=cd, device=kc.device)
                    if src < r:
                        dq_b, dk, dv = block_attention_backward(q, kc[..., :c, :], vc[..., :c, :], dout,
                                                                lse, delta, scale, causal=False)
                        dq += dq_b
                        blk[0, ..., :c, :], blk[1, ..., :c, :] = dk, dv
                    else:
                        dq_b, dk, dv = block_attention_backward(q[..., c:, :], kc, vc, dout[..., c:, :],
                                                                lse[..., c:], delta[..., c:], scale, causal=False)
                        dq[..., c:, :] += dq_b
                        blk[0], blk[1] = dk, dv
                    if i > 1:  # add what the ranks before us contributed to src's blocks
                        _wait(acc_handles)
                        blk += acc
                    # pass it on: the next rank holds src's blocks at step i+1; after the last
                    # step it is src itself, which adds the sum to its own
                    acc, acc_handles = _exchange(comm, blk)
                _wait(handles)
                kv = nxt
            _wait(acc_handles)
            if acc is not None:
                own += acc
            if dq.dim() == 5:  # back from the grouped layout
                dq, own = dq.flatten(1, 2), own.squeeze(3)
        return dq.to(dtype), own[0].to(dtype), own[1].to(dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, combine=combine) -> torch.Tensor:
    """Causal softmax(QKᵀ/√d)V for this context rank's queries [b, nh, 2c, d] against the
    keys and values [b, kv, 2c, d] of every rank of the 'cp' axis (each holding chunks r
    and 2N−1−r of the sequence; kv < nh: grouped-query attention, query head i on kv head
    i // (nh/kv), and only the kv heads travel). Equal to full causal attention on the
    whole sequence, sliced. `combine`: the online-softmax combination of the forward (a
    lab passes a learner's)."""
    if comm.size(AXIS) == 1:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                enable_gqa=k.shape[1] != q.shape[1])
    return _RingAttention.apply(q, k, v, comm, combine)


# --- all-to-all (Ulysses) -------------------------------------------------------------------------
# DeepSpeed-Ulysses (Jacobs et al. 2023, §3.1): instead of passing keys and values around a
# ring, one all-to-all turns this rank's sequence shard of every (local) head into the
# whole sequence of 1/N of the heads; attention is then the single-device computation on
# those heads, and a second all-to-all turns its output back into the sequence shard.
# Tokens keep the ring's placement (chunks r and 2N−1−r), so everything outside
# attention is the same for both modes; the gathered sequence is put in order locally.
# Per layer and microbatch each rank sends (all_to_all's call bytes: the whole tensor,
# its own block included) Q, K and V and receives the output: forward
# ``b·(s/N)·d·(2·nh + 2·kv_sent)`` elements (nh, kv: the rank's query and kv heads after
# tensor parallelism; kv_sent = kv, or N when N > kv and each kv head is replicated to
# the N/kv ranks of its queries), and the same again in the backward for the gradients
# (``analysis.context_parallel.a2a_comm_items``).


def _natural_order(n: int, c: int, device) -> torch.Tensor:
    """Positions, in the gathered order (rank 0's chunks 0 and 2N−1, rank 1's 1 and 2N−2,
    ...), of the tokens of the natural order: ``gathered[:, :, order]`` is the sequence."""
    gathered = torch.cat([torch.arange(a * c, (a + 1) * c) for r in range(n) for a in chunk_ids(n, r)])
    return torch.argsort(gathered).to(device)


class _SeqToHeads(torch.autograd.Function):
    """[b, H, s/N, d] (this rank's tokens of H heads) -> [b, H/N, s, d] (every token of its
    H/N heads, in gathered order); backward the inverse all-to-all."""

    @staticmethod
    def forward(fctx, x, comm):
        fctx.comm = comm
        return _seq_to_heads(x, comm)

    @staticmethod
    def backward(fctx, dy):
        return _heads_to_seq(dy, fctx.comm), None


class _HeadsToSeq(torch.autograd.Function):
    """The inverse of :class:`_SeqToHeads`: [b, H/N, s, d] -> [b, H, s/N, d]."""

    @staticmethod
    def forward(fctx, y, comm):
        fctx.comm = comm
        return _heads_to_seq(y, comm)

    @staticmethod
    def backward(fctx, dx):
        return _seq_to_heads(dx, fctx.comm), None


def _seq_to_heads(x, comm):
    n = comm.size(AXIS)
    b, h, s, d = x.shape
    blocks = x.reshape(b, n, h // n, s, d).transpose(0, 1).contiguous()  # head block j goes to rank j
    got = comm.all_to_all(blocks, AXIS, activation=True)  # [n (source rank), b, h/n, s/N, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _heads_to_seq(y, comm):
    n = comm.size(AXIS)
    b, h, s, d = y.shape
    blocks = y.reshape(b, h, n, s // n, d).permute(2, 0, 1, 3, 4).contiguous()  # sequence block j to rank j
    got = comm.all_to_all(blocks, AXIS, activation=True)  # [n (source: its heads), b, h, s/N, d]
    return got.transpose(0, 1).reshape(b, n * h, s // n, d)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Causal attention of this context rank's tokens (q [b, nh, 2c, d], k, v [b, kv, 2c, d]:
    chunks r and 2N−1−r) by all-to-all (Ulysses): heads split over the 'cp' axis during
    attention. With kv < N (and N a multiple of kv) each kv head is sent to the N/kv
    ranks holding its queries (its gradient summed back by the backward's all-to-all)."""
    n = comm.size(AXIS)
    if n == 1:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                enable_gqa=k.shape[1] != q.shape[1])
    kv = torch.stack([k, v])  # one all-to-all for both: [2, b, kv, 2c, d] -> [2b, kv, 2c, d]
    if kv.shape[2] < n:  # too few kv heads to split: each one to the ranks of its query heads
        kv = kv.repeat_interleave(n // kv.shape[2], dim=2)
    order = _natural_order(n, q.shape[-2] // 2, q.device)
    qh = _SeqToHeads.apply(q, comm)[:, :, order]
    kvh = _SeqToHeads.apply(kv.flatten(0, 1), comm)[:, :, order].unflatten(0, (2, -1))
    y = torch.nn.functional.scaled_dot_product_attention(qh, kvh[0], kvh[1], is_causal=True,
                                                         enable_gqa=kvh.shape[2] != qh.shape[1])
    return _HeadsToSeq.apply(y[:, :, torch.argsort(order)], comm)

