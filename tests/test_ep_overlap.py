"""--ep-overlap: each MoE call's dispatch and combine all-to-alls in two halves by local
expert, one in flight while the other half's experts run (parallel/expert_overlap.py;
DeepSeek-V3 §3.2.1).

In-process: the refusals, one line each. On real ranks (one launch of 4): moe-tiny and the
tiny DeepSeek-V3 (shared experts, group-limited routing, MTP) on ep2 × dp2 equal one device
in float64 (1e-9); each rank's traced step equals the analysis per axis and op (the
all-to-all from the step's routing counts) and the unoverlapped layout's bytes; and the
order of issue: every async all-to-all posted before the experts it runs under and waited
after them, which the unoverlapped path (the planted mistake: a wait before compute) fails.
"""
from __future__ import annotations

import pytest

from minitron.analysis.calls import bytes_by_axis
from minitron.config import PRESETS, ConfigError, ParallelConfig, TrainConfig, validate

MOE, DSV3 = PRESETS["moe-tiny"], PRESETS["deepseek-v3-tiny"]
TOL = 1e-9
CASES = [
    (MOE, ParallelConfig(dp=2, ep=2, ep_overlap=True)),
    (DSV3, ParallelConfig(dp=2, ep=2, ep_overlap=True)),
    (MOE, ParallelConfig(dp=2, ep=2)),  # the unoverlapped twin: the same bytes
]


@pytest.mark.parametrize("model,layout,msg", [
    (MOE, ParallelConfig(ep_overlap=True), "--ep-overlap with --ep 1: nothing to overlap"),
    (MOE, ParallelConfig(ep=4, ep_overlap=True), "leaves 1 per rank"),
])
def test_refused_with_one_line(model, layout, msg):
    with pytest.raises(ConfigError, match=msg) as e:
        validate(model, layout)
    assert "\n" not in str(e.value)


def _train() -> TrainConfig:
    return TrainConfig(steps=2, global_batch=4, microbatches=1, dtype="float64", lr=1e-2, warmup=1, eval_every=0,
                       progress=False, sample_tokens=0)


def _issue_order(comm, dispatch) -> tuple[list, list]:
    """(forward, backward) events of one MoE call on ep2 through `dispatch`: 'a2a' an
    all-to-all posted (the counts' included), 'wait' a Pending waited, 'experts' an expert
    computation starting (forward: run_experts; backward: its first op's gradient)."""
    from unittest import mock

    import torch

    from minitron.comm import Comm, CommTrace, Pending
    from minitron.grid import ProcessGrid

    grid = ProcessGrid(dp=2, ep=2, rank=comm.grid.rank).build_groups()
    events: list = []

    class Log(CommTrace):
        def add(self, **rec):
            events.append("a2a")

    real_wait = Pending.wait

    def wait(self):
        events.append("wait")
        return real_wait(self)

    class Mark(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            events.append("experts")
            return g

    def run_experts(rows, counts):
        events.append("experts")
        return Mark.apply(rows * 2.0)

    g = torch.Generator().manual_seed(comm.grid.rank)
    tokens = torch.randn(16, 8, dtype=torch.float64, generator=g, requires_grad=True)
    experts = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(16)])
    gates = torch.rand(16, 2, dtype=torch.float64, generator=g)
    keep = torch.ones(16, 2, dtype=torch.bool)
    c = Comm(grid, Log())
    with mock.patch.object(Pending, "wait", wait):
        y = dispatch(tokens, experts, gates, keep, 4, c, run_experts)
        fwd = list(events)
        events.clear()
        y.sum().backward()
    return fwd, list(events)


def _job(comm, cases):
    """Every case on this launch's ranks (the oracle, step 0's bytes by axis and op, its
    routing counts), then the issue order of the overlapped and the unoverlapped dispatch."""
    from minitron.comm import Comm, CommTrace
    from minitron.data import load_corpus
    from minitron.grid import ProcessGrid
    from minitron.parallel.expert_overlap import overlapped_token_dispatch
    from minitron.parallel.experts import token_dispatch
    from minitron.tools.verify import versus_one_device
    from minitron.train import Trainer

    corpus, rank, out = load_corpus(""), comm.grid.rank, []
    for model, layout in cases:
        grid = ProcessGrid(dp=layout.dp, ep=layout.ep, rank=rank).build_groups()
        c, train = Comm(grid, CommTrace()), _train()
        tr = Trainer(model, layout, train, c, corpus)
        losses = [tr.step(0)]
        calls = [d[0] for m in tr.moe for d in m.dispatches]
        losses += [tr.step(i) for i in range(1, train.steps)]
        res = versus_one_device(c, tr, losses, model, train.replace(microbatches=layout.data_replicas))
        step0 = [r for r in c.trace.records if r["rank"] == rank and r["step"] == 0 and r["phase"] != "log"]
        out.append(dict(res=res, coord=vars(grid.coord()), traced=bytes_by_axis(step0), calls=calls,
                        a2a_calls=sum(r["op"] == "all_to_all" for r in step0)))
    return out, _issue_order(comm, overlapped_token_dispatch), _issue_order(comm, token_dispatch)


