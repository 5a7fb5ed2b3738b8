"""1-D tensor parallelism by the numbers: what a layer keeps, what it sends, and why
t stays inside a node.

Activations a layer keeps for its backward
------------------------------------------
:func:`minitron.analysis.memory.saved_bytes_per_layer` counts what minitron's ``Block``
saves, item by item; :func:`activation_table` puts it beside Korthikanti et al.'s
Table 2 (:func:`minitron.analysis.memory.korthikanti_activation_bytes_per_layer`) for
each combination of ``--sp`` and recomputation.

Communication of one layer, one microbatch, one tensor rank
-----------------------------------------------------------
Without ``--sp``: g all-reduces b·s·h after attention and after the MLP (forward), f
all-reduces the gradient of their inputs (backward): 2 + 2 all-reduces of b·s·h. With
``--sp`` each all-reduce becomes an all-gather (of the b·s·h/t shard) and a
reduce-scatter (of b·s·h): the same bytes on the wire, 2(t−1)/t · b·s·h·e per pair
on a ring. The price of keeping only the input shard of QKV and fc is one more
all-gather of it in each one's backward (the weight gradient needs the whole input):
2 per layer, (t−1)/t · b·s·h·e on the wire each. Full recomputation replays the two
forward collectives in the backward. Once per microbatch: the vocabulary-parallel
embedding's g (an all-reduce of b·s·h forward; under ``--sp`` the sequence split
all-gathers its gradient), the output layer's f (all-reduce backward; under ``--sp``
an all-gather forward, and backward the re-gather of its input shard and a
reduce-scatter) and the cross-entropy's three all-reduces of b·s numbers (max, target
logit, sum of exponentials). :func:`tp_collectives` lists them with the phase they
run in, as :class:`minitron.comm.CommTrace` records them.

With ``--tp-overlap`` (``parallel/collective_matmul.py``; Wang et al. 2022) every
all-gather and reduce-scatter of a linear — the entries, the exits, the re-gathers and
their backward and replayed counterparts; not the embedding's sequence split, which feeds
no matmul — becomes a ring of t−1 steps, each one send and one receive of one sequence
chunk, b·s·h·e/t: the trace counts t−1 messages where it counted one call. The bytes on
the wire do not change: a ring all-gather of t−1 steps sends (t−1)·N/t of the gathered N
out of each rank, the (t−1)/t·N of :func:`~minitron.analysis.calls.ring_allgather_wire_bytes`,
and a ring reduce-scatter of t−1 steps sends (t−1) chunks of N/t, the (t−1)/t·N of
:func:`~minitron.analysis.calls.ring_reduce_scatter_wire_bytes`
(:func:`~minitron.analysis.calls.sent_bytes_by_axis` sums either way of counting).

Why t stays inside a node
-------------------------
A layer's compute shrinks as 1/t, its all-reduces do not: each moves
2(t−1)/t · b·s·h·e bytes out of every GPU whatever t is. Inside a node they run over
NVLink; beyond it the ring crosses InfiniBand, an order of magnitude slower per GPU.
:func:`tp_scaling` prices both (bandwidths and latencies are parameters; defaults from
:data:`minitron.analysis.cluster.CLUSTERS`) and shows the communication time passing
the compute time as soon as t leaves the node. ``python -m
minitron.analysis.tensor_parallel`` prints the tables.
"""
from __future__ import annotations

from ..config import ModelConfig, PRESETS
from .cluster import get_cluster
from .calls import ring_allreduce_wire_bytes
from .flops import layer_forward_flops, recompute_policy
from .memory import activation_bytes_per_layer, korthikanti_activation_bytes_per_layer, saved_bytes_per_layer

__all__ = ["activation_table", "tp_collectives", "tp_scaling", "format_table"]


# --------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------
def activation_table(model: ModelConfig, micro_batch: int, tp: int, bytes_per_el: int = 4,
                     dropout: bool | None = None) -> list[dict]:
    """One row per (sp, recompute): minitron's count next to Table 2 per element
    (same e and masks) and Table 2 literally (2-byte activations, 1-byte masks)."""
    rows = []
    drop = model.dropout > 0 if dropout is None else dropout
    for sp in (False, True):
        for rc in ("none", "selective", "full"):
            ours = sum(saved_bytes_per_layer(model, micro_batch, tp, sp, rc, bytes_per_el, drop).values())
            table2 = activation_bytes_per_layer(model, micro_batch, tp, sp, rc, bytes_per_el, 1, drop)
            literal = korthikanti_activation_bytes_per_layer(model.seq_len, micro_batch, model.hidden,
                                                             model.heads, tp, sp, rc)
            rows.append({"tp": tp, "sp": sp, "recompute": rc, "minitron_bytes": ours,
                         "table2_bytes": table2, "table2_16bit_bytes": literal})
    return rows


