"""A throughput model of a GPU cluster: how long one training iteration takes.

The model adds up, for the slowest pipeline stage, the time of every piece of work it
does in one iteration, each priced by the part of the machine that limits it:

* **matrix multiplies** at ``peak × matmul_efficiency(m, n, k)``: a smooth roofline,
  ``e_max · I/(I + e_max·R)`` with I the arithmetic intensity (FLOPs per byte moved)
  of the product and R the GPU's ridge point (peak FLOP/s over memory bandwidth).
  Large products run at e_max of peak; thin ones (the attention products of each head,
  small tensor-parallel slices, small microbatches) are limited by memory bandwidth;
* **element-wise work** (LayerNorm, softmax, dropout, GeLU, residual adds, the loss,
  the optimizer) at a fraction of the memory bandwidth, from a per-layer inventory of
  the bytes these kernels read and write — which depends on the software: fused or
  unfused kernels, flash attention (:mod:`.software`);
* **tensor-parallel all-reduces** on the critical path unless the software overlaps
  them: ring all-reduces of b·s·h inside a node over NVLink/NVSwitch (between nodes once
  t exceeds a node); with sequence parallelism also the backward's all-gathers of the
  column-parallel linears' saved input shards (Korthikanti et al. 2022, §4.2.2);
* **pipeline sends** between stages (b·s·h/t with the scatter/gather optimisation),
  and the **bubble** ``bubble_fraction(schedule, p, m, v)`` × the ideal time;
* **data-parallel all-reduce** of the gradients (2 bytes each), overlapped with the
  backward pass of the last microbatch for a fraction ``DP_OVERLAP`` of its time when
  the software buckets it, after the pipeline flush otherwise;
* the **optimizer step**, memory-bound over the local parameters.

The software (a :class:`~minitron.analysis.software.Software`; default
``megatron-2019``, the calibration's) is an argument like the hardware; :func:`~minitron.analysis.explain.explain` lists the
parts of one prediction.

Calibration (Megatron-LM 2019, V100 DGX-2H, with the ``megatron-2019`` software; the
only figures the constants below were fitted to, see
``tests/test_analysis.py::test_calibration_megatron_2019``):

=====================================================  =========  ============
figure                                                 published  this model
=====================================================  =========  ============
1.2B model, 1 V100, batch 8, recomputation: TFLOP/s    39         39.0
8.3B, 8-way tensor parallel: weak-scaling efficiency   77 %       76.9 %
8.3B, 8-way TP × 64-way DP (512 GPUs): efficiency      74 %       74.0 %
  (aggregate, a consequence of the above)              15.1 PF/s  14.8 PF/s
=====================================================  =========  ============

Three constants were fitted, one per figure, in this order: ``ELEMENTWISE_BW_FRACTION``
(0.45, to the 39 TFLOP/s), ``COMM_BW_FRACTION`` (0.71 of the datasheet NVSwitch
bandwidth, to the 77 %) and ``DP_OVERLAP`` (0.80, to the 74 %). Three numbers fitted
with three constants prove only that the model *can* express them; the test of the
model is what it says about runs it was not fitted to. ``GEMM_MAX_EFFICIENCY``
(0.85) and all bandwidths and peaks are datasheet/cuBLAS values, not fitted.

Prediction, not fitted (``minitron.analysis.published``; the test
``tests/test_throughput_model.py`` prints and bounds it): PTD-P (Narayanan et al. 2021)
Table 1 on DGX A100 at the published (t, p, batch), microbatch 1, 1F1B, full
recomputation, scatter/gather, with the ``ptdp-2021`` software:

=========  =====  ===========  ===============  ===============
model      GPUs   published    ptdp-2021        megatron-2019
=========  =====  ===========  ===============  ===============
1.7B       32     137 TFLOP/s  124.2 (−9 %)     90.8 (−34 %)
7.5B       128    142          122.4 (−14 %)    101.9 (−28 %)
18.4B      256    135          115.0 (−15 %)    97.1 (−28 %)
145.6B     1536   148          146.5 (−1 %)     128.6 (−13 %)
529.6B     2520   163          161.4 (−1 %)     147.9 (−9 %)
1008B      3072   163 (52 %)   167.1 (+3 %)     155.3 (−5 %)
=========  =====  ===========  ===============  ===============

Over all ten rows the worst error is 14.8 % and the mean 5.9 % (megatron-2019: 34 % and
19 %): PTD-P's fused kernels (one scale+mask+softmax pass instead of four, bias +
dropout + residual in one) and its transpose-free layout weigh most where the b·a·s²
attention matrix does, at s = 2048 and small h. The small models remain 10–15 % low;
Korthikanti et al.'s 530B MFU pair comes out 38.8 % / 55.0 % (published 42.1 % / 54.2 %),
GPT-3 175B on 384/768/1536 GPUs 155/150/140 TFLOP/s (published 153/149/141), and for
the 1T model on 3072 GPUs the planner's best layout is PTD-P's (t = 8 inside a node,
p = 64 across nodes) under every software preset. Use it to compare
layouts and to reason about where time goes, not as a substitute for measuring.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..config import ModelConfig
from .bubble import bubble_fraction
from .calls import ring_allgather_wire_bytes, ring_allreduce_wire_bytes
from .flops import flops_per_iteration, hardware_flops_per_iteration, model_flops_per_iteration, recompute_policy
from .memory import memory_estimate
from .params import layout_get, padded_vocab, params_given_layers, rank_layers
from .software import Software, get_software

__all__ = ["Cluster", "CLUSTERS", "get_cluster", "PlannedLayout", "Prediction", "matmul_efficiency",
           "predict", "GEMM_MAX_EFFICIENCY", "ELEMENTWISE_BW_FRACTION", "COMM_BW_FRACTION",
           "DP_OVERLAP"]

# ---- calibrated constants (fitted only to the Megatron-LM 2019 figures) -----------------
GEMM_MAX_EFFICIENCY = 0.85      # fraction of peak a large fp16 GEMM reaches (cuBLAS)
ELEMENTWISE_BW_FRACTION = 0.45  # fraction of HBM bandwidth element-wise kernels reach
COMM_BW_FRACTION = 0.71         # NCCL bus bandwidth over the link's datasheet figure
DP_OVERLAP = 0.80               # share of the data-parallel all-reduce hidden by backward
OPTIMIZER_BYTES_PER_PARAM = 36  # bytes an fp32-master Adam step reads and writes
GRAD_BYTES = 2                  # gradients all-reduced in fp16/bf16


@dataclass(frozen=True)
class Cluster:
    """A homogeneous GPU cluster.

    Bandwidths are bytes/s in one direction: `intra_bw` per GPU inside a node,
    `inter_bw` per node between nodes (all its network cards together); latencies are
    seconds per message step. `peak_flops` is the dense fp16/bf16 tensor-core peak.
    """

    name: str
    gpu: str
    peak_flops: float
    gpus_per_node: int
    intra_bw: float
    inter_bw: float
    intra_latency: float
    inter_latency: float
    memory_bytes: float
    hbm_bw: float = 2.0e12

    @property
    def ridge(self) -> float:
        """FLOPs per byte at which a kernel stops being memory-bound."""
        return self.peak_flops / self.hbm_bw


CLUSTERS: dict[str, Cluster] = {
    # DGX-2H: 16 V100 (32 GB, 900 GB/s HBM2), NVSwitch at 150 GB/s per direction per GPU
    # (the "300 GB/s" of Megatron-LM 2019 counts both directions), 8×100 Gb/s InfiniBand
    # = 100 GB/s between servers per node.
    "v100-dgx2": Cluster("v100-dgx2", "V100-SXM3-32GB", 125e12, 16, 150e9, 100e9, 5e-6, 10e-6,
                         32e9, 900e9),
    # DGX A100: 8 A100 (80 GB, 2.0 TB/s), NVLink3 300 GB/s per direction, 8×200 Gb/s IB.
    "a100-dgx": Cluster("a100-dgx", "A100-SXM4-80GB", 312e12, 8, 300e9, 200e9, 5e-6, 10e-6,
                        80e9, 2.039e12),
    # DGX H100: 8 H100 (80 GB, 3.35 TB/s), NVLink4 450 GB/s per direction, 8×400 Gb/s IB.
    "h100-dgx": Cluster("h100-dgx", "H100-SXM5-80GB", 989e12, 8, 450e9, 400e9, 4e-6, 8e-6,
                        80e9, 3.35e12),
}


def get_cluster(cluster: str | Cluster) -> Cluster:
    """A Cluster, or the named one from :data:`CLUSTERS` (ValueError listing them)."""
    if isinstance(cluster, Cluster):
        return cluster
    if cluster not in CLUSTERS:
        raise ValueError(f"unknown cluster '{cluster}': choose one of {', '.join(CLUSTERS)}")
    return CLUSTERS[cluster]


@dataclass(frozen=True)
class PlannedLayout:
    """A PTD-P layout as the throughput model prices it and the planner ranks it (not a
    run's :class:`minitron.config.ParallelConfig`): tensor × pipeline × data parallel
    degrees, model chunks per pipeline rank, microbatch size, schedule (default:
    interleaved if vpp > 1 else 1f1b), sequence parallelism and the pipeline
    scatter/gather optimisation."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1
    microbatch_size: int = 1
    schedule: str | None = None
    sp: bool = False
    scatter_gather: bool = True

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp


def as_planned_layout(layout: Any) -> PlannedLayout:
    """Read a PlannedLayout from a PlannedLayout, a dict or an object with the same attributes."""
    if isinstance(layout, PlannedLayout):
        return layout
    kw = {k: layout_get(layout, k) for k in PlannedLayout.__dataclass_fields__ if layout_get(layout, k) is not None}
    if layout_get(layout, "microbatch_size") is None and layout_get(layout, "b") is not None:
        kw["microbatch_size"] = layout_get(layout, "b")
    return PlannedLayout(**kw)


@dataclass
class Prediction:
    """The predicted iteration: seconds, achieved TFLOP/s per GPU (PTD-P's way of
    counting: Eq. 3 with recomputation), peak memory, bubble fraction, and a breakdown
    in seconds (``compute, tp_comm, pp_comm, bubble, dp_comm, dp_comm_exposed,
    optimizer`` and what overlap hid, ``tp_comm_hidden, pp_comm_hidden,
    dp_comm_hidden``), with ``software``, ``recompute``, ``mfu`` and ``parts``: the
    iteration per kind of work, as :func:`~minitron.analysis.explain.explain` lists it)."""

    iteration_s: float
    tflops_per_gpu: float
    memory_gb_per_gpu: float
    bubble_fraction: float
    breakdown: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)

    def __getitem__(self, key):  # allow prediction["iteration_s"]
        return getattr(self, key)


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------
def matmul_efficiency(m: int, n: int, k: int, cluster: str | Cluster, bytes_per_el: int = 2) -> float:
    """Fraction of peak a [m, k] × [k, n] matrix multiply reaches: a smooth roofline
    ``e_max · I / (I + e_max·R)`` where ``I = 2mnk / (e·(mk + kn + mn))`` is its
    arithmetic intensity and R the cluster's ridge point. Saturates at
    ``GEMM_MAX_EFFICIENCY`` for large products; thin products are bandwidth-bound."""
    c = get_cluster(cluster)
    intensity = 2 * m * n * k / (bytes_per_el * (m * k + k * n + m * n))
    e = GEMM_MAX_EFFICIENCY
    return e * intensity / (intensity + e * c.ridge)


