"""Collective calls: the vocabulary every communication formula shares.

A *call* is one record ``{what, phase, op, axis, calls, bytes}`` in **call bytes**: the
size of the local tensor handed to one call, the way :class:`minitron.comm.CommTrace`
records it (the whole tensor for all-reduce, broadcast and send/recv, the local *input
shard* for all-gather, the full local *input* for reduce-scatter). Its **wire bytes**
are what a ring (or pipelined line) algorithm really sends out of each of n devices:

=================  ==============================
op                 bytes sent per device
=================  ==============================
all-reduce         ``2(n−1)/n`` × the buffer
all-gather         ``(n−1)/n`` × the gathered output
reduce-scatter     ``(n−1)/n`` × the input
broadcast, reduce  ``(n−1)/n`` × the block (pipelined, on average over the line)
send, recv         the tensor
=================  ==============================

Beside them: the data-parallel call bytes of a step, the pipeline sends and receives
of a rank, and :class:`StepCalls`, which sums a step's calls by (what, axis, op) and
adds the calls outside a 2-D/3-D tensor grid. ``comm.py`` (1-D), ``summa.py`` (2-D,
2.5-D), ``cube.py`` (3-D), ``zero.py`` and ``data_parallel.py`` build on these.
"""
from __future__ import annotations

import math
from typing import Any

from ..config import ModelConfig
from .params import chunk_layers, layout_placement, params_on_rank

__all__ = ["NORM_BYTES", "ring_allreduce_wire_bytes", "ring_allgather_wire_bytes",
           "ring_reduce_scatter_wire_bytes", "call", "wire_bytes", "exact_bytes", "dp_bytes_per_step",
           "p2p_counts", "StepCalls", "bytes_by_axis", "sent_bytes_by_axis"]

# The gradient norm for clipping: one float64 (8 bytes) all-reduced per axis that
# splits the parameters (minitron.optim.sum_of_squares is float64).
NORM_BYTES = 8


# --------------------------------------------------------------------------------------
# Wire volume of ring collectives (bytes sent by each of n devices)
# --------------------------------------------------------------------------------------
def ring_allreduce_wire_bytes(nbytes: float, n: int) -> float:
    """Ring all-reduce of an `nbytes` buffer: each device sends ``2(n−1)/n · nbytes``
    (a reduce-scatter then an all-gather, n−1 steps each)."""
    return 2 * (n - 1) / n * nbytes


def ring_allgather_wire_bytes(total_bytes: float, n: int) -> float:
    """Ring all-gather into a `total_bytes` output: each device sends ``(n−1)/n · total``."""
    return (n - 1) / n * total_bytes


def ring_reduce_scatter_wire_bytes(total_bytes: float, n: int) -> float:
    """Ring reduce-scatter of a `total_bytes` input: each device sends ``(n−1)/n · total``."""
    return (n - 1) / n * total_bytes


# --------------------------------------------------------------------------------------
# One call
# --------------------------------------------------------------------------------------
def call(what: str, phase: str, op: str, axis: str, nbytes: float, calls: int = 1) -> dict:
    """One call record (bytes per call, a whole number)."""
    return {"what": what, "phase": phase, "op": op, "axis": axis, "calls": calls, "bytes": int(nbytes)}


def wire_bytes(record: dict, n: int) -> float:
    """Bytes a rank sends on a line of n for one traced call of ``record['bytes']`` (the
    table in the module docstring)."""
    x = record["bytes"]
    if record["op"] == "all_gather":
        return ring_allgather_wire_bytes(n * x, n)
    if record["op"] == "reduce_scatter":
        return ring_reduce_scatter_wire_bytes(x, n)
    if record["op"] == "all_reduce":
        return ring_allreduce_wire_bytes(x, n)
    if record["op"] in ("broadcast", "reduce"):
        return (n - 1) / n * x
    return x  # send / recv


def exact_bytes(x: float) -> float | int:
    """An int when the byte count is whole (traces record ints), else the float."""
    return int(x) if float(x).is_integer() else x


# --------------------------------------------------------------------------------------
# Data-parallel and pipeline calls of a rank
# --------------------------------------------------------------------------------------
def dp_bytes_per_step(n_params: int, d: int, zero1: bool = False, bytes_per_el: int = 4) -> dict:
    """Data-parallel call bytes per step for a rank holding `n_params` elements.

    Plain: ``{'all_reduce': n·e}`` (buckets or one call per parameter, the same sum).
    ZeRO-1: ``{'reduce_scatter': ceil(n/d)·d·e, 'all_gather': ceil(n/d)·e}``.
    """
    if d == 1:
        return {}
    if zero1:
        shard = math.ceil(n_params / d)
        return {"reduce_scatter": shard * d * bytes_per_el, "all_gather": shard * bytes_per_el}
    return {"all_reduce": n_params * bytes_per_el}


