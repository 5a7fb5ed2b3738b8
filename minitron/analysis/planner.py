"""Choosing a layout: enumerate (t, p, cp, d, v, b, schedule, FSDP), drop what does not
fit, rank the rest, say why.

PTD-P's rules of thumb (Narayanan et al. 2021, §3) come out of the throughput model
rather than being written in:

* tensor parallelism up to the GPUs of one node (its all-reduces are on the critical
  path and need NVLink bandwidth);
* pipeline parallelism across nodes to fit the model (its point-to-point traffic is
  small), with enough microbatches, ``m ≥ p`` or more, to keep the bubble small;
* data parallelism for the rest;
* a microbatch size that balances matrix-multiply efficiency against the bubble.

Beyond PTD-P, where the software runs them (:class:`~minitron.analysis.software.Software`'s
``schedules, context_parallel, fsdp``), the planner also searches

* the zero-bubble and V schedules (ZB-V, DualPipe-V: exactly two chunks per rank in a V,
  at least p, resp. 2p, microbatches), which win where the bubble is a large share;
* context parallelism (the sequence split over cp ranks: ring, all-to-all) for long
  sequences — from :data:`CP_MIN_SEQUENCE` tokens, in chunks of at least
  :data:`CP_MIN_CHUNK` (a shorter sequence's activations fit without it, and its
  attention is too short to hide the K/V exchange behind);
* FSDP / ZeRO-3 (and HSDP within a node) where memory demands it: a layout whose model
  states do not fit at the requested ZeRO stage is tried again with its weights
  sharded, and those layouts are ranked only when no layout fits without FSDP. Sharding
  the weights all-gathers every layer's weights each microbatch, forward and backward;
  the throughput model counts them hidden behind compute up to its overlap constant and
  does not count the prefetched weights in memory, so where both fit the planner keeps
  the layout that needs no per-microbatch weight traffic, and its reasons say what the
  best FSDP layout was predicted to do (``fsdp=True`` ranks them all together).

:func:`plan` enumerates every layout that divides the GPUs and the model, estimates
its memory with :func:`~minitron.analysis.memory.memory_estimate` (mixed precision,
2-byte activations, the chosen recomputation), drops those that exceed the GPU's
memory, sorts the rest by the throughput predicted by
:func:`~minitron.analysis.cluster.predict`, and gives each returned layout its
``reasons``: why its schedule, context parallelism and sharding, each against the
best layout without (or with) it.
"""
from __future__ import annotations

from ..config import V_SCHEDULES, ConfigError, ModelConfig, min_microbatches, validate_a2a_heads
from .cluster import CLUSTERS, Cluster, get_cluster, predict
from .software import SOFTWARE, Software, get_software

__all__ = ["plan", "valid_layouts", "check_request", "cluster_software", "CP_MIN_SEQUENCE", "CP_MIN_CHUNK"]

# Context parallelism is searched for sequences of at least this many tokens, split in
# chunks of at least CP_MIN_CHUNK (Llama 3 trained its 8k stage without it and its
# 128k stage with cp = 16: 8k-token chunks; Grattafiori et al. 2024, §3.3.1)
CP_MIN_SEQUENCE = 8192
CP_MIN_CHUNK = 4096


def cluster_software(software: "str | Software | None", cluster: str | Cluster) -> Software:
    """The software a plan prices: the one named, else the cluster's era's
    (:attr:`~minitron.analysis.cluster.Cluster.software`: megatron-2019 on V100,
    ptdp-2021 on A100, megatron-core-2024 on H100)."""
    return get_software(get_cluster(cluster).software if software is None else software)


def _stacks(has) -> str:
    return ", ".join(name for name, sw in SOFTWARE.items() if has(sw)) or "none"


