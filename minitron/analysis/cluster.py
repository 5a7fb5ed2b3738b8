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
  column-parallel linears' saved input shards (Korthikanti et al. 2022, §4.2.2); PyTorch's
  async TP (``tp_overlap="async"``) from its decomposition: each collective the compiler
  decomposes costs its t chunks' products, the one-chunk transfers not under them and what
  the fused op leaves exposed (:func:`decomposed_matmul_s`, ``software.ASYNC_TP``);
* **pipeline sends** between stages (b·s·h/t with the scatter/gather optimisation),
  and the **bubble** ``bubble_fraction(schedule, p, m, v)`` × the ideal time;
* **data-parallel all-reduce** of the gradients (2 bytes each), overlapped with the
  backward pass of the last microbatch for a fraction ``DP_OVERLAP`` of its time when
  the software buckets it, after the pipeline flush otherwise;
* the **optimizer step**, memory-bound over the local parameters (over its shard with
  the distributed optimizer, ``zero=1``).

The blocks of today's models and the parallelism they are trained with (the H100 era):

* **grouped-query attention** — the QKV product is h × (q + 2·kv) wide on one rank, with q
  = heads·d/t and kv = kv_heads·d/t, at least one whole kv head (replicated on t/kv ranks
  when t > kv heads, never more: :func:`attention_widths`); **SwiGLU** — three matrices
  (gate and up as one product of 2f, down);
* **mixtures of experts** — the router, the shared experts, and the E/ep routed experts a
  rank holds, each a product on k·T·ep/(t·E) token rows; the dispatch and combine
  all-to-alls forward and backward, on the critical path, over NVLink inside a node and
  the network cards across (:func:`_alltoall_s`); with ``moe_imbalance`` the busiest rank
  receives (1 + it) × the balanced share of routed tokens, in compute and in bytes; with
  the software's ``ep_overlap`` they hide under another microbatch's compute (up to
  DP_OVERLAP of it), with ``ep_node_dedup`` (DeepEP, HybridEP) a token crosses to each
  remote node once (:func:`_node_dedup_share`);
* **context parallelism** (``cp``) — each rank's s/cp queries against the causal
  sequence; ``ring`` passes the kv heads' K, V once around forward and K, V, dK, dV
  backward, hidden under the attention products up to DP_OVERLAP of them; ``allgather``
  moves the same bytes exposed; ``a2a`` (Ulysses) swaps sequence for head shards of q, k,
  v and the output, exposed; ``usp`` (Fang & Zhao 2024) runs that all-to-all over U =
  ``cp_a2a`` neighbouring ranks and the ring over the cp/U others, on 1/U of the heads
  (the ring's part hidden as the ring's). Flash attention skips the masked half of causal attention
  and keeps the scores on chip: priced on the roofline of its Q, K, V, O traffic;
