"""The throughput model on published runs of other software than the ones it was fitted with.

Three families beyond the calibration (Megatron-LM 2019 on V100) and the two H100 fitting
runs (:data:`~minitron.analysis.published.H100_FITTING_RUNS`); nothing below was fitted on
any of them. Every row of each published table is taken, decided before any error was seen,
except where stated:

* **Megatron/NeMo** — the NeMo and Megatron-Bridge tables of :data:`.published.H100_RUNS`
  (``megatron-core-2024``, DGX-H100);
* **Llama 3 paper** — its two Table 4 rows beside the fitting row (Meta's own stack, priced
  as ``megatron-core-2024``): a separate stack, but the same table as a fitting run;
* **llm-foundry** — MosaicML's MPT benchmark tables, "H100 80GB BF16" (52 rows, 8–64 GPUs,
  sequences 512–65,536, added in llm-foundry commit b2a43a1, 2023-10-19) and "H100 80GB BF16
  (Large Scale, >= 128 GPUs)" (18 rows, commit 5e85bd6, 2024-01-06), github.com/mosaicml/
  llm-foundry scripts/train/benchmarking/README.md: Composer with PyTorch FSDP, FULL_SHARD or
  SHARD_GRAD_OP, with or without activation checkpointing (full: each block), MPT's Triton
  flash attention (submit_benchmarks.py's ``--attn_impl`` default "triton" at both commits).
  The MPT shapes are the yamls' (scripts/train/yamls/pretrain/mpt-*.yaml at b2a43a1: d_model,
  n_heads, n_layers, expansion 4, vocabulary 50,368, learned positions, biases, LayerNorm,
  tied embeddings; the table's NumParams is exactly that count), head width 128 in all;
* **torchtitan** — benchmarks/llama3_h100_202412_torchtitan.md (github.com/pytorch/torchtitan,
  torchtitan 9dec370, torch 1963fc8, December 2024) Tables 1–4: Llama 3.1 8B and 70B, FSDP2
  with TP and CP, on Meta's Grand Teton H100s (96 GB HBM2e at 2.4 TB/s, 500 W: the
  ``h100-96gb`` cluster). Tables 5 and 6 (405B with pipeline parallelism) are left out: with
  pipelining, PyTorch's stage defers FSDP's gradient sync and resharding to a step's last
  microbatch, which this model does not price (it prices FSDP per microbatch).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from ..config import PRESETS, ModelConfig
from .cluster import PlannedLayout, get_cluster, predict
from .published import H100_RUN_SOFTWARE, H100_RUNS, H100_SOFTWARE, h100_era_model, release_spread
from .software import get_software

__all__ = ["PublishedRun", "FAMILIES", "LLM_FOUNDRY_RUNS", "TORCHTITAN_RUNS", "validation_runs", "mpt_model",
           "predict_run", "family_comparison", "family_summary", "group_scores"]

FAMILIES = ("Megatron/NeMo", "Llama 3 paper", "llm-foundry", "torchtitan")


@dataclass(frozen=True)
class PublishedRun:
    """One published training run: what its table states (model, sequence, GPUs, global
    batch, microbatch, layout), the stack and cluster it is priced on with what its recipe
    sets beyond the stack (``options``: Software fields), the published figure and its unit
    ("tokens/s" per GPU or model "TFLOP/s" per GPU) and where it is published."""

    run: str
    family: str
    model: str
    seq: int
    gpus: int
    batch: int
    mb: int
    value: float
    unit: str
    source: str
    software: str
    cluster: str = "h100-dgx"
    tp: int = 1
    pp: int = 1
    cp: int = 1
    vpp: int = 1
    ep: int = 1
    zero: int = 3
    cp_mode: str = "ring"
    options: dict = field(default_factory=dict)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)


# ---- llm-foundry (MosaicML), H100 80GB BF16 -------------------------------------------
_FOUNDRY = ("llm-foundry scripts/train/benchmarking/README.md, \"H100 80GB BF16\" table "
            "(github.com/mosaicml/llm-foundry, commit b2a43a1, 2023-10-19)")
_FOUNDRY_LARGE_SRC = ("llm-foundry scripts/train/benchmarking/README.md, \"H100 80GB BF16 (Large Scale, >= 128 GPUs)\" "
                      "table (github.com/mosaicml/llm-foundry, commit 5e85bd6, 2024-01-06)")
# (n_layers, d_model, n_heads) of the yamls scripts/train/yamls/pretrain/mpt-*.yaml (b2a43a1)
MPT_SHAPES = {"mpt-760m": (24, 1536, 12), "mpt-1b": (24, 2048, 16), "mpt-3b": (32, 2560, 20),
              "mpt-7b": (32, 4096, 32), "mpt-13b": (40, 5120, 40), "mpt-30b": (48, 7168, 56),
              "mpt-70b": (80, 8192, 64)}
_FOUNDRY_TABLE = [  # (model, seq, GPUs, global batch, MBS, checkpointing, sharding, tokens/s/GPU)
    ("mpt-70b", 2048, 64, 2048, 8, True, "FULL_SHARD", 1039),
    ("mpt-70b", 2048, 32, 1024, 2, True, "FULL_SHARD", 882),
    ("mpt-30b", 8192, 8, 168, 1, True, "FULL_SHARD", 1384),
    ("mpt-30b", 4096, 8, 168, 1, True, "FULL_SHARD", 1802),
    ("mpt-30b", 2048, 32, 1344, 14, True, "FULL_SHARD", 2308),
    ("mpt-30b", 2048, 16, 480, 10, True, "FULL_SHARD", 2263),
    ("mpt-30b", 2048, 8, 504, 3, True, "FULL_SHARD", 2002),
    ("mpt-30b", 1024, 8, 1008, 6, True, "FULL_SHARD", 2084),
    ("mpt-13b", 32768, 8, 24, 1, True, "FULL_SHARD", 1976),
    ("mpt-13b", 16384, 8, 72, 3, True, "FULL_SHARD", 2985),
    ("mpt-13b", 4096, 8, 240, 10, True, "FULL_SHARD", 4717),
    ("mpt-13b", 2048, 64, 128, 2, False, "FULL_SHARD", 4800),
    ("mpt-13b", 2048, 32, 64, 2, False, "FULL_SHARD", 4811),
    ("mpt-13b", 2048, 16, 32, 2, False, "FULL_SHARD", 4767),
    ("mpt-13b", 2048, 8, 16, 2, False, "FULL_SHARD", 4792),
    ("mpt-13b", 1024, 8, 960, 40, True, "FULL_SHARD", 5502),
    ("mpt-7b", 65536, 8, 16, 1, True, "FULL_SHARD", 1956),
    ("mpt-7b", 32768, 8, 32, 2, True, "FULL_SHARD", 3318),
    ("mpt-7b", 8192, 8, 128, 8, True, "FULL_SHARD", 6935),
    ("mpt-7b", 4096, 8, 256, 16, True, "FULL_SHARD", 8611),
    ("mpt-7b", 2048, 8, 48, 6, False, "FULL_SHARD", 10643),
    ("mpt-7b", 1024, 8, 1024, 64, True, "FULL_SHARD", 10203),
    ("mpt-3b", 65536, 8, 16, 1, True, "FULL_SHARD", 3262),
    ("mpt-3b", 32768, 8, 144, 3, True, "FULL_SHARD", 5873),
    ("mpt-3b", 16384, 8, 48, 1, False, "FULL_SHARD", 11152),
    ("mpt-3b", 8192, 8, 144, 3, False, "FULL_SHARD", 16578),
    ("mpt-3b", 4096, 8, 240, 5, False, "FULL_SHARD", 20964),
    ("mpt-3b", 2048, 64, 1152, 6, False, "FULL_SHARD", 22525),
    ("mpt-3b", 2048, 32, 576, 6, False, "FULL_SHARD", 23021),
    ("mpt-3b", 2048, 16, 480, 10, False, "FULL_SHARD", 24142),
    ("mpt-3b", 1024, 8, 960, 20, False, "FULL_SHARD", 27046),
    ("mpt-3b", 512, 8, 1920, 40, False, "FULL_SHARD", 27965),
    ("mpt-1b", 65536, 8, 16, 1, True, "FULL_SHARD", 5506),
    ("mpt-1b", 32768, 8, 32, 1, False, "FULL_SHARD", 12025),
    ("mpt-1b", 16384, 8, 64, 2, False, "FULL_SHARD", 19649),
    ("mpt-1b", 8192, 8, 96, 3, False, "FULL_SHARD", 29157),
    ("mpt-1b", 4096, 8, 224, 7, False, "FULL_SHARD", 38535),
    ("mpt-1b", 2048, 64, 1280, 20, False, "FULL_SHARD", 44402),
    ("mpt-1b", 2048, 32, 640, 20, False, "FULL_SHARD", 45130),
    ("mpt-1b", 2048, 16, 320, 20, False, "FULL_SHARD", 46037),
    ("mpt-1b", 2048, 8, 112, 14, False, "FULL_SHARD", 45455),
    ("mpt-1b", 1024, 8, 576, 18, False, "FULL_SHARD", 48910),
    ("mpt-1b", 512, 8, 1792, 56, False, "FULL_SHARD", 52275),
    ("mpt-760m", 32768, 8, 16, 1, False, "FULL_SHARD", 16291),
    ("mpt-760m", 16384, 8, 48, 3, False, "FULL_SHARD", 27815),
    ("mpt-760m", 8192, 8, 96, 6, False, "FULL_SHARD", 41825),
    ("mpt-760m", 4096, 8, 192, 12, False, "FULL_SHARD", 55459),
    ("mpt-760m", 2048, 32, 768, 24, False, "FULL_SHARD", 67971),
    ("mpt-760m", 2048, 16, 384, 24, False, "FULL_SHARD", 68551),
    ("mpt-760m", 2048, 8, 384, 24, False, "FULL_SHARD", 63147),
    ("mpt-760m", 1024, 8, 768, 48, False, "FULL_SHARD", 78581),
    ("mpt-760m", 512, 8, 1536, 96, False, "FULL_SHARD", 83749),
]
_FOUNDRY_LARGE = [  # (model, seq, GPUs, global batch, MBS, checkpointing, sharding, tokens/s/GPU)
    ("mpt-70b", 2048, 512, 4096, 8, True, "FULL_SHARD", 1007),
    ("mpt-70b", 2048, 256, 2048, 8, True, "FULL_SHARD", 1035),
    ("mpt-70b", 2048, 128, 1024, 8, True, "FULL_SHARD", 1058),
    ("mpt-30b", 2048, 512, 4096, 8, True, "FULL_SHARD", 2115),
    ("mpt-30b", 2048, 256, 2048, 8, True, "FULL_SHARD", 2148),
    ("mpt-30b", 2048, 128, 1024, 8, True, "FULL_SHARD", 2199),
    ("mpt-13b", 2048, 512, 8192, 16, True, "FULL_SHARD", 4952),
    ("mpt-13b", 2048, 256, 4096, 16, True, "FULL_SHARD", 4989),
    ("mpt-13b", 2048, 128, 2048, 16, True, "FULL_SHARD", 5080),
    ("mpt-7b", 2048, 512, 3072, 6, False, "FULL_SHARD", 9670),
    ("mpt-7b", 2048, 256, 1536, 6, False, "FULL_SHARD", 10119),
    ("mpt-7b", 2048, 128, 768, 6, False, "FULL_SHARD", 10475),
    ("mpt-3b", 2048, 512, 4096, 8, False, "SHARD_GRAD_OP", 21664),
    ("mpt-3b", 2048, 256, 2048, 8, False, "SHARD_GRAD_OP", 22772),
    ("mpt-3b", 2048, 128, 1024, 8, False, "SHARD_GRAD_OP", 23422),
    ("mpt-1b", 2048, 512, 6144, 12, False, "SHARD_GRAD_OP", 39837),
    ("mpt-1b", 2048, 256, 3072, 12, False, "SHARD_GRAD_OP", 42555),
    ("mpt-1b", 2048, 128, 1536, 12, False, "SHARD_GRAD_OP", 44123),
]


def mpt_model(name: str, seq: int) -> ModelConfig:
    """An MPT of the benchmark yamls: GPT-shaped (LayerNorm, GeLU, 4h MLP, biases, learned
    positions up to `seq`, tied embeddings), vocabulary 50,368."""
    layers, hidden, heads = MPT_SHAPES[name]
    return ModelConfig(name=name, layers=layers, hidden=hidden, heads=heads, seq_len=seq, vocab=50368,
                       tied_embeddings=True)


def _foundry_runs() -> list[PublishedRun]:
    runs = []
    for table, source in ((_FOUNDRY_TABLE, _FOUNDRY), (_FOUNDRY_LARGE, _FOUNDRY_LARGE_SRC)):
        for model, seq, gpus, batch, mb, ckpt, shard, tps in table:
            rid = f"foundry-{model[4:]}-s{seq}-g{gpus}" + ("-ac" if ckpt else "")
            runs.append(PublishedRun(rid, "llm-foundry", model, seq, gpus, batch, mb, tps, "tokens/s", source,
                                     "llm-foundry-2023", options={
                                         "recompute": "full" if ckpt else "none",
                                         "fsdp_reshard_after_forward": shard == "FULL_SHARD"}))
    return runs


LLM_FOUNDRY_RUNS = _foundry_runs()

# ---- torchtitan, H100 (Grand Teton) -----------------------------------------------------
_TITAN = ("torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table {n} (github.com/pytorch/torchtitan, "
          "commit 31a17bf; torchtitan 9dec370, 2024-12-26)")
# torch.compile fuses the element-wise kernels (Inductor); Float8 is torchao's tensorwise
# (current) scaling; async TP is PyTorch's (tp_overlap "async", priced from what its compiler pass
# decomposes: software.ASYNC_TP). "Selective"
# checkpointing is torchtitan's op-level policy (it saves the attention and every other
# matmul's output): priced as the model's selective policy, the nearest it has.
_COMPILE = {"fused_bias_gelu": True, "fused_bias_dropout_add": True}
_FLOAT8 = {"fp8": True, "fp8_recipe": "tensorwise"}
_T1 = [("", {}, 5762), ("-compile", _COMPILE, 6667), ("-compile-fp8", {**_COMPILE, **_FLOAT8}, 8532)]
_T3 = [("", {}, 5605), ("-compile", _COMPILE, 6514), ("-compile-fp8", {**_COMPILE, **_FLOAT8}, 8380)]


def _titan_runs() -> list[PublishedRun]:
    runs = []
    for n, gpus, rows in ((1, 8, _T1), (3, 128, _T3)):  # Llama 3.1 8B, local batch 2, seq 8192, selective AC
        runs += [PublishedRun(f"titan-8b-g{gpus}{tag}", "torchtitan", "llama3-8b", 8192, gpus, 2 * gpus, 2, tps,
                              "tokens/s", _TITAN.format(n=n), "torchtitan-2024", "h100-96gb",
                              options={"recompute": "selective", **opts}) for tag, opts, tps in rows]
    for cp, seq, tps in ((1, 32768, 3890), (2, 65536, 2540), (4, 131072, 1071), (8, 262144, 548)):
        # Table 2: 8 GPUs, FSDP 8/cp × CP cp, local batch 1, full AC, compile + Float8
        runs.append(PublishedRun(f"titan-8b-cp{cp}-s{seq}", "torchtitan", "llama3-8b", seq, 8, 8 // cp, 1, tps,
                                 "tokens/s", _TITAN.format(n=2), "torchtitan-2024", "h100-96gb", cp=cp,
                                 cp_mode="allgather", options={"recompute": "full", **_COMPILE, **_FLOAT8}))
    for tag, overlap, tps in (("", "none", 829), ("-asynctp", "async", 876)):
        # Table 4: 70B on 256 GPUs, FSDP 32 × TP 8, local batch 16, full AC, compile + Float8
        runs.append(PublishedRun(f"titan-70b-tp8{tag}", "torchtitan", "llama3-70b", 8192, 256, 512, 16, tps,
                                 "tokens/s", _TITAN.format(n=4), "torchtitan-2024", "h100-96gb", tp=8,
                                 options={"recompute": "full", "tp_overlap": overlap, **_COMPILE, **_FLOAT8}))
    return runs


TORCHTITAN_RUNS = _titan_runs()

# ---- async TP speed-ups (torchtitan, H100 Grand Teton, June 2025) -------------------------
ASYNC_TP_SOURCE = ("torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md, \"performance benchmarks done "
                   "by the PyTorch team in June 2025\" (github.com/pytorch/torchtitan, added in commit 2887250, "
                   "2025-06-16; torch 38410cf9)")
# (model, GPUs, local batch, recompute, quantization, vanilla TP tokens/s, async TP tokens/s), TP 8 × FSDP;
# the 70B: full AC; the 8B: per-op SAC (priced as selective); torch.compile in both. The source's note:
# "the low baseline performance of the vanilla TP float8 rowwise training is being addressed here:
# https://github.com/pytorch/torchtitan/issues/1207" (benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md)
ASYNC_TP_ROWS = [
    ("llama3-70b", 256, 16, "full", "bf16", 597.3, 652.4),
    ("llama3-70b", 256, 16, "full", "tensorwise", 809.8, 942.4),
    ("llama3-70b", 256, 16, "full", "rowwise", 599.6, 624.8),
    ("llama3-8b", 64, 12, "selective", "bf16", 4378, 4809.4),
    ("llama3-8b", 64, 12, "selective", "tensorwise", 5078.1, 5570.1),
    ("llama3-8b", 64, 12, "selective", "rowwise", 3708.5, 3914.9),
]


def async_tp_speedups() -> list[dict]:
    """Each published async-TP comparison: the published speed-up (async over vanilla TP
    tokens/s) beside the cluster model's, both layouts priced as the run states them
    (torchtitan-2024, TP 8, compile, FP8 recipe as named; async TP as ``tp_overlap="async"``,
    from its decomposition), nothing fitted: the June 2025 table (:data:`ASYNC_TP_ROWS`), then
    the December 2024 table's pair (Table 4, :data:`TORCHTITAN_RUNS`). ``flagged``: the source
    says its vanilla baseline is low for a reason of its own (the float8 rowwise rows)."""
    pairs = []
    for model, gpus, lbs, rc, quant, vanilla, asynctp in ASYNC_TP_ROWS:
        fp8 = {} if quant == "bf16" else {"fp8": True, "fp8_recipe": quant}
        pairs.append([PublishedRun(f"titan-async-{model}-{quant}-{overlap}", "torchtitan", model, 8192, gpus,
                                   lbs * gpus // 8, lbs, value, "tokens/s", ASYNC_TP_SOURCE, "torchtitan-2024",
                                   "h100-96gb", tp=8, options={"recompute": rc, "tp_overlap": overlap, **_COMPILE, **fp8})
                      for overlap, value in (("none", vanilla), ("async", asynctp))])
    pairs.append([r for r in TORCHTITAN_RUNS if r.run in ("titan-70b-tp8", "titan-70b-tp8-asynctp")])
    rows = []
    for plain, fused in pairs:
        quant = plain.options.get("fp8_recipe", "tensorwise") if plain.options.get("fp8") else "bf16"
        pred = [predict_run(plain)[1], predict_run(fused)[1]]
        rows.append({"model": plain.model, "gpus": plain.gpus, "quantization": quant, "source": plain.source,
                     "published": fused.value / plain.value, "predicted": pred[1] / pred[0],
                     "vanilla_error": pred[0] / plain.value - 1, "flagged": quant == "rowwise"})
    return rows


def _megatron_runs() -> list[PublishedRun]:
    """:data:`.published.H100_RUNS` as PublishedRuns (the Llama 3 paper's apart)."""
    runs = []
    for (rid, name, seq, n, batch, mb, t, p, cp, v, ep, zero, cp_mode, fp8, value, unit, source) in H100_RUNS:
        family = "Llama 3 paper" if "Llama 3 paper" in source else "Megatron/NeMo"
        runs.append(PublishedRun(rid, family, name, seq, n, batch, mb, value, unit, source, H100_SOFTWARE,
                                 tp=t, pp=p, cp=cp, vpp=v, ep=ep, zero=zero, cp_mode=cp_mode,
                                 options={"fp8": fp8, **H100_RUN_SOFTWARE.get(rid, {})}))
    return runs


def validation_runs() -> list[PublishedRun]:
    """Every validation run of every family (none of them fitted on)."""
    return _megatron_runs() + LLM_FOUNDRY_RUNS + TORCHTITAN_RUNS


def _model(run: PublishedRun) -> tuple[ModelConfig, int | None]:
    if run.model in MPT_SHAPES:
        return mpt_model(run.model, run.seq), None
    model, head_dim = h100_era_model(run.model) if run.model not in PRESETS else (PRESETS[run.model], None)
    return model.replace(seq_len=run.seq), head_dim


def predict_run(run: PublishedRun):
    """(Prediction, predicted value in the run's unit) of one published run."""
    model, head_dim = _model(run)
    sw = get_software(run.software).replace(**run.options)
    layout = PlannedLayout(tp=run.tp, pp=run.pp, dp=run.dp, vpp=run.vpp, microbatch_size=run.mb, cp=run.cp,
                           ep=run.ep, zero=run.zero, cp_mode=run.cp_mode, sp=run.tp > 1)
    pred = predict(model, layout, run.batch, run.cluster, software=sw, head_dim=head_dim)
    if run.unit == "tokens/s":
        return pred, pred.breakdown["tokens_per_s_per_gpu"]
    return pred, pred.breakdown["mfu"] * get_cluster(run.cluster).peak_flops / 1e12


def family_comparison(runs: list[PublishedRun] | None = None) -> list[dict]:
    """Each run: published and predicted value, the error, its family and source."""
    rows = []
    for run in (validation_runs() if runs is None else runs):
        pred, value = predict_run(run)
        rows.append({"run": run.run, "family": run.family, "model": run.model, "seq": run.seq, "gpus": run.gpus,
                     "batch": run.batch, "mb": run.mb, "published": run.value, "unit": run.unit, "predicted": value,
                     "error": value / run.value - 1, "source": run.source, "software": run.software,
                     "cluster": run.cluster, "layout": _layout(run)})
    return rows


def _layout(run: PublishedRun) -> str:
    parts = [f"{k}{getattr(run, k)}" for k in ("tp", "pp", "cp", "vpp", "ep", "dp") if getattr(run, k) > 1]
    if run.zero == 3:
        parts.append("FSDP" if run.options.get("fsdp_reshard_after_forward", True) else "FSDP(grad-op)")
    rc = run.options.get("recompute")
    return " ".join(parts + ([f"rc-{rc}"] if rc and rc != "none" else []) + (["FP8"] if run.options.get("fp8") else []))


def group_scores(rows: list[dict]) -> list[dict]:
    """The rule for runs one configuration was published with more than once (item 4 of
    the issue; written before any error was seen): the group of such runs
    (:func:`.published.release_spread`: same model, GPUs, layout, batch, precision and
    routing) scores as one, by how far its single prediction lies beyond the bound any
    prediction must miss by, ``max(0, worst |error| − least_worst_error)``; every other run
    scores its |error|. Returns one entry per scored unit: its runs, family and score."""
    by_run = {r["run"]: r for r in rows}
    grouped, units = set(), []
    for g in release_spread():
        members = [by_run[k] for k in g["runs"] if k in by_run]
        if len(members) < 2:
            continue
        worst = max(abs(r["error"]) for r in members)
        units.append({"runs": [r["run"] for r in members], "family": members[0]["family"],
                      "score": max(0.0, worst - g["least_worst_error"]), "seq": members[0]["seq"],
                      "bound": g["least_worst_error"]})
        grouped.update(r["run"] for r in members)
    units += [{"runs": [r["run"]], "family": r["family"], "score": abs(r["error"]), "seq": r["seq"], "bound": 0.0}
              for r in rows if r["run"] not in grouped]
    return units


def family_summary(rows: list[dict]) -> dict:
    """{family: {"runs", "units", "median", "worst", "long" (units with s ≥ 32k: worst)}} of the
    scores of :func:`group_scores`, and "outside" for every family but Megatron/NeMo."""
    units = group_scores(rows)
    out = {}
    for fam in (*FAMILIES, "outside Megatron/NeMo", "all"):
        sel = [u for u in units if fam == "all" or u["family"] == fam
               or (fam == "outside Megatron/NeMo" and u["family"] != "Megatron/NeMo")]
        if not sel:
            continue
        scores = [u["score"] for u in sel]
        long_ = [u["score"] for u in sel if u["seq"] >= 32768]
        out[fam] = {"runs": sum(len(u["runs"]) for u in sel), "units": len(sel), "median": statistics.median(scores),
                    "worst": max(scores), "long_runs": len(long_), "long_worst": max(long_) if long_ else None}
    return out
