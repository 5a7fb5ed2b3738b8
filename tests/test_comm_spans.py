"""What ran under what, measured: a timed trace stamps each call when it is issued, when
its rank begins to wait for it and when it is done (``Comm`` tells the trace; a
``Pending`` when it is waited for), and the run report says per axis how much of the time
in flight the rank did not wait (``viz.comm.exposure_by_axis``).

In-process: the sums over hand-made records. On real ranks (one launch of 2): tp2+sp with
and without ``--tp-overlap`` and ep2 with and without ``--ep-overlap``, with every matrix
product stamped: every overlapped shift and half all-to-all has a product that ran wholly
while it was in flight, before its rank waited; the plain layouts' blocking calls (the
planted mistake: a wait right after the post) have none and are all exposed.
"""
from __future__ import annotations

import pytest

from minitron.config import ParallelConfig, TrainConfig, preset
from minitron.tools.testing import run_on_ranks
from minitron.comm import TimedTrace
from minitron.viz.comm import exposure_by_axis


def test_exposure_sums_in_flight_and_waited_time_per_axis():
    recs = [  # a blocking all-reduce, an async all-gather waited late, a shift (send + recv), one unstamped
        {"axis": "tp", "op": "all_reduce", "t": 1.0, "waited": 1.0, "done": 1.5},
        {"axis": "tp", "op": "all_gather", "t": 2.0, "waited": 2.6, "done": 2.8},
        {"axis": "cp", "op": "send", "t": 3.0, "waited": 3.9, "done": 4.0},
        {"axis": "cp", "op": "recv", "t": 3.0, "waited": 3.9, "done": 4.0},
        {"axis": "pp", "op": "send", "t": 5.0},
    ]
    e = exposure_by_axis(recs)
    assert set(e) == {"tp", "cp"}
    assert e["tp"]["calls"] == 2 and e["tp"]["in_flight_s"] == pytest.approx(1.3)
    assert e["tp"]["exposed_s"] == pytest.approx(0.7) and e["tp"]["hidden"] == pytest.approx(1 - 0.7 / 1.3)
    assert e["cp"]["calls"] == 1 and e["cp"]["hidden"] == pytest.approx(0.9)


def test_a_timed_trace_stamps_a_call_when_done():
    tr = TimedTrace()
    rec = tr.add(op="all_reduce", axis="tp", bytes=4)
    tr.completed(rec, None)  # blocking: waited from its issue
    assert rec["waited"] == rec["t"] <= rec["done"]
    rec = tr.add(op="all_gather", axis="tp", bytes=4)
    tr.completed(rec, rec["t"] + 1e-6)
    assert rec["t"] < rec["waited"] <= rec["done"]


TRAIN = TrainConfig(steps=2, global_batch=4, microbatches=1, progress=False, eval_every=0, sample_tokens=0)
TP = [ParallelConfig(tp=2, sp=True, device="cpu"), ParallelConfig(tp=2, sp=True, tp_overlap=True, device="cpu")]
EP = [ParallelConfig(ep=2, device="cpu"), ParallelConfig(ep=2, ep_overlap=True, device="cpu")]


def _both(comm):
    from minitron.viz.tp_overlap import timed_steps_job

    return (timed_steps_job(comm, preset("tiny"), TRAIN, TP)
            + timed_steps_job(comm, preset("moe-tiny"), TRAIN, EP))


@pytest.fixture(scope="module")
def runs():
    return run_on_ranks(_both, TP[0])


def _forward_calls(run, axis, op):
    return [r for r in run["records"] if r["axis"] == axis and r["op"] == op and r["phase"] == "fwd"
            and r["step"] == 1]


@pytest.mark.multirank
def test_overlapped_calls_are_in_flight_under_a_product_and_plain_ones_wait_at_once(runs):
    from minitron.viz.tp_overlap import products_under

    for rank in (0, 1):
        plain_tp, tp, plain_ep, ep = runs[rank]
        for run in runs[rank]:  # every stamped call: issued, then waited, then done
            assert all(r["t"] <= r["waited"] <= r["done"] for r in run["records"] if "done" in r)
        shifts = _forward_calls(tp, "tp", "send")
        assert shifts and all(products_under(tp, r) >= 1 for r in shifts), "a chunk was waited before a product ran"
        halves = [r for r in _forward_calls(ep, "ep", "all_to_all") if r["shape"] and len(r["shape"]) > 1]
        assert len(halves) == 4 * 2  # two MoE blocks: dispatch and combine, each in two halves
        assert sum(products_under(ep, r) >= 1 for r in halves) >= len(halves) // 2  # each pair: one under the other's experts
        # the planted mistake, a wait at once: the plain layouts' calls have no product under them
        for run, axis, op in ((plain_tp, "tp", "all_gather"), (plain_ep, "ep", "all_to_all")):
            calls = _forward_calls(run, axis, op)
            assert calls and all(r["waited"] == r["t"] and products_under(run, r) == 0 for r in calls)
            assert exposure_by_axis(calls)[axis]["hidden"] == 0

