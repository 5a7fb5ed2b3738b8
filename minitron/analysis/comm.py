"""Communication volume: what each parallel axis moves in one training step.

Two ways to count bytes, kept apart on purpose:

* **Call bytes** — the size of the local tensor handed to each call, the way
  :class:`minitron.comm.CommTrace` records it: the whole tensor for all-reduce and
  send/recv, the local *input shard* for all-gather, the full local *input* for
  reduce-scatter. :func:`comm_items` and :func:`comm_bytes_per_step` count these, per
  rank, so that a traced run can be checked against them.
* **Wire bytes** — what a ring algorithm really sends out of each device:
  ``2(n−1)/n`` × the buffer for all-reduce, ``(n−1)/n`` × the full buffer for
  all-gather and reduce-scatter (:mod:`minitron.analysis.calls`, whose ring formulas
  this module re-exports).

Per axis (b the microbatch size, s the sequence, h hidden, e bytes per element):

* data parallel: one all-reduce of every local gradient per step; with ZeRO-1 a
  reduce-scatter of the flat gradient padded to a multiple of d and an all-gather of
  the updated ``ceil(n/d)`` parameter shard;
* 1-D tensor parallel, per layer per microbatch: 2 all-reduces of b·s·h forward
  (after attention and after the MLP: g) and 2 backward (f), 2 more when full
  recomputation replays the forward; with sequence parallelism each all-reduce becomes
  an all-gather of the b·s·h/t shard and a reduce-scatter of b·s·h (same wire bytes),
  and the QKV and fc linears, which keep only their input's sequence shard, all-gather
  it again in the backward for their weight gradients: 2 more all-gathers of the
  shard (Korthikanti et al. 2022, §4.2.2; one more for the output layer); with
  ``--tp-overlap`` each of a linear's all-gathers and reduce-scatters is t−1 sends and
  receives of b·s·h·e/t on a ring, the same wire bytes in t−1 times as many messages
  (:mod:`minitron.analysis.tensor_parallel`; the dry run reads them off the model);
* pipeline: b·s·h per stage boundary per microbatch in each direction (v times as many
  boundaries with interleaving; /t with sequence parallelism or scatter/gather);
* fault-tolerant replicas (``--ft-replicas R``, torchft): each replica is the layout on
  its 1/R share of the batch, then every rank all-reduces its whole gradient once per step
  on the ``'replica'`` axis, with its peers at the same place in the other replicas.

For comparing tensor-parallel schemes on one linear layer ``Y = X·W`` (X: B×h_in):
1-D never moves weights (one all-reduce of B×h per column/row pair); SUMMA-style 2-D
on q×q devices moves ``(q−1)/q²·(|A| + |B|)`` elements into each device for every
product A·B; the 3-D cube (Bian et al. 2021) moves ``(q−1)/q³·(B·h_in + h_in·h_out +
B·h_out)`` per device per direction. See :func:`tensor_parallel_comparison`.
"""
from __future__ import annotations

import math

from ..comm import REPLICA_AXIS
from ..config import ModelConfig, ParallelConfig, TrainConfig, cube_edge, element_bytes
from ..grid import ProcessGrid
from ..parallel.schedule_actions import SPLIT_BACKWARD
from .calls import (NORM_BYTES, StepCalls, bytes_by_axis, dp_bytes_per_step, exact_bytes, p2p_counts,
                    ring_allgather_wire_bytes, ring_allreduce_wire_bytes, ring_reduce_scatter_wire_bytes)
from ..parallel.fp8 import history_axes, history_reduce_bytes
from .dry_run import boundary_elements, embedding_elements, fp8_histories, model_calls, params_by_data_axes
from .experts import all_to_all_calls, balanced_all_to_all_bytes
from .flops import recompute_policy
from .params import activation_element_bytes, layout_placement, local_model, padded_vocab, rank_chunks
from .summa import summa_comm_items
from .zero import zero_calls

