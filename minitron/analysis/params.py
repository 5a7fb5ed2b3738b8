"""Parameter counts: the paper's closed form, and the exact count of minitron's GPT.

A GPT layer holds 12h² + 13h parameters when the MLP is 4h wide: the QKV matrix
(3h²) and the output projection (h²) of attention, the two MLP matrices (8h²), and
13h of biases and LayerNorm vectors. Adding the token and position embeddings gives
PTD-P Eq. 2 (Narayanan et al. 2021, §5.1)::

    P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h))  =  l·(12h² + 13h) + (V + s)·h

Eq. 2 assumes a tied output layer and leaves out the final LayerNorm (2h). minitron's
GPT (``minitron/model.py``) is counted exactly by :func:`param_count`:

=========  =====================  ==========================================
module     full shape             on a tensor-parallel rank (1-D, t ranks)
=========  =====================  ==========================================
wte        [V_pad, h]             rows split: [V_pad/t, h]   (first stage)
wpe        [s, h]                 replicated                 (first stage)
ln1, ln2   [h] + [h] each         replicated
qkv        [3h, h] + [3h]         column split: [3h/t, h] + [3h/t]
proj       [h, h] + [h]           row split: [h, h/t]; bias replicated
fc         [f, h] + [f]           column split: [f/t, h] + [f/t]
fc2        [h, f] + [h]           row split: [h, f/t]; bias replicated
ln_f       [h] + [h]              replicated                 (last stage)
lm_head    [V_pad, h], no bias    rows split (last stage; none when tied on one stage)
=========  =====================  ==========================================

V_pad is the vocabulary padded up to a multiple of t (:func:`minitron.config.pad_vocab`).
On the 3-D cube (t = q³ ranks, ``parallel/cube.py``) every matrix is split q³ ways, the
vectors and the position embedding q ways, and the vocabulary is padded to q².
With tied embeddings (or multi-token prediction) and the last stage on another pipeline
rank than the first, the last chunk keeps its own copy of ``wte`` (its gradient is summed
with the first stage's by an all-reduce), so it is counted on that rank by
:func:`params_on_rank` but once by :func:`param_count`; a rank holding both ends (the V
of zb-v and dualpipe-v) holds one.
"""
from __future__ import annotations

import functools

from .dry_run import block_params, ends_params
from ..placement import Placement, placement_for
from ..config import ModelConfig, ParallelConfig, cube_edge, element_bytes, pad_vocab, square_edge
from ..placement import split_layers, stage_layer_counts

__all__ = [
    "layout_degrees",
    "activation_element_bytes",
    "local_model",
    "ptdp_param_count",
    "param_count",
    "layer_param_count",
    "padded_vocab",
    "split_layers",
    "chunk_layers",
    "layers_on_rank",
    "rank_layers",
    "params_on_rank",
    "params_given_layers",
    "local_layer_params",
    "params_per_rank",
    "rank_chunks",
    "block_ids_on_rank",
    "layout_placement",
]


# --------------------------------------------------------------------------------------
# Reading a layout (a ParallelConfig, or the planner's PlannedLayout, which is one)
# --------------------------------------------------------------------------------------
def layout_degrees(layout: ParallelConfig) -> tuple[int, int, int, str]:
    """(tp, pp, vpp, tp_mode) of a layout. A 2.5-D layout
    (q²·d ranks) reads as 2-D on q² ranks: each of its d copies holds what 2-D holds."""
    t, mode = layout.tp, layout.tp_mode
    if mode == "2.5d":
        t, mode = t // layout.tp_depth, "2d"
    return t, layout.pp, layout.vpp, mode


def activation_element_bytes(layout: ParallelConfig, dtype_bytes: int) -> int:
    """Bytes of one activation element: bfloat16's under ``--precision bf16`` (autocast
    computes in it, and ``Comm.wire_dtype`` sends activations in it), else the
    parameter dtype's `dtype_bytes`."""
    return element_bytes("bfloat16") if layout.precision == "bf16" else dtype_bytes


