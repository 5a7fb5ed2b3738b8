"""1-D, 2-D, 2.5-D and 3-D tensor parallelism on the same 8 ranks: bytes per device,
measured and predicted, and the cost model's projection to the 64 V100s of Bian et al.

For each model, every layout trains the same GPT (same seed, same batches) for a few
steps in ONE start of 8 ranks (each layout builds its own process groups on the same
world); rank 0's communication trace of the last step gives the *measured* call bytes
per axis and operation and their wire bytes, printed next to the *predicted* ones
(:func:`minitron.analysis.comm.comm_bytes_per_step` for 1-D,
:func:`minitron.analysis.summa.summa_comm_bytes_per_step` for 2-D and 2.5-D,
:func:`minitron.analysis.cube.cube_comm_bytes_per_step` for 3-D). Parameter bytes (the
local shards) and activation bytes (what autograd saves for one microbatch's forward,
parameters excluded, each storage once) are measured and predicted the same way. Step
times are for information only (a shared 2-core CPU says little about a GPU cluster).

The layouts of 8 ranks: 1-D ``--tp 8``; 2-D ``--tp 4 --tp-mode 2d --dp 2`` (8 is not a
square: the q = 2 grid twice, data parallel); 2.5-D ``--tp 8 --tp-mode 2.5d
--tp-depth 2`` (q = 2, d = 2); 3-D ``--tp 8 --tp-mode 3d`` (q = 2).
Then :func:`minitron.analysis.tp_schemes.project_tp_schemes` projects one layer's
time onto 64 GPUs: TACC Longhorn (where the paper measured; 4 V100s per node) and a
DGX-2H cluster (16 per node).

    python benchmarks/tp_schemes.py            # writes benchmarks/tp_schemes.md
    python benchmarks/tp_schemes.py --ranks 16 # 1-D t=16, 2-D q=4, 2.5-D q=2 d=4, 3-D q=2 x dp2
    python benchmarks/tp_schemes.py --smoke    # tiny model, one step, nothing written
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from harness import bytes_by_axis_op, measure_trainer, measured_wire_bytes, predicted  # noqa: E402
from minitron.config import ModelConfig, ParallelConfig, TrainConfig, validate  # noqa: E402
from minitron.tools.testing import run_on_ranks  # noqa: E402

# many tokens and a narrow hidden size (activations dominate), and few tokens with a wide one
MODELS = {
    "tokens": (ModelConfig(layers=2, hidden=64, heads=16, seq_len=64, vocab=256, name="tokens"), 16),
    "weights": (ModelConfig(layers=2, hidden=256, heads=16, seq_len=16, vocab=256, name="weights"), 16),
}
SMOKE = {"tiny": (ModelConfig(layers=1, hidden=16, heads=8, seq_len=8, vocab=256, name="tiny"), 8)}
LAYOUTS = {"1d": ParallelConfig(tp=8), "2d": ParallelConfig(tp=4, tp_mode="2d", dp=2),
           "2.5d": ParallelConfig(tp=8, tp_mode="2.5d", tp_depth=2), "3d": ParallelConfig(tp=8, tp_mode="3d")}
# --ranks 16: 16 is a square, not a cube
LAYOUTS_16 = {"1d": ParallelConfig(tp=16), "2d": ParallelConfig(tp=16, tp_mode="2d"),
              "2.5d": ParallelConfig(tp=16, tp_mode="2.5d", tp_depth=4),
              "3d": ParallelConfig(tp=8, tp_mode="3d", dp=2)}
# the projection: one GPT layer on 64 GPUs, 16-bit (our choice of shape; see the report)
PAPER = (ModelConfig(layers=24, hidden=4096, heads=64, seq_len=512, vocab=51200, name="h4096"), 64)


def comm_for(layout, world_comm):
    """A Comm over this layout's own process groups on the running world (every rank
    builds the same groups in the same order, as ``launch.setup_rank`` does)."""
    from minitron.comm import Comm, CommTrace
    from minitron.grid import ProcessGrid

    grid = ProcessGrid(tp=layout.tp, dp=layout.dp, pp=layout.pp, rank=world_comm.grid.rank,
                       cube=layout.tp_mode == "3d",
                       summa_depth=layout.tp_depth if layout.tp_mode in ("2d", "2.5d") else 0)
    return Comm(grid.build_groups(), CommTrace())


def measure_job(world_comm, runs, steps):
    """On every rank, for each (model, layout, train): activations of one microbatch,
    parameter bytes, the trace of the last of `steps` steps and the step times."""
    from minitron.train import Trainer

    out = []
    for model, layout, train in runs:
        comm = comm_for(layout, world_comm)
        out.append(measure_trainer(Trainer(model, layout, train, comm), comm, steps, world_comm.barrier))
    return out


def run(models, schemes, steps, dtype, layouts=LAYOUTS):
    runs = []
    for name, (model, gb) in models.items():
        train = TrainConfig(steps=steps, global_batch=gb, dtype=dtype, warmup=1)
        for mode in schemes:
            layout = layouts[mode]
            validate(model, layout, train)
            runs.append((name, mode, model, layout, train))
    world = layouts["1d"].world
    res = run_on_ranks(measure_job, ParallelConfig(dp=world), [r[2:] for r in runs], steps)[0]
    rows = []
    for (name, mode, model, layout, train), got in zip(runs, res):
        pred = predicted(model, layout, train)
        meas = bytes_by_axis_op(got["records"])
        wire = measured_wire_bytes(got["records"], got["sizes"])
        rows.append({"model": name, "mode": mode, "layout": layout.describe(), "measured": meas,
                     "predicted": pred["comm"], "call_bytes": sum(meas.values()),
                     "call_bytes_pred": sum(pred["comm"].values()), "wire_bytes": wire, "wire_bytes_pred": pred["wire"],
                     "param_bytes": got["params"], "param_bytes_pred": pred["params"],
                     "act_bytes": got["acts"], "act_bytes_pred": pred["acts"],
                     "step_ms": 1000 * statistics.median(got["times"][1:] or got["times"])})
        r = rows[-1]
        print(f"{name:8s} {mode:4s}: wire {wire:.0f} B (pred {pred['wire']:.0f}), params {r['param_bytes']} B "
              f"(pred {pred['params']}), acts {r['act_bytes']} B (pred {pred['acts']}), {r['step_ms']:.0f} ms",
              flush=True)
    return rows


def projection(model, micro_batch):
    from minitron.analysis.tp_schemes import LONGHORN, compare_tp_schemes, project_tp_schemes

    return {"longhorn": project_tp_schemes(model, micro_batch, 64, LONGHORN),
            "v100-dgx2": project_tp_schemes(model, micro_batch, 64, "v100-dgx2"),
            "bytes": compare_tp_schemes(model, micro_batch, 64, bytes_per_el=2)}


def fmt(n) -> str:
    return f"{n / 1024:,.1f} KiB"


def report(rows, proj, argv, dtype, models, schemes, layouts=LAYOUTS) -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    world = layouts["1d"].world
    lines = [f"# Tensor parallelism 1-D, 2-D, 2.5-D, 3-D on {world} ranks", "",
             f"Command: `{' '.join(['python', 'benchmarks/' + os.path.basename(__file__), *argv])}`  ",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()} "
             f"{platform.release()}, torch {torch.__version__}, gloo ({world} local ranks), load average {load:.1f}  ",
             f"Date: {datetime.date.today().isoformat()}  ",
             f"{dtype}; one microbatch per data-parallel rank per step; bytes per device (rank 0).", "",
             "Layouts: " + "; ".join(f"**{k}** `{layouts[k].describe()}`" for k in schemes), "",
             "Models: " + "; ".join(f"**{k}** = {m.layers} layers, h={m.hidden}, {m.heads} heads, s={m.seq_len}, "
                                    f"V={m.vocab}, batch {gb} ({gb * m.seq_len} tokens)"
                                    for k, (m, gb) in models.items()), "",
             "## Per device per step: measured (trace, saved tensors, shards) | predicted (analysis)", "",
             "| model | scheme | layout | call bytes | wire bytes | parameter bytes | activation bytes "
             "(1 microbatch) | step time |", "|---|---|---|---|---|---|---|---|"]

    def pair(a, b):
        return f"{fmt(a)} \\| {fmt(b)}" + ("" if abs(a - b) < 0.5 else " ✗")

    for r in rows:
        lines.append(f"| {r['model']} | {r['mode']} | `{r['layout']}` | {pair(r['call_bytes'], r['call_bytes_pred'])} | "
                     f"{pair(r['wire_bytes'], r['wire_bytes_pred'])} | {pair(r['param_bytes'], r['param_bytes_pred'])} | "
                     f"{pair(r['act_bytes'], r['act_bytes_pred'])} | {r['step_ms']:.0f} ms |")
    lines += ["", "## Call bytes by axis and operation (measured | predicted)", "",
              "| model | scheme | axis | op | measured | predicted |", "|---|---|---|---|---|---|"]
    for r in rows:
        for key in sorted(set(r["measured"]) | set(r["predicted"])):
            m, p = r["measured"].get(key, 0), r["predicted"].get(key, 0)
            lines.append(f"| {r['model']} | {r['mode']} | {key[0]} | {key[1]} | {m:,} | {p:,.0f}"
                         f"{'' if m == p else ' ✗'} |")
    if proj:
        pm, pb = PAPER
        lines += ["", "## Projection: one layer on 64 V100s (cost model)", "",
                  f"`minitron.analysis.tp_schemes.project_tp_schemes`: one GPT layer of h={pm.hidden}, "
                  f"{pm.heads} heads, s={pm.seq_len}, {pb} sequences per step, 16-bit, forward and backward, "
                  "no overlap of communication and compute. Longhorn: 4 V100s per node on NVLink, one EDR "
                  "InfiniBand port per node (where Bian et al. measured); DGX-2H: 16 per node.", "",
                  "| cluster | scheme | grid | compute | communication | layer | 3-D's speed-up over it |",
                  "|---|---|---|---|---|---|---|"]
        for cl in ("longhorn", "v100-dgx2"):
            rs = {r["scheme"]: r for r in proj[cl]}
            for r in proj[cl]:
                if r["feasible"]:
                    up = r["layer_s"] / rs["3d"]["layer_s"] if rs["3d"]["feasible"] else float("nan")
                    lines.append(f"| {cl} | {r['scheme']} | {r['grid']} | {1e3 * r['compute_s']:.2f} ms | "
                                 f"{1e3 * r['comm_s']:.2f} ms | {1e3 * r['layer_s']:.2f} ms | {up:.2f}× |")
        lines += ["", "The same layer on 64 devices, bytes per device (`compare_tp_schemes`, 16-bit):", "",
                  "| scheme | grid | sent per microbatch | gradient sums per step | layer parameters | "
                  "layer activations |", "|---|---|---|---|---|---|"]
        for r in proj["bytes"]:
            if r["feasible"]:
                lines.append(f"| {r['scheme']} | {r['grid']} | {r['layer_wire_bytes'] / 2**20:,.1f} MiB | "
                             f"{r['layer_sync_wire_bytes'] / 2**20:,.2f} MiB | {r['layer_param_bytes'] / 2**20:,.2f} MiB | "
                             f"{r['layer_activation_bytes'] / 2**20:,.1f} MiB |")
    lines.append("")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model, one step, nothing written")
    ap.add_argument("--models", nargs="+", default=list(MODELS), help=f"which of {', '.join(MODELS)}")
    ap.add_argument("--schemes", nargs="+", default=list(LAYOUTS), help=f"which of {', '.join(LAYOUTS)}")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--ranks", type=int, default=8, help="8 (default) or 16 local ranks")
    ap.add_argument("--out", default="", help="results file (default tp_schemes.md, tp_schemes_16.md for 16 ranks)")
    args = ap.parse_args(argv)
    if args.ranks not in (8, 16):
        sys.exit(f"unknown rank count {args.ranks}: choose from 8, 16")
    layouts = LAYOUTS if args.ranks == 8 else LAYOUTS_16
    out = args.out or os.path.join(os.path.dirname(__file__), "tp_schemes.md" if args.ranks == 8 else "tp_schemes_16.md")
    for kind, names, valid in (("model", args.models, MODELS), ("scheme", args.schemes, LAYOUTS)):
        unknown = [k for k in names if k not in valid]
        if unknown:
            sys.exit(f"unknown {kind} {', '.join(unknown)}: choose from {', '.join(valid)}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    models = SMOKE if args.smoke else {k: MODELS[k] for k in args.models}
    rows = run(models, args.schemes, 1 if args.smoke else args.steps, args.dtype, layouts)
    proj = projection(*PAPER)
    for cl in ("longhorn", "v100-dgx2"):
        print(cl + ": " + ", ".join(f"{r['scheme']} {1e3 * r['layer_s']:.1f} ms" for r in proj[cl] if r["feasible"]))
    bad = [r for r in rows if r["measured"] != r["predicted"] or r["act_bytes"] != r["act_bytes_pred"]
           or r["param_bytes"] != r["param_bytes_pred"]]
    if args.smoke:
        print("smoke:", "every layout sent and kept what the analysis predicts" if not bad
              else f"{len(bad)} layouts differ from the analysis")
        return 1 if bad else 0
    with open(out, "w") as f:
        f.write(report(rows, proj, argv, args.dtype, models, args.schemes, layouts))
    print(f"written to {out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
