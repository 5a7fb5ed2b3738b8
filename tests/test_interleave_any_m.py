"""Interleaving for any m >= p: microbatches go through the chunks in m // p groups of at
least p (Megatron-Core's microbatch_group_size_per_vp_stage, PyTorch's rounds), so m need
not be a multiple of p. The schedule validates, its simulated bubble and stash are the
closed forms, and the runtime equals one device (float64)."""
import pytest

from minitron.analysis import bubble as A
from minitron.analysis.pipeline_sim import simulate
from minitron.config import ConfigError, ParallelConfig, TrainConfig, PRESETS, validate as validate_config
from minitron.parallel.schedule_actions import Schedule
from minitron.parallel.schedule_check import execute, validate
from minitron.parallel.schedules import interleaved_groups, interleaved_order, make_schedule, num_warmup
from minitron.parallel.pipeline import forward_only_actions
from minitron.tools.testing import last_json, run_cli


def shapes():
    """(p, v, m) with m >= p not a multiple of p (and a few multiples, for contrast)."""
    for p in range(2, 7):
        for v in (2, 3):
            for m in sorted({p + 1, p + p // 2 + 1, 2 * p - 1, 2 * p + 1, 3 * p - 1, 2 * p} - {p}):
                yield p, v, m


def test_groups_cover_m_with_at_least_p_each_largest_first():
    for p in range(1, 9):
        for m in range(p, 5 * p + 3):
            g = interleaved_groups(p, m)
            assert sum(g) == m and min(g) >= p and g == sorted(g, reverse=True)
            assert len(g) == max(m // p, 1) and max(g) - min(g) <= 1
            assert g[0] == A.first_group(p, m)
            if m % p == 0:
                assert g == [p] * (m // p)          # PTD-P's schedule, unchanged
    assert interleaved_groups(4, 6) == [6] and interleaved_groups(4, 9) == [5, 4]
    # the order: each group through chunk 0, then chunk 1 (Megatron's table for PP2, M5)
    assert interleaved_order(2, 2, 5) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1),
                                            (3, 0), (4, 0), (3, 1), (4, 1)]


def test_any_m_validates_and_hits_the_closed_forms():
    for p, v, m in shapes():
        s = validate(make_schedule("interleaved", p, v, m))
        eager = simulate(s, eager=True)
        blocking = simulate(s)
        # gloo's runtime leaves sends in flight (eager): the bubble is PTD-P's (p-1)/(v m)
        assert eager.bubble_fraction == pytest.approx(A.bubble_fraction("interleaved", p, m, v), rel=1e-12)
        # a runtime that blocks on every batch never does better
        assert blocking.makespan >= eager.makespan
        assert eager.busy == (3 * v * m,) * p
        for r in range(p):
            assert eager.peak_stashed[r] == pytest.approx(v * A.stashed_on_rank("interleaved", p, m, v, r))
        # evaluation (the forward half alone) cannot deadlock either
        fwd = Schedule("interleaved", p, v, m, forward_only_actions(s))
        for mode in (False, True):
            assert len(execute(fwd, lambda r, a: 1.0, mode)) == p * v * m


def test_the_issue_shape_is_exact_in_both_p2p_semantics():
    s = validate(make_schedule("interleaved", 4, 2, 6))
    for eager in (False, True):
        sim = simulate(s, eager=eager)
        assert sim.bubble_fraction == pytest.approx(3 / 12, rel=1e-12)
        # min((p-1)*2 + (v-1)*g + 1, v*m) with g = 6: one group, rank 0 holds all 12 chunk-microbatches
        assert sim.peak_stashed[0] == min(2 * 3 + 6 + 1, 12)
    # warm-up: (p - r - 1) * 2 + (v - 1) * g with g = 6
    assert [num_warmup("interleaved", 4, 2, 6, r) for r in range(4)] == [12, 10, 8, 6]


def test_vpp_1_is_1f1b():
    for p in range(1, 6):
        for m in (1, p, 2 * p + 1):
            il, ref = make_schedule("interleaved", p, 1, m), make_schedule("1f1b", p, 1, m)
            assert il.actions == ref.actions and il.kind == "interleaved"
            assert simulate(validate(il)).bubble_fraction == pytest.approx(
                A.bubble_fraction("interleaved", p, m, 1))


def test_config_accepts_any_m_at_least_p_and_vpp_1():
    model = PRESETS["tiny"].replace(layers=8)
    ok = [(ParallelConfig(pp=4, vpp=2, schedule="interleaved"), TrainConfig(microbatches=6, global_batch=12)),
          (ParallelConfig(pp=2, vpp=1, schedule="interleaved"), TrainConfig(microbatches=3, global_batch=6))]
    for layout, train in ok:
        validate_config(model, layout, train)
    with pytest.raises(ConfigError, match="at least --pp 4") as err:
        validate_config(model, ParallelConfig(pp=4, vpp=2, schedule="interleaved"),
                        TrainConfig(microbatches=3, global_batch=6))
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="at least p=4 microbatches"):
        make_schedule("interleaved", 4, 2, 3)


@pytest.mark.multirank
@pytest.mark.parametrize("argv", [
    # the issue's shape: p=4, v=2, m=6 (one group of 6), 4 ranks
    ["--nproc", "4", "--pp", "4", "--vpp", "2", "--microbatches", "6", "--global-batch", "12", "--layers", "8"],
    # p=2, v=2, m=5 (groups 3, 2): both directions share one channel between the two ranks
    ["--nproc", "2", "--pp", "2", "--vpp", "2", "--microbatches", "5", "--global-batch", "10", "--layers", "4"],
])
def test_any_m_equals_one_device(argv):
    code, out, err = run_cli(["verify", "--model", "tiny", "--schedule", "interleaved", "--dtype", "float64",
                              "--steps", "2", "--json", *argv], timeout=900)
    assert code == 0, err[-3000:]
    res = last_json(out)
    assert res["ok"] and res["max_loss_abs_diff"] <= 1e-9 and res["max_param_rel_diff"] <= 1e-9
