"""`minitron sweep`: a scaling series on real ranks, one JSON line per point, the local
throughput model's prediction beside each (timings are reported, never asserted)."""
from __future__ import annotations

import json

import pytest

from minitron.config import ConfigError, PRESETS
from minitron.tools.sweep import MachineProfile, analysed_calls, parse_layout, plan_on_machine, point_config
from minitron.tools.testing import run_cli


def test_parse_layout_and_series():
    p = parse_layout("dp2.tp2.pp2.v2")
    assert (p.dp, p.tp, p.pp, p.vpp, p.schedule) == (2, 2, 2, 2, "interleaved")
    assert parse_layout("tp8.3d").tp_mode == "3d" and parse_layout("tp2.sp").sp
    with pytest.raises(ConfigError, match="'xx2' is not"):
        parse_layout("dp2.xx2")
    m = PRESETS["tiny"]
    assert point_config(m, parse_layout("dp4"), "weak", 4, 3, 1).global_batch == 16
    assert point_config(m, parse_layout("dp4"), "strong", 8, 3, 1).global_batch == 8
    t = point_config(m, parse_layout("pp2"), "weak", 3, 3, 2)
    assert t.microbatches >= 2 and (t.global_batch // 1) % t.microbatches == 0
    with pytest.raises(ConfigError, match="weak or strong"):
        point_config(m, parse_layout("dp2"), "sideways", 4, 3, 1)


def test_alpha_beta_pricing():
    prof = MachineProfile("m", 2, 1e9, "tiny", {"all_reduce": {2: [1e-4, 1e-9]}, "send": {2: [5e-5, 2e-9]}})
    assert prof.call_seconds("all_reduce", 2, 1000) == pytest.approx(1e-4 + 1e-6)
    # a group of 4 measured at 2: three ring steps instead of one, each moving half the bytes
    assert prof.call_seconds("all_reduce", 4, 1000) == pytest.approx(3e-4 + 3 * 0.5 * 1e-6)
    assert prof.call_seconds("recv", 2, 1000) == pytest.approx(5e-5 + 2e-6)
    # a group of 4 measured with 4 ranks on 2 cores ran at half speed: its fit is taken back
    # to a core per rank (predict_step slows it again by the layout's own world / cores)
    fits = {"all_reduce": {4: [2e-4, 1e-9]}}
    assert MachineProfile("m", 2, 1e9, "tiny", fits).call_seconds("all_reduce", 4, 1000) == pytest.approx(
        (2e-4 + 1e-6) / 2)
    assert MachineProfile("m", 4, 1e9, "tiny", fits).call_seconds("all_reduce", 4, 1000) == pytest.approx(2e-4 + 1e-6)


PROFILE = MachineProfile("m", 2, 1e9, "tiny", {op: {2: [1e-4, 1e-9], 4: [3e-4, 1e-9]} for op in
                                              ("all_reduce", "all_gather", "reduce_scatter", "send")})


def test_plan_on_a_measured_machine(tmp_path):
    m = PRESETS["tiny"]
    rows = plan_on_machine(m, 4, 4, PROFILE)
    assert {r["layout"] for r in rows} >= {"dp4.tp1.pp1", "dp2.tp2.pp1.sp", "dp1.tp4.pp1.sp", "dp2.tp1.pp2.1f1b"}
    assert [r["tokens_per_s"] for r in rows] == sorted((r["tokens_per_s"] for r in rows), reverse=True)
    for r in rows:  # weak scaling: the same FLOPs per rank, the same compute on 4 ranks
        assert r["compute_s"] == pytest.approx(rows[0]["compute_s"])
        assert r["step_s"] == pytest.approx(r["compute_s"] + r["comm_s"] + r["bubble_s"])
    # the calls priced are the analysis's: dp4 sends one all-reduce of every gradient
    from minitron.analysis import param_count
    calls = analysed_calls(m, parse_layout("dp4"), point_config(m, parse_layout("dp4"), "weak", 4, 1, 1))[0]
    assert sum(c["bytes"] for c in calls if c["axis"] == "dp") == 4 * param_count(m)
    prof = tmp_path / "m.json"
    PROFILE.save(str(prof))
    code, out, err = run_cli(["plan", "--machine", str(prof), "--model", "tiny", "--gpus", "4", "--global-batch", "16",
                              "--json"])
    assert code == 0, err
    assert [r["layout"] for r in json.loads(out)["candidates"]] == [r["layout"] for r in rows]
    code, out, err = run_cli(["plan", "--machine", str(prof), "--model", "tiny", "--gpus", "4", "--global-batch", "10"])
    assert code == 2 and "multiple of --gpus 4" in err and err.count("\n") == 1, err


def test_bad_profile_and_output_are_one_line(tmp_path):
    bad = tmp_path / "m.json"
    bad.write_text("{}")
    code, out, err = run_cli(["sweep", "--machine", str(bad), "--layouts", "dp1"])
    assert code == 2 and err.count("\n") == 1 and "not a machine profile" in err, err
    code, out, err = run_cli(["sweep", "--layouts", "dp2.zz3"])
    assert code == 2 and "'zz3' is not" in err and "Traceback" not in err, err


@pytest.mark.multirank
def test_local_series_rows(tmp_path):
    prof, out = tmp_path / "machine.json", tmp_path / "sweep.jsonl"
    code, so, se = run_cli(["sweep", "--model", "tiny", "--measure-machine", str(prof)], timeout=600)
    assert code == 0, se
    code, so, se = run_cli(["sweep", "--model", "tiny", "--layouts", "dp1 dp2 tp2.sp", "--steps", "2",
                            "--warmup", "1", "--machine", str(prof), "--out", str(out)], timeout=600)
    assert code == 0, se
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["layout"] for r in rows] == ["dp1.tp1.pp1", "dp2.tp1.pp1", "dp1.tp2.pp1.sp"]
    assert [r["global_batch"] for r in rows] == [4, 8, 8]  # weak scaling: 4 sequences per rank
    for r in rows:
        assert r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["peak_rss_bytes"] > 0
        assert r["predicted"]["step_s"] == pytest.approx(sum(r["predicted"][k] for k in ("compute_s", "bubble_s", "comm_s")))
    assert rows[0]["bytes_per_axis"] == {} and rows[0]["efficiency"] == 1.0
    # the traced bytes of the dp2 step: one all-reduce of every gradient (float32)
    from minitron.analysis import param_count
    assert rows[1]["bytes_per_axis"]["dp"] == 4 * param_count(PRESETS["tiny"])
    assert rows[2]["bytes_per_axis"]["tp"] > 0 and "dp" not in rows[2]["bytes_per_axis"]
    # what `plan --machine` prices without running equals what the traced step sent
    for row, spec in zip(rows, ("dp1", "dp2", "tp2.sp")):
        lay = parse_layout(spec)
        calls = analysed_calls(PRESETS["tiny"], lay, point_config(PRESETS["tiny"], lay, "weak", 4, 1, 2))[0]
        for axis in ("dp", "tp"):
            assert sum(c["bytes"] for c in calls if c["axis"] == axis) == row["bytes_per_axis"].get(axis, 0), (spec, axis)
