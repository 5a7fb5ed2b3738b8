"""Multi-token prediction (DeepSeek-V3 §2.2) under context parallelism and the V schedules.

Under --cp the tokens ahead of each position are taken from whole rows before they are
cut into a rank's chunks (``mtp.targets_on_rank``); in the V of zb-v and dualpipe-v the
last stage shares pipeline rank 0 with the first and reads its ``wte`` (no copy, nothing on
the 'embed' axis). On real ranks (one launch of 2) the tiny DeepSeek-V3 (MLA, group-limited
MoE, MTP) under cp2 ring, cp2 a2a, pp2 dualpipe-v and pp2 zb-v equals one device in
float64 at 1e-9, each rank's traced step equals the analysis per axis and operation and
its parameters the analysis' count; two planted mistakes are caught: the tokens ahead
shifted inside the local chunk, and the V's last stage with its own copy of the embedding.
In process: the data-parallel buckets of a parameter two chunks share wait for both; ZeRO-2/3
still refused under a pipeline (in a V it would shard the embedding both ends share).
"""
from __future__ import annotations

from contextlib import nullcontext
from unittest import mock

import pytest
import torch

from minitron.config import PRESETS, ConfigError, ParallelConfig, TrainConfig, validate
from minitron.tools.testing import assert_oracle_verdicts, traced_step_bytes

TINY = PRESETS["deepseek-v3-tiny"].replace(mtp_depths=2)  # two depths: t_{i+2} and t_{i+3} ahead
TOL = 1e-9


def _shift_in_chunk(targets, depths, comm):
    """The planted mistake: the tokens ahead read inside this rank's chunks (a chunk's last
    positions read its own first tokens, not the next chunk's)."""
    from minitron.mtp import tokens_ahead
    from minitron.parallel.context_parallel import local_tokens

    return tokens_ahead(local_tokens(targets, comm), depths)


def _own_copy(*args, embedding=None, **kwargs):
    """The planted mistake: the V's last stage keeps its own copy of the embedding (summed
    over an 'embed' axis of one rank: nothing)."""
    from minitron.model import GPT

    return GPT(*args, **kwargs)


# (name, layout, plant): each fills the launch's 2 ranks
CASES = [
    ("cp2 ring", ParallelConfig(cp=2), None),
    ("cp2 a2a", ParallelConfig(cp=2, cp_mode="a2a"), None),
    ("pp2 dualpipe-v", ParallelConfig(pp=2, vpp=2, schedule="dualpipe-v"), None),
    ("pp2 zb-v", ParallelConfig(pp=2, vpp=2, schedule="zb-v"), None),
    ("planted: tokens ahead shifted in the chunk", ParallelConfig(cp=2), ("minitron.train.targets_on_rank",
                                                                         _shift_in_chunk)),
    ("planted: the V's own copy of wte", ParallelConfig(pp=2, vpp=2, schedule="dualpipe-v"),
     ("minitron.train.GPT", _own_copy)),
]


def _train(layout: ParallelConfig) -> TrainConfig:
    m = 4 if layout.pp > 1 else 1
    return TrainConfig(steps=2, global_batch=2 * layout.data_replicas * m, microbatches=m, dtype="float64",
                       lr=1e-2, warmup=1, eval_every=0, progress=False, sample_tokens=0)


def _cases_job(comm, cases):
    """Every case on this launch's ranks (its own grid): the oracle's verdict (rank 0),
    step 0's traced bytes by axis and op (the 'log' phase's routing counts left out), the
    rank's pipeline coordinate and its parameter elements."""
    from minitron.comm import Comm, CommTrace
    from minitron.data import load_corpus
    from minitron.grid import ProcessGrid
    from minitron.tools.verify import versus_one_device
    from minitron.train import Trainer

    corpus, rank, out = load_corpus(""), comm.grid.rank, {}
    for name, layout, plant in cases:
        grid = ProcessGrid.for_layout(layout, rank).build_groups()
        c, train = Comm(grid, CommTrace()), _train(layout)
        with mock.patch(*plant) if plant else nullcontext():
            tr = Trainer(TINY, layout, train, c, corpus)
            losses = [tr.step(i) for i in range(train.steps)]
        res = versus_one_device(c, tr, losses, TINY, train.replace(microbatches=train.microbatches
                                                                   * layout.data_replicas))
        out[name] = dict(res=res, traced=traced_step_bytes(c.trace.records, rank), pp=grid.coord().pp,
                         params=sum(p.numel() for p in tr.params))
    return out


