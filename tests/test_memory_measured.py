"""`minitron memory` against the bytes of a real run.

For the `tiny` and `small` presets (tiny also under each FP8 recipe), on one device and on one 8-rank launch of
dp2 x tp2 x pp2 (1F1B; replicated AdamW, ZeRO-1 and sequence parallelism in the same
launch), each rank runs one training step and measures
(:func:`minitron.tools.measure.measure_step_memory`)

* parameters: the bytes of its unique local parameters;
* gradients: the bytes of ``p.grad`` after the step;
* optimizer state: AdamW's ``exp_avg`` + ``exp_avg_sq`` (ZeRO-1: its shard tensors);
* data-parallel buffers: the distinct storages behind parameters, gradients and the
  data-parallel engine's flat buffers (``grad_buffer``, ``param_buffer``, ``shard_grad``,
  ZeRO-1's ``shard_param``) minus the parameters and the gradients;
* activations: the peak over the step of the bytes saved for the backward and still
  alive (saved-tensor hooks; parameters excluded; one count per storage), together with
  the pipeline stash of the microbatches in flight on the stage (their stage inputs).
  The stage output waiting for its send is a communication buffer, not counted here.
  A recomputed region (``--recompute``) holds its inputs (saved tensors: the hooks see
  them) and, during its backward, what its recomputation saves again, which
  ``minitron.recompute`` hands to the same hooks (one more single-device test, tiny and small under selective and full
  recomputation, and a long-sequence model where rebuilding the attention core is the
  peak).

and compares them with :func:`minitron.analysis.memory.memory_on_rank` (and
``memory_per_rank``, the maximum over stages) for the same (model, layout, train):
parameters, gradients, optimizer state and data-parallel buffers exactly, activations
within 10%.
"""
from __future__ import annotations

import dataclasses

import pytest

from minitron.analysis.memory import buffer_bytes_on_rank, memory_on_rank, memory_per_rank
from minitron.analysis.params import params_on_rank
from minitron.analysis.tensor_parallel import format_table
from minitron.config import PRESETS, ModelConfig, ParallelConfig, TrainConfig, validate
from minitron.tools.measure import measure_step_memory
from minitron.tools.testing import run_on_ranks

MODELS = ("tiny", "small")
# a parameter count no d = 2 divides on either stage: ZeRO-1 pads its flat buffers
ODD = PRESETS["tiny"].replace(hidden=34, heads=2, name="odd")
# s >> h with dropout: rebuilding the attention core (selective recomputation) is the peak
LONG = ModelConfig(layers=2, hidden=16, heads=4, seq_len=256, vocab=256, dropout=0.1, name="long")
CUSTOM = {"odd": ODD, "long": LONG}
ACT_TOL = 0.10
KW = dict(steps=1, warmup=1, eval_every=0, progress=False, sample_tokens=0)
ONE_DEVICE = (ParallelConfig(), TrainConfig(global_batch=8, microbatches=2, **KW))
PTDP = ParallelConfig(dp=2, tp=2, pp=2, schedule="1f1b")
ZERO1 = dataclasses.replace(PTDP, zero1=True)
SP = dataclasses.replace(PTDP, sp=True)  # the column-parallel linears keep their input's sequence shard
PTDP_CASES = [(n, lay) for n in MODELS for lay in (PTDP, ZERO1, SP)] + [("odd", ZERO1)]
PTDP_TRAIN = TrainConfig(global_batch=16, microbatches=4, **KW)  # microbatches of 2, 2 in flight on stage 0


# --------------------------------------------------------------------------------------
# measuring: minitron.tools.measure, under this file's short keys
# --------------------------------------------------------------------------------------
def measure_step(tr) -> dict:
    """Run one step of Trainer `tr` and measure this rank's bytes (module docstring)."""
    got = measure_step_memory(tr, 0)
    return {"params": got["params_bytes"], "grads": got["grads_bytes"], "optimizer": got["optimizer_bytes"],
            "dp_buffers": got["buffers_bytes"], "activations": got["activations_bytes"]}


def _model(name: str):
    return CUSTOM[name] if name in CUSTOM else PRESETS[name]


def predict(name: str, layout: ParallelConfig, train: TrainConfig, pp_rank: int) -> dict:
    m = _model(name)
    mem = memory_on_rank(m, layout, train, pp_rank)
    b = train.global_batch // (layout.dp * train.microbatches)
    e = 8 if train.dtype == "float64" else 4
    return {"params": mem["params_bytes"], "grads": mem["grads_bytes"], "optimizer": mem["optimizer_bytes"],
            "dp_buffers": buffer_bytes_on_rank(m, layout, b, params_on_rank(m, layout, pp_rank), e)["data_parallel"],
            "activations": mem["activations_bytes"]}


