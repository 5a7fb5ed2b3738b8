"""The software stack as a value: what a training system fuses, recomputes and overlaps.

Two systems on the same GPUs can differ by a third in throughput because of their
software alone. The cluster model (:mod:`.cluster`) therefore takes a :class:`Software`
next to the hardware: which element-wise kernels are fused, how attention is computed,
which activations are recomputed, and which communication hides behind computation.
Everything here is data; :mod:`.cluster` prices it.

What the choices change in the model (per transformer layer; the backward of the
token-wise kernels moves twice the bytes of their forward, the attention matrix's
kernels are itemised both ways):

* **attention** — ``"unfused"`` (Megatron-LM 2019): scale, mask, softmax and dropout are
  four kernels, 8.5 passes over the b·a·s²/t attention matrix in 2-byte elements
  forward (the mask counted as half an element), 10 backward; ``"fused-softmax"``
  (PTD-P 2021, §4.2): one scale+mask+softmax kernel with implicit causal masking, which
  reads only the lower triangle, and the dropout: 4 passes forward, 4.5 backward;
  ``"flash"`` (Dao et al. 2022): the s×s matrix never
  leaves on-chip memory, no pass at all, but the backward recomputes QKᵀ, so the
  attention products cost 2.5× their forward in the backward instead of 2×;
* **flash_kernel** — which fused attention kernel a flash stack runs (FlashAttention-2,
  FlashAttention-3, cuDNN's fused attention, a Triton kernel): Transformer Engine's
  default on Hopper is cuDNN's (``megatron-core-2024``); ``current``, meant for any GPU
  from the A100 on, and PyTorch's ``scaled_dot_product_attention`` (``minitron``) run
  FlashAttention-2. Each is priced
  at the throughput its published kernel benchmark gives for the GPU, head width and
  sequence length (:func:`kernel_tflops`, :data:`KERNEL_BENCHMARKS`);
* **fused bias + dropout + residual add** (PTD-P §4.2) — after attention and after the
  MLP: unfused, bias add (2 passes of the b·s·h activation), dropout (2.5) and the
  residual add (3) are 7.5 passes each; fused, one kernel reads the input and the
  residual and writes the sum and the mask: 3.5;
* **no_transposes** — PTD-P's [s, b, a, h] layout (§4.2) feeds strided batched GEMMs
  directly; without it, the Q, K, V and context tensors are copied into head-major order
  (8 passes of b·s·h/t);
* **fused bias + GeLU** — a launch saved, no byte: the unfused bias is added by the GEMM
  (``addmm``) and the GeLU is one read and one write of b·s·4h either way;
* **recompute** — the default policy (``"none" | "selective" | "full"``; Korthikanti et
  al. 2022): full replays each layer's forward in the backward, selective only the
  attention core;
* **sequence_parallel** — whether the system runs sequence parallelism with tensor
  parallelism (Korthikanti et al. 2022); the planner gives it to every layout with t > 1
  (a layout passed to ``predict`` says for itself);
* **dp_overlap** — the data-parallel gradient reduction runs under the backward (bucketed,
  as PyTorch DDP does) rather than after the pipeline flush (Megatron-LM's own
  data-parallel wrapper of 2021–2022);
* **tp_overlap** — with sequence parallelism only: ``"backward"`` (Megatron-LM's
  sequence-parallel linear of 2022, the implementation of Korthikanti et al.: the
  column-parallel backward launches the re-gather of its saved input shard before the
  input-gradient GEMM, and the reduce-scatter of that gradient before the weight-gradient
  GEMM) hides the backward's collectives behind the matrix multiplies;
  ``"all"`` pipelines every tensor-parallel collective with its GEMM (Megatron-Core's
  userbuffer overlap, 2023); ``"async"``: PyTorch's async tensor parallelism as torchtitan
  runs it, priced from its decomposition (:data:`ASYNC_TP`: which collectives the compiler
  pass decomposes, and what each fused op leaves exposed); ``"none"``: all on the critical path;
* **pp_overlap** — pipeline sends and receives overlapped with compute (Megatron-Core's
  ``overlap_p2p_comm``) rather than blocking;
* **precision** — ``"fp16"`` or ``"bf16"``: both 2-byte activations and gradients on the
  wire; the choice is recorded, not priced differently;
* **fp8** — the linears' matrix multiplies (and the experts', and the logit layer's) run
  on the FP8 tensor cores (Transformer Engine, torchao float8) at the cluster's FP8 peak
  and its own achievable fraction, with 1-byte operands; the attention products, the
  element-wise kernels and the communication stay 16-bit; each linear's input and output
  gradient are cast (and transposed) to FP8, 4 bytes per element moved with ``fp8_recipe``
  "delayed", 6 with the recipes that scale from the tensor itself (tensorwise, rowwise, mxfp8:
  an amax pass first); the recipe names are the engine's own (``--fp8-recipe``). A cluster
  without an FP8 peak ignores it;
* **ep_overlap, ep_node_dedup** — the expert-parallel all-to-all: hidden under another
  microbatch's compute (Megatron-Core's ``overlap_moe_expert_parallel_comm``), and sent
  once per remote node rather than once per expert (DeepEP, HybridEP); both off in every
  preset, set per published run where its recipe states them;
* **moe_host_s** — seconds the host (the Python framework and the kernel launches it
  issues) takes to issue one mixture-of-experts layer's forward and backward for one
  microbatch, whatever its size. A GPU finishes a thin expert layer faster than that at
  a small microbatch, and then waits: the stage takes the longer of its GPU time and
  its host time. 0 (every preset): the host is never the limit; set per published run
  (a dropless Megatron-Core layer, whose dispatcher reads the token counts back to the
  host to size its buffers: ``cluster.DROPLESS_MOE_HOST_S``);
* **FSDP as PyTorch runs it** (``fsdp_reshard_after_forward``, ``fsdp_reduce_bytes``; Zhao et
  al. 2023, "PyTorch FSDP", §3.2–3.3 and §4; the FSDP and ``fully_shard`` documentation) —
  each unit (a transformer block; the root holds the embedding, final norm and head) is
  all-gathered before its forward and, with ``reshard_after_forward`` (FULL_SHARD, FSDP2's
  default), freed after it and gathered again before its backward; its gradients are
  reduce-scattered after its backward. The next unit's all-gather is issued while the
  current unit computes (FSDP1's rate limiter and FSDP2's all-gather buffers keep one
  unit in flight ahead: prefetch depth one), so the first unit's gather and the last
  unit's reduce-scatter have nothing to hide under; in the backward the next gather and
  the previous reduce-scatter share the link under one unit's compute. The root is not
  freed after the forward (its parameters are used first in the backward). A checkpointed
  unit's recomputed forward runs inside that unit's backward, whose pre-backward hook has
  already gathered its parameters (FSDP2 ``_pre_forward``: "When composing with
  module-hook-based activation checkpointing, the pre-backward hook is responsible for the
  unshard"): recomputation adds compute to hide under, not a third gather.
  ``fsdp_reduce_bytes``: 4 where the gradients are reduced in fp32 (torchtitan's
  ``mixed_precision_reduce = "float32"``; Composer's FSDP ``mixed_precision: DEFAULT``,
  reduce_dtype fp32), 2 where in bf16 (Megatron's default). Every microbatch gathers and
  reduces (gradient accumulation without ``no_sync``);
* **schedules, context_parallel, fsdp** — what the system can run beyond PTD-P's
  layouts: its pipeline schedules (PTD-P's 1F1B and interleaved; the zero-bubble and V
  schedules where it splits the backward into input and weight gradients), its
  context-parallel kinds, and whether it shards weights (FSDP / ZeRO-3). Only the
  planner reads them (it searches what the system runs); ``predict`` prices any layout.

How much of a collective an overlap hides is the one overlap constant of the cluster
model, ``DP_OVERLAP``, fitted on Megatron-LM 2019's data-parallel figure, except under
``tp_overlap="async"``, whose hidden share follows from its decomposition (t chunks, the
transfers against the chunks' matmuls); no constant is fitted to the runs the presets are
validated on.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from ..config import FP8_RECIPES

__all__ = ["Software", "SOFTWARE", "DEFAULT_SOFTWARE", "get_software", "ATTENTION_MATRIX_PASSES",
           "TOKEN_PASSES", "ASYNC_TP", "ASYNC_TP_SOURCES", "ATTENTION_KERNELS", "KERNEL_BENCHMARKS", "kernel_tflops", "kernel_source"]

ATTENTIONS = ("unfused", "fused-softmax", "flash")
TP_OVERLAPS = ("none", "backward", "all", "async")
PRECISIONS = ("fp16", "bf16")
RECOMPUTES = ("none", "selective", "full")

# (forward, backward) passes over the b·a·s²/t attention matrix (2-byte elements; a
# 1-byte mask is half a pass), by attention kind. Unfused forward: scale (read, write),
# mask (read, write, read the mask), softmax (read, write), dropout (read, write);
# backward: scale 2, mask 2.5, softmax (read the output and its gradient, write) 3,
# dropout (read the gradient and the mask, write) 2.5. Fused: one causal softmax kernel
# that loads only the lower triangle (read half, write: 1.5 forward; read half of the
# output and of its gradient, write: 2 backward) and the dropout (read, write, write the
# mask: 2.5; backward 2.5).
ATTENTION_MATRIX_PASSES = {"unfused": (8.5, 10.0), "fused-softmax": (4.0, 4.5), "flash": (0.0, 0.0)}
# Forward passes over b·s·h of the kernels around the two residual branches: two
# LayerNorms (read, write: 2 each) plus, twice, bias + dropout + residual add.
TOKEN_PASSES = {False: 4 + 2 * 7.5, True: 4 + 2 * 3.5}  # key: fused bias+dropout+add


# ---- async tensor parallelism (tp_overlap "async"): what torchtitan's stack decomposes ---
# torchtitan turns it on by setting torch._inductor.config._micro_pipeline_tp and enabling
# symmetric memory on the TP group (torchtitan/distributed/compile.py, _maybe_enable_async_tp);
# Inductor's micro_pipeline_tp_pass then rewrites two graph patterns, in the forward and the
# backward graph alike, into torch.distributed._symmetric_memory's fused ops:
#   * all-gather -> matmul (fuse_all_gather_matmul): the gathered tensor must be the matmul's
#     left operand, gathered along a row dimension ("Decomposing the matmul on the K dimension
#     is not supported"); several matmuls of one gathered input (wq, wk, wv; w1, w3) fuse as one;
#   * matmul -> reduce-scatter (fuse_matmul_reduce_scatter): the reduce-scatter's input must be
#     one matmul's output (_find_producer_matmul returns None for anything else, and the fusion
#     is skipped when the matmul's output has more than one user).
# So, per sequence-parallel layer: the forward's two gathers (before wq/wk/wv and w1/w3) and
# two reduce-scatters (after wo and w2) are decomposed; in the backward the row-parallel
# linears' output-gradient all-gathers feed dX = dZ·W as its left operand (decomposed), but the
# column-parallel linears' input gradient is a sum over wq, wk, wv (w1, w3) before its
# reduce-scatter, not a matmul (not decomposed), and the input gathered again for the weight
# gradient dW = dYᵀ·X is gathered along the contraction (not decomposed).
# What each fused op leaves on the critical path (torch/distributed/_symmetric_memory/
# __init__.py): _pipelined_all_gather_and_consume copies the local shard into its symmetric
# buffer and meets a barrier before the first matmul ("we are giving up the chance to overlap
# 'mv' and 'b' with the first shard_consumer"), consumes the local shard first and each peer's
# shard as its copy lands (t−1 copies, serialised: "cp from different streams cannot overlap"),
# and meets a barrier at the end; _pipelined_produce_and_all2all computes the t−1 peers' chunks
# first, each followed by a barrier, the peer's copy and a second barrier, then its own chunk,
# and fused_matmul_reduce_scatter sums the t partial chunks after it (reduce_partials: reads t
# chunks, writes one). The copies are plain tensor copies (``copy_``) from a peer's buffer on the
# GPU's streams, not NCCL kernels; how much they slow the matmuls beside them (SMs, memory
# traffic) no source read here states, so no contention is priced.
ASYNC_TP: dict = {
    # which of a layer's collectives are decomposed (the names cluster.py prices)
    "decomposed": {"gather": True, "scatter": True, "grad_gather": True, "grad_scatter": False,
                   "regather": False},
    "gather_copy_passes": 2,      # the local shard's copy into the symmetric buffer: read, write of x/t
    "gather_barriers": 3,         # at the start, after that copy, at the end
    "scatter_step_barriers": 2,   # each of the t−1 steps: before and after the peer's copy
    "scatter_barriers": 2,        # at the start, at the end
    "scatter_reduce_writes": 1,   # reduce_partials reads the t chunks of x/t and writes this many
}
ASYNC_TP_SOURCES = (
    "torchtitan torchtitan/distributed/compile.py (_maybe_enable_async_tp; github.com/pytorch/torchtitan)",
    "PyTorch torch/_inductor/fx_passes/micro_pipeline_tp.py (fuse_all_gather_matmul, fuse_matmul_reduce_scatter, "
    "_find_producer_matmul)",
    "PyTorch torch/distributed/_symmetric_memory/__init__.py (_pipelined_all_gather_and_consume, "
    "_pipelined_produce_and_all2all, _fused_matmul_reduce_scatter_impl, reduce_partials)",
)

# ---- attention kernels: published kernel benchmarks (never end-to-end runs) ------------
# Each stack names the attention kernel it runs; the two without a fused kernel are priced
# by their passes over the score matrix (ATTENTION_MATRIX_PASSES), the flash kernels by
# the throughput their authors published, in TFLOP/s counted as they count it (4·s²·d per
# head forward, half with a causal mask; the backward 2.5× the forward), by GPU, head
# width, causal mask and pass. Sources, each read off the figure's printed bar labels:
#   H100 forward: FlashAttention-3 (Shah et al. 2024, arXiv 2407.08608) Figure 5 (b), (d),
#     (f), "Forward, with causal mask", head dim 64 / 128 / 256, BF16, H100 80GB SXM5
#     (the flash-attention repository's assets/flash3_fp16_fwd.png);
#   H100 backward: the same paper's Figure 6, head dim 128, without causal mask (no causal
#     backward figure is published; Triton's backward is not in it);
#   A100: FlashAttention-2 (Dao 2023, arXiv 2307.08691) Figure "Attention forward +
#     backward speed (A100 80GB SXM4)", (c), (d): with causal mask, head dim 64 / 128
#     (assets/flash2_a100_fwd_bwd_benchmark.png), one figure for both passes.
ATTENTION_KERNELS = ("unfused", "fused-softmax", "flash-attention-2", "flash-attention-3", "cudnn", "triton")
_SEQS = (512, 1024, 2048, 4096, 8192, 16384)
_FA3_FWD = "FlashAttention-3 paper (arXiv 2407.08608) Fig. 5, forward, causal, head dim {d}, H100 SXM5"
_FA3_BWD = "FlashAttention-3 paper (arXiv 2407.08608) Fig. 6, backward, head dim 128 (not causal), H100 SXM5"
_FA2_A100 = "FlashAttention-2 paper (arXiv 2307.08691) Fig. forward+backward, causal, head dim {d}, A100 SXM4"
# (kernel, GPU, head dim, pass) -> (TFLOP/s at _SEQS, source); pass "fwd", "bwd" or "fwd+bwd"
KERNEL_BENCHMARKS: dict[tuple, tuple[tuple[float, ...], str]] = {
    ("flash-attention-2", "H100-SXM5-80GB", 64, "fwd"): ((180, 229, 262, 284, 295, 299), _FA3_FWD.format(d=64)),
    ("triton", "H100-SXM5-80GB", 64, "fwd"): ((152, 291, 342, 363, 378, 363), _FA3_FWD.format(d=64)),
    ("cudnn", "H100-SXM5-80GB", 64, "fwd"): ((225, 288, 334, 363, 379, 388), _FA3_FWD.format(d=64)),
    ("flash-attention-3", "H100-SXM5-80GB", 64, "fwd"): ((197, 265, 371, 420, 460, 473), _FA3_FWD.format(d=64)),
    ("flash-attention-2", "H100-SXM5-80GB", 128, "fwd"): ((191, 260, 298, 319, 333, 335), _FA3_FWD.format(d=128)),
    ("triton", "H100-SXM5-80GB", 128, "fwd"): ((146, 273, 323, 353, 369, 378), _FA3_FWD.format(d=128)),
    ("cudnn", "H100-SXM5-80GB", 128, "fwd"): ((315, 410, 484, 518, 529, 539), _FA3_FWD.format(d=128)),
    ("flash-attention-3", "H100-SXM5-80GB", 128, "fwd"): ((292, 423, 521, 579, 602, 616), _FA3_FWD.format(d=128)),
    ("flash-attention-2", "H100-SXM5-80GB", 256, "fwd"): ((208, 251, 278, 293, 297, 298), _FA3_FWD.format(d=256)),
    ("cudnn", "H100-SXM5-80GB", 256, "fwd"): ((308, 391, 450, 483, 497, 509), _FA3_FWD.format(d=256)),
    ("flash-attention-3", "H100-SXM5-80GB", 256, "fwd"): ((286, 427, 537, 612, 628, 642), _FA3_FWD.format(d=256)),
    ("flash-attention-2", "H100-SXM5-80GB", 128, "bwd"): ((214, 260, 291, 310, 318, 322), _FA3_BWD),
    ("cudnn", "H100-SXM5-80GB", 128, "bwd"): ((305, 408, 465, 499, 518, 516), _FA3_BWD),
    ("flash-attention-3", "H100-SXM5-80GB", 128, "bwd"): ((316, 424, 501, 542, 559, 561), _FA3_BWD),
    ("flash-attention-2", "A100-SXM4-80GB", 64, "fwd+bwd"): ((88, 119, 140, 156, 165, 171), _FA2_A100.format(d=64)),
    ("flash-attention-2", "A100-SXM4-80GB", 128, "fwd+bwd"): ((99, 133, 155, 173, 182, 189), _FA2_A100.format(d=128)),
}


def _series(kernel: str, gpu: str, head_dim: int, kind: str) -> tuple[tuple, tuple, str]:
    """The published series for a pass: (seqs, TFLOP/s, source) at the nearest published
    head width; a forward or backward figure, else the forward+backward one. ValueError
    (one line) when the GPU has none for the kernel."""
    for pass_ in (kind, "fwd+bwd"):
        widths = [d for (k, g, d, p) in KERNEL_BENCHMARKS if (k, g, p) == (kernel, gpu, pass_)]
        if widths:
            d = min(widths, key=lambda w: (abs(w - head_dim), w))
            tflops, source = KERNEL_BENCHMARKS[kernel, gpu, d, pass_]
            return _SEQS, tflops, source
    known = sorted({g for (k, g, _, _) in KERNEL_BENCHMARKS if k == kernel}) or ["none"]
    raise ValueError(f"no published {kind} figures for the {kernel} attention kernel on {gpu} (it has them for "
                     f"{', '.join(known)}): choose a software stack whose kernel runs there")


def _least_squares(xs: list, ys: list) -> tuple[float, float, float]:
    """(a, b, worst relative error of 1/(a + b·x) against 1/y) of the line y = a + b·x."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    return a, b, max(abs(y / (a + b * x) - 1) for x, y in zip(xs, ys))


