"""USP (``--cp-mode usp --cp-a2a U``, Fang & Zhao 2024, arXiv 2405.07719): Ulysses'
all-to-all over the U ranks of a row of the context ranks, ring attention over the R = N/U
of a column (parallel/context_parallel.py, the grid's 'cp_a2a' and 'cp_ring').

In-process: the refusals, one line each; the grid's rows and columns; a row's chunks are
the ring's load-balanced pair; the closed form (usp_comm_items) equals the analysis read
off the model; the planner's search and pricing of USP. On real ranks (one launch of 8):
llama-tiny (grouped-query attention; under tp2 one kv head per tensor rank, replicated over
the row) on cp4 = 2 × 2 with dp2 and with tp2 (+sp, selective recomputation), and the tiny
DeepSeek-V3 without MTP (MLA's decompressed heads, keys wider than values; its MoE
blocks) on cp4 × dp2, against one device in float64 at 1e-9, each rank's traced step
equal to the analysis per axis and op; a sliding window on alternate layers on cp8 = 2 × 4
(the ring passes only the chunks in reach: its bytes per context rank); packed documents
(--pack) on cp4 = 2 × 2 with dp2 and with tp2, the ring over the columns masked by the
documents of its chunks and passing only the chunks they reach (each rank's 'cp_ring' bytes
the analysis of its step's documents, fewer than the whole ring's somewhere); and two
planted mistakes caught (the ring over the all-to-all's sub-axis; the gathered chunks left
in the order they arrive).
"""
from __future__ import annotations

from contextlib import nullcontext
from unittest import mock

import pytest

from minitron.analysis.calls import bytes_by_axis
from minitron.analysis.context_parallel import cp_comm_items, usp_comm_items
from minitron.config import PRESETS, ConfigError, ParallelConfig, TrainConfig, validate
from minitron.tools.testing import assert_oracle_verdicts, step_document_lengths
from test_packing import CORPUS as DOCUMENTS  # short documents, each ended by the separator

LLAMA, DSV3 = PRESETS["llama-tiny"], PRESETS["deepseek-v3-tiny"].replace(mtp_depths=0)
TOL = 1e-9


def usp(**kw) -> ParallelConfig:
    return ParallelConfig(**{"cp": 4, "cp_mode": "usp", "cp_a2a": 2, **kw})


@pytest.mark.parametrize("model,layout,msg", [
    (LLAMA, usp(cp_a2a=3), "needs --cp-a2a U with 1 < U < --cp 4 and U dividing it"),
    (LLAMA, usp(cp_a2a=4), "U = cp is --cp-mode a2a"),
    (LLAMA, ParallelConfig(cp=4, cp_a2a=2), "--cp-a2a 2 sizes USP's all-to-all: add --cp-mode usp"),
    (LLAMA, usp(cp=1), "--cp-mode usp splits the context ranks"),
    (LLAMA, usp(cp=8, tp=2, cp_a2a=4), "usp splits each tensor rank's 2 heads over --cp-a2a 4"),
    (LLAMA.replace(hidden=48, heads=6, kv_heads=3), usp(),
     "usp cannot split or replicate 3 key/value heads per tensor rank over --cp-a2a 2"),
])
def test_refused_with_one_line(model, layout, msg):
    with pytest.raises(ConfigError, match=msg) as e:
        validate(model, layout)
    assert "\n" not in str(e.value)


def test_rows_and_columns_of_the_context_ranks():
    """cp rank u + U·j: a row ('cp_a2a') is U neighbouring cp ranks, a column ('cp_ring')
    every U-th; under tp2 each holds one tensor rank's peers."""
    from minitron.grid import ProcessGrid

    g = ProcessGrid(tp=2, cp=8, cp_a2a=2)
    assert g.axis_ranks("cp_a2a", 0) == [0, 2] and g.axis_ranks("cp_ring", 0) == [0, 4, 8, 12]
    assert g.axis_ranks("cp_a2a", 13) == [13, 15] and g.axis_ranks("cp_ring", 13) == [1, 5, 9, 13]
    for axis, n in (("cp_a2a", 8), ("cp_ring", 4)):
        groups = g.all_groups(axis)
        assert len(groups) == n and sorted(r for grp in groups for r in grp) == list(range(16))


@pytest.mark.parametrize("n,u", [(4, 2), (8, 2), (8, 4), (6, 3)])
def test_a_row_gathers_the_rings_load_balanced_pair(n, u):
    """The chunks (of 2N) a row's all-to-all gathers, sorted, are the ring's chunks j and
    2R−1−j of 2R: the ring runs on them unchanged."""
    from minitron.comm import Comm
    from minitron.grid import ProcessGrid
    from minitron.parallel.context_parallel import _gathered_chunks, chunk_ids

    r_ring = n // u
    for rank in range(n):
        comm = Comm(ProcessGrid(cp=n, cp_a2a=u, rank=rank))
        j = comm.index("cp_ring")
        want = [x for a in chunk_ids(r_ring, j) for x in range(a * u, (a + 1) * u)]
        assert sorted(_gathered_chunks(comm, "cp_a2a")) == want