# --------------------------------------------------------------------------------------
# Communication
# --------------------------------------------------------------------------------------
def tp_collectives(model: ModelConfig, micro_batch: int, tp: int, sp: bool = False,
                   recompute: str = "none", layers: int | None = None, first: bool = True,
                   last: bool = True, bytes_per_el: int = 4, loss_bytes_per_el: int | None = None,
                   overlap: bool = False) -> list[dict]:
    """Tensor-axis collectives of one microbatch on one tensor rank, as the trace
    records them: ``{what, phase, op, calls, bytes}`` with `bytes` per call (the local
    input's size: the shard for all-gather, the whole input for reduce-scatter).

    `layers` defaults to all of the model's; `first`/`last`: whether this rank holds
    the embedding / the output layer and loss. `loss_bytes_per_el` is the element size
    of the cross-entropy's reductions (float32 for 16-bit logits; default as
    activations). `overlap` (``--tp-overlap``, with `sp`): each linear's all-gather and
    reduce-scatter as its ring of t−1 sends and receives of b·s·h·e/t (module docstring).
    Empty when t = 1.
    """
    if tp == 1:
        return []
    t, L = tp, model.layers if layers is None else layers
    x = micro_batch * model.seq_len * model.hidden * bytes_per_el
    shard = x / t
    replay = recompute_policy(recompute) == "full"
    out: list[dict] = []

    def add(what, phase, op, calls, nbytes, ring=True):
        if not calls:
            return
        if overlap and sp and ring and op in ("all_gather", "reduce_scatter"):  # decomposed on a ring
            for kind in ("send", "recv"):
                out.append({"what": f"{what}, {op} as a ring", "phase": phase, "op": kind, "calls": calls * (t - 1),
                            "bytes": shard})
            return
        out.append({"what": what, "phase": phase, "op": op, "calls": calls, "bytes": nbytes})

    if sp:
        add("layers: enter (all-gather the sequence)", "fwd", "all_gather", 2 * L, shard)
        add("layers: leave (reduce-scatter the sequence)", "fwd", "reduce_scatter", 2 * L, x)
        add("layers: leave backward + enter replayed", "bwd", "all_gather", (4 if replay else 2) * L, shard)
        add("layers: QKV and fc re-gather their input shard", "bwd", "all_gather", 2 * L, shard)
        add("layers: enter backward + leave replayed", "bwd", "reduce_scatter", (4 if replay else 2) * L, x)
    else:
        add("layers: g (after attention, after MLP)", "fwd", "all_reduce", 2 * L, x)
        add("layers: f backward" + (" + g replayed" if replay else ""), "bwd", "all_reduce",
            (4 if replay else 2) * L, x)
    if first:
        add("embedding: g", "fwd", "all_reduce", 1, x)
        if sp:
            add("embedding: sequence split, backward", "bwd", "all_gather", 1, shard, ring=False)
    if last:
        if sp:
            add("output layer: enter", "fwd", "all_gather", 1, shard)
            add("output layer: re-gather its input shard", "bwd", "all_gather", 1, shard)
            add("output layer: enter, backward", "bwd", "reduce_scatter", 1, x)
        else:
            add("output layer: f backward", "bwd", "all_reduce", 1, x)
        le = loss_bytes_per_el or bytes_per_el
        add("cross-entropy: max, target logit, sum exp", "fwd", "all_reduce", 3,
            micro_batch * model.seq_len * le)
    return out


def layer_call_bytes(model: ModelConfig, micro_batch: int, tp: int, sp: bool = False,
                     recompute: str = "none", bytes_per_el: int = 4) -> dict:
    """Per-layer call bytes by op from :func:`tp_collectives` (equals
    :func:`minitron.analysis.comm.tp_layer_bytes`, which the test checks)."""
    out: dict = {}
    for c in tp_collectives(model, micro_batch, tp, sp, recompute, 1, False, False, bytes_per_el):
        out[c["op"]] = out.get(c["op"], 0) + c["calls"] * c["bytes"]
    return out


