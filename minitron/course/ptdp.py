"""PTD-P's analytical takeaways, measured on the engine, and two of its comparisons
computed with the engine's analysis (lesson 6).

Takeaway 3 of Narayanan et al. 2021 (§3.4): with a global batch of B sequences, microbatches
of b sequences and p pipeline stages, the time of one batch through a pipeline is

    (B/b + p − 1) · (t_f(b) + t_b(b))

where t_f(b) and t_b(b) are the forward and backward time of one microbatch on one stage.
Larger b uses the hardware better (t(b)/b falls) but makes fewer microbatches and so a
larger bubble (p − 1 of them). :func:`time_microbatch` measures t_f and t_b on the engine's
own GPT; :func:`pipeline_batch_time` evaluates the formula; :func:`microbatch_sweep`
times it on a GPU cluster in the engine's schedule simulator, for PTD-P's 91B model of
Fig. 16 (:data:`GPT_91B`).

Activation checkpoint spacing (§3.5): a stage of l layers that keeps c checkpoints (the
input of every (l/c)-th layer) and, during the backward, rebuilds one segment of l/c
layers at a time holds ``c·A_input + (l/c)·A_intermediate``, smallest at
``c* = sqrt(l·A_intermediate / A_input)``. :func:`checkpoint_spacing` takes A_input and
A_intermediate from :func:`minitron.analysis.memory.activation_bytes_per_layer` (full
recomputation keeps the layer input; no recomputation keeps everything).

PTD-P against ZeRO-3 (§5.2): :func:`zero3_prediction` prices ZeRO-3 without model
parallelism with the cluster model (:mod:`minitron.analysis.cluster`) plus its
parameter all-gathers, which the cluster model does not express (module notes there);
:func:`ptdp_vs_zero3` puts both beside the paper's Table 2.
"""
from __future__ import annotations

import math
import time

import torch

from ..config import ModelConfig
from ..context import Context
from ..model import GPT