def check_request(model: ModelConfig, cluster: str | Cluster, sw: Software, ep: int | None = None,
                  cp: int | None = None, cp_modes: tuple | None = None, zero: int = 0) -> None:
    """Refuse, in one line naming the setting, what the model, the cluster or the
    software cannot run: expert parallelism on a dense model (or an ep that does not
    divide the experts), FP8 on a GPU without FP8 tensor cores, context parallelism or a
    context-parallel kind the software does not run, FSDP (zero 3) on software that does
    not shard weights. ``plan`` and ``minitron plan`` call it before pricing anything."""
    c = get_cluster(cluster)
    if ep and ep > 1 and not model.experts:
        raise ConfigError(f"ep = {ep}: {model.name} is a dense model (no experts), so nothing splits over "
                          f"expert-parallel ranks: drop --ep or plan a MoE model")
    if ep and ep > 1 and model.experts % ep:
        raise ConfigError(f"ep = {ep} does not divide the {model.experts} experts of {model.name}: pick a divisor")
    if sw.fp8 and not c.fp8_peak_flops:
        fp8_clusters = ", ".join(n for n, k in CLUSTERS.items() if k.fp8_peak_flops) or "none"
        raise ConfigError(f"fp8: {c.name}'s {c.gpu} has no FP8 tensor cores: drop --fp8 or plan on a cluster "
                          f"that has them ({fp8_clusters})")
    if cp and cp > 1 and not sw.context_parallel:
        raise ConfigError(f"cp = {cp}: software {sw.name} runs no context parallelism: drop --cp or choose a "
                          f"stack that runs it ({_stacks(lambda s: s.context_parallel)})")
    for kind in cp_modes or ():
        if kind not in sw.context_parallel:
            raise ConfigError(f"cp kind '{kind}': software {sw.name} runs "
                              f"{', '.join(sw.context_parallel) or 'no context parallelism'}: pick one of those "
                              f"or a stack that runs it ({_stacks(lambda s, k=kind: k in s.context_parallel)})")
    if zero == 3 and not sw.fsdp:
        raise ConfigError(f"zero = 3 (FSDP): software {sw.name} does not shard weights: use --zero 0 or 1, or a "
                          f"stack that does ({_stacks(lambda s: s.fsdp)})")


def _a2a_splits(model: ModelConfig, t: int, k: int) -> bool:
    """Whether all-to-all context parallelism over k ranks can split t-way heads (the
    rule `train` applies, :func:`minitron.config.validate_a2a_heads`)."""
    try:
        validate_a2a_heads(model, t, k)
    except ConfigError:
        return False
    return True


def _cp_variants(model: ModelConfig, t: int, k: int, cp_modes, cp_a2a=None) -> list[dict]:
    """The context-parallel kinds of `cp_modes` on k ranks under t-way tensor parallelism,
    as layout fields: all-to-all where it splits the heads, USP (Fang & Zhao 2024) once
    per U = `cp_a2a` (default: every divisor of k with 1 < U < k) that splits them."""
    out = []
    for ck in cp_modes:
        if ck == "usp":
            out += [{"cp_mode": ck, "cp_a2a": u} for u in ([cp_a2a] if cp_a2a else _divisors(k))
                    if 1 < u < k and k % u == 0 and _a2a_splits(model, t, u)]
        elif ck != "a2a" or _a2a_splits(model, t, k):
            out.append({"cp_mode": ck})
    return out


def _cp_name(e: dict) -> str:
    """A layout's context-parallel kind as the reasons print it: USP with its U × R grid."""
    return f"usp {e['cp_a2a']}x{e['cp'] // e['cp_a2a']}" if e["cp_mode"] == "usp" else e["cp_mode"]


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _powers_of_two_upto(n: int) -> list[int]:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return out