# --------------------------------------------------------------------------------------
# Why t stays inside a node
# --------------------------------------------------------------------------------------
def tp_scaling(model: ModelConfig | str = "megatron-8.3b", micro_batch: int = 1, tps=None,
               cluster: str = "a100-dgx", mfu: float = 0.5, intra_bw: float | None = None,
               inter_bw: float | None = None, gpus_per_node: int | None = None,
               intra_latency: float | None = None, inter_latency: float | None = None,
               bytes_per_el: int = 2) -> list[dict]:
    """Compute vs tensor-parallel all-reduce time of one layer (forward + backward, one
    microbatch) for each t, no overlap.

    compute = 3 · (24bsh² + 4bs²h) / t / (mfu · peak);
    comm    = 4 ring all-reduces of b·s·h·e: each 2(t−1)·latency + 2(t−1)/t · bytes / bw,
    with bw = `intra_bw` (NVLink, per GPU) while t ≤ `gpus_per_node`, else `inter_bw`
    (InfiniBand per GPU: the ring's slowest link). Defaults from `cluster`
    (:data:`~minitron.analysis.cluster.CLUSTERS`; inter-node bandwidth split over the
    node's GPUs). Returns ``{t, link, compute_ms, comm_ms, comm_share, efficiency,
    speedup}`` rows; efficiency = compute/(compute + comm), speedup = t · efficiency
    over one GPU. Values of t that do not divide the heads are skipped.
    """
    m = PRESETS[model] if isinstance(model, str) else model
    c = get_cluster(cluster)
    G = gpus_per_node or c.gpus_per_node
    nv, ib = intra_bw or c.intra_bw, inter_bw or c.inter_bw / c.gpus_per_node
    nv_lat = c.intra_latency if intra_latency is None else intra_latency
    ib_lat = c.inter_latency if inter_latency is None else inter_latency
    flops = 3 * layer_forward_flops(micro_batch, m.seq_len, m.hidden, m.ffn_hidden)
    nbytes = micro_batch * m.seq_len * m.hidden * bytes_per_el
    rows = []
    for t in tps or range(2, 17):
        if m.heads % t or m.hidden % t:
            continue
        inside = t <= G
        bw, lat = (nv, nv_lat) if inside else (ib, ib_lat)
        compute = flops / t / (mfu * c.peak_flops)
        comm = 4 * (2 * (t - 1) * lat + ring_allreduce_wire_bytes(nbytes, t) / bw)
        eff = compute / (compute + comm)
        rows.append({"t": t, "link": "NVLink" if inside else "InfiniBand", "compute_ms": compute * 1e3,
                     "comm_ms": comm * 1e3, "comm_share": comm / (compute + comm), "efficiency": eff,
                     "speedup": t * eff})
    return rows


def format_table(rows: list[dict], cols: list[str] | None = None) -> str:
    """A plain-text table of dict rows (floats with 4 significant digits)."""
    cols = cols or list(rows[0])
    cell = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    body = [[cell(r[c]) for c in cols] for r in rows]
    w = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w[i]) for i, c in enumerate(cols))]
    lines += ["  ".join(v.rjust(w[i]) for i, v in enumerate(b)) for b in body]
    return "\n".join(lines)


def report(model: str = "megatron-8.3b", micro_batch: int = 1, cluster: str = "a100-dgx") -> str:
    """The tables of this module for a preset model (what ``python -m`` prints)."""
    m = PRESETS[model]
    out = [f"{model}: activation bytes per layer, b={micro_batch}, 2-byte activations, dropout, t=8"]
    rows = activation_table(m.replace(dropout=0.1), micro_batch, 8, bytes_per_el=2)
    for r in rows:
        for k in ("minitron_bytes", "table2_bytes", "table2_16bit_bytes"):
            r[k.replace("_bytes", "_MiB")] = r.pop(k) / 2**20
    out += [format_table(rows), ""]
    x = layer_call_bytes(m, micro_batch, 8, False, "none", 2)
    y = layer_call_bytes(m, micro_batch, 8, True, "none", 2)
    out += [f"call bytes per layer per microbatch, t=8: {x} (--sp: {y})", ""]
    out += [f"{model}: one layer, fwd+bwd, b={micro_batch}, {cluster}, 50% of peak"]
    out += [format_table(tp_scaling(m, micro_batch, cluster=cluster))]
    return "\n".join(out)


if __name__ == "__main__":
    print(report())
