"""Interactive widgets for the lessons (Jupyter, ipywidgets from the `course` extra).

`schedule_explorer()` puts a pipeline schedule's shape under sliders: pick the kind
(gpipe, 1f1b, interleaved, zb-h1), the pipeline stages p, the microbatches m and, for
interleaving, the chunks per rank v. Every change builds the schedule with
`minitron.parallel.schedules`, simulates it (`minitron.analysis.pipeline_sim`), redraws its timeline with
`minitron.viz.pipeline.plot_timeline` and prints one line:

    bubble fraction 0.375 (closed form 0.375) · peak stash 4

the simulated bubble, the closed form of `minitron.analysis.bubble` for the same
per-action costs, and the most microbatches any rank stashes (for interleaving,
microbatch-chunks: each holds 1/v of a stage). A shape the engine refuses (interleaving
with fewer microbatches than stages, say) shows the engine's one-line error instead.

The figure is drawn off-screen (Agg) and shown as a PNG, so importing this module and
building the widget need no display and no kernel: tests set the sliders from Python and
read `summary.value`.
"""
from __future__ import annotations

import base64
import io

import ipywidgets as W

from ..analysis.bubble import bubble_fraction
from ..analysis.pipeline_sim import Simulation, simulate
from ..config import V_SCHEDULES
from ..parallel.schedule_actions import KINDS, default_costs
from ..parallel.schedule_check import validate
from ..parallel.schedules import make_schedule
from .pipeline import save_timeline_plot

__all__ = ["ScheduleExplorer", "schedule_explorer", "summary_line"]


def summary_line(sim: Simulation) -> str:
    """'bubble fraction 0.xxx (closed form 0.xxx) · peak stash N' for a simulation.

    The closed form is evaluated at the costs `simulate` used by default (F=1, B=2;
    zb-h1 F=B=W=1), so the two agree wherever the formula holds (zb-h1 needs m >= p)."""
    s = sim.schedule
    c = default_costs(s.kind)
    closed = bubble_fraction(s.kind, s.p, s.m, s.v, t_f=c["F"], t_b=c["B"], t_w=c["W"])
    return (f"bubble fraction {sim.bubble_fraction:.3f} (closed form {closed:.3f})"
            f" · peak stash {max(sim.peak_stashed)}")


def _png_output(sim: Simulation) -> dict:
    """The timeline as one Jupyter display_data output (a PNG drawn with Agg)."""
    buf = io.BytesIO()
    save_timeline_plot(sim, buf)
    s = sim.schedule
    return {"output_type": "display_data", "metadata": {},
            "data": {"image/png": base64.b64encode(buf.getvalue()).decode("ascii"),
                     "text/plain": f"<timeline of {s.kind} p={s.p} v={s.v} m={s.m}>"}}


class ScheduleExplorer(W.VBox):
    """The explorer: controls `kind`, `p`, `m`, `v`, the text line `summary` and the
    timeline in the Output widget `plot`. Setting a control's `.value` (from Python or
    the browser) re-simulates and redraws."""

    def __init__(self, kind: str = "1f1b", p: int = 4, m: int = 8, v: int = 2):
        def look(description):
            return {"description": description, "style": {"description_width": "9em"},
                    "layout": W.Layout(width="26em")}

        def slider(value, lo, hi, description):       # redraws on release, not mid-drag
            return W.IntSlider(value, min=lo, max=hi, continuous_update=False, **look(description))

        self.kind = W.Dropdown(options=list(KINDS), value=kind, **look("schedule"))
        self.p = slider(p, 1, max(8, p), "p (stages)")
        self.m = slider(m, 1, max(32, m), "m (microbatches)")
        self.v = slider(v, 2, max(4, v), "v (chunks)")   # used by interleaved only (V kinds: 2)
        self.summary = W.Label()
        self.plot = W.Output()
        # CSS classes name the parts for browser tests (tests/test_browser.py).
        for name in ("kind", "p", "m", "v", "summary", "plot"):
            getattr(self, name).add_class(f"minitron-{name}")
        super().__init__([W.HBox([self.kind, self.p]), W.HBox([self.m, self.v]),
                          self.summary, self.plot])
        self.add_class("minitron-schedule-explorer")
        for control in (self.kind, self.p, self.m, self.v):
            control.observe(lambda _change: self.redraw(), names="value")
        self.redraw()

    def __repr__(self) -> str:         # the text a notebook stores next to the widget
        kind, p, m, v = self.shape()
        return f"ScheduleExplorer({kind}, p={p}, m={m}, v={v}): {self.summary.value}"

    def shape(self) -> tuple[str, int, int, int]:
        """(kind, p, m, v) as chosen; v is 1 unless the kind is interleaved (2 for the V kinds)."""
        v = self.v.value if self.kind.value == "interleaved" else 2 if self.kind.value in V_SCHEDULES else 1
        return self.kind.value, self.p.value, self.m.value, v

    def redraw(self) -> None:
        """Re-simulate the chosen shape; update the text line and the timeline."""
        kind, p, m, v = self.shape()
        self.v.disabled = kind != "interleaved"
        try:
            sim = simulate(validate(make_schedule(kind, p, v, m)))
        except ValueError as e:          # the engine's one-line refusal (ScheduleError too)
            self.summary.value = f"⚠ {e}"
            self.summary.style.text_color = "#b00020"
            self.plot.outputs = ()
            return
        self.summary.value = summary_line(sim)
        self.summary.style.text_color = None
        self.plot.outputs = (_png_output(sim),)


def schedule_explorer(kind: str = "1f1b", p: int = 4, m: int = 8, v: int = 2
                      ) -> ScheduleExplorer:
    """An interactive pipeline-schedule explorer; show it as a cell's last value.

        from minitron.viz.widgets import schedule_explorer
        schedule_explorer()                    # or schedule_explorer("interleaved", 4, 8, 2)
    """
    return ScheduleExplorer(kind, p, m, v)
