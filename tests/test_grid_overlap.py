"""--tp-overlap on 2-D and 2.5-D tensor parallelism (SUMMA, parallel/summa.py) and on the
cube (3-D, parallel/cube.py). SUMMA: each step's row and column broadcasts posted under the
product of the step before, each partial product's reduce waited under the product after
it. The cube: a product's two gathers in flight at once, dX's reduce-scatter under dW's
product (the 3-D paper's own order), and in the forward the second half of each weight's
gather under the first half's product. Both move the plain schedule's bytes; SUMMA in the
plain schedule's calls, the cube in more (its weights gathered in pieces).

In-process: every mode accepted, the one-line refusal that remains (the split backward);
the order in which a SUMMA product posts and waits its calls around its products, with the
step each call belongs to (forward and backward, the linears' X·W and the output layer's
X·Bᵀ, q = 2 and 3), and the cube product's order (a Linear3D's and the output layer's), with
planted mistakes (every call waited before its product; the prefetch of the wrong step)
caught; whole models' dry runs moving the same bytes with and without the flag (fp32 and
bf16), in the calls the analysis counts. On real ranks (one launch of 8):
2-D tp4 × dp2 and × pp2, 2.5-D tp8 (q = 2, d = 2) and the cube tp8 with --tp-overlap equal
one device in float64 (1e-9) over 2 steps, the planted wrong step does not, each traced
step equals the analysis per axis and op exactly, which prices the flag at the plain
layout's bytes, the cube's traced calls are analysis/cube.py's, and its traced bytes and
losses equal its plain run's.
"""
from __future__ import annotations

import re
from collections import Counter
from contextlib import nullcontext
from dataclasses import replace
from unittest import mock

import pytest
import torch

from minitron.analysis import comm as A
from minitron.analysis import cube as C
from minitron.analysis.dry_run import dry_context, dry_trace
from minitron.comm import Comm, CommTrace, Pending
from minitron.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig, validate
from minitron.parallel import cube, summa
from minitron.parallel.summa import _SummaAB, _SummaABT
from minitron.tools.testing import traced_step_bytes
from test_tp_overlap import _Matmuls  # 'mm' logged as each matrix product starts

MODEL = ModelConfig(layers=2, hidden=32, heads=4, seq_len=16, vocab=256)
TRAIN = TrainConfig(steps=2, global_batch=8, microbatches=2, dtype="float64", lr=1e-2, warmup=1, eval_every=0,
                    progress=False, sample_tokens=0)
TOL = 1e-9
REAL_STEPS = summa.summa_steps
# the real calls, taken once: the event logs below wrap them afresh for each product they watch
WAIT, BROADCAST, REDUCE, ALL_GATHER, REDUCE_SCATTER = (Pending.wait, Comm.broadcast, Comm.reduce, Comm.all_gather,
                                                       Comm.reduce_scatter)


def wrong_step(q, post, overlap):
    """The planted mistake: each step handed the blocks of the step before (step 0's
    twice), as a prefetch of the wrong step would; the same calls and bytes."""
    return REAL_STEPS(q, lambda l: post(max(l - 1, 0)), overlap)


# --- what is built, what is refused ---------------------------------------------------------------
@pytest.mark.parametrize("layout", [dict(tp=4, tp_mode="2d"), dict(tp=4, tp_mode="2d", dp=2),
                                    dict(tp=4, tp_mode="2d", pp=2, schedule="interleaved", vpp=1),
                                    dict(tp=2, sp=True), dict(tp=8, tp_mode="3d"),
                                    dict(tp=8, tp_mode="3d", pp=2, schedule="interleaved", vpp=1),
                                    dict(tp=8, tp_mode="2.5d", tp_depth=2)])
def test_every_tensor_parallel_mode_is_accepted(layout):
    validate(MODEL, ParallelConfig(tp_overlap=True, **layout))


