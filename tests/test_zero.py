"""ZeRO's ladder (``--zero 0..3``): every rung equals one device in float64, a traced step
sends exactly the bytes ``analysis.zero`` predicts, the model states a rank measurably
holds match the analysis, and checkpoints move between rungs.

Each multi-rank test is one launch that checks several rungs (starting ranks is the cost).
"""
from __future__ import annotations

import pytest
import torch

from minitron.analysis.comm import comm_bytes_per_step, ring_allreduce_wire_bytes
from minitron.analysis.memory import memory_on_rank
from minitron.analysis.zero import plan_units, zero_calls, zero_state_bytes, zero_units, zero_wire_bytes
from minitron.config import PRESETS, ConfigError, ParallelConfig, TrainConfig, validate
from minitron.tools.testing import run_on_ranks
from minitron.tools.verify import compare, reference_run

TINY = PRESETS["tiny"]
TRAIN = TrainConfig(steps=3, global_batch=8, microbatches=2, dtype="float64", progress=False,
                    eval_every=0, sample_tokens=0)
STEPS = 3


def _traced(records, rank: int, step: int) -> dict:
    """{axis: {op: bytes}} of one rank's training calls in one step ('log' left out)."""
    got: dict = {}
    for r in records:
        if r["rank"] == rank and r["step"] == step and r["phase"] != "log":
            ops = got.setdefault(r["axis"], {})
            ops[r["op"]] = ops.get(r["op"], 0) + r["bytes"]
    return got


def _by_phase(records, rank: int, step: int, axis: str) -> list[dict]:
    """One rank's calls on `axis` in one step as zero_calls lists them."""
    out: dict = {}
    for r in records:
        if r["rank"] == rank and r["step"] == step and r["axis"] == axis:
            c = out.setdefault((r["op"], r["phase"]), {"op": r["op"], "phase": r["phase"], "calls": 0, "bytes": 0})
            c["calls"] += 1
            c["bytes"] += r["bytes"]
    return sorted(out.values(), key=lambda c: (c["op"], c["phase"]))


def _ladder_job(comm, model, layouts, train, ckpt_dir):
    """For each layout: train, keep rank results (losses, full weights on rank 0, this step's
    trace, measured memory); then a checkpoint written at stage 3 resumes at stage 2."""
    from minitron import checkpoint as ckpt
    from minitron.checkpoint import gather_full
    from minitron.tools.measure import measure_step_memory
    from minitron.train import Trainer

    out = []
    for lay in layouts:
        comm.trace.records.clear()
        tr = Trainer(model, lay, train, comm)
        losses = [tr.step(i) for i in range(STEPS)]
        records = list(comm.trace.records)
        full = gather_full(tr)
        mem = measure_step_memory(Trainer(model, lay, train, comm))
        out.append({"layout": lay, "losses": losses, "full": full, "records": records, "memory": mem,
                    "stage": comm.index("pp")})
    if ckpt_dir:  # save at step 2 under ZeRO-3, resume under ZeRO-2: the same third step
        three, two = (ParallelConfig(**{**vars(layouts[0]), "zero": z, "zero1": True}) for z in (3, 2))
        a = Trainer(model, three, train, comm)
        for i in range(2):
            a.step(i)
        ckpt.save(ckpt_dir, 2, a)
        b = Trainer(model, two, train, comm)
        start = ckpt.load_latest(ckpt_dir, b)
        out.append({"resumed_at": start, "continued": a.step(2), "resumed": b.step(2)})
    return out


def _check_against_one_device(results, train, model):
    """Rank 0's losses and parameters against the single-device run, float64: 1e-9."""
    ref_losses, ref = None, None
    for res in results:
        if "layout" not in res:
            continue
        lay = res["layout"]
        if ref is None:
            torch.manual_seed(train.seed)
            ref_losses, ref = reference_run(model, train.replace(microbatches=train.microbatches * lay.dp),
                                            None, STEPS)
        verdict = compare(res["losses"], res["full"], ref_losses, ref)
        assert verdict["max_loss_abs_diff"] <= 1e-9, (lay.describe(), verdict)
        assert verdict["max_param_rel_diff"] <= 1e-9, (lay.describe(), verdict)


def _check_trace(per_rank, train, model):
    """Every rank's traced step equals comm_bytes_per_step for its stage (all axes), and the
    data-parallel calls equal zero_calls phase by phase, on the first and a later step."""
    for res in per_rank:
        lay, records, stage, rank = res["layout"], res["records"], res["stage"], res["rank"]
        for step in (0, STEPS - 1):
            assert _traced(records, rank, step) == comm_bytes_per_step(model, lay, train, pp_rank=stage), \
                (lay.describe(), rank, step)
            want = sorted(({k: c[k] for k in ("op", "phase", "calls", "bytes")}
                           for c in zero_calls(model, lay, train, stage) if c["axis"] == "dp"),
                          key=lambda c: (c["op"], c["phase"]))
            assert _by_phase(records, rank, step, "dp") == want, (lay.describe(), rank, step)


def _check_memory(res, train, model):
    """Measured params + grads + optimizer bytes equal the analysis (exact; the issue asks 5 %)."""
    lay, mem, stage = res["layout"], res["memory"], res["stage"]
    want = memory_on_rank(model, lay, train, stage)
    for k in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert mem[k] == want[k], (lay.describe(), k, mem[k], want[k])


def _ladder(layouts, world_layout, ckpt_dir=None, model=TINY):
    runs = run_on_ranks(_ladder_job, world_layout, model, layouts, TRAIN, ckpt_dir, trace=True)
    per_rank = [{**res, "rank": rank} for rank, results in runs.items() for res in results if "layout" in res]
    _check_against_one_device(runs[0], TRAIN, model)
    _check_trace([r for r in per_rank if r["layout"].zero >= 2], TRAIN, model)
    for r in per_rank:
        _check_memory(r, TRAIN, model)
    return runs


