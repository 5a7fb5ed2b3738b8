"""Memory per rank: model states (parameters, gradients, optimizer) and activations.

Model states
------------
minitron's engine keeps every parameter, its gradient and AdamW's two state tensors
(``exp_avg``, ``exp_avg_sq``) in the parameter's dtype: 4 bytes each in fp32, and
also in bf16 mixed precision (fp32 master weights, bf16 autocast for the compute).
With ``--zero1`` each of the d data-parallel ranks keeps the Adam state of a 1/d shard
of its flat parameter vector, padded up to a multiple of d: ``2·ceil(n/d)`` elements.
(AdamW's scalar ``step`` is not counted.) :func:`memory_per_rank` is exact for these.

Large-scale training uses mixed-precision Adam (ZeRO, Rajbhandari et al. 2020, §3.1):
fp16/bf16 parameters (2 bytes) and gradients (2), and an fp32 master copy with the two
Adam moments (4 + 4 + 4 = 12): 16 bytes per parameter, 20 with fp32 gradient
accumulation. ZeRO shards the 12 (stage 1), then the gradients (2), then the
parameters (3) over the d data-parallel ranks; see :func:`zero_bytes_per_param`.

Activations (Korthikanti et al. 2022, Table 2)
----------------------------------------------
One layer on a microbatch of b sequences of s tokens keeps, with 2-byte activations and
1-byte dropout masks (no parallelism)::

    s·b·h·(34 + 5·a·s/h) bytes

Per element, with activations of e bytes, masks of m bytes and an MLP of width f:

* attention: input of QKV (e), Q and K (2e), V (e), input of the projection (e),
  dropout mask after it (m): ``(5e + m)·sbh``; softmax output (e), its dropout mask
  (m) and the dropped-out probabilities (e): ``(2e + m)·a·s²·b``;
* MLP: input of fc (e), input of GeLU (e·f/h), input of fc2 (e·f/h), dropout mask (m):
  ``(e + 2e·f/h + m)·sbh``;
* two LayerNorm inputs: ``2e·sbh``.

So ``sbh·(8e + 2m + 2e·f/h) + (2e + m)·a·s²·b``, which is 34 and 5 for e = 2, m = 1,
f = 4h. Without dropout the masks and the dropped copy of the probabilities go:
``sbh·(8e + 2e·f/h) + e·a·s²·b``. Under 1-D tensor parallelism the parts inside the
parallel region (Q, K, V, the projection input, the MLP's hidden activations, the
attention matrices) divide by t, and the LayerNorm inputs, the inputs of QKV and fc
and the dropout masks stay whole: ``sbh·(4e + 2m) + sbh·(4e + 2e·f/h)/t`` + s² terms /t
(Table 2: 10 + 24/t). Sequence parallelism divides the rest by t too (34/t).
Selective recomputation drops the s² terms; full recomputation keeps only the layer
input, ``e·sbh`` (/t with sequence parallelism).

A pipeline stage keeps these for every microbatch in flight
(:func:`~minitron.analysis.bubble.stashed_on_rank`: p on the first stage with 1F1B, m
with GPipe, ×(1 + (p−1)/(p·v)) interleaved), plus, on the first stage, the embedding's
dropout mask and, on the last, the inputs of the final LayerNorm and of the output
layer (sequence shards under sequence parallelism) and the fp32 softmax of the
cross-entropy (``4·b·s·V/t``; Korthikanti §4.3: ``4sbh/t·(1 + V/h)`` with 2-byte
activations and sequence parallelism). With recomputation one
layer's activations are rebuilt during its backward: that working set is added once.
This is :func:`activation_bytes_on_rank`, the estimate of the planner
(:func:`memory_estimate`) for Megatron-style training at scale.

What minitron's ``Block`` saves (:func:`saved_bytes_per_layer`)
---------------------------------------------------------------
Table 2 as :func:`korthikanti_activation_bytes_per_layer` gives it literally and
:func:`activation_bytes_per_layer` per element. :func:`saved_bytes_per_layer` counts what minitron's ``Block`` itself saves,
one item per tensor, for one microbatch of b sequences on one tensor rank (e bytes per
activation, boolean masks of 1 byte; T = b·s tokens, t_s = t with ``--sp`` else 1)::

    ln1, ln2 input                 e·T·h/t_s each, + mean and rstd: 2·e'·T/t_s each
    QKV input, fc input            e·T·h/t_s each   (under --sp the sequence shard: the
                                                     linear all-gathers it again in the
                                                     backward, Korthikanti §4.2.2)
    Q, K, V                        3·e·T·h/t
    attention, dropout > 0         softmax output e·b·a·s²/t, mask b·a·s²/t, dropped
                                   probabilities e·b·a·s²/t      (explicit core)
    attention, dropout = 0         SDPA's logsumexp e'·b·a·s/t
    proj input                     e·T·h/t          (SDPA's output, which it saves too)
    GELU input, fc2 input          e·T·f/t each
    residual dropout masks         T·h/t_s each     (dropout > 0)

(e' = max(e, 4): statistics stay in float32 for 16-bit activations.) Selective
recomputation keeps the input of the attention core (Q, K, V) and drops what it
saved; full recomputation keeps only the layer input, e·T·h/t_s. With dropout and e = 2
this is Table 2, with and without ``--sp``, plus what Table 2 leaves out: LayerNorm's
statistics (b·s-sized; and SDPA's logsumexp when the SDPA core runs). Under full
recomputation Table 2 counts the whole layer input, 2·s·b·h, where each rank holds its
1/t shard under ``--sp``.

minitron's engine (:func:`memory_on_rank`)
-------------------------------------------
``memory_on_rank`` models what this engine holds, measured equal in
``tests/test_memory_measured.py``:

* parameters, gradients, optimizer state: exact (above). Gradients are ``n`` elements
  whatever the data-parallel implementation: bucketed data parallelism makes every
  ``p.grad`` a view into one flat buffer, so the buffer *is* the gradients.
* activations (:func:`engine_activation_bytes_on_rank`): the peak of what autograd
  saves for the backward, parameters excluded, storages counted once. Per layer that is
  :func:`saved_bytes_per_layer`, minitron's ``Block``
  item by item (exact in float32/float64): with dropout, Table 2 per element (also
  under ``--sp``: the column-parallel linears keep their input's sequence shard and
  all-gather it again in the backward, as Megatron does) plus LayerNorm's statistics,
  which Table 2 leaves out; without dropout the SDPA core stores no s² attention
  matrices. A stage holds its layers for every microbatch in flight
  (``stashed_on_rank``, as above; the pipeline stash's stage input *is* the first
  layer's saved input), plus per microbatch (:func:`stage_activation_bytes`):

  - first stage: the token ids the embedding saves (``8·b·s``; with t > 1 the shifted
    local ids and a 1-byte out-of-range mask, ``9·b·s``) and, with dropout, the
    embedding's mask (``b·s·h/t_s``);
  - last stage (one microbatch in flight outside GPipe): the final LayerNorm's input
    and statistics (``e·b·s·h/t_s + 2·e'·b·s/t_s``), the output layer's input
    (``e·b·s·h/t_s``: a sequence shard under ``--sp``), the cross-entropy's float32-or-wider softmax
    (``e'·b·s·V_pad/t``) and its targets (``8·b·s``, with t > 1 also a 1-byte mask).

  With t = 1 the ids the embedding saves are a view of the rank's whole token batch
  (inputs and targets share one ``[B, s+1]`` tensor), so a count by storage sees
  ``8·B·(s+1)`` bytes instead of ``8·b·s`` (and ``F.cross_entropy`` keeps a scalar
  weight): a few KiB, 0.2% of ``tiny`` on one device. With t > 1 the count is exact.

  Recomputation: a stage holds its layers' checkpointed inputs (selective: what the
  layer saves outside the attention core) and rebuilds one layer (or core) at a time
  during the backward, after the backward of the head and the loss has freed what they
  saved: the peak is the larger of the two (:func:`engine_activation_bytes_on_rank`).

  Under bf16 autocast (``--precision bf16``) the casts keep extra copies: an estimate.
  The 3-D cube uses the Table 2 estimate above.
* buffers (:func:`buffer_bytes_on_rank`): with ZeRO-1, the two extra shard-sized flat
  tensors ``shard_grad`` (the reduce-scattered gradient) and ``shard_param`` (the
  stepped parameters), ``2·ceil(n/d)`` elements, and the padding of the flat gradient
  and parameter buffers to ``ceil(n/d)·d`` elements (exact); with a pipeline, an
  estimate of the boundary tensors in flight (an output waiting for its send, a received
  gradient: ``2·b·s·h`` in the run's dtype, /t under ``--sp`` or scatter/gather).
"""
from __future__ import annotations