__all__ = [
    "ring_allreduce_wire_bytes",
    "ring_allgather_wire_bytes",
    "ring_reduce_scatter_wire_bytes",
    "tp_layer_bytes",
    "pp_boundary_bytes",
    "dp_bytes_per_step",
    "comm_items",
    "replica_items",
    "comm_bytes_per_step",
    "cube_linear_elements",
    "summa_linear_elements",
    "one_d_layer_elements",
    "tensor_parallel_comparison",
]


# --------------------------------------------------------------------------------------
# Call bytes per axis
# --------------------------------------------------------------------------------------
def tp_layer_bytes(model: ModelConfig, micro_batch: int, tp: int, sp: bool = False,
                   recompute: str = "none", bytes_per_el: int = 4) -> dict:
    """1-D tensor-parallel call bytes of one transformer layer for one microbatch.

    Without sequence parallelism: ``{'all_reduce': k·b·s·h·e}`` with k = 4 (2 forward,
    2 backward), 6 with full recomputation. With it each all-reduce becomes an
    all-gather of the shard and a reduce-scatter, and the backward all-gathers the
    2 saved input shards of QKV and fc again: ``{'all_gather': (k + 2)·b·s·h·e/t,
    'reduce_scatter': k·b·s·h·e}``. Empty when t = 1.
    """
    if tp == 1:
        return {}
    k = 6 if recompute_policy(recompute) == "full" else 4
    x = micro_batch * model.seq_len * model.hidden * bytes_per_el
    if sp:
        regather = 2  # the backward's all-gathers of QKV's and fc's saved input shards
        return {"all_gather": exact_bytes((k + regather) * x / tp), "reduce_scatter": k * x}
    return {"all_reduce": k * x}


def pp_boundary_bytes(model: ModelConfig, micro_batch: int, tp: int = 1, sp: bool = False,
                      scatter_gather: bool = False, bytes_per_el: int = 4) -> float:
    """Bytes of one pipeline send (one boundary, one microbatch, one direction):
    ``b·s·h·e``, divided by t with sequence parallelism (the hidden states are
    already split along the sequence) or the scatter/gather optimisation."""
    x = micro_batch * model.seq_len * model.hidden * bytes_per_el
    return exact_bytes(x / tp) if (sp or scatter_gather) else x


def _replicated_elements(model: ModelConfig, layers: int, first: bool, last: bool) -> int:
    """Parameters copied on every tensor rank whose gradients are summed over it under
    sequence parallelism: LayerNorms and row-parallel biases (wpe is added before the
    sequence is split, so its gradient is already whole: no sum)."""
    h = model.hidden
    return layers * 6 * h + (2 * h if last else 0)


def replica_items(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, pp_rank: int = 0,
                  dtype_bytes: int | None = None) -> list[dict]:
    """The fault-tolerant replicas' gradient mean (``fault_tolerance.ReplicaAverage``): each
    rank all-reduces its whole gradient once per step, one flat buffer, over the 'replica'
    axis (its peers at the same place in the other replicas, through torchft), after the
    layout's own synchronisation inside its replica."""
    e = dtype_bytes or element_bytes(train.dtype)
    n = sum(params_by_data_axes(model, parallel, rank_chunks(model, parallel, pp_rank)).values())
    return [{"what": "gradients (the replicas' mean, torchft)", "axis": REPLICA_AXIS, "op": "all_reduce",
             "calls": 1, "bytes": n * e}]


