"""Failures at scale, the arithmetic (lesson 8, section 6): the Llama 3 record's MTBF, Young's
interval as the minimum of the lost fraction it is derived from, Daly's correction; and the
fault-tolerant replay's weights (``fault_tolerance.step_weights``, ``rows_and_scale``,
``ScaledGradients``) as the Trainer takes them. In-process, no ranks: fast."""
import math
from types import SimpleNamespace

import pytest
import torch

from minitron import data
from minitron import fault_tolerance as ftm
from minitron.analysis import checkpoint_interval as ci


def test_the_llama3_record_and_its_mtbf():
    run = ci.LLAMA3_405B
    assert (run.gpus, run.days, run.interruptions, run.unexpected) == (16_384, 54, 466, 419)
    assert run.mtbf_s() == pytest.approx(54 * 86_400 / 419)
    assert run.mtbf_s(4_096) == pytest.approx(4 * run.mtbf_s())  # independent per GPU: 1/N
    assert run.mtbf_s(1) / 86_400 / 365 == pytest.approx(5.785, rel=1e-3)


def test_young_is_the_minimum_of_the_lost_fraction_and_daly_is_below_it():
    for save_s, mtbf in ((60.0, 11_133.0), (0.3, 3_600.0), (300.0, 86_400.0)):
        tau = ci.young_daly_interval_s(save_s, mtbf)
        assert tau == pytest.approx(math.sqrt(2 * save_s * mtbf))
        grid = [tau * (0.5 + i / 1000) for i in range(1001)]
        best = min(grid, key=lambda t: ci.lost_fraction(t, save_s, mtbf, restart_s=600))
        assert best == pytest.approx(tau, rel=2e-3)  # the restart does not move the optimum
        assert ci.lost_fraction(tau, save_s, mtbf) == pytest.approx(math.sqrt(2 * save_s / mtbf))
        assert ci.young_daly_interval_s(save_s, mtbf, daly=True) == pytest.approx(tau - save_s)
    with pytest.raises(ValueError, match="must be positive"):
        ci.young_daly_interval_s(0.0, 10.0)
    assert ci.live_recovery_lost_fraction(16, 120.0, 11_133.0) == pytest.approx(120 / 16 / 11_133)


def test_step_weights_are_the_mean_over_the_quorums_rows():
    B, R = 12, 3
    w = ftm.step_weights(B, R, {0: [0, 1, 2], 1: [0, 2], 2: [1]})
    assert torch.equal(w(0), torch.full((B,), 1 / B, dtype=torch.float64))
    rows = [i for r in (0, 2) for i in range(B)[data.dp_rows(B, R, r)]]
    assert w(1).nonzero().flatten().tolist() == rows and w(1)[rows].eq(1 / 8).all()
    assert ftm.rows_and_scale(w(2)) == (list(range(4, 8)), 1.0)


def test_rows_and_scale_takes_a_uniform_share_and_refuses_the_rest():
    rows, scale = ftm.rows_and_scale(torch.tensor([0.25, 0.25, 0.0, 0.0], dtype=torch.float64))
    assert rows == [0, 1] and scale == 0.5  # the mean over the whole batch: half the participants' mean
    for bad in ([0.5, 0.25, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, -0.5, 0.5, 0.0]):
        with pytest.raises(ValueError, match="one non-negative value") as e:
            ftm.rows_and_scale(torch.tensor(bad, dtype=torch.float64))
        assert "\n" not in str(e.value)


def test_scaled_gradients_scales_each_step_by_its_own_factor():
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    calls = []
    inner = SimpleNamespace(params=[p], comm=None, zero_grad=lambda: calls.append("zero"),
                            microbatch=lambda last: calls.append(last), finish=lambda: calls.append("finish"))
    sync = ftm.ScaledGradients(inner, [1.0, 0.5])
    for want in (1.0, 0.5):
        p.grad = torch.full((3,), 2.0, dtype=torch.float64)
        sync.finish()
        assert torch.equal(p.grad, torch.full((3,), 2.0 * want, dtype=torch.float64))
    assert calls == ["finish", "finish"]
