"""ZeRO's ladder by the numbers: what each rung keeps on a rank and what it sends.

ZeRO (Rajbhandari et al. 2020) removes the data-parallel redundancy of model states one
kind at a time: stage 1 shards the optimizer state over the d data-parallel ranks, stage
2 the gradients too, stage 3 the parameters as well. With Ψ parameters and mixed-precision
Adam (2 + 2 + 12 bytes per parameter, §3.1) a rank holds ``2Ψ + 2Ψ + 12Ψ/d`` (1),
``2Ψ + 14Ψ/d`` (2), ``16Ψ/d`` (3) bytes; minitron keeps every state in the parameter
dtype (fp32: 4 + 4 + 8 bytes), see :func:`zero_state_bytes`.

Traffic (§7): stages 1 and 2 move one all-reduce's worth (a reduce-scatter of gradients and
an all-gather of parameters, 2Ψ on the wire per rank in the limit); stage 3 gathers the
parameters twice (before a unit's forward and again before its backward) and
reduce-scatters the gradients: 3Ψ, 1.5× data parallelism (:func:`zero_wire_bytes`).

How minitron's rungs 2 and 3 lay out a rank's parameters (``minitron.parallel.zero``): in
*units*, each model chunk's non-block parameters (embeddings, final norm, output layer:
the "root", as FSDP wraps the root module) first, then one unit per transformer block;
each unit padded to a multiple of d so that rank r owns the r-th 1/d of every unit. Per
microbatch a unit's gradient is reduce-scattered as soon as its backward is done (no
full gradient buffer is kept). Stage 3 gathers a block before its forward and before its
backward and frees it after each; the root is gathered once per step (its first forward)
and kept until the step ends. The engine calls :func:`plan_units`, so the prediction and the
run share one plan.

Pure Python: no tensors, no processes.
"""
from __future__ import annotations

import math

from ..config import ModelConfig, ParallelConfig, TrainConfig, element_bytes
from ..grid import ProcessGrid
from ..parallel.buckets import plan_units
from .calls import NORM_BYTES, ring_allgather_wire_bytes, ring_allreduce_wire_bytes, ring_reduce_scatter_wire_bytes
from .dry_run import fp8_gathered_weights, unit_params_by_data_axes
from .params import layout_degrees, params_on_rank, rank_chunks

__all__ = ["plan_units", "zero_units", "zero_groups", "zero_calls", "zero_state_bytes", "zero_buffer_bytes",
           "zero_wire_bytes"]


def zero_units(model: ModelConfig, parallel: ParallelConfig, pp_rank: int = 0) -> list[dict]:
    """The units of a rank of pipeline stage `pp_rank`, in the engine's order:
    ``[{"kind": "root" | "block", "numel": n, "axes": data axes}, ...]`` (1-D tensor
    parallelism; a chunk with no embedding, norm or head has no root unit). Each unit's
    trained parameters are read off the model (:mod:`~minitron.analysis.dry_run`): for GPT-2
    a block is ``4h² + 2hf + 9h + f`` over t and the root the embeddings (V_pad·h/t + s·h),
    the final norm (2h) and the head. `axes` are the data axes the unit is sharded over:
    under --ep a block with experts is two units (``parallel.zero.sharded_data_parallel``),
    its dense weights sharded over every data replica, its experts over the replicas that
    hold the same experts."""
    units = []
    for ids, first, last in rank_chunks(model, parallel, pp_rank):  # this rank's chunks, in order
        units += _group_units("root", unit_params_by_data_axes(model, parallel, None, first, last),
                              fp8_gathered_weights(model, parallel, None, first, last))
        for i in ids:
            units += _group_units("block", unit_params_by_data_axes(model, parallel, i),
                                  fp8_gathered_weights(model, parallel, i))
    return units


def _group_units(kind: str, by_axes: dict[tuple, int], fp8: tuple[int, int]) -> list[dict]:
    """A unit's parameters as one unit per data group, and under ZeRO-3's FP8 gathers
    (``parallel/fp8_gather.py``) the dense group's FP8 linears' weights (`fp8`: elements,
    linears; gathered 1 byte an element) apart from the rest (routed experts stay unquantized)."""
    n8, linears = fp8
    dense = max(by_axes, key=len, default=())
    parts = [{"kind": kind, "numel": n8, "axes": dense, "fp8_linears": linears}] if n8 else []
    for axes, numel in by_axes.items():
        rest = numel - (n8 if axes == dense else 0)
        parts += [{"kind": kind, "numel": rest, "axes": axes}] if rest else []
    return parts