@lru_cache(maxsize=None)
def _fit(seqs: tuple, tflops: tuple) -> tuple[float, float, float]:
    """(a, b, n) of 1/T = a + b·s⁻ⁿ fitted on the published points: a kernel's throughput
    rising with sequence length to 1/a; a and b by least squares on 1/T for each n of
    0.5, 0.6, … 3.0, the n of the smallest worst error kept."""
    fits = []
    for n in (k / 10 for k in range(5, 31)):
        a, b, worst = _least_squares([s ** -n for s in seqs], [1 / t for t in tflops])
        fits.append((worst, a, b, n))
    _, a, b, n = min(fits)
    return a, b, n


def kernel_tflops(kernel: str, gpu: str, head_dim: int, seq: float, kind: str = "fwd") -> float:
    """TFLOP/s of an attention kernel's `kind` pass ("fwd" or "bwd") on `gpu` at a causal
    sequence of `seq` tokens: the curve fitted to its published benchmark (kernel
    measurements only, :data:`KERNEL_BENCHMARKS`), held flat past the longest published
    length."""
    seqs, tflops, _ = _series(kernel, gpu, head_dim, kind)
    a, b, n = _fit(seqs, tflops)
    return 1 / (a + b * min(seq, seqs[-1]) ** -n)


def kernel_source(kernel: str, gpu: str, head_dim: int, kind: str = "fwd") -> str:
    """Where the figures :func:`kernel_tflops` is fitted to come from."""
    return _series(kernel, gpu, head_dim, kind)[2]