import dataclasses
import math

from ..config import INDEX_BYTES, ModelConfig, ParallelConfig, TrainConfig, element_bytes, statistics_bytes
from ..parallel.fp8 import AMAX_HISTORY_LEN
from .dry_run import block_rebuilt_bytes, block_saved_bytes, ends_saved_bytes, fp8_histories
from .bubble import stashed_on_rank
from .flops import recompute_policy
from .planned_layout import PlannedLayout
from .params import (activation_element_bytes, layers_on_rank, layout_placement, layout_degrees, local_model,
                     padded_vocab, params_given_layers, params_on_rank, rank_chunks, rank_layers)
from .zero import zero_buffer_bytes, zero_state_bytes

__all__ = [
    "korthikanti_activation_bytes_per_layer",
    "activation_bytes_per_layer",
    "saved_bytes_per_layer",
    "activation_bytes_on_rank",
    "engine_activation_bytes_on_rank",
    "stage_activation_bytes",
    "buffer_bytes_on_rank",
    "memory_on_rank",
    "memory_per_rank",
    "memory_estimate",
    "zero_bytes_per_param",
    "distributed_optimizer_bytes_per_param",
]


# --------------------------------------------------------------------------------------
# Model states
# --------------------------------------------------------------------------------------
def zero_bytes_per_param(stage: int, d: int, master_and_moments: int = 12) -> float:
    """Model-state bytes per parameter per rank, mixed-precision Adam (ZeRO §3.1, §5).

    stage 0: ``2 + 2 + 12 = 16``; stage 1 (optimizer states sharded): ``2 + 2 + 12/d``;
    stage 2 (+ gradients): ``2 + 14/d``; stage 3 (+ parameters): ``16/d``.
    """
    k = master_and_moments
    if d < 1:
        raise ValueError(f"data-parallel degree must be at least 1 (got {d})")
    table = {0: 2 + 2 + k, 1: 2 + 2 + k / d, 2: 2 + (2 + k) / d, 3: (2 + 2 + k) / d}
    if stage not in table:
        raise ValueError(f"unknown ZeRO stage {stage}: use 0, 1, 2 or 3")
    return table[stage]


