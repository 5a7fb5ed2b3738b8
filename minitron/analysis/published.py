"""Published training runs and the cluster model's predictions of them, side by side.

None of the A100-era figures was used to fit the model: its constants come from
Megatron-LM 2019 on V100s alone (:mod:`.cluster`). What moves the predictions from one
system to the next is the software stack (:mod:`.software`), described from the papers,
not tuned. The H100 era adds two fitted constants, each fitted on one published run
listed in :data:`H100_FITTING_RUNS` and never among the validation runs
:data:`H100_RUNS` (:func:`fit_h100_constants` re-derives them; what a run's recipe states
beyond the preset, such as the expert all-to-all overlap, is in :data:`H100_RUN_SOFTWARE`): Llama-family dense models (NeMo 24.07 and Megatron-Bridge tables on
DGX-H100, the Llama 3 paper's Table 4) and Qwen3 mixtures of experts (Megatron-Bridge),
with FSDP, context and expert parallelism and FP8, compared in tokens/s per GPU (the
Llama 3 rows in model TFLOP/s per GPU).

* PTD-P (Narayanan et al. 2021) Table 1: GPT models of 1.7B–1T parameters on DGX A100s,
  sequence 2048, vocabulary 51200, full recomputation, at the published (t, p, global
  batch); the microbatch size is not in the table, we take 1.
* PTD-P §5.2 (Table 2): GPT-3 175B (t = 8, p = 12, global batch 1536) on 384, 768 and
  1536 GPUs.
* Korthikanti et al. 2022: the 530B model (105 layers, h = 20480, 128 heads) on 2240
  A100s (t = 8, p = 35, d = 8; global batch 2240 and microbatch 1 assumed), MFU 42.1 %
  with full recomputation, 54.2 % with sequence parallelism and selective recomputation.
* PTD-P's gains, as the paper states them: the interleaved schedule (§5.4, GPT-3 175B on
  96 GPUs: over 10 % at small batches, closing as the batch grows), the scatter/gather
  optimisation (§5.8, same model: up to 11 % for the interleaved schedule at large
  batches), and operator fusion (§5.9: 175B from 113 to 135 TFLOP/s per GPU, +19 %;
  530B from 133 to 148, +11 %).
* PTD-P §5.2 (Table 2): ZeRO-3 without model parallelism against PTD-P, GPT-3 175B and the
  530B model, the global batch fixed as the GPU count doubles (TFLOP/s per GPU; the
  paper's text: PTD-P ahead by 6 % and 24 % at the smallest counts, by 70 % for both
  models once the GPUs are doubled).
* Bian et al. 2021 (3-D tensor parallelism): on 64 V100s of TACC Longhorn, 3-D is 2.32×
  faster than 1-D and 1.57× faster than 2-D (strong scaling).
"""
from __future__ import annotations

from ..config import ModelConfig
from .cluster import DROPLESS_MOE_HOST_S, PlannedLayout, get_cluster, predict
from .software import Software, get_software

__all__ = ["fit_h100_constants", "H100_RUNS", "H100_FITTING_RUNS", "H100_RUN_SOFTWARE", "H100_RUNS_FIRST_16", "h100_era_model", "h100_run_prediction", "h100_comparison",
           "PTDP_TABLE1", "PTDP_GPT3_175B", "KORTHIKANTI_530B_MFU", "PTDP_FUSION_GAINS", "ptdp_model",
           "gpt3_175b", "gpt_530b", "ptdp_table1_comparison", "gpt3_175b_comparison",
           "korthikanti_530b_comparison", "interleaving_gains", "scatter_gather_gains", "fusion_gains",
           "PTDP_VS_ZERO3", "BIAN_2021_SPEEDUPS"]