def _gemm_s(m: float, n: float, k: float, c: Cluster, count: float = 1) -> tuple[float, float, float]:
    """Seconds of `count` products [m,k]×[k,n] (forward), of their input gradients
    [m,n]×[n,k] and of their weight gradients [k,m]×[m,n]."""
    f = 2 * m * n * k * count / c.peak_flops
    return (f / matmul_efficiency(m, n, k, c), f / matmul_efficiency(m, k, n, c),
            f / matmul_efficiency(k, n, m, c))


# Matrix multiplies of one layer, by kind: (rows, columns, inner) of the forward product
# for b·s tokens on one tensor rank; "attention" is the per-head QKᵀ and attention·V.
LINEAR_KINDS = ("qkv", "proj", "fc1", "fc2")


@dataclass(frozen=True)
class _LayerTime:
    """Seconds of one transformer layer for one microbatch on one tensor rank, by kind
    of work: ``parts[kind] = (forward, backward input-gradient, backward weight-gradient)``
    for the four linears, the attention products and the element-wise kernels."""

    parts: dict
    core_fwd: float   # forward of the attention core (what selective recompute replays)

    @property
    def fwd(self) -> float:
        return sum(f for f, _, _ in self.parts.values())

    @property
    def bwd_input(self) -> float:
        return sum(b for _, b, _ in self.parts.values())

    @property
    def bwd_weight(self) -> float:
        return sum(w for _, _, w in self.parts.values())


