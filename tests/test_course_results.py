"""The figures lessons 5 and 6 compute (minitron.course.tp_schemes, minitron.course.ptdp)
are computed: each is checked against the analysis it comes from or a brute-force
version of itself, never against a typed-in answer. Fast: no ranks are started."""
import math

import pytest

from minitron import PRESETS, ParallelConfig
from minitron import analysis as A
from minitron.analysis import cube as C
from minitron.analysis import tp_schemes as T
from minitron.analysis.cluster import COMM_BW_FRACTION, PlannedLayout, get_cluster, predict
from minitron.analysis.published import BIAN_2021_SPEEDUPS, PTDP_VS_ZERO3
from minitron.analysis.zero import zero_wire_bytes
from minitron.course import ptdp as CP
from minitron.course import tp_schemes as CT
from minitron.grid import ProcessGrid


# --- lesson 5: the naive and the balanced cube ---------------------------------------------
@pytest.mark.parametrize("q, b, s, d_in, d_out", [(2, 4, 32, 32, 128), (3, 9, 2, 18, 27)])
def test_cube_placements_match_the_analysis(q, b, s, d_in, d_out):
    e = 8
    placed = CT.cube_placements(q, b, s, d_in, d_out, bytes_per_el=e)
    grid = ProcessGrid(tp=q ** 3, cube=True)
    fwd = C.linear_wire_bytes(b, s, d_in, d_out, q, e)
    for rows in placed.values():
        assert len(rows) == q ** 3
        # same bytes on the wire either way: Bian et al.'s formula
        assert all(math.isclose(r["sent"], fwd["fwd"]) and math.isclose(r["sent"], fwd["formula"])
                   for r in rows.values())
        # every block of X, W and Y held exactly once over the cube
        for k, full in (("input", e * b * s * d_in), ("weight", e * d_in * d_out), ("output", e * b * s * d_out)):
            assert sum(r[k] for r in rows.values()) == full, k
    bal, naive = placed["balanced"], placed["naive"]
    calls = {c["what"].split(": ")[1]: c["bytes"] for c in C.linear_calls(b, s, d_in, d_out, q, e)}
    assert all(r["weight"] == calls["weight all-gather"] and r["input"] == calls["input all-gather"]
               for r in bal.values())
    assert set(CT.placement_imbalance(bal).values()) == {1.0}
    imbalance = CT.placement_imbalance(naive)
    assert all(math.isclose(imbalance[k], q) for k in ("input", "weight", "output", "bias", "bias_adds"))
    # the naive output (and its bias) sits on the plane k = 0 of the grid
    assert {r for r, row in naive.items() if row["output"]} == {r for r in range(q ** 3) if grid.cube_coord(r)[2] == 0}
    # balanced vectors: a piece of d_out/q on every rank, q² copies of each
    assert sum(r["bias"] for r in bal.values()) == q * q * e * d_out


def test_cube_placement_figure_has_a_panel_per_plane():
    from minitron.course.figures import draw_cube_placements

    fig = draw_cube_placements(CT.cube_placements(2, 4, 4, 8, 8), 2)
    assert len(fig.axes) == 2 * 2


# --- lesson 5: the four schemes and Bian et al.'s 64 GPUs --------------------------------------
def test_scheme_rows_join_the_analysis():
    model, batch = CT.BIAN_SHAPE
    rows = {r["scheme"]: r for r in CT.scheme_rows(model, batch, 64)}
    sizes = {r["scheme"]: r for r in T.compare_tp_schemes(model, batch, 64, 2)}
    times = {r["scheme"]: r for r in T.project_tp_schemes(model, batch, 64, T.LONGHORN, 2)}
    for s in T.SCHEMES:
        assert rows[s]["layer_wire_bytes"] == sizes[s]["layer_wire_bytes"]
        assert rows[s]["layer_s"] == times[s]["layer_s"]


def test_bian_comparison_is_the_projection_beside_the_published_figure():
    model, batch = CT.BIAN_SHAPE
    proj = {r["scheme"]: r for r in T.project_tp_schemes(model, batch, 64, T.LONGHORN)}
    rows = CT.bian_64gpu_comparison()
    assert {r["over"] for r in rows} == set(BIAN_2021_SPEEDUPS)
    for r in rows:
        assert r["published"] == BIAN_2021_SPEEDUPS[r["over"]]
        assert r["predicted"] == proj["3d"]["speedup_vs"][r["over"]] == proj[r["over"]]["layer_s"] / proj["3d"]["layer_s"]
        assert math.isclose(r["error"], r["predicted"] / r["published"] - 1)


def test_scaling_series_lists_each_scheme_where_it_fits():
    model, _ = CT.BIAN_SHAPE
    series = CT.scaling_series(model, (4, 8, 16, 64), batch_for=lambda P: P)
    assert [P for P, _ in series["3d"]] == [8, 64] and [P for P, _ in series["2d"]] == [4, 16, 64]
    seconds = {r["scheme"]: r["layer_s"] for r in T.project_tp_schemes(model, 16, 16, T.LONGHORN) if r["feasible"]}
    assert dict(series["1d"])[16] == seconds["1d"]


