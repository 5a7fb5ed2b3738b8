"""3-D tensor parallelism by the numbers: what the cube sends, holds and keeps, next to
1-D (Megatron) and 2-D (SUMMA; the engine's 2-D and 2.5-D are in ``analysis/summa.py``, all
four schemes side by side in ``analysis/tp_schemes.py``).

Communication of one Linear3D, one microbatch, one rank
-------------------------------------------------------
``Y = X·W`` on placement (a, c) with X of B = b·s tokens (b sequences of the
data-parallel microbatch on the cube), q³ ranks. Bytes are *call bytes*, as
:class:`minitron.comm.CommTrace` records them: the local shard for all-gather, the
full local input for reduce-scatter (e bytes per element)::

    forward   all-gather X along a         e·B·h_in/q³       (the local input)
              all-gather W along i         e·h_in·h_out/q³   (the local weight)
              reduce-scatter Y along c     e·B·h_out/q²      (the partial product)
    backward  all-gather dY along c        e·B·h_out/q³
              reduce-scatter dX along a    e·B·h_in/q²
              reduce-scatter dW along i    e·h_in·h_out/q²

On a ring an all-gather sends (q−1)× its shard and a reduce-scatter (q−1)/q of its
input, so each direction moves ``(q−1)/q³·(B·h_in + h_in·h_out + B·h_out)`` elements out
of every rank: Bian et al.'s formula, :func:`minitron.analysis.comm.cube_linear_elements`
(:func:`linear_wire_bytes` checks it). :func:`linear_calls` lists the six calls. Under
--tp-overlap the weight's all-gather is made in ``parallel.cube.weight_pieces`` calls (two
halves of its output rows, the second in flight under the first's product): the same
bytes in more calls.

The rest of the model on the cube (``parallel/cube.py``): each LayerNorm all-reduces
two statistics per token along the hidden-split line (k), forward and backward
(``2·e·B/q²`` each). The embedding all-gathers its weight along i and reduce-scatters its
output along j (the token ids need no gather); the output layer is a Linear3D with
h_in = h, h_out = V' (vocabulary padded to q²) on placement (j, k); the cross-entropy
all-reduces max, target logit and sum of exponentials (``e'·B/q²`` each) along j and the
loss itself along i and k (one scalar each). Once per step the gradients of the
replicated vectors (biases, LayerNorms, wpe) are summed over their plane: one
all-reduce per line of the plane per vector. :func:`cube_collectives` lists the calls of
a microbatch, :func:`cube_comm_items` those of a step in the format of
:func:`minitron.analysis.comm.comm_items`.

Where 3-D wins and where it loses
---------------------------------
1-D never moves weights: per layer it all-reduces B·h four times (2 forward, 2
backward), ``8·(t−1)/t·B·h`` elements on a ring, whatever h is. 3-D moves
``2·(q−1)/q³·Σ(B·h_in + h_in·h_out + B·h_out)`` over the four linears: activations
shrink as 1/q² per device, but the weight term ``12h²·(q−1)/q³`` does not depend on the
batch. With many tokens per step (B ≫ h) 3-D wins; when ``h² ≫ B·h`` (few tokens, huge
hidden) the weight all-gathers dominate and 1-D wins. :func:`compare_schemes` tabulates
communication, parameters and activations per device for 1-D, 2-D and 3-D.

Activations the cube keeps
--------------------------
:func:`cube_saved_bytes_per_layer` counts what a ``Block`` on the cube saves for its
backward, one item per tensor (T = b·s/q² tokens per rank, e bytes, e' = max(e, 4) for
statistics)::

    ln1, ln2          x̂ e·T·h/q and 1/σ e·T          (LayerNorm3D saves no input)
    QKV, proj, fc,    the *gathered* input q·e·T·d_in/q and the gathered weight
    fc2               e·d_out/q·d_in/q               (autograd's matmul keeps both)
    attention         QKV output 3·e·T·h/q (Q, K, V are views of it); SDPA's
                      output e·T·h/q and logsumexp e'·b/q²·a/q·s
                      (dropout > 0: softmax output, mask, dropped probabilities,
                      e·b/q²·a/q·s² + b/q²·a/q·s² + e·b/q²·a/q·s²)
    GELU input        e·T·f/q
    residual masks    2·T·h/q bytes (dropout > 0)

The gathered inputs are q times the local activation: saving the local shard and
gathering again in the backward would trade that memory for one more all-gather per
linear (Colossal-AI's layers, like minitron's, keep the gathered copy).
"""
from __future__ import annotations

