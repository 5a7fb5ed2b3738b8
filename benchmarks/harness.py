"""What the benchmark scripts share: where the numbers were taken, how paired timings
are summed up, and how a traced run is measured and set beside the analysis.

* :func:`checkout_commit`, :func:`cpu_name` — the code and the machine a results file
  names.
* :func:`slowest_rank_rounds`, :func:`paired_ratio` — timings of variants run in
  alternation on a shared machine: a variant's time in a round is its slowest rank's,
  and a ratio is the median over rounds of the ratio within the round (slow drifts of
  the machine's load hit both sides of a round alike and cancel), given beside the ratio
  of the medians; :func:`publish` prints them and appends them to a results file.
* :func:`saved_activation_bytes`, :func:`measure_trainer`, :func:`bytes_by_axis_op`,
  :func:`measured_wire_bytes`, :func:`predicted` — one traced training step measured
  (activations saved, parameter shards, calls and their ring wire bytes) and the
  analysis's prediction of the same numbers (1-D, 2-D, 2.5-D and 3-D tensor parallelism).

A library for the scripts beside it (they put the repository on ``sys.path``), not a
benchmark itself.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


# --------------------------------------------------------------------------------------
# Where the numbers come from
# --------------------------------------------------------------------------------------
def checkout_commit() -> str:
    """The checkout's commit (with '+' when files differ from it), for the results."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "minitron", "benchmarks"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return head + ("+" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; else what ``platform`` says)."""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
        if name:
            return name
    return platform.processor() or "unknown CPU"


# --------------------------------------------------------------------------------------
# Paired timings
# --------------------------------------------------------------------------------------
def slowest_rank_rounds(results: dict, variants=None) -> dict[str, list[float]]:
    """``{variant: [seconds per round]}``, each round's time the slowest rank's, from
    ``{rank: {"times": {variant: [seconds per round]}}}`` (ranks that did not time a
    variant are left out of it)."""
    variants = list(results[min(results)]["times"]) if variants is None else variants
    rounds = {}
    for v in variants:
        ranks = [r for r in results if results[r]["times"].get(v)]
        rounds[v] = [max(x) for x in zip(*(results[r]["times"][v] for r in ranks))]
    return rounds


def paired_ratio(numerator: list[float], denominator: list[float], factor: float = 1.0) -> dict:
    """``{paired_median, ratio_of_medians}`` of ``factor · numerator / denominator`` over
    rounds timed in alternation (the i-th of each side from the same round)."""
    return {"paired_median": statistics.median(factor * x / y for x, y in zip(numerator, denominator)),
            "ratio_of_medians": factor * statistics.median(numerator) / statistics.median(denominator)}


def publish(markdown: str, summary: dict, as_json: bool = False, append_to: str = "") -> None:
    """Print the results (`summary` as JSON with `as_json`, else the markdown) and append
    the markdown to the file `append_to` when one is named."""
    print(json.dumps(summary, indent=1) if as_json else markdown)
    if append_to:
        with open(append_to, "a") as f:
            f.write(markdown + "\n")