@pytest.fixture(scope="module")
def four():
    from minitron.tools.testing import run_on_ranks

    for model, layout in CASES:
        validate(model, layout, _train(), world=4)
    return run_on_ranks(_job, ParallelConfig(dp=4), CASES)


@pytest.mark.multirank
def test_overlapped_layouts_equal_one_device(four):
    """verify --dtype float64 (1e-9): moe-tiny and DeepSeek-V3 tiny on ep2 × dp2 --ep-overlap."""
    for i, (model, layout) in enumerate(CASES):
        res = four[0][0][i]["res"]
        print(f"{model.name} {layout.describe():<32} loss {res['max_loss_abs_diff']:.1e} "
              f"param {res['max_param_rel_diff']:.1e}")
        assert res["max_loss_abs_diff"] <= TOL and res["max_param_rel_diff"] <= TOL, (layout.describe(), res)


@pytest.mark.multirank
def test_traced_step_equals_the_analysis_and_the_unoverlapped_bytes(four):
    """Step 0 on every rank equals comm_bytes_per_step per axis and op (the all-to-all from
    the step's own counts), with 9 all-to-alls per MoE call against 5 unoverlapped; the
    overlapped moe-tiny moves exactly the unoverlapped twin's bytes."""
    from minitron.analysis.comm import comm_bytes_per_step
    from minitron.analysis.experts import all_to_all_calls, moe_blocks
    from minitron.tools.testing import routed_all_to_all_bytes

    for i, (model, layout) in enumerate(CASES):
        ranks = [four[r][0][i] for r in sorted(four)]
        for r in ranks:
            want = comm_bytes_per_step(model, layout, _train(), pp_rank=0)
            want["ep"]["all_to_all"] = routed_all_to_all_bytes(ranks, r, model, 8)
            assert r["traced"] == want, (layout.describe(), r["coord"], r["traced"], want)
            assert r["a2a_calls"] == all_to_all_calls(layout.ep_overlap) * len(moe_blocks(model))
    for r in sorted(four):
        assert four[r][0][0]["traced"] == four[r][0][2]["traced"]
        assert four[r][0][0]["calls"] == four[r][0][2]["calls"]


def _hides(events: list) -> bool:
    """Whether every 'experts' but the first runs while an all-to-all posted before it is
    still unwaited (posted 'a2a' count above the 'wait' count, the counts' all-to-all apart:
    it is synchronous, no Pending)."""
    posted = waited = seen = 0
    for e in events:
        if e == "a2a":
            posted += 1
        elif e == "wait":
            waited += 1
        elif e == "experts":
            seen += 1
            if seen > 1 and posted - waited < 1:
                return False
    return seen == 2


@pytest.mark.multirank
def test_each_all_to_all_is_posted_before_the_experts_it_runs_under(four):
    """Forward: counts, dispatch 1 and 2 posted, dispatch 1 waited, experts 1 (dispatch 2 in
    flight), combine 1 posted, dispatch 2 waited, experts 2 (combine 1 in flight), combine 2
    posted, both combines waited. Backward: the combines' gradients posted, experts 2 under
    combine 1's, experts 1 under dispatch 2's. The unoverlapped dispatch (every all-to-all
    waited before the experts: the planted mistake) fails the same check."""
    fwd_want = ["a2a", "a2a", "a2a", "wait", "experts", "a2a", "wait", "experts", "a2a", "wait", "wait"]
    bwd_want = ["a2a", "a2a", "wait", "experts", "a2a", "wait", "experts", "a2a", "wait", "wait"]
    for r in sorted(four):
        _, (fwd, bwd), (plain_fwd, plain_bwd) = four[r]
        assert fwd == fwd_want, fwd
        assert bwd == bwd_want, bwd
        assert _hides(fwd) and _hides(bwd)
        assert not _hides(plain_fwd) and not _hides(plain_bwd), (plain_fwd, plain_bwd)