@pytest.mark.parametrize("layout,words", [
    (dict(tp=8, tp_mode="3d", pp=2, schedule="zb-h1"), "--tp-mode 3d is not checked under --schedule zb-h1"),
    (dict(tp=4, tp_mode="2d", pp=2, schedule="zb-h1"), "not checked under --schedule zb-h1"),
    (dict(tp=4, tp_mode="2d", pp=2, schedule="zb-v"), "not checked under --schedule zb-v"),
])
def test_the_rest_is_refused_with_one_line(layout, words):
    with pytest.raises(ConfigError, match=re.escape(words)) as e:
        validate(MODEL, ParallelConfig(tp_overlap=True, **layout))
    assert "\n" not in str(e.value)


# --- the order of issue: every call in flight under a product ----------------------------------------
def expected(q: int, posts: int, products: int, reduces: bool, overlap: bool) -> list[str]:
    """A SUMMA product's events ('b{l}': a broadcast of step l's block posted, 'r{l}': step
    l's reduce posted, 'wait' for either, 'mm' a product begins) for `posts` broadcasts,
    `products` products and at most one reduce per step. Overlapped: step l+1's broadcasts
    posted before step l's products and waited after them; step l's reduce waited after
    step l+1's products. Plain: each call waited before anything else starts."""
    def post(l):
        return [f"b{l}"] * posts

    if not overlap:
        return [e for l in range(q) for e in post(l) + ["wait"] * posts + ["mm"] * products + [f"r{l}", "wait"] * reduces]
    seq = post(0) + ["wait"] * posts
    for l in range(q):
        ahead = l < q - 1
        seq += post(l + 1) * ahead + ["mm"] * products
        seq += ([f"r{l}"] + ["wait"] * (l > 0)) * reduces + ["wait"] * posts * ahead
    return seq + ["wait"] * reduces


def _issue_order(q: int, fn, overlap: bool, rank: int, monkeypatch) -> tuple[list, list]:
    """(forward, backward) event logs of one SUMMA product (`fn`: _SummaAB or _SummaABT) on
    grid rank `rank` of q×q, on a dry Comm (nothing sent): each broadcast and reduce logged
    with its root, the step it belongs to, as it is posted."""
    events: list = []
    monkeypatch.setattr(Pending, "wait", lambda self: (events.append("wait"), WAIT(self))[1])
    monkeypatch.setattr(Comm, "broadcast", lambda self, t, axis, src_index=0, async_op=False: (
        events.append(f"b{src_index}"), BROADCAST(self, t, axis, src_index, async_op))[1])
    monkeypatch.setattr(Comm, "reduce", lambda self, t, axis, dst_index=0, async_op=False: (
        events.append(f"r{dst_index}"), REDUCE(self, t, axis, dst_index, async_op))[1])
    ctx = dry_context(ParallelConfig(tp=q * q, tp_mode="2d", tp_overlap=overlap), rank, torch.float64, CommTrace())
    x = torch.randn(2, 4, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)
    with _Matmuls(events):
        y = fn.apply(x, w, ctx.comm, overlap)
        forward = list(events)
        events.clear()
        y.backward(torch.ones_like(y))
    return forward, list(events)


@pytest.mark.parametrize("q", [2, 3])
def test_each_call_is_posted_before_the_product_it_hides_under_and_waited_after(q, monkeypatch):
    """X·W forward: X(r, l+1) and W(l+1, c) broadcast while X(r, l)·W(l, c) runs; backward,
    dX then dW, each W (X) block broadcast under the product before and each partial
    product's reduce waited under the product after. X·Bᵀ (the output layer) forward:
    the B blocks prefetched, the partial logits' reduces under the next product; backward
    dZ and B prefetched together, two products per step. Planted: the plain schedule
    (every call waited before its product) and the prefetch of the wrong step read otherwise."""
    ab = {"fwd": expected(q, 2, 1, False, True), "bwd": expected(q, 1, 1, True, True) * 2}
    abt = {"fwd": expected(q, 1, 1, True, True), "bwd": expected(q, 2, 2, True, True)}
    for rank in (0, q * q - 1):
        for fn, want in ((_SummaAB, ab), (_SummaABT, abt)):
            fwd, bwd = _issue_order(q, fn, True, rank, monkeypatch)
            assert fwd == want["fwd"], (fn.__name__, fwd)
            assert bwd == want["bwd"], (fn.__name__, bwd)
    fwd, bwd = _issue_order(q, _SummaAB, False, 0, monkeypatch)  # planted: waited before the product
    assert fwd == expected(q, 2, 1, False, False) != ab["fwd"]
    assert bwd == expected(q, 1, 1, True, False) * 2 != ab["bwd"]
    monkeypatch.setattr(summa, "summa_steps", wrong_step)  # planted: the wrong step prefetched
    fwd, bwd = _issue_order(q, _SummaAB, True, 0, monkeypatch)
    assert fwd != ab["fwd"] and bwd != ab["bwd"]