# --------------------------------------------------------------------------------------
# One traced step, measured and predicted
# --------------------------------------------------------------------------------------
def saved_activation_bytes(model, x, y) -> int:
    """Bytes autograd saves for the backward of `model(x, y)` (one forward): every
    distinct storage once, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set = set()
    total = 0

    def pack(t):
        nonlocal total
        st = t.untyped_storage()
        if st.data_ptr() not in params and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, y)
    return total


def measure_trainer(tr, comm, steps: int, before_step=lambda: None) -> dict:
    """On one rank: the activations of `tr`'s first microbatch, its parameter bytes, the
    trace of the last of `steps` steps (``comm`` traces) and the step times.
    `before_step` runs before each timed step (a barrier over several layouts' ranks)."""
    x, y = tr.microbatches(0)[0]
    acts = saved_activation_bytes(tr.model, x, y)
    times = []
    for i in range(steps):
        comm.trace.records.clear()
        before_step()
        t0 = time.perf_counter()
        tr.step(i)
        times.append(time.perf_counter() - t0)
    recs = [r for r in comm.trace.records if r["phase"] not in ("log", "other")]
    sizes = {r["axis"]: comm.size(r["axis"]) for r in recs}
    params = sum(p.numel() * p.element_size() for p in tr.params)
    return {"acts": acts, "params": params, "records": recs, "sizes": sizes, "times": times}


def bytes_by_axis_op(records) -> dict:
    """Call bytes summed per (axis, op) over trace records or analysis items."""
    out: dict = {}
    for r in records:
        out[(r["axis"], r["op"])] = out.get((r["axis"], r["op"]), 0) + r["bytes"]
    return out


def measured_wire_bytes(records, sizes: dict) -> float:
    """Ring wire bytes of traced calls, each on its axis of ``sizes[axis]`` ranks."""
    from minitron.analysis.calls import wire_bytes

    return sum(wire_bytes(r, sizes[r["axis"]]) for r in records)


def predicted(model, layout, train) -> dict:
    """The analysis of one step on rank 0: call bytes per (axis, op), wire bytes,
    activation bytes of a microbatch and parameter bytes."""
    from minitron.analysis import cube as C
    from minitron.analysis import summa as S
    from minitron.analysis.calls import wire_bytes
    from minitron.analysis.comm import comm_items
    from minitron.analysis.params import params_on_rank
    from minitron.config import element_bytes

    e = element_bytes(train.dtype)
    b = train.global_batch // (layout.dp * train.microbatches)
    if layout.tp_mode == "3d":
        q = C.cube_q(layout.tp)
        items, sizes = C.cube_comm_items(model, layout, train), {C.I: q, C.J: q, C.K: q}
        acts = sum(C.saved_bytes_per_microbatch(model, b, layout.tp, "3d", e).values())
    elif layout.tp_mode in ("2d", "2.5d"):
        q = S.grid_shape(layout.tp, layout.tp_depth)
        items, sizes = S.summa_comm_items(model, layout, train), {S.ROW: q, S.COL: q, S.DEP: layout.tp_depth}
        acts = sum(S.saved_bytes_per_microbatch(model, b, layout.tp, layout.tp_depth, e).values())
    else:
        items, sizes = comm_items(model, layout, train), {}
        acts = sum(C.saved_bytes_per_microbatch(model, b, layout.tp, "1d", e).values())
    sizes.update(tp=layout.tp, dp=layout.dp)
    wire = 0.0
    for it in items:  # bytes summed over `calls` calls of equal size
        wire += it["calls"] * wire_bytes({**it, "bytes": it["bytes"] / it["calls"]}, sizes.get(it["axis"], 1))
    return {"comm": bytes_by_axis_op(items), "wire": wire, "acts": acts, "params": e * params_on_rank(model, layout)}


def alternate_rounds(runs: dict, warmup: int, rounds: int, script: str, tolerance: float = 1e-4) -> tuple[dict, dict]:
    """Time each of `runs` ({name: step(i) -> loss}) for `rounds` rounds after `warmup`,
    alternating which goes first so neither always does; returns (times per name, first
    loss per name). The two sides train the same model on the same batch: their first losses
    must agree within `tolerance`, or the race is unfair and `script` stops saying so."""
    times, first = {k: [] for k in runs}, {}
    for i in range(warmup + rounds):
        for k in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
            t0 = time.perf_counter()
            loss = runs[k](i)
            if i >= warmup:
                times[k].append(time.perf_counter() - t0)
            first.setdefault(k, loss)
    a, b = list(first.values())[:2]
    if abs(a - b) > tolerance:
        raise SystemExit(f"{script}: first losses differ ({first}): the two models are not the same")
    return times, first


def race_versus_transformers(tr, hf_step, args, script: str, title: str, shape: str, about: dict) -> None:
    """Race minitron's ``tr.step`` against transformers' `hf_step` on one device
    (:func:`alternate_rounds`, args.warmup and args.rounds) and publish the markdown block and
    the summary RESULTS.md records: `title` heads it, `shape` describes the model, `about`
    leads the summary; the ratio is minitron / transformers (below 1: minitron faster)."""
    times, first = alternate_rounds({"minitron": tr.step, "transformers": hf_step}, args.warmup, args.rounds, script)
    r = paired_ratio(times["minitron"], times["transformers"])
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    summary = {**about, "global_batch": args.global_batch, "threads": args.threads, "rounds": args.rounds,
               "minitron_step_s": med["minitron"], "transformers_step_s": med["transformers"], "first_losses": first,
               "minitron_over_transformers": r, "commit": checkout_commit(), "cpu": cpu_name(),
               "date": time.strftime("%Y-%m-%d")}
    cmd = " ".join(["python", f"benchmarks/{script}"] + sys.argv[1:])
    md = (f"\n### {title} ({summary['date']})\n\n"
          f"`{cmd}` on {summary['cpu']}, {args.threads} thread(s), commit {summary['commit']}; "
          f"{shape}, global batch {args.global_batch}, {args.rounds} alternating rounds.\n\n"
          f"| | median step (s) |\n|---|---|\n| minitron | {med['minitron']:.4f} |\n"
          f"| transformers | {med['transformers']:.4f} |\n\n"
          f"minitron / transformers: paired median **{r['paired_median']:.3f}**, ratio of medians "
          f"{r['ratio_of_medians']:.3f}.\n")
    publish(md, summary, args.json, args.out)
