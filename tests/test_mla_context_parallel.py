"""Multi-head latent attention under context parallelism: the ring of decompressed heads
priced against the ring of latents it does not run (DeepSeek-V3 and the tiny model),
refusals in one line; and on real ranks (one launch of 4) the tiny DeepSeek-V3 without
MTP under the ring and the all-to-all, with data and tensor (+ sequence) parallelism,
against one device in float64 at 1e-9, each rank's traced step equal to the analysis per
axis and operation, and a planted mistake (rotary positions local, not global) caught.
"""
from __future__ import annotations

from fractions import Fraction
from unittest import mock

import pytest

from minitron.analysis.calls import bytes_by_axis
from minitron.analysis.context_parallel import cp_comm_items, cp_message_elements
from minitron.config import PRESETS, ConfigError, ParallelConfig, TrainConfig, validate

TINY = PRESETS["deepseek-v3-tiny"].replace(mtp_depths=0)
TOL = 1e-9


# --------------------------------------------------------------------------------------
# the ring's message: decompressed heads (run) against the latent (priced)
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,tp", [("deepseek-v3", 1), ("deepseek-v3", 8), ("deepseek-v3-tiny", 1),
                                     ("deepseek-v3-tiny", 2)])
def test_latent_ring_is_the_closed_form_ratio_smaller(name, tp):
    """A step's ring bytes carrying K, V of the rank's heads over those carrying c_KV, k_R:
    heads/t·(qk_nope + qk_rope + v)/(kv_lora + qk_rope) exactly (71.1 for DeepSeek-V3 at
    t = 1), with the same calls; the heads' message is b·(s/N)·heads/t·(dk + dv)."""
    model = PRESETS[name].replace(mtp_depths=0)
    layout = ParallelConfig(cp=2, tp=tp)
    train = TrainConfig(global_batch=2, microbatches=1)
    heads, latent = (bytes_by_axis(cp_comm_items(model, layout, train, carries=c))["cp"] for c in ("heads", "latent"))
    dk, dv = model.qk_nope_head_dim + model.qk_rope_head_dim, model.v_head_dim
    ratio = Fraction(model.heads // tp * (dk + dv), model.kv_lora_rank + model.qk_rope_head_dim)
    for op in ("send", "recv"):
        assert Fraction(heads[op], latent[op]) == ratio
    calls = [[it["calls"] for it in cp_comm_items(model, layout, train, carries=c)] for c in ("heads", "latent")]
    assert calls[0] == calls[1]
    assert cp_message_elements(model, 2, tp, 2) == 2 * model.seq_len // 2 * model.heads // tp * (dk + dv)
    if name == "deepseek-v3" and tp == 1:
        assert round(float(ratio), 1) == 71.1


@pytest.mark.parametrize("name,tp", [("deepseek-v3", 8), ("deepseek-v3-tiny", 2), ("llama3-8b", 4), ("llama3-8b", 16)])
def test_planner_prices_the_message_the_ring_passes(name, tp):
    """The throughput model's context-parallel exchange carries, per token, the K and V
    widths of the engine's message (MLA: heads/t·(qk_nope + qk_rope + v), not 2·hidden/t)."""
    from minitron.analysis.cluster import cp_widths

    model = PRESETS[name]
    tokens = model.seq_len // 2
    assert cp_widths(model, tp)[1] * tokens == cp_message_elements(model, 1, tp, 2)


def test_latent_ring_needs_a_latent():
    with pytest.raises(ValueError, match="needs --attention mla"):
        cp_message_elements(PRESETS["llama-tiny"], 1, 1, 2, carries="latent")


@pytest.mark.parametrize("change,layout,msg", [
    (dict(aux_loss=0.01), ParallelConfig(cp=2), "balancing loss or a capacity"),
    (dict(capacity_factor=1.0), ParallelConfig(cp=2), "balancing loss or a capacity"),
    (dict(), ParallelConfig(cp=2, ep=2), "--ep is not written to compose with --cp"),
    (dict(), ParallelConfig(cp=4, tp=2, cp_mode="a2a"), "a2a splits each tensor rank's 2 heads over --cp 4"),
])
def test_refused_with_one_line(change, layout, msg):
    with pytest.raises(ConfigError, match=msg) as e:
        validate(TINY.replace(**change), layout)
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------------------
# on real ranks: the oracle and the trace against the analysis
# --------------------------------------------------------------------------------------
def _local_positions(n_local, comm, device=None):
    """The planted mistake: every rank's tokens rotated as if they began the sequence."""
    return slice(0, n_local)


# (name, layout, planted): each fills the launch's 4 ranks
CASES = [
    ("cp2 ring x dp2", ParallelConfig(cp=2, dp=2), False),
    ("cp2 a2a x dp2", ParallelConfig(cp=2, dp=2, cp_mode="a2a"), False),
    ("cp2 ring x tp2 sp", ParallelConfig(cp=2, tp=2, sp=True), False),
    ("cp2 a2a x tp2", ParallelConfig(cp=2, tp=2, cp_mode="a2a"), False),
    ("planted: local rotary positions", ParallelConfig(cp=2, dp=2), True),
]


def _train(layout: ParallelConfig) -> TrainConfig:
    return TrainConfig(steps=2, global_batch=2 * layout.data_replicas, microbatches=1, dtype="float64", lr=1e-2,
                       warmup=1, eval_every=0, progress=False, sample_tokens=0)


def _cases_job(comm, cases):
    """Every case on this launch's ranks (its own grid): the oracle's verdict (rank 0) and
    step 0's traced bytes by axis and op (the 'log' phase's routing counts left out)."""
    from minitron.data import load_corpus
    from minitron.tools.testing import trained_versus_one_device

    corpus, out = load_corpus(""), {}
    for name, layout, planted in cases:
        plant = mock.patch("minitron.mla.local_positions", _local_positions) if planted else None
        run = trained_versus_one_device(comm, TINY, layout, _train(layout), corpus, plant)
        out[name] = run
    return out


@pytest.fixture(scope="module")
def four():
    from minitron.tools.testing import run_on_ranks

    for _, layout, _ in CASES:
        validate(TINY, layout, _train(layout), world=4)
    return run_on_ranks(_cases_job, ParallelConfig(dp=4), CASES)


@pytest.mark.multirank
def test_mla_under_cp_equals_one_device_and_the_plant_is_caught(four):
    """verify --dtype float64 (1e-9), loss and parameters: ring and all-to-all, with dp2 and
    tp2 (+sp); rotary positions local instead of global is caught."""
    for name, layout, planted in CASES:
        res = four[0][name]["res"]
        print(f"{name:<34} loss {res['max_loss_abs_diff']:.1e} param {res['max_param_rel_diff']:.1e}")
        ok = res["max_loss_abs_diff"] <= TOL and res["max_param_rel_diff"] <= TOL
        assert ok != planted, (name, res)


@pytest.mark.multirank
def test_mla_under_cp_traced_step_equals_the_analysis(four):
    """Each rank's step 0 equals comm_bytes_per_step per axis and operation, and its 'cp'
    axis the closed form (cp_comm_items: the ring's K, V of width dk + dv, or Ulysses')."""
    from minitron.analysis.comm import comm_bytes_per_step

    bad = []
    for name, layout, _ in CASES:
        want = comm_bytes_per_step(TINY, layout, _train(layout), pp_rank=0)
        closed = bytes_by_axis(cp_comm_items(TINY, layout, _train(layout), act_bytes=8))["cp"]
        for rank in sorted(four):
            traced = four[rank][name]["traced"]
            if traced != want or traced["cp"] != closed:
                bad.append((name, rank, traced, want, closed))
    for b in bad[:4]:
        print(b)
    assert not bad, f"{len(bad)} rank-layouts differ from the analysis"