def local_model(model: ModelConfig, cp: int) -> ModelConfig:
    """The model as one context-parallel rank sees its activations: a sequence of s/N
    tokens for N = `cp` ranks (the parameters are those of `model`: the position table
    stays whole)."""
    return model if cp == 1 else model.replace(seq_len=model.seq_len // cp)


# --------------------------------------------------------------------------------------
# The paper's closed form
# --------------------------------------------------------------------------------------
def ptdp_param_count(model: ModelConfig) -> int:
    """PTD-P Eq. 2: ``12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h))``.

    Counts l transformer layers with a 4h MLP, the token embedding (tied with the
    output layer) and the learned position embedding; no final LayerNorm, no padding.
    """
    l, h, V, s = model.layers, model.hidden, model.vocab, model.seq_len
    # the same number, multiplied out so that it is an exact integer:
    # 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h)) = l·(12h² + 13h) + (V + s)·h
    return l * (12 * h * h + 13 * h) + (V + s) * h


# --------------------------------------------------------------------------------------
# minitron's GPT, exactly
# --------------------------------------------------------------------------------------
def padded_vocab(model: ModelConfig, tp: int = 1, tp_mode: str = "1d") -> int:
    """Rows of the embedding matrix: the vocabulary padded to a multiple of t.

    In 1-D mode the vocabulary is split over the t tensor ranks. In 3-D mode
    (``parallel/cube.py``) its rows are split into q² pieces (and the hidden size over
    q), so it is padded to a multiple of q².
    """
    if tp_mode == "3d":
        return pad_vocab(model.vocab, cube_edge(tp) ** 2)
    if tp_mode == "2d":  # SUMMA (parallel/summa.py): rows over q of the q×q grid
        return pad_vocab(model.vocab, square_edge(tp))
    return pad_vocab(model.vocab, tp)


def layer_param_count(model: ModelConfig) -> int:
    """Elements of one transformer layer: ``4h² + 2hf + 9h + f`` (= 12h² + 13h for f = 4h).

    ln1 2h, qkv 3h² + 3h, proj h² + h, ln2 2h, fc fh + f, fc2 hf + h.
    """
    h, f = model.hidden, model.ffn_hidden
    return 4 * h * h + 2 * h * f + 9 * h + f


def param_count(model: ModelConfig, tp: int = 1, tp_mode: str = "1d") -> int:
    """Exact number of parameters of minitron's GPT (each tied weight counted once).

    Returns ``l·layer + V_pad·h (wte) + s·h (wpe) + 2h (ln_f) + V_pad·h (lm_head, if not
    tied)``, where V_pad is the vocabulary padded for `tp` tensor ranks (the padded
    rows are real, zero-initialised elements of the local tensors).
    """
    h = model.hidden
    v = padded_vocab(model, tp, tp_mode)
    n = model.layers * layer_param_count(model) + v * h + model.seq_len * h + 2 * h
    if not model.tied_embeddings:
        n += v * h
    return n


# --------------------------------------------------------------------------------------
# Where the layers go
# --------------------------------------------------------------------------------------
def chunk_layers(model: ModelConfig, layout: ParallelConfig = ParallelConfig()) -> list[int]:
    """Layers of each of the pp·vpp model chunks, in model order (virtual stage order).

    Uses ``layout.stage_layers`` when given, else an even split
    (:func:`minitron.placement.stage_layer_counts`). Chunk c lives on
    pipeline rank ``c % pp`` (Megatron's interleaving: rank r holds chunks r, r+p, ...).
    """
    _, p, v, _ = layout_degrees(layout)
    return stage_layer_counts(model.layers, p, v, tuple(layout.stage_layers))


def layers_on_rank(model: ModelConfig, layout: ParallelConfig, pp_rank: int) -> int:
    """Transformer layers held by pipeline rank `pp_rank` (all its chunks)."""
    return rank_layers(model, layout)[pp_rank]


# --------------------------------------------------------------------------------------
# Per rank
# --------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def local_layer_params(model: ModelConfig, tp: int, tp_mode: str) -> int:
    """Parameter elements of one transformer layer on one tensor rank (1-D, 2-D or 3-D),
    read off the block built on fake tensors (:mod:`~minitron.analysis.dry_run`): every
    architecture knob counted as built. For GPT-2 shapes it equals the table above —
    1-D ``(2h) + (3h²+3h)/t + (h²/t + h) + (2h) + (fh+f)/t + (hf/t + h)``, the cube
    ``(4h²+2hf)/q³ + (9h+f)/q``, SUMMA ``(4h²+2hf)/q² + (9h+f)/q`` — as the tests check."""
    return block_params(model, ParallelConfig(tp=tp, tp_mode=tp_mode))


def params_on_rank(model: ModelConfig, layout: ParallelConfig, pp_rank: int = 0, tp_rank: int = 0) -> int:
    """Exact local parameter elements on the rank at (pp_rank, tp_rank) of a tensor ×
    pipeline layout (data-parallel replicas hold the same).

    `layout`: its ``tp, pp, vpp, stage_layers, tp_mode, ep, schedule`` count. All tensor
    ranks of a stage hold the same number of elements (the vocabulary is padded to a multiple of t); the
    `tp_rank` argument is kept for symmetry. With ``tp_mode='3d'`` (t = q³) every rank
    of the cube holds the same count too: matrices and the embeddings split q³ ways,
    vectors and the position embedding q ways.
    """
    t, p, v, mode = layout_degrees(layout)
    if not 0 <= pp_rank < p or not 0 <= tp_rank < t:
        raise ValueError(f"rank (pp={pp_rank}, tp={tp_rank}) outside a layout of pp={p}, tp={t}")
    lay = ParallelConfig(tp=t, tp_mode=mode, ep=layout.ep)
    # every chunk the rank holds, where the schedule's placement puts it, block by block (a
    # mixture of experts holds E/ep experts); the ends once per rank: a V puts both on rank 0,
    # whose last stage reads the first's embedding (multi-token prediction: no copy)
    blocks = sum(block_params(model, lay, i) for ids, _, _ in rank_chunks(model, layout, pp_rank) for i in ids)
    return blocks + ends_params(model, lay, *layout_placement(layout).holds_ends(pp_rank))


def layout_placement(layout: ParallelConfig) -> Placement:
    """The schedule's placement of a layout: which pipeline rank holds which chunk, the
    embedding and the head (:class:`minitron.placement.Placement`; a V puts both ends on
    rank 0)."""
    _, p, v, _ = layout_degrees(layout)
    return placement_for(layout.schedule, p, v)


@functools.lru_cache(maxsize=65536)
def params_given_layers(model: ModelConfig, t: int, p: int, v: int, mode: str, pp_rank: int,
                         n_layers: int, kind: str = "1f1b") -> int:
    """:func:`params_on_rank` once the rank's layer count `n_layers` is known, for the
    degrees (t, p, v, mode) of :func:`layout_degrees` and the schedule `kind` that places
    the stages (the planner calls this often)."""
    lay = ParallelConfig(tp=t, tp_mode=mode)
    first, last = placement_for(kind or "1f1b", p, v).holds_ends(pp_rank)
    # the ends once per rank (one embedding where a rank holds both: one chunk, or the V's
    # rank 0); a last stage apart from the first keeps its copy of a tied or MTP-read wte
    return n_layers * local_layer_params(model, t, mode) + ends_params(model, lay, first, last)


def rank_layers(model: ModelConfig, layout: ParallelConfig = ParallelConfig()) -> list[int]:
    """Transformer layers held by each pipeline rank (all its chunks), rank 0 first."""
    _, p, v, _ = layout_degrees(layout)
    where = layout_placement(layout)
    out = [0] * p
    for c, n in enumerate(chunk_layers(model, layout)):
        out[where.locate(c)[0]] += n
    return out


def rank_chunks(model: ModelConfig, layout: ParallelConfig, pp_rank: int) -> list[tuple[list[int], bool, bool]]:
    """(layer ids, first, last) of each model chunk pipeline rank `pp_rank` holds, in its
    chunk order: where the schedule's placement (loop or V) puts the virtual stages."""
    _, p, v, _ = layout_degrees(layout)
    stages, start = [], 0
    for n in chunk_layers(model, layout):
        stages.append(list(range(start, start + n)))
        start += n
    where = layout_placement(layout)
    return [(stages[where.stage(pp_rank, c)], *where.chunk_ends(pp_rank, c)) for c in range(v)]


def block_ids_on_rank(model: ModelConfig, layout: ParallelConfig, pp_rank: int) -> list[int]:
    """Ids of every transformer block pipeline rank `pp_rank` runs in a step, in its chunk
    order: its chunks' layers and, after the last stage's, the blocks of the D multi-token
    prediction depths (ids L .. L+D−1, ``mtp.Depth``; DeepSeek-V3 §2.2), which attend like
    any block (under --cp their ring or all-to-all traffic too)."""
    mtp = list(range(model.layers, model.layers + model.mtp_depths))
    return [i for ids, _, last in rank_chunks(model, layout, pp_rank) for i in ids + (mtp if last else [])]


def params_per_rank(model: ModelConfig, layout: ParallelConfig = ParallelConfig()) -> int:
    """The largest exact local parameter count over the ranks of a layout
    (see :func:`params_on_rank`)."""
    t, p, v, mode = layout_degrees(layout)
    kind = layout.schedule
    return max(params_given_layers(model, t, p, v, mode, r, n, kind)
               for r, n in enumerate(rank_layers(model, layout)))