def p2p_counts(model: ModelConfig, layout: Any, pp_rank: int) -> tuple[int, int]:
    """(sends, receives) per microbatch on `pp_rank`, both directions: stage c sends
    forward unless it is the last or stage c+1 is on the same rank (the V's turn on rank
    p−1 hands over in memory), receives forward unless it is the first or stage c−1 is on
    the same rank, and the backward mirrors that."""
    chunks = len(chunk_layers(model, layout))
    where = layout_placement(layout)
    rank = [where.locate(c)[0] for c in range(chunks)]
    mine = [c for c in range(chunks) if rank[c] == pp_rank]
    to_next = sum(c < chunks - 1 and rank[c + 1] != pp_rank for c in mine)
    from_prev = sum(c > 0 and rank[c - 1] != pp_rank for c in mine)
    return to_next + from_prev, from_prev + to_next


# --------------------------------------------------------------------------------------
# A whole step
# --------------------------------------------------------------------------------------
class StepCalls:
    """One step's calls on a rank, merged by (what, axis, op): ``{what, axis, op, calls,
    bytes}`` with calls and bytes summed over the step (the format of
    :func:`minitron.analysis.comm.comm_items`)."""

    def __init__(self):
        self.merged: dict = {}

    def add(self, what: str, axis: str, op: str, calls: int, nbytes: float) -> None:
        if calls and nbytes:
            it = self.merged.setdefault((what, axis, op), {"what": what, "axis": axis, "op": op,
                                                           "calls": 0, "bytes": 0})
            it["calls"] += calls
            it["bytes"] += nbytes

    def add_per_microbatch(self, records: list[dict], microbatches: int) -> None:
        """Call records of one microbatch, made `microbatches` times in a step, merged
        by the part of ``what`` before the colon (the layer: "qkv: input all-gather")."""
        for c in records:
            self.add(c["what"].split(":")[0], c["axis"], c["op"], microbatches * c["calls"],
                     microbatches * c["calls"] * c["bytes"])

    def add_per_step(self, records: list[dict]) -> None:
        """Call records made once per step (the gradient sums after the backward)."""
        for c in records:
            self.add(c["what"], c["axis"], c["op"], 1, c["bytes"])

    def add_outside_grid(self, model: ModelConfig, parallel: Any, pp_rank: int, microbatches: int,
                         boundary_bytes: int, tied_bytes: int, bytes_per_el: int) -> None:
        """The calls of a 2-D/3-D tensor-grid rank beyond the grid's own: the gradient
        norm over the tensor ranks, the pipeline's sends and receives of
        `boundary_bytes` (and its norm), the tied embedding's gradient (`tied_bytes`,
        first and last stage) and data parallelism (with ZeRO-1 its norm)."""
        p, d = parallel.pp, parallel.dp
        m, e = microbatches, bytes_per_el
        chunks = p * parallel.vpp
        first, last = layout_placement(parallel).holds_ends(pp_rank)
        if parallel.tp > 1:
            self.add("gradient norm", "tp", "all_reduce", 1, NORM_BYTES)
        if p > 1:
            sends, recvs = p2p_counts(model, parallel, pp_rank)
            self.add("activations and their gradients", "pp", "send", m * sends, m * sends * boundary_bytes)
            self.add("activations and their gradients", "pp", "recv", m * recvs, m * recvs * boundary_bytes)
            self.add("gradient norm", "pp", "all_reduce", 1, NORM_BYTES)
        if model.tied_embeddings and chunks > 1 and (first or last):
            self.add("tied embedding gradient", "embed", "all_reduce", 1, tied_bytes)
        n = params_on_rank(model, parallel, pp_rank)
        for op, nbytes in dp_bytes_per_step(n, d, parallel.zero1, e).items():
            self.add("gradients" if op != "all_gather" else "updated parameter shards", "dp", op, 1, nbytes)
        if parallel.zero1 and d > 1:  # ZeRO-1's norm: squares summed over the dp shards too
            self.add("gradient norm", "dp", "all_reduce", 1, NORM_BYTES)

    def items(self) -> list[dict]:
        return list(self.merged.values())


def bytes_by_axis(items: list[dict]) -> dict:
    """Call bytes summed per axis and op: ``{axis: {op: bytes}}``."""
    out: dict = {}
    for it in items:
        ax = out.setdefault(it["axis"], {})
        ax[it["op"]] = ax.get(it["op"], 0) + it["bytes"]
    return out


def sent_bytes_by_axis(items: list[dict], sizes: dict) -> dict:
    """Wire bytes sent out of a rank per axis (:func:`wire_bytes` of every call or item, on
    the axis' `sizes`; receives not counted, their bytes are another rank's sends): the
    measure in which a collective and the ring of sends that replaces it (``--tp-overlap``)
    are equal."""
    out: dict = {}
    for it in items:
        if it["op"] != "recv":
            out[it["axis"]] = out.get(it["axis"], 0) + wire_bytes(it, sizes[it["axis"]])
    return out