# billions of parameters, heads, hidden, layers, t, p, GPUs, global batch, TFLOP/s per GPU
PTDP_TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
PTDP_GPT3_175B = [(384, 153), (768, 149), (1536, 141)]  # GPUs, TFLOP/s per GPU; batch 1536
KORTHIKANTI_530B_MFU = {"full": 0.421, "selective": 0.542}
PTDP_FUSION_GAINS = {"175B": (113, 135), "530B": (133, 148)}  # TFLOP/s without, with fusion
# PTD-P Table 2: {model: {scheme: [(GPUs, global batch, microbatch, TFLOP/s per GPU)]}};
# PTD-P at t = 8 and p = 12 (175B) or p = 35 (530B), ZeRO-3 with d = GPUs
PTDP_VS_ZERO3 = {
    "175B": {"ptdp": [(n, 1536, 1, tflops) for n, tflops in PTDP_GPT3_175B],
             "zero3": [(384, 1536, 4, 144), (768, 1536, 2, 88), (1536, 1536, 1, 44)]},
    "530B": {"ptdp": [(560, 2240, 1, 171), (1120, 2240, 1, 167), (2240, 2240, 1, 159)],
             "zero3": [(640, 2560, 4, 138), (1120, 2240, 2, 98), (2240, 2240, 1, 48)]},
}
BIAN_2021_SPEEDUPS = {"1d": 2.32, "2d": 1.57}  # 3-D's speed-up over each, 64 V100s


def ptdp_model(heads: int, hidden: int, layers: int) -> ModelConfig:
    """A GPT of PTD-P's evaluation: sequence 2048, vocabulary 51200."""
    return ModelConfig(layers=layers, hidden=hidden, heads=heads, seq_len=2048, vocab=51200)


def gpt3_175b() -> ModelConfig:
    return ptdp_model(96, 12288, 96)


def gpt_530b() -> ModelConfig:
    return ptdp_model(128, 20480, 105)