# --- the cube: the paper's schedule ---------------------------------------------------------------
def _cube_issue_order(overlap: bool, monkeypatch, planted: bool = False, w_dim: int = 1) -> tuple[list, list]:
    """(forward, backward) event logs of one cube product (placement (j, k), rank 5 of the
    2×2×2 cube) on a dry Comm: each gather 'ag' and reduce-scatter 'rs' logged with its axis
    as it is posted ('~': async), 'wait' for a Pending, 'mm' a product begins. `planted`:
    every async call waited at once (a wait before the product it should run under).
    `w_dim` 1: a Linear3D's weight (gathered along its columns); 0: the output layer's wte
    (gathered along its rows, the output dimension)."""
    events: list = []

    def logged(real, op):
        def call(self, t, axis, dim=0, async_op=False, **kw):
            events.append(f"{op}:{axis[-1]}{'~' * async_op}")
            done = real(self, t, axis, dim, async_op, **kw)
            return (done, done.wait())[0] if planted and async_op else done
        return call
    monkeypatch.setattr(Pending, "wait", lambda self: (events.append("wait"), WAIT(self))[1])
    monkeypatch.setattr(Comm, "all_gather", logged(ALL_GATHER, "ag"))
    monkeypatch.setattr(Comm, "reduce_scatter", logged(REDUCE_SCATTER, "rs"))
    ctx = dry_context(ParallelConfig(tp=8, tp_mode="3d", tp_overlap=overlap), 5, torch.float64, CommTrace())
    x = torch.randn(2, 4, 6, dtype=torch.float64, requires_grad=True)
    # a Linear3D's [d_out/q, d_in/q²] (columns gathered along i: d_in/q), or wte's [V'/q², h/q] (rows gathered)
    w = torch.randn(8, 3 if w_dim else 6, dtype=torch.float64, requires_grad=True)
    with _Matmuls(events):
        y = cube.cube_product(x, w, ctx.comm, cube.J, w_dim, cube.K, overlap)
        forward = list(events)
        events.clear()
        y.backward(torch.ones_like(y))
    return forward, list(events)


@pytest.mark.parametrize("w_dim", [1, 0])
def test_cube_product_follows_the_papers_schedule(w_dim, monkeypatch):
    """Forward: X's gather along j and the gather along i of W's first piece (half its
    output rows) posted together and both waited; the second piece's gather posted, the
    first piece's product run under it, then waited and the second product run; the
    reduce-scatter along k. Backward: dY gathered along k, dX's product, its
    reduce-scatter along j posted and left in flight while dW's product runs, dW's
    reduce-scatter along i posted, then both waited. Planted: every call waited at once
    (no product between a forward gather's issue and its wait) reads otherwise, and so
    does the plain schedule."""
    def product_under_second_gather(events):  # an 'mm' between the second weight gather's post and its wait
        post = events.index("ag:i~", events.index("ag:i~") + 1)
        return "mm" in events[post:events.index("wait", post)]
    fwd, bwd = _cube_issue_order(True, monkeypatch, w_dim=w_dim)
    assert fwd == ["ag:j~", "ag:i~", "wait", "wait", "ag:i~", "mm", "wait", "mm", "rs:k"], fwd
    assert product_under_second_gather(fwd)
    assert bwd == ["ag:k", "mm", "rs:j~", "mm", "rs:i~", "wait", "wait"], bwd
    planted = _cube_issue_order(True, monkeypatch, planted=True, w_dim=w_dim)
    assert not product_under_second_gather(planted[0])
    assert planted[0] == ["ag:j~", "wait", "ag:i~", "wait", "wait", "wait", "ag:i~", "wait", "mm", "wait", "mm",
                          "rs:k"], planted
    assert planted[1] == ["ag:k", "mm", "rs:j~", "wait", "mm", "rs:i~", "wait", "wait", "wait"], planted
    assert _cube_issue_order(False, monkeypatch, w_dim=w_dim) != (fwd, bwd)


