"""Context parallelism (``--cp N``): what the ring moves and what a rank keeps.

Each of the N ranks of a context group holds s/N tokens of every sequence (chunks r and
2N−1−r of 2N, ``minitron.parallel.context_parallel``). Everything a layer computes per
token — and therefore every activation it saves — is 1/N of the whole; the attention
core keeps only its queries, keys, values, output and log-sum-exp of the rank's own
tokens (the visiting blocks are not kept: the backward passes them around again). So
activation memory per rank is the single-device count for a sequence of s/N tokens:
:func:`~minitron.analysis.params.local_model` is the model the rest of the analysis sees, and
``memory.memory_on_rank`` adds the position indices the embedding saves (8 bytes per
token). Data-parallel traffic becomes the gradient average over the d·N ranks of the
'dp_cp' axis.

The ring (call bytes per rank, ``CommTrace``'s count). One message carries the K and V
of the rank's tokens and heads, ``2·b·(s/N)·(h/t)`` elements; per layer and
microbatch:

* forward: N−1 sends and N−1 receives of K, V (activation dtype: bf16 under
  ``--precision bf16``);
* backward: N−1 sends and receives of K, V again, and N−1 of the accumulated dK, dV
  (in the compute dtype: fp32 at least);
* recomputation (selective or full) runs the forward ring once more, in the backward.

Grouped-query attention: only the rank's key/value heads travel (kv/t of them, or the one
kv head a rank holds when t > kv), ``2·b·(s/N)·kv_t·d`` elements per message.

Multi-head latent attention (``mla.py``): the ring passes the decompressed heads, keys of
width dk = qk_nope + qk_rope and values of dv = v_head_dim, ``b·(s/N)·(h_t)·(dk + dv)``
elements per message (:func:`head_widths`). The alternative, a ring of the latent c_KV
and the shared rotary key k_R (each receiver decompressing with ``kv_b``), would carry
``b·(s/N)·(kv_lora + qk_rope)``: :func:`cp_message_elements` prices both (``carries``),
a ratio of heads/t·(dk + dv)/(kv_lora + qk_rope), 71 for DeepSeek-V3 at t = 1.

The all-to-all (``--cp-mode a2a``, Ulysses) moves no K, V around a ring: per layer and
microbatch two all-to-alls of Q and of K, V (joined along the width) turn the sequence shard into a head
shard and one turns the output back; the backward mirrors the three (gradients), and
recomputation repeats the forward's. Call bytes (the whole tensor, the block a rank keeps
included) ``b·(s/N)·d·(2·nh_t + 2·kv_sent)`` per pass (MLA: Q and K of width dk, V and
the output dv), nh_t = heads/t, kv_sent = kv_t or N
when N > kv_t (each kv head replicated to the ranks of its queries): :func:`a2a_comm_items`.

USP (``--cp-mode usp --cp-a2a U``, Fang & Zhao 2024): the N ranks a U × R grid. Ulysses'
all-to-alls run over the U ranks of the axis 'cp_a2a' on the rank's s/N tokens (kv_sent =
max(kv_t, U)), then the ring over the R = N/U ranks of 'cp_ring' with the rank's s/R
tokens on nh_t/U query and kv_sent/U key/value heads: a message of ``b·(s/N)·kv_sent·(dk+dv)``
elements (the all-to-all's K, V), R−1 hops per pass, or under a window the chunks that
reach (the ring of R ranks on the sequence's 2R chunks), and with packed documents the
chunks the documents reach: :func:`usp_comm_items`.

Sliding windows (``--window W``): a chunk of c = s/(2N) tokens is seen only by the query
chunks within ⌈(W−1)/c⌉ chunks after it, so it travels only to the farthest rank holding
one of them (its reach, :func:`window_chunk_reach`) and its dK, dV go straight home from
there; every message carries the chunks that reach further, ``2·b·c·kv_t·d`` elements
each, and fewer chunks make fewer bytes (:func:`window_ring_items`, per context rank: the
ranks differ). Packed documents (``--pack``) do the same with data: chunk b is seen up to
the chunk where the document holding its last token ends, the farthest over the rows of
the microbatch (:func:`document_last_chunks`), so the bytes follow the step's documents.
Balanced per document (``--pack-balance document``: rank r holds chunks r and 2N−1−r of every
document, padded to a multiple of 2N; Megatron-Core's THD split) chunk b of every document
is seen by the later chunks of the same documents up to the last: every chunk travels as the
causal ring's do, rank 0's last chunk not at all (:func:`document_balanced_last_chunks`).
The work of the attention core a rank's queries have, the (query, key) pairs inside their
documents (:func:`packed_attention_pairs`, what a varlen kernel runs), is the same on every
rank when balanced per document and follows the documents' lengths when not.

"Per layer" means per block the rank runs (:func:`~minitron.analysis.params.block_ids_on_rank`):
its chunks' layers and, on the rank of the last stage, the D multi-token prediction depths'
blocks (``mtp.py``; DeepSeek-V3 §2.2), which attend over the context ranks like any block
(each with its own ``window_of``); full recomputation replays the stage's layers only (a
depth's block runs outside ``run_block``), selective replays a depth's attention core too.

Wire bytes equal call bytes here: each point-to-point message crosses one link once.
Against sequence parallelism's collectives this is ``(N−1)/N`` of the K and V of the
whole sequence per direction, but it overlaps the block computations (each hop is
posted before the block that uses the current one).
"""
from __future__ import annotations