def _layer_time(model: ModelConfig, b: int, t: int, sp: bool, c: Cluster, sw: Software,
                e: int = 2) -> _LayerTime:
    s, h, a, f = model.seq_len, model.hidden, model.heads, model.ffn_hidden
    T, dh, heads = b * s, h // a, b * a / t
    parts = {}
    for kind, mm in zip(LINEAR_KINDS, [(T, 3 * h / t, h), (T, h, h / t), (T, f / t, h), (T, h, f / t)]):
        parts[kind] = _gemm_s(*mm, c)
    att_f = att_b = 0.0
    for mm in [(s, s, dh), (s, dh, s)]:  # scores QKᵀ and attention·V, for each head
        x, y, z = _gemm_s(*mm, c, count=heads)
        att_f, att_b = att_f + x, att_b + y + z  # no weights: both are input gradients
    att_b *= sw.attention_backward_ratio / 2    # flash attention recomputes QKᵀ backward
    parts["attention"] = (att_f, att_b, 0.0)
    # Element-wise bytes, from the software's kernel inventory (see software.py): per
    # token, replicated unless sequence parallel, the LayerNorms and the two bias +
    # dropout + residual sites; split over t, the head reshapes (8·Th, none in PTD-P's
    # layout) and GeLU (2·Tf) — their backward moves about twice their forward; and the
    # passes over the b·a·s²/t attention matrix, counted forward and backward.
    bw_ew = c.hbm_bw * ELEMENTWISE_BW_FRACTION
    matrix_f, matrix_b = (k * b * a * s * s / t * e / bw_ew for k in sw.attention_matrix_passes)
    sharded = (sw.reshape_passes * T * h + 2 * T * f) / t
    ew = (sw.token_passes * T * h / (t if sp else 1) + sharded) * e / bw_ew
    parts["elementwise"] = (ew + matrix_f, 2 * ew + matrix_b, 0.0)
    return _LayerTime(parts, att_f + matrix_f)


