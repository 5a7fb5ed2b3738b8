"""Pictures of pipeline schedules: Gantt charts of simulated or measured timelines.

A timeline is a list of records {"rank", "op", "mb", "chunk", "start", "end"}: what
`Simulation.records()` returns and what the runtime's `--timeline FILE` writes, one
JSON object per line. Both are drawn by the same function, so a lesson can put the
simulator's prediction next to a real run. matplotlib's pyplot is imported only when
a function has to make its own axes, so this module imports without a display.
"""
from __future__ import annotations

from matplotlib import colors as mcolors
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from ..comm import read_trace

OP_COLORS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}


def load_timeline(path, calls: bool = False) -> list[dict]:
    """The pipeline's compute actions of a runtime `--timeline` file (JSON lines, like a
    ``--trace`` file: :func:`minitron.comm.read_trace` reads every line); with `calls`,
    the ranks' timed calls written beside them instead (``"kind": "comm"``,
    :meth:`minitron.comm.Comm.write_spans`)."""
    return [r for r in read_trace(path) if (r.get("kind") == "comm") == calls]


def _records(sim_or_timeline) -> tuple[list[dict], str | None]:
    """Records with time starting at 0, and a default title for a Simulation."""
    if hasattr(sim_or_timeline, "records"):
        s = sim_or_timeline.schedule
        title = (f"{s.kind}  p={s.p} v={s.v} m={s.m}  "
                 f"bubble {sim_or_timeline.bubble_fraction:.3f}")
        return sim_or_timeline.records(), title
    recs = [r for r in sim_or_timeline if r["op"] in OP_COLORS]
    t0 = min((r["start"] for r in recs), default=0.0)
    return [{**r, "start": r["start"] - t0, "end": r["end"] - t0} for r in recs], None


def _shade(op: str, chunk: int, v: int):
    """Chunk 0 in the op's colour, later chunks paler."""
    rgb = mcolors.to_rgb(OP_COLORS[op])
    t = 0.6 * chunk / max(v - 1, 1)
    return tuple(c + (1 - c) * t for c in rgb)


def plot_timeline(sim_or_timeline, ax=None, title: str | None = None):
    """Draw one row per rank, a box per F/B/W coloured by op, shaded by chunk, with
    the microbatch number inside when it fits. Accepts a `Simulation` or a list of
    measured records. Returns the axes."""
    recs, default_title = _records(sim_or_timeline)
    p = 1 + max((r["rank"] for r in recs), default=0)
    v = 1 + max((r["chunk"] for r in recs), default=0)
    end = max((r["end"] for r in recs), default=1.0) or 1.0
    if ax is None:
        import matplotlib.pyplot as plt
        _, ax = plt.subplots(figsize=(10, 0.6 + 0.45 * p))
    fig = ax.get_figure()
    width_pt = ax.get_position().width * fig.get_figwidth() * 72
    for r in recs:
        w = r["end"] - r["start"]
        ax.add_patch(Rectangle((r["start"], r["rank"] - 0.4), w, 0.8,
                               facecolor=_shade(r["op"], r["chunk"], v),
                               edgecolor="white", linewidth=0.5))
        if w / end * width_pt >= 9:
            ax.text(r["start"] + w / 2, r["rank"], str(r["mb"]), ha="center",
                    va="center", fontsize=7, color="white" if r["chunk"] == 0 else "black")
    ax.set_xlim(0, end)
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_yticks(range(p), [f"rank {i}" for i in range(p)])
    ax.set_xlabel("time")
    ops = [op for op in OP_COLORS if any(r["op"] == op for r in recs)]
    handles = [Patch(color=_shade(op, c, v), label=op if v == 1 else f"{op} chunk {c}")
               for op in ops for c in range(v)]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0),
              fontsize=7, frameon=False)
    ax.set_title(title or default_title or "")
    return ax


def save_timeline_plot(sim_or_timeline, path, title: str | None = None):
    """Draw the timeline into an image file with the Agg backend (no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    recs, _ = _records(sim_or_timeline)
    p = 1 + max((r["rank"] for r in recs), default=0)
    fig = Figure(figsize=(10, 0.9 + 0.45 * p), layout="constrained")
    FigureCanvasAgg(fig)
    plot_timeline(sim_or_timeline, fig.add_subplot(), title)
    fig.savefig(path, dpi=120)
    return path


def plot_placement(placement, ax=None, title: str | None = None):
    """Draw a `schedules.Placement`: one row per rank, one box per local chunk labelled
    with the global stage it holds, and the path of the activations through the stages
    (the loop wraps from the last rank back to rank 0; the V turns on rank p-1 and comes
    back to rank 0, which holds the first and the last stage). Returns the axes."""
    p, v = placement.p, placement.v
    if ax is None:
        import matplotlib.pyplot as plt
        _, ax = plt.subplots(figsize=(1.6 + 1.3 * v, 0.6 + 0.5 * p))
    centre = {}
    for r, stages in enumerate(placement.table()):
        for c, s in enumerate(stages):
            ax.add_patch(Rectangle((c + 0.1, r - 0.35), 0.8, 0.7, facecolor=_shade("F", c, v),
                                   edgecolor="white"))
            ax.text(c + 0.5, r, f"stage {s}", ha="center", va="center", fontsize=8,
                    color="white" if c == 0 else "black")
            centre[s] = (c + 0.5, r)
    xs, ys = zip(*(centre[s] for s in range(placement.num_stages)))
    ax.plot(xs, ys, color="0.3", linewidth=0.8, marker=".", zorder=0)
    ax.set_xlim(0, v)
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_xticks([c + 0.5 for c in range(v)], [f"chunk {c}" for c in range(v)])
    ax.set_yticks(range(p), [f"rank {i}" for i in range(p)])
    ax.set_title(title or f"{placement.kind} placement, p={p}, v={v}")
    return ax