* **long context** — the attention products and the score matrix's passes count the keys
  each query meets, layer by layer (:func:`attention_keys`, from the FLOPs formula's core,
  :func:`~minitron.model_flops.keys_per_query`): a sliding window's block pairs (about 2·W,
  not s) on its windowed layers (``window_layers``: Gemma's and Mistral's patterns), the
  whole sequence on the global ones; packed documents (``doc_len``, ``minitron plan
  --doc-len``) each at its own length. Under a cp ring only the chunks a window or a
  document reaches travel (:func:`~minitron.analysis.context_parallel.ring_kv_sends`, the
  reach the engine's ring skips by), and the MFU counts the same FLOPs;
* **FSDP / ZeRO-3** (``zero=3``) — every microbatch all-gathers each layer's weights
  forward and backward and reduce-scatters its gradients, prefetched under the compute
  (hidden up to DP_OVERLAP of it); **HSDP** (``fsdp_shard``) shards over a group and
  all-reduces the shards across replicas once per step;
* **FP8 matmuls** (a software option) — the linears at the cluster's FP8 peak, their
  inputs and output gradients cast (and transposed) element-wise, with delayed or current
  scaling;
* **the host** — with the software's ``moe_host_s`` a stage takes at least the host's
  time to issue its MoE layers, per microbatch (:data:`DROPLESS_MOE_HOST_S`): a thin
  expert layer at a small microbatch is launch-bound, not compute-bound;
* the **V schedules** (ZB-V, DualPipe-V) — their bubble from the stage's F, B and W
  times, as :func:`~minitron.analysis.bubble.bubble_fraction` gives it.

The software (a :class:`~minitron.analysis.software.Software`; default
``megatron-2019``, the calibration's) is an argument like the hardware; :func:`~minitron.analysis.breakdown.explain` lists the
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

H100 era (``h100-dgx``, ``megatron-core-2024`` software plus what each run's recipe
states; ``benchmarks/RESULTS.md``): two constants fitted on one run each
(:data:`H100_GEMM_MAX_EFFICIENCY`, :data:`H100_FP8_GEMM_MAX_EFFICIENCY`;
``published.H100_FITTING_RUNS``, ``published.fit_h100_constants``) and the host's time
per dropless MoE layer on a B200 run (:data:`DROPLESS_MOE_HOST_S`,
``published.fit_dropless_moe_host_s``). On the 30 other published runs
(``published.H100_RUNS``) the median error is 8.5 %; 28 are within 16.3 %; two dropless
Qwen3-30B-A3B rows are not (+162 % for 25.11, +87 % for 26.02, whose very configuration
the 26.02.01 release ran 1.77x faster: no single prediction can come within 27.8 % of
both, ``published.release_spread``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..config import ModelConfig, validate_a2a_heads
from ..model_flops import keys_per_query, packed_rows
from .bubble import bubble_fraction
from .calls import ring_allgather_wire_bytes, ring_allreduce_wire_bytes
from .context_parallel import head_widths, ring_kv_sends
from .experts import balanced_all_to_all_bytes
from .flops import (flops_per_iteration, hardware_flops_per_iteration, model_flops_per_iteration, recompute_policy,
                    transformer_flops_per_iteration)
from .memory import memory_estimate
from ..placement import placement_for
from .planned_layout import PLANNED_CP_MODES, PlannedLayout
from .params import layout_placement, padded_vocab, params_given_layers, rank_layers
from .software import ASYNC_TP, Software, get_software, kernel_source, kernel_tflops

__all__ = ["Cluster", "CLUSTERS", "get_cluster", "PlannedLayout", "Prediction", "matmul_efficiency",
           "predict", "decomposed_matmul_s", "tp_linear_shapes", "FsdpUnits", "fsdp_units", "fsdp_unit_seconds", "stage_weights", "attention_widths", "PLANNED_CP_MODES", "GEMM_MAX_EFFICIENCY",
           "H100_GEMM_MAX_EFFICIENCY", "H100_FP8_GEMM_MAX_EFFICIENCY", "ELEMENTWISE_BW_FRACTION", "COMM_BW_FRACTION",
           "DP_OVERLAP", "DROPLESS_MOE_HOST_S", "GPU_MEMORY_BYTES"]

# ---- calibrated constants (fitted only to the Megatron-LM 2019 figures) -----------------
GEMM_MAX_EFFICIENCY = 0.85      # fraction of peak a large fp16 GEMM reaches (cuBLAS)
ELEMENTWISE_BW_FRACTION = 0.45  # fraction of HBM bandwidth element-wise kernels reach
COMM_BW_FRACTION = 0.71         # NCCL bus bandwidth over the link's datasheet figure
DP_OVERLAP = 0.80               # share of the data-parallel all-reduce hidden by backward
OPTIMIZER_BYTES_PER_PARAM = 36  # bytes an fp32-master Adam step reads and writes
GRAD_BYTES = 2                  # gradients all-reduced in fp16/bf16

# ---- H100: the two constants fitted on H100 runs (never on the validation runs) -------
# Fitted, in this order, each to one published run that is NOT among the validation runs
# of minitron.analysis.published (H100_FITTING_RUNS lists them):
#   bf16: Llama 3 405B on 8,192 H100 (Grattafiori et al. 2024, Table 4, first row:
#         TP 8, PP 16, DP 64, 32 sequences of 8,192 per DP rank, 430 TFLOP/s per GPU;
#         the interleaving degree is not stated, we take v = 2)         -> 0.615
#   fp8:  GPT-3 5B on 64 H100, FP8 (NeMo 24.07 performance summary, DGX-H100: TP 1,
#         GBS 2048, MBS 4, s 2048, 22,521 tokens/s per GPU)             -> 0.575
# (minitron.analysis.published.fit_h100_constants re-derives both; they were 0.664 and
# 0.545 while flash attention was priced on the bytes of the s×s scores it never writes
# and the FP8 casts were not priced apart.)
# (cuBLAS reaches about 0.75 of the bf16 peak on large square GEMMs; a training run's
# GEMMs sustain less: thinner shapes, power and clock limits, concurrent communication.)
H100_GEMM_MAX_EFFICIENCY = 0.615
H100_FP8_GEMM_MAX_EFFICIENCY = 0.575

# ---- the host's time per dropless MoE layer (software, not the GPU) -------------------
# Megatron-Core's dropless MoE layer issues hundreds of small kernels per microbatch and
# reads its token counts back to the host to size the expert buffers; at a microbatch of
# one 4,096-token sequence a thin expert layer (Qwen3-30B-A3B: h 2048, 128 experts of
# 768) is done on the GPU before the host has issued the next. Fitted on one run that is
# not an H100 run, so on none the H100 runs are validated on:
#   Qwen3-30B-A3B on 8 DGX-B200 GPUs, FP8, MBS 1, EP 8, PP 1, 48 layers, dropless,
#   9,691 tokens/s per GPU (Megatron-Bridge performance summary archive, NeMo 26.02
#   container): 4,096 tokens / 9,691 tokens/s / 48 layers                  -> 8.8 ms
# taking the run to be host-bound: the same table's B300 at MBS 8 ran 3.0x faster per
# GPU, and this model's GPU time for the microbatch on an H100, over the B200's 2.27x FP8
# peak, is 0.36 of it (published.fit_dropless_moe_host_s re-derives both). The
# host time does not grow with the microbatch: a larger one hides it.
DROPLESS_MOE_HOST_S = 0.0088


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
    gemm_max_efficiency: float = 0.0      # 0: GEMM_MAX_EFFICIENCY (the cuBLAS figure of V100/A100)
    fp8_peak_flops: float = 0.0           # dense FP8 tensor-core peak; 0: no FP8
    fp8_gemm_max_efficiency: float = 0.0  # fraction of the FP8 peak a large FP8 GEMM reaches
    # the software of the cluster's era (a preset of analysis.software): what `plan`
    # prices unless told otherwise
    software: str = "megatron-2019"

    @property
    def ridge(self) -> float:
        """FLOPs per byte at which a kernel stops being memory-bound."""
        return self.peak_flops / self.hbm_bw

    @property
    def gemm_e_max(self) -> float:
        """Fraction of the 16-bit peak a large GEMM reaches on this GPU."""
        return self.gemm_max_efficiency or GEMM_MAX_EFFICIENCY


CLUSTERS: dict[str, Cluster] = {
    # DGX-2H: 16 V100 (32 GB, 900 GB/s HBM2), NVSwitch at 150 GB/s per direction per GPU
    # (the "300 GB/s" of Megatron-LM 2019 counts both directions), 8×100 Gb/s InfiniBand
    # = 100 GB/s between servers per node.
    "v100-dgx2": Cluster("v100-dgx2", "V100-SXM3-32GB", 125e12, 16, 150e9, 100e9, 5e-6, 10e-6,
                         32e9, 900e9, software="megatron-2019"),
    # DGX A100: 8 A100 (80 GB, 2.0 TB/s), NVLink3 300 GB/s per direction, 8×200 Gb/s IB.
    "a100-dgx": Cluster("a100-dgx", "A100-SXM4-80GB", 312e12, 8, 300e9, 200e9, 5e-6, 10e-6,
                        80e9, 2.039e12, software="ptdp-2021"),
    # DGX H100 (NVIDIA H100 SXM datasheet): 8 H100 (80 GB HBM3, 3.35 TB/s), dense bf16
    # 989 TFLOP/s and dense FP8 1,979 TFLOP/s (the datasheet's 1,979 / 3,958 assume
    # sparsity), NVLink 4 at 900 GB/s per GPU both ways = 450 GB/s per direction, one
    # 400 Gb/s NIC per GPU (InfiniBand NDR) = 8 × 50 GB/s per node. The two achievable
    # GEMM fractions are fitted, see H100_FITTING_RUNS; everything else is datasheet or
    # the Megatron-LM 2019 calibration.
    "h100-dgx": Cluster("h100-dgx", "H100-SXM5-80GB", 989e12, 8, 450e9, 400e9, 4e-6, 8e-6,
                        80e9, 3.35e12, gemm_max_efficiency=H100_GEMM_MAX_EFFICIENCY,
                        fp8_peak_flops=1979e12, fp8_gemm_max_efficiency=H100_FP8_GEMM_MAX_EFFICIENCY,
                        software="megatron-core-2024"),
    # H800 SXM (DeepSeek-V3's GPUs, arXiv 2412.19437 §3.1): the H100 SXM5's chip, memory and
    # peaks (so its fitted GEMM fractions), with NVLink cut to 400 GB/s per GPU both ways =
    # 200 GB/s per direction (the export-control part's datasheet); one 400 Gb/s InfiniBand
    # NIC per GPU, 8 × 50 GB/s per node (DeepSeek-V3 §3.2.2: "IB (50 GB/s)", and NVLink
    # "160 GB/s" achieved of the 200).
    "h800": Cluster("h800", "H800-SXM5-80GB", 989e12, 8, 200e9, 400e9, 4e-6, 8e-6,
                    80e9, 3.35e12, gemm_max_efficiency=H100_GEMM_MAX_EFFICIENCY,
                    fp8_peak_flops=1979e12, fp8_gemm_max_efficiency=H100_FP8_GEMM_MAX_EFFICIENCY,
                    software="megatron-core-2024"),
    # Meta's Grand Teton H100s of torchtitan's benchmarks (benchmarks/llama3_h100_202412_torchtitan.md:
    # "96GB HBM2e with 2.4 TB/sec", NVLink inside the 8-GPU host, "400 Gb/s per GPU" RDMA, "the
    # default 500W power limit"; its peak is "between SXM and NVL", not stated): priced at the
    # SXM5's dense peaks and the fitted H100 GEMM fractions (fitted at 700 W), so the power cap is
    # not in the model, with HBM2e's bandwidth and capacity.
    "h100-96gb": Cluster("h100-96gb", "H100-HBM2e-96GB", 989e12, 8, 450e9, 400e9, 4e-6, 8e-6,
                         96e9, 2.4e12, gemm_max_efficiency=H100_GEMM_MAX_EFFICIENCY,
                         fp8_peak_flops=1979e12, fp8_gemm_max_efficiency=H100_FP8_GEMM_MAX_EFFICIENCY,
                         software="torchtitan-2024"),
}

# Memory of the common training GPUs (datasheets), for `minitron memory`'s warning: the
# clusters' GPUs and the H200 (141 GB HBM3e) and B200 (180 GB per GPU in a DGX B200).
GPU_MEMORY_BYTES: dict[str, float] = {**{c.gpu: c.memory_bytes for c in CLUSTERS.values()},
                                      "H200-SXM-141GB": 141e9, "B200-180GB": 180e9}


def get_cluster(cluster: str | Cluster) -> Cluster:
    """A Cluster, or the named one from :data:`CLUSTERS` (ValueError listing them)."""
    if isinstance(cluster, Cluster):
        return cluster
    if cluster not in CLUSTERS:
        raise ValueError(f"unknown cluster '{cluster}': choose one of {', '.join(CLUSTERS)}")
    return CLUSTERS[cluster]


@dataclass
class Prediction:
    """The predicted iteration: seconds, achieved TFLOP/s per GPU (PTD-P's way of
    counting: Eq. 3 with recomputation), peak memory, bubble fraction, and a breakdown
    in seconds (``compute, tp_comm, pp_comm, bubble, dp_comm, dp_comm_exposed,
    optimizer`` and what overlap hid, ``tp_comm_hidden, pp_comm_hidden,
    dp_comm_hidden``), with ``software``, ``recompute``, ``mfu`` and ``parts``: the
    iteration per kind of work, as :func:`~minitron.analysis.breakdown.explain` lists it)."""

    iteration_s: float
    tflops_per_gpu: float
    memory_gb_per_gpu: float
    bubble_fraction: float
    breakdown: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)

    def __getitem__(self, key):  # allow prediction["iteration_s"]
        return getattr(self, key)


# What a planner entry carries beside its layout: its prediction and the planner's reasons
_ENTRY_KEYS = frozenset(Prediction.__dataclass_fields__) | {"reasons"}


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------
def matmul_efficiency(m: int, n: int, k: int, cluster: str | Cluster, bytes_per_el: int = 2,
                      fp8: bool = False) -> float:
    """Fraction of peak a [m, k] × [k, n] matrix multiply reaches: a smooth roofline
    ``e_max · I / (I + e_max·R)`` where ``I = 2mnk / (e·(mk + kn + mn))`` is its
    arithmetic intensity and R the cluster's ridge point. Saturates at the cluster's
    ``gemm_e_max`` (``GEMM_MAX_EFFICIENCY`` unless fitted for the GPU) for large
    products; thin products are bandwidth-bound. ``fp8``: of the FP8 peak, 1-byte elements."""
    c = get_cluster(cluster)
    if fp8:
        e, ridge, bytes_per_el = c.fp8_gemm_max_efficiency, c.fp8_peak_flops / c.hbm_bw, 1
    else:
        e, ridge = c.gemm_e_max, c.ridge
    intensity = 2 * m * n * k / (bytes_per_el * (m * k + k * n + m * n))
    return e * intensity / (intensity + e * ridge)


def _gemm_s(m: float, n: float, k: float, c: Cluster, count: float = 1,
            fp8: bool = False) -> tuple[float, float, float]:
    """Seconds of `count` products [m,k]×[k,n] (forward), of their input gradients
    [m,n]×[n,k] and of their weight gradients [k,m]×[m,n] (at the FP8 peak with `fp8`)."""
    f = 2 * m * n * k * count / (c.fp8_peak_flops if fp8 else c.peak_flops)
    return (f / matmul_efficiency(m, n, k, c, fp8=fp8), f / matmul_efficiency(m, k, n, c, fp8=fp8),
            f / matmul_efficiency(k, n, m, c, fp8=fp8))


# Matrix multiplies of one layer, by kind: (rows, columns, inner) of the forward product
# for b·s tokens on one tensor rank; "attention" is the per-head QKᵀ and attention·V;
# "experts" the routed experts' MLPs of a MoE block (with its router).
LINEAR_KINDS = ("qkv", "proj", "fc1", "fc2", "experts")


@dataclass(frozen=True)
class _LayerTime:
    """Seconds of one transformer layer for one microbatch on one tensor rank, by kind
    of work: ``parts[kind] = (forward, backward input-gradient, backward weight-gradient)``
    for the linears, the attention products and the element-wise kernels."""

    parts: dict
    core_fwd: float   # forward of the attention core (what selective recompute replays)
    attention_s: float = 0.0  # forward + backward of the attention products (hides ring CP)

    @property
    def fwd(self) -> float:
        return sum(f for f, _, _ in self.parts.values())

    @property
    def bwd_input(self) -> float:
        return sum(b for _, b, _ in self.parts.values())

    @property
    def bwd_weight(self) -> float:
        return sum(w for _, _, w in self.parts.values())


@dataclass(frozen=True)
class _StageTime:
    """One pipeline stage's microbatch: forward, backward input- and weight-gradient
    seconds, the work by kind (``parts``), and each axis's communication on the critical
    path (``tp, cp, ep``) and hidden behind computation (``tp_hidden, cp_hidden``)."""

    fwd: float
    b_in: float
    b_w: float
    parts: dict
    tp: float
    tp_hidden: float
    cp: float
    cp_hidden: float
    ep: float
    ep_hidden: float = 0.0
    host: float = 0.0  # the host's seconds to issue the stage's MoE layers (Software.moe_host_s)

    @property
    def gpu_seconds(self) -> float:
        """The GPU's critical path per microbatch: compute and exposed communication."""
        return self.fwd + self.b_in + self.b_w + self.tp + self.cp + self.ep

    @property
    def host_wait(self) -> float:
        """Seconds per microbatch the GPU waits for the host to issue its kernels."""
        return max(self.host - self.gpu_seconds, 0.0)

    @property
    def seconds(self) -> float:
        """The stage's critical path per microbatch (what the slowest stage sets): its
        GPU time, or the host's time to issue it where that is longer."""
        return self.gpu_seconds + self.host_wait


def attention_widths(model: ModelConfig, t: int, head_dim: int | None = None) -> tuple[int, float]:
    """(query width, key/value width) on one tensor rank: ``heads·d/t`` and
    ``kv_heads·d/t``, but at least one whole kv head: with t > kv_heads each kv head is
    replicated on t/kv_heads ranks (the known way past GQA's limit), never more."""
    d = head_dim or model.head_dim
    return model.heads * d // t, max(model.n_kv_heads * d / t, d)


def cp_widths(model: ModelConfig, t: int, head_dim: int | None = None) -> tuple[float, float]:
    """(query + output, key + value) widths per token on one tensor rank: what context
    parallelism exchanges, twice :func:`attention_widths`'; MLA's decompressed heads,
    heads/t·(dk + dv) each (``context_parallel.head_widths``: keys qk_nope + qk_rope wide,
    values v_head_dim, not hidden/heads)."""
    if model.attention == "mla" and not head_dim:
        width = model.heads / t * sum(head_widths(model))
        return width, width
    q, kv = attention_widths(model, t, head_dim)
    return 2 * q, 2 * kv


def attention_keys(model: ModelConfig, sw: Software, doc_len: int | None = None) -> dict[float, float]:
    """Keys each query meets, as ``{keys: share of the layers}`` over the model's blocks
    (a pattern of windowed and global layers, ``window_of``): from the FLOPs formula's
    core (:func:`~minitron.model_flops.keys_per_query`) — s, halved where flash attention
    skips the causal mask's masked blocks (an unfused kernel computes the whole square),
    the block pairs in reach under a window; with packed documents of `doc_len` tokens
    (``--doc-len``) each document's, averaged over the sequence's tokens."""
    causal, s = sw.attention == "flash", model.seq_len
    row = packed_rows(s, doc_len)[0] if doc_len else [s]
    shares: dict[float, float] = {}
    for i, layers in _layers_by_window(model).items():  # i: the first block of each window
        k = sum(n * keys_per_query(model, i, causal, n) for n in row) / s
        shares[k] = shares.get(k, 0.0) + layers / model.layers
    return shares


def _layers_by_window(model: ModelConfig) -> dict[int, int]:
    """{first block of each window (``window_of``): how many blocks have that window}."""
    first, count = {}, {}
    for i in range(model.layers):
        w = model.window_of(i)
        first.setdefault(w, i)
        count[w] = count.get(w, 0) + 1
    return {first[w]: n for w, n in count.items()}


def _layer_time(model: ModelConfig, b: int, t: int, sp: bool, c: Cluster, sw: Software,
                e: int = 2, cp: int = 1, ep: int = 1, moe: bool = False, imbalance: float = 0.0,
                head_dim: int | None = None, keys: dict[float, float] | None = None) -> _LayerTime:
    """One layer on one rank: b sequences of s/cp tokens (context parallel), the
    attention of those queries against the keys each meets (`keys`, :func:`attention_keys`:
    the layers' mean, each layer priced at its own window), the MLP dense or, when
    `moe`, the router, the shared experts and the routed experts this rank holds (E/ep
    of them, each on k·T·ep/(t·E) token rows; the busiest rank gets (1 + `imbalance`)
    times the balanced share)."""
    keys = keys or attention_keys(model, sw)
    T = b * model.seq_len // cp
    fp8 = sw.fp8 and c.fp8_peak_flops > 0
    shapes = tp_linear_shapes(model, T, t, head_dim)
    parts = {k: _gemm_s(*shapes[k], c, fp8=fp8) for k in ("qkv", "proj")}
    mlp, mlp_passes = (_moe_mlp(model, T, t, c, fp8, ep, imbalance) if moe else _dense_mlp(model, T, t, c, fp8))
    parts.update(mlp)
    per_keys = [(share, _attention_products_s(model, b, t, cp, c, sw, e, head_dim, k)) for k, share in keys.items()]
    att_f, att_b = (sum(share * fb[j] for share, fb in per_keys) for j in (0, 1))
    parts["attention"] = (att_f, att_b, 0.0)
    mean_keys = sum(k * share for k, share in keys.items())
    ew, matrix_f, matrix_b = _elementwise_s(model, b, t, sp, cp, c, sw, e, mlp_passes, mean_keys)
    cast_f, cast_b = _fp8_casts_s(model, T, t, c, sw, moe, ep, imbalance, head_dim) if fp8 else (0.0, 0.0)
    parts["elementwise"] = (ew + matrix_f + cast_f, 2 * ew + matrix_b + cast_b, 0.0)
    return _LayerTime(parts, att_f + matrix_f, att_f + att_b)


def _dense_mlp(model: ModelConfig, T: int, t: int, c: Cluster, fp8: bool) -> tuple[dict, float]:
    """The dense MLP's products on one tensor rank, ``{"fc1", "fc2", "experts"}`` (up, or
    gate and up as one 2f/t-wide product with SwiGLU; down; no experts), and its
    activation's element-wise passes per token: GeLU reads and writes T·f/t, SwiGLU reads
    gate and up and writes their product."""
    f, gated = model.ffn_hidden, model.activation == "swiglu"
    shapes = tp_linear_shapes(model, T, t)
    parts = {"fc1": _gemm_s(*shapes["fc1"], c, fp8=fp8), "fc2": _gemm_s(*shapes["fc2"], c, fp8=fp8),
             "experts": (0.0, 0.0, 0.0)}
    return parts, (3 if gated else 2) * f / t


def tp_linear_shapes(model: ModelConfig, T: float, t: int, head_dim: int | None = None) -> dict:
    """(rows, columns, inner) of a dense layer's four linears' forward products for T tokens
    on one of t tensor ranks: QKV (h → q + 2·kv, :func:`attention_widths`), the attention's
    output projection (q → h), the MLP's up (gate and up as one 2f/t-wide product with
    SwiGLU) and down products."""
    h, f, gated = model.hidden, model.ffn_hidden, model.activation == "swiglu"
    q, kv = attention_widths(model, t, head_dim)
    return {"qkv": (T, q + 2 * kv, h), "proj": (T, h, q), "fc1": (T, (2 if gated else 1) * f / t, h),
            "fc2": (T, h, f / t)}


def _moe_rows(model: ModelConfig, T: int, t: int, ep: int, imbalance: float) -> tuple[float, float]:
    """(token rows of each of this rank's routed experts, how many it holds): the k·T
    routed copies over t tensor ranks and E experts, E/ep of them here; the busiest rank
    gets (1 + `imbalance`) times the balanced share."""
    return model.top_k * T * ep / (t * model.experts) * (1 + imbalance), model.experts / ep


def _moe_mlp(model: ModelConfig, T: int, t: int, c: Cluster, fp8: bool, ep: int,
             imbalance: float) -> tuple[dict, float]:
    """A MoE block's products on one rank, ``{"experts", "fc1", "fc2"}``: the local routed
    experts (up and down, whole) with the router (T × E, 16-bit), and the shared experts'
    up and down split over t; and its element-wise passes per token: the activations, and
    the permute and un-permute of the k copies of each token (read, write: 4 passes of k·T·h/t)."""
    f, k, E, h, gated = model.moe_ffn_hidden, model.top_k, model.experts, model.hidden, model.activation == "swiglu"
    rows, local = _moe_rows(model, T, t, ep, imbalance)
    up = _gemm_s(rows, (2 if gated else 1) * f, h, c, count=local, fp8=fp8)
    down = _gemm_s(rows, h, f, c, count=local, fp8=fp8)
    router = _gemm_s(T, E, h, c)
    fs = model.shared_ffn_hidden
    parts = {"experts": tuple(x + y + z for x, y, z in zip(up, down, router)),
             "fc1": _gemm_s(T, (2 if gated else 1) * fs / t, h, c, fp8=fp8) if fs else (0.0, 0.0, 0.0),
             "fc2": _gemm_s(T, h, fs / t, c, fp8=fp8) if fs else (0.0, 0.0, 0.0)}
    passes = (rows * local * (3 if gated else 2) * f + T * fs / t * (3 if gated else 2)) / T \
        + 4 * k * h / t * (1 + imbalance)
    return parts, passes


def _attention_products_s(model: ModelConfig, b: int, t: int, cp: int, c: Cluster, sw: Software, e: int,
                          head_dim: int | None, keys: float) -> tuple[float, float]:
    """(Forward, backward) seconds of the attention products: per head, s/cp queries
    against the `keys` each meets (:func:`attention_keys`: s, s/2 for flash's causal
    mask, the block pairs of a window). Flash attention skips the masked blocks of a causal mask (half
    the products) in one fused kernel (Dao et al. 2022) whose s×s scores stay on chip, so
    its HBM traffic is Q, K, V and the output (K and V streamed whole), not the score matrix — priced on the same
    smooth roofline as a GEMM with that intensity (far above the ridge: it runs at the
    GEMM ceiling); the published kernel figures (software.kernel_tflops) are shown beside
    it by explain, not priced: see benchmarks/RESULTS.md. An unfused or
    fused-softmax kernel computes the whole square and masks it (PTD-P): QKᵀ and
    attention·V as GEMMs, both backward products input gradients."""
    s, d = model.seq_len, head_dim or model.head_dim
    q, _ = attention_widths(model, t, head_dim)
    heads = b * (q // d)
    if sw.attention == "flash":
        flops = 2 * 2 * (s / cp) * keys * d * heads
        intensity = flops / (e * heads * d * (2 * s / cp + 2 * s))
        eff = c.gemm_e_max * intensity / (intensity + c.gemm_e_max * c.ridge)
        att_f = flops / (c.peak_flops * eff)
        return att_f, 2.5 * att_f  # QKᵀ recomputed in the backward
    att_f = att_b = 0.0
    for mm in [(s / cp, keys, d), (s / cp, d, keys)]:
        x, y, z = _gemm_s(*mm, c, count=heads)
        att_f, att_b = att_f + x, att_b + y + z  # no weights: both are input gradients
    return att_f, att_b * (sw.attention_backward_ratio / 2)


def _elementwise_s(model: ModelConfig, b: int, t: int, sp: bool, cp: int, c: Cluster, sw: Software, e: int,
                   mlp_passes: float, keys: float) -> tuple[float, float, float]:
    """Forward seconds of a layer's element-wise kernels, and the (forward, backward)
    seconds of the passes over the b·a·(s/cp)·keys/t attention matrix (`keys` per query,
    :func:`attention_keys`: s for a global layer's whole square), from the software's kernel
    inventory (see software.py): per token, replicated unless sequence parallel, the
    norms and the two residual-branch sites; split over t, the head reshapes (8·Th, none
    in PTD-P's layout) and the MLP activation (`mlp_passes` per token) — their backward
    moves about twice their forward — all at ELEMENTWISE_BW_FRACTION of HBM bandwidth."""
    s, h, a = model.seq_len, model.hidden, model.heads
    T = b * s // cp
    bw_ew = c.hbm_bw * ELEMENTWISE_BW_FRACTION
    matrix_f, matrix_b = (k_ * b * (a / t) * (s / cp) * keys * e / bw_ew for k_ in sw.attention_matrix_passes)
    sharded = sw.reshape_passes * T * h / t + T * mlp_passes
    ew = (sw.token_passes * T * h / (t if sp else 1) + sharded) * e / bw_ew
    return ew, matrix_f, matrix_b


def _fp8_casts_s(model: ModelConfig, T: int, t: int, c: Cluster, sw: Software, moe: bool, ep: int,
                 imbalance: float, head_dim: int | None) -> tuple[float, float]:
    """(Forward, backward) seconds of the FP8 casts (Transformer Engine): every linear's
    input forward and its output gradient backward are read (2 bytes) and written cast
    and transposed (1 + 1: FP8 GEMMs on Hopper take only the TN layout); current scaling
    first reads the tensor once more for its amax (delayed scaling takes it from the
    history and fuses the amax into the cast): 4 or 6 bytes per element. Weights are cast
    once per step (cached across microbatches), not counted."""
    h, g = model.hidden, 2 if model.activation == "swiglu" else 1
    q, kv = attention_widths(model, t, head_dim)
    f = model.moe_ffn_hidden if moe else model.ffn_hidden
    ins, outs = T * (h + q + h) + (T * f / t if not moe else 0.0), T * ((q + 2 * kv) + h + h)
    if moe:
        rows, local = _moe_rows(model, T, t, ep, imbalance)
        fs = model.shared_ffn_hidden
        ins += rows * local * (h + f) + (T * (h + fs / t) if fs else 0.0)
        outs += rows * local * (g * f + h) + (T * (g * fs / t + h) if fs else 0.0)
        ins -= T * h  # no dense fc1 input
        outs -= T * h  # no dense fc2 output
    else:
        outs += T * g * f / t
    per, bw_ew = 4 if sw.fp8_recipe == "delayed" else 6, c.hbm_bw * ELEMENTWISE_BW_FRACTION
    return per * ins / bw_ew, per * outs / bw_ew


def _logit_times(model: ModelConfig, b: int, t: int, c: Cluster, cp: int = 1,
                 fp8: bool = False) -> tuple[tuple, tuple, float]:
    """Seconds of the output layer and the fp32 cross-entropy (about 6 passes over the
    b·s·V/t logits in all, for the s/cp tokens of this context rank): ``(forward matmul,
    forward element-wise), (input-gradient matmul, backward element-wise),
    weight-gradient matmul``."""
    T, V = b * model.seq_len // cp, padded_vocab(model, t) / t
    fwd, bin_, bw = _gemm_s(T, V, model.hidden, c, fp8=fp8)
    ew = 6 * T * V * 4 / (c.hbm_bw * ELEMENTWISE_BW_FRACTION)
    return (fwd, ew / 3), (bin_, 2 * ew / 3), bw


def _allreduce_s(nbytes: float, n: int, bw: float, latency: float) -> float:
    """Ring all-reduce time: 2(n−1) latency steps and 2(n−1)/n · bytes at `bw`."""
    if n == 1:
        return 0.0
    return 2 * (n - 1) * latency + ring_allreduce_wire_bytes(nbytes, n) / (bw * COMM_BW_FRACTION)


def _alltoall_s(nbytes: float, n: int, c: Cluster, inter_share: float = 1.0) -> float:
    """All-to-all among n consecutive ranks, each sending (n−1)/n of its `nbytes`: the
    part for ranks of its own node over NVLink, the rest over the GPU's network card
    (inter_bw/G), both at once; one latency step per peer node and one inside.
    `inter_share`: the fraction of the cross-node bytes that travel (a node-aware
    dispatcher's, :func:`_node_dedup_share`)."""
    if n == 1:
        return 0.0
    G = c.gpus_per_node
    inside = min(n, G)
    intra = nbytes * (inside - 1) / n / (c.intra_bw * COMM_BW_FRACTION)
    inter = inter_share * nbytes * (n - inside) / n / (c.inter_bw / G * COMM_BW_FRACTION)
    return c.intra_latency + (n // G) * c.inter_latency + max(intra, inter)


def _node_dedup_share(model: ModelConfig, ep: int, c: Cluster) -> float:
    """Cross-node bytes of a node-aware dispatch over those of a plain all-to-all, for
    balanced routing (top-k of E experts uniformly, as a force-balanced benchmark routes):
    a plain all-to-all sends each of the k copies whose expert sits on another node,
    k·(ep−G)/ep per token; a node-aware one sends a token once to each of the other
    N − 1 nodes that holds any of its k experts, (N−1)·(1 − C(E − E/N, k)/C(E, k))."""
    from math import comb

    G, E, k = c.gpus_per_node, model.experts, model.top_k
    if ep <= G:
        return 1.0
    nodes = ep // G
    hit = 1 - comb(E - E // nodes, k) / comb(E, k)
    return (nodes - 1) * hit / (k * (ep - G) / ep)


def stage_weights(model: ModelConfig, t: int, p: int, v: int, pp_rank: int, n_layers: int, ep: int = 1,
                  moe_layers: int = 0, head_dim: int | None = None, kind: str = "1f1b") -> tuple[float, float]:
    """(dense, expert) parameter elements on one rank of a pipeline stage of `n_layers`
    layers, `moe_layers` of them MoE blocks: attention, dense MLPs, shared experts,
    router, norms, embedding and head over t tensor ranks; the routed experts E/ep per
    rank, whole (expert tensor parallelism 1). GPT shapes: exactly
    :func:`~minitron.analysis.params.params_given_layers` (the 1-D engine's count)."""
    if _gpt_shapes(model, head_dim):
        return float(params_given_layers(model, t, p, v, "1d", pp_rank, n_layers, kind)), 0.0
    first, last = placement_for(kind, p, v).holds_ends(pp_rank)
    h = model.hidden
    q, kv = attention_widths(model, t, head_dim)
    mats = 3 if model.activation == "swiglu" else 2
    attn = h * (q + 2 * kv) + q * h + 2 * h * (2 if model.norm == "layernorm" else 1)
    dense_mlp = mats * h * model.ffn_hidden / t
    shared = mats * h * model.shared_ffn_hidden / t + h * model.experts + (h if model.shared_gate else 0)
    experts = mats * h * model.moe_ffn_hidden * model.experts / ep
    dense = n_layers * attn + (n_layers - moe_layers) * dense_mlp + moe_layers * shared
    emb = padded_vocab(model, t) / t * h
    dense += (emb + (model.seq_len * h if model.positions == "learned" else 0)) if first else 0
    dense += (emb if not model.tied_embeddings or not first else 0) + h if last else 0
    return float(dense), float(moe_layers * experts)


def _allgather_s(nbytes: float, n: int, bw: float, latency: float) -> float:
    """Ring all-gather time into an `nbytes` output: n−1 latency steps and
    (n−1)/n · bytes at `bw` (half an all-reduce)."""
    if n == 1:
        return 0.0
    return (n - 1) * latency + ring_allgather_wire_bytes(nbytes, n) / (bw * COMM_BW_FRACTION)


# --------------------------------------------------------------------------------------
# The iteration
# --------------------------------------------------------------------------------------
def predict(model: ModelConfig, layout: PlannedLayout | dict, global_batch: int, cluster: str | Cluster,
            recompute: str | bool | None = None, bytes_per_param: float = 16,
            software: str | Software | None = None, head_dim: int | None = None,
            moe_imbalance: float = 0.0, doc_len: int | None = None) -> Prediction:
    """Predicted time of one iteration of `global_batch` sequences on `cluster`.

    `layout`: a :class:`~minitron.analysis.planned_layout.PlannedLayout`, or a planner entry
    (a dict) naming its fields, its prediction and reasons beside them (:meth:`PlannedLayout.of`).
    `software`: a :class:`~minitron.analysis.software.Software` or a preset name (default
    ``megatron-2019``, the software the constants were fitted with); `recompute`
    overrides its recomputation policy. `head_dim`: the attention's head width when it is
    not hidden/heads. `moe_imbalance`: the busiest expert-parallel rank receives
    (1 + this) times the balanced share of routed tokens (0: balanced routing, as
    Megatron's benchmarks force it). `doc_len`: packed documents (``--pack``) of this mean
    length, each attended on its own (the attention products, score matrix, the ring's
    reach and the FLOPs at L, not s; None: whole sequences). Returns a :class:`Prediction`:
    ``iteration_s, tflops_per_gpu`` (Eq. 3 FLOPs over n·time with full recomputation,
    model or hardware FLOPs otherwise; for other than GPT shapes
    :func:`~minitron.analysis.flops.transformer_flops_per_iteration`),
    ``memory_gb_per_gpu`` (mixed-precision,
    :func:`~minitron.analysis.memory.memory_estimate`), ``bubble_fraction``, and the
    ``breakdown`` in seconds, its ``parts`` per kind of work (:func:`explain` reads
    them), ``mfu`` (model FLOPs, no recomputation counted, over n·bf16 peak·time),
    ``tokens_per_s_per_gpu`` and ``stage_fbw``, the slowest stage's forward, input- and
    weight-gradient seconds per microbatch (what a zero-bubble or V schedule's bubble reads). Raises ValueError for a layout the model cannot take.
    """
    c = get_cluster(cluster)
    sw = get_software(software)
    L = PlannedLayout.of(layout, carried=_ENTRY_KEYS)
    rc = recompute_policy(sw.recompute if recompute is None else recompute)
    kind = L.schedule
    _check_layout(model, L, global_batch, kind)
    if doc_len is not None and not 0 < doc_len <= model.seq_len:
        raise ValueError(f"doc_len {doc_len} must be in 1 .. seq_len {model.seq_len}")
    r = _Run(model, L, c, sw, rc, kind, global_batch, head_dim, moe_imbalance, bytes_per_param, doc_len)
    tm = _iteration_times(r)
    fl, mfu_flops = _iteration_flops(r)
    memory = _memory_bytes(r, tm.weights, tm.shard)
    return Prediction(iteration_s=tm.iteration_s, tflops_per_gpu=fl / (r.L.world * tm.iteration_s) / 1e12,
                      memory_gb_per_gpu=memory / 1e9, bubble_fraction=tm.bubble_fraction,
                      breakdown=_breakdown(r, tm, mfu_flops))


def _gpt_shapes(model: ModelConfig, head_dim: int | None) -> bool:
    """Whether the model is a GPT of PTD-P's shape (no experts, GeLU, multi-head
    attention of width hidden/heads): the shapes whose FLOPs and weights the 1-D engine's
    exact counts (analysis/flops.py, analysis/params.py) give."""
    return model.experts == 0 and model.activation != "swiglu" and model.n_kv_heads == model.heads and not head_dim


@dataclass(frozen=True)
class _Run:
    """What one prediction prices, read once: the model, the layout, the cluster, the
    software, the recomputation policy and the schedule, the global batch and the
    arguments of :func:`predict`."""

    model: ModelConfig
    L: PlannedLayout
    c: Cluster
    sw: Software
    rc: str
    kind: str
    global_batch: int
    head_dim: int | None
    moe_imbalance: float
    bytes_per_param: float
    doc_len: int | None = None

    @property
    def m(self) -> int:
        """Microbatches per pipeline per iteration."""
        return self.global_batch // (self.L.dp * self.L.microbatch_size)

    @property
    def fp8(self) -> bool:
        """FP8 matmuls: the software runs them and the cluster has an FP8 peak."""
        return self.sw.fp8 and self.c.fp8_peak_flops > 0

    @property
    def x(self) -> int:
        """Bytes of a b·(s/cp)·h activation in 16 bits (what tensor and pipeline ranks send)."""
        return self.L.microbatch_size * self.model.seq_len // self.L.cp * self.model.hidden * 2

    @property
    def replay(self) -> int:
        """How often a layer's forward communication runs: again under full recompute."""
        return 2 if self.rc == "full" else 1


@dataclass(frozen=True)
class _PerLayer:
    """One layer's seconds per microbatch on one rank: its work (``dense``, and ``moe`` for
    a MoE block) and the share of MoE blocks, the output layer's ``logits``
    (:func:`_logit_times`), a tensor-parallel all-reduce ``ar`` and sequence-parallel
    re-gather of one activation, the context-parallel exchange ``cp`` (seconds, of which
    hidden) and the expert-parallel all-to-alls ``ep`` of a MoE block."""

    dense: _LayerTime
    moe: _LayerTime
    moe_share: float
    logits: tuple
    ar: float
    regather: float
    cp: tuple[float, float]
    ep: float


@dataclass(frozen=True)
class _Times:
    """The iteration's seconds by part: the slowest stage's microbatch ``st``, the
    pipeline's sends per microbatch (exposed ``pp``, ``pp_hidden``), FSDP's per
    microbatch (all, and hidden), the data-parallel reduction per step (all, and hidden),
    the bubble (fraction, seconds), the optimizer, the iteration; the heaviest stage's
    (dense, expert) ``weights`` and the optimizer's ``shard``."""

    st: _StageTime
    pp: float
    pp_hidden: float
    fsdp: float
    fsdp_hidden: float
    dp: float
    dp_hidden: float
    bubble_fraction: float
    bubble: float
    optimizer: float
    iteration_s: float
    weights: tuple[float, float]
    shard: int


def _iteration_times(r: _Run) -> _Times:
    """The iteration of the slowest pipeline stage: m microbatches of its compute and
    exposed communication (tensor, context, expert, pipeline, FSDP), the bubble over that
    ideal time, the exposed data-parallel reduction and the optimizer step."""
    per = _per_layer(r)
    layers, where = rank_layers(r.model, r.L), layout_placement(r.L)  # a V: both ends on rank 0
    stages = [_stage_time(r, per, n, *where.holds_ends(rank)) for rank, n in enumerate(layers)]
    st = max(stages, key=lambda s_: s_.seconds)
    B = st.b_in + st.b_w
    pp_total, pp_hidden = _pp_comm_s(r)
    pp_mb = pp_total - pp_hidden
    dense_w, expert_w = _heaviest_stage_weights(r, layers, where, per.moe_share)
    dp_s = _dp_comm_s(r, dense_w, expert_w)
    fsdp_mb, fsdp_hidden_mb = _fsdp_s(r, st, fsdp_units(r, layers, where, per.moe_share)) if r.L.zero == 3 \
        else (0.0, 0.0)
    per_mb = st.seconds + pp_mb + fsdp_mb - fsdp_hidden_mb
    bub = _bubble(r, st)
    ideal = r.m * per_mb
    bubble_s = bub * ideal
    hidden = min(DP_OVERLAP * dp_s, B) if r.sw.dp_overlap else 0.0
    dp_exposed = dp_s - hidden
    shard = _optimizer_shard(r.L)
    opt_s = _optimizer_s(r.c, dense_w + expert_w, shard)
    it = ideal + bubble_s + dp_exposed + opt_s
    return _Times(st, pp_mb, pp_hidden, fsdp_mb, fsdp_hidden_mb, dp_s, hidden, bub, bubble_s, opt_s, it,
                  (dense_w, expert_w), shard)


def _per_layer(r: _Run) -> _PerLayer:
    """A layer's work and communication per microbatch (:class:`_PerLayer`)."""
    model, L, c, sw = r.model, r.L, r.c, r.sw
    keys = attention_keys(model, sw, r.doc_len)
    lt = _layer_time(model, L.microbatch_size, L.tp, L.sp, c, sw, cp=L.cp, head_dim=r.head_dim, keys=keys)
    lt_moe = _layer_time(model, L.microbatch_size, L.tp, L.sp, c, sw, cp=L.cp, ep=L.ep, moe=True,
                         imbalance=r.moe_imbalance, head_dim=r.head_dim, keys=keys) if model.experts else lt
    moe_share = sum(model.is_moe_block(i) for i in range(model.layers)) / model.layers
    logits = _logit_times(model, L.microbatch_size, L.tp, c, L.cp, r.fp8)
    ar, regather = _tp_collectives_s(r)
    return _PerLayer(lt, lt_moe, moe_share, logits, ar, regather, _cp_layer_s(r, lt), _ep_layer_s(r))


def _tp_collectives_s(r: _Run) -> tuple[float, float]:
    """(All-reduce, re-gather) seconds of one b·(s/cp)·h activation over the t tensor
    ranks, inside a node over NVLink/NVSwitch (between nodes once t exceeds a node). With
    sequence parallelism an all-reduce is an all-gather and a reduce-scatter (the same
    time), and the backward all-gathers again the input shards that QKV and fc (and the
    output layer) kept (Korthikanti et al. 2022, §4.2.2): the re-gather, else 0."""
    t, c = r.L.tp, r.c
    tp_bw, tp_lat = (c.intra_bw, c.intra_latency) if t <= c.gpus_per_node else \
        (c.inter_bw / c.gpus_per_node, c.inter_latency)
    ar = _allreduce_s(r.x, t, tp_bw, tp_lat)
    return ar, (_allgather_s(r.x, t, tp_bw, tp_lat) if r.L.sp else 0.0)


def _cp_layer_s(r: _Run, lt: _LayerTime) -> tuple[float, float]:
    """(Seconds, of which hidden) of a layer's context-parallel exchange: the K and V of
    the other s/cp chunks (kv heads only) pass the ring once forward, K, V, dK, dV
    backward (Liu et al. 2023); a ring step's transfer runs under the attention of the
    block before it, so only what exceeds the attention's time (up to DP_OVERLAP of it)
    is exposed. "allgather" gathers them first (exposed, Llama 3); "a2a" (Ulysses) swaps
    a sequence shard of q, k, v and the output for a head shard, forward and backward
    (exposed). "usp" (Fang & Zhao 2024): Ulysses' swap over the U = cp_a2a neighbouring
    ranks (exposed; kv heads fewer than U sent to each of their query heads' ranks), then a
    ring over the cp/U others whose messages carry s/(cp/U) tokens on 1/U of those heads
    (``analysis.context_parallel.usp_comm_items``), hidden as the ring's. The forward's
    exchange happens again under full recompute."""
    L, c, model = r.L, r.c, r.model
    t, cp, G = L.tp, L.cp, c.gpus_per_node
    if cp == 1:
        return 0.0, 0.0
    qo_w, kv_w = cp_widths(model, t, r.head_dim)
    b, u = L.microbatch_size, (L.cp_a2a if L.cp_mode == "usp" else cp if L.cp_mode == "a2a" else 1)
    a2a_s = 0.0
    if u > 1:  # the all-to-all's u ranks: t·u neighbours
        abw, alat = _cp_link(c, t * u)
        # USP: a kv head sent to each of its queries' ranks when fewer than U (the engine's);
        # "a2a" as priced before, the kv heads once
        kv_sent = kv_w * max(1.0, u / max(1, model.n_kv_heads // t)) if u < cp else kv_w
        per = 2 * (u - 1) / u * b * model.seq_len // cp * (qo_w + kv_sent) * 2
        a2a_s = (r.replay + 1) * (alat + per / (abw * COMM_BW_FRACTION))
        if u == cp:
            return a2a_s, 0.0
        kv_w = kv_sent  # the ring's message: s/(cp/u) tokens on 1/u of the heads sent
    cbw, clat = _cp_link(c, t * cp)
    kv_bytes = b * model.seq_len // cp * kv_w * 2
    msgs, chunks = _ring_reach(r, cp // u) if L.cp_mode in ("ring", "usp") else (cp // u - 1, 2 * (cp // u - 1))
    layer_cp = (r.replay + 2) * (msgs * clat + chunks / 2 * kv_bytes / (cbw * COMM_BW_FRACTION))
    hidden = min(layer_cp, DP_OVERLAP * lt.attention_s) if L.cp_mode in ("ring", "usp") else 0.0
    return a2a_s + layer_cp, hidden


def _ring_reach(r: _Run, n: int) -> tuple[float, float]:
    """(Messages, chunks of s/(2n) tokens) a ring of `n` ranks passes per layer, the
    busiest rank's, averaged over the model's layers: the whole ring for global attention,
    the chunks a layer's window or the packed documents (``--doc-len``) reach
    (:func:`~minitron.analysis.context_parallel.ring_kv_sends`, what the engine's ring
    skips)."""
    model = r.model
    if not model.window and not r.doc_len:
        return n - 1, 2 * (n - 1)
    rows = packed_rows(model.seq_len, r.doc_len) if r.doc_len else None
    sends = [(layers, ring_kv_sends(n, model.seq_len // (2 * n), model.window_of(i), rows))
             for i, layers in _layers_by_window(model).items()]
    return tuple(sum(layers * x[j] for layers, x in sends) / model.layers for j in (0, 1))


def _cp_link(c: Cluster, ranks: int) -> tuple[float, float]:
    """(Bandwidth, latency) of a context-parallel group spanning `ranks` neighbouring
    GPUs: NVLink inside a node, a node's share of the network cards across."""
    G = c.gpus_per_node
    return (c.intra_bw, c.intra_latency) if ranks <= G else (c.inter_bw / G, c.inter_latency)


def _ep_layer_s(r: _Run) -> float:
    """Seconds of a MoE block's expert-parallel all-to-alls: dispatch and combine of the
    k·T/t routed token copies, forward and backward (and again in a replayed forward), on
    the critical path (:func:`_alltoall_s`); the busiest rank moves (1 + imbalance) times
    the balanced share; a node-aware dispatcher (``ep_node_dedup``) sends a token once
    to each remote node (:func:`_node_dedup_share`)."""
    model, L = r.model, r.L
    if not model.experts or L.ep == 1:
        return 0.0
    # the traced bytes of the four calls (dispatch, combine, both backward) for the
    # T/t tokens this rank routes (analysis/experts.py), one call's worth at a time
    tokens = L.microbatch_size * model.seq_len // L.cp // L.tp
    per_call = balanced_all_to_all_bytes(model, tokens, 2) / 4 * (1 + r.moe_imbalance)
    share = _node_dedup_share(model, L.ep, r.c) if r.sw.ep_node_dedup else 1.0
    return 2 * (r.replay + 1) * _alltoall_s(per_call, L.ep, r.c, share)


def _stage_time(r: _Run, per: _PerLayer, n: int, first: bool, last: bool) -> _StageTime:
    """One microbatch on a pipeline stage of `n` layers (holding the embedding when
    `first`, the output layer when `last`): its work by kind and each axis's
    communication on the critical path. With the software's expert-parallel overlap
    (Megatron-Core's overlap_moe_expert_parallel_comm) a microbatch's forward all-to-alls
    run under another's backward compute and the reverse, hidden up to DP_OVERLAP of the
    stage's compute, as every other overlap here; the host must issue each MoE layer
    (``moe_host_s``)."""
    parts, fwd, b_in, b_w = _stage_compute(r, per, n, last)
    tp, tp_hidden = _stage_tp_s(r, per, n, first, last, sum(parts[k] for k in LINEAR_KINDS))
    n_moe = n * per.moe_share
    ep_s = n_moe * per.ep
    ep_hidden = min(ep_s, DP_OVERLAP * (fwd + b_in + b_w)) if r.sw.ep_overlap else 0.0
    return _StageTime(fwd, b_in, b_w, parts, tp=tp, tp_hidden=tp_hidden, cp=n * (per.cp[0] - per.cp[1]),
                      cp_hidden=n * per.cp[1], ep=ep_s - ep_hidden, ep_hidden=ep_hidden,
                      host=n_moe * r.sw.moe_host_s)


def _stage_compute(r: _Run, per: _PerLayer, n: int, last: bool) -> tuple[dict, float, float, float]:
    """(Work by kind, forward, backward input-gradient, backward weight-gradient) seconds
    of a stage's microbatch: its dense and MoE layers, the output layer and loss on the
    last stage, and the recomputed forward — the attention core under selective
    recomputation, the whole forward under full (Korthikanti et al. 2022)."""
    lt, lt_moe = per.dense, per.moe
    lf, lb_in, lb_w = per.logits
    n_moe = n * per.moe_share
    n_dense = n - n_moe
    parts = {k: n_dense * sum(lt.parts[k]) + n_moe * sum(lt_moe.parts[k])
             for k in (*LINEAR_KINDS, "attention", "elementwise")}
    parts["logits"] = (lf[0] + lb_in[0] + lb_w) if last else 0.0
    parts["elementwise"] += (lf[1] + lb_in[1]) if last else 0.0
    core, full = (n_dense * lt.core_fwd + n_moe * lt_moe.core_fwd), (n_dense * lt.fwd + n_moe * lt_moe.fwd)
    parts["recompute"] = {"none": 0.0, "selective": core, "full": full}[r.rc]
    fwd = full + (sum(lf) if last else 0.0)
    b_in = n_dense * lt.bwd_input + n_moe * lt_moe.bwd_input + parts["recompute"] + (sum(lb_in) if last else 0.0)
    b_w = n_dense * lt.bwd_weight + n_moe * lt_moe.bwd_weight + (lb_w if last else 0.0)
    return parts, fwd, b_in, b_w


def _stage_tp_s(r: _Run, per: _PerLayer, n: int, first: bool, last: bool, linears: float) -> tuple[float, float]:
    """(Exposed, hidden) seconds of a stage's tensor-parallel collectives per microbatch:
    k all-reduces of b·s·h per layer (2 forward, 2 backward, 2 more when the forward is
    replayed; one more for the embedding on the first stage and the output layer on the
    last), on the critical path; with sequence parallelism the backward's re-gathers of
    QKV's, fc's (and the output layer's) input shards (§4.2.2), and the software may hide
    the backward's share or all of them behind the `linears` (up to DP_OVERLAP)."""
    if r.sw.tp_overlap == "async" and r.L.sp:
        return _async_tp_stage_s(r, per, n, first, last)
    k_fwd = 4 if r.rc == "full" else 2
    tp_fwd = (n * k_fwd + first + last) * per.ar
    tp_bwd = 2 * n * per.ar + (2 * n + last) * per.regather
    hideable = {"none": 0.0, "backward": tp_bwd, "all": tp_fwd + tp_bwd}[r.sw.tp_overlap] if r.L.sp else 0.0
    tp_hidden = min(DP_OVERLAP * hideable, linears)
    return tp_fwd + tp_bwd - tp_hidden, tp_hidden


# A sequence-parallel layer's collectives: (name in software.ASYNC_TP["decomposed"], the
# linear whose product it feeds or follows, that product's pass: 0 forward, 1 input
# gradient, 2 weight gradient), by pass; the forward's run again under full recompute.
ASYNC_TP_FORWARD = (("gather", "qkv", 0), ("gather", "fc1", 0), ("scatter", "proj", 0), ("scatter", "fc2", 0))
ASYNC_TP_BACKWARD = (("grad_gather", "proj", 1), ("grad_gather", "fc2", 1), ("grad_scatter", "qkv", 1),
                     ("grad_scatter", "fc1", 1), ("regather", "qkv", 2), ("regather", "fc1", 2))


def decomposed_matmul_s(chunk_s: float, step_s: float, t: int) -> float:
    """Seconds of a collective matmul decomposed into t chunks, as the engine runs it
    (``parallel/collective_matmul.py``) and PyTorch's micro-pipelined ops do: t−1 transfers
    of one chunk, each under one chunk's product, and one product with no transfer under it
    (the own shard, first, of an all-gather; the own chunk, last, of a reduce-scatter):
    ``(t−1)·max(product, transfer) + product``."""
    return (t - 1) * max(chunk_s, step_s) + chunk_s


def _async_tp_op_s(r: _Run, op: str, linear: str, pass_: int, whole: float) -> float:
    """Seconds one decomposed collective adds to its linear's product (of `whole` seconds)
    under async TP: the t chunks' products at the efficiency of their T/t rows, the t−1
    one-chunk copies (a barrier's latency each, two per reduce-scatter step) and what the
    fused op leaves exposed (software.ASYNC_TP: an all-gather's local copy and barriers, a
    reduce-scatter's barriers and its sum of the t partial chunks), over the whole product."""
    L, c, t = r.L, r.c, r.L.tp
    m, n, k = tp_linear_shapes(r.model, L.microbatch_size * r.model.seq_len // L.cp, t, r.head_dim)[linear]
    chunk = _gemm_s(m / t, n, k, c, fp8=r.fp8)[pass_]
    lat = c.intra_latency
    wire = r.x / t / (c.intra_bw * COMM_BW_FRACTION)  # one chunk over NVLink, priced as NCCL's
    hbm_pass = r.x / t / (c.hbm_bw * ELEMENTWISE_BW_FRACTION)  # one chunk read or written in memory
    if op.endswith("gather"):
        step, fixed = lat + wire, ASYNC_TP["gather_barriers"] * lat + ASYNC_TP["gather_copy_passes"] * hbm_pass
    else:
        step = ASYNC_TP["scatter_step_barriers"] * lat + wire
        fixed = ASYNC_TP["scatter_barriers"] * lat + (t + ASYNC_TP["scatter_reduce_writes"]) * hbm_pass
    return decomposed_matmul_s(chunk, step, t) + fixed - whole


def _async_tp_stage_s(r: _Run, per: _PerLayer, n: int, first: bool, last: bool) -> tuple[float, float]:
    """(Exposed, hidden) seconds of a stage's tensor-parallel collectives per microbatch under
    PyTorch's async TP (``tp_overlap="async"``, torchtitan): each collective the compiler
    decomposes (software.ASYNC_TP) costs what :func:`_async_tp_op_s` adds to its product, and
    hides the rest of its all-gather or reduce-scatter (half of ``per.ar``); the others, and
    the embedding's and the output layer's, stay on the critical path as without overlap."""
    if r.L.tp > r.c.gpus_per_node or r.model.experts:
        raise ValueError(f"async TP is priced for dense blocks with the tensor group inside one node "
                         f"(tp {r.L.tp}, {r.c.gpus_per_node} GPUs per node, experts {r.model.experts}): "
                         f"use tp_overlap 'all' for this layout")
    parts = per.dense.parts
    exposed, hidden = (first + last) * per.ar + last * per.regather, 0.0
    for ops, times in ((ASYNC_TP_FORWARD, r.replay), (ASYNC_TP_BACKWARD, 1)):
        for op, linear, pass_ in ops:
            alone = per.regather if op == "regather" else per.ar / 2
            if not ASYNC_TP["decomposed"][op]:
                exposed += n * times * alone
                continue
            added = _async_tp_op_s(r, op, linear, pass_, parts[linear][pass_])
            exposed += n * times * added
            hidden += n * times * max(alone - added, 0.0)
    return exposed, hidden


def _pp_comm_s(r: _Run) -> tuple[float, float]:
    """(Seconds, of which hidden) of a microbatch's pipeline sends: one forward and one
    backward per chunk, of b·s·h/t with the scatter/gather optimisation (then all-gathered
    inside the node after the receive; sequence parallel activations are sharded
    already), across nodes once a pipeline stage's t·cp·d ranks fill one (Narayanan et al.
    2021, §4.1); the software may overlap them (``pp_overlap``, up to DP_OVERLAP)."""
    L, c, x = r.L, r.c, r.x
    t, G = L.tp, c.gpus_per_node
    pp_total = 0.0
    if L.pp > 1:
        cross = t * L.cp * L.dp >= G
        bw, lat = (c.inter_bw / G, c.inter_latency) if cross else (c.intra_bw, c.intra_latency)
        msg = x / t if (L.scatter_gather or L.sp) else x
        hop = lat + msg / (bw * COMM_BW_FRACTION)
        if L.scatter_gather and not L.sp and t > 1:
            hop += (t - 1) / t * x / (c.intra_bw * COMM_BW_FRACTION)  # all-gather after recv
        pp_total = 2 * L.vpp * hop
    return pp_total, (DP_OVERLAP * pp_total if r.sw.pp_overlap else 0.0)


def _heaviest_stage_weights(r: _Run, layers: list, where: Any, moe_share: float) -> tuple[float, float]:
    """(Dense, expert) weights of the stage that holds the most (:func:`stage_weights`):
    the most sit on the first or last stage (the embedding, the head) or on the one with
    the most layers, so only those three are counted."""
    L = r.L
    heavy = {*where.end_ranks(), max(range(L.pp), key=layers.__getitem__)}
    return max((stage_weights(r.model, L.tp, L.pp, L.vpp, rank, layers[rank], L.ep, round(layers[rank] * moe_share),
                              r.head_dim, r.kind) for rank in sorted(heavy)), key=sum)


def _ring_bw(r: _Run, span: int) -> tuple[float, float]:
    """(Bandwidth, latency) of a data-parallel ring of `span` ranks: NVLink inside a node,
    else the node's network cards, shared by the rings of its tensor ranks."""
    c, t = r.c, r.L.tp
    if t * span <= c.gpus_per_node:
        return c.intra_bw, c.intra_latency
    return c.inter_bw / min(t, c.gpus_per_node), c.inter_latency  # one ring per tensor rank shares the NICs


def _dp_comm_s(r: _Run, dense_w: float, expert_w: float) -> float:
    """Data-parallel seconds per step over the dp·cp ranks that hold the same weights (the
    routed experts: over tp·cp·dp/ep ranks). Plain or distributed optimizer (zero 0, 1):
    one all-reduce (reduce-scatter + all-gather, the same bytes) of the 2-byte gradients
    per step, partly hidden behind the last backward when the software overlaps it
    (DP_OVERLAP), else after the flush. FSDP / ZeRO-3 (zero 3) gathers and reduces per
    unit and microbatch (:func:`_fsdp_s`); with HSDP (``fsdp_shard``) the shards are
    all-reduced across the replicas once per step, this."""
    L, c = r.L, r.c
    group, egroup = L.dp * L.cp, max(L.tp * L.cp * L.dp // L.ep, 1)
    if L.zero == 3:
        g = L.fsdp_shard or group
        replicas = group // g
        bw_r, lat_r = _ring_bw(r, group) if replicas > 1 else (c.intra_bw, c.intra_latency)
        return _allreduce_s((dense_w + expert_w) * GRAD_BYTES / g, replicas, bw_r, lat_r)
    bw_d, lat_d = _ring_bw(r, group)
    dp_s = _allreduce_s(dense_w * GRAD_BYTES, group, bw_d, lat_d)
    if expert_w:
        bw_e, lat_e = _ring_bw(r, egroup)
        dp_s += _allreduce_s(expert_w * GRAD_BYTES, egroup, bw_e, lat_e)
    return dp_s


@dataclass(frozen=True)
class FsdpUnits:
    """The FSDP units of the heaviest pipeline stage's rank: ``blocks`` transformer blocks
    of ``block`` parameter elements each (its dense and expert weights, on this tensor
    rank) and the root unit of ``root`` elements (embedding, final norm, head; 0 on a
    stage without the ends)."""

    blocks: int
    block: float
    root: float


def fsdp_units(r: _Run, layers: list, where: Any, moe_share: float) -> FsdpUnits:
    """The units FSDP wraps on the rank :func:`_heaviest_stage_weights` prices: one per
    transformer block (its weights, the stage's over its blocks) and the root."""
    L = r.L
    heavy = {*where.end_ranks(), max(range(L.pp), key=layers.__getitem__)}

    def weights(rank: int, n: int) -> float:
        return sum(stage_weights(r.model, L.tp, L.pp, L.vpp, rank, n, L.ep, round(n * moe_share), r.head_dim, r.kind))

    rank = max(sorted(heavy), key=lambda k: weights(k, layers[k]))
    root = weights(rank, 0)
    n = layers[rank]
    return FsdpUnits(n, (weights(rank, n) - root) / max(n, 1), root)


def fsdp_unit_seconds(r: _Run, numel: float) -> tuple[float, float]:
    """(All-gather, reduce-scatter) seconds of one FSDP unit of `numel` elements over its
    shard group: the 2-byte parameters gathered, the gradients reduced in the software's
    ``fsdp_reduce_bytes`` (a ring reduce-scatter moves what a ring all-gather does)."""
    g = r.L.fsdp_shard or r.L.dp * r.L.cp
    bw, lat = _ring_bw(r, g)
    return (_allgather_s(numel * GRAD_BYTES, g, bw, lat),
            _allgather_s(numel * r.sw.fsdp_reduce_bytes, g, bw, lat))


def _fsdp_s(r: _Run, st: _StageTime, u: FsdpUnits) -> tuple[float, float]:
    """(Seconds, of which hidden) per microbatch of FSDP's collectives, unit by unit as
    PyTorch runs them (Zhao et al. 2023; software.py): forward, the root and the first
    block gathered with nothing to hide under, then each block's gather under the block
    before it; backward (with ``fsdp_reshard_after_forward``), the last block's gather
    under the head's backward (nothing on a stage without the root), then under each
    block the next gather and the previous reduce-scatter together; the first block's
    and the root's reduce-scatters exposed at the end. A collective hides under at most
    DP_OVERLAP of a unit's compute (the model's one overlap constant); the recomputed
    forward of a checkpointed block is in its backward's compute (no third gather). The
    stage's compute is shared evenly over its blocks."""
    n = max(u.blocks, 1)
    ag, rs = fsdp_unit_seconds(r, u.block)
    ag_root, rs_root = fsdp_unit_seconds(r, u.root)
    hide = DP_OVERLAP if r.sw.dp_overlap else 0.0
    f, b = hide * st.fwd / n, hide * (st.b_in + st.b_w) / n
    exposed = ag_root + ag + (n - 1) * max(ag - f, 0.0)
    total = ag_root + n * ag + rs_root + n * rs
    if r.sw.fsdp_reshard_after_forward:
        total += n * ag
        exposed += max(ag - b, 0.0) if u.root else ag          # the last block's, under the head
        if n > 1:
            exposed += max(ag - b, 0.0)                         # under the last block: a gather
            exposed += max(ag + rs - b, 0.0) * (n - 2)          # under the middle ones: both
            exposed += max(rs - b, 0.0)                         # under the first: a reduce
    else:
        exposed += max(rs - b, 0.0) * (n - 1)
    exposed += rs + rs_root                                     # the first block's and the root's
    return total, total - exposed


def _bubble(r: _Run, st: _StageTime) -> float:
    """The pipeline bubble's fraction of the ideal time (analysis/bubble.py): zero bubble
    and the V schedules (ZB-V, DualPipe-V) split the backward into B (input gradients)
    and W (weight gradients) and price their bubble from the stage's times; the others'
    bubble does not depend on them."""
    L, kind = r.L, r.kind
    if kind in ("gpipe", "1f1b", "interleaved"):
        return bubble_fraction(kind, L.pp, r.m, L.vpp)
    return bubble_fraction(kind, L.pp, r.m, L.vpp, st.fwd, st.b_in, st.b_w)


def _optimizer_shard(L: PlannedLayout) -> int:
    """Ranks the optimizer states are sharded over: the FSDP group with ZeRO-3, the dp·cp
    ranks with the distributed optimizer (zero 1), none otherwise."""
    group = L.dp * L.cp
    return (L.fsdp_shard or group) if L.zero == 3 else (group if L.zero >= 1 else 1)


def _optimizer_s(c: Cluster, weights: float, shard: int) -> float:
    """Seconds of the optimizer step: memory-bound, OPTIMIZER_BYTES_PER_PARAM read and
    written per local parameter (of its shard), at ELEMENTWISE_BW_FRACTION of HBM."""
    return weights / shard * OPTIMIZER_BYTES_PER_PARAM / (c.hbm_bw * ELEMENTWISE_BW_FRACTION)


def _iteration_flops(r: _Run) -> tuple[float, float]:
    """(FLOPs an iteration counts, model FLOPs): PTD-P's Eq. 3 with full recomputation,
    the hardware FLOPs of the policy otherwise, and the model FLOPs (no recomputation) for
    the MFU; for other than GPT shapes, or a window, or packed documents (``doc_len``)
    :func:`~minitron.analysis.flops.transformer_flops_per_iteration`."""
    model, batch, rc, head_dim = r.model, r.global_batch, r.rc, r.head_dim
    gpt = _gpt_shapes(model, head_dim) and not model.window and not r.doc_len  # the papers' forms count s²
    docs = packed_rows(model.seq_len, r.doc_len) if r.doc_len else None
    if rc == "full":
        fl = (flops_per_iteration(model, batch, recompute=True) if gpt else
              transformer_flops_per_iteration(model, batch, "full", head_dim, documents=docs))
    else:
        fl = (hardware_flops_per_iteration(model, batch, rc) if gpt else
              transformer_flops_per_iteration(model, batch, rc, head_dim, documents=docs))
    mfu_flops = (model_flops_per_iteration(model, batch) if gpt else
                 transformer_flops_per_iteration(model, batch, "none", head_dim, documents=docs))
    return fl, mfu_flops


def _memory_bytes(r: _Run, weights: tuple[float, float], shard: int) -> float:
    """Peak bytes per GPU (:func:`~minitron.analysis.memory.memory_estimate`, for the s/cp
    tokens of a context rank). Beyond GPT shapes, with ZeRO or cp, the model states come
    from this rank's own weights (experts included, the activation estimate is the GPT
    block's): 2-byte weights and gradients whole, the rest (fp32 master and Adam moments)
    over the distributed optimizer's shard; ZeRO-3 shards all of it over its group."""
    model, L, bpp = r.model, r.L, r.bytes_per_param
    mem = memory_estimate(model.replace(seq_len=model.seq_len // L.cp), L, r.global_batch,
                          bytes_per_param=bpp, recompute=r.rc, flash=r.sw.attention == "flash")
    if _gpt_shapes(model, r.head_dim) and not L.zero and L.cp == 1:
        return mem["total_bytes"]
    w = weights[0] + weights[1]
    states = w * bpp / shard if L.zero == 3 else w * (4 + (bpp - 4) / shard)
    return mem["total_bytes"] - mem["params_bytes"] - mem["grads_bytes"] - mem["optimizer_bytes"] + states


def _parts_per_iteration(r: _Run, tm: _Times) -> dict:
    """The iteration's seconds per part, as :func:`~minitron.analysis.breakdown.explain`
    lists them: the slowest stage's work by kind and each axis's communication, exposed
    and hidden, over m microbatches; the bubble, the data-parallel reduction and the
    optimizer once per step."""
    m, st = r.m, tm.st
    per_iteration = {k: m * s for k, s in st.parts.items()}
    per_iteration.update(tp_comm=m * st.tp, tp_comm_hidden=m * st.tp_hidden, pp_comm=m * tm.pp,
                         pp_comm_hidden=m * tm.pp_hidden, cp_comm=m * st.cp, cp_comm_hidden=m * st.cp_hidden,
                         ep_comm=m * st.ep, ep_comm_hidden=m * st.ep_hidden,
                         fsdp_comm=m * (tm.fsdp - tm.fsdp_hidden), fsdp_comm_hidden=m * tm.fsdp_hidden,
                         host_wait=m * st.host_wait, bubble=tm.bubble, dp_comm=tm.dp - tm.dp_hidden,
                         dp_comm_hidden=tm.dp_hidden, optimizer=tm.optimizer)
    return per_iteration


def _breakdown(r: _Run, tm: _Times, mfu_flops: float) -> dict:
    """:attr:`Prediction.breakdown`: the iteration's seconds by part (and ``parts``, per
    kind of work), the software, recompute policy and kernels assumed, the slowest
    stage's (F, B, W), tokens per second per GPU and the MFU."""
    m, st, c, sw, model, it = r.m, tm.st, r.c, r.sw, r.model, tm.iteration_s
    dp_exposed = tm.dp - tm.dp_hidden
    return {"compute": m * (st.fwd + (st.b_in + st.b_w)), "tp_comm": m * st.tp, "pp_comm": m * tm.pp,
            "cp_comm": m * st.cp, "ep_comm": m * st.ep, "fsdp_comm": m * (tm.fsdp - tm.fsdp_hidden),
            "host_wait": m * st.host_wait,
            "bubble": tm.bubble, "dp_comm": tm.dp, "dp_comm_exposed": dp_exposed,
            "optimizer": tm.optimizer, "microbatches": m, "tp_comm_hidden": m * st.tp_hidden,
            "pp_comm_hidden": m * tm.pp_hidden, "dp_comm_hidden": tm.dp_hidden,
            "software": sw.name, "recompute": r.rc, "parts": _parts_per_iteration(r, tm), "fp8": r.fp8,
            "fp8_recipe": sw.fp8_recipe if r.fp8 else "",
            "kernels": _kernels_assumed(sw, c, r.head_dim or model.head_dim, r.fp8, model.seq_len // r.L.cp,
                                        _keys_said(r)),
            "stage_fbw": (st.fwd, st.b_in, st.b_w),
            "tokens_per_s_per_gpu": r.global_batch * model.seq_len / (r.L.world * it),
            "mfu": mfu_flops / (r.L.world * it * c.peak_flops)}


def _keys_said(r: _Run) -> str:
    """The attention's reach in words where it is not the whole sequence: the keys a query
    meets (:func:`attention_keys`), the window and its layers, the packed documents' length."""
    model = r.model
    if not model.window and not r.doc_len:
        return ""
    keys = sum(k * share for k, share in attention_keys(model, r.sw, r.doc_len).items())
    what = [f"window {model.window} on " + (f"the L layers of '{model.window_layers}'" if model.window_layers
                                            else "every layer")] if model.window else []
    what += [f"packed documents of {r.doc_len} tokens"] if r.doc_len else []
    return f"; {keys:.0f} keys per query of s = {model.seq_len} ({', '.join(what)})" if what else ""


def _kernels_assumed(sw: Software, c: Cluster, d: int, fp8: bool, seq: int, keys: str = "") -> dict:
    """{part group: the kernel a prediction assumes for it, and where its speed comes from;
    for the attention, the keys each query meets (`keys`)}."""
    if sw.attention == "flash":
        try:
            fig = (f"; its published figure at s = {seq}: {kernel_tflops(sw.kernel, c.gpu, d, seq):.0f} TFLOP/s "
                   f"forward, {kernel_tflops(sw.kernel, c.gpu, d, seq, 'bwd'):.0f} backward "
                   f"({kernel_source(sw.kernel, c.gpu, d)}), not priced")
        except ValueError:
            fig = f"; no published figures for it on {c.gpu}"
        att = f"{sw.kernel}, priced at the GEMM roofline" + fig
    else:
        att = (f"{sw.kernel}: QKᵀ and attention·V as GEMMs on the roofline, "
               f"{sw.attention_matrix_passes} passes over the score matrix (software.ATTENTION_MATRIX_PASSES)")
    e_max = c.fp8_gemm_max_efficiency if fp8 else c.gemm_e_max
    gemm = (f"cuBLAS GEMMs on a roofline, at most {e_max:.3f} of the {'FP8' if fp8 else '16-bit'} peak "
            + ("(fitted on published.H100_FITTING_RUNS)" if c.gemm_max_efficiency else "(GEMM_MAX_EFFICIENCY, cuBLAS)"))
    return {"attention": att + keys, "matmul": gemm,
            "elementwise": f"memory-bound at {ELEMENTWISE_BW_FRACTION} of HBM bandwidth (fitted on Megatron-LM 2019)"}


def _check_layout(model: ModelConfig, L: PlannedLayout, global_batch: int, kind: str) -> None:
    t, p, d, v, b = L.tp, L.pp, L.dp, L.vpp, L.microbatch_size
    if min(t, p, d, v, b, L.cp, L.ep) < 1:
        raise ValueError(f"tp, pp, dp, vpp, cp, ep and microbatch_size must be at least 1 (got {L})")
    if L.cp_mode not in PLANNED_CP_MODES:
        raise ValueError(f"unknown context-parallel kind '{L.cp_mode}': choose one of {', '.join(PLANNED_CP_MODES)}")
    if model.seq_len % (2 * L.cp) and L.cp > 1:
        raise ValueError(f"sequence {model.seq_len} does not split into 2·cp = {2 * L.cp} chunks")
    if L.cp > 1 and L.cp_mode == "a2a":  # what `train` refuses is never priced
        validate_a2a_heads(model, t, L.cp, flag="--cp-mode")
    if L.cp_mode == "usp" and not (1 < L.cp_a2a < L.cp and L.cp % L.cp_a2a == 0):
        raise ValueError(f"cp kind usp needs --cp-a2a U with 1 < U < --cp {L.cp} and U dividing it "
                         f"(got {L.cp_a2a})")
    if L.cp_mode == "usp":
        validate_a2a_heads(model, t, L.cp_a2a, flag="--cp-mode", mode="usp", over="--cp-a2a")
    if L.ep > 1 and (not model.experts or model.experts % L.ep or (t * L.cp * d) % L.ep):
        raise ValueError(f"expert parallel degree {L.ep} must divide the {model.experts} experts "
                         f"and the tp·cp·dp = {t * L.cp * d} ranks")
    if L.zero not in (0, 1, 3):
        raise ValueError(f"zero must be 0, 1 or 3 (got {L.zero})")
    if L.fsdp_shard and (L.zero != 3 or (d * L.cp) % L.fsdp_shard):
        raise ValueError(f"fsdp_shard {L.fsdp_shard} needs zero 3 and must divide dp·cp = {d * L.cp}")
    if model.heads % t or model.hidden % t:
        raise ValueError(f"tensor parallel degree {t} must divide {model.heads} heads and hidden {model.hidden}")
    kv = model.n_kv_heads
    if (kv % t if t <= kv else t % kv):
        raise ValueError(f"tensor parallel degree {t} and {kv} kv heads: one must divide the other "
                         f"(kv heads are split, or each replicated on t/kv ranks)")
    if p * v > model.layers:
        raise ValueError(f"pp*vpp = {p * v} model chunks but only {model.layers} layers")
    if global_batch % (d * b):
        raise ValueError(f"global batch {global_batch} is not divisible by dp*microbatch_size = {d}*{b}")
    if kind == "interleaved" and p > 1 and v > 1 and global_batch // (d * b) < p:
        # any m >= p: the microbatches go in groups of at least p (parallel/schedules.py)
        raise ValueError(f"interleaved schedule needs microbatches ({global_batch // (d * b)}) "
                         f"of at least pp = {p}")

