"""A predicted iteration drawn part by part (what `minitron plan --explain --plot` writes).

One horizontal bar per prediction, split into the parts of
:func:`minitron.analysis.breakdown.explain` in seconds: matrix multiplies by kind in blues,
element-wise work and recomputation in greens, exposed communication in oranges, the
GPU waiting for its host in purple, the bubble in red, the optimizer in grey. Hidden communication is drawn as a hatched bar
beside it: time that overlaps computation and so costs nothing. Several predictions
(software stacks or layouts) share one axis to be compared.
"""
from __future__ import annotations

from matplotlib.figure import Figure

from ..analysis.breakdown import explain

__all__ = ["plot_explain", "save_explain_plot", "PART_COLORS"]

PART_COLORS = {
    "qkv": "#08519c", "proj": "#3182bd", "fc1": "#6baed6", "fc2": "#9ecae1",
    "attention": "#c6dbef", "logits": "#4a6fa5", "elementwise": "#31a354", "recompute": "#a1d99b",
    "tp_comm": "#e6550d", "pp_comm": "#fd8d3c", "dp_comm": "#fdae6b", "bubble": "#c44e52",
    "optimizer": "#8c8c8c", "tp_comm_hidden": "#e6550d", "pp_comm_hidden": "#fd8d3c",
    "dp_comm_hidden": "#fdae6b", "experts": "#2171b5", "cp_comm": "#d94801", "cp_comm_hidden": "#d94801",
    "ep_comm": "#a63603", "ep_comm_hidden": "#a63603", "fsdp_comm": "#fdd0a2", "fsdp_comm_hidden": "#fdd0a2",
    "host_wait": "#756bb1",
}


def plot_explain(predictions: dict, ax=None, title: str | None = None):
    """Draw ``{label: Prediction}`` as stacked bars of seconds per iteration, one row per
    prediction (hidden communication hatched to the right of the total). Returns the axes."""
    if ax is None:
        import matplotlib.pyplot as plt
        _, ax = plt.subplots(figsize=(13, 2.6 + 0.5 * len(predictions)), layout="constrained")
    labels = list(predictions)
    drawn, longest = set(), 0.0
    for y, label in enumerate(labels):
        rows = explain(predictions[label])
        left = 0.0
        for r in (r for r in rows if r["group"] != "hidden"):
            ax.barh(y, r["seconds"], left=left, color=PART_COLORS[r["part"]], edgecolor="white",
                    linewidth=0.4, label=None if r["part"] in drawn else r["label"])
            drawn.add(r["part"])
            left += r["seconds"]
        for r in (r for r in rows if r["group"] == "hidden" and r["seconds"] > 0):
            ax.barh(y, r["seconds"], left=left, color="none", edgecolor=PART_COLORS[r["part"]],
                    hatch="///", linewidth=0.6, label=None if r["part"] in drawn else r["label"])
            drawn.add(r["part"])
            left += r["seconds"]
        longest = max(longest, left)
        p = predictions[label]
        ax.text(left, y, f"  {p.tflops_per_gpu:.0f} TFLOP/s per GPU", fontsize=8, va="center")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_ylim(len(labels) - 0.4, -0.6)
    ax.set_xlim(0, 1.25 * longest)
    ax.set_xlabel("seconds per iteration, slowest pipeline stage (hatched: communication hidden by compute)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    ax.set_title(title or "")
    return ax


def save_explain_plot(predictions: dict, path, title: str | None = None):
    """Draw :func:`plot_explain` into an image file with the Agg backend (no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = Figure(figsize=(13, 2.6 + 0.5 * len(predictions)), layout="constrained")
    FigureCanvasAgg(fig)
    plot_explain(predictions, fig.add_subplot(), title)
    fig.savefig(path, dpi=120)
    return path