@pytest.mark.parametrize("tp,mode,rank,precision", [(4, "2d", 0, "fp32"), (4, "2d", 3, "bf16"), (8, "3d", 5, "fp32"),
                                                    (8, "3d", 6, "bf16")])
def test_the_model_makes_the_plain_calls(tp, mode, rank, precision):
    """A whole model's forward and backward (a dry run) moves the same bytes per (phase,
    axis, op, dtype) with the flag as without it, in fp32 and under bf16's autocast
    (activations in bf16 on the wire, weights and their gradients in fp32). SUMMA posts the
    very same calls, so analysis/summa.py counts both; the cube's forward gathers each
    weight in pieces, and every call's (phase, axis, op, bytes), with and without the
    flag, is the one analysis/cube.py counts."""
    def records(overlap):
        layout = ParallelConfig(tp=tp, tp_mode=mode, tp_overlap=overlap, precision=precision)
        return dry_trace(MODEL, layout, tp, rank).records

    def summed(recs):
        out = Counter()
        for r in recs:
            out[(r["phase"], r["axis"], r["op"], r["dtype"])] += r["bytes"]
        return out
    plain, overlapped = records(False), records(True)
    assert plain and summed(overlapped) == summed(plain)
    calls = [Counter((r["phase"], r["axis"], r["op"], r["bytes"], r["dtype"]) for r in recs)
             for recs in (plain, overlapped)]
    if mode == "2d":
        assert calls[1] == calls[0]
        return
    assert calls[1] != calls[0]
    for recs, overlap in ((plain, False), (overlapped, True)):
        want = C.cube_collectives(MODEL, tp, C.cube_q(tp), act_bytes_per_el=2 if precision == "bf16" else 4,
                                  overlap=overlap)
        assert (Counter((r["phase"], r["axis"], r["op"], r["bytes"]) for r in recs)
                == Counter((c["phase"], c["axis"], c["op"], c["bytes"]) for c in want for _ in range(c["calls"])))


# --- on real ranks: one launch of 8 -------------------------------------------------------------------
GRID = dict(tp=4, tp_mode="2d")
# the 2-D plain layouts' runs are test_summa.py's (their traced step = the same analysis); the cube's plain
# run is here, its product being new code in both schedules
CASES = [("2d tp4 x dp2 overlap", dict(GRID, dp=2, tp_overlap=True), False),
         ("2d tp4 x dp2 overlap, wrong step prefetched (planted)", dict(GRID, dp=2, tp_overlap=True), True),
         ("2d tp4 x pp2 overlap", dict(GRID, pp=2, tp_overlap=True), False),
         ("2.5d tp8 (q 2, d 2) overlap", dict(tp=8, tp_mode="2.5d", tp_depth=2, tp_overlap=True), False),
         ("3d tp8", dict(tp=8, tp_mode="3d"), False), ("3d tp8 overlap", dict(tp=8, tp_mode="3d", tp_overlap=True), False)]
PLAIN_OF = {"3d tp8 overlap": "3d tp8"}