def _logit_times(model: ModelConfig, b: int, t: int, c: Cluster) -> tuple[tuple, tuple, float]:
    """Seconds of the output layer and the fp32 cross-entropy (about 6 passes over the
    b·s·V/t logits in all): ``(forward matmul, forward element-wise), (input-gradient
    matmul, backward element-wise), weight-gradient matmul``."""
    T, V = b * model.seq_len, padded_vocab(model, t) / t
    fwd, bin_, bw = _gemm_s(T, V, model.hidden, c)
    ew = 6 * T * V * 4 / (c.hbm_bw * ELEMENTWISE_BW_FRACTION)
    return (fwd, ew / 3), (bin_, 2 * ew / 3), bw


def _allreduce_s(nbytes: float, n: int, bw: float, latency: float) -> float:
    """Ring all-reduce time: 2(n−1) latency steps and 2(n−1)/n · bytes at `bw`."""
    if n == 1:
        return 0.0
    return 2 * (n - 1) * latency + ring_allreduce_wire_bytes(nbytes, n) / (bw * COMM_BW_FRACTION)


def _allgather_s(nbytes: float, n: int, bw: float, latency: float) -> float:
    """Ring all-gather time into an `nbytes` output: n−1 latency steps and
    (n−1)/n · bytes at `bw` (half an all-reduce)."""
    if n == 1:
        return 0.0
    return (n - 1) * latency + ring_allgather_wire_bytes(nbytes, n) / (bw * COMM_BW_FRACTION)


