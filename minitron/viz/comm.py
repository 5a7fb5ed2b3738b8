"""Pictures of communication, drawn from real traces.

A trace is the list of records that :class:`minitron.comm.CommTrace` keeps (and that
``--trace FILE`` writes as JSON lines): ``{rank, step, microbatch, op, axis, bytes,
phase, shape, dtype}``, one per collective or point-to-point call, in the order the
rank issued them. This module sums them up and draws them:

* :func:`totals` — the calls and bytes per (phase, op) of the records of one
  rank/step/axis (chosen with :func:`minitron.comm.select`, imported here): what lessons
  compare with ``minitron.analysis``.
* :func:`plot_calls` — the calls of one microbatch in issue order, one lane per phase
  (forward, backward, optimizer), a box per call coloured by op: a communication
  diagram of a layer or a model, e.g. Megatron's f/g all-reduces next to sequence
  parallelism's all-gathers and reduce-scatters.

A trace says *what* was sent, not *when*. To see when data-parallel buckets fire
during the backward pass, :func:`dp_overlap_job` (run on every rank by
:func:`minitron.tools.testing.run_on_ranks`) trains a few steps with a :class:`TimedTrace`
and stamps the moment each parameter's gradient is produced;
:func:`exposure_by_axis` sums a timed trace into each axis' time in flight and time waited;
:func:`plot_spans` draws a ``--timeline``'s calls (in flight, then waited for) beside the
pipeline's actions, one lane per rank.
:func:`overlap_events` lists the calls against the gradients computed before them and
:func:`plot_overlap` draws both on one time axis.

matplotlib is imported only inside the drawing functions: the rank job needs none.
"""
from __future__ import annotations

import time
from collections import defaultdict

from ..comm import TimedTrace, select

OP_COLORS = {"all_reduce": "#4c72b0", "all_gather": "#55a868", "reduce_scatter": "#dd8452",
             "broadcast": "#8172b2", "send": "#937860", "recv": "#da8bc3", "all_to_all": "#c44e52",
             "reduce": "#64b5cd"}
OP_SHORT = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "broadcast": "BC",
            "send": "send", "recv": "recv", "all_to_all": "A2A", "reduce": "R"}
PHASES = ("fwd", "bwd", "optim")