@pytest.mark.parametrize("layout", [usp(cp=8), usp(cp=8, cp_a2a=4)])
def test_closed_form_equals_the_model_read_off(layout):
    """usp_comm_items (the all-to-all over U, the ring over R) equals what the dry run reads
    off the model's forward and backward, per axis and op, on the grids the ranks below do
    not run (2 × 4 and 4 × 2; 2 × 2 is checked against a trace there)."""
    model = PRESETS["tiny"]
    from minitron.analysis.comm import comm_bytes_per_step

    train = TrainConfig(global_batch=4, microbatches=2, dtype="float64")
    closed = bytes_by_axis(cp_comm_items(model, layout, train, act_bytes=8))
    read = comm_bytes_per_step(model, layout, train, pp_rank=0)
    assert set(closed) == {"cp_a2a", "cp_ring"} and all(read[a] == closed[a] for a in closed)


# --------------------------------------------------------------------------------------
# on real ranks: the oracle and the trace against the analysis
# --------------------------------------------------------------------------------------
def _gathered_order(chunks, c, device):
    """Planted: the gathered tokens taken as they arrive (rank by rank, each rank's two
    chunks), not put in the order of the sequence."""
    import torch

    return torch.arange(len(chunks) * c, device=device)


def _plant(planted: str | None):
    from minitron.parallel import context_parallel

    if planted == "ring on cp_a2a":
        return mock.patch.object(context_parallel, "RING_AXIS", context_parallel.A2A_AXIS)
    if planted == "arrival order":
        return mock.patch.object(context_parallel, "_natural_order", _gathered_order)
    return nullcontext()


# (name, model, layout, --pack, planted): each fills the launch's 8 ranks
CASES = [
    ("cp4 usp 2x2 x dp2", LLAMA, usp(dp=2), False, None),
    ("cp4 usp 2x2 x tp2 sp, selective", LLAMA, usp(tp=2, sp=True, recompute="selective"), False, None),
    ("DeepSeek-V3 (MLA) cp4 usp 2x2 x dp2", DSV3, usp(dp=2), False, None),
    ("window 6 on G/L layers, cp8 usp 2x4", LLAMA.replace(window=6, window_layers="LG"), usp(cp=8), False, None),
    ("packed, cp4 usp 2x2 x dp2", LLAMA, usp(dp=2), True, None),
    ("packed, cp4 usp 2x2 x tp2", LLAMA, usp(tp=2), True, None),
    ("planted: the ring over cp_a2a", LLAMA, usp(dp=2), False, "ring on cp_a2a"),
    ("planted: chunks in arrival order", LLAMA, usp(dp=2), False, "arrival order"),
]


def _train(layout: ParallelConfig, pack: bool = False) -> TrainConfig:
    return TrainConfig(steps=2, global_batch=2 * layout.data_replicas, microbatches=1, dtype="float64", lr=1e-2,
                       warmup=1, eval_every=0, progress=False, sample_tokens=0, pack=pack)


def _cases_job(comm, cases, documents):
    """Every case on this launch's ranks (its own grid): the oracle's verdict (rank 0) and
    step 0's traced bytes by axis and op; a --pack case reads `documents`."""
    from minitron.data import load_corpus
    from minitron.tools.testing import trained_versus_one_device

    corpus, out = load_corpus(""), {}
    for name, model, layout, pack, planted in cases:
        run = trained_versus_one_device(comm, model, layout, _train(layout, pack), documents if pack else corpus,
                                        _plant(planted))
        out[name] = run
    return out


@pytest.fixture(scope="module")
def eight():
    from minitron.tools.testing import run_on_ranks

    for _, model, layout, pack, _ in CASES:
        validate(model, layout, _train(layout, pack), world=8)
    return run_on_ranks(_cases_job, ParallelConfig(dp=8), CASES, DOCUMENTS)


@pytest.mark.multirank
def test_usp_equals_one_device_and_the_plants_are_caught(eight):
    """verify --dtype float64 (1e-9), loss and parameters, on cp4 = 2 × 2 with dp2 and with
    tp2 (+sp, selective recomputation), MLA with dp2, a window on cp8 = 2 × 4, packed documents
    on cp4 = 2 × 2 with dp2 and with tp2; each planted mistake exceeds it."""
    assert_oracle_verdicts(eight[0], CASES, TOL)


