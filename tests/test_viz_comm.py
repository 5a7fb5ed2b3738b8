"""minitron.viz.comm: trace summaries, communication diagrams and the data-parallel
overlap job (in one process; the lessons run it on real ranks)."""
from __future__ import annotations

import pytest

from minitron import PRESETS, ParallelConfig, TrainConfig
from minitron.comm import TimedTrace
from minitron.viz import comm as VC
from minitron.tools.testing import run_on_ranks

REC = dict(rank=0, step=0, microbatch=0, axis="tp", dtype="float32")
RECORDS = [
    {**REC, "op": "all_reduce", "phase": "fwd", "bytes": 64, "shape": [2, 8]},
    {**REC, "op": "all_gather", "phase": "fwd", "bytes": 32, "shape": [2, 4]},
    {**REC, "op": "all_reduce", "phase": "bwd", "bytes": 64, "shape": [2, 8]},
    {**REC, "op": "all_reduce", "phase": "optim", "bytes": 8, "shape": [], "microbatch": None},
    {**REC, "op": "all_reduce", "phase": "fwd", "bytes": 64, "shape": [2, 8], "rank": 1},
]


def test_select_and_totals():
    assert len(VC.select(RECORDS, rank=0)) == 4
    assert VC.select(RECORDS, rank=0, phase="bwd") == [RECORDS[2]]
    assert VC.totals(RECORDS, rank=0) == {("fwd", "all_reduce"): {"calls": 1, "bytes": 64},
                                          ("fwd", "all_gather"): {"calls": 1, "bytes": 32},
                                          ("bwd", "all_reduce"): {"calls": 1, "bytes": 64},
                                          ("optim", "all_reduce"): {"calls": 1, "bytes": 8}}
    assert VC.totals(RECORDS, by=("op",), rank=0) == {"all_reduce": {"calls": 3, "bytes": 136},
                                                      "all_gather": {"calls": 1, "bytes": 32}}


def test_human_bytes():
    assert VC.human_bytes(8) == "8 B"
    assert VC.human_bytes(16384) == "16 KiB"
    assert VC.human_bytes(1536) == "1.5 KiB"
    assert VC.human_bytes(3 * 2**20) == "3 MiB"


def test_timed_trace_orders_calls_and_stamps():
    tr = TimedTrace()
    s0, _ = tr.stamp()
    tr.add(op="all_reduce", bytes=4)
    s2, _ = tr.stamp()
    rec = tr.records[0]
    assert s0 < rec["seq"] < s2 and rec["t"] > 0 and tr.total_bytes(op="all_reduce") == 4


def test_plots_draw_one_box_per_call():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = VC.select(RECORDS, rank=0)
    ax = VC.plot_calls(recs, labels=["a", "b", "c", "d"], highlight={0}, columns=6, title="t")
    assert len(ax.patches) == 4 and ax.get_xlim() == (0, 6)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["fwd", "bwd", "optim"]
    plt.close("all")


def test_overlap_job_in_one_process():
    """World of one: the job runs in-process (no calls on a one-rank axis), stamps every
    gradient of every microbatch, and the plot and the event list accept its result."""
    model = PRESETS["tiny"]
    train = TrainConfig(global_batch=4, microbatches=2, progress=False)
    layouts = [ParallelConfig()]
    (run,) = run_on_ranks(VC.dp_overlap_job, layouts[0], model, train, layouts, 2)[0]
    n = len(run["params"])
    assert len(run["steps"]) == 2 and run["buckets"] is None and run["records"] == []
    assert len(run["grads"]) == 2 * 2 * n  # steps × microbatches × tensors
    assert {g["name"] for g in run["grads"]} == set(run["params"])
    assert VC.overlap_events(run) == []
    # a hand-made record: issued after every gradient of the last microbatch
    last = max(g["seq"] for g in run["grads"])
    run["records"] = [{**REC, "axis": "dp", "step": 1, "op": "all_reduce", "phase": "optim", "bytes": 8,
                       "microbatch": None, "seq": last + 1, "t": run["steps"][1][1]}]
    assert VC.overlap_events(run) == [{"op": "all_reduce", "phase": "optim", "microbatch": None, "bytes": 8,
                                       "grads_before": n, "grads_total": n}]
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ax = VC.plot_overlap(run)
    assert ax.get_title() == run["layout"]
    plt.close("all")
