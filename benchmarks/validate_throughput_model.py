"""Print the cluster model's predictions of published runs as Markdown tables.

    .venv/bin/python benchmarks/validate_throughput_model.py [--smoke]

(`--smoke` is accepted for the test suite's benchmark check; nothing here is slow, so it
prints the same tables.)

Nothing is timed: these are the model's predictions (minitron.analysis.published), side
by side with the papers' figures, for the software presets of minitron.analysis.software.
The H100-era table (Llama-family dense models and mixtures of experts, FSDP, context and
expert parallelism, FP8) lists the two runs the H100 constants were fitted on apart from
the runs it validates on, each with its source, then the B200 run the dropless MoE
layer's host time was fitted on, and the configurations several releases published (how
far apart the software alone puts them).
"""
from __future__ import annotations

import argparse

import statistics

from minitron.analysis import published as P
from minitron.analysis import validation as V


def main() -> None:
    ap = argparse.ArgumentParser(description="the cluster model beside published runs")
    ap.add_argument("--smoke", action="store_true", help="the same tables (nothing here is slow)")
    ap.parse_args()
    old, new = P.ptdp_table1_comparison("megatron-2019"), P.ptdp_table1_comparison("ptdp-2021")
    print("| model | GPUs | t | p | batch | published | ptdp-2021 | error | megatron-2019 | error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for o, n in zip(old, new):
        print(f"| {n['model']} | {n['gpus']} | {n['tp']} | {n['pp']} | {n['batch']} | {n['published']} | "
              f"{n['predicted']:.1f} | {n['ratio'] - 1:+.1%} | {o['predicted']:.1f} | {o['ratio'] - 1:+.1%} |")
    for name, rows in (("ptdp-2021", new), ("megatron-2019", old)):
        err = [abs(r["ratio"] - 1) for r in rows]
        print(f"\n{name}: worst |error| {max(err):.1%}, mean {sum(err) / len(err):.1%}")

    print("\n| GPT-3 175B, t=8 p=12, batch 1536 | published | ptdp-2021 |\n|---|---|---|")
    for r in P.gpt3_175b_comparison():
        print(f"| {r['gpus']} GPUs | {r['published']} | {r['predicted']:.1f} |")

    print("\n| 530B on 2240 A100, MFU | published | korthikanti-2022 |\n|---|---|---|")
    for k, r in P.korthikanti_530b_comparison().items():
        label = "full recomputation" if k == "full" else "sequence parallel + selective"
        print(f"| {label} | {r['published']:.1%} | {r['predicted']:.1%} |")

    inter, sg = P.interleaving_gains(), P.scatter_gather_gains()
    print("\n| 175B on 96 GPUs, batch | " + " | ".join(str(b) for b in inter) + " |")
    print("|---|" + "---|" * len(inter))
    print("| interleaved v=2 over 1F1B (paper: 10+ % at small batches) | "
          + " | ".join(f"{g:+.1%}" for g in inter.values()) + " |")
    print("| scatter/gather, interleaved (paper: up to 11 %) | " + " | ".join(f"{g:+.1%}" for g in sg.values()) + " |")

    print("\n| operator fusion | published | ptdp-2021 without / with fusion |\n|---|---|---|")
    for k, (a, b) in P.fusion_gains().items():
        pa, pb = P.PTDP_FUSION_GAINS[k]
        print(f"| {k} | {pa} → {pb} ({pb / pa - 1:+.0%}) | {a:.0f} → {b:.0f} ({b / a - 1:+.0%}) |")
    h100_tables()
    family_tables()
    async_tp_table()


def _layout(r: dict) -> str:
    parts = [f"{k}{r[k]}" for k in ("tp", "pp", "cp", "vpp", "ep", "dp") if r[k] > 1]
    return " ".join(parts + (["FSDP"] if r["zero"] == 3 else []) + (["FP8"] if r["fp8"] else ["BF16"]))


def h100_tables() -> None:
    """The H100-era runs: fitting runs first, then the validation runs with their errors."""
    head = ("| run | model | seq | GPUs | batch | mb | layout | published | predicted | error |\n"
            "|---|---|---|---|---|---|---|---|---|---|")
    for title, rows in (("H100 fitting runs (the two constants were fitted on these; not validation)",
                         P.h100_comparison(P.H100_FITTING_RUNS)),
                        ("H100-era validation runs (h100-dgx, software megatron-core-2024, nothing fitted on them)",
                         P.h100_comparison())):
        print(f"\n{title}:\n\n{head}")
        for r in rows:
            print(f"| {r['run']} | {r['model']} | {r['seq']} | {r['gpus']} | {r['batch']} | {r['mb']} | {_layout(r)} | "
                  f"{r['published']} {r['unit']} | {r['predicted']:.0f} | {r['ratio'] - 1:+.1%} |")
    print("\nSources:")
    for src in dict.fromkeys(r["source"] for r in rows):
        print(f"- {src}")
    first = [r for r in rows if r["run"] in P.H100_RUNS_FIRST_16]
    for label, sel in (("all", rows), ("dense", [r for r in rows if not r["moe"]]),
                       ("MoE", [r for r in rows if r["moe"]]), ("the first 16 runs, all", first),
                       ("the first 16 runs, MoE", [r for r in first if r["moe"]])):
        err = [abs(r["ratio"] - 1) for r in sel]
        print(f"\n{label} ({len(sel)} runs): median |error| {statistics.median(err):.1%}, worst {max(err):.1%}")
    print("\nSoftware beyond megatron-core-2024, as each run's recipe states it:")
    for rid, opts in P.H100_RUN_SOFTWARE.items():
        print(f"- {rid}: {', '.join(f'{k}={v}' for k, v in opts.items())}")
    host_s, gpu_share = P.fit_dropless_moe_host_s()
    print(f"\nHost fitting run (DROPLESS_MOE_HOST_S; a B200 run, not validation): {P.HOST_FITTING_RUN[-1]}, "
          f"{P.HOST_FITTING_RUN[-2]} tokens/s per GPU -> {host_s * 1e3:.2f} ms per layer per microbatch; "
          f"the model's GPU time for it is {gpu_share:.2f} of that")
    print("\nConfigurations published by several releases (the same model, GPUs, layout, batch, precision and "
          "routing; any single prediction's worst |error| on a group is at least the last column):\n")
    print("| model | runs | published | spread | least worst error |\n|---|---|---|---|---|")
    for g in P.release_spread():
        print(f"| {g['model']} | {', '.join(g['runs'])} | {', '.join(map(str, g['values']))} | {g['spread']:.2f}x | "
              f"{g['least_worst_error']:.1%} |")


def family_tables() -> None:
    """Every validation run of every software family (minitron.analysis.validation), its
    error and source, then each family's median and worst scored error (groups of one
    configuration published several times scored by the rule of validation.group_scores)."""
    rows = V.family_comparison()
    sources = list(dict.fromkeys(r["source"] for r in rows))
    print("\nValidation runs by software family (nothing fitted on any; error = predicted/published − 1):\n")
    print("| family | run | model | seq | GPUs | batch | mb | layout | stack | published | predicted | error | source |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['family']} | {r['run']} | {r['model']} | {r['seq']} | {r['gpus']} | {r['batch']} | {r['mb']} | "
              f"{r['layout']} | {r['software']} on {r['cluster']} | {r['published']} {r['unit']} | "
              f"{r['predicted']:.0f} | {r['error']:+.1%} | [{sources.index(r['source']) + 1}] |")
    print("\nSources:")
    for i, src in enumerate(sources, 1):
        print(f"{i}. {src}")
    print("\n| family | runs | scored units | median |error| | worst | runs with s ≥ 32k | their worst |")
    print("|---|---|---|---|---|---|---|")
    for fam, f in V.family_summary(rows).items():
        long_ = f"{f['long_worst']:.1%}" if f["long_worst"] is not None else "-"
        print(f"| {fam} | {f['runs']} | {f['units']} | {f['median']:.1%} | {f['worst']:.1%} | {f['long_runs']} | "
              f"{long_} |")
    print("\nGroups scored by the published bound (worst |error| beyond the least any one prediction can have):\n")
    print("| runs | least worst error | score |\n|---|---|---|")
    for u in V.group_scores(rows):
        if len(u["runs"]) > 1:
            print(f"| {', '.join(u['runs'])} | {u['bound']:.1%} | {u['score']:.1%} |")


def async_tp_table() -> None:
    """Published async-TP speed-ups beside the model's (async TP priced from its decomposition:
    cluster._async_tp_stage_s, software.ASYNC_TP)."""
    print("\nAsync TP over vanilla TP (torchtitan's published comparisons; the model prices both layouts):\n")
    rows = V.async_tp_speedups()
    sources = list(dict.fromkeys(r["source"] for r in rows))
    print("| model | GPUs | quantization | published speed-up | predicted | error | vanilla TP error | source |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in rows:
        flag = " (baseline flagged)" if r["flagged"] else ""
        print(f"| {r['model']} | {r['gpus']} | {r['quantization']}{flag} | {r['published']:.3f} | {r['predicted']:.3f} | "
              f"{r['predicted'] / r['published'] - 1:+.1%} | {r['vanilla_error']:+.1%} | "
              f"[{sources.index(r['source']) + 1}] |")
    print("\nSources:")
    for i, src in enumerate(sources, 1):
        print(f"{i}. {src}")


if __name__ == "__main__":
    main()