@dataclass(frozen=True)
class Software:
    """One training system's software: kernels, recomputation, overlap, precision.

    See the module docstring for what each field changes in the cluster model.
    """

    name: str
    summary: str
    attention: str = "unfused"
    fused_bias_gelu: bool = False
    fused_bias_dropout_add: bool = False
    no_transposes: bool = False
    recompute: str = "full"
    sequence_parallel: bool = False
    dp_overlap: bool = True
    tp_overlap: str = "none"
    pp_overlap: bool = False
    precision: str = "fp16"
    fp8: bool = False
    # how FP8 scales are found, by the engine's recipe names: "delayed" (from an amax history,
    # Transformer Engine's and NeMo 2024's default), "tensorwise" (current scaling: a pass over
    # each tensor first, the Bridge's FP8-CS), "rowwise", "mxfp8" (Blackwell's blocks of 32)
    fp8_recipe: str = "delayed"
    # Megatron-Core's overlap_moe_expert_parallel_comm (the Bridge recipes' moe_a2a_overlap):
    # one microbatch's dispatch/combine all-to-alls run under another's compute
    ep_overlap: bool = False
    # a node-aware dispatcher (DeepEP's normal kernels, Megatron's HybridEP flex backend):
    # a token crosses the network once per remote node that holds any of its k experts and
    # fans out over NVLink there, instead of once per expert
    ep_node_dedup: bool = False
    # host seconds to issue one MoE layer's forward and backward per microbatch (0: never the limit)
    moe_host_s: float = 0.0
    # what the system runs beyond PTD-P's layouts (the planner searches these; `predict`
    # prices any layout it is given): pipeline schedules, context-parallel kinds, FSDP
    schedules: tuple[str, ...] = ("1f1b", "interleaved")
    context_parallel: tuple[str, ...] = ()
    fsdp: bool = False
    # the flash kernel when `attention` is "flash" (ATTENTION_KERNELS), priced from its
    # published benchmarks (kernel_tflops); the `kernel` property names the one run
    flash_kernel: str = "flash-attention-2"
    # FSDP / ZeRO-3 (zero 3) as the stack runs it (module docstring): whether a unit is
    # freed after its forward and gathered again for its backward, and the bytes of a
    # reduce-scattered gradient element (4: reduced in fp32)
    fsdp_reshard_after_forward: bool = True
    fsdp_reduce_bytes: int = 2

    @property
    def kernel(self) -> str:
        """The attention kernel this stack runs: "unfused", "fused-softmax" or its flash kernel."""
        return self.flash_kernel if self.attention == "flash" else self.attention

    def __post_init__(self):
        if self.flash_kernel not in ATTENTION_KERNELS[2:]:
            raise ValueError(f"software '{self.name}': flash_kernel must be one of "
                             f"{', '.join(ATTENTION_KERNELS[2:])} (got '{self.flash_kernel}')")
        for field, value, allowed in (("attention", self.attention, ATTENTIONS),
                                      ("tp_overlap", self.tp_overlap, TP_OVERLAPS),
                                      ("precision", self.precision, PRECISIONS),
                                      ("recompute", self.recompute, RECOMPUTES),
                                      ("fp8_recipe", self.fp8_recipe, FP8_RECIPES)):
            if value not in allowed:
                raise ValueError(f"software '{self.name}': {field} must be one of "
                                 f"{', '.join(allowed)} (got '{value}')")
        if self.fsdp_reduce_bytes not in (2, 4):
            raise ValueError(f"software '{self.name}': fsdp_reduce_bytes must be 2 (bf16) or 4 (fp32) "
                             f"(got {self.fsdp_reduce_bytes})")
        if self.moe_host_s < 0:
            raise ValueError(f"software '{self.name}': moe_host_s must be at least 0 seconds (got {self.moe_host_s})")

    @property
    def attention_matrix_passes(self) -> tuple[float, float]:
        """(Forward, backward) passes over the attention matrix (ATTENTION_MATRIX_PASSES)."""
        return ATTENTION_MATRIX_PASSES[self.attention]

    @property
    def token_passes(self) -> float:
        """Forward passes over b·s·h by the LayerNorms and residual-branch kernels."""
        return TOKEN_PASSES[self.fused_bias_dropout_add]

    @property
    def reshape_passes(self) -> float:
        """Forward passes over b·s·h/t copying Q, K, V and the context into head-major order."""
        return 0.0 if self.no_transposes else 8.0

    @property
    def attention_backward_ratio(self) -> float:
        """Backward cost of the attention products over their forward: 2 (two input
        gradients each), 2.5 with flash attention (QKᵀ recomputed on chip)."""
        return 2.5 if self.attention == "flash" else 2.0

    def replace(self, **kw) -> "Software":
        """A copy with some fields changed (for what-if questions)."""
        return replace(self, **kw)


