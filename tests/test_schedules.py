"""Schedules are data: every kind is executable, and its simulated bubble and memory
are exactly the published formulas (PTD-P §2.2, Qi et al. 2024)."""
import json

import pytest

from minitron.config import V_SCHEDULES
from minitron.analysis.pipeline_sim import describe, simulate, to_json
from minitron.parallel.schedule_actions import KINDS, Action, Schedule, ScheduleError
from minitron.parallel.schedule_check import execute, validate
from minitron.parallel.schedule_comms import with_comms
from minitron.parallel.schedules import make_schedule, num_warmup


def grid(kind):
    """(p, v, m) over p in 1..8: m below, at and above p; v in 2..4 for interleaved."""
    for p in range(1, 9):
        if kind != "interleaved":
            for m in sorted({1, 2, 3, p - 1, p, p + 1, 2 * p, 3 * p} - {0}):
                yield p, 1, m
        elif p >= 2:
            for v in (2, 3, 4):
                for m in (p, 2 * p, 3 * p)[:3 if p <= 4 else 2]:
                    yield p, v, m


def bubble(sim):
    return sim.makespan - max(sim.busy)


@pytest.mark.parametrize("kind", [k for k in KINDS if k not in V_SCHEDULES])  # V: test_v_schedules.py
def test_every_schedule_validates_and_hits_the_formula(kind):
    for p, v, m in grid(kind):
        sim = simulate(validate(make_schedule(kind, p, v, m)))
        if kind == "zb-h1":
            assert bubble(sim) <= 3 * (p - 1)  # never worse than 1F1B (F=1, B+W=2)
            if m >= p:
                assert sim.bubble_fraction == pytest.approx((p - 1) / (3 * m), rel=1e-12)
        else:
            assert sim.bubble_fraction == pytest.approx((p - 1) / (v * m), rel=1e-12)
        assert sim.busy == (3 * v * m,) * p
        # the runtime blocks on every batch; with uniform costs it loses nothing
        assert simulate(make_schedule(kind, p, v, m), eager=True).makespan == sim.makespan


def test_zero_bubble_is_a_third_of_1f1b_with_the_same_memory():
    for p, _, m in grid("zb-h1"):
        zb = simulate(make_schedule("zb-h1", p, m=m), {"F": 1, "B": 1, "W": 1})
        ref = simulate(make_schedule("1f1b", p, m=m), {"F": 1, "B": 2})
        assert zb.peak_stashed == ref.peak_stashed
        if m >= p:
            assert bubble(zb) == pytest.approx(bubble(ref) / 3, rel=1e-12)


@pytest.mark.parametrize("costs", [{"F": 1, "B": 2, "W": 1}, {"F": 2, "B": 1, "W": 1},
                                   {"F": 1, "B": 1, "W": 0.5}])
def test_zero_bubble_formula_with_other_costs(costs):
    """(p-1)(T_F + T_B - T_W), for T_W no larger than T_F and T_B."""
    for p in (2, 4, 8):
        sim = simulate(make_schedule("zb-h1", p, m=2 * p), costs)
        assert bubble(sim) == pytest.approx(
            (p - 1) * (costs["F"] + costs["B"] - costs["W"]), rel=1e-12)


def test_peak_stashed_1f1b_gpipe_interleaved():
    for p in range(1, 9):
        for m in (1, p, 3 * p):
            one = simulate(make_schedule("1f1b", p, m=m))
            assert one.peak_stashed == tuple(min(p - r, m) for r in range(p))
            assert simulate(make_schedule("gpipe", p, m=m)).peak_stashed == (m,) * p
    # interleaved rank 0 holds p*v + p - 1 microbatch-chunks: p*(1 + (p-1)/(p*v)) stages
    for p, v, m in grid("interleaved"):
        sim = simulate(make_schedule("interleaved", p, v, m))
        assert sim.peak_stashed[0] == min(p * v + p - 1, m * v)