def distributed_optimizer_bytes_per_param(d: int) -> float:
    """Megatron's distributed optimizer: bf16 parameters (2) and fp32 gradients (4)
    on every rank, fp32 master weights and Adam moments sharded: ``6 + 12/d``."""
    return 6 + 12 / d


# --------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------
def korthikanti_activation_bytes_per_layer(s: int, b: int, h: int, a: int, t: int = 1,
                                           sp: bool = False, recompute: str = "none") -> float:
    """Korthikanti et al. (2022) Table 2, literally (2-byte activations, 1-byte masks):

    none: ``sbh(34 + 5as/h)``; tensor parallel: ``sbh(10 + 24/t + 5as/(ht))``;
    + sequence parallel: ``sbh(34/t + 5as/(ht))``; selective recomputation drops the
    ``5as/h`` term; full recomputation: ``2sbh``.
    """
    rc = recompute_policy(recompute)
    if rc == "full":
        return 2 * s * b * h
    quad = 0 if rc == "selective" else 5 * a * s / (h * t)
    if sp:
        return s * b * h * (34 / t + quad)
    return s * b * h * (10 + 24 / t + quad)


def activation_bytes_per_layer(model: ModelConfig, micro_batch: int, tp: int = 1, sp: bool = False,
                               recompute: str = "none", bytes_per_el: int = 2, mask_bytes: int = 1,
                               dropout: bool | None = None) -> float:
    """Activation bytes one layer keeps for one microbatch (per tensor rank), the
    per-element form of Korthikanti et al. Table 2 (see the module docstring)::

        replicated  = sbh·(4e + 2m)              (LayerNorm, QKV and fc inputs, masks)
        sharded     = sbh·(4e + 2e·f/h) / t      (Q, K, V, projection input, MLP hidden)
        attention   = (2e + m)·a·s²·b / t        (softmax, its mask, dropped copy)

    With sequence parallelism the replicated part divides by t too. Selective
    recomputation drops the attention term; full recomputation keeps ``e·sbh`` (/t with
    sequence parallelism). `dropout` (default: ``model.dropout > 0``) decides whether
    the masks (m bytes) and the dropped-out copy of the probabilities exist.
    """
    s, b, h, a, f, t = model.seq_len, micro_batch, model.hidden, model.heads, model.ffn_hidden, tp
    e = bytes_per_el
    m = mask_bytes if (model.dropout > 0 if dropout is None else dropout) else 0
    rc = recompute_policy(recompute)
    sbh = s * b * h
    if rc == "full":
        return e * sbh / (t if sp else 1)
    replicated = sbh * (4 * e + 2 * m)
    sharded = sbh * (4 * e + 2 * e * f / h)
    quad = (2 * e + m if m else e) * a * s * s * b
    total = (replicated / t if sp else replicated) + sharded / t
    if rc == "none":
        total += quad / t
    return total