def ptdp_table1_comparison(software: str | Software | None = "ptdp-2021", cluster="a100-dgx") -> list[dict]:
    """Every row of PTD-P Table 1: published and predicted TFLOP/s per GPU, their ratio,
    the predicted memory per GPU."""
    rows = []
    for billions, a, h, l, t, p, n, batch, published in PTDP_TABLE1:
        pred = predict(ptdp_model(a, h, l), PlannedLayout(tp=t, pp=p, dp=n // (t * p)), batch, cluster,
                       software=software)
        rows.append({"model": f"{billions}B", "gpus": n, "tp": t, "pp": p, "batch": batch,
                     "published": published, "predicted": pred.tflops_per_gpu,
                     "ratio": pred.tflops_per_gpu / published, "memory_gb": pred.memory_gb_per_gpu})
    return rows


def gpt3_175b_comparison(software: str | Software | None = "ptdp-2021", cluster="a100-dgx") -> list[dict]:
    """PTD-P §5.2: GPT-3 175B at t = 8, p = 12, batch 1536 on 384, 768 and 1536 GPUs."""
    rows = []
    for n, published in PTDP_GPT3_175B:
        pred = predict(gpt3_175b(), PlannedLayout(tp=8, pp=12, dp=n // 96), 1536, cluster, software=software)
        rows.append({"gpus": n, "published": published, "predicted": pred.tflops_per_gpu,
                     "ratio": pred.tflops_per_gpu / published})
    return rows


def korthikanti_530b_comparison(software: str | Software | None = "korthikanti-2022",
                                cluster="a100-dgx") -> dict:
    """MFU (model FLOPs, no recomputation counted, over the peak) of the 530B run on 2240
    GPUs: full recomputation without sequence parallelism vs sequence parallelism with
    selective recomputation, predicted and published."""
    model, n = gpt_530b(), 2240
    out = {}
    for policy, sp in (("full", False), ("selective", True)):
        pred = predict(model, PlannedLayout(tp=8, pp=35, dp=8, sp=sp), n, cluster, recompute=policy, software=software)
        out[policy] = {"predicted": pred.breakdown["mfu"], "published": KORTHIKANTI_530B_MFU[policy],
                       "memory_gb": pred.memory_gb_per_gpu}
    return out


def _gain(model, layout_a, layout_b, batch, cluster, sw_a, sw_b) -> float:
    a = predict(model, layout_a, batch, cluster, software=sw_a).tflops_per_gpu
    b = predict(model, layout_b, batch, cluster, software=sw_b).tflops_per_gpu
    return b / a - 1


def interleaving_gains(batches=(12, 24, 36, 48, 60), software="ptdp-2021", cluster="a100-dgx") -> dict:
    """PTD-P §5.4: GPT-3 175B on 96 GPUs (t = 8, p = 12): the interleaved schedule (v = 2,
    with scatter/gather) over 1F1B, by global batch."""
    m = gpt3_175b()
    return {B: _gain(m, PlannedLayout(tp=8, pp=12), PlannedLayout(tp=8, pp=12, vpp=2), B, cluster, software, software)
            for B in batches}


def scatter_gather_gains(batches=(12, 24, 36, 48, 60), software="ptdp-2021", cluster="a100-dgx") -> dict:
    """PTD-P §5.8: the same model and GPUs, interleaved (v = 2): scatter/gather over plain
    sends of the full activation, by global batch."""
    m = gpt3_175b()
    return {B: _gain(m, PlannedLayout(tp=8, pp=12, vpp=2, scatter_gather=False), PlannedLayout(tp=8, pp=12, vpp=2), B,
                     cluster, software, software) for B in batches}


def fusion_gains(software="ptdp-2021", cluster="a100-dgx") -> dict:
    """PTD-P §5.9: the software with and without its fused kernels (unfused softmax,
    bias + dropout + add and bias + GeLU), everything else equal. The paper does not give
    the layouts; we take the 175B run on 384 GPUs and the 530B run on 560 (t = 8, p = 35,
    batch 2240, as in its Table 2). Returns {model: (without, with) TFLOP/s per GPU}."""
    sw = get_software(software)
    unfused = sw.replace(name=f"{sw.name} unfused", attention="unfused", fused_bias_gelu=False,
                         fused_bias_dropout_add=False)
    out = {}
    for name, model, layout, batch in (("175B", gpt3_175b(), PlannedLayout(tp=8, pp=12, dp=4), 1536),
                                       ("530B", gpt_530b(), PlannedLayout(tp=8, pp=35, dp=2), 2240)):
        out[name] = tuple(predict(model, layout, batch, cluster, software=s).tflops_per_gpu
                          for s in (unfused, sw))
    return out


# --------------------------------------------------------------------------------------
# The H100 era: Llama-family dense models and mixtures of experts
# --------------------------------------------------------------------------------------
# Shapes of the published models the runs below train (each from its model card or
# paper); Llama 3 8B / 70B / 405B are minitron's presets (Grattafiori et al. 2024, Table 3).
_LLAMA = dict(norm="rmsnorm", activation="swiglu", positions="rope", bias=False, tied_embeddings=False)


def h100_era_model(name: str) -> tuple[ModelConfig, int | None]:
    """(ModelConfig, head width) of a model of the H100-era runs; the head width is given
    where it is not hidden/heads (Qwen3), else None."""
    from ..config import PRESETS

    if name in ("llama3-8b", "llama3-70b", "llama3-405b"):
        return PRESETS[name], None
    shapes = {
        # Llama 2 (Touvron et al. 2023, Table 1 and the released configs): MHA at 7B and 13B, GQA at 70B
        "llama2-7b": (dict(layers=32, hidden=4096, heads=32, ffn=11008, seq_len=4096, vocab=32000, **_LLAMA), None),
        "llama2-13b": (dict(layers=40, hidden=5120, heads=40, ffn=13824, seq_len=4096, vocab=32000, **_LLAMA), None),
        "llama2-70b": (dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, seq_len=4096, vocab=32000,
                            **_LLAMA), None),
        # Qwen3 MoE (Qwen3 technical report, Yang et al. 2025, Table 2; the released configs):
        # 128 experts, top-8, no shared expert, head width 128 (so heads·128 ≠ hidden)
        "qwen3-30b-a3b": (dict(layers=48, hidden=2048, heads=32, kv_heads=4, ffn=6144, seq_len=4096, vocab=151936,
                               experts=128, top_k=8, moe_ffn=768, **_LLAMA), 128),
        "qwen3-235b-a22b": (dict(layers=94, hidden=4096, heads=64, kv_heads=4, ffn=12288, seq_len=4096,
                                 vocab=151936, experts=128, top_k=8, moe_ffn=1536, **_LLAMA), 128),
        # NeMo's GPT-3 5B (24 layers, h 4096, 32 heads, s 2048): a fitting run only
        "gpt3-5b": (dict(layers=24, hidden=4096, heads=32, seq_len=2048, vocab=51200), None),
    }
    kw, head_dim = shapes[name]
    return ModelConfig(name=name, **kw), head_dim


# Each run: (id, model, seq_len, GPUs, global batch, microbatch, tp, pp, cp, vpp, ep, zero,
#            cp_mode, fp8, published value, unit, source). dp = GPUs/(tp·pp·cp). Unit
# "tokens/s" is tokens per second per GPU; "TFLOP/s" is model FLOP/s per GPU
# (transformer_flops_per_iteration without recomputation, the whole attention square:
# 430 TFLOP/s is 43 % of 989, the MFU the Llama 3 paper states beside it).
NEMO_2407 = ("NeMo 24.07 performance summary, DGX-H100, FP8 (github.com/NVIDIA/NeMo "
             "docs/source/performance/performance_summary.md, 2024-08)")
BRIDGE_2511 = ("Megatron-Bridge performance summary, NeMo 25.11 container, DGX-H100 (github.com/NVIDIA-NeMo/"
               "Megatron-Bridge docs/performance-summary.md)")
BRIDGE_2602 = ("Megatron-Bridge performance summary archive, NeMo 26.02 container, DGX-H100 "
               "(docs/performance-summary-archive.md; MoE force-balanced, dropless)")
BRIDGE_2509 = ("Megatron-Bridge performance summary archive, NeMo 25.09 container, DGX-H100, token-dropping "
               "MoE (precision not in the table; FP8 per its footnote on H100 quantization)")
LLAMA3_T4 = "Llama 3 paper (Grattafiori et al. 2024, arXiv 2407.21783), Table 4, BF16 on H100"
H100_RUNS = [
    ("nemo-llama3-8b-cp2", "llama3-8b", 8192, 8, 128, 1, 1, 1, 2, 1, 1, 1, "ring", True, 12036, "tokens/s", NEMO_2407),
    ("nemo-llama3-70b-cp2", "llama3-70b", 8192, 64, 128, 1, 4, 4, 2, 5, 1, 1, "ring", True, 1533, "tokens/s",
     NEMO_2407),
    ("nemo-llama2-7b", "llama2-7b", 4096, 8, 128, 1, 1, 1, 1, 1, 1, 1, "ring", True, 16847, "tokens/s", NEMO_2407),
    ("nemo-llama2-13b", "llama2-13b", 4096, 16, 128, 1, 1, 4, 1, 10, 1, 1, "ring", True, 8646, "tokens/s",
     NEMO_2407),
    ("nemo-llama2-70b", "llama2-70b", 4096, 64, 128, 1, 4, 4, 1, 20, 1, 1, "ring", True, 1707, "tokens/s",
     NEMO_2407),
    ("bridge-llama3-8b-fsdp", "llama3-8b", 8192, 8, 128, 1, 1, 1, 1, 1, 1, 3, "ring", True, 14451, "tokens/s",
     BRIDGE_2511),
    ("bridge-llama3-70b", "llama3-70b", 8192, 64, 128, 1, 4, 8, 1, 5, 1, 1, "ring", True, 1602, "tokens/s",
     BRIDGE_2511),
    ("bridge-llama31-405b-cp2", "llama3-405b", 8192, 1024, 512, 1, 8, 8, 2, 8, 1, 1, "ring", True, 292, "tokens/s",
     BRIDGE_2511),
    ("llama3-405b-16k", "llama3-405b", 8192, 16384, 2048, 1, 8, 16, 1, 2, 1, 1, "ring", False, 400, "TFLOP/s",
     LLAMA3_T4),
    ("llama3-405b-16k-cp16", "llama3-405b", 131072, 16384, 128, 1, 8, 16, 16, 2, 1, 1, "allgather", False, 380,
     "TFLOP/s", LLAMA3_T4),
    ("bridge-qwen3-30b-a3b-2509-drop", "qwen3-30b-a3b", 4096, 16, 512, 2, 1, 2, 1, 24, 8, 1, "ring", True, 10494,
     "tokens/s", BRIDGE_2509),
    ("bridge-qwen3-235b-a22b-2509-drop", "qwen3-235b-a22b", 4096, 256, 2048, 1, 2, 8, 1, 4, 32, 1, "ring", True,
     1204, "tokens/s", BRIDGE_2509),
    ("bridge-qwen3-30b-a3b", "qwen3-30b-a3b", 4096, 16, 512, 2, 1, 2, 1, 24, 8, 1, "ring", True, 5275, "tokens/s",
     BRIDGE_2511),
    ("bridge-qwen3-30b-a3b-2602", "qwen3-30b-a3b", 4096, 16, 1024, 1, 1, 2, 1, 12, 8, 1, "ring", True, 5113,
     "tokens/s", BRIDGE_2602),
    ("bridge-qwen3-235b-a22b", "qwen3-235b-a22b", 4096, 256, 2048, 1, 2, 8, 1, 4, 32, 1, "ring", True, 1575,
     "tokens/s", BRIDGE_2511),
    ("bridge-qwen3-235b-a22b-2602", "qwen3-235b-a22b", 4096, 256, 8192, 1, 2, 8, 1, 4, 32, 1, "ring", True, 1633,
     "tokens/s", BRIDGE_2602),
]
# Later Megatron-Bridge containers, the same tables (performance-summary-archive.md, DGX-H100,
# FP8, force-balanced and dropless): the 26.02.01 patch release ran Qwen3 30B-A3B on the very
# layout of the 26.02 row (pp 2, vp 12, ep 8, GBS 1024, MBS 1) at 9,058 tokens/s instead of
# 5,113, and the 26.04 release on pp 1, ep 16 with HybridEP (the recipe's
# moe_flex_dispatcher_backend="hybridep", no all-to-all overlap).
BRIDGE_260201 = ("Megatron-Bridge performance summary archive, NeMo 26.02.01 container, DGX-H100 "
                 "(docs/performance-summary-archive.md; MoE force-balanced, dropless)")
BRIDGE_2604 = ("Megatron-Bridge performance summary archive, NeMo 26.04 container, DGX-H100 "
               "(docs/performance-summary-archive.md; MoE force-balanced, dropless)")
H100_RUNS += [
    ("bridge-qwen3-30b-a3b-260201", "qwen3-30b-a3b", 4096, 16, 1024, 1, 1, 2, 1, 12, 8, 1, "ring", True, 9058,
     "tokens/s", BRIDGE_260201),
    ("bridge-qwen3-235b-a22b-260201", "qwen3-235b-a22b", 4096, 256, 8192, 1, 2, 8, 1, 4, 32, 1, "ring", True, 1611,
     "tokens/s", BRIDGE_260201),
    ("bridge-qwen3-30b-a3b-2604-ep16", "qwen3-30b-a3b", 4096, 16, 1024, 1, 1, 1, 1, 1, 16, 1, "ring", True, 8901,
     "tokens/s", BRIDGE_2604),
    ("bridge-qwen3-235b-a22b-2604", "qwen3-235b-a22b", 4096, 256, 8192, 1, 2, 8, 1, 4, 32, 1, "ring", True, 1686,
     "tokens/s", BRIDGE_2604),
]
# Later releases of the configurations above (the same archive, DGX-H100, FP8): Llama 3
# 70B at GBS 256 and Llama 3.1 405B at GBS 1,536 (the 25.11 rows ran 128 and 512), and
# Qwen3 at the 26.04 layouts. A row per release: the spread between releases of one
# configuration is what the tables' software changes alone (release_spread).
BRIDGE_2604_01 = ("Megatron-Bridge performance summary archive, NeMo 26.04.01 container, DGX-H100 "
                  "(docs/performance-summary-archive.md; MoE force-balanced, dropless)")
BRIDGE_2606 = ("Megatron-Bridge performance summary archive, NeMo 26.06 container, DGX-H100 "
               "(docs/performance-summary-archive.md; MoE force-balanced, dropless)")
# (model, seq, GPUs, batch, MBS, tp, pp, cp, vpp, ep, zero, cp kind, FP8) of each configuration
_LLAMA3_70B_GBS256 = ("llama3-70b", 8192, 64, 256, 1, 4, 8, 1, 5, 1, 1, "ring", True)
_LLAMA31_405B_GBS1536 = ("llama3-405b", 8192, 1024, 1536, 1, 8, 8, 2, 8, 1, 1, "ring", True)
_QWEN3_30B_EP16 = ("qwen3-30b-a3b", 4096, 16, 1024, 1, 1, 1, 1, 1, 16, 1, "ring", True)
_QWEN3_235B_GBS8192 = ("qwen3-235b-a22b", 4096, 256, 8192, 1, 2, 8, 1, 4, 32, 1, "ring", True)
H100_RUNS += [(rid, *config, value, "tokens/s", source) for rid, config, value, source in (
    ("bridge-llama3-70b-2602", _LLAMA3_70B_GBS256, 1621, BRIDGE_2602),
    ("bridge-llama31-405b-cp2-2602", _LLAMA31_405B_GBS1536, 311, BRIDGE_2602),
    ("bridge-llama3-70b-260201", _LLAMA3_70B_GBS256, 1639, BRIDGE_260201),
    ("bridge-llama3-70b-2604", _LLAMA3_70B_GBS256, 1633, BRIDGE_2604),
    ("bridge-llama3-70b-260401", _LLAMA3_70B_GBS256, 1664, BRIDGE_2604_01),
    ("bridge-llama31-405b-cp2-260401", _LLAMA31_405B_GBS1536, 328, BRIDGE_2604_01),
    ("bridge-qwen3-30b-a3b-260401-ep16", _QWEN3_30B_EP16, 8960, BRIDGE_2604_01),
    ("bridge-qwen3-235b-a22b-260401", _QWEN3_235B_GBS8192, 1712, BRIDGE_2604_01),
    ("bridge-llama31-405b-cp2-2606", _LLAMA31_405B_GBS1536, 326, BRIDGE_2606),
    ("bridge-qwen3-30b-a3b-2606-ep16", _QWEN3_30B_EP16, 8826, BRIDGE_2606),
)]
# The 16 runs reported before the expert-parallel overlap was modelled (the before/after
# comparison of benchmarks/RESULTS.md reads them).
H100_RUNS_FIRST_16 = tuple(r[0] for r in H100_RUNS[:16])
# What each run's recipe states beyond the megatron-core-2024 preset (Software fields).
# moe_a2a_overlap=True (Megatron-Core's overlap_moe_expert_parallel_comm: one microbatch's
# all-to-alls under another's compute) is in the Bridge's H100 Qwen3 presets
# (scripts/performance/configs/qwen/qwen3_workload_base_configs.py, QWEN3_30B_A3B_ and
# QWEN3_235B_A22B_PRETRAIN_CONFIG_H100_*, from the 25.11 container's recipes, Dec 2025, on;
# the 26.04 235B recipe src/megatron/bridge/perf_recipes/qwen/h100/qwen3_moe.py keeps it,
# the 26.04 30B one on ep 16 sets it False). The 25.09 token-dropping runs came from
# scripts/performance/run_script.py of Oct 2025, which does not set it.
H100_RUN_SOFTWARE = {rid: {"ep_overlap": True} for rid in (
    "bridge-qwen3-30b-a3b", "bridge-qwen3-30b-a3b-2602", "bridge-qwen3-235b-a22b", "bridge-qwen3-235b-a22b-2602",
    "bridge-qwen3-30b-a3b-260201", "bridge-qwen3-235b-a22b-260201", "bridge-qwen3-235b-a22b-2604",
    "bridge-qwen3-235b-a22b-260401")}
# the 30B recipes on ep 16 from 26.04 on (perf_recipes/qwen/h100/qwen3_moe.py, fp8cs; the
# QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_FP8_CS_V1 of v0.4.0 to v0.5.0): moe_token_dispatcher_type
# "flex" with moe_flex_dispatcher_backend "hybridep" (node-aware), moe_a2a_overlap False
for _rid in ("bridge-qwen3-30b-a3b-2604-ep16", "bridge-qwen3-30b-a3b-260401-ep16", "bridge-qwen3-30b-a3b-2606-ep16"):
    H100_RUN_SOFTWARE[_rid] = {"ep_node_dedup": True}
# FP8 with current scaling: the 25.11 table's "FP8-CS", and the Bridge's H100 FP8 presets
# after it (QWEN3_*_H100_FP8_CS_*, the *_h100_fp8cs_config recipes). NeMo 24.07 and the
# 25.09 run script (scripts/performance/run_script.py, --fp8_recipe default "ds") ran
# delayed scaling, the preset's default.
# Every Bridge MoE run from 25.11 on is dropless (the tables' footnote): its layers take at
# least the host's DROPLESS_MOE_HOST_S each per microbatch (fitted on a B200 run:
# fit_dropless_moe_host_s). The 25.09 runs dropped tokens: no host time is known for them.
_DROPLESS_SOURCES = (BRIDGE_2511, BRIDGE_2602, BRIDGE_260201, BRIDGE_2604, BRIDGE_2604_01, BRIDGE_2606)


def _dropless_moe(run: tuple) -> bool:
    """Whether a run trained a mixture of experts without dropping tokens (its table says so)."""
    return run[16] in _DROPLESS_SOURCES and bool(h100_era_model(run[1])[0].experts)


for _r in H100_RUNS:
    _opts = H100_RUN_SOFTWARE.get(_r[0], {})
    if _r[16] in _DROPLESS_SOURCES and _r[13]:
        _opts = {**_opts, "fp8_recipe": "tensorwise"}
    if _dropless_moe(_r):
        _opts = {**_opts, "moe_host_s": DROPLESS_MOE_HOST_S}
    if _opts:
        H100_RUN_SOFTWARE[_r[0]] = _opts
# The runs the two H100 constants of minitron.analysis.cluster were fitted on: never
# reported as validation. Same fields.
H100_FITTING_RUNS = [
    ("llama3-405b-8k", "llama3-405b", 8192, 8192, 2048, 1, 8, 16, 1, 2, 1, 1, "ring", False, 430, "TFLOP/s",
     LLAMA3_T4 + ", first row (fits H100_GEMM_MAX_EFFICIENCY)"),
    ("nemo-gpt3-5b", "gpt3-5b", 2048, 64, 2048, 4, 1, 1, 1, 1, 1, 1, "ring", True, 22521, "tokens/s",
     NEMO_2407 + " (fits H100_FP8_GEMM_MAX_EFFICIENCY)"),
]
# The software of every run: Megatron-Core of 2024-2025 (the NeMo and Bridge recipes; the
# Llama 3 paper's own stack is taken to be alike: flash attention, overlapped
# communication, no recomputation at these batch sizes). The Llama 3 paper does not
# state its interleaving degree: v = 2 for its three rows, chosen with the fitting row.
H100_SOFTWARE = "megatron-core-2024"


def h100_run(run_id: str) -> tuple:
    """The published H100-era run (validation or fitting) with this id; KeyError naming the
    ids there are otherwise."""
    runs = {r[0]: r for r in H100_RUNS + H100_FITTING_RUNS}
    if run_id not in runs:
        raise KeyError(f"unknown published run '{run_id}': choose one of {', '.join(runs)}")
    return runs[run_id]


def h100_run_prediction(run: tuple, cluster: str = "h100-dgx", software: str | Software = H100_SOFTWARE,
                        moe_imbalance: float = 0.0):
    """(layout, Prediction, predicted value in the run's unit) of one H100-era run."""
    (_, name, seq, n, batch, mb, t, p, cp, v, ep, zero, cp_mode, fp8, _, unit, _) = run
    model, head_dim = h100_era_model(name)
    model = model.replace(seq_len=seq)
    sw = get_software(software).replace(fp8=fp8, **H100_RUN_SOFTWARE.get(run[0], {}))
    layout = PlannedLayout(tp=t, pp=p, dp=n // (t * p * cp), vpp=v, microbatch_size=mb, cp=cp, ep=ep, zero=zero,
                           cp_mode=cp_mode, sp=t > 1)
    pred = predict(model, layout, batch, cluster, software=sw, head_dim=head_dim, moe_imbalance=moe_imbalance)
    if unit == "tokens/s":
        return layout, pred, pred.breakdown["tokens_per_s_per_gpu"]
    return layout, pred, pred.breakdown["mfu"] * get_cluster(cluster).peak_flops / 1e12  # model TFLOP/s


def h100_comparison(runs: list | None = None, **kw) -> list[dict]:
    """Every H100-era run (default :data:`H100_RUNS`): published and predicted value,
    their ratio, what the run exercises (MoE, context parallel, FSDP, FP8) and its source."""
    rows = []
    for run in (H100_RUNS if runs is None else runs):
        layout, pred, value = h100_run_prediction(run, **kw)
        (rid, name, seq, n, batch, mb, t, p, cp, v, ep, zero, cp_mode, fp8, published, unit, source) = run
        rows.append({"run": rid, "model": name, "seq": seq, "gpus": n, "batch": batch, "mb": mb, "tp": t, "pp": p,
                     "cp": cp, "vpp": v, "ep": ep, "dp": n // (t * p * cp), "zero": zero, "fp8": fp8,
                     "moe": ep > 1 or "a3b" in name or "a22b" in name, "published": published, "unit": unit,
                     "predicted": value, "ratio": value / published, "source": source,
                     "memory_gb": pred.memory_gb_per_gpu})
    return rows


def fit_h100_constants() -> tuple[float, float]:
    """Re-derive the two fitted H100 constants of :mod:`.cluster` from their fitting runs
    (:data:`H100_FITTING_RUNS`, in order): the bf16 GEMM ceiling that makes the Llama 3
    405B row predict its 430 TFLOP/s, then, with it, the FP8 ceiling that makes NeMo's
    GPT-3 5B predict its 22,521 tokens/s (bisection; a prediction rises with its ceiling)."""
    from dataclasses import replace

    base = get_cluster("h100-dgx")

    def solve(run, field, fixed):
        lo, hi = 0.2, 1.0
        for _ in range(24):
            mid = (lo + hi) / 2
            value = h100_run_prediction(run, cluster=replace(base, **{field: mid}, **fixed))[2]
            lo, hi = (mid, hi) if value < run[14] else (lo, mid)
        return (lo + hi) / 2

    bf16 = solve(H100_FITTING_RUNS[0], "gemm_max_efficiency", {})
    return bf16, solve(H100_FITTING_RUNS[1], "fp8_gemm_max_efficiency", {"gemm_max_efficiency": bf16})


# The run DROPLESS_MOE_HOST_S was fitted on (a B200, so never an H100 validation run):
# (model, seq, GPUs, MBS, EP, PP, tokens/s per GPU, source), and the B200's dense FP8
# peak (4.5 PFLOP/s, the DGX B200 datasheet; the H100's is h100-dgx's fp8_peak_flops).
HOST_FITTING_RUN = ("qwen3-30b-a3b", 4096, 8, 1, 8, 1, 9691,
                    "Megatron-Bridge performance summary archive, NeMo 26.02 container, DGX-B200, FP8 (MXFP8), "
                    "MBS 1, EP 8, dropless")
B200_FP8_PEAK_FLOPS = 4.5e15


def fit_dropless_moe_host_s() -> tuple[float, float]:
    """(host seconds per MoE layer per microbatch, GPU share) from :data:`HOST_FITTING_RUN`.

    Taken to be host-bound, the run spends seq·MBS / (tokens/s per GPU) per microbatch on
    its layers; the host seconds are that over the layers one GPU runs (PP 1: all). The
    GPU share checks the assumption: this model's GPU time for the same microbatch on an
    H100 (FP8, the layout's all-to-alls included, no host limit), over the B200's FP8
    peak ratio, as a fraction of that time. Well under 1: the GPU was not the limit."""
    name, seq, gpus, mb, ep, pp, tokens_per_s, _ = HOST_FITTING_RUN
    model, head_dim = h100_era_model(name)
    model = model.replace(seq_len=seq)
    per_microbatch = seq * mb / tokens_per_s
    host_s = per_microbatch / (model.layers // pp)
    sw = get_software(H100_SOFTWARE).replace(fp8=True, fp8_recipe="mxfp8")
    layout = PlannedLayout(pp=pp, dp=gpus // pp, ep=ep, microbatch_size=mb)
    pred = predict(model, layout, gpus // pp * mb * 64, "h100-dgx", software=sw, head_dim=head_dim)
    h100_over_b200 = get_cluster("h100-dgx").fp8_peak_flops / B200_FP8_PEAK_FLOPS
    gpu_s = pred.iteration_s / pred.breakdown["microbatches"] * h100_over_b200
    return host_s, gpu_s / per_microbatch


def _configuration(run: tuple) -> tuple:
    """What the tables state of a run, and so all a model of the hardware and the layout
    is given: model, seq, GPUs, batch, MBS, tp, pp, cp, vpp, ep, zero, cp kind, FP8, and
    whether its MoE layers were dropless."""
    return (*run[1:14], _dropless_moe(run))


def release_spread(runs: list | None = None) -> list[dict]:
    """Configurations published by more than one release (default :data:`H100_RUNS`): the
    same model, GPUs, layout, batch, precision and routing (:func:`_configuration`), so the
    same prediction from any model of what the tables state. For each: its runs, the lowest and highest published figure,
    and the least worst |error| any single prediction P can have on them,
    (hi − lo)/(hi + lo), at P = 2·lo·hi/(lo + hi) (there P/lo − 1 = 1 − P/hi)."""
    groups: dict = {}
    for run in (H100_RUNS if runs is None else runs):
        groups.setdefault(_configuration(run), []).append(run)
    out = []
    for config, members in groups.items():
        if len(members) < 2:
            continue
        values = [r[14] for r in members]
        lo, hi = min(values), max(values)
        out.append({"model": config[0], "runs": [r[0] for r in members], "values": values, "low": lo, "high": hi,
                    "spread": hi / lo, "least_worst_error": (hi - lo) / (hi + lo)})
    return out