from ..config import (INDEX_BYTES, ModelConfig, ParallelConfig, TrainConfig, cube_edge, element_bytes,
                      pad_vocab, square_edge, statistics_bytes)
from ..parallel.cube import weight_pieces
from .calls import StepCalls, bytes_by_axis, call, ring_allreduce_wire_bytes, wire_bytes
from .comm import cube_linear_elements, summa_linear_elements
from .flops import recompute_policy
from .memory import saved_bytes_per_layer
from .params import activation_element_bytes, layers_on_rank, layout_placement, local_layer_params, params_on_rank

__all__ = ["cube_q", "cube_vocab", "linear_calls", "linear_wire_bytes", "embedding_calls",
           "layer_norm_calls", "loss_calls", "layer_calls", "cube_collectives", "grad_sync_calls",
           "cube_comm_items", "cube_comm_bytes_per_step", "wire_bytes", "cube_saved_bytes_per_layer",
           "saved_bytes_per_microbatch", "params_per_device", "compare_schemes"]

I, J, K = "cube_i", "cube_j", "cube_k"
FIRST, SECOND = (J, K), (K, J)  # placements (a, c): the residual stream, and inside a pair


def cube_q(tp: int) -> int:
    q = cube_edge(tp)
    if q ** 3 != tp:
        raise ValueError(f"{tp} tensor ranks are not a cube (8, 27, 64, ...)")
    return q


def cube_vocab(model: ModelConfig, q: int) -> int:
    """V': the vocabulary padded to a multiple of q² (rows split over the (j, i) plane)."""
    return pad_vocab(model.vocab, q * q)