# --------------------------------------------------------------------------------------
# Summaries
# --------------------------------------------------------------------------------------
def totals(records, by=("phase", "op"), **match) -> dict:
    """``{key: {"calls": n, "bytes": b}}`` over the records that `match`, keyed by the
    tuple of the `by` fields (a single field gives plain keys)."""
    out: dict = defaultdict(lambda: {"calls": 0, "bytes": 0})
    for r in select(records, **match):
        key = tuple(r.get(k) for k in by) if len(by) > 1 else r.get(by[0])
        out[key]["calls"] += 1
        out[key]["bytes"] += r["bytes"]
    return dict(out)


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, at most one decimal)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or float(n).is_integer() else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# --------------------------------------------------------------------------------------
# A communication diagram: the calls of one microbatch, per phase
# --------------------------------------------------------------------------------------
def plot_calls(records, ax=None, labels=None, phases=PHASES, title: str | None = None,
               highlight=None, columns: int | None = None):
    """Draw `records` (one rank, typically one step and microbatch plus its optimizer
    phase) as boxes in issue order, one lane per phase in `phases`.

    Each box is coloured by op and shows the op (AR all-reduce, AG all-gather, RS
    reduce-scatter), the local tensor's shape and bytes; `labels`, when given, is one
    string per record (same order) written above the box (e.g. "attn g"). `highlight`
    is a set of record positions to outline (e.g. the calls of one layer). `columns`
    widens the axes to at least that many boxes (to align panels). Returns the axes.
    """
    from matplotlib.patches import Patch, Rectangle

    recs = [r for r in records if r["phase"] in phases]
    pos = [i for i, r in enumerate(records) if r["phase"] in phases]
    lanes = [p for p in phases if any(r["phase"] == p for r in recs)]
    ncol = max([sum(r["phase"] == p for r in recs) for p in lanes] + [columns or 1])
    if ax is None:
        import matplotlib.pyplot as plt
        _, ax = plt.subplots(figsize=(max(6, 1.15 * ncol), 0.5 + 1.1 * len(lanes)))
    col = dict.fromkeys(lanes, 0)
    for i, r in zip(pos, recs):
        y = len(lanes) - 1 - lanes.index(r["phase"])
        x = col[r["phase"]]
        col[r["phase"]] += 1
        edge = "black" if highlight and i in highlight else "white"
        ax.add_patch(Rectangle((x + 0.04, y + 0.12), 0.92, 0.62, color=OP_COLORS.get(r["op"], "grey"),
                               ec=edge, lw=2 if edge == "black" else 0.5))
        shape = "×".join(map(str, r["shape"])) or "scalar"
        ax.text(x + 0.5, y + 0.43, f"{OP_SHORT.get(r['op'], r['op'])}\n{shape}\n{human_bytes(r['bytes'])}",
                ha="center", va="center", fontsize=7, color="white")
        if labels is not None:
            ax.text(x + 0.5, y + 0.8, labels[i], ha="center", va="bottom", fontsize=7)
    ax.set_xlim(0, ncol)
    ax.set_ylim(0, len(lanes))
    ax.set_yticks([len(lanes) - 1 - k + 0.43 for k in range(len(lanes))], lanes)
    ax.set_xticks([])
    ax.set_xlabel("calls in issue order")
    for s in ("top", "right", "bottom"):
        ax.spines[s].set_visible(False)
    ops = [op for op in OP_COLORS if any(r["op"] == op for r in recs)]
    ax.legend(handles=[Patch(color=OP_COLORS[o], label=o.replace("_", "-")) for o in ops],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


# --------------------------------------------------------------------------------------
# When do data-parallel calls fire? A timed trace and gradient stamps
# --------------------------------------------------------------------------------------
def exposure_by_axis(records: list[dict]) -> dict:
    """Per axis, from a :class:`TimedTrace`'s records (receives left out, and the pipeline's
    sends and receives, ``Comm.p2p``, whose handles its runtime waits on unstamped): ``{"calls", "steps" (how many steps they span), "in_flight_s" (issue to done, summed),
    "exposed_s" (waited to done: the rank stood still), "hidden" (1 − exposed/in flight)}``.

    A blocking call is all exposed (hidden 0). An asynchronous call's in-flight time counts
    the compute the rank ran between issuing and waiting in full, though the transfer may
    have finished sooner: ``hidden`` is the share of that window the rank did not wait, an
    upper bound on the share of the transfer's own time hidden; ``exposed_s`` is exact.
    A ring shift's send and receive are one call (the send's record)."""
    out: dict = {}
    for r in records:
        if r["op"] == "recv" or "done" not in r:
            continue
        a = out.setdefault(r["axis"], {"calls": 0, "steps": set(), "in_flight_s": 0.0, "exposed_s": 0.0})
        a["calls"] += 1
        a["steps"].add(r.get("step"))
        a["in_flight_s"] += r["done"] - r["t"]
        a["exposed_s"] += r["done"] - r["waited"]
    for a in out.values():
        a["steps"] = len(a["steps"])
        a["hidden"] = 1 - a["exposed_s"] / a["in_flight_s"] if a["in_flight_s"] > 0 else 0.0
    return out


def dp_overlap_job(comm, model, train, layouts, steps: int = 2) -> list[dict] | None:
    """Rank job for :func:`minitron.tools.testing.run_on_ranks`: for each layout in `layouts`
    (all of the launch's world size), build a ``Trainer``, train `steps` steps with a
    :class:`TimedTrace` and a tensor hook on every parameter that stamps when its
    gradient is produced (before it is accumulated, so before the data-parallel hook of
    the same parameter runs). Returns, on global rank 0, one dict per layout::

        {"layout", "params": names in the gradient buffer's order (~ backward order),
         "buckets": [[positions of the tensors each bucket touches], ...] (bucketed only),
         "records": the timed trace, "grads": [{name, step, microbatch, seq, t}],
         "steps": [(t_start, t_end), ...]}

    and None on the other ranks.
    """
    from ..data import load_corpus

    corpus = load_corpus(train.data)
    out = []
    for layout in layouts:
        with comm.tracing(TimedTrace()) as trace:
            tr, grads, windows = _stamped_steps(model, layout, train, comm, corpus, steps, trace)
        bucketed = hasattr(tr.dp, "buckets")
        order = list(tr.dp.params) if bucketed else list(reversed(tr.params))  # ~ backward order
        out.append({"layout": layout.describe() + (f" {layout.dp_impl}" if not layout.zero1 else ""),
                    "params": [p.shard.name for p in order],
                    "buckets": [list(b.tensors) for b in tr.dp.buckets] if bucketed else None,
                    "records": trace.records, "grads": grads, "steps": windows})
        comm.barrier()
    return out if comm.grid.rank == 0 else None


def _stamped_steps(model, layout, train, comm, corpus, steps: int, trace: TimedTrace):
    """(the Trainer, the gradient stamps, the step windows) of `steps` steps of `layout`
    (:func:`dp_overlap_job`), the trace installed by the caller."""
    from ..train import Trainer

    tr = Trainer(model, layout, train, comm, corpus)
    grads: list[dict] = []

    def hook(name):
        def stamp(g):
            seq, t = trace.stamp()
            grads.append({"name": name, "step": tr.comm.step, "microbatch": tr.comm.microbatch, "seq": seq, "t": t})
        return stamp

    for p in tr.params:
        p.register_hook(hook(p.shard.name))
    windows = []
    for i in range(steps):
        t0 = time.perf_counter()
        tr.step(i)
        windows.append((t0, time.perf_counter()))
    return tr, grads, windows


def overlap_events(run: dict, step: int = -1, axis: str = "dp") -> list[dict]:
    """The `axis` calls of one step of a :func:`dp_overlap_job` result, each with how
    many of the step's last-microbatch gradients had been produced before it was issued:
    ``{op, phase, microbatch, bytes, grads_before, grads_total}``. Deterministic (the
    order of events, not their times)."""
    step = run_step(run, step)
    last_mb = max((g["microbatch"] for g in run["grads"] if g["step"] == step), default=None)
    grads = [g for g in run["grads"] if g["step"] == step and g["microbatch"] == last_mb]
    out = []
    for r in select(run["records"], step=step, axis=axis):
        out.append({"op": r["op"], "phase": r["phase"], "microbatch": r["microbatch"], "bytes": r["bytes"],
                    "grads_before": sum(g["seq"] < r["seq"] for g in grads), "grads_total": len(grads)})
    return out


def run_step(run: dict, step: int) -> int:
    """A step index of a :func:`dp_overlap_job` result (negative counts from the end)."""
    return step if step >= 0 else len(run["steps"]) + step


def plot_overlap(run: dict, step: int = -1, ax=None, axis: str = "dp", title: str | None = None):
    """Gradients produced (dots: x = time since the step began, y = the tensor's position
    in the gradient buffer) and the `axis` calls issued (vertical lines, coloured by op,
    numbered in issue order above the axes; dashed: the step's end) during one step of a :func:`dp_overlap_job` result. The
    shaded span is the last microbatch's backward pass (first to last gradient); for a
    bucketed run, bands mark the buckets (call k belongs to bucket k). Returns the axes."""
    from matplotlib.lines import Line2D

    step = run_step(run, step)
    t0, t1 = run["steps"][step]
    ms = lambda t: (t - t0) * 1e3  # noqa: E731
    if ax is None:
        import matplotlib.pyplot as plt
        _, ax = plt.subplots(figsize=(9, 3.2))
    where = {n: i for i, n in enumerate(run["params"])}
    grads = [g for g in run["grads"] if g["step"] == step]
    mbs = sorted({g["microbatch"] for g in grads})
    shades = ["#bbbbbb", "#333333"]
    for k, mb in enumerate(mbs):
        gs = [g for g in grads if g["microbatch"] == mb]
        ax.scatter([ms(g["t"]) for g in gs], [where[g["name"]] for g in gs], s=9, zorder=3,
                   color=shades[1] if mb == mbs[-1] else shades[0])
        if mb == mbs[-1] and gs:
            ax.axvspan(ms(min(g["t"] for g in gs)), ms(max(g["t"] for g in gs)), color="#f2f2f2", zorder=0)
    n = len(run["params"])
    calls = select(run["records"], step=step, axis=axis)
    for k, r in enumerate(calls):
        x = ms(r["t"])
        ax.axvline(x, color=OP_COLORS.get(r["op"], "grey"), lw=1.5, zorder=2)
        if len(calls) <= 24:
            ax.text(x, 1.005 + (k % 2) * 0.06, str(k), ha="center", va="bottom", fontsize=7,
                    color=OP_COLORS.get(r["op"], "grey"), transform=ax.get_xaxis_transform())
    ax.axvline(ms(t1), color="black", ls="--", lw=1, zorder=2)
    if run.get("buckets"):  # a band per bucket: its call fires after the band's last dot
        ticks = []
        for k, b in enumerate(run["buckets"]):
            lo, hi = min(b) - 0.5, max(b) + 0.5
            if k % 2 == 0:
                ax.axhspan(lo, hi, color="#e8eef7", zorder=0)
            ticks.append(((lo + hi) / 2, f"bucket {k}"))
        ax.set_yticks([t for t, _ in ticks], [s for _, s in ticks], fontsize=7)
        ax.set_ylabel("gradient buffer")
    else:
        ax.set_ylabel("tensor (backward order)")
    ax.set_xlim(0, ms(t1))
    ax.set_ylim(-1, n)
    ax.set_xlabel("ms since the step began")
    ops = [op for op in OP_COLORS if select(run["records"], step=step, axis=axis, op=op)]
    handles = [Line2D([], [], color=OP_COLORS[o], label=o.replace("_", "-")) for o in ops]
    handles.append(Line2D([], [], color="black", ls="--", lw=1, label="step ends"))
    handles.append(Line2D([], [], marker="o", ls="", color=shades[1], label="gradient (last microbatch)"))
    if len(mbs) > 1:
        handles.append(Line2D([], [], marker="o", ls="", color=shades[0], label="gradient (earlier)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize=8)
    ax.set_title(title or run["layout"], fontsize=10, pad=14)
    return ax


# --------------------------------------------------------------------------------------
# What ran under what: a --timeline's calls beside the pipeline's actions
# --------------------------------------------------------------------------------------
def plot_spans(timeline: list[dict], step: int = -1, ax=None, title: str | None = None):
    """One lane per rank of a ``--timeline`` (:func:`minitron.viz.pipeline.load_timeline`):
    the pipeline's F/B/W actions of `step` (-1: the last) as grey boxes, each call of that
    step as a thin bar while in flight before its rank waited (compute ran under it) and a
    thick bar while the rank waited (exposed), coloured by op. Returns the axes."""
    from matplotlib.lines import Line2D

    calls = [r for r in timeline if r.get("kind") == "comm"]
    steps = sorted({r["step"] for r in calls})
    s = steps[step] if step < 0 else step
    calls = [r for r in calls if r["step"] == s]
    acts = [r for r in timeline if r.get("kind") is None and r.get("step") == s]
    t0 = min([r["start"] for r in calls + acts], default=0.0)
    ranks = sorted({r["global_rank"] for r in calls + acts})
    if ax is None:
        import matplotlib.pyplot as plt
        _, ax = plt.subplots(figsize=(10, 0.8 + 0.6 * len(ranks)))
    ms = lambda t: (t - t0) * 1e3  # noqa: E731
    for r in acts:
        lane = ranks.index(r["global_rank"])
        ax.barh(lane, ms(r["end"]) - ms(r["start"]), left=ms(r["start"]), height=0.7, color="#dddddd")
    for r in calls:
        lane, c = ranks.index(r["global_rank"]), OP_COLORS.get(r["op"], "black")
        ax.plot([ms(r["start"]), ms(r["waited"])], [lane, lane], color=c, lw=1, alpha=0.6)
        ax.plot([ms(r["waited"]), ms(r["end"])], [lane, lane], color=c, lw=6, solid_capstyle="butt")
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlabel(f"ms since step {s} began")
    ops = [o for o in OP_COLORS if any(r["op"] == o for r in calls)]
    ax.legend(handles=[Line2D([], [], color="grey", lw=1, label="in flight, computing"),
                       Line2D([], [], color="grey", lw=6, label="waited (exposed)")]
              + [Line2D([], [], color=OP_COLORS[o], lw=4, label=o.replace("_", "-")) for o in ops],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    return ax
