"""3-D cube (q = 2) vs 1-D Megatron (t = 8) on the same 8 ranks: bytes per device.

For each model, both layouts train the same GPT (same seed, same batches) for a few
steps; rank 0's communication trace of the last step gives the *measured* call bytes per
axis and operation (and their ring wire bytes), which are printed next to the
*predicted* ones (``harness.predicted``: :func:`minitron.analysis.comm.comm_items` for
1-D, :func:`minitron.analysis.cube.cube_comm_items` for the cube). Parameter bytes
(the local shards) and activation bytes (what autograd saves during one microbatch's
forward, counted through ``saved_tensors_hooks``, parameters excluded, each storage
once) are measured and predicted the same way. Step times are printed for
information only (a shared 2-core CPU says little about a GPU cluster).

The two default models bracket the trade-off: "tokens" has many tokens per step and a
small hidden size (3-D moves less: activations dominate), "weights" few tokens and a
wide hidden size (1-D moves less: 3-D all-gathers weights of h² per layer).

    python benchmarks/cube_vs_1d.py                # writes benchmarks/cube.md
    python benchmarks/cube_vs_1d.py --smoke        # one model, one step, no file (the tests)
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

from harness import (bytes_by_axis_op, checkout_commit, measure_trainer, measured_wire_bytes,  # noqa: E402
                     predicted)
from minitron.config import ModelConfig, ParallelConfig, TrainConfig, validate  # noqa: E402
from minitron.tools.testing import run_on_ranks  # noqa: E402

MODELS = {
    "tokens": (ModelConfig(layers=2, hidden=64, heads=8, seq_len=64, vocab=256, name="tokens"), 16),
    "weights": (ModelConfig(layers=2, hidden=256, heads=8, seq_len=16, vocab=256, name="weights"), 4),
}
LAYOUTS = {"1d": ParallelConfig(tp=8), "3d": ParallelConfig(tp=8, tp_mode="3d")}


def measure_job(comm, model, layout, train, steps):
    """On every rank: activations of one microbatch, parameter bytes, the trace of the
    last of `steps` steps and the step times."""
    from minitron.train import Trainer

    return measure_trainer(Trainer(model, layout, train, comm), comm, steps)


def run(models, steps, dtype):
    rows = []
    for name in models:
        model, gb = MODELS[name]
        train = TrainConfig(steps=steps, global_batch=gb, dtype=dtype, warmup=1)
        for mode, layout in LAYOUTS.items():
            validate(model, layout, train)
            res = run_on_ranks(measure_job, layout, model, layout, train, steps, trace=True)[0]
            pred = predicted(model, layout, train)
            meas = bytes_by_axis_op(res["records"])
            rows.append({"model": name, "mode": mode, "tokens": gb * model.seq_len, "hidden": model.hidden,
                         "measured": meas, "predicted": pred["comm"],
                         "call_bytes": sum(meas.values()), "call_bytes_pred": sum(pred["comm"].values()),
                         "wire_bytes": measured_wire_bytes(res["records"], res["sizes"]), "wire_bytes_pred": pred["wire"],
                         "param_bytes": res["params"], "param_bytes_pred": pred["params"],
                         "act_bytes": res["acts"], "act_bytes_pred": pred["acts"],
                         "step_ms": 1000 * statistics.median(res["times"][1:] or res["times"])})
            print(f"{name:8s} {mode}: wire {rows[-1]['wire_bytes']:.0f} B (pred {pred['wire']:.0f}), "
                  f"params {res['params']} B (pred {pred['params']}), acts {res['acts']} B (pred {pred['acts']})",
                  flush=True)
    return rows


def fmt(n) -> str:
    return f"{n / 1024:,.1f} KiB"


def report(rows, argv, dtype, rev) -> str:
    lines = ["# 3-D cube (q = 2) vs 1-D (t = 8) on 8 ranks", "",
             f"Command: `{' '.join(['python', 'benchmarks/' + os.path.basename(__file__), *argv])}`  ",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()} "
             f"{platform.release()}, torch {torch.__version__}, gloo (8 local ranks)  ",
             f"Date: {datetime.date.today().isoformat()}, commit {rev}  ",
             f"Activations and parameters in {dtype}; one step = one microbatch per rank; bytes per device "
             "(rank 0; every rank of a layout moves the same).", "",
             "Models: " + "; ".join(f"**{k}** = {m.layers} layers, h={m.hidden}, {m.heads} heads, s={m.seq_len}, "
                                    f"V={m.vocab}, batch {gb} ({gb * m.seq_len} tokens)"
                                    for k, (m, gb) in MODELS.items()), "",
             "## Per device per step: measured (trace, saved tensors, shards) | predicted (analysis)", "",
             "| model | layout | call bytes | wire bytes (ring) | parameter bytes | activation bytes "
             "(1 microbatch) | step time |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        def pair(a, b):
            return f"{fmt(a)} \\| {fmt(b)}" + ("" if abs(a - b) < 0.5 else " ✗")
        lines.append(f"| {r['model']} | {r['mode']} | {pair(r['call_bytes'], r['call_bytes_pred'])} | "
                     f"{pair(r['wire_bytes'], r['wire_bytes_pred'])} | {pair(r['param_bytes'], r['param_bytes_pred'])} | "
                     f"{pair(r['act_bytes'], r['act_bytes_pred'])} | {r['step_ms']:.0f} ms |")
    lines += ["", "## Call bytes by axis and operation (measured | predicted)", "",
              "| model | layout | axis | op | measured | predicted |", "|---|---|---|---|---|---|"]
    for r in rows:
        for key in sorted(set(r["measured"]) | set(r["predicted"])):
            m, p = r["measured"].get(key, 0), r["predicted"].get(key, 0)
            lines.append(f"| {r['model']} | {r['mode']} | {key[0]} | {key[1]} | {m:,} | {p:,.0f}"
                         f"{'' if m == p else ' ✗'} |")
    lines += ["", "## Reading", ""]
    for name in MODELS:
        d = {r["mode"]: r for r in rows if r["model"] == name}
        if len(d) == 2:
            lines.append(f"- **{name}**: the cube sends {d['3d']['wire_bytes'] / d['1d']['wire_bytes']:.2f}× "
                         f"the wire bytes of 1-D, holds {d['3d']['param_bytes'] / d['1d']['param_bytes']:.2f}× "
                         f"its parameter bytes and keeps {d['3d']['act_bytes'] / d['1d']['act_bytes']:.2f}× "
                         f"its activation bytes.")
    lines += ["",
              "Call bytes follow the trace's convention (all-gather: the local shard; reduce-scatter: the whole "
              "local input; all-reduce: the buffer); wire bytes are what a ring sends out of a device: "
              "(n−1)× the shard, (n−1)/n of the input, 2(n−1)/n of the buffer. Data-parallel and pipeline "
              "axes are absent (dp = pp = 1); the once-per-step 'log' all-reduce of the loss is not counted. "
              "Step times are medians on a shared 2-core CPU (8 ranks, other jobs running): for "
              "information only. "
              "1-D never moves weights: two all-reduces of b·s·h per layer each way. The cube moves "
              "activations 1/q² as large plus every weight (all-gathered forward, reduce-scattered "
              "backward), and also parameter-gradient plane sums for its replicated vectors. For the backward "
              "it keeps the *gathered* input and the *gathered* weight of each linear: with many tokens that "
              "is still less than 1-D, whose LayerNorm, QKV and fc inputs are whole on every rank; with few "
              "tokens and a wide hidden size the gathered weights (h_in·h_out/q² per linear) dominate.", ""]
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), help=f"which of {', '.join(MODELS)}")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "cube.md"),
                    help="results file to write ('' for none)")
    ap.add_argument("--smoke", action="store_true",
                    help="one model, one step of each layout, no results file (what the tests run)")
    args = ap.parse_args(argv)
    unknown = [k for k in args.models if k not in MODELS]
    if unknown:
        sys.exit(f"unknown model {', '.join(unknown)}: choose from {', '.join(MODELS)}")
    if args.smoke:
        args.models, args.steps, args.out = ["tokens"], 1, ""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rev = checkout_commit()  # the code measured: the commit at the start
    rows = run(args.models, args.steps, args.dtype)
    text = report(rows, argv, args.dtype, rev)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"written to {args.out}")
    return rows


if __name__ == "__main__":
    main()