# --------------------------------------------------------------------------------------
# Calls of one layer type, one microbatch (bytes per call)
# --------------------------------------------------------------------------------------
def linear_calls(micro_batch: int, seq_len: int, d_in: int, d_out: int, q: int, bytes_per_el: int = 4,
                 placement: tuple[str, str] = FIRST, what: str = "linear",
                 act_bytes_per_el: int | None = None, pieces: int = 1) -> list[dict]:
    """The six collectives of one Linear3D on placement (a, c) for one microbatch of
    `micro_batch` sequences (module docstring). Empty when q = 1. The weight and its
    gradient travel in `bytes_per_el`, activations and theirs in `act_bytes_per_el`
    (default the same; 2 under bf16, ``Comm.wire_dtype``). `pieces`: the weight's
    all-gather made in that many calls of a piece each (--tp-overlap,
    ``parallel.cube.weight_pieces``), the same bytes."""
    if q == 1:
        return []
    a, c = placement
    e, b, s = bytes_per_el, micro_batch, seq_len
    ea = act_bytes_per_el or e
    return [
        call(f"{what}: input all-gather", "fwd", "all_gather", a, ea * b // (q * q) * s * d_in // q),
        call(f"{what}: weight all-gather", "fwd", "all_gather", I, e * d_out // q * d_in // (q * q) // pieces, pieces),
        call(f"{what}: output reduce-scatter", "fwd", "reduce_scatter", c, ea * b // q * s * d_out // q),
        call(f"{what}: output-grad all-gather", "bwd", "all_gather", c, ea * b // (q * q) * s * d_out // q),
        call(f"{what}: input-grad reduce-scatter", "bwd", "reduce_scatter", a, ea * b // q * s * d_in // q),
        call(f"{what}: weight-grad reduce-scatter", "bwd", "reduce_scatter", I, e * d_out // q * d_in // q),
    ]


def linear_wire_bytes(micro_batch: int, seq_len: int, d_in: int, d_out: int, q: int,
                      bytes_per_el: int = 4) -> dict:
    """Ring wire bytes of one Linear3D per direction, from its calls; each equals
    ``e · cube_linear_elements(b·s, d_in, d_out, q)`` (Bian et al.)."""
    out = {"fwd": 0.0, "bwd": 0.0}
    for c in linear_calls(micro_batch, seq_len, d_in, d_out, q, bytes_per_el):
        out[c["phase"]] += wire_bytes(c, q)
    out["formula"] = bytes_per_el * cube_linear_elements(micro_batch * seq_len, d_in, d_out, q)
    return out


def embedding_calls(micro_batch: int, seq_len: int, vocab_padded: int, h: int, q: int,
                    bytes_per_el: int = 4, act_bytes_per_el: int | None = None) -> list[dict]:
    """The token embedding on the cube (a Linear3D on placement (k, j) whose input, the
    token ids, every rank already holds): no input all-gather, no input gradient."""
    if q == 1:
        return []
    return [c for c in linear_calls(micro_batch, seq_len, vocab_padded, h, q, bytes_per_el, SECOND, "embedding",
                                    act_bytes_per_el)
            if "input" not in c["what"]]


def layer_norm_calls(micro_batch: int, seq_len: int, q: int, bytes_per_el: int = 4,
                     what: str = "layernorm") -> list[dict]:
    """LayerNorm3D: (Σx, Σx²) forward and (Σg, Σg·x̂) backward, along k."""
    if q == 1:
        return []
    n = bytes_per_el * micro_batch // (q * q) * seq_len * 2
    return [call(f"{what}: statistics", "fwd", "all_reduce", K, n),
            call(f"{what}: gradient statistics", "bwd", "all_reduce", K, n)]


def loss_calls(micro_batch: int, seq_len: int, q: int, loss_bytes_per_el: int = 4) -> list[dict]:
    """Vocabulary-parallel cross-entropy along j (max, target logit, sum of exponentials),
    then the mean of the q² batch pieces' losses: one scalar along i, one along k."""
    if q == 1:
        return []
    n = loss_bytes_per_el * micro_batch // (q * q) * seq_len
    return [call("cross-entropy: max, target logit, sum exp", "fwd", "all_reduce", J, n, calls=3),
            call("loss: mean over the batch pieces", "fwd", "all_reduce", I, loss_bytes_per_el),
            call("loss: mean over the batch pieces", "fwd", "all_reduce", K, loss_bytes_per_el)]


def layer_calls(model: ModelConfig, micro_batch: int, q: int, bytes_per_el: int = 4,
                recompute: str = "none", act_bytes_per_el: int | None = None, overlap: bool = False) -> list[dict]:
    """The collectives of one transformer layer for one microbatch; with full
    recomputation the forward calls run again in the backward. LayerNorm statistics
    stay in `bytes_per_el` (sums of the fp32 residual stream under bf16 autocast).
    `overlap` (--tp-overlap): each weight gathered in ``weight_pieces`` of its d_out/q rows."""
    b, s, h, f, e = micro_batch, model.seq_len, model.hidden, model.ffn_hidden, bytes_per_el
    ea = act_bytes_per_el

    def linear(d_in, d_out, placement, what):
        return linear_calls(b, s, d_in, d_out, q, e, placement, what, ea, weight_pieces(d_out // q, overlap))
    out = (layer_norm_calls(b, s, q, e, "ln1") + linear(h, 3 * h, FIRST, "qkv") + linear(h, h, SECOND, "proj")
           + layer_norm_calls(b, s, q, e, "ln2") + linear(h, f, FIRST, "fc") + linear(f, h, SECOND, "fc2"))
    if recompute_policy(recompute) == "full":
        out += [{**c, "phase": "bwd", "what": c["what"] + " (replayed)"} for c in out if c["phase"] == "fwd"]
    return out


def cube_collectives(model: ModelConfig, micro_batch: int, q: int, layers: int | None = None,
                     first: bool = True, last: bool = True, bytes_per_el: int = 4,
                     loss_bytes_per_el: int | None = None, recompute: str = "none",
                     act_bytes_per_el: int | None = None, overlap: bool = False) -> list[dict]:
    """Every cube collective of one microbatch on one rank (``calls`` per item, `bytes`
    per call), in forward order; `first`/`last`: the rank holds the embedding / the
    output layer and loss. `act_bytes_per_el`: activations on the wire (2 under bf16).
    `overlap` (--tp-overlap): the linears' and the output layer's weights gathered in
    pieces (the output layer's local rows are wte's V'/q²); the embedding's lookup stays whole."""
    b, s, h, e, ea = micro_batch, model.seq_len, model.hidden, bytes_per_el, act_bytes_per_el
    vp = cube_vocab(model, q)
    out: list[dict] = []
    if first:
        out += embedding_calls(b, s, vp, h, q, e, ea)
    for _ in range(model.layers if layers is None else layers):
        out += layer_calls(model, b, q, e, recompute, ea, overlap)
    if last:
        out += layer_norm_calls(b, s, q, e, "ln_f")
        out += linear_calls(b, s, h, vp, q, e, FIRST, "output layer", ea, weight_pieces(vp // (q * q), overlap))
        out += loss_calls(b, s, q, loss_bytes_per_el or statistics_bytes(e))
    return out


def grad_sync_calls(model: ModelConfig, q: int, layers: int, first: bool, last: bool,
                    bytes_per_el: int = 4) -> list[dict]:
    """Once per step: the gradient of every replicated vector summed over its plane,
    one all-reduce per line (``ShardInfo.grad_sync``, ``optim.sync_replicated_grads``)."""
    if q == 1:
        return []
    h, f, s, e = model.hidden, model.ffn_hidden, model.seq_len, bytes_per_el
    ij = [(h // q, (I, J))]  # one vector of the residual placement: hidden slice k, plane (i, j)
    per_layer = ij * 2 + [(3 * h // q, (I, K))] + ij + ij * 2 + [(f // q, (I, K))] + ij
    vectors = per_layer * layers + ([(s * h // q, (I, J))] if first else []) + (ij * 2 if last else [])
    out = []
    for n, axes in vectors:
        for axis in axes:
            out.append(call("replicated vector gradients (plane sum)", "optim", "all_reduce", axis, e * n))
    return out


# --------------------------------------------------------------------------------------
# A whole step, in the format of analysis.comm.comm_items
# --------------------------------------------------------------------------------------
def cube_comm_items(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, pp_rank: int = 0,
                    dtype_bytes: int | None = None) -> list[dict]:
    """Every kind of call a cube rank of pipeline stage `pp_rank` makes in one step:
    ``{what, axis, op, calls, bytes}`` with `bytes` summed over the step (as
    :func:`minitron.analysis.comm.comm_items`; the 'log' all-reduce of the loss is not
    counted). Tensor (cube), pipeline, tied-embedding and data-parallel axes."""
    e = dtype_bytes or element_bytes(train.dtype)
    ea = activation_element_bytes(parallel, e)
    q, d = cube_q(parallel.tp), parallel.dp
    m = train.microbatches
    b = train.global_batch // (d * m)
    first, last = layout_placement(parallel).holds_ends(pp_rank)
    n_layers = layers_on_rank(model, parallel, pp_rank)
    step = StepCalls()
    step.add_per_microbatch(cube_collectives(model, b, q, n_layers, first, last, e, recompute=parallel.recompute,
                                             act_bytes_per_el=ea, overlap=parallel.tp_overlap), m)
    step.add_per_step(grad_sync_calls(model, q, n_layers, first, last, e))
    boundary = ea * b // (q * q) * model.seq_len * model.hidden // q
    tied = e * cube_vocab(model, q) // (q * q) * model.hidden // q
    step.add_outside_grid(model, parallel, pp_rank, m, boundary, tied, e)
    return step.items()


def cube_comm_bytes_per_step(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                             pp_rank: int = 0, dtype_bytes: int | None = None) -> dict:
    """Call bytes per step on one cube rank, ``{axis: {op: bytes}}``."""
    return bytes_by_axis(cube_comm_items(model, parallel, train, pp_rank, dtype_bytes))


# --------------------------------------------------------------------------------------
# Activations (what the engine saves) and parameters
# --------------------------------------------------------------------------------------
def cube_saved_bytes_per_layer(model: ModelConfig, micro_batch: int, q: int, bytes_per_el: int = 4,
                               dropout: bool | None = None) -> dict[str, int]:
    """Bytes one ``Block`` on the cube keeps for its backward, per item (module
    docstring); exact for float32/float64 without recomputation."""
    s, h, f, a, e = model.seq_len, model.hidden, model.ffn_hidden, model.heads, bytes_per_el
    es = statistics_bytes(e)
    drop = model.dropout > 0 if dropout is None else dropout
    bl, al = micro_batch // (q * q), a // q
    T, hq, fq = bl * s, h // q, f // q
    out = {"ln1 x̂, 1/σ": e * T * hq + e * T,
           "qkv gathered input": e * q * T * hq, "qkv gathered weight": e * 3 * hq * hq,
           "QKV output (Q, K, V)": 3 * e * T * hq}
    if drop:
        out["softmax output"] = e * bl * al * s * s
        out["attention dropout mask"] = bl * al * s * s
        out["dropped probabilities"] = e * bl * al * s * s
    else:
        out["SDPA output"] = e * T * hq
        out["SDPA logsumexp"] = es * bl * al * s
    out.update({"proj gathered input": e * q * T * hq, "proj gathered weight": e * hq * hq,
                "ln2 x̂, 1/σ": e * T * hq + e * T,
                "fc gathered input": e * q * T * hq, "fc gathered weight": e * fq * hq,
                "GELU input": e * T * fq,
                "fc2 gathered input": e * q * T * fq, "fc2 gathered weight": e * hq * fq})
    if drop:
        out["residual dropout masks"] = 2 * T * hq
    if q == 1:  # nothing is gathered: the weights are the parameters, proj's input is SDPA's output
        out = {k: v for k, v in out.items() if "weight" not in k and k != "proj gathered input"}
    return out


def saved_bytes_per_microbatch(model: ModelConfig, micro_batch: int, tp: int, tp_mode: str = "1d",
                               bytes_per_el: int = 4, first: bool = True, last: bool = True,
                               layers: int | None = None) -> dict[str, int]:
    """Bytes the whole model (or a stage) keeps for one microbatch on one tensor rank,
    by part: 'embedding', 'layers', 'head and loss'. 1-D layers from
    :func:`minitron.analysis.memory.saved_bytes_per_layer`; no dropout, no
    recomputation, float32/float64."""
    b, s, h, e = micro_batch, model.seq_len, model.hidden, bytes_per_el
    es = statistics_bytes(e)
    L = model.layers if layers is None else layers
    out = {}
    if tp_mode == "3d":
        q = cube_q(tp)
        T, hq, vq = b // (q * q) * s, h // q, cube_vocab(model, q) // q
        per_layer = sum(cube_saved_bytes_per_layer(model, b, q, e, dropout=False).values())
        if first:  # token ids of batch block i (int64) and the out-of-slice mask (bool)
            out["embedding"] = 8 * b // q * s + b // q * s
        if last:  # ln_f x̂, 1/σ; output layer gathered input and weight; softmax, target, mask
            out["head and loss"] = (e * T * hq + e * T + e * q * T * hq + e * vq * hq
                                    + es * T * vq + INDEX_BYTES * T + T)
    else:
        t = tp
        T, vt = b * s, pad_vocab(model.vocab, t) // t
        per_layer = sum(saved_bytes_per_layer(model, b, t, dropout=False).values())
        if first:
            out["embedding"] = INDEX_BYTES * T + (T if t > 1 else 0)
        if last:  # ln_f input, mean, rstd; output layer input; softmax (t>1) or log-softmax; targets
            out["head and loss"] = e * T * h + 2 * es * T + e * T * h + (es * T * vt + INDEX_BYTES * T + T if t > 1
                                                                           else e * T * vt + INDEX_BYTES * T)
    out["layers"] = L * per_layer
    return out


def params_per_device(model: ModelConfig, scheme: str, devices: int) -> dict[str, int]:
    """Parameter elements per device, one layer and the whole model: 1-D and 3-D as the
    engine holds them (:func:`minitron.analysis.params.params_on_rank`), 2-D as SUMMA
    (Optimus) would: matrices split q² ways, vectors q ways (a formula)."""
    h, f, s = model.hidden, model.ffn_hidden, model.seq_len
    mats, vecs = 4 * h * h + 2 * h * f, 9 * h + f
    if scheme == "2d":
        q = square_edge(devices)
        vp = pad_vocab(model.vocab, q)
        layer = mats // (q * q) + vecs // q
        emb = vp * h // (q * q)
        whole = model.layers * layer + emb + s * h // q + 2 * h // q + (0 if model.tied_embeddings else emb)
        return {"layer": layer, "model": whole}
    mode = "3d" if scheme == "3d" else "1d"
    return {"layer": local_layer_params(model, devices, mode),
            "model": params_on_rank(model, ParallelConfig(tp=devices, tp_mode=mode))}


def compare_schemes(model: ModelConfig, micro_batch: int, devices: int, bytes_per_el: int = 4) -> list[dict]:
    """Per device, one microbatch of `micro_batch` sequences: ring wire bytes of one
    layer (forward + backward), parameter bytes of a layer and of the model, and
    activation bytes of a layer, for 1-D (t = P), 2-D (q = √P, formulas) and 3-D
    (q = ∛P). A scheme the device count does not fit gets ``feasible: False``."""
    P, e, b, s, h = devices, bytes_per_el, micro_batch, model.seq_len, model.hidden
    B = b * s
    lin = [(h, 3 * h), (h, h), (h, model.ffn_hidden), (model.ffn_hidden, h)]
    rows = []
    one_d = 4 * ring_allreduce_wire_bytes(e * B * h, P)
    par = params_per_device(model, "1d", P)
    rows.append({"scheme": "1d", "q": P, "feasible": True, "layer_wire_bytes": one_d,
                 "layer_param_bytes": e * par["layer"], "model_param_bytes": e * par["model"],
                 "layer_activation_bytes": sum(saved_bytes_per_layer(model, b, P, dropout=False,
                                                                     bytes_per_el=e).values())})
    q2 = square_edge(P)
    if q2 * q2 == P:
        wire = e * sum(sum(summa_linear_elements(B, a, c, q2)) for a, c in lin)
        par = params_per_device(model, "2d", P)
        act = sum(saved_bytes_per_layer(model, b, 1, dropout=False, bytes_per_el=e).values()) / P
        rows.append({"scheme": "2d", "q": q2, "feasible": True, "layer_wire_bytes": wire,
                     "layer_param_bytes": e * par["layer"], "model_param_bytes": e * par["model"],
                     "layer_activation_bytes": act})
    else:
        rows.append({"scheme": "2d", "q": None, "feasible": False})
    q3 = cube_edge(P)
    if q3 ** 3 == P and b % (q3 * q3) == 0:
        wire = sum(wire_bytes(c, q3) * c["calls"] for c in layer_calls(model, b, q3, e))
        par = params_per_device(model, "3d", P)
        rows.append({"scheme": "3d", "q": q3, "feasible": True, "layer_wire_bytes": wire,
                     "layer_param_bytes": e * par["layer"], "model_param_bytes": e * par["model"],
                     "layer_activation_bytes": sum(cube_saved_bytes_per_layer(model, b, q3, e, False).values())})
    else:
        rows.append({"scheme": "3d", "q": None, "feasible": False})
    return rows
