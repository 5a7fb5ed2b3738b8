"""1-D, 2-D, 2.5-D and 3-D tensor parallelism side by side, from the call lists of the
engine's own layers, and a projection of their step times onto a GPU cluster.

:func:`compare_tp_schemes` puts the four schemes on the same P devices next to each
other for one transformer layer and one microbatch, per device: bytes sent (ring
collectives, pipelined broadcasts and reduces), bytes of the once-per-step gradient
sums of replicated parameters, parameter bytes of a layer and of the model, and the
activation bytes a layer keeps for its backward. Every number comes from the analysis
of the layers minitron runs — 1-D ``analysis/tensor_parallel.py``, 2-D and 2.5-D
``analysis/summa.py``, 3-D ``analysis/cube.py`` — whose call lists a traced step
matches exactly.

:func:`project_tp_schemes` turns those calls into seconds on a cluster: each call
costs its latency steps plus its bytes sent over the bandwidth of the line it runs on
(inside a node when the line's ranks fit in one, else each GPU's share of its node's
network), and the layer's matrix products run at the cluster model's matmul
efficiency for the local product shape (``analysis.cluster.matmul_efficiency``).
No overlap of communication with computation is assumed. Bian et al. (2021) report
3-D 2.32× faster than 1-D and 1.57× faster than 2-D on 64 V100s of TACC's Longhorn
(4 GPUs per node); :data:`LONGHORN` is that machine as this model sees it.
"""
from __future__ import annotations

import math

from ..config import ModelConfig, ParallelConfig, cube_edge
from . import cube as C
from . import summa as S
from .calls import ring_allreduce_wire_bytes, wire_bytes
from .cluster import COMM_BW_FRACTION, Cluster, get_cluster, matmul_efficiency
from .memory import saved_bytes_per_layer
from .params import local_layer_params, params_on_rank

__all__ = ["LONGHORN", "SCHEMES", "scheme_shapes", "compare_tp_schemes", "project_tp_schemes"]

SCHEMES = ("1d", "2d", "2.5d", "3d")

# TACC Longhorn, where Bian et al. measured: IBM AC922 nodes of 4 V100-SXM2-16GB, NVLink 2.0
# between GPUs (3 bricks, 75 GB/s per direction), one InfiniBand EDR port per node
# (100 Gb/s = 12.5 GB/s). The bandwidths are the datasheets', not measurements.
LONGHORN = Cluster("tacc-longhorn", "V100-SXM2-16GB", 125e12, 4, 75e9, 12.5e9, 5e-6, 10e-6, 16e9, 900e9)