def saved_bytes_per_layer(model: ModelConfig, micro_batch: int, tp: int = 1, sp: bool = False,
                          recompute: str = "none", bytes_per_el: int = 4,
                          dropout: bool | None = None) -> dict[str, float]:
    """Bytes one minitron ``Block`` keeps for its backward, per item (module docstring).

    `dropout` (default ``model.dropout > 0``) selects the explicit attention core with
    its masks; otherwise the SDPA core. Exact for float32/float64 training; under bf16
    autocast the casts keep extra copies.
    """
    s, b, h, a, f, t = model.seq_len, micro_batch, model.hidden, model.heads, model.ffn_hidden, tp
    e, es = bytes_per_el, statistics_bytes(bytes_per_el)
    drop = model.dropout > 0 if dropout is None else dropout
    T = b * s
    ts = t if sp else 1
    rc = recompute_policy(recompute)
    if rc == "full":
        return {"layer input": e * T * h / ts}
    out: dict[str, float] = {}
    if rc == "none":
        out["ln1 input"] = e * T * h / ts
        out["ln1 mean, rstd"] = 2 * es * T / ts
        out["qkv input"] = e * T * h / ts
    out["Q, K, V"] = 3 * e * T * h / t
    if rc == "none":
        if drop:
            out["softmax output"] = e * b * a * s * s / t
            out["attention dropout mask"] = b * a * s * s / t
            out["dropped probabilities"] = e * b * a * s * s / t
        else:
            out["SDPA logsumexp"] = es * b * a * s / t  # its output is the proj input (a view)
    out["proj input"] = e * T * h / t
    out["ln2 input"] = e * T * h / ts
    out["ln2 mean, rstd"] = 2 * es * T / ts
    out["fc input"] = e * T * h / ts
    out["GELU input"] = e * T * f / t
    out["fc2 input"] = e * T * f / t
    if drop:
        out["residual dropout masks"] = 2 * T * h / ts
    if rc == "selective":  # the layer input is ln1's input: kept, not recomputed
        out = {"ln1 input": e * T * h / ts, "ln1 mean, rstd": 2 * es * T / ts, "qkv input": e * T * h / ts,
               **out}
    return out


def _schedule(layout: ParallelConfig) -> tuple[str, int, int]:
    kind, p, v = layout.schedule, layout.pp, layout.vpp
    if p * v == 1:
        kind = "1f1b"  # no pipeline: one microbatch at a time (gradient accumulation)
    return kind, p, v


