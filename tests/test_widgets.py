"""The schedule explorer (`minitron.viz.widgets`) driven from Python: no kernel, no browser.

Setting a control's value is what the browser does through the widget's comm, so these
checks cover the explorer's logic; tests/test_browser.py drives the same widget in a real
JupyterLab. Expected lines are computed here from the engine.
"""
import base64
import os
import subprocess
import sys

import pytest

pytest.importorskip("ipywidgets", reason="the course extras are not installed: pip install -e .[course]")

from minitron.analysis.bubble import bubble_fraction  # noqa: E402
from minitron.analysis.pipeline_sim import simulate  # noqa: E402
from minitron.parallel.schedule_actions import KINDS, default_costs  # noqa: E402
from minitron.parallel.schedules import make_schedule  # noqa: E402
from minitron.viz.widgets import ScheduleExplorer, schedule_explorer  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def expected(kind, p, m, v=1):
    """The explorer's line for a shape, from the simulator and the closed form."""
    sim = simulate(make_schedule(kind, p, v, m))
    c = default_costs(kind)
    closed = bubble_fraction(kind, p, m, v, t_f=c["F"], t_b=c["B"], t_w=c["W"])
    return (f"bubble fraction {sim.bubble_fraction:.3f} (closed form {closed:.3f})"
            f" · peak stash {max(sim.peak_stashed)}")


def png_of(ex):
    (out,) = ex.plot.outputs
    png = base64.b64decode(out["data"]["image/png"])
    assert png.startswith(PNG_MAGIC)
    return png


def test_explorer_starts_with_a_timeline():
    ex = schedule_explorer()
    assert isinstance(ex, ScheduleExplorer)
    assert ex.shape() == ("1f1b", 4, 8, 1)
    assert ex.summary.value == expected("1f1b", 4, 8) == \
        "bubble fraction 0.375 (closed form 0.375) · peak stash 4"
    assert ex.v.disabled                      # v only matters for interleaving
    png_of(ex)
    assert set(ex.kind.options) == set(KINDS)


def test_controls_resimulate_and_redraw():
    ex = schedule_explorer()
    before = png_of(ex)

    ex.kind.value = "interleaved"
    assert not ex.v.disabled
    assert ex.summary.value == expected("interleaved", 4, 8, 2)
    assert png_of(ex) != before

    ex.v.value = 4
    assert ex.summary.value == expected("interleaved", 4, 8, 4)
    ex.p.value = 2
    assert ex.summary.value == expected("interleaved", 2, 8, 4)

    ex.kind.value = "zb-h1"                   # v is ignored again: zb-h1 has one chunk
    assert ex.v.disabled and ex.shape() == ("zb-h1", 2, 8, 1)
    assert ex.summary.value == expected("zb-h1", 2, 8)

    ex.m.value = 3
    ex.kind.value = "gpipe"
    assert ex.summary.value == expected("gpipe", 2, 3) == \
        "bubble fraction 0.333 (closed form 0.333) · peak stash 3"


@pytest.mark.parametrize("kind, p, m, v", [("interleaved", 4, 3, 2), ("interleaved", 1, 4, 2)])
def test_invalid_shape_shows_the_engines_one_line_error(kind, p, m, v):
    with pytest.raises(ValueError) as err:
        make_schedule(kind, p, v, m)
    ex = schedule_explorer(kind, p=4, m=8, v=v)
    ex.p.value, ex.m.value = p, m
    assert ex.summary.value == f"⚠ {err.value}"
    assert "\n" not in ex.summary.value and "Traceback" not in ex.summary.value
    assert ex.plot.outputs == ()               # no stale timeline under an error
    assert ex.summary.style.text_color

    ex.p.value, ex.m.value = 4, 8              # a valid shape again: back to normal
    assert ex.summary.value == expected(kind, 4, 8, v)
    assert not ex.summary.style.text_color
    png_of(ex)


def test_needs_no_display():
    """Importing the module and building the widget never touches pyplot (a GUI backend)."""
    code = ("import sys; from minitron.viz.widgets import schedule_explorer; schedule_explorer(); "
            "assert 'matplotlib.pyplot' not in sys.modules, 'pyplot imported'")
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "MPLBACKEND")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
