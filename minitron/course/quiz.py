"""Graded questions for the lessons.

A lesson asks a question in a markdown cell and grades the learner's answer in the next
code cell::

    from minitron.course.quiz import check
    check("02.bubble_1f1b", ...)        # replace ... with your answer, then run the cell

`check` prints ``right`` or ``wrong — <hint>``; `grade` returns (right?, message). The answers
live here, not in the notebooks; where an answer is a figure the engine can compute, it
is computed by calling the engine (the analysis functions, the process grid), so the
question and the engine can never disagree.

Answers are graded by their kind:

* an integer (a count, a rank, a number of GPUs) exactly: off by one is wrong;
* a figure that is measured, rounded or a fraction within the relative tolerance its question
  states (``rel_tol``; every non-integer question states one);
* words (a choice) without case, spaces, hyphens or underscores, against accepted spellings;
* lists element by element, in order; sets (a frozenset, e.g. the ranks of a group) in any order.

A number may be written as text: thousands separators (``"1,280"``), a per cent sign for a
fraction or a percentage (``"43.75%"``), or another unit of the question's kind (``"12 MB"``
where the question asks for bytes, ``"12.9B"`` where it asks for billions of parameters): it
is converted to the question's ``unit``. ``True`` and ``False`` are not numbers.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Question:
    """One graded question: how to compute its answer, and the hint a wrong answer gets.

    `answer` is a callable returning the right answer (an int, graded exactly; a float,
    graded within `rel_tol`, which such a question must state; a list, a frozenset, or a
    tuple of accepted words); `unit` is the answer's unit (a key of :data:`UNITS`, or
    ``"fraction"``: a per cent sign divides by 100), to which an answer written with
    another unit of the same kind is converted.
    """

    answer: Callable[[], Any]
    hint: str
    rel_tol: float = 0.0
    unit: str = ""


def _best_microbatch(global_batch: int) -> int:
    """Lesson 6: the microbatch size of PTD-P's 91B model with the most TFLOP/s in the
    engine's simulator (minitron.course.ptdp.microbatch_sweep)."""
    from .ptdp import GPT_91B, microbatch_sweep
    return max(microbatch_sweep(GPT_91B, global_batch), key=lambda r: r["tflops_per_gpu"])["b"]


def _host_wait_pct(run_id: str) -> float:
    """Lesson 11: the per cent of a published H100 run's predicted iteration the GPU waits
    for its host (minitron.analysis.published)."""
    from ..analysis import published as P
    pred = P.h100_run_prediction(P.h100_run(run_id))[1]
    return 100 * pred.breakdown["parts"]["host_wait"] / pred.iteration_s


def _tensorwise_scale(amax: float) -> float:
    """Lesson 7: the engine's tensorwise E4M3 scale of a tensor whose amax is `amax`."""
    import torch

    from ..parallel import fp8
    return float(fp8.amax_to_scale(torch.tensor(amax), fp8.RECIPES["tensorwise"].forward))


def _mx_scales(rows: int, cols: int) -> int:
    """Lesson 7: the E8M0 scales MXFP8 keeps for a [rows, cols] operand (blocks along cols)."""
    from ..config import MX_BLOCK
    return rows * cols // MX_BLOCK


def _A():
    from .. import analysis
    return analysis


def _preset(name):
    from ..config import PRESETS
    return PRESETS[name]


def _grid(**kw):
    from ..grid import ProcessGrid
    return ProcessGrid(**kw)


def _interval():
    """Lesson 8: Young/Daly's checkpoint interval and the published failure rates."""
    from ..analysis import checkpoint_interval
    return checkpoint_interval


def _quorum_rows(global_batch: int, replicas: int, quorum: list[int]) -> int:
    """Lesson 8: the rows a fault-tolerant step averages when `quorum` took part (the replay's weights)."""
    from ..fault_tolerance import step_weights
    return int(step_weights(global_batch, replicas, {0: quorum})(0).count_nonzero())


def _whole(x: float) -> int:
    """A count the engine computes as a float (an exact whole number), graded as an integer."""
    if not float(x).is_integer():
        raise ValueError(f"{x} is not a whole number: this answer is not a count")
    return int(x)


def _words(*accepted: str) -> Callable[[], tuple[str, ...]]:
    return lambda: tuple(accepted)


def _gpus_for_states(name: str, bytes_per_param: float, gpu_bytes: float) -> int:
    return math.ceil(_A().param_count(_preset(name)) * bytes_per_param / gpu_bytes)


def _dp_wire_ratio(n_params: int, d: int) -> float:
    from ..analysis.data_parallel import dp_wire_bytes
    return dp_wire_bytes(n_params, d, zero1=True) / dp_wire_bytes(n_params, d)


def _tp_sent_bytes(overlap: bool, t: int = 4) -> float:
    """Lesson 4: the tensor-parallel bytes a rank of the tiny model sends per step under
    ``--tp t --sp`` (float64, b = 2), with or without ``--tp-overlap`` (the analysis)."""
    from ..analysis.calls import sent_bytes_by_axis
    from ..analysis.comm import comm_items
    from ..config import ParallelConfig, TrainConfig
    items = comm_items(_preset("tiny"), ParallelConfig(tp=t, sp=True, tp_overlap=overlap),
                       TrainConfig(global_batch=2, dtype="float64"))
    return sent_bytes_by_axis([it for it in items if it["axis"] == "tp"], {"tp": t})["tp"]


def _sp_entry_backward() -> tuple[str]:
    """Lesson 4: the collective a block's entry makes in the backward pass under sequence
    parallelism (f's place: the all-gather of the sequence shards forward), read off a dry
    run of one `tiny` block at ``--tp 2 --sp``: the block's backward ends at its entry."""
    from ..analysis.dry_run import dry_trace
    from ..config import ParallelConfig
    records = dry_trace(_preset("tiny"), ParallelConfig(tp=2, sp=True), 2, layer_ids=[0],
                        first=False, last=False).records
    return ([r["op"] for r in records if r["phase"] == "bwd"][-1],)


