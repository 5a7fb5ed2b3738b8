"""2-D (SUMMA) and 2.5-D (Tesseract) tensor parallelism by the numbers: what a rank of
the q×q×d grid sends, holds and keeps (``parallel/summa.py``; d = 1 is 2-D).

Communication of one SUMMA linear, one microbatch, one rank
-----------------------------------------------------------
``Y = X·W`` with X the rank's block of T = b/(q·d)·s tokens × h_in/q and W's block
h_in/q × h_out/q. Bytes are *call bytes*, as :class:`minitron.comm.CommTrace` records
them (a broadcast or a reduce: the block handed to the call; e bytes per element)::

    forward   q broadcasts of X blocks along the row      e·T·h_in/q each
              q broadcasts of W blocks along the column   e·h_in·h_out/q² each
    backward  q broadcasts of W blocks along the column   (for dX)
              q reduces of dX partials along the row      e·T·h_in/q each
              q broadcasts of X blocks along the row      (for dW)
              q reduces of dW partials along the column   e·h_in·h_out/q² each

One of the q calls on each line is the rank's own (it sends); a pipelined broadcast or
reduce of x bytes moves (n−1)/n·x out of each of the n ranks of the line on average
(:func:`wire_bytes`), so a product moves ``(q−1)/q²·(|X| + |W|)`` elements per device
forward (Optimus' cost; |X| is the batch of one depth, b/d sequences) and twice that
backward: SUMMA keeps no gathered copy, it broadcasts again.

The rest: each LayerNorm all-reduces two statistics per token along the row, forward
and backward (``2·e·T`` each). The embedding reduce-scatters its lookup of the depth's
b/d sequences along the column (backward: an all-gather of the T-token gradient). The
output layer is A·Bᵀ with B = wte: q broadcasts of wte blocks along the column and q
reduces of partial logits ``e·T·V'/q`` along the row forward; backward q broadcasts of
logit-gradient blocks along the row, q of wte blocks along the column and q reduces of
wte-gradient partials along the column. The cross-entropy all-reduces max, target logit
and sum of exponentials along the row (``e'·T``, e' = max(e, 4)), the loss itself one
scalar along the column and one along the depth. Once per step the gradients of the
replicated parameters are summed: vectors (biases, LayerNorms, wpe) over the column and
the depth, matrices (and wte) over the depth — 2.5-D's weight-gradient reduction.

Activations a SUMMA block keeps (no dropout, no recomputation)
--------------------------------------------------------------
T = b/(q·d)·s tokens per rank; every saved tensor is a local block::

    ln1, ln2          x̂ e·T·h/q and 1/σ e·T
    QKV, proj, fc,    the local input block (SUMMA keeps no gathered copy): e·T·h/q
    fc2               (proj's input is SDPA's output), e·T·f/q for fc2
    attention         QKV output 3·e·T·h/q; SDPA's output e·T·h/q and logsumexp
                      e'·b/(q·d)·a/q·s
    GELU input        e·T·f/q

so a layer keeps 1/(q²·d) of the single-device layer's activations, without the q×
gathered inputs and weights the cube keeps.
"""
from __future__ import annotations

from ..config import (INDEX_BYTES, ModelConfig, ParallelConfig, TrainConfig, element_bytes, pad_vocab,
                      square_edge, statistics_bytes)
from ..parallel.schedule_actions import SPLIT_BACKWARD
from .calls import StepCalls, bytes_by_axis, call, ring_allreduce_wire_bytes, wire_bytes
from .flops import recompute_policy
from .params import activation_element_bytes, layers_on_rank, layout_placement, params_on_rank

__all__ = ["grid_shape", "summa_vocab", "linear_calls", "linear_wire_bytes", "embedding_calls", "output_calls",
           "layer_norm_calls", "loss_calls", "layer_calls", "summa_collectives", "grad_sync_calls",
           "summa_comm_items", "summa_comm_bytes_per_step", "wire_bytes", "summa_saved_bytes_per_layer",
           "saved_bytes_per_microbatch", "params_per_device", "layer_wire_bytes",
           "layer_grad_sync_wire_bytes"]