def time_microbatch(model: ModelConfig, sizes=(1, 2, 4, 8), repeats: int = 3, seed: int = 0) -> list[dict]:
    """Seconds of one forward (t_f) and one backward (t_b) of the engine's GPT on a
    microbatch of b sequences, for each b in `sizes` (the fastest of `repeats`, after a
    warm-up): ``[{b, t_f, t_b}]``."""
    gpt = GPT(model, Context(dtype=torch.float32))
    g = torch.Generator().manual_seed(seed)
    rows = []
    for b in sizes:
        x = torch.randint(0, model.vocab, (b, model.seq_len), generator=g)
        y = torch.randint(0, model.vocab, (b, model.seq_len), generator=g)
        best_f = best_b = float("inf")
        for k in range(repeats + 1):
            t0 = time.perf_counter()
            loss = gpt(x, y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            gpt.zero_grad(set_to_none=True)
            if k:  # the first pass warms up
                best_f, best_b = min(best_f, t1 - t0), min(best_b, t2 - t1)
        rows.append({"b": b, "t_f": best_f, "t_b": best_b})
    return rows


def pipeline_batch_time(global_batch: int, b: int, p: int, t_f: float, t_b: float) -> float:
    """PTD-P §3.4: ``(B/b + p − 1) · (t_f(b) + t_b(b))``, the time of a batch of B
    sequences in microbatches of b through p stages."""
    return (global_batch / b + p - 1) * (t_f + t_b)


# PTD-P's 91B GPT of Fig. 16 (§5): the paper gives 91 billion parameters, (t, p) = (8, 8) on
# 64 A100s, not the shape; this one (h = 10240 and 80 heads as its 76.1B, 72 layers: 9
# per stage) has 91.2B by Eq. 2
GPT_91B = ModelConfig(layers=72, hidden=10240, heads=80, seq_len=2048, vocab=51200, name="gpt-91b")


def microbatch_sweep(model: ModelConfig, global_batch: int, sizes=(1, 2, 4, 8), tp: int = 8, pp: int = 8,
                     dp: int = 1, cluster="a100-dgx", software="ptdp-2021") -> list[dict]:
    """Takeaway 3 on a GPU cluster, timed in the engine's schedule simulator: for each
    microbatch size b, the cluster model's time of one microbatch on the slowest stage
    (its matrix multiplies at b's efficiency, kernels, tensor-parallel and pipeline
    communication; :func:`minitron.analysis.cluster.predict`) costs the forward and
    backward of the engine's own 1F1B schedule of m = B/(d·b) microbatches on p stages,
    and :func:`minitron.analysis.pipeline_sim.simulate` times it. Returns per b: ``b, m,
    per_sequence_s`` (a microbatch's forward and backward over b), ``bubble`` (the
    simulator's), ``iteration_s`` (the simulated makespan plus the data-parallel and
    optimizer time), ``formula_s`` (the same from the cluster model's closed form),
    ``tflops_per_gpu`` (Eq. 3) and ``memory_gb``."""
    from ..analysis.cluster import PlannedLayout, predict
    from ..analysis.flops import flops_per_iteration
    from ..analysis.pipeline_sim import simulate
    from ..parallel.schedules import make_schedule

    rows = []
    for b in sizes:
        if global_batch % (dp * b):
            continue
        pred = predict(model, PlannedLayout(tp=tp, pp=pp, dp=dp, microbatch_size=b), global_batch, cluster,
                       software=software)
        bd = pred.breakdown
        m = bd["microbatches"]
        f, b_in, b_w = bd["stage_fbw"]
        per_mb = (bd["compute"] + bd["tp_comm"] + bd["pp_comm"]) / m  # one microbatch through the stage
        fwd = per_mb * f / (f + b_in + b_w)
        sim = simulate(make_schedule("1f1b", pp, m=m), {"F": fwd, "B": per_mb - fwd, "W": 0})
        it = sim.makespan + bd["dp_comm_exposed"] + bd["optimizer"]
        rows.append({"b": b, "m": m, "per_sequence_s": per_mb / b, "bubble": sim.bubble_fraction,
                     "iteration_s": it, "formula_s": pred.iteration_s,
                     "tflops_per_gpu": flops_per_iteration(model, global_batch, recompute=True)
                     / (tp * pp * dp * it) / 1e12, "memory_gb": pred.memory_gb_per_gpu})
    return rows


# --------------------------------------------------------------------------------------
# §3.5: how many activation checkpoints
# --------------------------------------------------------------------------------------
def checkpoint_memory(layers: int, checkpoints: float, a_input: float, a_intermediate: float,
                      in_flight: int = 1) -> float:
    """PTD-P §3.5: activation bytes of a stage of `layers` layers with `checkpoints`
    checkpoints: ``c·A_input`` kept for each of `in_flight` microbatches, plus one segment
    of ``l/c`` layers rebuilt at a time, ``(l/c)·A_intermediate``. (The paper counts one
    microbatch, ``in_flight = 1``.)"""
    return in_flight * checkpoints * a_input + layers / checkpoints * a_intermediate


def checkpoint_spacing(model: ModelConfig, micro_batch: int, layers: int, tp: int = 1, sp: bool = False,
                       bytes_per_el: int = 2, in_flight: int = 1) -> dict:
    """The memory curve of §3.5 over c = 1..l checkpoints for a stage of `layers` layers
    of `model` on `tp` tensor ranks, and its minimum: ``{a_input, a_intermediate,
    c_star`` (the closed form, a real number), ``best_c`` (the integer c of least memory:
    the closed form rounded down or up, clamped to 1..l), ``layers_per_checkpoint``
    (l / best_c), ``curve`` ({c: bytes})``}``."""
    from ..analysis.memory import activation_bytes_per_layer

    a_in = activation_bytes_per_layer(model, micro_batch, tp, sp, "full", bytes_per_el)
    a_mid = activation_bytes_per_layer(model, micro_batch, tp, sp, "none", bytes_per_el)
    c_star = math.sqrt(layers * a_mid / (in_flight * a_in))
    curve = {c: checkpoint_memory(layers, c, a_in, a_mid, in_flight) for c in range(1, layers + 1)}
    candidates = {min(max(math.floor(c_star), 1), layers), min(max(math.ceil(c_star), 1), layers)}
    best = min(candidates, key=lambda c: curve[c])
    return {"a_input": a_in, "a_intermediate": a_mid, "c_star": c_star, "best_c": best,
            "layers_per_checkpoint": layers / best, "curve": curve}


# --------------------------------------------------------------------------------------
# §5.2: PTD-P against ZeRO-3 without model parallelism
# --------------------------------------------------------------------------------------
NETWORKS = ("node", "gpu")


def zero3_prediction(model: ModelConfig, gpus: int, global_batch: int, micro_batch: int,
                     cluster="a100-dgx", software="ptdp-2021", network: str = "gpu") -> dict:
    """Predicted TFLOP/s per GPU of ZeRO-3 with d = `gpus` and no model parallelism.

    The cluster model prices the compute (``predict`` with ``dp = gpus``: full
    recomputation, the software's kernels). ZeRO-3 adds what it cannot express: every
    step each GPU all-gathers all Ψ parameters twice (forward, backward) and
    reduce-scatters the gradients, ``3(d−1)/d·2Ψ`` bytes in 16 bits
    (:func:`minitron.analysis.zero.zero_wire_bytes`), and steps the optimizer on Ψ/d
    parameters only. The transfers are priced at the cluster's inter-node bandwidth
    times ``COMM_BW_FRACTION`` — `network` ``"node"``: a ring that crosses each node once
    gets the node's whole network (the price the cluster model gives a data-parallel
    ring); ``"gpu"``: every GPU moves its own copy through its share of the node's
    network cards (the price it gives tensor-parallel groups that span nodes). Prefetching
    hides up to ``DP_OVERLAP`` of them behind the compute. Returns ``{tflops_per_gpu,
    iteration_s, compute_s, comm_s, exposed_s, optimizer_s, state_gb}``."""
    from ..analysis.cluster import COMM_BW_FRACTION, DP_OVERLAP, PlannedLayout, get_cluster, predict
    from ..analysis.flops import flops_per_iteration
    from ..analysis.params import param_count
    from ..analysis.zero import zero_wire_bytes

    if network not in NETWORKS:
        raise ValueError(f"network must be one of {', '.join(NETWORKS)} (got {network!r})")
    c = get_cluster(cluster)
    base = predict(model, PlannedLayout(dp=gpus, microbatch_size=micro_batch), global_batch, c, software=software)
    psi = param_count(model)
    bw = c.inter_bw / (c.gpus_per_node if network == "gpu" else 1) * COMM_BW_FRACTION
    steps = 3 * (gpus - 1)  # two all-gathers and a reduce-scatter, n − 1 ring steps each
    comm = steps * c.inter_latency + zero_wire_bytes(psi, gpus, 3, bytes_per_el=2) / bw
    compute = base.breakdown["compute"]
    exposed = comm - min(DP_OVERLAP * comm, compute)
    optimizer = base.breakdown["optimizer"] / gpus
    it = compute + exposed + optimizer
    return {"tflops_per_gpu": flops_per_iteration(model, global_batch) / (gpus * it) / 1e12,
            "iteration_s": it, "compute_s": compute, "comm_s": comm, "exposed_s": exposed,
            "optimizer_s": optimizer, "state_gb": 16 * psi / gpus / 1e9}


def ptdp_vs_zero3(software="ptdp-2021", cluster="a100-dgx", network: str = "gpu") -> list[dict]:
    """PTD-P §5.2 (Table 2), every run: published and predicted TFLOP/s per GPU for PTD-P
    (the cluster model at t = 8 and the paper's p) and ZeRO-3 (:func:`zero3_prediction`),
    with the relative error. ``[{model, scheme, gpus, batch, microbatch, published,
    predicted, error}]``."""
    from ..analysis.cluster import PlannedLayout, predict
    from ..analysis.published import PTDP_VS_ZERO3, gpt3_175b, gpt_530b

    models = {"175B": (gpt3_175b(), 12), "530B": (gpt_530b(), 35)}
    rows = []
    for name, runs in PTDP_VS_ZERO3.items():
        model, p = models[name]
        for scheme, points in runs.items():
            for n, batch, b, published in points:
                if scheme == "ptdp":
                    layout = PlannedLayout(tp=8, pp=p, dp=n // (8 * p), microbatch_size=b)
                    predicted = predict(model, layout, batch, cluster, software=software).tflops_per_gpu
                else:
                    predicted = zero3_prediction(model, n, batch, b, cluster, software, network)["tflops_per_gpu"]
                rows.append({"model": name, "scheme": scheme, "gpus": n, "batch": batch, "microbatch": b,
                             "published": published, "predicted": predicted,
                             "error": predicted / published - 1})
    return rows