def _tp_layer_all_reduces(recompute: str) -> int:
    """Lesson 4: the all-reduces one layer of `tiny` makes per microbatch at ``--tp 2``
    (forward and backward) under `recompute`, read off the model by the analysis's dry run."""
    from ..analysis.comm import comm_items
    from ..config import ParallelConfig, TrainConfig
    tiny = _preset("tiny")
    items = comm_items(tiny, ParallelConfig(tp=2, recompute=recompute), TrainConfig(global_batch=2))
    calls = sum(it["calls"] for it in items if it["what"] == "transformer layers" and it["op"] == "all_reduce")
    return calls // tiny.layers


def _naive_output_ranks(q: int) -> int:
    from .tp_schemes import cube_placements
    rows = cube_placements(q, q * q, 4, 4 * q * q, 4 * q * q)["naive"]
    return sum(1 for row in rows.values() if row["output"] > 0)


def _fewest_bytes_scheme(devices: int) -> str:
    from .tp_schemes import BIAN_SHAPE, scheme_rows
    rows = [r for r in scheme_rows(*BIAN_SHAPE, devices) if r["feasible"]]
    return min(rows, key=lambda r: r["layer_wire_bytes"])["scheme"]


def _overlap_bound(devices: int, scheme: str) -> float:
    """Lesson 5: the largest share of a tensor-parallel scheme's layer time (Bian et al.'s
    Longhorn GPUs, the cost model) that overlapping communication with computation could
    hide: its compute."""
    from ..analysis.tp_schemes import project_tp_schemes
    from .tp_schemes import BIAN_SHAPE
    r = next(r for r in project_tp_schemes(*BIAN_SHAPE, devices) if r["scheme"] == scheme)
    return r["compute_s"] / r["layer_s"]


def _checkpoints(name: str, micro_batch: int, layers: int, tp: int) -> int:
    from .ptdp import checkpoint_spacing
    return checkpoint_spacing(_preset(name), micro_batch, layers, tp=tp)["best_c"]


def _forwards_before_first_backward(p: int, v: int, m: int, rank: int) -> int:
    """What the engine's interleaved schedule runs on `rank` before its first backward:
    the warm-up forwards and the steady state's first forward."""
    from ..parallel.schedules import make_schedule
    ops = [a.op for a in make_schedule("interleaved", p, v, m).compute_actions(rank)]
    return ops[:ops.index("B")].count("F")


def _model_mfu_of_eq3(name: str, tflops: float, peak: float) -> float:
    """A throughput counted with PTD-P's Eq. 3 (full recomputation: hardware FLOPs) as
    model FLOPs utilization: scaled by model FLOPs / Eq. 3 FLOPs, over the peak."""
    m = _preset(name)
    return tflops * _A().model_flops_per_iteration(m, 1) / _A().flops_per_iteration(m, 1) / peak


def _model_flops_per_token(name: str, seq_len: int) -> float:
    """Lesson 7: the model FLOPs of one training token of preset `name` at context `seq_len`."""
    m = _preset(name).replace(seq_len=seq_len)
    return _A().model_flops_per_iteration(m, 1) / m.seq_len


def _layers_hfu_over_mfu(name: str, seq_len: int, recompute: str) -> float:
    """Lesson 7: hardware FLOPs over model FLOPs of preset `name` at context `seq_len` under
    `recompute`, the logit layer left out (it is never replayed)."""
    m = _preset(name).replace(seq_len=seq_len)
    logits = 3 * _A().logit_forward_flops(1, m.seq_len, m.hidden, m.vocab)
    return (_A().hardware_flops_per_iteration(m, 1, recompute) - logits) / (_A().model_flops_per_iteration(m, 1) - logits)


def _ptdp_175b_tflops() -> float:
    """PTD-P §5.2: GPT-3 175B's TFLOP/s per A100 on its fewest GPUs (384), counted with Eq. 3."""
    from ..analysis.published import PTDP_GPT3_175B
    return min(PTDP_GPT3_175B)[1]


