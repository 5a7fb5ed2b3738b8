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

Wire bytes equal call bytes here: each point-to-point message crosses one link once.
Against sequence parallelism's collectives this is ``(N−1)/N`` of the K and V of the
whole sequence per direction, but it overlaps the block computations (each hop is
posted before the block that uses the current one).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ..config import ModelConfig
from .flops import recompute_policy
from .memory import memory_on_rank
from .params import layers_on_rank, layout_get, local_model

__all__ = ["cp_message_elements", "cp_comm_items", "cp_activation_table"]


def cp_message_elements(model: ModelConfig, micro_batch: int, tp: int, cp: int) -> int:
    """Elements of one ring message: K and V of the rank's s/N tokens on its h/t
    hidden columns (its heads), ``2·b·(s/N)·(h/t)``."""
    return 2 * micro_batch * (model.seq_len // cp) * (model.hidden // tp)


def cp_comm_items(model: ModelConfig, parallel: Any, train: Any, pp_rank: int = 0,
                  act_bytes: int = 4) -> list[dict]:
    """The ring's calls on the 'cp' axis of a rank of pipeline stage `pp_rank` in one
    step, as ``analysis.comm.comm_items`` lists them: ``{what, axis, op, calls, bytes}``.
    `act_bytes` is the element size of activations on the wire (K and V); the dK, dV
    accumulators travel in the compute dtype, ``max(act_bytes, 4)``."""
    n = int(layout_get(parallel, "cp", 1) or 1)
    if n == 1:
        return []
    t, d = int(layout_get(parallel, "tp", 1) or 1), int(layout_get(parallel, "dp", 1) or 1)
    m = train.microbatches
    b = train.global_batch // (d * m)
    layers = layers_on_rank(model, parallel, pp_rank)
    el = cp_message_elements(model, b, t, n)
    hops = m * layers * (n - 1)  # per pass of the ring over this rank's layers
    forwards = 2 if recompute_policy(layout_get(parallel, "recompute", "none")) != "none" else 1
    items = []
    for op in ("send", "recv"):
        items.append({"what": "ring attention: K, V (forward" + (", recomputed" if forwards > 1 else "")
                      + " and backward)", "axis": "cp", "op": op, "calls": (forwards + 1) * hops,
                      "bytes": (forwards + 1) * hops * el * act_bytes})
        items.append({"what": "ring attention: dK, dV accumulated around the ring (backward)", "axis": "cp",
                      "op": op, "calls": hops, "bytes": hops * el * max(act_bytes, 4)})
    return items


def cp_activation_table(model: ModelConfig, parallel: Any, train: Any, cps=(1, 2, 4, 8),
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
            lay = _replace(parallel, cp=n)
            acts = memory_on_rank(m, lay, train, 0, bytes_per_el)["activations_bytes"]
            base = acts if n == 1 else base
            rows.append({"seq_len": s, "cp": n, "activations_bytes": acts,
                         "ratio": base / acts if base else None})
    return rows


def _replace(layout: Any, **kw) -> Any:
    if isinstance(layout, dict):
        return {**layout, **kw}
    return dataclasses.replace(layout, **kw)
