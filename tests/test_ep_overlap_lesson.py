"""Lesson 11's section 9 reads one MoE call's forward off a timed trace
(``viz.tp_overlap.moe_call_order``): in-process, on hand-made records, the plain call's
blocking all-to-alls, the overlapped call's halves posted before the experts they hide under,
and the planted mistake (a half waited at its issue) told apart. The real two-rank run is the
lesson's own stored output (``tests/test_notebooks.py``). Fast: no ranks are started."""
from __future__ import annotations

from minitron.viz.tp_overlap import moe_call_order, products_under


def _run(plan: list[str]) -> dict:
    """A timed_steps_job result for step 0's forward from `plan`: 'counts', 'post X',
    'wait X', 'X' (blocking) and 'mm', one time unit apart."""
    records, products, calls = [], [], {}
    for t, ev in enumerate(plan):
        if ev == "mm":
            products.append({"seq": t, "t0": t, "t1": t + 0.5, "step": 0, "phase": "fwd"})
            continue
        kind, _, name = ev.partition(" ")
        if kind == "wait":
            calls[name]["waited"] = calls[name]["done"] = t
            continue
        rec = {"axis": "ep", "op": "all_to_all", "step": 0, "phase": "fwd", "t": t, "waited": t, "done": t,
               "shape": [4] if ev == "counts" else [8, 32]}
        records.append(rec)
        if kind == "post":
            calls[name] = rec
    return {"records": records, "products": products}


PLAIN = ["counts", "dispatch", "mm", "mm", "combine"]
OVERLAP = ["counts", "post d1", "post d2", "wait d1", "mm", "mm", "post c1", "wait d2", "mm", "mm", "post c2",
           "wait c1", "wait c2"]


def test_the_plain_call_blocks_and_the_overlapped_halves_are_posted_before_the_experts_they_hide_under():
    assert moe_call_order(_run(PLAIN), 0) == ["counts", "dispatch (blocking)", "2 products", "combine (blocking)"]
    run = _run(OVERLAP)
    assert moe_call_order(run, 0) == [
        "counts", "post dispatch 1", "post dispatch 2", "wait dispatch 1", "2 products", "post combine 1",
        "wait dispatch 2", "2 products", "post combine 2", "wait combine 1", "wait combine 2"]
    assert [products_under(run, r) for r in run["records"][1:]] == [0, 2, 2, 0]


def test_a_half_waited_at_once_is_caught():
    planted = ["counts", "post d1", "post d2", "wait d1", "wait d2", "mm", "mm", "post c1", "mm", "mm", "post c2",
               "wait c1", "wait c2"]
    order = moe_call_order(_run(planted), 0)
    assert order.index("wait dispatch 2") < order.index("2 products")
    assert order != moe_call_order(_run(OVERLAP), 0)


def test_the_second_call_of_a_step_is_read_from_its_own_counts():
    run = _run(PLAIN + ["mm"] + OVERLAP)
    assert moe_call_order(run, 0, 1)[:3] == ["counts", "post dispatch 1", "post dispatch 2"]
    assert moe_call_order(run, 0, 0)[-1] == "combine (blocking)"