@pytest.mark.multirank
def test_zero_ladder_at_d4_equals_one_device_traces_and_memory(tmp_path):
    """d = 4, rungs 0-3: each equals one device (float64, 1e-9); ZeRO-2/3 steps trace exactly
    the predicted calls; measured model states equal the analysis and shrink down the ladder
    as ZeRO says; a ZeRO-3 checkpoint resumes under ZeRO-2 with the same next loss."""
    layouts = [ParallelConfig(dp=4, zero=z, device="cpu") for z in (0, 1, 2, 3)]
    runs = _ladder(layouts, layouts[0], str(tmp_path / "ckpt"))
    mem = [res["memory"] for res in runs[0] if "layout" in res]
    states = [m["params_bytes"] + m["grads_bytes"] + m["optimizer_bytes"] for m in mem]
    assert states[0] > states[1] > states[2] > states[3]
    assert mem[3]["params_bytes"] * 4 >= mem[0]["params_bytes"]  # a quarter, up to padding
    resumed = runs[0][-1]
    assert resumed["resumed_at"] == 2
    assert abs(resumed["continued"] - resumed["resumed"]) <= 1e-12


@pytest.mark.multirank
def test_zero_composes_with_tensor_parallelism():
    """dp2 · tp2 with ZeRO-2 and ZeRO-3: one device's losses and weights; exact traces."""
    layouts = [ParallelConfig(dp=2, tp=2, zero=z, device="cpu") for z in (2, 3)]
    _ladder(layouts, layouts[0])


@pytest.mark.multirank
def test_zero_composes_with_pipeline_parallelism():
    """dp2 · pp2 with ZeRO-2 and ZeRO-3, both stages, a 4-layer GPT: 1F1B (two microbatches
    in flight) and interleaved 1F1B (two chunks per rank, one of them without embeddings or
    head: a block's prefetch stays within its chunk)."""
    layouts = [ParallelConfig(dp=2, pp=2, zero=z, device="cpu", **kw)
               for kw in ({}, {"vpp": 2, "schedule": "interleaved"}) for z in (2, 3)]
    _ladder(layouts, layouts[0], model=TINY.replace(layers=4))


# --- pure: the analysis and the refusals ----------------------------------------------------------
def test_plan_units_pads_each_unit_to_a_multiple_of_d():
    offsets, units, total = plan_units([[3, 4], [5], [2]], 4)
    assert offsets == [0, 3, 8, 16]
    assert [(u.start, u.end, u.tensors) for u in units] == [(0, 8, [0, 1]), (8, 16, [2]), (16, 20, [3])]
    assert total == 20


def test_zero_units_cover_the_rank_parameters():
    from minitron.analysis.params import params_on_rank

    for lay in (ParallelConfig(dp=2), ParallelConfig(dp=2, tp=2), ParallelConfig(dp=2, pp=2),
                ParallelConfig(dp=2, pp=2, vpp=2, schedule="interleaved")):
        for r in range(lay.pp):
            units = zero_units(PRESETS["small"], lay, r)
            assert sum(u["numel"] for u in units) == params_on_rank(PRESETS["small"], lay, r)


def test_zero_state_bytes_follow_the_paper_per_rung():
    """ZeRO's 2Ψ+2Ψ+12Ψ/d ladder in minitron's fp32 states (4 + 4 + 8 bytes): up to
    padding, Ψ(4+4+8/d), Ψ(4+12/d), 16Ψ/d."""
    m, t, d = PRESETS["small"], TrainConfig(global_batch=8), 4
    from minitron.analysis.params import params_on_rank

    n = params_on_rank(m, ParallelConfig(dp=d), 0)
    want = {0: 16 * n, 1: (8 + 8 / d) * n, 2: (4 + 12 / d) * n, 3: 16 * n / d}
    for z, w in want.items():
        got = sum(zero_state_bytes(m, ParallelConfig(dp=d, zero=z), t).values())
        assert abs(got - w) / w < 1e-3, (z, got, w)


def test_zero3_traffic_is_one_and_a_half_all_reduces():
    n, d = 10_000, 8
    assert zero_wire_bytes(n, d, 3) == pytest.approx(1.5 * ring_allreduce_wire_bytes(4 * n, d))
    assert zero_wire_bytes(n, d, 2) == ring_allreduce_wire_bytes(4 * n, d)


def test_zero_flags_and_refusals():
    assert ParallelConfig(dp=2, zero1=True).zero == 1
    assert ParallelConfig(dp=2, zero=3).zero1  # the optimizer state is sharded on every rung
    assert ParallelConfig(dp=2, zero=2).describe().endswith(".zero2")
    bad = [(ParallelConfig(dp=2, zero=4), "--zero 4"),
           (ParallelConfig(zero=2), "--dp 2"),
           (ParallelConfig(dp=2, tp=2, sp=True, zero=2), "--sp"),
           (ParallelConfig(dp=2, zero=3, compile=True), "--compile"),
           (ParallelConfig(dp=2, zero=3, recompute="full"), "--recompute full"),
           (ParallelConfig(dp=2, pp=2, zero=3, schedule="zb-h1"), "zb-h1"),
           (ParallelConfig(dp=2, zero=2, dp_impl="naive"), "--dp-impl naive")]
    for lay, words in bad:
        with pytest.raises(ConfigError, match=words.replace("-", r"\-")):
            validate(TINY, lay)
    with pytest.raises(ConfigError, match="tied"):
        validate(TINY.replace(tied_embeddings=True), ParallelConfig(dp=2, pp=2, zero=2))