def activation_bytes_on_rank(model: ModelConfig, layout: ParallelConfig, micro_batch: int, microbatches: int,
                             pp_rank: int = 0, bytes_per_el: int = 2, mask_bytes: int = 1,
                             dropout: bool | None = None, recompute: str | None = None,
                             _n_layers: int | None = None, flash: bool = False) -> float:
    """Peak activation bytes on pipeline rank `pp_rank` (any tensor rank): stashed
    microbatches × layers held × :func:`activation_bytes_per_layer`, the embedding and
    logit terms, and one layer's working set under recomputation.

    `layout`: its ``tp, pp, vpp, sp, schedule, recompute, stage_layers`` count
    (`recompute` overrides the layout's). `flash`: the attention is a flash kernel (Dao et
    al. 2022), which never writes the a·s² scores: it saves the rows' log-sum-exp
    and recomputes the scores block by block on chip in its backward, so a layer keeps
    what selective recomputation keeps and none is rebuilt in memory.
    """
    t = layout.tp
    # the 3-D cube (and the 2-D/2.5-D grid) splits every activation over its ranks, like
    # sequence parallelism
    sp = layout.sp or layout.tp_mode in ("2d", "2.5d", "3d")
    rc = recompute_policy(recompute if recompute is not None else layout.recompute)
    kind, p, v = _schedule(layout)
    m = microbatches
    s, b, h = model.seq_len, micro_batch, model.hidden
    e = bytes_per_el
    drop = model.dropout > 0 if dropout is None else dropout
    whole = "selective" if flash else "none"  # what a layer saves when nothing is recomputed
    per_layer = activation_bytes_per_layer(model, b, t, sp, whole if rc == "none" else rc, e, mask_bytes, drop)
    in_flight = stashed_on_rank(kind, p, m, v, pp_rank)
    n_layers = layers_on_rank(model, layout, pp_rank) if _n_layers is None else _n_layers
    total = in_flight * n_layers * per_layer
    if rc != "none":  # one layer rebuilt for its backward
        total += activation_bytes_per_layer(model, b, t, sp, whole, e, mask_bytes, drop) - per_layer
    first, last = layout_placement(layout).holds_ends(pp_rank)  # a V holds both on rank 0
    if first and drop:  # dropout mask of the embedding output
        total += in_flight * mask_bytes * s * b * h / (t if sp else 1)
    if last:  # final LayerNorm input, output-layer input, fp32 softmax
        logits_in_flight = m if kind == "gpipe" else 1
        vocab = padded_vocab(model, t) // t
        total += logits_in_flight * (2 * e * s * b * h / (t if sp else 1)  # (shards under sp, §4.3)
                                     + max(4, e) * s * b * vocab)
    return total


# --------------------------------------------------------------------------------------
# minitron's engine, per rank
# --------------------------------------------------------------------------------------
def stage_activation_bytes(model: ModelConfig, micro_batch: int, tp: int = 1, sp: bool = False,
                           first: bool = True, last: bool = True, bytes_per_el: int = 4,
                           dropout: bool | None = None) -> dict[str, float]:
    """What minitron's embedding (`first`) and output layer and loss (`last`) save for
    the backward, per item, for one microbatch on one tensor rank (module docstring)."""
    s, b, h, t = model.seq_len, micro_batch, model.hidden, tp
    e, es = bytes_per_el, statistics_bytes(bytes_per_el)
    T, ts = b * s, (tp if sp else 1)
    drop = model.dropout > 0 if dropout is None else dropout
    out: dict[str, float] = {}
    if first:
        out["token ids"] = INDEX_BYTES * T + (T if t > 1 else 0)  # (t > 1: local ids and the out-of-range mask)
        if drop:
            out["embedding dropout mask"] = T * h / ts
    if last:
        out["ln_f input"] = e * T * h / ts
        out["ln_f mean, rstd"] = 2 * es * T / ts
        out["output layer input"] = e * T * h / ts  # (the shard under --sp: re-gathered in the backward)
        out["cross-entropy softmax"] = es * T * padded_vocab(model, t) / t
        out["targets"] = INDEX_BYTES * T + (T if t > 1 else 0)  # (t > 1: clamped local ids and their mask)
    return out


def engine_activation_bytes_on_rank(model: ModelConfig, layout: ParallelConfig, micro_batch: int, microbatches: int,
                                    pp_rank: int = 0, bytes_per_el: int = 4) -> float:
    """Peak bytes that minitron's engine saves for the backward on pipeline rank
    `pp_rank` (any tensor rank)::

        held    = in flight × (layers × what one block saves + what the embedding saves)
        last    = what the final norm, the output layer and the loss save
        rebuilt = the most a block's backward saves on top of what it held
        peak    = held + (heads in flight − 1)·last + max(last, rebuilt)   (last stage)
                  held + max(0, rebuilt)                                    (others)

    In flight: :func:`~minitron.analysis.bubble.stashed_on_rank`; heads in flight: 1,
    m with GPipe. A layer is rebuilt during its backward, once the backward has gone
    through the head and the loss and freed what they saved: the peak is the larger of
    the two, not their sum. Each term is read off the model by a dry run
    (:mod:`~minitron.analysis.dry_run`: the block's own forward and backward on fake
    tensors), so every architecture is counted as built. For GPT-2 the terms equal the
    items of :func:`saved_bytes_per_layer` and :func:`stage_activation_bytes` (and, with
    recomputation, full: ``none − full``; selective: the attention core rebuilt once the
    backward has freed what the layer saved after it), which the tests check.

    `layout`: its ``tp, pp, vpp, sp, schedule, recompute, stage_layers, tp_mode`` count.
    The 3-D cube and the 2-D/2.5-D grid fall back to :func:`activation_bytes_on_rank`.
    """
    if layout.tp_mode in ("2d", "2.5d", "3d"):
        return activation_bytes_on_rank(model, layout, micro_batch, microbatches, pp_rank, bytes_per_el, 1)

    kind, p, v = _schedule(layout)
    m, b, e = microbatches, micro_batch, bytes_per_el
    terms = _dry_run_terms if e >= 4 else _bf16_table_terms
    held_per_layer, rebuilt, embedding, last = terms(model, layout, b, e)
    in_flight = stashed_on_rank(kind, p, m, v, pp_rank)
    held = in_flight * layers_on_rank(model, layout, pp_rank) * held_per_layer
    first, holds_head = layout_placement(layout).holds_ends(pp_rank)
    if first:
        held += in_flight * embedding
    if not holds_head:
        return held + max(0.0, rebuilt)
    heads_in_flight = m if kind == "gpipe" else 1
    return held + (heads_in_flight - 1) * last + max(last, rebuilt)


