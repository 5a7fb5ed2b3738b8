"""Data parallelism by the numbers: the bucket plan, every data-parallel call of a step,
and model-state bytes with and without ZeRO-1.

The totals live next door: :func:`~minitron.analysis.calls.dp_bytes_per_step` (call bytes
per step) and :func:`~minitron.analysis.memory.memory_on_rank` (``optimizer_bytes`` is
``2·ceil(n/d)·e`` with ZeRO-1). This module adds what a trace shows call by call:

* :func:`plan_buckets` — how the engine lays gradients out in one flat buffer and cuts it
  into buckets: the engine's own plan (``minitron.parallel.buckets``, imported here), so the
  prediction and the run share one plan.
* :func:`dp_calls` — the data-parallel calls of one optimizer step on one rank: op, the
  phase it is issued in, how many calls, how many bytes.
* :func:`model_state_bytes` — parameters, gradients and optimizer state per rank,
  replicated beside ZeRO-1.

A rank holding n parameter elements of e bytes, d data-parallel ranks:

========================  ====================================  ==============================
implementation            calls per step                        call bytes per step
========================  ====================================  ==============================
naive                     one all-reduce per tensor, after bwd  ``n·e``
bucketed                  one all-reduce per bucket, during     ``n·e``
                          the last microbatch's backward
ZeRO-1 (bucketed)         one reduce-scatter per bucket during  ``ceil(n/d)·d·e``
                          backward; one all-gather per bucket   ``ceil(n/d)·e``
                          after the step; the norm (8 bytes)    ``8``
========================  ====================================  ==============================

ZeRO-2 and ZeRO-3 (``--zero 2|3``) reduce-scatter unit by unit, every microbatch, and
ZeRO-3 gathers each block twice per microbatch: their calls, states and traffic are in
:mod:`minitron.analysis.zero`.

Pure Python: no tensors, no processes.
"""
from __future__ import annotations

import dataclasses
import math

from ..config import ModelConfig, ParallelConfig, TrainConfig
from ..parallel.buckets import Bucket, bucket_elements, plan_buckets
from .calls import (NORM_BYTES, dp_bytes_per_step, ring_allgather_wire_bytes, ring_allreduce_wire_bytes,
                    ring_reduce_scatter_wire_bytes)
from .memory import memory_on_rank

__all__ = ["Bucket", "plan_buckets", "bucket_elements", "dp_calls", "dp_wire_bytes", "model_state_bytes",
           "NORM_BYTES"]

def dp_calls(numels, d: int, impl: str = "bucketed", zero1: bool = False, bucket_mb: float = 4.0,
             bytes_per_el: int = 4, late_tensors: int = 0) -> list[dict]:
    """The data-parallel calls of one optimizer step on a rank holding tensors of `numels`
    elements, in the engine's buffer order (``minitron.parallel.data``: reversed order of
    the model's parameters; with ZeRO-1 the `late_tensors` that need another sum first —
    ``ShardInfo.grad_sync`` — go last and their buckets start after backward).

    Each item is ``{op, phase, calls, bytes}``: 'bwd' when issued during the last
    microbatch's backward (overlapped), 'optim' when issued after it. Byte totals agree
    with :func:`~minitron.analysis.calls.dp_bytes_per_step`.
    """
    numels = list(numels)
    n, e = sum(numels), bytes_per_el
    if d == 1:
        return []
    if impl not in ("naive", "bucketed"):
        raise ValueError(f"unknown data-parallel implementation '{impl}': use naive or bucketed")
    if not zero1:
        if impl == "naive":
            return [{"op": "all_reduce", "phase": "optim", "calls": len(numels), "bytes": n * e}]
        _, buckets, _ = plan_buckets(numels, bucket_elements(bucket_mb, e))
        return [{"op": "all_reduce", "phase": "bwd", "calls": len(buckets), "bytes": n * e}]
    cap = bucket_elements(bucket_mb, e) if impl == "bucketed" else max(1, n)
    _, buckets, total = plan_buckets(numels, cap, d)
    first_late = len(numels) - late_tensors
    late = [b for b in buckets if any(i >= first_late for i in b.tensors)]
    early = [b for b in buckets if b not in late]
    out = []
    if impl == "bucketed" and early:
        out.append({"op": "reduce_scatter", "phase": "bwd", "calls": len(early),
                    "bytes": sum(b.numel for b in early) * e})
    rest = late if impl == "bucketed" else buckets
    if rest:
        out.append({"op": "reduce_scatter", "phase": "optim", "calls": len(rest),
                    "bytes": sum(b.numel for b in rest) * e})
    out.append({"op": "all_reduce", "phase": "optim", "calls": 1, "bytes": NORM_BYTES})
    out.append({"op": "all_gather", "phase": "optim", "calls": len(buckets), "bytes": total // d * e})
    return out


def dp_wire_bytes(n_params: int, d: int, zero1: bool = False, bytes_per_el: int = 4) -> float:
    """Bytes each rank sends per step with ring algorithms: ``2(d−1)/d · n·e`` either way
    (ZeRO-1's reduce-scatter plus all-gather is one all-reduce cut in two), plus padding."""
    if d == 1:
        return 0.0
    calls = dp_bytes_per_step(n_params, d, zero1, bytes_per_el)
    if not zero1:
        return ring_allreduce_wire_bytes(calls["all_reduce"], d)
    return (ring_reduce_scatter_wire_bytes(calls["reduce_scatter"], d)
            + ring_allgather_wire_bytes(calls["all_gather"] * d, d))


def model_state_bytes(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                      pp_rank: int = 0) -> dict:
    """Parameters, gradients and AdamW state per rank, replicated and with ZeRO-1.

    Returns ``{params_bytes, grads_bytes, optimizer_bytes, optimizer_bytes_zero1,
    optimizer_bytes_replicated, zero1_fraction}`` where ``optimizer_bytes`` follows
    ``parallel.zero1`` and ``zero1_fraction`` is ZeRO-1's share of the replicated state
    (``ceil(n/d)/n``, 1/d up to padding). Every rung: :func:`minitron.analysis.zero.zero_state_bytes`.
    """
    rep = memory_on_rank(model, dataclasses.replace(parallel, zero1=False, zero=0), train, pp_rank)
    d = parallel.dp
    z = memory_on_rank(model, dataclasses.replace(parallel, zero1=d > 1, zero=int(d > 1)), train, pp_rank)
    return {"params_bytes": rep["params_bytes"], "grads_bytes": rep["grads_bytes"],
            "optimizer_bytes": z["optimizer_bytes"] if parallel.zero1 else rep["optimizer_bytes"],
            "optimizer_bytes_zero1": z["optimizer_bytes"], "optimizer_bytes_replicated": rep["optimizer_bytes"],
            "zero1_fraction": z["optimizer_bytes"] / rep["optimizer_bytes"] if rep["optimizer_bytes"] else math.nan}