def _overlap_job(comm, cases):
    """Each case's 2 float64 steps on these ranks (its own grid), traced: the oracle's
    verdict (rank 0), the losses, step 0's traced bytes per axis and op and the analysis's
    for the layout and for it without --tp-overlap."""
    from minitron.data import load_corpus
    from minitron.grid import ProcessGrid
    from minitron.tools.verify import versus_one_device
    from minitron.train import Trainer

    corpus, rank, out = load_corpus(""), comm.grid.rank, {}
    for name, kw, planted in cases:
        layout = ParallelConfig(**kw)
        c = Comm(ProcessGrid.for_layout(layout, rank).build_groups(), CommTrace())
        with mock.patch("minitron.parallel.summa.summa_steps", wrong_step) if planted else nullcontext():
            tr = Trainer(MODEL, layout, TRAIN, c, corpus)
            losses = [tr.step(i) for i in range(TRAIN.steps)]
        step0 = [r for r in c.trace.records if r["rank"] == rank and r["step"] == 0 and r["phase"] != "log"]
        out[name] = {"losses": losses, "traced": traced_step_bytes(c.trace.records, rank),
                     "calls": dict(Counter((r["axis"], r["op"]) for r in step0)),
                     "want_calls": _calls(C.cube_comm_items(MODEL, layout, TRAIN)) if kw["tp_mode"] == "3d" else None,
                     "want": {flag: _nonzero(A.comm_bytes_per_step(MODEL, replace(layout, tp_overlap=flag), TRAIN,
                                                                   c.index("pp"))) for flag in (False, True)},
                     "one_device": versus_one_device(c, tr, losses, MODEL,
                                                     TRAIN.replace(microbatches=TRAIN.microbatches * layout.data_replicas))}
    return out


def _calls(items: list[dict]) -> dict:
    """Calls per (axis, op) of a step's items (those it prices at zero bytes left out)."""
    out = Counter()
    for it in items:
        if it["bytes"]:
            out[(it["axis"], it["op"])] += it["calls"]
    return dict(out)


def _nonzero(by_axis: dict) -> dict:
    """comm_bytes_per_step without the axes and ops it prices at zero (a trace has no such entries)."""
    return {a: {op: nb for op, nb in ops.items() if nb} for a, ops in by_axis.items() if any(ops.values())}


@pytest.fixture(scope="module")
def eight():
    from minitron.tools.testing import run_on_ranks

    for _, kw, _ in CASES:
        validate(MODEL, ParallelConfig(**kw), TRAIN, world=8)
    return run_on_ranks(_overlap_job, ParallelConfig(tp=8, tp_mode="3d"), CASES)


@pytest.mark.multirank
def test_overlapped_layouts_equal_one_device_and_the_plant_is_caught(eight):
    """verify --dtype float64 (1e-9), loss and parameters: 2-D tp4 × dp2 and × pp2, 2.5-D tp8
    and the cube tp8, each with --tp-overlap, and the plain cube; the overlapped cube's losses equal
    the plain one's (1e-9) on every rank; the wrong step prefetched is caught."""
    for name, _, planted in CASES:
        res = eight[0][name]["one_device"]
        print(f"{name:<54} loss {res['max_loss_abs_diff']:.1e} param {res['max_param_rel_diff']:.1e}")
        assert (res["max_loss_abs_diff"] <= TOL and res["max_param_rel_diff"] <= TOL) != planted, (name, res)
    for rank, res in eight.items():
        for overlapped, plain in PLAIN_OF.items():
            assert max(abs(a - b) for a, b in zip(res[overlapped]["losses"], res[plain]["losses"])) <= TOL, rank


@pytest.mark.multirank
def test_overlapped_traced_step_equals_the_analysis_and_the_plain_bytes(eight):
    """Each rank's step 0 equals comm_bytes_per_step per axis and op, with and without the
    flag; the analysis prices the overlapped layout as the plain one (whose traced step
    test_summa.py and test_cube.py hold equal to it), and the overlapped cube's traced bytes
    equal its plain run's on every axis and op; the cube's traced calls per axis and op are
    analysis/cube.py's closed form's (cube_comm_items), more with the flag (its weights
    gathered in pieces)."""
    for rank, res in eight.items():
        for name, kw, _ in CASES:
            got, want = res[name]["traced"], res[name]["want"]
            lines = {"summa_row", "summa_col"} if kw["tp_mode"] != "3d" else {"cube_i", "cube_j", "cube_k"}
            assert got == want[kw.get("tp_overlap", False)] == want[False] and lines <= set(got), (rank, name, got, want)
        for overlapped, plain in PLAIN_OF.items():
            assert res[overlapped]["traced"] == res[plain]["traced"], (rank, overlapped)
            for name in (overlapped, plain):  # the closed form's calls: the weights gathered in pieces
                assert res[name]["calls"] == res[name]["want_calls"], (rank, name, res[name]["calls"])
            assert res[overlapped]["calls"] != res[plain]["calls"], rank