def scheme_shapes(devices: int, depth: int | None = None) -> dict:
    """The grid of each scheme on `devices` devices, or None where it does not fit:
    ``{'1d': {'t': P}, '2d': {'q': √P}, '2.5d': {'q', 'depth'}, '3d': {'q': ∛P}}``.
    2.5-D takes `depth` when given, else the smallest d > 1 leaving a square q² ≥ 4."""
    P = devices
    out: dict = {"1d": {"t": P}}
    q2 = math.isqrt(P)
    out["2d"] = {"q": q2, "depth": 1} if q2 * q2 == P else None
    out["2.5d"] = None
    for d in ([depth] if depth else range(2, P + 1)):
        if P % d == 0 and math.isqrt(P // d) ** 2 == P // d and P // d >= 4:
            out["2.5d"] = {"q": math.isqrt(P // d), "depth": d}
            break
    q3 = cube_edge(P)
    out["3d"] = {"q": q3} if q3**3 == P else None
    return out


def _fits(model: ModelConfig, micro_batch: int, scheme: str, shape: dict | None) -> bool:
    if shape is None:
        return False
    h, a, f = model.hidden, model.heads, model.ffn_hidden
    if scheme == "1d":
        t = shape["t"]
        return h % t == 0 and a % t == 0 and f % t == 0
    q = shape["q"]
    if scheme == "3d":
        return micro_batch % (q * q) == 0 and h % (q * q) == 0 and f % (q * q) == 0 and a % q == 0
    return micro_batch % (q * shape["depth"]) == 0 and h % q == 0 and f % q == 0 and a % q == 0


def _layer_calls(model: ModelConfig, micro_batch: int, scheme: str, shape: dict, e: int,
                 ea: int | None = None) -> tuple[list[dict], list[dict], dict]:
    """(calls per microbatch, gradient sums per step, axis sizes) of one layer."""
    if scheme == "1d":
        t = shape["t"]
        x = (ea or e) * micro_batch * model.seq_len * model.hidden
        # g after attention and after the MLP forward, f before each backward (Megatron §3)
        calls = [{"op": "all_reduce", "axis": "tp", "calls": 4, "bytes": x, "phase": "both"}] if t > 1 else []
        return calls, [], {"tp": t}
    q = shape["q"]
    if scheme == "3d":
        sizes = {C.I: q, C.J: q, C.K: q}
        return (C.layer_calls(model, micro_batch, q, e, act_bytes_per_el=ea),
                C.grad_sync_calls(model, q, 1, False, False, e), sizes)
    d = shape["depth"]
    sizes = {S.ROW: q, S.COL: q, S.DEP: d}
    return (S.layer_calls(model, micro_batch, q, d, e, act_bytes_per_el=ea),
            S.grad_sync_calls(model, q, d, 1, False, False, e), sizes)


def _feasible_layers(model: ModelConfig, micro_batch: int, devices: int, depth: int | None, e: int,
                     rows: list[dict]):
    """(scheme, shape, :func:`_layer_calls`) of each scheme the devices and the model's
    divisibility allow; each other scheme gets its ``feasible: False`` row in `rows`."""
    for scheme, shape in scheme_shapes(devices, depth).items():
        if _fits(model, micro_batch, scheme, shape):
            yield scheme, shape, _layer_calls(model, micro_batch, scheme, shape, e)
        else:
            rows.append({"scheme": scheme, "grid": None, "feasible": False})


def _sent(call: dict, n: int) -> float:
    """Bytes one rank sends for `call['calls']` calls of `call['bytes']` on a line of n."""
    return call["calls"] * wire_bytes(call, n)


def compare_tp_schemes(model: ModelConfig, micro_batch: int, devices: int, bytes_per_el: int = 4,
                       depth: int | None = None) -> list[dict]:
    """The four schemes on `devices` devices, one row each, per device: one layer and one
    microbatch of `micro_batch` sequences (forward and backward). Keys: ``scheme, grid,
    feasible, layer_wire_bytes, layer_sync_wire_bytes`` (once per step: replicated
    gradients summed; 2.5-D's depth reduction of the weight gradients), ``layer_param_bytes,
    model_param_bytes, layer_activation_bytes``. A scheme the devices or the model's
    divisibility do not allow has ``feasible: False``."""
    e, b = bytes_per_el, micro_batch
    rows = []
    for scheme, shape, layer in _feasible_layers(model, b, devices, depth, e, rows):
        calls, sync, sizes = layer
        row = {"scheme": scheme, "grid": shape, "feasible": True,
               "layer_wire_bytes": sum(_sent(c, sizes[c["axis"]]) for c in calls),
               "layer_sync_wire_bytes": sum(c["calls"] * ring_allreduce_wire_bytes(c["bytes"], sizes[c["axis"]])
                                            for c in sync)}
        if scheme == "1d":
            t = shape["t"]
            layer, whole = local_layer_params(model, t, "1d"), params_on_rank(model, ParallelConfig(tp=t))
            acts = sum(saved_bytes_per_layer(model, b, t, dropout=False, bytes_per_el=e).values())
        elif scheme == "3d":
            q = shape["q"]
            layer = local_layer_params(model, devices, "3d")
            whole = params_on_rank(model, ParallelConfig(tp=devices, tp_mode="3d"))
            acts = sum(C.cube_saved_bytes_per_layer(model, b, q, e, dropout=False).values())
        else:
            q, d = shape["q"], shape["depth"]
            par = S.params_per_device(model, devices, d)
            layer, whole = par["layer"], par["model"]
            acts = sum(S.summa_saved_bytes_per_layer(model, b, q, d, e).values())
        row.update(layer_param_bytes=e * layer, model_param_bytes=e * whole, layer_activation_bytes=acts)
        rows.append(row)
    return rows


def _line_bandwidth(axis: str, sizes: dict, shape: dict, scheme: str, c: Cluster) -> tuple[float, float]:
    """(bytes/s per GPU, latency) of the line `axis`: inside a node when its ranks (tensor
    ranks placed in order, the fastest axis on neighbours) fit in one."""
    if scheme == "1d":
        stride = 1
    elif scheme == "3d":
        stride = {C.I: 1, C.J: shape["q"], C.K: shape["q"] ** 2}[axis]
    else:
        stride = {S.ROW: 1, S.COL: shape["q"], S.DEP: shape["q"] ** 2}[axis]
    span = stride * (sizes[axis] - 1) + 1
    if span <= c.gpus_per_node:
        return c.intra_bw * COMM_BW_FRACTION, c.intra_latency
    return c.inter_bw / c.gpus_per_node * COMM_BW_FRACTION, c.inter_latency


def _call_seconds(call: dict, n: int, bw: float, latency: float) -> float:
    steps = 2 * (n - 1) if call["op"] == "all_reduce" else n - 1
    return call["calls"] * (steps * latency + wire_bytes(call, n) / bw)


def project_tp_schemes(model: ModelConfig, micro_batch: int, devices: int, cluster: str | Cluster = LONGHORN,
                       bytes_per_el: int = 2, depth: int | None = None) -> list[dict]:
    """Seconds of one transformer layer (forward and backward, one microbatch per step,
    gradient sums included) on `devices` GPUs of `cluster` for each scheme: ``compute_s``
    (matrix products at the cluster model's efficiency for the local shape), ``comm_s``,
    ``layer_s`` = their sum, and ``speedup_vs`` each other feasible scheme (> 1: this one
    is faster). 16-bit activations and weights (`bytes_per_el`)."""
    c = get_cluster(cluster) if isinstance(cluster, str) else cluster
    b, s, h, f, P = micro_batch, model.seq_len, model.hidden, model.ffn_hidden, devices
    flops = 3 * (24 * b * s * h * h + 4 * b * s * s * h)  # forward + backward (PTD-P)
    rows = []
    for scheme, shape, layer in _feasible_layers(model, b, devices, depth, bytes_per_el, rows):
        calls, sync, sizes = layer
        # the local fc product: [tokens, h_in] x [h_in, f_out] on one device
        if scheme == "1d":
            mm = (b * s, f // shape["t"], h)
        elif scheme == "3d":
            q = shape["q"]
            mm = (b * s // q, f // q, h // q)
        else:
            q, d = shape["q"], shape["depth"]
            mm = (b * s // (q * d), f // q, h // q)
        compute = flops / P / (c.peak_flops * matmul_efficiency(*mm, c, bytes_per_el))
        comm = 0.0
        for call in calls + [{**x, "calls": x["calls"]} for x in sync]:
            bw, lat = _line_bandwidth(call["axis"], sizes, shape, scheme, c)
            comm += _call_seconds(call, sizes[call["axis"]], bw, lat)
        rows.append({"scheme": scheme, "grid": shape, "feasible": True, "compute_s": compute, "comm_s": comm,
                     "layer_s": compute + comm})
    done = [r for r in rows if r["feasible"]]
    for r in done:
        r["speedup_vs"] = {o["scheme"]: o["layer_s"] / r["layer_s"] for o in done if o is not r}
    return rows