# --------------------------------------------------------------------------------------
# The iteration
# --------------------------------------------------------------------------------------
def predict(model: ModelConfig, layout: Any, global_batch: int, cluster: str | Cluster,
            recompute: str | bool | None = None, bytes_per_param: float = 16,
            software: str | Software | None = None) -> Prediction:
    """Predicted time of one iteration of `global_batch` sequences on `cluster`.

    `layout`: a :class:`PlannedLayout` or a dict with ``tp, pp, dp`` and optionally ``vpp,
    microbatch_size, schedule, sp, scatter_gather``. `software`: a
    :class:`~minitron.analysis.software.Software` or a preset name (default
    ``megatron-2019``, the software the constants were fitted with); `recompute`
    overrides its recomputation policy. Returns a :class:`Prediction`:
    ``iteration_s, tflops_per_gpu`` (Eq. 3 FLOPs over n·time with full recomputation,
    model or hardware FLOPs otherwise), ``memory_gb_per_gpu`` (mixed-precision,
    :func:`~minitron.analysis.memory.memory_estimate`), ``bubble_fraction``, and the
    ``breakdown`` in seconds, its ``parts`` per kind of work (:func:`explain` reads
    them) and ``mfu``, the model FLOPs (no recomputation counted) over n·peak·time. Raises ValueError for a layout the model cannot take.
    """
    c = get_cluster(cluster)
    sw = get_software(software)
    L = as_planned_layout(layout)
    t, p, d, v, b = L.tp, L.pp, L.dp, L.vpp, L.microbatch_size
    rc = recompute_policy(sw.recompute if recompute is None else recompute)
    kind = L.schedule or ("interleaved" if v > 1 else "1f1b")
    _check_layout(model, L, global_batch, kind)
    m = global_batch // (d * b)
    n_gpus = t * p * d
    G = c.gpus_per_node

    # per microbatch, per stage: compute and the tensor-parallel all-reduces of b·s·h
    # (k per layer: 2 forward, 2 backward, 2 more when the forward is replayed; one
    # more for the embedding on the first stage and the output layer on the last),
    # which sit on the critical path. With sequence parallelism an all-reduce is an
    # all-gather and a reduce-scatter (the same time), and the backward all-gathers
    # again the input shards that QKV and fc (and the output layer) kept (§4.2.2);
    # the software may hide the backward's share or all of them behind the matmuls.
    lt = _layer_time(model, b, t, L.sp, c, sw)
    x = b * model.seq_len * model.hidden * 2  # bytes of a b·s·h activation in 16 bits
    tp_bw, tp_lat = (c.intra_bw, c.intra_latency) if t <= G else (c.inter_bw / G, c.inter_latency)
    ar = _allreduce_s(x, t, tp_bw, tp_lat)
    regather = _allgather_s(x, t, tp_bw, tp_lat) if L.sp else 0.0
    k_fwd = 4 if rc == "full" else 2
    lf, lb_in, lb_w = _logit_times(model, b, t, c)
    layers = rank_layers(model, {"pp": p, "vpp": v})
    stages = []
    for r, n in enumerate(layers):
        first, last = r == 0, r == (p * v - 1) % p
        parts = {k: n * sum(lt.parts[k]) for k in (*LINEAR_KINDS, "attention", "elementwise")}
        parts["logits"] = (lf[0] + lb_in[0] + lb_w) if last else 0.0
        parts["elementwise"] += (lf[1] + lb_in[1]) if last else 0.0
        parts["recompute"] = n * {"none": 0.0, "selective": lt.core_fwd, "full": lt.fwd}[rc]
        fwd = n * lt.fwd + (sum(lf) if last else 0.0)
        b_in = n * lt.bwd_input + parts["recompute"] + (sum(lb_in) if last else 0.0)
        b_w = n * lt.bwd_weight + (lb_w if last else 0.0)
        tp_fwd = (n * k_fwd + first + last) * ar
        tp_bwd = 2 * n * ar + (2 * n + last) * regather
        hideable = {"none": 0.0, "backward": tp_bwd, "all": tp_fwd + tp_bwd}[sw.tp_overlap] if L.sp else 0.0
        linears = sum(parts[k] for k in LINEAR_KINDS)
        tp_hidden = min(DP_OVERLAP * hideable, linears)
        stages.append((fwd, b_in, b_w, tp_fwd + tp_bwd - tp_hidden, tp_hidden, parts))
    F, B_in, B_w, tp_mb, tp_hidden_mb, parts = max(stages, key=lambda st: sum(st[:4]))

    # pipeline: one send forward and one backward per chunk per microbatch
    pp_total = 0.0
    if p > 1:
        cross = t * d >= G
        bw, lat = (c.inter_bw / G, c.inter_latency) if cross else (c.intra_bw, c.intra_latency)
        msg = x / t if (L.scatter_gather or L.sp) else x
        hop = lat + msg / (bw * COMM_BW_FRACTION)
        if L.scatter_gather and not L.sp and t > 1:
            hop += (t - 1) / t * x / (c.intra_bw * COMM_BW_FRACTION)  # all-gather after recv
        pp_total = 2 * v * hop
    pp_hidden = DP_OVERLAP * pp_total if sw.pp_overlap else 0.0
    pp_mb = pp_total - pp_hidden
    per_mb = F + B_in + B_w + tp_mb + pp_mb
    # zero bubble splits the backward into B (input gradients) and W (weight gradients)
    bub = bubble_fraction(kind, p, m, v, F, B_in, B_w) if kind == "zb-h1" else bubble_fraction(kind, p, m, v)
    ideal = m * per_mb
    bubble_s = bub * ideal
    B = B_in + B_w

    # data parallel: gradients all-reduced, partly hidden behind the last backward when
    # the software overlaps them (bucketed), else all after the pipeline flush
    n_local = max(params_given_layers(model, t, p, v, "1d", r, n) for r, n in enumerate(layers))
    dp_s = 0.0
    if d > 1:
        within = t * d <= G
        if within:
            dp_s = _allreduce_s(n_local * GRAD_BYTES, d, c.intra_bw, c.intra_latency)
        else:  # one ring per tensor rank of a node shares the node's network cards
            dp_s = _allreduce_s(n_local * GRAD_BYTES, d, c.inter_bw / min(t, G), c.inter_latency)
    hidden = min(DP_OVERLAP * dp_s, B) if sw.dp_overlap else 0.0
    dp_exposed = dp_s - hidden
    opt_s = n_local * OPTIMIZER_BYTES_PER_PARAM / (c.hbm_bw * ELEMENTWISE_BW_FRACTION)

    it = ideal + bubble_s + dp_exposed + opt_s
    if rc == "full":
        fl = flops_per_iteration(model, global_batch, recompute=True)
    else:
        fl = hardware_flops_per_iteration(model, global_batch, rc)
    mem = memory_estimate(model, {"tp": t, "pp": p, "dp": d, "vpp": v, "microbatch_size": b,
                                  "sp": L.sp, "schedule": kind}, global_batch,
                          bytes_per_param=bytes_per_param, recompute=rc)
    per_iteration = {k: m * s for k, s in parts.items()}
    per_iteration.update(tp_comm=m * tp_mb, tp_comm_hidden=m * tp_hidden_mb, pp_comm=m * pp_mb,
                         pp_comm_hidden=m * pp_hidden, bubble=bubble_s, dp_comm=dp_exposed,
                         dp_comm_hidden=hidden, optimizer=opt_s)
    breakdown = {"compute": m * (F + B), "tp_comm": m * tp_mb, "pp_comm": m * pp_mb,
                 "bubble": bubble_s, "dp_comm": dp_s, "dp_comm_exposed": dp_exposed,
                 "optimizer": opt_s, "microbatches": m, "tp_comm_hidden": m * tp_hidden_mb,
                 "pp_comm_hidden": m * pp_hidden, "dp_comm_hidden": hidden,
                 "software": sw.name, "recompute": rc, "parts": per_iteration,
                 "mfu": model_flops_per_iteration(model, global_batch) / (n_gpus * it * c.peak_flops)}
    return Prediction(iteration_s=it, tflops_per_gpu=fl / (n_gpus * it) / 1e12,
                      memory_gb_per_gpu=mem["total_bytes"] / 1e9, bubble_fraction=bub,
                      breakdown=breakdown)


def _check_layout(model: ModelConfig, L: PlannedLayout, global_batch: int, kind: str) -> None:
    t, p, d, v, b = L.tp, L.pp, L.dp, L.vpp, L.microbatch_size
    if min(t, p, d, v, b) < 1:
        raise ValueError(f"tp, pp, dp, vpp and microbatch_size must be at least 1 (got {L})")
    if model.heads % t or model.hidden % t:
        raise ValueError(f"tensor parallel degree {t} must divide {model.heads} heads and hidden {model.hidden}")
    if p * v > model.layers:
        raise ValueError(f"pp*vpp = {p * v} model chunks but only {model.layers} layers")
    if global_batch % (d * b):
        raise ValueError(f"global batch {global_batch} is not divisible by dp*microbatch_size = {d}*{b}")
    if kind == "interleaved" and p > 1 and v > 1 and global_batch // (d * b) < p:
        # any m >= p: the microbatches go in groups of at least p (parallel/schedules.py)
        raise ValueError(f"interleaved schedule needs microbatches ({global_batch // (d * b)}) "
                         f"of at least pp = {p}")