def _dry_run_terms(model: ModelConfig, layout: ParallelConfig, b: int, e: int) -> tuple[float, float, float, float]:
    """(one block's saved bytes, what its backward rebuilds on top, the embedding's, the
    head and loss's), read off the model by a dry run (float32/float64 training: exact)."""
    return (block_saved_bytes(model, layout, b, e), block_rebuilt_bytes(model, layout, b, e),
            ends_saved_bytes(model, layout, b, e, first=True, last=False),
            ends_saved_bytes(model, layout, b, e, first=False, last=True))


# the items of saved_bytes_per_layer saved before the attention core (the rest come after it)
_BEFORE_CORE = ("ln1 input", "ln1 mean, rstd", "qkv input", "Q, K, V")


def _bf16_table_terms(model: ModelConfig, layout: ParallelConfig, b: int, e: int) -> tuple[float, float, float, float]:
    """The same terms for 2-byte activations from the item tables (bf16 autocast keeps
    fp32 statistics and cast copies that a dry run in one dtype does not show): GPT-2's
    items, Korthikanti's Table 2 plus the statistics."""
    t, sp = layout.tp, layout.sp
    rc = recompute_policy(layout.recompute)
    cp = layout.cp
    model = local_model(model, cp)  # a context rank's s/N tokens
    positions = INDEX_BYTES * b * model.seq_len if cp > 1 else 0  # the embedding's indices of its two chunks

    def layer(policy: str) -> float:
        return sum(saved_bytes_per_layer(model, b, t, sp, policy, e).values())

    rebuilt = 0.0
    if rc == "full":  # the whole layer at once, but its input (held)
        rebuilt = layer("none") - layer("full")
    elif rc == "selective":  # the core, after the backward freed what the layer saved after it
        kept = saved_bytes_per_layer(model, b, t, sp, "selective", e)
        rebuilt = layer("none") - sum(kept.values())
        # the explicit core's matmuls save contiguous copies of Q, K and V (their inputs
        # are strided views of the QKV output, held); SDPA saves its output again
        rebuilt += (3 if model.dropout > 0 else 1) * e * b * model.seq_len * model.hidden / t
        rebuilt -= sum(nbytes for item, nbytes in kept.items() if item not in _BEFORE_CORE)
    return (layer(rc), rebuilt, positions + sum(stage_activation_bytes(model, b, t, sp, True, False, e).values()),
            sum(stage_activation_bytes(model, b, t, sp, False, True, e).values()))