def test_interleaved_warmup_and_chunk_order_follow_ptdp():
    for p, v, m in grid("interleaved"):
        s = make_schedule("interleaved", p, v, m)
        for r in range(p):
            ops = s.compute_actions(r)
            warmup = min((p - r - 1) * 2 + (v - 1) * p, m * v)
            assert warmup == num_warmup("interleaved", p, v, m, r)
            # warm-up forwards, then the steady state opens with one more forward
            first_b = next(i for i, a in enumerate(ops) if a.op == "B")
            assert first_b == warmup + (warmup < m * v)
            fwd = [a for a in ops if a.op == "F"]
            bwd = [a for a in ops if a.op == "B"]
            assert [a.chunk for a in fwd] == [(k % (p * v)) // p for k in range(m * v)]
            assert [a.chunk for a in bwd] == [v - 1 - (k % (p * v)) // p
                                              for k in range(m * v)]


def test_1f1b_warmup():
    for p, _, m in grid("1f1b"):
        s = make_schedule("1f1b", p, m=m)
        for r in range(p):
            ops = "".join(a.op for a in s.compute_actions(r))
            assert len(ops) - len(ops.lstrip("F")) == min(p - r - 1, m) + (m > p - r - 1)


def test_actions_print_compactly_and_steps_batch_comms():
    assert str(Action("F", 3, 1)) == "F3.c1"
    assert str(Action("send_fwd", 3, 1, 2)) == "send_fwd3.c1->2"
    assert str(Action("recv_bwd", 0, 0, 1)) == "recv_bwd0.c0<-1"
    s = make_schedule("1f1b", 4, m=8)
    assert s.stage(3, 0) == 3 and s.is_last(3, 0) and s.is_first(0, 0)
    steps = [tuple(map(str, x)) if isinstance(x, tuple) else str(x) for x in s.steps(1)]
    # Megatron's send_forward_recv_backward in the steady state
    assert ("send_fwd3.c0->2", "recv_bwd1.c0<-2") in steps


def test_callable_costs_match_dict_costs():
    s = make_schedule("interleaved", 4, 2, 8)
    by_dict = simulate(s, {"F": 1, "B": 2})
    by_fn = simulate(s, lambda rank, a: {"F": 1, "B": 2}[a.op])
    assert by_fn.timeline == by_dict.timeline


def _replace(s, rank, actions):
    rows = list(s.actions)
    rows[rank] = tuple(actions)
    return Schedule(s.kind, s.p, s.v, s.m, tuple(rows))


def test_broken_schedules_are_rejected():
    s = make_schedule("1f1b", 4, m=8)
    row = list(s.actions[1])
    dropped = [a for a in row if str(a) != "recv_fwd2.c0<-0"]
    with pytest.raises(ScheduleError, match="missing recv_fwd2"):
        validate(_replace(s, 1, dropped))
    i = row.index(Action("F", 2))
    swapped = row[:i - 1] + [row[i], row[i - 1]] + row[i + 1:]
    with pytest.raises(ScheduleError, match="F2.c0 runs before recv_fwd2"):
        validate(_replace(s, 1, swapped))
    with pytest.raises(ScheduleError, match="unexpected"):
        validate(_replace(s, 1, row + [Action("W", 0)]))
    with pytest.raises(ScheduleError, match="unexpected"):
        validate(_replace(s, 1, [Action(a.op, a.mb, a.chunk, 3) if a.op == "send_fwd"
                                 else a for a in row]))


def test_messages_must_arrive_in_the_order_they_are_received():
    """Rank 1 handles microbatch 1 before 0: each rank alone is fine, but rank 0's
    first message is microbatch 0's activation."""
    s = make_schedule("gpipe", 2, m=2)
    r1 = [Action("recv_fwd", 1, 0, 0), Action("F", 1), Action("recv_fwd", 0, 0, 0),
          Action("F", 0), Action("B", 0), Action("send_bwd", 0, 0, 0), Action("B", 1),
          Action("send_bwd", 1, 0, 0)]
    with pytest.raises(ScheduleError, match="send_fwd0.c0->1 on rank 0 meets recv_fwd1"):
        validate(_replace(s, 1, r1))


def test_deadlocks_are_found():
    s = make_schedule("1f1b", 2, m=1)
    # rank 0 waits for the gradient before sending the activation that produces it
    r0 = [Action("F", 0), Action("recv_bwd", 0, 0, 1), Action("B", 0),
          Action("send_fwd", 0, 0, 1)]
    with pytest.raises(ScheduleError, match="deadlock with blocking sends"):
        validate(_replace(s, 0, r0))


def test_unpaired_interleaved_deadlocks_only_with_blocking_sends():
    """Why steady (F, B) pairs share a batch: receiving each tensor just before its
    use is fine with eager sends but deadlocks a runtime that blocks on sends."""
    good = make_schedule("interleaved", 4, 2, 8)
    naive = Schedule(good.kind, 4, 2, 8, tuple(
        with_comms(4, 2, r, [(a,) for a in good.compute_actions(r)]) for r in range(4)))
    execute(naive, lambda r, a: 1.0, eager=True)
    with pytest.raises(ScheduleError, match="deadlock with blocking sends"):
        validate(naive)


def test_validate_is_sound_under_random_swaps():
    """Swap two neighbouring actions at random: validate either rejects the result
    with a ScheduleError or the result runs to completion in both p2p semantics."""
    import random
    rng = random.Random(0)
    accepted = 0
    for _ in range(120):
        kind = rng.choice([k for k in KINDS if k not in V_SCHEDULES])
        p, v, m = rng.choice([g for g in grid(kind) if g[0] <= 4])
        s = make_schedule(kind, p, v, m)
        r = rng.randrange(p)
        row = list(s.actions[r])
        if len(row) < 2:
            continue
        i = rng.randrange(len(row) - 1)
        row[i], row[i + 1] = row[i + 1], row[i]
        try:
            t = validate(_replace(s, r, row))
        except ScheduleError:
            continue
        accepted += 1
        for eager in (False, True):
            sim = simulate(t, eager=eager)
            assert sum(len(x) for x in sim.timeline) == sum(
                len(t.compute_actions(q)) for q in range(p))
    assert 0 < accepted < 120


@pytest.mark.parametrize("args, message", [
    (("pipedream", 4), "unknown schedule 'pipedream'; choose one of gpipe, 1f1b"),
    (("interleaved", 4, 2, 3), "at least p=4 microbatches"),
    (("1f1b", 4, 2, 8), "use interleaved for v > 1"),
    (("interleaved", 1, 2, 4), "needs p >= 2 pipeline ranks"),
    (("gpipe", 0, 1, 4), "p, v, m >= 1"),
    (("gpipe", 4, 1, 0), "p, v, m >= 1"),
])
def test_bad_input_is_one_clear_line(args, message):
    with pytest.raises(ValueError, match=message) as err:
        make_schedule(*args)
    assert "\n" not in str(err.value)


def test_describe_and_json():
    s = make_schedule("1f1b", 4, m=8)
    text = describe(s)
    assert text.splitlines()[1].startswith("rank 0: F0 F1 F2 F3 B0 F4")
    assert "bubble fraction 0.3750" in text and "[4, 3, 2, 1]" in text
    d = json.loads(json.dumps(to_json(s, simulate(s))))
    assert set(d) == {"kind", "p", "v", "m", "bubble_fraction", "peak_stashed",
                      "makespan", "actions"}
    assert d["peak_stashed"] == [4, 3, 2, 1] and d["makespan"] == 33
    assert d["actions"][0][:2] == ["F0.c0", "send_fwd0.c0->1"]


def test_timeline_plots_from_simulation_and_measurement(tmp_path):
    from matplotlib.figure import Figure
    from minitron.viz import pipeline as viz
    sim = simulate(make_schedule("interleaved", 2, 2, 4))
    assert viz.save_timeline_plot(sim, tmp_path / "sim.png").stat().st_size > 0
    measured = [{**r, "start": 1e9 + r["start"] / 100, "end": 1e9 + r["end"] / 100}
                for r in sim.records()]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(r) for r in measured))
    ax = viz.plot_timeline(viz.load_timeline(tmp_path / "t.jsonl"),
                           ax=Figure().add_subplot(), title="measured")
    assert len(ax.patches) == len(measured) and ax.get_xlim()[0] == 0


def test_the_ideal_bubble_states_its_formula():
    """What the run report prints: the ideal bubble of every kind and the formula it gives,
    evaluated at the same p, v, m (T_F = T_B = T_W where the kind splits the backward)."""
    from minitron.analysis import ideal_bubble

    for kind in KINDS:
        for p, m in ((2, 4), (4, 8), (4, 9), (8, 16)):
            v = 2 if kind in ("interleaved", *V_SCHEDULES) else 1
            value, formula = ideal_bubble(kind, p, m, v)
            assert value == pytest.approx(eval(formula, {}, {"p": p, "v": v, "m": m}), rel=1e-12), (kind, p, m)