def _rows(case: str, results: dict, name: str, layout: ParallelConfig, train: TrainConfig) -> list[dict]:
    rows = []
    for rank, (pp_rank, got) in sorted(results.items()):
        want = {k: int(v) if v == int(v) else v for k, v in predict(name, layout, train, pp_rank).items()}
        rows.append({"case": case, "rank": rank, "stage": pp_rank,
                     **{f"{k}{s}": (got if s == "" else want)[k] for k in got for s in ("", "~")},
                     "act ratio": got["activations"] / want["activations"]})
    return rows


def _check(rows: list[dict]) -> list[str]:
    problems = []
    for r in rows:
        for k in ("params", "grads", "optimizer", "dp_buffers"):
            if r[k] != r[k + "~"]:
                problems.append(f"{r['case']} rank {r['rank']}: {k} measured {r[k]}, predicted {r[k + '~']}")
        if abs(r["act ratio"] - 1) > ACT_TOL:
            problems.append(f"{r['case']} rank {r['rank']}: activations measured {r['activations']}, "
                            f"predicted {r['activations~']:.0f} (ratio {r['act ratio']:.3f})")
    return problems


def _show(rows: list[dict]) -> None:
    print("\nmeasured (no mark) vs predicted (~) bytes per rank; dp_buffers: beyond params and grads")
    print(format_table(rows))


def _check_per_rank_max(rows, name, layout, train):
    """memory_per_rank is the maximum of memory_on_rank over stages: the largest measured."""
    top = memory_per_rank(_model(name), layout, train)
    for k, key in (("params", "params_bytes"), ("grads", "grads_bytes"), ("optimizer", "optimizer_bytes")):
        assert max(r[k] for r in rows) == top[key]
    peak = max(r["activations"] for r in rows)
    assert abs(peak / top["activations_bytes"] - 1) <= ACT_TOL


# --------------------------------------------------------------------------------------
# one device
# --------------------------------------------------------------------------------------
def test_memory_matches_a_single_device_run():
    from minitron.train import Trainer

    layout, train = ONE_DEVICE
    rows = []
    for name in MODELS:
        validate(PRESETS[name], layout, train)
        got = measure_step(Trainer(PRESETS[name], layout, train))
        rows += _rows(f"{name} one device", {0: (0, got)}, name, layout, train)
        _check_per_rank_max(rows[-1:], name, layout, train)
    _show(rows)
    assert not _check(rows), _check(rows)


def test_memory_matches_a_single_device_fp8_run():
    """Every FP8 recipe on one device: delayed scaling's amax histories are parameters
    without gradient or optimizer state; the saved operands are the working dtype's."""
    from minitron.config import FP8_RECIPES
    from minitron.train import Trainer

    _, train = ONE_DEVICE
    rows = []
    for recipe in FP8_RECIPES:
        layout = ParallelConfig(precision="fp8", fp8_recipe=recipe)
        validate(PRESETS["tiny"], layout, train)
        rows += _rows(f"tiny fp8 {recipe}", {0: (0, measure_step(Trainer(PRESETS["tiny"], layout, train)))}, "tiny",
                      layout, train)
    _show(rows)
    assert not _check(rows), _check(rows)
    delayed, tensorwise = (next(r for r in rows if r["case"].endswith(k)) for k in ("delayed", "tensorwise"))
    assert delayed["params"] > tensorwise["params"] and delayed["optimizer"] == tensorwise["optimizer"]


def test_memory_matches_a_single_device_run_with_recomputation():
    from minitron.train import Trainer

    _, train = ONE_DEVICE
    rows = []
    for name in (*MODELS, "long"):
        for rc in ("selective", "full"):
            layout = ParallelConfig(recompute=rc)
            validate(_model(name), layout, train)
            got = measure_step(Trainer(_model(name), layout, train))
            rows += _rows(f"{name} one device {rc}", {0: (0, got)}, name, layout, train)
    _show(rows)
    assert not _check(rows), _check(rows)


# --------------------------------------------------------------------------------------
# dp2 x tp2 x pp2, 1F1B, replicated and ZeRO-1
# --------------------------------------------------------------------------------------
def _ptdp_job(comm):
    from minitron.data import load_corpus
    from minitron.train import Trainer

    corpus = load_corpus("")
    out = {}
    for name, layout in PTDP_CASES:
        tr = Trainer(_model(name), layout, PTDP_TRAIN, comm, corpus)
        out[(name, layout.describe())] = (comm.index("pp"), measure_step(tr))
        del tr
    return out


@pytest.mark.multirank
def test_memory_matches_a_dp2_tp2_pp2_run():
    for name, layout in PTDP_CASES:
        validate(_model(name), layout, PTDP_TRAIN)
    results = run_on_ranks(_ptdp_job, PTDP)
    rows = []
    for name, layout in PTDP_CASES:
        per_rank = {rank: res[(name, layout.describe())] for rank, res in results.items()}
        case_rows = _rows(f"{name} {layout.describe()}", per_rank, name, layout, PTDP_TRAIN)
        _check_per_rank_max(case_rows, name, layout, PTDP_TRAIN)
        rows += case_rows
    _show(rows)
    assert not _check(rows), _check(rows)
