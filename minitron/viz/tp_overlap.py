"""What ran under what: a timed trace beside the matrix products, per rank, on a real run
(``--tp-overlap``: Wang et al. 2022's decomposition; ``--ep-overlap``: the experts' halves,
DeepSeek-V3 §3.2.1; the data-parallel buckets).

``--timeline`` records the pipeline's actions; the decomposed collective matmuls of
``parallel/collective_matmul.py`` run inside one action, so :func:`timed_steps_job` (run on
every rank by :func:`minitron.tools.testing.run_on_ranks`) trains a few steps with a
:class:`~minitron.viz.comm.TimedTrace` (each call stamped when issued, when its rank began
to wait for it and when it was done) and a dispatch mode that stamps when each matrix
product starts and ends, on one counter (:func:`tp_overlap_job`: the plain and the
overlapped tensor-parallel layouts; :func:`products_under`: the products a call was in
flight over; :func:`moe_call_order`: one MoE call's all-to-alls and products): calls and products
have one total order (:func:`issue_order`) and times (:func:`plot_tp_overlap`). The plain
layout's all-gather is one call followed by its product; the overlapped one posts each
shift before the product that runs while it travels.

matplotlib is imported only inside the drawing function.
"""
from __future__ import annotations

import time

from torch.utils._python_dispatch import TorchDispatchMode

from ..comm import TimedTrace
from .comm import OP_COLORS

PRODUCTS = ("mm", "addmm", "bmm", "baddbmm")


class _Products(TorchDispatchMode):
    """Stamps every matrix product's start and end on the trace's counter."""

    def __init__(self, trace: TimedTrace, comm, spans: list):
        super().__init__()
        self.trace, self.comm, self.spans = trace, comm, spans

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in PRODUCTS:
            return func(*args, **(kwargs or {}))
        seq, t0 = self.trace.stamp()
        out = func(*args, **(kwargs or {}))
        self.spans.append({"seq": seq, "t0": t0, "t1": time.perf_counter(), "step": self.comm.step,
                           "phase": self.comm.phase})
        return out


def tp_overlap_job(comm, model, train, overlaps=(False, True), steps: int = 2) -> list[dict]:
    """Rank job: for each of `overlaps`, a Trainer on ``--tp <world> --sp`` (with
    ``--tp-overlap`` when True) trains `steps` steps with a timed trace and stamped matrix
    products. Returns, on every rank, one dict per variant: ``{"overlap", "records" (the
    timed trace's tensor-axis calls), "products" [{seq, t0, t1, step, phase}], "steps"
    [(t0, t1)]}``."""
    from ..config import ParallelConfig

    layouts = [ParallelConfig(tp=comm.grid.world, sp=True, tp_overlap=o, device="cpu") for o in overlaps]
    runs = timed_steps_job(comm, model, train, layouts, steps)
    return [{**run, "overlap": o, "records": [r for r in run["records"] if r["axis"] == "tp"]}
            for o, run in zip(overlaps, runs)]


def timed_steps_job(comm, model, train, layouts, steps: int = 2) -> list[dict]:
    """Rank job: for each layout of `layouts` (all of the launch's size), a Trainer trains
    `steps` steps with a :class:`~minitron.viz.comm.TimedTrace` (each call stamped when
    issued, waited for and done) and every matrix product's start and end stamped on the
    same counter. Returns, on every rank, one dict per layout: ``{"layout" (its
    description), "records", "products" [{seq, t0, t1, step, phase}], "steps" [(t0, t1)]}``:
    what ran under what (:func:`products_under`)."""
    from ..comm import Comm
    from ..data import load_corpus
    from ..grid import ProcessGrid
    from ..train import Trainer

    corpus, out = load_corpus(train.data), []
    for layout in layouts:
        spans: list = []
        grid = ProcessGrid.for_layout(layout, comm.grid.rank).build_groups()  # the layout's own axes
        trace, windows = TimedTrace(), []
        tr = Trainer(model, layout, train, Comm(grid, trace), corpus)
        with _Products(trace, tr.comm, spans):
            for i in range(steps):
                comm.barrier()
                t0 = time.perf_counter()
                tr.step(i)
                windows.append((t0, time.perf_counter()))
        out.append({"layout": layout.describe(), "records": list(trace.records), "products": spans,
                    "steps": windows})
    return out


def products_under(run: dict, rec: dict) -> int:
    """How many of `run`'s matrix products ran wholly while the call of `rec` was in
    flight and its rank had not begun to wait for it (between its issue and its wait)."""
    return sum(rec["t"] <= p["t0"] and p["t1"] <= rec["waited"] for p in run["products"])