def _shard(numel: int, d: int) -> int:
    return -(-numel // d)


def zero_groups(model: ModelConfig, parallel: ParallelConfig, pp_rank: int = 0) -> list[tuple[str, int, list]]:
    """``[(data axis name, degree, its units)]``: the rank's units (:func:`zero_units`) by the
    data group each is sharded over, the dense group first (one group without experts;
    the degree is d, d·cp under context parallelism, d·cp·ep for dense weights under --ep)."""
    grid, groups = ProcessGrid.for_layout(parallel), {}
    for u in zero_units(model, parallel, pp_rank):
        groups.setdefault(u["axes"], []).append(u)
    sizes = grid.sizes()
    return [(grid.data_axis(axes), math.prod(sizes[a] for a in axes), units)
            for axes, units in sorted(groups.items(), key=lambda kv: -len(kv[0]))]


def zero_calls(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, pp_rank: int = 0,
               bytes_per_el: int | None = None) -> list[dict]:
    """The data-parallel calls of one optimizer step under ``--zero 2`` or ``--zero 3``:
    ``[{op, phase, calls, bytes, axis}]`` in call bytes (the all-gather's input shard, the
    reduce-scatter's whole input), as a trace records them, for each data group of
    :func:`zero_groups` (each a synchroniser of its own in the engine).

    Per microbatch, every unit's gradient: one reduce-scatter (phase 'bwd'). Then the
    gradient norm's 8-byte all-reduce. Stage 2: one all-gather per unit of the updated
    shard after the step ('optim'). Stage 3: one all-gather per block before its forward
    ('fwd') and one before its backward ('bwd') per microbatch, one per root per step; a
    unit of FP8-gathered weights moves 1 byte an element, after one all-reduce (MAX) of its
    linears' amaxes per step over the data axis and, with t > 1, over 'tp'. Each group after
    the first sums its squared norm over 'tp' and 'pp' once more (``GroupedOptimizer``).
    """
    if parallel.zero < 2:
        return []
    e = bytes_per_el or element_bytes(train.dtype)
    t, p = layout_degrees(parallel)[0], parallel.pp
    out = []
    for g, (axis, d, units) in enumerate(zero_groups(model, parallel, pp_rank)):
        if d > 1:
            out += [{**c, "axis": c.get("axis") or axis} for c in _group_calls(units, d, parallel, train.microbatches, e)]
        if g:
            out += [{"op": "all_reduce", "phase": "optim", "calls": 1, "bytes": NORM_BYTES, "axis": a,
                     "what": "gradient norm"} for a, n in (("tp", t), ("pp", p)) if n > 1]
    return [c for c in out if c["calls"]]


def _group_calls(units: list[dict], d: int, parallel: ParallelConfig, m: int, e: int) -> list[dict]:
    """:func:`zero_calls` of one data group of `d` ranks, `m` microbatches, `e`-byte elements."""
    z = parallel.zero
    padded = [_shard(u["numel"], d) * d for u in units]
    out = [{"op": "reduce_scatter", "phase": "bwd", "calls": m * len(units), "bytes": m * sum(padded) * e}]
    if z == 3:
        wire = [1 if u.get("fp8_linears") else e for u in units]  # bytes an element on the wire
        blocks = [s // d * w for s, u, w in zip(padded, units, wire) if u["kind"] == "block"]
        roots = [s // d * w for s, u, w in zip(padded, units, wire) if u["kind"] == "root"]
        out.append({"op": "all_gather", "phase": "fwd", "calls": m * len(blocks) + len(roots),
                    "bytes": m * sum(blocks) + sum(roots)})
        if blocks:
            out.append({"op": "all_gather", "phase": "bwd", "calls": m * len(blocks), "bytes": m * sum(blocks)})
        out += _fp8_amax_calls(units, parallel, e)
    out.append({"op": "all_reduce", "phase": "optim", "calls": 1, "bytes": NORM_BYTES})
    if z == 2:
        out.append({"op": "all_gather", "phase": "optim", "calls": len(units), "bytes": sum(padded) // d * e})
    return out


def _fp8_amax_calls(units: list[dict], parallel: ParallelConfig, e: int) -> list[dict]:
    """The FP8 gathers' scales: per FP8 unit per step one all-reduce (MAX) of its linears'
    amaxes (`e` bytes each) over the data axis, then over 'tp' when the tensor ranks split them."""
    amax = [u["fp8_linears"] * e for u in units if u.get("fp8_linears")]
    axes = [None] + (["tp"] if layout_degrees(parallel)[0] > 1 else [])
    return [{"op": "all_reduce", "phase": "fwd", "calls": len(amax), "bytes": sum(amax), "axis": a,
             "what": "FP8 weight amax"} for a in axes if amax]


def zero_state_bytes(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, pp_rank: int = 0,
                     bytes_per_el: int | None = None) -> dict:
    """Bytes a rank keeps between steps at its ZeRO stage (``parallel.zero``):
    ``{params_bytes, grads_bytes, optimizer_bytes}``, minitron's engine exactly (every
    state in the parameter dtype: AdamW's two moments are ``2·e`` per element).

    stage 0: n, n, 2n elements; 1: n, n, 2·Σ_g ceil(n_g/d_g); 2: n, s, 2s; 3: s + w, s, 2s,
    where s = Σ ceil(n_u/d_u) over the units (n/d up to padding), each sharded over its
    data group's d_g ranks (:func:`zero_groups`; one group of d·cp without experts) and w
    the elements trained by no gradient (a router's selection bias), kept whole.
    Stage 3 also holds, for a moment, the gathered units: see :func:`zero_buffer_bytes`.
    """
    e = bytes_per_el or element_bytes(train.dtype)
    z, groups = parallel.zero, zero_groups(model, parallel, pp_rank)
    n = params_on_rank(model, parallel, pp_rank)
    if z == 0 or all(d == 1 for _, d, _ in groups):
        return {"params_bytes": n * e, "grads_bytes": n * e, "optimizer_bytes": 2 * n * e}
    untrained = n - sum(u["numel"] for _, _, units in groups for u in units)  # a selection bias: whole
    if z == 1:
        s = sum(_shard(sum(u["numel"] for u in units), d) for _, d, units in groups)
        return {"params_bytes": n * e, "grads_bytes": n * e, "optimizer_bytes": 2 * s * e}
    s = sum(_shard(u["numel"], d) for _, d, units in groups for u in units)
    return {"params_bytes": (n if z == 2 else s + untrained) * e, "grads_bytes": s * e, "optimizer_bytes": 2 * s * e}


def zero_buffer_bytes(model: ModelConfig, parallel: ParallelConfig, pp_rank: int = 0,
                      bytes_per_el: int = 4) -> dict:
    """What stages 2 and 3 hold for a moment, beyond the states of :func:`zero_state_bytes`
    (an estimate of the peak): ``{gathered, staging, padding}`` bytes, summed over the data
    groups (each prefetches and reduce-scatters its own units).

    gathered (stage 3): every root unit (kept for the step) and two blocks (the one
    computing and the next, prefetched). staging: the gradient buffers of units being
    reduce-scattered: the roots (their first gradients come early in backward, their last
    at its end) and three blocks (two reduce-scatters in flight, one filling).
    padding (stage 2): the full parameter buffers' padding to multiples of d.
    Not counted: the working memory of the collectives themselves (NCCL's, or on gloo
    the copy of each unit that ``comm.reduce_scatter_single`` receives into while its
    reduce-scatter is in flight).
    """
    e, z = bytes_per_el, parallel.zero
    out = {"gathered": 0, "staging": 0, "padding": 0}
    for _, d, units in zero_groups(model, parallel, pp_rank):
        padded = [_shard(u["numel"], d) * d for u in units]
        roots = sum(s for s, u in zip(padded, units) if u["kind"] == "root")
        blocks = sorted((s for s, u in zip(padded, units) if u["kind"] == "block"), reverse=True)
        out["gathered"] += (roots + sum(blocks[:2])) * e if z == 3 else 0
        out["staging"] += (roots + sum(blocks[:3])) * e if z >= 2 else 0
        out["padding"] += (sum(padded) - sum(u["numel"] for u in units)) * e if z == 2 else 0
    return out


def zero_wire_bytes(n_params: int, d: int, stage: int, bytes_per_el: int = 4) -> float:
    """Bytes each rank sends per step with ring collectives, one microbatch, ``n·e`` of
    parameters: stages 0–2 one all-reduce's worth, ``2(d−1)/d·n·e``; stage 3 one more
    all-gather, ``3(d−1)/d·n·e`` (1.5×; ZeRO §7.2.2)."""
    if d == 1:
        return 0.0
    nbytes = n_params * bytes_per_el
    if stage < 3:
        return ring_allreduce_wire_bytes(nbytes, d)
    return 2 * ring_allgather_wire_bytes(nbytes, d) + ring_reduce_scatter_wire_bytes(nbytes, d)