def _schedules_for(model: ModelConfig, p: int, m: int, schedules, vpp, max_vpp: int) -> list[tuple[str, int]]:
    """(schedule, v) pairs that apply to p stages and m microbatches."""
    if p == 1:
        return [("1f1b", 1)] if vpp in (None, 1) else []
    out = []
    for kind in schedules:
        if kind in ("1f1b", "gpipe", "zb-h1"):
            vs = [1]
        elif kind == "interleaved":
            vs = range(2, max_vpp + 1)
        elif kind in V_SCHEDULES:
            vs = [2]  # a V: stages r and 2p-1-r on rank r
        else:
            continue
        for v in vs:
            if vpp and v != vpp:
                continue
            # Megatron's interleaving needs equal chunks; a V splits as the engine does (placement.
            # split_layers: DeepSeek-V3's 61 layers run DualPipe on 16 ranks, arXiv 2412.19437 §3.2)
            if p * v > model.layers or (v > 1 and kind not in V_SCHEDULES and model.layers % (p * v)):
                continue
            if m < min_microbatches(kind, p):
                continue
            out.append((kind, v))
    return out


def valid_layouts(model: ModelConfig, gpus: int, global_batch: int, cluster: str | Cluster,
                  tp=None, pp=None, vpp=None, microbatch_size=None, max_vpp: int = 8,
                  max_microbatch: int = 16, ep=None, cp=None, schedules=("1f1b", "interleaved"),
                  cp_modes=("ring",), cp_a2a=None) -> list[dict]:
    """Every (tp, cp, pp, dp, vpp, microbatch_size, schedule, ep) the planner considers.

    t: a power of two up to a node's GPUs that divides the heads, the hidden size, the
    MLP width and the GPU count; cp: 1, or (sequences of at least CP_MIN_SEQUENCE
    tokens) a power of two leaving chunks of at least CP_MIN_CHUNK, one layout per kind
    of `cp_modes` (none when it is empty; all-to-all only where `train` can split the
    heads over t·cp, :func:`minitron.config.validate_a2a_heads`; USP for each U of
    :func:`_cp_variants`, or `cp_a2a`); p: divides
    gpus/(t·cp) and is at most the layer count; d = gpus/(t·cp·p); b divides
    global_batch/d (at most `max_microbatch`); the schedules of `schedules` that apply:
    1F1B (and zb-h1) with v = 1, interleaved with v > 1, the V schedules with v = 2, each
    with layers divisible by p·v and at least its minimum microbatches
    (:func:`minitron.config.min_microbatches`). Keyword arguments fix a degree.
    """
    c = get_cluster(cluster)
    out = []
    s = model.seq_len
    tps = [tp] if tp else [t for t in _powers_of_two_upto(c.gpus_per_node) if gpus % t == 0]
    for t in tps:
        if model.heads % t or model.hidden % t or model.ffn_hidden % t or gpus % t:
            continue
        kv = model.n_kv_heads
        if (kv % t if t <= kv else t % kv):  # kv heads split over whole ranks, or each replicated t/kv times
            continue
        if cp:
            cps = [cp]
        elif not cp_modes:  # the software runs no context parallelism
            cps = [1]
        else:
            cps = [1] + [k for k in _powers_of_two_upto(s // CP_MIN_CHUNK)
                         if k > 1 and s >= CP_MIN_SEQUENCE]
        for k in cps:
            if (gpus // t) % k or (k > 1 and s % (2 * k)):  # 2·cp chunks: each rank a front and a back one
                continue
            kinds = _cp_variants(model, t, k, cp_modes, cp_a2a) if k > 1 else [{"cp_mode": "ring"}]
            for p in ([pp] if pp else _divisors(gpus // (t * k))):
                if p > model.layers or (gpus // (t * k)) % p:
                    continue
                d = gpus // (t * k * p)
                if global_batch % d:
                    continue
                for b in ([microbatch_size] if microbatch_size else _divisors(global_batch // d)):
                    if b > max_microbatch or (global_batch // d) % b:
                        continue
                    m = global_batch // (d * b)
                    for kind, v in _schedules_for(model, p, m, schedules, vpp, max_vpp):
                        # expert parallelism (MoE only): a power of two dividing the experts
                        # and the tp·cp·dp ranks, up to 64
                        eps = ([ep] if ep else [e for e in _powers_of_two_upto(min(model.experts, t * k * d, 64))
                                                if model.experts % e == 0]) if model.experts else [1]
                        for ck in kinds:
                            for e in eps:
                                out.append({"tp": t, "pp": p, "dp": d, "vpp": v, "microbatch_size": b, "ep": e,
                                            "cp": k, **ck, "schedule": kind})
    return out


def _fsdp_shards(t: int, group: int, gpus_per_node: int) -> list[int]:
    """FSDP over all dp·cp ranks (0), and HSDP over the ranks of one node when that is
    fewer: sharding over an intermediate count crosses nodes as the full one does but
    keeps more states, so the model never prefers it."""
    node = gpus_per_node // t
    return [0] + ([node] if 1 < node < group and group % node == 0 else [])


def _kinds(lay: dict) -> list[str]:
    """What a layout has or lacks, as the reasons compare them."""
    return ["any", "v" if lay["schedule"] in V_SCHEDULES else "not_v", "cp" if lay["cp"] > 1 else "no_cp",
            "fsdp" if lay["zero"] == 3 else "no_fsdp"]


def _describe(e: dict) -> str:
    cp = f" cp={e['cp']} ({_cp_name(e)})" if e["cp"] > 1 else ""
    ep = f" ep={e['ep']}" if e["ep"] > 1 else ""
    z = (f", FSDP" + (f" over {e['fsdp_shard']}" if e["fsdp_shard"] else "")) if e["zero"] == 3 else ""
    return (f"t={e['tp']} p={e['pp']}{cp} d={e['dp']}{ep} v={e['vpp']} b={e['microbatch_size']} "
            f"{e['schedule']}{z}")


def _versus(e: dict, alt: dict | None, smallest: float | None, without: str, cap_gb: float) -> str:
    """`e` against `alt`, the best layout `without` (or: none fits, the smallest's memory)."""
    if alt is None:
        return (f"no layout {without} fits" + (f" (the smallest needs {smallest:.0f} GB per GPU of "
                                               f"{cap_gb:.0f})" if smallest else ""))
    gain = e["tflops_per_gpu"] / alt["tflops_per_gpu"] - 1
    return (f"the best layout {without} ({_describe(alt)}: {alt['tflops_per_gpu']:.0f} TFLOP/s, bubble "
            f"{alt['bubble_fraction']:.1%}, {alt['memory_gb_per_gpu']:.0f} GB) is {abs(gain):.1%} "
            f"{'slower' if gain >= 0 else 'faster'}")


def _reasons(e: dict, best: dict, smallest: dict, model: ModelConfig, sw_searched: dict,
             cap_gb: float, zero: int) -> dict:
    """Why `e`'s schedule, context parallelism and sharding: each against the fastest
    fitting layout that differs in it (`best`, by what it has or lacks). Keys ``schedule,
    cp, fsdp`` (only the axes searched)."""
    out = {}
    v_kinds = [k for k in sw_searched["schedules"] if k in V_SCHEDULES]
    if not v_kinds and e["pp"] > 1:
        out["schedule"] = (f"{e['schedule']}: bubble {e['bubble_fraction']:.1%}; V schedules (zb-v, dualpipe-v) "
                           f"not searched: the software does not run them")
    if v_kinds:
        is_v = e["schedule"] in V_SCHEDULES
        if is_v:
            out["schedule"] = (f"{e['schedule']} (two chunks per rank in a V): bubble {e['bubble_fraction']:.1%} "
                               f"of the ideal time in {e['memory_gb_per_gpu']:.0f} GB per GPU; "
                               + _versus(e, best.get("not_v"),
                                         smallest.get("not_v"), "without a V schedule", cap_gb))
        elif e["pp"] == 1:
            out["schedule"] = "no pipeline (p = 1): no bubble for a V schedule to remove"
        else:
            out["schedule"] = (f"{e['schedule']}: bubble {e['bubble_fraction']:.1%}; "
                               + _versus(e, best.get("v"), smallest.get("v"), "with a V schedule", cap_gb))
    if sw_searched["cp"]:
        s = model.seq_len
        if e["cp"] > 1:
            out["cp"] = (f"cp = {e['cp']} ({_cp_name(e)}): the {s}-token sequence in {s // e['cp']}-token chunks; "
                         + _versus(e, best.get("no_cp"), smallest.get("no_cp"), "without cp", cap_gb))
        elif s < CP_MIN_SEQUENCE:
            out["cp"] = f"no cp: a {s}-token sequence is short (context parallelism is searched from {CP_MIN_SEQUENCE})"
        else:
            out["cp"] = "no cp: " + _versus(e, best.get("cp"), smallest.get("cp"), "with cp", cap_gb)
    if sw_searched["fsdp"]:
        alt = best.get("fsdp_alt")
        if e["zero"] == 3:
            g = e["fsdp_shard"] or e["dp"] * e["cp"]
            out["fsdp"] = (f"FSDP (ZeRO-3{', HSDP' if e['fsdp_shard'] else ''}, weights sharded over {g} ranks): "
                           f"at ZeRO-{zero} this layout needs {e['unsharded_gb']:.0f} GB per GPU of {cap_gb:.0f}, "
                           f"sharded {e['memory_gb_per_gpu']:.0f} GB; "
                           + _versus(e, best.get("no_fsdp"), smallest.get("no_fsdp"), "without FSDP",
                                     cap_gb))
        else:
            out["fsdp"] = (f"no FSDP: the model states fit at ZeRO-{zero} ({e['memory_gb_per_gpu']:.0f} GB per GPU "
                           f"of {cap_gb:.0f}), with no weight all-gathers per layer and microbatch")
            if sw_searched["fsdp"] == "needed" and alt is not None:
                gain = alt["tflops_per_gpu"] / e["tflops_per_gpu"] - 1
                out["fsdp"] += (f"; FSDP is ranked only where nothing fits without it (the best FSDP layout, "
                                f"{_describe(alt)}, would be {abs(gain):.1%} {'faster' if gain >= 0 else 'slower'} "
                                f"if its all-gathers hide as the model assumes)")
    return out


def plan(model: ModelConfig, gpus: int, global_batch: int, cluster: str | Cluster, seq_len: int | None = None,
         recompute: str | None = None, bytes_per_param: float = 16, tp=None, pp=None, vpp=None,
         microbatch_size=None, top: int | None = None, software: str | Software | None = None,
         zero: int = 0, ep=None, cp=None, schedules=None, cp_modes=None,
         fsdp: bool | str | None = None, cp_a2a=None, doc_len: int | None = None) -> list[dict]:
    """Layouts for training `model` on `gpus` GPUs of `cluster`, fastest first.

    Each entry: ``tp, pp, cp, cp_mode, dp, vpp, microbatch_size, ep, sp, schedule, zero,
    fsdp_shard``, the prediction's ``tflops_per_gpu, iteration_s, memory_gb_per_gpu,
    bubble_fraction``, and ``reasons`` (a dict: ``schedule, cp, fsdp``, for the axes
    searched) saying why against the best layout that differs there. `seq_len` overrides
    the model's; `bytes_per_param` is 16 (mixed-precision Adam) or 20 (with fp32 gradient
    accumulation); `tp, pp, vpp, microbatch_size, cp, ep` fix a degree (`cp_a2a`: USP's U); `doc_len`:
    packed documents of this mean length, each attended on its own (:func:`predict`'s); `software` is the
    stack the layouts run (a :class:`~minitron.analysis.software.Software` or a preset
    name, see :func:`~minitron.analysis.cluster.predict`; default: predict's, so that a
    layout planned and then predicted is priced alike; ``minitron plan`` passes the
    cluster's era's, :func:`cluster_software`); layouts with t > 1 are
    sequence parallel when the software is. The pipeline schedules, context-parallel
    kinds and FSDP searched are the software's (``schedules, context_parallel, fsdp``)
    unless `schedules`, `cp_modes`, `fsdp` say otherwise. `zero`: 1 prices Megatron's
    distributed optimizer (0 by default, PTD-P's); a layout that does not fit at that
    stage is tried again with FSDP (zero 3, and HSDP within a node): `fsdp` ``"needed"``
    (the default where the software shards weights) ranks those only when no layout fits
    without FSDP, ``True`` ranks them with the others, ``False`` tries none.

    Raises ValueError (one line) for an unknown cluster, fixed degrees that do not
    divide the GPU count, a model that fits no layout, or what :func:`check_request`
    refuses (an axis, kind or precision the model, cluster or software does not run):
    the planner never searches an axis the software does not run.
    """
    c = get_cluster(cluster)
    sw = get_software(software)
    check_request(model, c, sw, ep, cp, cp_modes, zero)
    if seq_len:
        model = model.replace(seq_len=seq_len)
    _check_degrees(model, gpus, tp, pp, cp)
    schedules, cp_modes, fsdp = _searched(sw, schedules, cp_modes, fsdp, zero)

    def priced(lay):
        pred = predict(model, lay, global_batch, c, recompute=recompute, bytes_per_param=bytes_per_param,
                       software=sw, doc_len=doc_len)
        return {**lay, "tflops_per_gpu": pred.tflops_per_gpu, "iteration_s": pred.iteration_s,
                "memory_gb_per_gpu": pred.memory_gb_per_gpu, "bubble_fraction": pred.bubble_fraction}

    layouts = valid_layouts(model, gpus, global_batch, c, tp, pp, vpp, microbatch_size, ep=ep, cp=cp,
                            schedules=schedules, cp_modes=cp_modes, cp_a2a=cp_a2a)
    entries, sharded, smallest, n_layouts = _fitting(layouts, priced, sw, zero, fsdp, c)
    if fsdp is True or not entries:
        entries += sharded
    if not entries:
        _fits_none(n_layouts, gpus, global_batch, c, smallest)
    entries.sort(key=lambda e: -e["tflops_per_gpu"])
    searched = {"schedules": schedules, "cp": bool(cp_modes) or bool(cp and cp > 1), "fsdp": fsdp}
    out = entries[:top] if top else entries
    _give_reasons(out, entries, sharded, smallest, model, searched, c.memory_bytes / 1e9, zero)
    return out


def _check_degrees(model: ModelConfig, gpus: int, tp, pp, cp) -> None:
    """Refuse, in one line, a GPU count below one, fixed degrees whose product does not
    divide the GPUs, or a fixed tp that does not divide the heads and hidden size."""
    if gpus < 1:
        raise ValueError(f"need at least one GPU (got {gpus})")
    fixed = (tp or 1) * (pp or 1) * (cp or 1)
    if gpus % fixed:
        raise ValueError(f"tp*pp*cp = {tp or 1}*{pp or 1}*{cp or 1} = {fixed} does not divide {gpus} GPUs: "
                         f"pick degrees whose product divides the GPU count")
    if tp and (model.heads % tp or model.hidden % tp):
        raise ValueError(f"tp = {tp} does not divide {model.heads} heads and hidden {model.hidden}")


def _searched(sw: Software, schedules, cp_modes, fsdp, zero: int) -> tuple[tuple, tuple, bool | str]:
    """(Schedules, context-parallel kinds, FSDP mode) a plan searches: the software's
    unless given; "allgather" only without "ring" (the same bytes as the ring, none
    hidden: never faster in the model); FSDP ``"needed"`` where the software shards
    weights, and never on top of a requested zero 3."""
    schedules = tuple(sw.schedules if schedules is None else schedules)
    cp_modes = tuple(sw.context_parallel if cp_modes is None else cp_modes)
    if "ring" in cp_modes:
        cp_modes = tuple(k for k in cp_modes if k != "allgather")
    fsdp = ("needed" if sw.fsdp else False) if fsdp is None else fsdp
    if fsdp not in (False, True, "needed"):
        raise ValueError(f"fsdp must be False, True or 'needed' (got {fsdp!r})")
    return schedules, cp_modes, (fsdp if zero != 3 else False)


def _fitting(layouts, priced, sw: Software, zero: int, fsdp, c: Cluster) -> tuple[list, list, dict, int]:
    """Price each layout (sequence parallel where the software is, at the requested ZeRO
    stage); keep those that fit the GPU's memory; where the model states do not, try the
    weights sharded too (FSDP, and HSDP within a node). Returns (fitting entries, fitting
    FSDP entries fastest first, the smallest memory of what did not fit by kind, how many
    layouts there were)."""
    cap = c.memory_bytes / 1e9
    entries, sharded, smallest, n_layouts = [], [], {}, 0
    for lay in layouts:
        n_layouts += 1
        lay = {**lay, "sp": sw.sequence_parallel and lay["tp"] > 1, "zero": zero, "fsdp_shard": 0}
        e = priced(lay)
        if e["memory_gb_per_gpu"] <= cap:
            entries.append(e)
            continue
        for key in _kinds(lay):  # the smallest memory of what did not fit, by what it has or lacks
            smallest[key] = min(smallest.get(key, e["memory_gb_per_gpu"]), e["memory_gb_per_gpu"])
        if not fsdp or lay["dp"] * lay["cp"] == 1:
            continue
        # the model states do not fit at this ZeRO stage: shard the weights too
        for shard in _fsdp_shards(lay["tp"], lay["dp"] * lay["cp"], c.gpus_per_node):
            e3 = priced({**lay, "zero": 3, "fsdp_shard": shard})
            if e3["memory_gb_per_gpu"] <= cap:
                sharded.append({**e3, "unsharded_gb": e["memory_gb_per_gpu"]})
            else:
                smallest["any"] = min(smallest["any"], e3["memory_gb_per_gpu"])
    sharded.sort(key=lambda e: -e["tflops_per_gpu"])
    return entries, sharded, smallest, n_layouts


def _fits_none(n_layouts: int, gpus: int, global_batch: int, c: Cluster, smallest: dict) -> None:
    """Raise the one-line error for a plan with nothing to rank: no layout divides the
    model and batch, or none fits the GPU's memory."""
    if not n_layouts:
        raise ValueError(f"no layout of {gpus} GPUs divides this model and a global batch of "
                         f"{global_batch}: change the GPU count or the batch")
    raise ValueError(f"the model fits no layout of {gpus} {c.gpu} GPUs: the smallest needs "
                     f"{smallest['any']:.1f} GB per GPU of {c.memory_bytes / 1e9:.0f} GB; add GPUs")


def _give_reasons(out: list, entries: list, sharded: list, smallest: dict, model: ModelConfig, searched: dict,
                  cap_gb: float, zero: int) -> None:
    """Give each returned layout of `out` its ``reasons`` (:func:`_reasons`), against the
    fastest fitting layout of each kind among `entries` (and the fastest FSDP one), and
    drop the unsharded memory the FSDP reasons read."""
    best = {"fsdp_alt": sharded[0]} if sharded else {}
    for e in entries:  # the fastest of each kind
        for key in _kinds(e):
            best.setdefault(key, e)
    for e in out:
        e["reasons"] = _reasons(e, best, smallest, model, searched, cap_gb, zero)
    for e in entries + sharded:
        e.pop("unsharded_gb", None)