def test_benchmark_results_are_read_and_bad_files_refused(tmp_path):
    rows = CT.read_tp_schemes_benchmark()
    assert {s for _, s in rows} == set(T.SCHEMES) and len(rows) == 8
    assert all(r["wire_measured"] > 0 and r["step_s"] > 0 for r in rows.values())
    flagged = tmp_path / "flagged.md"   # a row the benchmark marks as measured != predicted
    flagged.write_text("| tokens | 3d | `dp1.tp8.pp1.cube` | 1.0 KiB \\| 1.0 KiB | 2.0 KiB \\| 3.0 KiB ✗ | "
                       "1.0 KiB \\| 1.0 KiB | 1.0 KiB \\| 1.0 KiB | 517 ms |\n")
    row = CT.read_tp_schemes_benchmark(flagged)["tokens", "3d"]
    assert (row["wire_measured"], row["wire_predicted"], row["step_s"]) == (2048, 3072, 0.517)
    empty = tmp_path / "results.md"
    empty.write_text("# nothing here\n")
    with pytest.raises(ValueError, match="results.md: no per-device table"):
        CT.read_tp_schemes_benchmark(empty)


# --- lesson 6: checkpoint spacing (PTD-P §3.5) -------------------------------------------------
@pytest.mark.parametrize("layers, in_flight", [(8, 1), (96, 1), (8, 12), (30, 3)])
def test_checkpoint_optimum_is_the_brute_force_minimum(layers, in_flight):
    gpt3 = PRESETS["gpt3-175b"]
    sp = CP.checkpoint_spacing(gpt3, 1, layers, tp=8, in_flight=in_flight)
    a_in = A.activation_bytes_per_layer(gpt3, 1, 8, False, "full", 2)
    a_mid = A.activation_bytes_per_layer(gpt3, 1, 8, False, "none", 2)
    assert (sp["a_input"], sp["a_intermediate"]) == (a_in, a_mid)
    memory = {c: in_flight * c * a_in + layers / c * a_mid for c in range(1, layers + 1)}
    assert sp["curve"] == memory
    assert sp["best_c"] == min(memory, key=memory.get)
    # the closed form is the continuous minimum: no neighbour is lower
    m = lambda c: CP.checkpoint_memory(layers, c, a_in, a_mid, in_flight)  # noqa: E731
    assert m(sp["c_star"]) <= min(m(sp["c_star"] * 0.99), m(sp["c_star"] * 1.01))


def test_every_layer_checkpointed_is_the_engines_full_recompute_estimate():
    gpt3, p, m, stage = PRESETS["gpt3-175b"], 12, 128, 5
    k = A.stashed_on_rank("1f1b", p, m, 1, stage)
    sp = CP.checkpoint_spacing(gpt3, 1, gpt3.layers // p, tp=8, in_flight=k)
    engine = A.activation_bytes_on_rank(gpt3, ParallelConfig(tp=8, pp=p), 1, m, pp_rank=stage, recompute="full")
    assert math.isclose(engine, sp["curve"][gpt3.layers // p] - sp["a_input"])


# --- lesson 6: PTD-P against ZeRO-3 (§5.2) -----------------------------------------------------
def test_zero3_prediction_prices_the_zero_traffic():
    gpt3, c = PRESETS["gpt3-175b"], get_cluster("a100-dgx")
    psi = A.param_count(gpt3)
    for network, share in (("gpu", c.gpus_per_node), ("node", 1)):
        z = CP.zero3_prediction(gpt3, 768, 1536, 2, c, network=network)
        wire = zero_wire_bytes(psi, 768, 3, bytes_per_el=2)
        assert math.isclose(z["comm_s"], 3 * 767 * c.inter_latency + wire / (c.inter_bw / share * COMM_BW_FRACTION))
        base = predict(gpt3, PlannedLayout(dp=768, microbatch_size=2), 1536, c, software="ptdp-2021")
        assert z["compute_s"] == base.breakdown["compute"]
        assert math.isclose(z["iteration_s"], z["compute_s"] + z["exposed_s"] + z["optimizer_s"])
        assert math.isclose(z["tflops_per_gpu"], A.flops_per_iteration(gpt3, 1536) / (768 * z["iteration_s"]) / 1e12)
    with pytest.raises(ValueError, match="network must be one of"):
        CP.zero3_prediction(gpt3, 768, 1536, 2, c, network="wifi")


def test_ptdp_vs_zero3_rows_are_the_predictions_beside_table_2():
    rows = CP.ptdp_vs_zero3()
    assert len(rows) == sum(len(pts) for runs in PTDP_VS_ZERO3.values() for pts in runs.values())
    for r in rows:
        assert math.isclose(r["error"], r["predicted"] / r["published"] - 1)
    first = next(r for r in rows if r["scheme"] == "ptdp" and r["model"] == "175B")
    expect = predict(PRESETS["gpt3-175b"], PlannedLayout(tp=8, pp=12, dp=first["gpus"] // 96), 1536, "a100-dgx",
                     software="ptdp-2021").tflops_per_gpu
    assert math.isclose(first["predicted"], expect)