ROW, COL, DEP = "summa_row", "summa_col", "summa_dep"


def grid_shape(tp: int, depth: int = 1) -> int:
    """q of a q×q×d grid of `tp` ranks (ValueError when tp is not q²·d)."""
    q = square_edge(tp // depth) if depth >= 1 and tp % depth == 0 else 0
    if q < 1 or q * q * depth != tp:
        raise ValueError(f"{tp} tensor ranks are not q²·d for d = {depth}")
    return q


def summa_vocab(model: ModelConfig, q: int) -> int:
    """V': the vocabulary padded to a multiple of q (rows split over the column)."""
    return pad_vocab(model.vocab, q)


# --------------------------------------------------------------------------------------
# Calls of one layer type, one microbatch (bytes per call)
# --------------------------------------------------------------------------------------
def linear_calls(micro_batch: int, seq_len: int, d_in: int, d_out: int, q: int, depth: int = 1,
                 bytes_per_el: int = 4, what: str = "linear", act_bytes_per_el: int | None = None) -> list[dict]:
    """The collectives of one SUMMA linear for one microbatch of `micro_batch` sequences
    (module docstring; ``calls`` = q of each). Empty when q = 1. The weight blocks and
    their gradients travel in `bytes_per_el`, activations in `act_bytes_per_el`."""
    if q == 1:
        return []
    ea = act_bytes_per_el or bytes_per_el
    x = ea * micro_batch // (q * depth) * seq_len * d_in // q
    w = bytes_per_el * (d_out // q) * (d_in // q)
    return [call(f"{what}: input blocks broadcast", "fwd", "broadcast", ROW, x, q),
            call(f"{what}: weight blocks broadcast", "fwd", "broadcast", COL, w, q),
            call(f"{what}: weight blocks broadcast (for dX)", "bwd", "broadcast", COL, w, q),
            call(f"{what}: input-grad partials reduce", "bwd", "reduce", ROW, x, q),
            call(f"{what}: input blocks broadcast (for dW)", "bwd", "broadcast", ROW, x, q),
            call(f"{what}: weight-grad partials reduce", "bwd", "reduce", COL, w, q)]


def linear_wire_bytes(micro_batch: int, seq_len: int, d_in: int, d_out: int, q: int,
                      bytes_per_el: int = 4) -> dict:
    """Wire bytes of one SUMMA linear per direction on one 2-D grid, from its calls,
    beside Optimus' ``(q−1)/q²·(|X| + |W|)`` per product (forward one product,
    backward two)."""
    out = {"fwd": 0.0, "bwd": 0.0}
    for c in linear_calls(micro_batch, seq_len, d_in, d_out, q, 1, bytes_per_el):
        out[c["phase"]] += c["calls"] * wire_bytes(c, q)
    tokens = micro_batch * seq_len
    out["formula"] = bytes_per_el * (q - 1) / q**2 * (tokens * d_in + d_in * d_out)
    return out


def embedding_calls(micro_batch: int, seq_len: int, h: int, q: int, depth: int = 1,
                    act_bytes_per_el: int = 4) -> list[dict]:
    """The token lookup: the depth's b/d sequences reduce-scattered along the column
    (backward: the gradient of this rank's T tokens all-gathered)."""
    if q == 1:
        return []
    full = act_bytes_per_el * micro_batch // depth * seq_len * h // q
    return [call("embedding: lookup reduce-scatter", "fwd", "reduce_scatter", COL, full),
            call("embedding: output-grad all-gather", "bwd", "all_gather", COL, full // q)]


def output_calls(micro_batch: int, seq_len: int, h: int, vocab_padded: int, q: int, depth: int = 1,
                 bytes_per_el: int = 4, act_bytes_per_el: int | None = None,
                 split_backward: bool = False) -> list[dict]:
    """The output layer ``x·wteᵀ`` (SUMMA's A·Bᵀ), ``calls`` = q of each. With
    `split_backward` (zb-h1: the input gradient in B, the weight gradient later in W)
    the logit-gradient blocks are broadcast again in W."""
    if q == 1:
        return []
    ea = act_bytes_per_el or bytes_per_el
    z = ea * micro_batch // (q * depth) * seq_len * vocab_padded // q
    w = bytes_per_el * (vocab_padded // q) * (h // q)
    return [call("output layer: wte blocks broadcast", "fwd", "broadcast", COL, w, q),
            call("output layer: logit partials reduce", "fwd", "reduce", ROW, z, q),
            call("output layer: logit-grad blocks broadcast", "bwd", "broadcast", ROW, z,
                  2 * q if split_backward else q),
            call("output layer: wte blocks broadcast (for dX)", "bwd", "broadcast", COL, w, q),
            call("output layer: wte-grad partials reduce", "bwd", "reduce", COL, w, q)]


def layer_norm_calls(micro_batch: int, seq_len: int, q: int, depth: int = 1, bytes_per_el: int = 4,
                     what: str = "layernorm") -> list[dict]:
    """LayerNorm: (Σx, Σx²) forward and (Σg, Σg·x̂) backward, along the row."""
    if q == 1:
        return []
    n = bytes_per_el * micro_batch // (q * depth) * seq_len * 2
    return [call(f"{what}: statistics", "fwd", "all_reduce", ROW, n),
            call(f"{what}: gradient statistics", "bwd", "all_reduce", ROW, n)]


def loss_calls(micro_batch: int, seq_len: int, q: int, depth: int = 1, loss_bytes_per_el: int = 4) -> list[dict]:
    """Vocabulary-parallel cross-entropy along the row (max, target logit, sum of
    exponentials), then the mean of the q·d pieces' losses: one scalar along the column,
    one along the depth."""
    out = []
    if q > 1:
        n = loss_bytes_per_el * micro_batch // (q * depth) * seq_len
        out += [call("cross-entropy: max, target logit, sum exp", "fwd", "all_reduce", ROW, n, calls=3),
                call("loss: mean over the batch pieces", "fwd", "all_reduce", COL, loss_bytes_per_el)]
    if depth > 1:
        out.append(call("loss: mean over the batch pieces", "fwd", "all_reduce", DEP, loss_bytes_per_el))
    return out


def layer_calls(model: ModelConfig, micro_batch: int, q: int, depth: int = 1, bytes_per_el: int = 4,
                recompute: str = "none", act_bytes_per_el: int | None = None) -> list[dict]:
    """The collectives of one transformer layer for one microbatch; with full
    recomputation the forward calls run again in the backward."""
    b, s, h, f, e, ea, d = micro_batch, model.seq_len, model.hidden, model.ffn_hidden, bytes_per_el, \
        act_bytes_per_el, depth
    out = (layer_norm_calls(b, s, q, d, e, "ln1")
           + linear_calls(b, s, h, 3 * h, q, d, e, "qkv", ea)
           + linear_calls(b, s, h, h, q, d, e, "proj", ea)
           + layer_norm_calls(b, s, q, d, e, "ln2")
           + linear_calls(b, s, h, f, q, d, e, "fc", ea)
           + linear_calls(b, s, f, h, q, d, e, "fc2", ea))
    if recompute_policy(recompute) == "full":
        out += [{**c, "phase": "bwd", "what": c["what"] + " (replayed)"} for c in out if c["phase"] == "fwd"]
    return out


def summa_collectives(model: ModelConfig, micro_batch: int, q: int, depth: int = 1, layers: int | None = None,
                      first: bool = True, last: bool = True, bytes_per_el: int = 4,
                      loss_bytes_per_el: int | None = None, recompute: str = "none",
                      act_bytes_per_el: int | None = None, split_backward: bool = False) -> list[dict]:
    """Every grid collective of one microbatch on one rank (``calls`` per item, `bytes`
    per call), in forward order; `first`/`last`: the rank holds the embedding / the
    output layer and loss; `split_backward`: zb-h1's B/W split (:func:`output_calls`)."""
    b, s, h, e = micro_batch, model.seq_len, model.hidden, bytes_per_el
    ea = act_bytes_per_el or e
    out: list[dict] = []
    if first:
        out += embedding_calls(b, s, h, q, depth, ea)
    for _ in range(model.layers if layers is None else layers):
        out += layer_calls(model, b, q, depth, e, recompute, ea)
    if last:
        out += layer_norm_calls(b, s, q, depth, e, "ln_f")
        out += output_calls(b, s, h, summa_vocab(model, q), q, depth, e, ea, split_backward)
        out += loss_calls(b, s, q, depth, loss_bytes_per_el or statistics_bytes(e))
    return out


def grad_sync_calls(model: ModelConfig, q: int, depth: int, layers: int, first: bool, last: bool,
                    bytes_per_el: int = 4, chunks: int = 1) -> list[dict]:
    """Once per step: every replicated parameter's gradient summed where its copies
    live (``ShardInfo.grad_sync``, ``optim.sync_replicated_grads``): vectors over the
    column and the depth, matrices and the embeddings over the depth. (The tied
    embedding's sum between the first and the last stage is counted apart.)"""
    h, f, s, e = model.hidden, model.ffn_hidden, model.seq_len, bytes_per_el
    vq = summa_vocab(model, q) // q
    vec, mat = [COL, DEP], [DEP]
    per_layer = ([(h // q, vec)] * 2 + [(3 * h // q * (h // q), mat), (3 * h // q, vec)]
                 + [((h // q) ** 2, mat), (h // q, vec)] + [(h // q, vec)] * 2
                 + [(f // q * (h // q), mat), (f // q, vec), (h // q * (f // q), mat), (h // q, vec)])
    params = per_layer * layers
    if first:
        params += [(vq * (h // q), mat), (s * h // q, vec)]
    if last:
        params += [(h // q, vec)] * 2
        if not model.tied_embeddings or chunks > 1:
            params.append((vq * (h // q), mat))
    out = []
    for n, axes in params:
        for axis in axes:
            if (axis == COL and q > 1) or (axis == DEP and depth > 1):
                out.append(call("replicated parameter gradients", "optim", "all_reduce", axis, e * n))
    return out


# --------------------------------------------------------------------------------------
# A whole step, in the format of analysis.comm.comm_items
# --------------------------------------------------------------------------------------
def summa_comm_items(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, pp_rank: int = 0,
                     dtype_bytes: int | None = None) -> list[dict]:
    """Every kind of call a grid rank of pipeline stage `pp_rank` makes in one step:
    ``{what, axis, op, calls, bytes}`` with `bytes` summed over the step (as
    :func:`minitron.analysis.comm.comm_items`; the 'log' all-reduce of the loss is not
    counted). Grid, pipeline, tied-embedding and data-parallel axes."""
    e = dtype_bytes or element_bytes(train.dtype)
    ea = activation_element_bytes(parallel, e)
    depth = parallel.tp_depth
    q, p, d = grid_shape(parallel.tp, depth), parallel.pp, parallel.dp
    m = train.microbatches
    b = train.global_batch // (d * m)
    first, last = layout_placement(parallel).holds_ends(pp_rank)
    n_layers = layers_on_rank(model, parallel, pp_rank)
    step = StepCalls()
    # zb-h1, zb-v, dualpipe-v: B the input gradient, W the weight gradients (parallel/schedule_actions.py)
    split_backward = p > 1 and parallel.schedule in SPLIT_BACKWARD
    step.add_per_microbatch(summa_collectives(model, b, q, depth, n_layers, first, last, e, recompute=parallel.recompute,
                                              act_bytes_per_el=ea, split_backward=split_backward), m)
    step.add_per_step(grad_sync_calls(model, q, depth, n_layers, first, last, e, p * parallel.vpp))
    boundary = ea * b // (q * depth) * model.seq_len * model.hidden // q
    tied = e * summa_vocab(model, q) // q * model.hidden // q
    step.add_outside_grid(model, parallel, pp_rank, m, boundary, tied, e)
    return step.items()


def summa_comm_bytes_per_step(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                              pp_rank: int = 0, dtype_bytes: int | None = None) -> dict:
    """Call bytes per step on one grid rank, ``{axis: {op: bytes}}``."""
    return bytes_by_axis(summa_comm_items(model, parallel, train, pp_rank, dtype_bytes))


# --------------------------------------------------------------------------------------
# Activations (what the engine saves) and parameters
# --------------------------------------------------------------------------------------
def summa_saved_bytes_per_layer(model: ModelConfig, micro_batch: int, q: int, depth: int = 1,
                                bytes_per_el: int = 4) -> dict[str, int]:
    """Bytes one ``Block`` on the grid keeps for its backward, per item (module
    docstring); exact for float32/float64 without dropout or recomputation."""
    s, h, f, a, e = model.seq_len, model.hidden, model.ffn_hidden, model.heads, bytes_per_el
    bl = micro_batch // (q * depth)
    T, hq, fq = bl * s, h // q, f // q
    return {"ln1 x̂, 1/σ": e * T * hq + e * T, "qkv input": e * T * hq, "QKV output (Q, K, V)": 3 * e * T * hq,
            "SDPA output (proj input)": e * T * hq, "SDPA logsumexp": statistics_bytes(e) * bl * (a // q) * s,
            "ln2 x̂, 1/σ": e * T * hq + e * T, "fc input": e * T * hq, "GELU input": e * T * fq,
            "fc2 input": e * T * fq}


def saved_bytes_per_microbatch(model: ModelConfig, micro_batch: int, tp: int, depth: int = 1,
                               bytes_per_el: int = 4, first: bool = True, last: bool = True,
                               layers: int | None = None) -> dict[str, int]:
    """Bytes the whole model (or a stage) keeps for one microbatch on one grid rank, by
    part: 'embedding' (the depth's token ids, int64, and the out-of-slice mask), 'layers',
    'head and loss' (ln_f, the output layer's input, the cross-entropy's softmax, target
    indices and mask). No dropout, no recomputation, float32/float64."""
    q, e, s, h = grid_shape(tp, depth), bytes_per_el, model.seq_len, model.hidden
    T, vq = micro_batch // (q * depth) * s, summa_vocab(model, q) // q
    out = {}
    if first:
        out["embedding"] = 9 * micro_batch // depth * s
    if last:
        out["head and loss"] = 2 * e * T * (h // q) + e * T + statistics_bytes(e) * T * vq + INDEX_BYTES * T + T
    L = model.layers if layers is None else layers
    out["layers"] = L * sum(summa_saved_bytes_per_layer(model, micro_batch, q, depth, e).values())
    return out


def params_per_device(model: ModelConfig, tp: int, depth: int = 1) -> dict[str, int]:
    """Parameter elements per device on the grid, one layer and the whole model (the
    same as 2-D on q² ranks: the d copies hold the same blocks)."""
    layout = ParallelConfig(tp=tp, tp_mode="2.5d" if depth > 1 else "2d", tp_depth=depth)
    q, h, f = grid_shape(tp, depth), model.hidden, model.ffn_hidden
    return {"layer": (4 * h * h + 2 * h * f) // (q * q) + (9 * h + f) // q,
            "model": params_on_rank(model, layout)}


def layer_wire_bytes(model: ModelConfig, micro_batch: int, tp: int, depth: int = 1,
                     bytes_per_el: int = 4) -> float:
    """Bytes one rank sends for one transformer layer, one microbatch, forward and
    backward (pipelined broadcasts and reduces, ring all-reduces)."""
    q = grid_shape(tp, depth)
    return sum(c["calls"] * wire_bytes(c, q) for c in layer_calls(model, micro_batch, q, depth, bytes_per_el))


def layer_grad_sync_wire_bytes(model: ModelConfig, tp: int, depth: int = 1, bytes_per_el: int = 4) -> float:
    """Bytes one rank sends once per step for one layer's replicated gradients (ring
    all-reduces: vectors over the column and the depth, matrices over the depth —
    Tesseract's weight-gradient reduction, zero for 2-D's matrices)."""
    q = grid_shape(tp, depth)
    return sum(ring_allreduce_wire_bytes(c["bytes"], q if c["axis"] == COL else depth)
               for c in grad_sync_calls(model, q, depth, 1, False, False, bytes_per_el))
