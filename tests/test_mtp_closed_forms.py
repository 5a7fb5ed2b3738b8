"""The context-parallel closed forms count the multi-token-prediction blocks.

DeepSeek-V3's MTP depths (``mtp.py``, §2.2 of arXiv 2412.19437) each run one transformer
block after the last stage's layers, and that block attends like any other: under --cp its
ring hops or all-to-alls travel too. ``cp_comm_items`` (ring, a2a, usp; the windowed ring)
counts the blocks of ``params.block_ids_on_rank``: the rank's layers and, where the last
stage is, the D depths' blocks.

In-process: the tiny DeepSeek-V3 with 1 and 2 depths, on cp2 ring, cp2 a2a and cp4 usp
(2 × 2), with recomputation (full recomputation does not replay a depth's block: it runs
outside the stage's ``run_block``), under pipelines (the loop's last rank, the V's rank 0) and a
sliding window, equals the dry run (``comm_bytes_per_step``) per axis and op; the old count
(the layers alone) is planted and caught. On real ranks (one launch of 4): each rank's
traced step 0 equals the dry run and the closed form on the context axes, and differs from
the planted count.
"""
from __future__ import annotations

from contextlib import nullcontext
from unittest import mock

import pytest

from minitron.analysis import context_parallel
from minitron.analysis.calls import bytes_by_axis
from minitron.analysis.comm import comm_bytes_per_step
from minitron.analysis.context_parallel import cp_comm_items
from minitron.analysis.params import rank_chunks
from minitron.config import PRESETS, ParallelConfig, TrainConfig, validate
from minitron.tools.testing import traced_step_bytes

DSV3 = PRESETS["deepseek-v3-tiny"]
CP_AXES = ("cp", "cp_a2a", "cp_ring")

RING, A2A = ParallelConfig(cp=2), ParallelConfig(cp=2, cp_mode="a2a")
USP = ParallelConfig(cp=4, cp_mode="usp", cp_a2a=2)


def _train(layout: ParallelConfig) -> TrainConfig:
    m = layout.pp  # a V needs a microbatch per stage
    return TrainConfig(steps=1, global_batch=2 * layout.data_replicas * m, microbatches=m, dtype="float64", lr=1e-2,
                       warmup=0, eval_every=0, progress=False, sample_tokens=0)


def _layers_only(model, layout, pp_rank):
    """The planted mistake (the old count): the rank's layers, not the MTP depths' blocks."""
    return [i for ids, _, _ in rank_chunks(model, layout, pp_rank) for i in ids]


def _closed(model, layout, pp_rank=0, planted=False) -> dict:
    """The closed form's bytes on the context axes, {axis: {op: bytes}} (float64)."""
    with mock.patch.object(context_parallel, "block_ids_on_rank", _layers_only) if planted else nullcontext():
        return bytes_by_axis(cp_comm_items(model, layout, _train(layout), pp_rank, act_bytes=8))


def _context_axes(per_axis: dict) -> dict:
    return {a: ops for a, ops in per_axis.items() if a in CP_AXES}


IN_PROCESS = [(d, lay) for d in (1, 2) for lay in (RING, A2A, USP)] + [(2, lay) for lay in (
    ParallelConfig(cp=2, recompute="selective"), ParallelConfig(cp=2, recompute="full"),
    ParallelConfig(cp=2, cp_mode="a2a", recompute="full"),
    ParallelConfig(cp=2, pp=2), ParallelConfig(cp=2, pp=2, vpp=2, schedule="zb-v"))]


@pytest.mark.parametrize("depths,layout", IN_PROCESS)
def test_closed_form_equals_the_dry_run_and_the_old_count_is_caught(depths, layout):
    """Per axis and op on every pipeline rank: the closed form equals the dry run, and the
    count without the MTP blocks differs where the rank holds the last stage (and only there)."""
    model = DSV3.replace(mtp_depths=depths)
    validate(model, layout, _train(layout))
    for r in range(layout.pp):
        read = _context_axes(comm_bytes_per_step(model, layout, _train(layout), pp_rank=r))
        assert _closed(model, layout, r) == read
        holds_mtp = any(last for _, _, last in rank_chunks(model, layout, r))
        assert (_closed(model, layout, r, planted=True) != read) == holds_mtp


@pytest.mark.parametrize("layout", [ParallelConfig(cp=4), ParallelConfig(cp=4, cp_mode="usp", cp_a2a=2)])
def test_windowed_ring_counts_the_mtp_blocks(layout):
    """A sliding window on alternate layers (the depths' blocks take theirs, ``window_of(L + k − 1)``)
    with grouped-query attention: context rank 0's ring (the dry run's) equals its closed form."""
    model = PRESETS["llama-tiny"].replace(window=6, window_layers="LG", mtp_depths=2)
    validate(model, layout, _train(layout))
    read = _context_axes(comm_bytes_per_step(model, layout, _train(layout), pp_rank=0))
    assert _closed(model, layout) == read != _closed(model, layout, planted=True)


# --------------------------------------------------------------------------------------
# on real ranks: each rank's traced step
# --------------------------------------------------------------------------------------
# (name, depths, layout): each fills the launch's 4 ranks
CASES = [(f"mtp {d}, {name}", d, lay) for d in (1, 2) for name, lay in (
    ("cp2 ring x dp2", ParallelConfig(cp=2, dp=2)),
    ("cp2 a2a x dp2", ParallelConfig(cp=2, dp=2, cp_mode="a2a")),
    ("cp4 usp 2x2", USP))]


def _cases_job(comm, cases):
    """Step 0's traced bytes by axis and op of every case on this launch's ranks (its own grid)."""
    from minitron.comm import Comm, CommTrace
    from minitron.data import load_corpus
    from minitron.grid import ProcessGrid
    from minitron.train import Trainer

    corpus, rank, out = load_corpus(""), comm.grid.rank, {}
    for name, depths, layout in cases:
        c = Comm(ProcessGrid.for_layout(layout, rank).build_groups(), CommTrace())
        Trainer(DSV3.replace(mtp_depths=depths), layout, _train(layout), c, corpus).step(0)
        out[name] = traced_step_bytes(c.trace.records, rank)
    return out


@pytest.fixture(scope="module")
def four():
    from minitron.tools.testing import run_on_ranks

    for _, depths, layout in CASES:
        validate(DSV3.replace(mtp_depths=depths), layout, _train(layout), world=4)
    return run_on_ranks(_cases_job, ParallelConfig(dp=4), CASES)


@pytest.mark.multirank
def test_traced_step_equals_the_closed_form_and_the_dry_run(four):
    """Every rank's traced step equals comm_bytes_per_step on every axis and op, and the closed
    form on the context axes; the old count (no MTP blocks) differs from it on every rank."""
    bad = []
    for name, depths, layout in CASES:
        model = DSV3.replace(mtp_depths=depths)
        want, closed = comm_bytes_per_step(model, layout, _train(layout), pp_rank=0), _closed(model, layout)
        old = _closed(model, layout, planted=True)
        for rank in sorted(four):
            traced = four[rank][name]
            if traced != want or _context_axes(traced) != closed or _context_axes(traced) == old:
                bad.append((name, rank, traced, want, closed, old))
    for b in bad[:4]:
        print(b)
    assert not bad, f"{len(bad)} rank-layouts differ from the analysis"