QUESTIONS: dict[str, Question] = {
    # --- lesson 0: collectives ---------------------------------------------------------
    "00.all_reduce": Question(
        lambda: sum(range(1, 9)),
        "an all-reduce leaves the *sum* of every rank's value on every rank: 1 + 2 + ... + 8."),
    "00.ring_steps": Question(
        lambda: 2 * (8 - 1),
        "a ring all-reduce is a reduce-scatter (p − 1 steps) followed by an all-gather "
        "(p − 1 steps)."),
    "00.ring_bytes": Question(
        lambda: _A().ring_allreduce_wire_bytes(8e6, 4),
        "each rank sends 2·(p − 1)/p of its buffer: (p − 1) chunks of size N/p in each "
        "of the two phases.", rel_tol=1e-3, unit="B"),
    "00.dp_group": Question(
        lambda: frozenset(_grid(tp=2, dp=4).axis_ranks("dp", 5)),
        "the tensor-parallel index runs fastest: rank = tp_rank + t·dp_rank. Keep rank 5's "
        "tp_rank and vary dp_rank over all d."),
    "00.latency_bound": Question(
        _words("alpha", "α", "latency"),
        "for a tiny message the n·β term is negligible: what is left is the per-step cost."),
    # --- lesson 1: memory and FLOPs ----------------------------------------------------
    "01.bytes_per_param": Question(
        lambda: _A().zero_bytes_per_param(0, 1) * 7.5e9 / 1e9,
        "count fp16 parameters, fp16 gradients, and Adam's fp32 master weights, momentum "
        "and variance per parameter (ZeRO §3.1), times 7.5 billion.", rel_tol=1e-3, unit="GB"),
    "01.gpus_175b": Question(
        lambda: _gpus_for_states("gpt3-175b", 18, 80e9),
        "divide 18 bytes × the exact parameter count (param_count) by 80 GB, and round *up*: "
        "a fraction of a GPU is a whole GPU."),
    "01.zero3_d128": Question(
        lambda: _A().zero_bytes_per_param(3, 128),
        "stage 3 shards all 16 bytes of every parameter over the d data-parallel ranks.", rel_tol=1e-3, unit="B"),
    "01.full_recompute": Question(
        lambda: _A().korthikanti_activation_bytes_per_layer(4096, 1, 8192, 64, 8,
                                                             recompute="full") / 2**20,
        "full recomputation keeps only the layer's input: s·b·h values of 2 bytes each.", rel_tol=1e-3, unit="MiB"),
    # --- lesson 2: pipeline schedules --------------------------------------------------
    "02.bubble_1f1b": Question(
        lambda: _A().bubble_fraction("1f1b", 8, 16),
        "1F1B's bubble is (p − 1)/m of the ideal time, whatever the order of its work.", rel_tol=1e-2,
        unit="fraction"),  # 0.4375 or 0.44 (two digits)
    "02.bubble_interleaved": Question(
        lambda: _A().bubble_fraction("interleaved", 8, 16, 2),
        "interleaving with v chunks per rank divides the bubble by v: (p − 1)/(v·m).", rel_tol=1e-2,
        unit="fraction"),  # 0.21875 or 0.22
    "02.stash_gpipe": Question(
        lambda: _whole(_A().peak_stashed_microbatches("gpipe", 8, 16)),
        "GPipe runs every forward before the first backward."),
    "02.warmup": Question(
        lambda: _forwards_before_first_backward(8, 2, 16, 0),
        "rank 0 first runs its (p − r − 1)·2 + (v − 1)·p warm-up forwards (p = 8, v = 2, r = 0); "
        "the steady state then starts with a forward, and only after it the first backward."),
    "02.zbv_idle": Question(
        lambda: _whole(_A().bubble_time("zb-v", 8, 16, 2, 2, 2, 2)),  # stage times: two chunks of 1
        "with F = B = W ZB-V idles only while the pipeline fills: the last rank's first "
        "forward starts p − 1 chunk-forwards late."),
    # --- lesson 3: data parallelism ----------------------------------------------------
    "03.ring_wire": Question(
        lambda: _A().ring_allreduce_wire_bytes(4e9, 8) / 1e9,
        "a ring all-reduce sends 2·(d − 1)/d times the buffer from every rank.", rel_tol=1e-3, unit="GB"),
    "03.zero1_over_allreduce": Question(
        lambda: _dp_wire_ratio(10**6, 8),
        "a reduce-scatter and an all-gather are exactly the two halves of a ring all-reduce.", rel_tol=1e-3),
    "03.zero1_bytes": Question(
        lambda: _A().zero_bytes_per_param(1, 16),
        "stage 1 shards only Adam's 12 bytes: 2 + 2 + 12/d.", rel_tol=1e-3, unit="B"),
    # --- lesson 4: tensor parallelism --------------------------------------------------
    "04.f_backward": Question(
        _sp_entry_backward,
        "the entry's forward all-gathers the sequence shards; its backward is the conjugate: each "
        "rank holds a partial gradient of the whole sequence and keeps the sum over its own shard."),
    "04.allreduces_per_layer": Question(
        lambda: _tp_layer_all_reduces("full"),
        "one g after attention and one after the MLP in forward, the matching f's in backward, "
        "and the replayed forward's two g's again inside the backward."),
    "04.ce_allreduces": Question(
        lambda: 3,
        "the cross-entropy needs the largest logit, the target logit and the sum of the "
        "exponentials — each over the whole vocabulary."),
    "04.max_t": Question(
        lambda: 16,
        "count the GPUs that share one server's NVLink: a DGX-2's NVSwitches join all sixteen (a DGX "
        "A100's eight); beyond them the tensor group's all-reduces would cross the network."),
    "04.overlap_sends": Question(
        lambda: 8 - 1,
        "a ring moves one shard per step, and each rank starts with its own: the others arrive "
        "one by one."),
    "04.overlap_bytes_ratio": Question(
        lambda: _tp_sent_bytes(True) / _tp_sent_bytes(False),
        "count what leaves a rank: a ring of t − 1 shards of N/t against a ring all-gather of N.",
        rel_tol=1e-3),
    "04.ring_shard": Question(
        lambda: (5 - 2) % 8,
        "at step k a rank holds the shard that has come k places round the ring, from rank "
        "(r − k) mod t."),
    # --- lesson 5: 3-D tensor parallelism ----------------------------------------------
    "05.devices": Question(
        lambda: 4 ** 3,
        "the cube has q ranks along each of its three axes."),
    "05.vector_copies": Question(
        lambda: 4 ** 2,
        "a bias is split q ways along one axis of the cube; each piece is replicated on the "
        "plane of the two other axes."),
    "05.min_batch": Question(
        lambda: 3 ** 2,
        "the batch is split over two axes of the cube (i and a) into whole sequences."),
    "05.linear_collectives": Question(
        lambda: 6,
        "forward: gather X, gather W, reduce-scatter Y; backward: gather dY, reduce-scatter "
        "dX, reduce-scatter dW."),
    "05.naive_output_ranks": Question(
        lambda: _naive_output_ranks(2),
        "the partial products are reduced along k onto one plane of the cube: q² of the q³ ranks."),
    "05.fewest_bytes_64": Question(
        lambda: (_fewest_bytes_scheme(64),),
        "compare the 'sent per microbatch' column of section 6: activations shrink with the "
        "grid, and the cube splits them over all three axes."),
    "05.overlap_bound": Question(
        lambda: _overlap_bound(64, "2.5d"),
        "overlap hides communication behind computation, so it can hide at most the compute "
        "time: compare the layer's compute with its total.", rel_tol=0.05, unit="fraction"),  # the lesson prints 3.6%
    # --- lesson 6: PTD-P -----------------------------------------------------------------
    "06.rank_of": Question(
        lambda: _grid(tp=4, dp=2, pp=2).rank_of(tp=1, dp=1, pp=1),
        "rank = tp_rank + t·dp_rank + t·d·pp_rank."),
    "06.gpus_1t": Question(
        lambda: 8 * 64 * 12,
        "n = t · p · d."),
    "06.bubble_dp": Question(
        lambda: (64 / 16 - 1) / (1024 / 16),
        "with n GPUs, d-way data parallelism leaves p = n/d stages and b′/d microbatches "
        "per pipeline: the bubble is (n/d − 1)/(b′/d).", rel_tol=5e-3, unit="fraction"),  # the table: 3 decimals
    "06.checkpoints": Question(
        lambda: _checkpoints("gpt3-175b", 1, 48, 8),
        "minimise c·A_input + (l/c)·A_intermediate: c* = sqrt(l·A_intermediate/A_input), then "
        "try the whole numbers on either side."),
    "06.zero3_state_gb": Question(
        lambda: 16 * _A().param_count(_preset("gpt3-175b")) / 1536 / 1e9,
        "ZeRO-3 shards all 16 bytes per parameter over the d GPUs: 16·Ψ/d.", rel_tol=1e-2, unit="GB"),
    "06.microbatch_b2048": Question(
        lambda: _best_microbatch(2048),
        "a larger b runs each sequence a little faster (the ms per sequence column) but leaves "
        "fewer microbatches, m = B/b, and the bubble (p − 1)/m grows with b: weigh the two at "
        "B = 2048, where the bubble costs less than at 512."),
    # --- lesson 7: performance -----------------------------------------------------------
    "07.hfu_over_mfu": Question(
        lambda: _layers_hfu_over_mfu("gpt-1.3b", 8192, "selective"),
        "selective recomputation replays the attention core, 4Bs²h per layer, on top of the model's "
        "72Bsh²(1 + s/6h): the ratio is 1 + (s/18h)/(1 + s/6h), at s = 4h.", rel_tol=5e-3),
    "07.mfu": Question(
        lambda: _model_mfu_of_eq3("gpt3-175b", _ptdp_175b_tflops() * 1e12, 312e12),
        "PTD-P counted its TFLOP/s with Eq. 3, which includes the recomputed forward (the 96): "
        "that is a hardware-FLOPs rate (HFU 153/312). Scale it by model FLOPs / Eq. 3 FLOPs "
        "(about 72/96) before dividing by the peak.", rel_tol=1e-2, unit="fraction"),
    "07.flops_per_token": Question(
        lambda: _model_flops_per_token("gpt-1.3b", 8192) / 1e9,
        "72·l·h²·(1 + s/6h + V/12lh) per token: the attention term s/6h grows with the context, "
        "four times the preset's at s = 8192.", rel_tol=0.1, unit="GFLOP"),
    "07.fusion_passes": Question(
        lambda: (3 * 2) // 2,
        "count the passes over memory: each eager kernel reads its input and writes its output "
        "(three kernels: six); the fused kernel reads x once and writes once (two)."),
    "07.fp8_tp_scale": Question(
        lambda: _whole(_tensorwise_scale(max(0.5, 2.0))),
        "the scale is the whole tensor's: its amax is the MAX over the shards (an all-reduce over "
        "'tp'), and both ranks quantize with max_E4M3 / amax, not with their own shard's max."),
    "07.mx_scales": Question(
        lambda: _mx_scales(4096, 4096),
        "MXFP8 keeps one E8M0 scale per block of 32 consecutive elements along the reduction dim: "
        "count the blocks of the whole weight (not one per row, not one per tensor)."),
    "07.fp8_amdahl": Question(
        lambda: 1 / ((1 - 0.4) + 0.4 / 2),
        "Amdahl's law: only the GEMMs' share f = 0.4 runs k = 2 times faster; the step takes "
        "(1 - f) + f / k of its time, and the speed-up is the inverse.", rel_tol=1e-2),
    "07.fp8_gather_bytes": Question(
        lambda: 2 * 12_582_912 // 4,
        "each all-gather takes the rank's shard, n/d elements of 1 byte (E4M3), and ZeRO-3 gathers "
        "a block before its forward and again before its backward; the scales' all-reduce is a few "
        "bytes on top."),
    # --- lesson 8: scaling runs ----------------------------------------------------------
    "08.weak_efficiency": Question(
        lambda: _sweep_efficiency("weak", "dp4", 10e-3, 12.5e-3),
        "weak scaling keeps the work per rank fixed, so the ideal step time is the one-rank "
        "time: efficiency = t(1 rank) / t(n ranks).", rel_tol=1e-3, unit="fraction"),
    "08.strong_efficiency": Question(
        lambda: _sweep_efficiency("strong", "dp4", 10e-3, 4e-3),
        "strong scaling keeps the global batch fixed, so the ideal is t(1)/n: efficiency = "
        "t(1) / (n · t(n)).", rel_tol=1e-3, unit="fraction"),
    "08.oversubscription": Question(
        lambda: _whole(_predicted_compute_s("tiny", "dp8", 1, cores=2, flops_per_s=1e9)
                       / _predicted_compute_s("tiny", "dp8", 1, cores=8, flops_per_s=1e9)),
        "ranks beyond the cores take turns: each of 8 single-threaded ranks gets 2/8 of a core, "
        "so its compute takes 8/2 times as long."),
    "08.bubble_pp2": Question(
        lambda: _A().bubble_fraction("1f1b", 2, 2),
        "the 1F1B bubble is (p − 1)/m of the ideal time.", rel_tol=1e-3, unit="fraction"),
    "08.compute_ms": Question(
        lambda: _predicted_compute_s("tiny", "dp4", 8, cores=2, flops_per_s=4e9) * 1e3,
        "the step's model FLOPs of a global batch of 32 shared by 4 ranks at 4 GFLOP/s, times 4/2: "
        "four ranks take turns on two cores.", rel_tol=1e-2, unit="ms"),
    "08.ft_mtbf_h": Question(
        lambda: _interval().LLAMA3_405B.mtbf_s(4096) / 3600,
        "failures are independent per GPU: a quarter of the GPUs fails a quarter as often, so the "
        "MTBF is the run's 54 days / 419 times 16,384 / 4,096.", rel_tol=1e-2, unit="h"),
    "08.young_daly_min": Question(
        lambda: _interval().young_daly_interval_s(30.0, 2 * 3600.0) / 60,
        "Young's interval is √(2·δ·M), with δ and M in the same unit: √(2 · 30 s · 7,200 s).",
        rel_tol=1e-2, unit="min"),
    "08.quorum_rows": Question(
        lambda: int(_quorum_rows(64, 4, [0, 2, 3])),
        "each replica averages its own B/R rows and the quorum averages the replicas: the step is the "
        "mean over the rows of the replicas in it, 3 of 4 shares of 64."),
    # --- lesson 9: context parallelism ---------------------------------------------------
    "09.chunks": Question(
        lambda: frozenset(_chunks(4, 1)),
        "the sequence is cut into 2N chunks and rank r holds chunk r and its mirror, 2N − 1 − r."),
    "09.lse": Question(
        lambda: math.log(math.exp(2.0) + math.exp(2.0)),
        "L' = log(e^L + e^L_b): two blocks of equal mass double it, so L' = L + log 2.", rel_tol=1e-3),
    "09.ring_messages": Question(
        lambda: 3 * (4 - 1),
        "forward: N − 1 hops of K, V; backward: N − 1 hops of K, V again and N − 1 of the "
        "accumulated dK, dV."),
    "09.message_mib": Question(
        lambda: _cp_message_elements(_preset("gpt-1.3b").replace(seq_len=32768), 1, 1, 8) * 2 / 2**20,
        "one message is K and V of the rank's s/N tokens over its h/t columns: 2·b·(s/N)·(h/t) "
        "elements of 2 bytes.", rel_tol=1e-3, unit="MiB"),
    "09.separator_document": Question(
        lambda: ("ends", "the one it ends", "it ends", "previous", "the previous one", "its own"),
        "a document is its tokens and the separator that ends it: the token after a separator starts the "
        "next one (the separator's target is the next document's first token, given no loss)."),
    "09.packed_positions": Question(
        lambda: _packed_positions("xy|z||uv"),
        "positions restart at 0 with each document, and a document ends with its separator: "
        "x y | is one document, z | the next, the lone | a third."),
    "09.skipped_pairs": Question(
        lambda: _skipped_pairs([5, 3, 4, 4], 2),
        "a causal pair (query chunk a after key chunk b) is empty when the document of chunk b's last "
        "token ends before chunk a begins; count those among the pairs with a ≥ b."),
    "09.window_core_share": Question(
        lambda: _window_core_share(_mistral_7b().replace(seq_len=65536)),
        "the window runs the blocks of beta = 4096 keys in reach: each query block meets its own and the one "
        "before it, 2·s/beta − 1 block pairs of beta² against the global core's s².", rel_tol=1e-2, unit="fraction"),
    "09.window_hops": Question(
        lambda: sum(_chunk_mask(4, 4, 8).reach.values()),
        "chunk b is seen by the query chunks b .. b + ceil((W − 1)/c), held by ranks a or 2N − 1 − a; a chunk "
        "travels (holder − owner) mod N steps to the farthest of them: add them over the 8 chunks."),
    "09.rope_kept": Question(
        lambda: _rope_kept(_preset("llama3-8b").replace(rope_base=10000.0, rope_scaling="llama3",
                                                        rope_original_context=4096)),
        "a pair keeps its frequency when its wavelength 2π·base^(2i/d) is shorter than L/high_freq_factor "
        "= 4096/4 tokens: count the pairs i < 64 below it."),
    "09.usp_message_mib": Question(
        lambda: _usp_ring_message_mib(_preset("llama3-70b").replace(seq_len=131072), 8, 16, 2),
        "a message of the ring over R carries s/R tokens on max(kv_t, U)/U kv heads: b·(s/N)·max(kv_t, U)·(dk + dv) "
        "elements of 2 bytes; at t = 8 a rank holds one kv head, which the all-to-all copies to both ranks of "
        "its row.", rel_tol=1e-3, unit="MiB"),
    "09.usp_largest_u": Question(
        lambda: _usp_largest_a2a(_preset("llama3-8b").replace(hidden=3584, heads=28, kv_heads=4), 1, 16, 8),
        "U must divide cp and the 28 query heads per tensor rank, the 4 kv heads must divide U or be divided by "
        "it, and t·U ranks must fit in a node of 8: 7 splits the queries but not the kv heads."),
    "09.usp_ring_sends": Question(
        lambda: _usp_ring_sends(8, 2),
        "the ring runs over R = N/U ranks: R − 1 hops of K, V forward, R − 1 of K, V and R − 1 of dK, dV "
        "backward, 3(R − 1) sends."),
    # --- lesson 10: modern blocks under parallelism ----------------------------------------
    "10.kv_rows": Question(
        lambda: 2 * _kv_heads_per_rank(_preset("llama3-70b"), 4) * _preset("llama3-70b").head_dim,
        "a rank holds max(kv/t, 1) whole kv heads, each of 2·d rows (k and v): at t = 4, kv/t of them."),
    "10.kv_copies": Question(
        lambda: max(1, 32 // _preset("llama3-70b").n_kv_heads),
        "each kv head is copied onto the t/kv neighbouring ranks that hold its query heads; its "
        "gradient is summed over exactly those copies."),
    "10.swiglu_params": Question(
        lambda: 3 * _preset("llama3-70b").hidden * _preset("llama3-70b").ffn_hidden,
        "SwiGLU has three h x f matrices: gate, up and down (no biases)."),
    "10.cp_position": Question(
        lambda: _chunks(4, 1)[1] * (128 // (2 * 4)),
        "the sequence is cut into 2N chunks of s/(2N) tokens; rank r's second chunk is 2N − 1 − r (not 2r + 1)."),
    "10.kv_saved_per_element": Question(
        lambda: _whole(_saved_per_kv_element()),
        "count the storages autograd keeps: the rotated k, and v's view pinning the whole [k|v] "
        "projection output."),
    # --- lesson 11: mixture of experts and expert parallelism ------------------------------
    "11.mixtral_active": Question(
        lambda: _active_params(_preset("mixtral-8x7b").replace(top_k=1)) / 1e9,
        "every dense weight plus, in each MoE block, the router and k = 1 of the 8 experts: the "
        "total less 7 experts per layer.", rel_tol=1e-2, unit="billion"),  # top-1, not the published top-2
    "11.capacity": Question(
        lambda: _capacity(_preset("mixtral-8x7b").replace(capacity_factor=1.25), 4096),
        "C = ceil(k·T·cf/E) with k = 2, E = 8."),
    "11.collapsed_aux": Question(
        lambda: _collapsed_aux(64),
        "α·E·Σ f_i·P_i with f = P = 1 on one expert and 0 elsewhere is α·E.", rel_tol=1e-3),
    "11.a2a_mib": Question(
        lambda: _balanced_a2a(_preset("mixtral-8x7b"), 4096, 2) / 2**20,
        "dispatch and combine, forward and backward: 4 passes of T·k rows of h elements, plus the "
        "E int64 counts: 8E + 2(S + R)·h·b with S = R = T·k.", rel_tol=1e-3, unit="MiB"),
    "11.host_wait_pct": Question(
        lambda: _host_wait_pct("bridge-qwen3-30b-a3b-2602"),
        "the prediction's part 'host_wait' over its iteration time, in per cent: per microbatch the host "
        "needs 48 layers × 8.8 ms, and the GPU waits for what its own work does not cover.", rel_tol=1e-2,
        unit="%"),
    "11.mla_cache_kib": Question(
        lambda: _kv_cache_bytes(_preset("deepseek-v2-lite"), 2) / 2**10,
        "latent attention caches the latent and the one shared rotary key per token and layer, "
        "(kv_lora_rank + qk_rope_head_dim) elements, over every layer, 2 bytes each: not the heads' "
        "decompressed keys and values.", rel_tol=1e-2, unit="KiB"),
    "11.mtp_flops_pct": Question(
        lambda: 100 * (_step_flops(_preset("deepseek-v2-lite").replace(mtp_depths=1))
                       / _step_flops(_preset("deepseek-v2-lite")) - 1),
        "model_flops_per_step with mtp_depths=1 over the same without, less 1, in per cent: a depth is "
        "the projection M_k, one dense block and the shared output layer, against 27 layers and the head.",
        rel_tol=2e-2, unit="%"),
    "11.ib_bytes_max": Question(
        lambda: _preset("deepseek-v3").topk_groups * _preset("deepseek-v3").hidden * 2,
        "at most M = 4 nodes, all of them other than the token's own: one copy of its h = 7168 bf16 "
        "values per node, whatever its k = 8 experts.", unit="bytes"),
    "11.ep_overlap_calls": Question(
        lambda: _ep_all_to_all(ep_overlap=True)["calls"],
        "per MoE block and microbatch the counts' all-to-all once and dispatch and combine, forward and "
        "backward, each in two halves: 1 + 4·2 = 9, times 3 blocks and 2 microbatches (the gradient "
        "norm's all-reduce is no all-to-all)."),
    "11.ep_overlap_bytes": Question(
        lambda: _ep_all_to_all(ep_overlap=True)["bytes"],
        "the halves carry the whole call's rows and the counts go once, so the bytes are the plain "
        "layout's: per block and microbatch 8E + 4·T·k·h·b with T = 32 tokens, k = 2, h = 32, b = 4.",
        unit="bytes"),
    # --- lesson 12: PyTorch's native APIs ---------------------------------------------------
    "12.fsdp2_gathers": Question(
        lambda: 8 * (1 + 2 * 24),
        "with fully_shard on every block and on the root, each microbatch gathers the root once (kept "
        "from its forward to its backward, freed after it) and every block twice: before its forward "
        "and before its backward."),
    "12.zero3_gathers": Question(
        lambda: _zero3_gathers(24, 8),
        "minitron gathers the root once per step and keeps it to the end; every block is gathered "
        "before its forward and again before its backward, in every microbatch."),
    "12.tp_all_reduces": Question(
        lambda: 4 * 24,
        "each block has two row-wise linears (an all-reduce of the output in the forward: g) and two "
        "column-wise ones (an all-reduce of the input's gradient in the backward: f)."),
    "12.colwise_dim": Question(
        lambda: 1,
        "colwise splits the output features: an nn.Linear stores them as its weight's rows "
        "([out, in]), an nn.Embedding as its columns ([num_embeddings, embedding_dim])."),
}


def _active_params(model) -> int:
    """Active parameters: the built model's count (the dry run) less, per MoE block, the
    E − k experts a token does not use and the selection bias (it only picks)."""
    from ..analysis.dry_run import model_params
    from ..analysis.experts import moe_blocks, moe_layer_params
    one = moe_layer_params(model)["experts"] // model.experts
    return model_params(model) - len(moe_blocks(model)) * ((model.experts - model.top_k) * one + model.experts)


def _ep_all_to_all(ep_overlap: bool) -> dict:
    """Lesson 11: the analysis' ep all-to-all item (calls, bytes) of one step of moe-tiny with
    3 MoE blocks on ep 4, 2 microbatches of one sequence per rank, float32."""
    from ..analysis.comm import comm_items
    from ..config import ParallelConfig, TrainConfig
    items = comm_items(_preset("moe-tiny").replace(layers=3), ParallelConfig(ep=4, ep_overlap=ep_overlap),
                       TrainConfig(global_batch=8, microbatches=2))
    (a2a,) = [it for it in items if it["axis"] == "ep" and it["op"] == "all_to_all"]
    return a2a


def _capacity(model, tokens: int) -> int:
    from ..moe import capacity
    return capacity(model, tokens)


def _collapsed_aux(experts: int) -> float:
    """The balancing loss / α of top-1 routing with every token on expert 0 at score 1."""
    import torch
    from ..config import ModelConfig
    from ..moe import balancing_loss
    cfg = ModelConfig(experts=experts, top_k=1, aux_loss=1.0)
    scores = torch.zeros(16, experts, dtype=torch.float64)
    scores[:, 0] = 1.0
    return float(balancing_loss(scores, torch.zeros(16, 1, dtype=torch.long), cfg))


def _kv_cache_bytes(model, dtype_bytes: int) -> int:
    from ..analysis.kv_cache import kv_cache_bytes_per_token
    return kv_cache_bytes_per_token(model, dtype_bytes)


def _step_flops(model) -> float:
    from ..model_flops import model_flops_per_step
    return model_flops_per_step(model, 1)


def _balanced_a2a(model, tokens: int, dtype_bytes: int) -> float:
    from ..analysis.experts import balanced_all_to_all_bytes
    return balanced_all_to_all_bytes(model, tokens, dtype_bytes)


def _cp_message_elements(model, b: int, tp: int, cp: int) -> int:
    from ..analysis.context_parallel import cp_message_elements
    return cp_message_elements(model, b, tp, cp)


def _kv_heads_per_rank(model, tp: int) -> int:
    from ..analysis.context_parallel import kv_heads_per_rank
    return kv_heads_per_rank(model, tp)


def _saved_per_kv_element() -> float:
    """Elements a Llama block saves per token and key/value element, from the dry run: one
    kv head fewer on llama-small."""
    from ..analysis.dry_run import block_saved_bytes
    from ..config import ParallelConfig
    m = _preset("llama-small")
    fewer = block_saved_bytes(m.replace(kv_heads=m.n_kv_heads - 1), ParallelConfig(), 1, 4)
    return (block_saved_bytes(m, ParallelConfig(), 1, 4) - fewer) / (4 * m.seq_len * m.head_dim)


def _predicted_compute_s(name: str, layout: str, base_batch: int, cores: int, flops_per_s: float) -> float:
    """Lesson 8: the compute part the local throughput model predicts for one point of a weak
    series of preset `name` on a machine of `cores` cores at a one-rank rate of `flops_per_s`."""
    from ..tools.sweep import MachineProfile, parse_layout, point_config, predict_step
    model, lay = _preset(name), parse_layout(layout)
    machine = MachineProfile("the question's", cores, flops_per_s, name)
    return predict_step(model, lay, point_config(model, lay, "weak", base_batch, 1, 1), machine, [])["compute_s"]


def _sweep_efficiency(series: str, layout: str, one_rank_step_s: float, step_s: float) -> float:
    """Lesson 8: the efficiency `minitron sweep` reports for a point of `series` that took
    `step_s` where one rank took `one_rank_step_s` (``tools.sweep.finish_row``)."""
    from ..tools.sweep import finish_row, parse_layout, point_config
    model, lay = _preset("tiny"), parse_layout(layout)
    row = finish_row({"calls_per_rank": [], "step_s": step_s}, model, lay, point_config(model, lay, series, 4, 1, 1),
                     series, None, one_rank_step_s)
    return row["efficiency"]


def _window_core_share(model) -> float:
    """Lesson 9: the FLOPs of the windowed attention core over the global core's (model_flops)."""
    from ..model_flops import attention_core_flops
    q = model.heads * model.head_dim
    return attention_core_flops(model, 0, q) / attention_core_flops(model.replace(window=0), 0, q)


def _mistral_7b():
    from .context_parallel import MISTRAL_7B
    return MISTRAL_7B


def _chunk_mask(n: int, c: int, window: int):
    from ..parallel.context_parallel import ChunkMask
    return ChunkMask(n, c, window)


def _rope_kept(model) -> int:
    """Lesson 9: the frequency pairs Llama 3.1's rope scaling leaves unchanged (rope.py)."""
    from ..rope import default_inv_freq, rope_frequencies
    return int((rope_frequencies(model)[0] == default_inv_freq(model.head_dim, model.rope_base)).sum())


def _zero3_gathers(layers: int, microbatches: int) -> int:
    """Lesson 12: the all-gathers of one ``--zero 3`` step of `tiny` with `layers` blocks on 2
    data ranks, from the analysis' calls (``analysis.zero.zero_calls``, which a trace equals)."""
    from ..analysis.zero import zero_calls
    from ..config import ParallelConfig, TrainConfig
    calls = zero_calls(_preset("tiny").replace(layers=layers), ParallelConfig(dp=2, zero=3),
                       TrainConfig(global_batch=2 * microbatches, microbatches=microbatches))
    return sum(c["calls"] for c in calls if c["op"] == "all_gather")


def _chunks(n: int, r: int) -> tuple[int, int]:
    from ..parallel.context_parallel import chunk_ids
    return chunk_ids(n, r)


def _packed_positions(row: str) -> list[int]:
    """Lesson 9: the positions in their documents of the tokens of `row` ('|' the separator)."""
    import torch

    from ..packing import SEPARATOR_BYTE, Documents
    x = torch.tensor([[SEPARATOR_BYTE if ch == "|" else ord(ch) for ch in row]])
    return Documents.of(x, SEPARATOR_BYTE).positions[0].tolist()


def _usp_ring_message_mib(model, tp: int, cp: int, u: int) -> float:
    """Lesson 9: one message of USP's ring (one sequence, bf16): the all-to-all's K, V of the
    rank's s/N tokens, max(kv_t, U) heads (analysis.context_parallel.a2a_elements)."""
    from ..analysis.context_parallel import a2a_elements
    return a2a_elements(model, 1, tp, cp, u)["kv"] * 2 / 2**20


def _usp_largest_a2a(model, tp: int, cp: int, gpus_per_node: int) -> int:
    from .context_parallel import largest_a2a
    return largest_a2a(model, tp, cp, gpus_per_node)


def _usp_ring_sends(cp: int, u: int) -> int:
    """Lesson 9: the sends on 'cp_ring' per layer and microbatch of one training step under
    USP (the engine's analysis, usp_comm_items, of a one-sequence step divided by the layers)."""
    from ..analysis.context_parallel import usp_comm_items
    from ..config import PRESETS, ParallelConfig, TrainConfig
    model = PRESETS["llama-tiny"].replace(seq_len=64)
    items = usp_comm_items(model, ParallelConfig(cp=cp, cp_mode="usp", cp_a2a=u), TrainConfig(global_batch=1))
    return sum(i["calls"] for i in items if i["axis"] == "cp_ring" and i["op"] == "send") // model.layers


def _skipped_pairs(lengths: list[int], n: int) -> int:
    """Lesson 9: the causal chunk pairs the ring skips for one row of documents of `lengths`
    under cp `n` (the engine's ChunkMask)."""
    import torch

    from ..packing import Documents
    from ..parallel.context_parallel import ChunkMask
    seg = torch.cat([torch.full((k,), i) for i, k in enumerate(lengths)])[None]
    docs = Documents(seg, torch.zeros_like(seg), torch.ones_like(seg, dtype=torch.float64))
    c = seg.shape[1] // (2 * n)
    rule, causal = ChunkMask(n, c, 0, docs), ChunkMask(n, c)
    return sum(rule.kinds[ab] == "none" for ab, kind in causal.kinds.items() if kind != "none")


def _norm_word(s: str) -> str:
    return "".join(ch for ch in str(s).lower() if ch not in " -_")


# units an answer may be written in, by kind, in their base unit (bytes, seconds, FLOPs, a count)
UNITS = {
    "bytes": {"B": 1, "kB": 1e3, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
              "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "bytes": 1, "byte": 1},
    "seconds": {"s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9, "min": 60, "h": 3600},
    "flops": {"FLOP": 1, "kFLOP": 1e3, "MFLOP": 1e6, "GFLOP": 1e9, "TFLOP": 1e12, "PFLOP": 1e15},
    "count": {"thousand": 1e3, "k": 1e3, "K": 1e3, "million": 1e6, "M": 1e6, "billion": 1e9, "B": 1e9, "bn": 1e9,
              "G": 1e9, "trillion": 1e12, "T": 1e12},
}
_NUMBER = re.compile(r"^([-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?(?:[eE][-+]?\d+)?|[-+]?\.\d+)\s*(.*)$")


def _kind(unit: str) -> dict:
    return next((table for table in UNITS.values() if unit in table), {})


def parse_number(given: Any, unit: str = "") -> float | None:
    """`given` as a number in `unit`: a number, or text with thousands separators, a per cent
    sign (for a ``"fraction"`` or ``"%"`` question) or a unit of the question's kind. None
    when it is not a number (a boolean is not), or written in a unit of another kind."""
    if isinstance(given, bool) or given is None:
        return None
    if isinstance(given, (int, float)):
        return float(given)
    if not isinstance(given, str):
        try:
            return None if isinstance(given.item(), bool) else float(given.item())  # a 0-d tensor or array
        except (AttributeError, TypeError, ValueError):
            return None
    m = _NUMBER.match(given.strip().replace("\u2009", "").replace("\u202f", "").replace("_", ""))
    if m is None:
        return None
    value, suffix = float(m.group(1).replace(",", "")), m.group(2).strip().rstrip(".")
    if suffix in ("", unit):
        return value
    if suffix == "%":
        return value / 100 if unit == "fraction" else value if unit == "%" else None
    table = _kind(unit)
    scale = table.get(suffix, table.get(suffix.split("/")[0].split(" ")[0]))
    return value * scale / table[unit] if scale else None


def _matches(given: Any, right: Any, rel_tol: float, unit: str = "") -> bool:
    if isinstance(right, tuple):  # accepted spellings of a word
        return isinstance(given, str) and _norm_word(given) in {_norm_word(w) for w in right}
    if isinstance(right, frozenset):  # a set: the same elements, in any order
        if isinstance(given, (str, bytes)):
            return False
        try:
            given = sorted(given, key=float)
            return isinstance(given, list) and _matches(given, sorted(right, key=float), rel_tol)
        except (TypeError, ValueError):
            return False
    if isinstance(right, list):
        try:
            return len(given) == len(right) and all(_matches(g, r, rel_tol) for g, r in zip(given, right))
        except TypeError:
            return False
    g = parse_number(given, unit)
    if g is None:
        return False
    if isinstance(right, int):  # a count: exactly
        return g == right
    return math.isclose(g, float(right), rel_tol=rel_tol, abs_tol=1e-12)


def grade(question_id: str, answer: Any) -> tuple[bool, str]:
    """(right?, message) for `answer` to the question `question_id`."""
    if question_id not in QUESTIONS:
        raise KeyError(f"no question {question_id!r}; the questions are {sorted(QUESTIONS)}")
    q = QUESTIONS[question_id]
    if answer is Ellipsis:
        return False, "no answer yet — replace ... with your answer and run the cell again"
    right = q.answer()
    if isinstance(answer, bool) and not isinstance(right, tuple):
        return False, "wrong — True and False are not numbers here: give the number itself"
    if _matches(answer, right, q.rel_tol, q.unit):
        return True, "right"
    return False, f"wrong — {q.hint}"


def check(question_id: str, answer: Any) -> None:
    """Grade `answer` to the question `question_id`: print ``right`` or ``wrong — <hint>``
    (:func:`grade` returns the verdict instead)."""
    print(grade(question_id, answer)[1])


def questions(lesson: str | None = None) -> list[str]:
    """The question ids, all or those of one lesson (``"03"``)."""
    return sorted(q for q in QUESTIONS if lesson is None or q.split(".")[0] == lesson)