def memory_on_rank(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, pp_rank: int = 0,
                   dtype_bytes: int | None = None, act_bytes: int | None = None) -> dict:
    """Bytes held by a rank of pipeline stage `pp_rank` in minitron's engine.

    Keys: ``params_bytes, grads_bytes, optimizer_bytes, activations_bytes,
    buffers_bytes, total_bytes``. `dtype_bytes` is the parameter dtype's size (default:
    8 for ``train.dtype == 'float64'``, else 4 — bf16 mixed precision keeps fp32
    parameters); `act_bytes` the activation element size (default: 2 with
    ``parallel.precision == 'bf16'``, else `dtype_bytes`). Activations are
    :func:`engine_activation_bytes_on_rank`, buffers :func:`buffer_bytes_on_rank`.
    """
    e = dtype_bytes or element_bytes(train.dtype)
    ea = act_bytes or activation_element_bytes(parallel, e)
    d = parallel.dp
    cp = parallel.cp
    n = params_on_rank(model, parallel, pp_rank)
    shard = math.ceil(n / (d * cp)) if parallel.zero1 else n  # (ZeRO over dp_cp)
    m, replicas = train.microbatches, parallel.ep * d  # (ep ranks read other rows too)
    if train.global_batch % (replicas * m):
        raise ValueError(f"global batch {train.global_batch} is not divisible by ep*dp*microbatches = {replicas}*{m}")
    b = train.global_batch // (replicas * m)
    # context parallelism: activations of s/N tokens, and the position indices of the rank's
    # two chunks that the embedding saves, read off the dry run of the layout
    tokens, lay = local_model(model, cp), parallel
    acts = engine_activation_bytes_on_rank(model, parallel, b, m, pp_rank, ea)
    if cp > 1:
        # ZeRO-1's flat buffers over the dp·cp ranks; zero capped at 1 counts what this always
        # counted here, the flat buffers also under ZeRO-2/3 (their units are added below)
        lay = dataclasses.replace(parallel, dp=d * cp, zero=min(parallel.zero, 1))
    buffers = sum(buffer_bytes_on_rank(tokens, lay, b, n, e).values())
    states = (n * e, n * e, 2 * shard * e)
    if parallel.zero >= 2 and d * cp > 1:  # ZeRO-2/3: states and buffers unit by unit
        z = zero_state_bytes(model, parallel, train, pp_rank, e)
        states = (z["params_bytes"], z["grads_bytes"], z["optimizer_bytes"])
        buffers += sum(zero_buffer_bytes(model, parallel, pp_rank, e).values())
    return _assemble(states[0] + fp8_history_bytes(model, parallel, pp_rank, e), *states[1:], acts, buffers)


def fp8_history_bytes(model: ModelConfig, parallel: ParallelConfig, pp_rank: int, e: int) -> int:
    """Delayed scaling's amax histories on a rank: per FP8 linear a [3, 1024] parameter
    without gradient or optimizer state, replicated (outside ZeRO's units). What else the
    engine's FP8 keeps is a scale per quantized tensor (a few bytes); its linears save their
    operands in the working dtype, as torchao's do, not FP8 copies."""
    if parallel.precision != "fp8":
        return 0
    return fp8_histories(model, parallel, rank_chunks(model, parallel, pp_rank)) * 3 * AMAX_HISTORY_LEN * e


def buffer_bytes_on_rank(model: ModelConfig, layout: ParallelConfig, micro_batch: int, n: int, e: int) -> dict:
    """Buffers beyond parameters, gradients, optimizer state and activations on a rank
    holding `n` parameter elements of `e` bytes: ``{data_parallel, pipeline}``.

    data_parallel (exact): 0 for naive and bucketed data parallelism (``p.grad`` are views
    into the flat buffer: it holds the gradients, nothing more); with ZeRO-1 the flat
    gradient and parameter buffers are padded to ``ceil(n/d)·d`` elements and two
    shard-sized tensors come on top, ``shard_grad`` and ``shard_param``:
    ``(2·ceil(n/d) + 2·(ceil(n/d)·d − n))·e``.

    pipeline (an estimate): a stage output waiting for its send and a received gradient,
    ``2·b·s·h·e`` in the run's dtype (under bf16 the copy in flight is bf16 and the
    received gradient is cast back: ``e`` is an upper bound there), /t
    under ``--sp`` or ``--scatter-gather``. The received forward input is the stage
    input, counted with the activations. (On gloo the runtime posts each batch's receives
    one batch early: up to two more boundary tensors for the length of a compute action.
    The planner prices NCCL runs, which post them where the schedule says.) Not counted,
    here as for data parallelism: the collectives' own working memory (on gloo, the
    transient copy a reduce-scatter receives into, see ``comm.reduce_scatter_single``).
    """
    t, p = layout.tp, layout.pp
    d = layout.dp
    out = {"data_parallel": 0.0, "pipeline": 0.0}
    if p > 1:
        shrink = t if (layout.sp or layout.scatter_gather) else 1
        out["pipeline"] = 2 * micro_batch * model.seq_len * model.hidden * e / shrink
    if d > 1 and layout.zero1 and layout.zero < 2:  # (ZeRO-2/3: analysis/zero.py)
        shard = math.ceil(n / d)
        out["data_parallel"] = float((2 * shard + 2 * (shard * d - n)) * e)
    return out


