"""Choosing a layout: enumerate (t, p, d, v, b), drop what does not fit, rank the rest.

PTD-P's rules of thumb (Narayanan et al. 2021, §3) come out of the throughput model
rather than being written in:

* tensor parallelism up to the GPUs of one node (its all-reduces are on the critical
  path and need NVLink bandwidth);
* pipeline parallelism across nodes to fit the model (its point-to-point traffic is
  small), with enough microbatches, ``m ≥ p`` or more, to keep the bubble small;
* data parallelism for the rest;
* a microbatch size that balances matrix-multiply efficiency against the bubble.

:func:`plan` enumerates every layout that divides the GPUs and the model, estimates
its memory with :func:`~minitron.analysis.memory.memory_estimate` (mixed precision,
2-byte activations, the chosen recomputation), drops those that exceed the GPU's
memory, and sorts the rest by the throughput predicted by
:func:`~minitron.analysis.cluster.predict`.
"""
from __future__ import annotations

from ..config import ModelConfig
from .cluster import Cluster, get_cluster, predict
from .software import Software, get_software

__all__ = ["plan", "valid_layouts"]


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _powers_of_two_upto(n: int) -> list[int]:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return out


def valid_layouts(model: ModelConfig, gpus: int, global_batch: int, cluster: str | Cluster,
                  tp=None, pp=None, vpp=None, microbatch_size=None, max_vpp: int = 8,
                  max_microbatch: int = 16, ep=None) -> list[dict]:
    """Every (tp, pp, dp, vpp, microbatch_size) the planner considers.

    t: a power of two up to a node's GPUs that divides the heads, the hidden size, the
    MLP width and the GPU count; p: divides gpus/t and is at most the layer count;
    d = gpus/(t·p); b divides global_batch/d (at most `max_microbatch`); v > 1 only
    with p > 1, layers divisible by p·v and at least p microbatches (the interleaved
    schedule runs any m ≥ p in groups of at least p). Keyword arguments fix a degree.
    """
    c = get_cluster(cluster)
    out = []
    tps = [tp] if tp else [t for t in _powers_of_two_upto(c.gpus_per_node) if gpus % t == 0]
    for t in tps:
        if model.heads % t or model.hidden % t or model.ffn_hidden % t or gpus % t:
            continue
        kv = model.n_kv_heads
        if t > kv and t % kv:  # a kv head is split over whole ranks, or replicated t/kv times
            continue
        for p in ([pp] if pp else _divisors(gpus // t)):
            if p > model.layers or (gpus // t) % p:
                continue
            d = gpus // (t * p)
            if global_batch % d:
                continue
            for b in ([microbatch_size] if microbatch_size else _divisors(global_batch // d)):
                if b > max_microbatch or (global_batch // d) % b:
                    continue
                m = global_batch // (d * b)
                vs = [vpp] if vpp else range(1, max_vpp + 1)
                for v in vs:
                    if v > 1 and (p == 1 or model.layers % (p * v) or m < p):
                        continue
                    # expert parallelism (MoE only): a power of two dividing the experts
                    # and the tp·dp ranks, up to 64
                    eps = ([ep] if ep else [e for e in _powers_of_two_upto(min(model.experts, t * d, 64))
                                            if model.experts % e == 0]) if model.experts else [1]
                    for e in eps:
                        out.append({"tp": t, "pp": p, "dp": d, "vpp": v, "microbatch_size": b, "ep": e})
    return out


def plan(model: ModelConfig, gpus: int, global_batch: int, cluster: str | Cluster, seq_len: int | None = None,
         recompute: str | None = None, bytes_per_param: float = 16, tp=None, pp=None, vpp=None,
         microbatch_size=None, top: int | None = None, software: str | Software | None = None,
         zero: int = 0, ep=None) -> list[dict]:
    """Layouts for training `model` on `gpus` GPUs of `cluster`, fastest first.

    Each entry: ``tp, pp, dp, vpp, microbatch_size, sp, schedule`` and the prediction's
    ``tflops_per_gpu, iteration_s, memory_gb_per_gpu, bubble_fraction``. `seq_len`
    overrides the model's; `bytes_per_param` is 16 (mixed-precision Adam) or 20 (with
    fp32 gradient accumulation); `tp, pp, vpp, microbatch_size` fix a degree;
    `software` is the stack the layouts run (a :class:`~minitron.analysis.software.Software`
    or a preset name, see :func:`~minitron.analysis.cluster.predict`); layouts with t > 1
    are sequence parallel when the software is. `zero`: 1 prices Megatron's distributed
    optimizer (0 by default, PTD-P's). A mixture of experts is also laid out over an
    expert-parallel degree ``ep`` (a key of each entry; `ep` fixes it).

    Raises ValueError (one line) for an unknown cluster, fixed degrees that do not
    divide the GPU count, or a model that fits no layout.
    """
    c = get_cluster(cluster)
    sw = get_software(software)
    if seq_len:
        model = model.replace(seq_len=seq_len)
    if gpus < 1:
        raise ValueError(f"need at least one GPU (got {gpus})")
    fixed = (tp or 1) * (pp or 1)
    if gpus % fixed:
        raise ValueError(f"tp*pp = {tp or 1}*{pp or 1} = {fixed} does not divide {gpus} GPUs: "
                         f"pick degrees whose product divides the GPU count")
    if tp and (model.heads % tp or model.hidden % tp):
        raise ValueError(f"tp = {tp} does not divide {model.heads} heads and hidden {model.hidden}")
    entries, smallest = [], None
    for lay in valid_layouts(model, gpus, global_batch, c, tp, pp, vpp, microbatch_size, ep=ep):
        kind = "interleaved" if lay["vpp"] > 1 else "1f1b"
        lay = {**lay, "sp": sw.sequence_parallel and lay["tp"] > 1, "zero": zero}
        pred = predict(model, lay, global_batch, c, recompute=recompute, bytes_per_param=bytes_per_param,
                       software=sw)
        smallest = pred.memory_gb_per_gpu if smallest is None else min(smallest, pred.memory_gb_per_gpu)
        if pred.memory_gb_per_gpu * 1e9 > c.memory_bytes:
            continue
        entries.append({**lay, "schedule": kind, "tflops_per_gpu": pred.tflops_per_gpu,
                        "iteration_s": pred.iteration_s, "memory_gb_per_gpu": pred.memory_gb_per_gpu,
                        "bubble_fraction": pred.bubble_fraction})
    if not entries:
        if smallest is None:
            raise ValueError(f"no layout of {gpus} GPUs divides this model and a global batch of "
                             f"{global_batch}: change the GPU count or the batch")
        raise ValueError(f"the model fits no layout of {gpus} {c.gpu} GPUs: the smallest needs "
                         f"{smallest:.1f} GB per GPU of {c.memory_bytes / 1e9:.0f} GB; add GPUs")
    entries.sort(key=lambda e: -e["tflops_per_gpu"])
    return entries[:top] if top else entries