SOFTWARE: dict[str, Software] = {
    "megatron-2019": Software(
        "megatron-2019", "Megatron-LM 2019 (Shoeybi et al.): unfused kernels, full recomputation, "
        "data-parallel all-reduce overlapped with backward; the calibration's software",
        attention="unfused", recompute="full", dp_overlap=True),
    "ptdp-2021": Software(
        "ptdp-2021", "PTD-P (Narayanan et al. 2021, §4.2): the [s, b, a, h] layout without "
        "transposes, fused scale+mask+softmax, bias+GeLU and bias+dropout+add; full recomputation; gradients all-reduced after the pipeline flush",
        attention="fused-softmax", fused_bias_gelu=True, fused_bias_dropout_add=True,
        no_transposes=True, recompute="full", dp_overlap=False),
    "korthikanti-2022": Software(
        "korthikanti-2022", "Korthikanti et al. 2022: PTD-P's kernels, selective recomputation, "
        "the backward's sequence-parallel all-gathers and reduce-scatters overlapped with the backward GEMMs",
        attention="fused-softmax", fused_bias_gelu=True, fused_bias_dropout_add=True,
        no_transposes=True, recompute="selective", sequence_parallel=True, dp_overlap=False,
        tp_overlap="backward", precision="bf16"),
    "current": Software(
        "current", "a current stack (Megatron-Core with Transformer Engine): flash attention, fused "
        "kernels, selective recomputation, data-parallel, tensor-parallel and pipeline "
        "communication overlapped", attention="flash", fused_bias_gelu=True,
        fused_bias_dropout_add=True, no_transposes=True, recompute="selective", sequence_parallel=True,
        dp_overlap=True, tp_overlap="all",
        pp_overlap=True, precision="bf16", flash_kernel="flash-attention-2"),
    "megatron-core-2024": Software(
        "megatron-core-2024", "Megatron-Core / NeMo of 2024-2025 on H100 (the NeMo and Megatron-Bridge "
        "performance tables): Transformer Engine's flash attention and fused kernels, no "
        "recomputation, distributed optimizer, tensor-, data-, pipeline- and context-parallel "
        "communication overlapped", attention="flash", fused_bias_gelu=True, fused_bias_dropout_add=True,
        no_transposes=True, recompute="none", sequence_parallel=True, dp_overlap=True, tp_overlap="all",
        pp_overlap=True, precision="bf16", context_parallel=("ring", "allgather", "a2a"), fsdp=True,
        flash_kernel="cudnn"),
    "llm-foundry-2023": Software(
        "llm-foundry-2023", "MosaicML llm-foundry / Composer of 2023 (the MPT benchmark tables): PyTorch FSDP "
        "FULL_SHARD (gradients reduced in fp32, mixed_precision DEFAULT), MPT's Triton flash attention, eager "
        "PyTorch element-wise kernels, activation checkpointing per run", attention="flash", recompute="none",
        dp_overlap=True, precision="bf16", fsdp=True, flash_kernel="triton", fsdp_reduce_bytes=4),
    "torchtitan-2024": Software(
        "torchtitan-2024", "torchtitan of December 2024 (its H100 benchmark tables): FSDP2 (fully_shard, "
        "gradients reduced in fp32), scaled_dot_product_attention's FlashAttention-2 kernel, sequence-parallel "
        "TP, all-gather context parallelism; torch.compile, Float8 and async TP per run", attention="flash",
        recompute="none", sequence_parallel=True, dp_overlap=True, precision="bf16",
        schedules=("1f1b", "interleaved"), context_parallel=("allgather",), fsdp=True,
        flash_kernel="flash-attention-2", fsdp_reduce_bytes=4),
    "minitron": Software(
        "minitron", "minitron on GPUs: flash attention (scaled_dot_product_attention), unfused "
        "element-wise kernels (eager PyTorch), bucketed data-parallel all-reduce overlapped "
        "with backward, blocking tensor- and pipeline-parallel communication",
        attention="flash", recompute="none", dp_overlap=True, precision="bf16",
        schedules=("1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe-v"),
        context_parallel=("ring", "a2a", "usp"),
        fsdp=True, flash_kernel="flash-attention-2"),
}


# The stack predictions assume unless told otherwise: the calibration's. Name the
# system you mean (`ptdp-2021` for PTD-P's runs, `current` for a stack of today).
DEFAULT_SOFTWARE = "megatron-2019"


def get_software(software: "str | Software | None") -> Software:
    """A Software, or the named preset of :data:`SOFTWARE` (None: :data:`DEFAULT_SOFTWARE`);
    ValueError listing the presets for an unknown name."""
    if software is None:
        return SOFTWARE[DEFAULT_SOFTWARE]
    if isinstance(software, Software):
        return software
    if software not in SOFTWARE:
        raise ValueError(f"unknown software '{software}': choose one of {', '.join(SOFTWARE)}")
    return SOFTWARE[software]