@pytest.fixture(scope="module")
def two():
    from minitron.tools.testing import run_on_ranks

    for _, layout, _ in CASES:
        validate(TINY, layout, _train(layout), world=2)
    return run_on_ranks(_cases_job, ParallelConfig(dp=2), CASES)


@pytest.mark.multirank
def test_mtp_under_cp_and_v_equals_one_device_and_the_plants_are_caught(two):
    """verify --dtype float64 (1e-9), loss and parameters: cp2 ring and a2a, pp2 dualpipe-v
    and zb-v (MTP on the last stage, rank 0); each planted mistake is caught."""
    assert_oracle_verdicts(two[0], CASES, TOL)


@pytest.mark.multirank
def test_mtp_under_cp_and_v_traced_step_and_params_equal_the_analysis(two):
    """Each rank's step 0 equals comm_bytes_per_step per axis and operation (in a V no
    'embed' bytes: rank 0 sums the embedding's two uses locally), and its parameter
    elements params_on_rank (in a V one wte on rank 0, no copy)."""
    from minitron.analysis.comm import comm_bytes_per_step
    from minitron.analysis.params import params_on_rank

    bad = []
    for name, layout, plant in CASES:
        if plant:
            continue
        for rank in sorted(two):
            r = two[rank][name]
            want = comm_bytes_per_step(TINY, layout, _train(layout), pp_rank=r["pp"])
            if r["traced"] != want or r["params"] != params_on_rank(TINY, layout, r["pp"]):
                bad.append((name, rank, r["traced"], want, r["params"], params_on_rank(TINY, layout, r["pp"])))
    for b in bad[:4]:
        print(b)
    assert not bad, f"{len(bad)} rank-layouts differ from the analysis"


# --------------------------------------------------------------------------------------
# in process: a parameter two chunks share (the V's wte) is reduced after both gradients
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("listed_per_chunk", [True, False])
def test_bucket_of_a_shared_parameter_waits_for_both_chunks(listed_per_chunk):
    """Overlapped buckets on a dry dp2 Comm, in the V's order: the last stage's backward
    (the shared weight, alone in its bucket), then the first stage's (a block, then the
    embedding). The shared bucket is all-reduced only once the embedding's gradient is in;
    listed once (the planted mistake: the uses not counted) it goes before, right after
    the block's bucket."""
    from minitron.comm import Comm, CommTrace
    from minitron.context import Context, make_param
    from minitron.grid import ProcessGrid
    from minitron.parallel.data import BucketedDataParallel

    comm = Comm(ProcessGrid.for_layout(ParallelConfig(dp=2)), CommTrace(), dry=True)
    ctx = Context(comm, ParallelConfig(dp=2), torch.float64)
    shared, own = make_param("wte", (64, 4), (), ctx), make_param("blocks.0.w", (4,), (), ctx)
    params = [shared, own, shared] if listed_per_chunk else [shared, own]  # chunk 0's, then chunk 1's
    dp = BucketedDataParallel(params, comm, bucket_mb=4 * 8 / 2 ** 20)  # a bucket per parameter
    dp.zero_grad()
    with dp.microbatch(last=True):
        (shared.sum() * 2).backward()  # the last stage
        own.sum().backward()  # the first stage: its block,
        before = [r["bytes"] for r in comm.trace.records if r["op"] == "all_reduce"]
        shared.sum().backward()  # then its embedding
    assert 4 * 8 in before and (64 * 4 * 8 in before) != listed_per_chunk, before
    dp.finish()
    # both uses pre-scaled by 1/dp; the plant scaled the last stage's only, before the embedding's came
    assert torch.equal(shared.grad, torch.full_like(shared, 3.0 / 2)) == listed_per_chunk


@pytest.mark.parametrize("layout,msg", [
    (ParallelConfig(dp=2, pp=2, vpp=2, schedule="zb-v", zero=2), "cannot shard the embedding that the V's first and"),
])
def test_refused_with_one_line(layout, msg):
    with pytest.raises(ConfigError, match=msg) as e:
        validate(TINY, layout)
    assert "\n" not in str(e.value)