def issue_order(run: dict, step: int, phase: str = "fwd", first: int = 12) -> list[str]:
    """The first `first` events of one step's `phase` in the order they began: a tp call's
    op ('all_gather', 'send', ...) or 'mm' for a matrix product. Deterministic."""
    events = [(r["seq"], r["op"]) for r in run["records"] if r["step"] == step and r["phase"] == phase]
    events += [(p["seq"], "mm") for p in run["products"] if p["step"] == step and p["phase"] == phase]
    return [op for _, op in sorted(events)][:first]


def moe_call_order(run: dict, step: int, call: int = 0) -> list[str]:
    """The forward of `run`'s `call`-th MoE call in `step` (one layout of
    :func:`timed_steps_job` under ``--ep``) in the order it happened: the counts' all-to-all,
    each row all-to-all as 'post X' and 'wait X' (or 'X (blocking)' when waited at its issue)
    and the matrix products between them as 'N products'. The rows' calls are named by their
    issue order: dispatch and combine, or under ``--ep-overlap`` their two halves each.
    Deterministic: one thread stamps them all."""
    recs = [r for r in run["records"] if r["step"] == step and r["phase"] == "fwd" and r["axis"] == "ep"
            and r["op"] == "all_to_all"]
    starts = [i for i, r in enumerate(recs) if len(r["shape"]) == 1]  # each call opens with its E counts
    group = recs[starts[call]:starts[call + 1] if call + 1 < len(starts) else None]
    counts, rows = group[0], group[1:]
    names = ["dispatch", "combine"] if len(rows) == 2 else ["dispatch 1", "dispatch 2", "combine 1", "combine 2"]
    events = [(counts["t"], "counts")]
    for name, r in zip(names, rows):
        if r["waited"] == r["t"]:  # waited at its issue
            events.append((r["t"], f"{name} (blocking)"))
        else:
            events += [(r["t"], f"post {name}"), (r["waited"], f"wait {name}")]
    end = max(r["done"] for r in group)
    events += [(p["t0"], None) for p in run["products"]
               if p["step"] == step and p["phase"] == "fwd" and counts["t"] <= p["t0"] <= end]
    out: list = []
    for _, name in sorted(events, key=lambda e: e[0]):
        if name is None and out and isinstance(out[-1], int):
            out[-1] += 1
        else:
            out.append(1 if name is None else name)
    return [f"{e} products" if isinstance(e, int) else e for e in out]


def plot_tp_overlap(runs: dict, step: int = -1, ax=None, window: int = 6, title: str | None = None):
    """One lane per rank of `runs` ({rank: one variant of :func:`tp_overlap_job`}): the matrix
    products of a step's forward as grey bars, its tensor-axis calls as lines coloured by op
    (issue times), from the step's first tp call to its `window`-th after it.
    Returns the axes."""
    from matplotlib.lines import Line2D

    if ax is None:
        import matplotlib.pyplot as plt
        _, ax = plt.subplots(figsize=(9, 0.9 + 0.8 * len(runs)))
    drawn: set = set()
    for lane, (rank, run) in enumerate(sorted(runs.items())):
        s = step if step >= 0 else len(run["steps"]) + step
        calls = [r for r in run["records"] if r["step"] == s and r["phase"] == "fwd" and r["op"] != "recv"]
        if not calls:
            continue
        start = calls[0]["t"]
        end = calls[window]["t"] if len(calls) > window else run["steps"][s][1]
        ms = lambda t: (t - start) * 1e3  # noqa: E731
        for p in run["products"]:
            if p["step"] == s and p["phase"] == "fwd" and start <= p["t0"] <= end:
                ax.barh(lane, ms(p["t1"]) - ms(p["t0"]), left=ms(p["t0"]), height=0.5, color="#999999")
        for r in calls:
            if r["t"] <= end:
                drawn.add(r["op"])
                ax.plot([ms(r["t"])] * 2, [lane - 0.4, lane + 0.4], color=OP_COLORS.get(r["op"], "black"), lw=1.5)
    ax.set_yticks(range(len(runs)), [f"rank {r}" for r in sorted(runs)])
    ax.set_xlabel("ms since the step's first tensor-parallel call (forward)")
    ops = sorted(drawn)
    ax.legend(handles=[Line2D([], [], color="#999999", lw=6, label="matrix product")]
              + [Line2D([], [], color=OP_COLORS.get(o, "black"), label=o.replace("_", "-") + " issued") for o in ops],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    return ax