def _buffers(model: ModelConfig, layout: ParallelConfig, b: int, ea: int, n: int, e: int) -> float:
    """:func:`buffer_bytes_on_rank` summed, boundary tensors of `ea` bytes (the planner's
    mixed-precision estimate)."""
    out = buffer_bytes_on_rank(model, layout, b, n, e)
    return out["data_parallel"] + out["pipeline"] * ea / e


def _assemble(params: float, grads: float, optim: float, acts: float, buffers: float) -> dict:
    return {"params_bytes": params, "grads_bytes": grads, "optimizer_bytes": optim,
            "activations_bytes": acts, "buffers_bytes": buffers,
            "total_bytes": params + grads + optim + acts + buffers}


def _max_over_ranks(per_rank: list[dict]) -> dict:
    """Each component's maximum over ranks; ``total_bytes`` is the largest rank total
    (not the sum of the component maxima, which may sit on different ranks)."""
    out = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
    out["total_bytes"] = max(r["total_bytes"] for r in per_rank)
    return out


def memory_per_rank(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                    dtype_bytes: int | None = None, act_bytes: int | None = None) -> dict:
    """Bytes per rank in minitron's engine, the maximum over the pipeline stages.

    Returns ``{params_bytes, grads_bytes, optimizer_bytes, activations_bytes,
    buffers_bytes, total_bytes}``. Parameters, gradients and AdamW state (exp_avg and
    exp_avg_sq; ``2·ceil(n/d)`` elements with ZeRO-1) are exact; activations are what
    the engine saves for its backward (:func:`engine_activation_bytes_on_rank`); the
    data-parallel buffers are exact, the pipeline's an estimate (:func:`buffer_bytes_on_rank`).
    `dtype_bytes` defaults to 4 (8 for float64 training).
    """
    p = parallel.pp
    return _max_over_ranks([memory_on_rank(model, parallel, train, r, dtype_bytes, act_bytes)
                            for r in range(p)])


# --------------------------------------------------------------------------------------
# Mixed-precision estimate for large models (the planner's)
# --------------------------------------------------------------------------------------
def memory_estimate(model: ModelConfig, layout: PlannedLayout, global_batch: int, bytes_per_param: float = 16,
                    act_bytes: int = 2, recompute: str = "full", dropout: bool = True, flash: bool = False) -> dict:
    """Bytes per GPU for mixed-precision training at scale, the maximum over stages.

    `layout`: a :class:`~minitron.analysis.planned_layout.PlannedLayout` (its ``tp, pp, dp,
    vpp, microbatch_size, sp, schedule, stage_layers`` count). Model states: 2-byte
    parameters, 12 bytes of fp32 master weights and Adam moments, and ``bytes_per_param −
    14`` bytes of gradients (2 for the ZeRO paper's 16, 6 for 20 with fp32 accumulation).
    Activations: Korthikanti Table 2 with `act_bytes`-byte activations and 1-byte dropout masks, `recompute` policy; with
    `flash` attention no a·s² term (:func:`activation_bytes_on_rank`).
    """
    d = layout.dp
    b = layout.microbatch_size
    p = layout.pp
    if global_batch % (d * b):
        raise ValueError(f"global batch {global_batch} is not divisible by dp*microbatch_size = {d}*{b}")
    m = global_batch // (d * b)
    t, _, v, mode = layout_degrees(layout)
    kind = _schedule(layout)[0]
    layers = rank_layers(model, layout)
    # Layers and microbatches in flight never grow with the rank in the loop placement under
    # an even split, so the first and the last stage bound the others; check them all
    # otherwise (a V stashes the most on its middle ranks).
    where = layout_placement(layout)
    even_loop = not layout.stage_layers and where.kind == "loop"
    check = where.end_ranks() if even_loop else range(p)
    # the boundary tensors split by --sp, not by scatter/gather (as the planner has priced them)
    no_dp = dataclasses.replace(layout, dp=1, scatter_gather=False)
    ranks = []
    for r in check:
        n = params_given_layers(model, t, p, v, mode, r, layers[r], kind)
        acts = activation_bytes_on_rank(model, layout, b, m, r, act_bytes, 1, dropout, recompute,
                                        _n_layers=layers[r], flash=flash)
        ranks.append(_assemble(2 * n, (bytes_per_param - 14) * n, 12 * n, acts,
                               _buffers(model, no_dp, b, act_bytes, n, 2)))
    return _max_over_ranks(ranks)