import dataclasses
from ..config import ModelConfig, ParallelConfig, TrainConfig
from .flops import recompute_policy
from .memory import memory_on_rank
from .params import block_ids_on_rank, local_model

__all__ = ["RING_CARRIES", "head_widths", "cp_message_elements", "cp_comm_items", "a2a_elements", "a2a_comm_items",
           "usp_comm_items", "cp_activation_table",
           "window_chunk_reach", "window_ring_items", "chunk_reach_of", "document_last_chunks",
           "document_balanced_last_chunks", "packed_attention_pairs", "packed_attention_flops"]


def kv_heads_per_rank(model: ModelConfig, tp: int) -> int:
    """Key/value heads a tensor rank holds: kv/t, or 1 when t > kv (replicated)."""
    return max(1, model.n_kv_heads // tp)


RING_CARRIES = ("heads", "latent")


def head_widths(model: ModelConfig) -> tuple[int, int]:
    """A head's (query/key, value) widths in the attention core: (d, d); MLA's decompressed
    heads (qk_nope + qk_rope, v_head_dim)."""
    if model.attention == "mla":
        return model.qk_nope_head_dim + model.qk_rope_head_dim, model.v_head_dim
    return model.head_dim, model.head_dim


def cp_message_elements(model: ModelConfig, micro_batch: int, tp: int, cp: int, carries: str = "heads") -> int:
    """Elements of one ring message for the rank's s/N tokens. `carries` "heads" (what the
    engine passes): K and V on its key/value heads, ``b·(s/N)·kv_t·(dk+dv)`` (``2·b·(s/N)·(h/t)``
    with every head a kv head of width d). "latent" (MLA only, priced, not run): the
    compressed c_KV and the shared rotary key k_R, ``b·(s/N)·(kv_lora + qk_rope)``, the
    whole latent on every tensor rank (each decompresses its own heads from it)."""
    tokens = micro_batch * (model.seq_len // cp)
    if carries == "latent":
        if model.attention != "mla":
            raise ValueError("a ring of latents needs --attention mla (standard attention has no latent)")
        return tokens * (model.kv_lora_rank + model.qk_rope_head_dim)
    if carries != "heads":
        raise ValueError(f"unknown ring message '{carries}': one of {', '.join(RING_CARRIES)}")
    return tokens * kv_heads_per_rank(model, tp) * sum(head_widths(model))


def a2a_elements(model: ModelConfig, micro_batch: int, tp: int, cp: int, over: int | None = None) -> dict:
    """Elements of the three all-to-alls of one layer's forward under ``--cp-mode a2a``:
    ``{"q": b·(s/N)·nh_t·dk, "kv": b·(s/N)·kv_sent·(dk+dv), "out": b·(s/N)·nh_t·dv}``
    (dk = dv = d but for MLA, :func:`head_widths`); kv_sent = max(kv_t, `over`), the ranks
    the heads are split over (N; USP's U)."""
    tok = micro_batch * (model.seq_len // cp)
    (dk, dv), kv = head_widths(model), kv_heads_per_rank(model, tp)
    return {"q": tok * model.heads // tp * dk, "kv": tok * max(kv, over or cp) * (dk + dv),
            "out": tok * model.heads // tp * dv}


def _microbatch_of(parallel: ParallelConfig, train: TrainConfig) -> tuple[int, int, int]:
    """(tp, microbatches, microbatch size) of a layout's step."""
    t, d = parallel.tp, parallel.dp
    return t, train.microbatches, train.global_batch // (d * train.microbatches)


def _forwards(model: ModelConfig, parallel: ParallelConfig, i: int) -> int:
    """Forward passes of block `i`'s attention core per step: 2 under recomputation (its
    replay). A multi-token prediction depth's block (i ≥ L) runs outside the stage's
    ``run_block``: full recomputation does not replay it, selective (inside the attention) does."""
    policy = recompute_policy(parallel.recompute)
    return 2 if policy == "selective" or (policy == "full" and i < model.layers) else 1


def _passes(model: ModelConfig, parallel: ParallelConfig, pp_rank: int) -> int:
    """Passes of the attention core over a microbatch on pipeline rank `pp_rank` in a step,
    summed over every block it runs (:func:`~minitron.analysis.params.block_ids_on_rank`,
    the MTP depths' included): each block's forwards and its backward."""
    return sum(_forwards(model, parallel, i) + 1 for i in block_ids_on_rank(model, parallel, pp_rank))


def a2a_comm_items(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, pp_rank: int = 0,
                   act_bytes: int = 4) -> list[dict]:
    """Ulysses' all-to-alls on the 'cp' axis of a rank of pipeline stage `pp_rank` in one
    step (``{what, axis, op, calls, bytes}``): per layer and microbatch the forward's three
    (Q, K and V, the output), the backward's three, and the forward's again under recomputation."""
    n = parallel.cp
    if n == 1:
        return []
    return _a2a_items(model, parallel, train, pp_rank, act_bytes, n, "cp", "all-to-all attention (Ulysses)")


def _a2a_items(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, pp_rank: int, act_bytes: int,
               over: int, axis: str, name: str) -> list[dict]:
    """The all-to-alls of the rank's s/N tokens, heads split over `over` ranks of `axis`."""
    (t, m, b), n = _microbatch_of(parallel, train), parallel.cp
    passes = m * _passes(model, parallel, pp_rank)
    el = a2a_elements(model, b, t, n, over)
    return [{"what": f"{name}: Q, K and V to heads, the output back, and their gradients",
             "axis": axis, "op": "all_to_all", "calls": 3 * passes,
             "bytes": passes * sum(el.values()) * act_bytes}]


def usp_comm_items(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, pp_rank: int = 0,
                   act_bytes: int = 4, cp_rank: int = 0, documents: list | None = None) -> list[dict]:
    """USP's calls (``--cp-mode usp --cp-a2a U``, Fang & Zhao 2024) of context rank `cp_rank`
    of pipeline stage `pp_rank` in one step: Ulysses' all-to-alls of the rank's s/N tokens
    with the heads split over the U ranks of 'cp_a2a', and the ring's hops over the R = N/U
    ranks of 'cp_ring', each message the K, V of s/R tokens on max(kv_t, U)/U heads, as many
    elements as the all-to-all's K, V (``b·(s/N)·max(kv_t, U)·(dk + dv)``); under a sliding
    window, or with `documents` (--pack: each microbatch's document lengths per row, as
    :func:`window_ring_items` takes them), the ring's chunks that reach (from ring rank
    cp_rank // U, on the sequence's 2R chunks); the all-to-alls do not depend on them."""
    n, u = parallel.cp, parallel.cp_a2a
    _, _, b = _microbatch_of(parallel, train)
    ring_el = a2a_elements(model, b, parallel.tp, n, u)["kv"]
    if model.window or documents is not None:  # the chunks a mask lets reach: a chunk is half a message
        ring = _window_items(model, parallel, train, n // u, cp_rank // u, pp_rank, act_bytes, ring_el // 2,
                             "cp_ring", documents)
    else:
        ring = _ring_items(model, parallel, train, pp_rank, act_bytes, n // u, ring_el, "cp_ring")
    return _a2a_items(model, parallel, train, pp_rank, act_bytes, u, "cp_a2a", "USP's all-to-all (Ulysses)") + ring


def cp_comm_items(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, pp_rank: int = 0,
                  act_bytes: int = 4, cp_rank: int = 0, carries: str = "heads") -> list[dict]:
    """The ring's calls on the 'cp' axis of a rank of pipeline stage `pp_rank` in one
    step, as ``analysis.comm.comm_items`` lists them: ``{what, axis, op, calls, bytes}``.
    `act_bytes` is the element size of activations on the wire (K and V); the dK, dV
    accumulators travel in the compute dtype, ``max(act_bytes, 4)``. `carries`: what a
    message holds (:func:`cp_message_elements`): "heads", what the engine runs, or for MLA
    "latent", the ring of c_KV and k_R with the same hops (their gradients travelling
    back as dK, dV do), priced for comparison. ``--cp-mode a2a``: :func:`a2a_comm_items`;
    ``usp``: :func:`usp_comm_items` (on its axes 'cp_a2a' and 'cp_ring')."""
    n = parallel.cp
    if n == 1:
        return []
    mode = parallel.cp_mode
    if mode == "a2a":
        return a2a_comm_items(model, parallel, train, pp_rank, act_bytes)
    if mode == "usp":
        return usp_comm_items(model, parallel, train, pp_rank, act_bytes, cp_rank)
    if model.window:
        return window_ring_items(model, parallel, train, cp_rank, pp_rank, act_bytes)
    t, _, b = _microbatch_of(parallel, train)
    return _ring_items(model, parallel, train, pp_rank, act_bytes, n, cp_message_elements(model, b, t, n, carries),
                       "cp", carries)


def _ring_items(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, pp_rank: int, act_bytes: int,
                n: int, el: int, axis: str, carries: str = "heads") -> list[dict]:
    """The sends and receives of a ring of `n` ranks on `axis` whose messages hold `el` elements."""
    blocks = block_ids_on_rank(model, parallel, pp_rank)
    hops = train.microbatches * len(blocks) * (n - 1)  # per pass of the ring
    kv_hops = train.microbatches * _passes(model, parallel, pp_rank) * (n - 1)  # every pass of K, V
    kv, grads = ("K, V", "dK, dV") if carries == "heads" else ("the latent c_KV, k_R", "their gradients")
    recomputed = ", recomputed" if kv_hops > 2 * hops else ""
    items = []
    for op in ("send", "recv"):
        items.append({"what": f"ring attention: {kv} (forward{recomputed} and backward)", "axis": axis, "op": op,
                      "calls": kv_hops, "bytes": kv_hops * el * act_bytes})
        items.append({"what": f"ring attention: {grads} accumulated around the ring (backward)", "axis": axis,
                      "op": op, "calls": hops, "bytes": hops * el * max(act_bytes, 4)})
    return items


def cp_activation_table(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, cps=(1, 2, 4, 8),
                        seq_lens=None, bytes_per_el: int = 4) -> list[dict]:
    """Activation bytes per rank (minitron's engine, the first pipeline stage) for each
    sequence length in `seq_lens` (default: the model's) and each context degree in
    `cps` that divides it into 2N chunks: ``{seq_len, cp, activations_bytes, ratio}``,
    ratio = bytes at cp = 1 / bytes at cp = N (N for a perfect split)."""
    rows = []
    for s in seq_lens or (model.seq_len,):
        m = model.replace(seq_len=s)
        base = None
        for n in cps:
            if s % (2 * n):
                continue
            lay = dataclasses.replace(parallel, cp=n)
            acts = memory_on_rank(m, lay, train, 0, bytes_per_el)["activations_bytes"]
            base = acts if n == 1 else base
            rows.append({"seq_len": s, "cp": n, "activations_bytes": acts,
                         "ratio": base / acts if base else None})
    return rows




# --- the ring under a sliding window or packed documents -----------------------------------------
def chunk_reach_of(n: int, last: dict[int, int]) -> dict[tuple[int, int], int]:
    """Ring steps each chunk travels, by (owner rank o, slot k: 0 its early chunk o, 1 its
    late chunk 2N−1−o), when chunk b is seen by the query chunks b .. ``last[b]``: those are
    held by rank a (a < N) or 2N−1−a, which the chunk reaches after (holder − o) mod N
    steps; it travels to the farthest of them."""
    out = {}
    for o in range(n):
        for k, b in enumerate((o, 2 * n - 1 - o)):
            holders = [a if a < n else 2 * n - 1 - a for a in range(b, last[b] + 1)]
            out[(o, k)] = max((h - o) % n for h in holders)
    return out


def window_chunk_reach(n: int, c: int, window: int) -> dict[tuple[int, int], int]:
    """Ring steps each chunk travels under a causal window of `window` keys: chunk b is seen
    by the query chunks b .. b + ⌈(W−1)/c⌉ (:func:`chunk_reach_of`)."""
    ahead = -(-(window - 1) // c)
    return chunk_reach_of(n, {b: min(2 * n - 1, b + ahead) for b in range(2 * n)})


def document_last_chunks(n: int, c: int, lengths: list[list[int]], window: int = 0) -> dict[int, int]:
    """The last query chunk that sees key chunk b, with packed documents (--pack) of the
    given `lengths` per row (``packing.Documents.lengths``): the chunk holding the last token
    of the document that holds b's last token (documents are contiguous: no document
    touching b reaches further), the farthest over the rows (they share the messages);
    under a `window` at most ⌈(W−1)/c⌉ chunks ahead as well."""
    ahead = -(-(window - 1) // c) if window else 2 * n
    last = {}
    for b in range(2 * n):
        t, far = (b + 1) * c - 1, b
        for row in lengths:
            end = -1
            for length in row:  # the end of the document holding token t
                end += length
                if end >= t:
                    break
            far = max(far, end // c)
        last[b] = min(far, b + ahead, 2 * n - 1)
    return last


def document_balanced_last_chunks(n: int) -> dict[int, int]:
    """The last query chunk that sees key chunk b when the chunks are balanced per document:
    chunk 2N−1 (every document holds all 2N chunks, its last sees every earlier one)."""
    return {b: 2 * n - 1 for b in range(2 * n)}


def packed_attention_pairs(n: int, lengths: list[list[int]], balance: str = "sequence") -> list[int]:
    """The (query, key) pairs each of the N context ranks' queries attend to, over rows of
    packed documents of the given `lengths` (``Documents.lengths``): a query at position p
    of its document sees p + 1 keys. 'sequence': rank r holds chunks r and 2N−1−r of each
    row; 'document': of each document (lengths multiples of 2N)."""
    pairs = [0] * n
    for row in lengths:
        c, t = sum(row) // (2 * n), 0
        for length in row:
            for p in range(length):
                if balance == "document":
                    a = p // (length // (2 * n))
                else:
                    a = (t + p) // c
                pairs[a if a < n else 2 * n - 1 - a] += p + 1
            t += length
    return pairs


def packed_attention_flops(model: ModelConfig, parallel: ParallelConfig, lengths: list[list[int]],
                           balance: str = "sequence") -> list[float]:
    """Forward FLOPs of one layer's attention core on each context rank for rows of packed
    documents (QKᵀ and PV: 4·d per pair and query head of the rank's heads, heads/t):
    :func:`packed_attention_pairs` priced as ``model_flops`` prices a pair."""
    n, t = parallel.cp, parallel.tp
    return [4.0 * (model.heads // t) * model.head_dim * p for p in packed_attention_pairs(n, lengths, balance)]


def _window_hops(n: int, r: int, reach: dict) -> dict[str, list[int]]:
    """Chunks per message of context rank r in one layer: K, V sent and received at each
    hop of a ring pass, the backward's accumulators sent and received (zero-chunk
    messages are not sent)."""
    far = lambda o, past: sum(reach[(o, k)] > past for k in (0, 1))  # noqa: E731
    kv_send = [far((r - i) % n, i) for i in range(n - 1)]
    kv_recv = [far((r - 1 - i) % n, i) for i in range(n - 1)]
    acc_send, acc_recv = [], []
    for i in range(1, n):
        src = (r - i) % n
        onward, held = far(src, i), sum(reach[(src, k)] >= i for k in (0, 1))
        acc_send += [onward, held - onward]  # to the next rank; home to src
        acc_recv += [far((r - 1 - i) % n, i), sum(reach[(r, k)] == i for k in (0, 1))]
    return {name: [x for x in v if x] for name, v in
            (("kv_send", kv_send), ("kv_recv", kv_recv), ("acc_send", acc_send), ("acc_recv", acc_recv))}


def ring_kv_sends(n: int, c: int, window: int = 0, rows: list[list[int]] | None = None) -> tuple[int, int]:
    """(Messages, chunks) of K and V the busiest of a ring's `n` ranks sends in one layer's
    forward pass, chunks of `c` tokens: the whole ring's n − 1 messages of its two chunks
    for global attention, only the chunks a `window` (:func:`window_chunk_reach`) or the
    packed documents of `rows` (:func:`document_last_chunks`) let later queries see — the
    reach :func:`window_ring_items` traces. What the throughput model prices."""
    if rows is None and not window:
        return n - 1, 2 * (n - 1)
    reach = chunk_reach_of(n, document_last_chunks(n, c, rows, window)) if rows is not None \
        else window_chunk_reach(n, c, window)
    sends = [_window_hops(n, r, reach)["kv_send"] for r in range(n)]
    return max(len(x) for x in sends), max(sum(x) for x in sends)


def window_ring_items(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, cp_rank: int = 0,
                      pp_rank: int = 0, act_bytes: int = 4, documents: list | None = None,
                      balance: str = "sequence") -> list[dict]:
    """The ring's calls on the 'cp' axis of context rank `cp_rank` of pipeline stage `pp_rank`
    in one step when the model has a sliding window or packs documents: its windowed layers
    pass the chunks the window reaches (:func:`window_chunk_reach`), its global layers
    (``window_layers``) the whole ring of :func:`cp_comm_items`. With `documents` (--pack:
    the document lengths of each row, per microbatch of the rank's step, ``Documents.lengths``)
    every layer passes only the chunks the documents (and the window) let later queries see,
    microbatch by microbatch (:func:`document_last_chunks`; `balance` 'document': the chunks of
    every document, :func:`document_balanced_last_chunks`). ``{what, axis, op, calls, bytes}``."""
    n = parallel.cp
    t, _, b = _microbatch_of(parallel, train)
    chunk = b * (model.seq_len // (2 * n)) * kv_heads_per_rank(model, t) * sum(head_widths(model))
    return _window_items(model, parallel, train, n, cp_rank, pp_rank, act_bytes, chunk, "cp", documents, balance)


def _window_items(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, n: int, ring_rank: int,
                  pp_rank: int, act_bytes: int, chunk: int, axis: str, documents: list | None = None,
                  balance: str = "sequence") -> list[dict]:
    """:func:`window_ring_items` of a ring of `n` ranks on `axis` (the 'cp' ranks, or USP's
    'cp_ring' columns), seen from its rank `ring_rank`, whose chunks of s/(2n) tokens hold
    `chunk` elements of K and V."""
    m = train.microbatches
    c = model.seq_len // (2 * n)
    ids = block_ids_on_rank(model, parallel, pp_rank)
    whole = {"kv_send": [2] * (n - 1), "kv_recv": [2] * (n - 1), "acc_send": [2] * (n - 1), "acc_recv": [2] * (n - 1)}
    totals = {key: [0, 0] for key in whole}
    for rows in documents if documents is not None else [None] * m:
        for i in ids:
            w = model.window_of(i)
            if rows is not None:
                last = document_balanced_last_chunks(n) if balance == "document" else \
                    document_last_chunks(n, c, rows, w)
                hops = _window_hops(n, ring_rank, chunk_reach_of(n, last))
            else:
                hops = _window_hops(n, ring_rank, window_chunk_reach(n, c, w)) if w else whole
            for key, msgs in hops.items():
                passes = (_forwards(model, parallel, i) + 1) if key.startswith("kv") else 1
                totals[key][0] += passes * len(msgs)
                totals[key][1] += passes * sum(msgs) * chunk
    what = "packed documents" if documents is not None else "a sliding window"
    items = []
    for op in ("send", "recv"):
        kv, acc = totals[f"kv_{op}"], totals[f"acc_{op}"]
        items.append({"what": f"ring attention under {what}: the K, V chunks it reaches", "axis": axis,
                      "op": op, "calls": kv[0], "bytes": kv[1] * act_bytes})
        items.append({"what": f"ring attention under {what}: dK, dV accumulated, sent home", "axis": axis,
                      "op": op, "calls": acc[0], "bytes": acc[1] * max(act_bytes, 4)})
    return items