def comm_items(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, pp_rank: int = 0,
               dtype_bytes: int | None = None, act_bytes: int | None = None, replicas: int = 1) -> list[dict]:
    """Every kind of call a rank of pipeline stage `pp_rank` makes in one step.

    Each item is ``{what, axis, op, calls, bytes}`` with `bytes` the call bytes summed
    over the step. `dtype_bytes` is the parameter/gradient element size (4, 8 for
    float64 training); `act_bytes` the activation size on the wire (2 with bf16
    precision, ``Comm.wire_dtype``; else `dtype_bytes`). Follows minitron's model: the vocab-parallel embedding all-reduces
    its output, the output layer enters the parallel region (f; under sequence
    parallelism an all-gather forward, and backward the re-gather of its saved input
    shard and a reduce-scatter), the loss all-reduces max, target logit and sum of
    exponentials (b·s each); under sequence parallelism replicated parameters sum their
    gradients over the tensor group; the gradient norm for clipping is one 8-byte
    all-reduce on the tensor and pipeline axes. `replicas` > 1: fault-tolerant replicas
    (``--ft-replicas``), each the layout on its 1/replicas share of the global batch, then
    their gradient mean (:func:`replica_items`).
    """
    if replicas > 1:
        share = train.replace(global_batch=train.global_batch // replicas)
        return (comm_items(model, parallel, share, pp_rank, dtype_bytes, act_bytes)
                + replica_items(model, parallel, train, pp_rank, dtype_bytes))
    mode = parallel.tp_mode
    if mode in ("2d", "2.5d", "3d") and parallel.tp > 1:
        return _grid_comm_items(model, parallel, train, pp_rank, dtype_bytes)
    e = dtype_bytes or element_bytes(train.dtype)
    ea = act_bytes or activation_element_bytes(parallel, e)
    t, p, d = parallel.tp, parallel.pp, parallel.dp
    v, sp = parallel.vpp, parallel.sp
    m = train.microbatches
    b = train.global_batch // (parallel.data_replicas * m)
    cp = parallel.cp
    tokens = local_model(model, cp)  # a context rank's activations: s/N tokens of each sequence
    s, h = tokens.seq_len, model.hidden
    x = b * s * h * ea
    first, last = layout_placement(parallel).holds_ends(pp_rank)
    items: list[dict] = []

    def add(what, axis, op, calls, nbytes):
        if calls and nbytes:
            items.append({"what": what, "axis": axis, "op": op, "calls": calls, "bytes": exact_bytes(nbytes)})

    # tensor and context parallel: read off the model's own forward and backward (a dry
    # run, analysis/dry_run.py), then the sums of its replicated gradients
    items += [it for it in model_calls(model, parallel, b, m, rank_chunks(model, parallel, pp_rank), e)
              if it["calls"]]
    if t > 1:
        add("gradient norm", "tp", "all_reduce", 1, NORM_BYTES)
    if parallel.precision == "fp8" and parallel.fp8_recipe == "delayed":
        n = fp8_histories(model, parallel, rank_chunks(model, parallel, pp_rank))
        for axis in history_axes(ProcessGrid.for_layout(parallel).sizes()):  # the step's amaxes, MAX
            add("FP8 amax history (delayed scaling)", axis, "all_reduce", 1, history_reduce_bytes(n))
    if parallel.scatter_gather and t > 1 and not sp and p > 1:
        recvs = p2p_counts(model, parallel, pp_rank)[1]
        add("scatter/gather: rebuild received activations", "tp", "all_gather", m * recvs, m * recvs * x / t)

    # pipeline
    if p > 1:
        sends, recvs = p2p_counts(model, parallel, pp_rank)
        nb = pp_boundary_bytes(tokens, b, t, sp, parallel.scatter_gather, ea)
        add("activations and their gradients", "pp", "send", m * sends, m * sends * nb)
        add("activations and their gradients", "pp", "recv", m * recvs, m * recvs * nb)
        add("gradient norm", "pp", "all_reduce", 1, NORM_BYTES)

    # tied embedding between the first and the last stage (an axis of one rank when
    # p = 1, or in a V, whose rank 0 holds both: nothing crosses a wire); multi-token
    # prediction's copy on the last stage alike
    if (model.tied_embeddings or model.mtp_depths) and p > 1 and first != last:
        add("tied embedding gradient", "embed", "all_reduce", 1, padded_vocab(model, t) // t * h * e)

    # experts: each MoE block's token dispatch and combine over 'ep' (routing is data: the
    # expected bytes of balanced routing, analysis/experts.py; a trace holds the routed ones)
    ep = parallel.ep
    moe_blocks = sum(model.is_moe_block(i) for ids, _, _ in rank_chunks(model, parallel, pp_rank) for i in ids)
    if ep > 1 and moe_blocks:
        tokens = b * s // (t if sp else 1)
        add("expert dispatch and combine (balanced routing: expected)", "ep", "all_to_all",
            all_to_all_calls(parallel.ep_overlap) * m * moe_blocks,
            m * moe_blocks * balanced_all_to_all_bytes(model, tokens, ea))
        add("gradient norm", "ep", "all_reduce", 1, NORM_BYTES)

    # data parallel: each parameter's gradient over its own data axes ('dp', 'dp_cp' with
    # context parallelism, 'dp_ep' for a dense weight under expert parallelism)
    grid = ProcessGrid.for_layout(parallel)
    dp_axis = grid.data_axis()
    if parallel.zero >= 2:  # ZeRO-2/3: unit by unit (analysis/zero.py)
        for c in zero_calls(model, parallel, train, pp_rank, e):
            what = c.get("what") or {"reduce_scatter": "gradients", "all_reduce": "gradient norm"}.get(c["op"],
                                                                                                   "parameters")
            add(f"{what} ({c['phase']})", c.get("axis") or dp_axis, c["op"], c["calls"], c["bytes"])
        return items
    sharded = []  # ZeRO-1's groups of shards: the dense weights', and the experts' under --ep
    for axes, n in params_by_data_axes(model, parallel, rank_chunks(model, parallel, pp_rank)).items():
        degree = math.prod(grid.sizes()[a] for a in axes)
        for op, nbytes in dp_bytes_per_step(n, degree, parallel.zero1, e).items():
            add("gradients" if op != "all_gather" else "updated parameter shards", grid.data_axis(axes), op, 1,
                nbytes)
        sharded += [grid.data_axis(axes)] if degree > 1 else []
    if parallel.zero1 and d * cp > 1:  # ZeRO-1's norm: squares summed over each group's shards too
        for axis in sharded or [dp_axis]:
            add("gradient norm", axis, "all_reduce", 1, NORM_BYTES)
    return items


def _grid_comm_items(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, pp_rank: int,
                     dtype_bytes: int | None) -> list[dict]:
    """:func:`comm_items` on the 2-D / 2.5-D grid and the 3-D cube: the grid's calls read
    off the model (the SUMMA products' broadcasts and reduces, the cube's gathers and
    reduce-scatters, the sums of vectors replicated on its lines), then the pipeline, the
    tied embedding and data parallelism. A split backward (zb-h1, zb-v, dualpipe-v) on the
    grid issues its weight-gradient products apart, which a dry run's one backward does not
    show: there the grid's closed form (analysis/summa.py) counts them."""
    if parallel.tp_mode in ("2d", "2.5d") and parallel.pp > 1 and parallel.schedule in SPLIT_BACKWARD:
        return summa_comm_items(model, parallel, train, pp_rank, dtype_bytes)
    e = dtype_bytes or element_bytes(train.dtype)
    ea = activation_element_bytes(parallel, e)
    m = train.microbatches
    b = train.global_batch // (parallel.dp * m)
    step = StepCalls()
    for it in model_calls(model, parallel, b, m, rank_chunks(model, parallel, pp_rank), e):
        step.add(it["what"], it["axis"], it["op"], it["calls"], it["bytes"])
    step.add_outside_grid(model, parallel, pp_rank, m, boundary_elements(model, parallel, b) * ea,
                          embedding_elements(model, parallel) * e, e)
    return step.items()


def comm_bytes_per_step(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                        pp_rank: int | None = None, dtype_bytes: int | None = None,
                        act_bytes: int | None = None, replicas: int = 1) -> dict:
    """Call bytes per step on one rank, ``{axis: {op: bytes}}`` (see :func:`comm_items`;
    `replicas`: fault-tolerant replicas).

    With `pp_rank` None, each (axis, op) is the maximum over the pipeline stages.
    """
    ranks = range(parallel.pp) if pp_rank is None else [pp_rank]
    out: dict = {}
    for r in ranks:
        per = bytes_by_axis(comm_items(model, parallel, train, r, dtype_bytes, act_bytes, replicas))
        for axis, ops in per.items():
            for op, nbytes in ops.items():
                out.setdefault(axis, {})[op] = max(out.get(axis, {}).get(op, 0), nbytes)
    return out


# --------------------------------------------------------------------------------------
# 1-D vs 2-D vs 3-D tensor parallelism (elements per device)
# --------------------------------------------------------------------------------------
def cube_linear_elements(tokens: int, h_in: int, h_out: int, q: int) -> float:
    """3-D tensor parallelism (q³ devices), one linear, one direction, per device:
    ``(q−1)/q³ · (B·h_in + h_in·h_out + B·h_out)`` elements (Bian et al. 2021):
    all-gather of X along one line, of W along another, reduce-scatter of Y."""
    return (q - 1) / q**3 * (tokens * h_in + h_in * h_out + tokens * h_out)


def summa_linear_elements(tokens: int, h_in: int, h_out: int, q: int) -> tuple[float, float]:
    """2-D (SUMMA) tensor parallelism on q×q devices, one linear, per device:
    (forward, backward) elements received. A product A·B broadcasts q−1 blocks of each
    operand into every device, ``(q−1)/q²·(|A| + |B|)``; forward is X·W, backward is
    dY·Wᵀ and Xᵀ·dY. (The textbook count; minitron's SUMMA, ``parallel/summa.py``,
    broadcasts W and X again in the backward instead of dY: ``analysis/summa.py`` counts
    what it sends, ``analysis/tp_schemes.py`` puts the four schemes side by side.)"""
    c = (q - 1) / q**2
    fwd = c * (tokens * h_in + h_in * h_out)
    bwd = c * (tokens * h_out + h_in * h_out) + c * (tokens * h_in + tokens * h_out)
    return fwd, bwd


def one_d_layer_elements(tokens: int, hidden: int, t: int) -> float:
    """1-D (Megatron) tensor parallelism, one transformer layer, one direction, per
    device: two ring all-reduces of tokens×hidden, ``4·(t−1)/t · B·h`` elements."""
    return 2 * ring_allreduce_wire_bytes(tokens * hidden, t)


def _linears(model: ModelConfig) -> list[tuple[int, int]]:
    h, f = model.hidden, model.ffn_hidden
    return [(h, 3 * h), (h, h), (h, f), (f, h)]


def tensor_parallel_comparison(model: ModelConfig, tokens: int, devices: int) -> list[dict]:
    """Elements moved per device for one transformer layer's four linears, for 1-D,
    2-D (SUMMA, q = √P) and 3-D (q = ∛P) tensor parallelism on `devices` devices.

    Returns one row per scheme: ``{scheme, devices, q, forward, backward, total,
    weights_per_device, feasible}``; ``feasible`` is False (and the counts None) when P
    is not a square (2-D) or a cube (3-D). `tokens` is B = b·s, the tokens of a
    microbatch. weights_per_device is the layer's matrix elements per device.
    """
    P = devices
    weights = sum(a * b for a, b in _linears(model))
    rows = []
    fwd = one_d_layer_elements(tokens, model.hidden, P)
    rows.append({"scheme": "1d", "devices": P, "q": P, "forward": fwd, "backward": fwd,
                 "total": 2 * fwd, "weights_per_device": weights / P, "feasible": True})
    q2 = math.isqrt(P)
    if q2 * q2 == P:
        f = sum(summa_linear_elements(tokens, a, b, q2)[0] for a, b in _linears(model))
        bw = sum(summa_linear_elements(tokens, a, b, q2)[1] for a, b in _linears(model))
        rows.append({"scheme": "2d", "devices": P, "q": q2, "forward": f, "backward": bw,
                     "total": f + bw, "weights_per_device": weights / P, "feasible": True})
    else:
        rows.append({"scheme": "2d", "devices": P, "q": None, "forward": None, "backward": None,
                     "total": None, "weights_per_device": None, "feasible": False})
    q3 = cube_edge(P)
    if q3**3 == P:
        f = sum(cube_linear_elements(tokens, a, b, q3) for a, b in _linears(model))
        rows.append({"scheme": "3d", "devices": P, "q": q3, "forward": f, "backward": f,
                     "total": 2 * f, "weights_per_device": weights / P, "feasible": True})
    else:
        rows.append({"scheme": "3d", "devices": P, "q": None, "forward": None, "backward": None,
                     "total": None, "weights_per_device": None, "feasible": False})
    return rows