@pytest.mark.multirank
def test_usp_traced_step_equals_the_analysis(eight):
    """Each rank's step 0 equals comm_bytes_per_step per axis and op (context rank 0's dry
    run: under a window or packed documents the ring's ranks differ, so 'cp_ring' there is
    each rank's own), and its 'cp_a2a' and 'cp_ring' axes the closed form (usp_comm_items)
    of its context rank (and, packed, of its step's documents: fewer bytes than the whole
    ring's on some rank)."""
    from minitron.analysis.comm import comm_bytes_per_step
    from minitron.grid import ProcessGrid

    bad, fewer = [], False
    for name, model, layout, pack, planted in CASES:
        if planted:
            continue
        train = _train(layout, pack)
        want = comm_bytes_per_step(model, layout, train, pp_rank=0)
        for rank in sorted(eight):
            cp_rank = ProcessGrid.for_layout(layout, rank).coord().cp
            replica = ProcessGrid.for_layout(layout, rank).data_index()
            documents = step_document_lengths(DOCUMENTS, model, layout, train, replica) if pack else None
            closed = bytes_by_axis(usp_comm_items(model, layout, train, act_bytes=8, cp_rank=cp_rank,
                                                  documents=documents))
            traced = eight[rank][name]["traced"]
            same = all(traced.get(a) == want[a] for a in want if a != "cp_ring" or not (model.window or pack))
            if set(traced) != set(want) or not same or any(traced[a] != closed[a] for a in ("cp_a2a", "cp_ring")):
                bad.append((name, rank, traced, want, closed))
            if pack:
                whole = bytes_by_axis(cp_comm_items(model, layout, train, act_bytes=8, cp_rank=cp_rank))["cp_ring"]
                fewer |= traced["cp_ring"]["send"] < whole["send"]
    for b in bad[:4]:
        print(b)
    assert not bad, f"{len(bad)} rank-layouts differ from the analysis"
    assert fewer  # the documents kept some chunk from going all the way round


# --------------------------------------------------------------------------------------
# the planner prices USP
# --------------------------------------------------------------------------------------
def test_planner_searches_usp_once_per_grid_that_splits_the_heads():
    """cp 8 under t = 8 (llama3-8b: 32 heads, 8 kv heads, so 4 and 1 per tensor rank): USP
    for U = 2 and 4 (U = 8 is Ulysses, which cannot split 4 heads over 8); `cp_a2a` fixes U."""
    from minitron.analysis.planner import valid_layouts

    model = PRESETS["llama3-8b"].replace(seq_len=65536)
    lays = valid_layouts(model, 64, 16, "h100-dgx", tp=8, pp=1, cp=8, cp_modes=("usp", "a2a"))
    assert {(e["cp_mode"], e.get("cp_a2a")) for e in lays} == {("usp", 2), ("usp", 4)}
    lays = valid_layouts(model, 64, 16, "h100-dgx", tp=8, pp=1, cp=8, cp_modes=("usp",), cp_a2a=2)
    assert {e["cp_a2a"] for e in lays} == {2}


def test_usp_exposes_the_all_to_all_of_its_rows_only():
    """llama3-8b at 64k tokens on cp 8: the ring hides its exchange under attention, Ulysses
    exposes its all-to-all over 8 ranks, USP the all-to-all over its U (fewer bytes per rank
    for a smaller U) with the ring over the rest hidden: ring < usp 2x4 < usp 4x2 < a2a."""
    from minitron.analysis.cluster import PlannedLayout, predict

    model = PRESETS["llama3-8b"].replace(seq_len=65536)

    def exposed(kind, u=1):
        lay = PlannedLayout(cp=8, dp=1, cp_mode=kind, cp_a2a=u)
        return predict(model, lay, 8, "h100-dgx", software="minitron").breakdown["cp_comm"]

    assert exposed("ring") < exposed("usp", 2) < exposed("usp", 4) < exposed("a2a")


@pytest.mark.parametrize("kw,msg", [
    (dict(cp=8, cp_mode="usp", cp_a2a=3), "cp kind usp needs --cp-a2a U with 1 < U < --cp 8"),
    (dict(cp=8, cp_mode="usp", cp_a2a=1), "cp kind usp needs --cp-a2a U"),
    (dict(cp=16, tp=8, cp_mode="usp", cp_a2a=8), "usp splits each tensor rank's 4 heads over --cp-a2a 8"),
])
def test_planner_refuses_what_train_refuses(kw, msg):
    from minitron.analysis.cluster import PlannedLayout, predict

    with pytest.raises(ValueError, match=msg) as e:
        predict(PRESETS["llama3-8b"].replace(seq_len=65536), PlannedLayout(**kw), 8, "h100-dgx", software="minitron")
    assert "\n" not in str(e.value)
