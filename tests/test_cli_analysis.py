"""`minitron memory | plan | schedule` contracts (in-process, no ranks)."""
import json

import pytest

from minitron.tools.cli import main


def run_json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_memory_json_keys(capsys):
    out = run_json(capsys, ["memory", "--model", "small", "--dp", "2", "--tp", "2", "--pp", "2",
                            "--microbatches", "2", "--zero1", "--json"])
    for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "total_bytes"):
        assert out[k] > 0
    assert out["optimizer_bytes"] == pytest.approx(out["params_bytes"], rel=0.01)  # 2 states / d=2


def test_plan_layout_and_candidates(capsys):
    one = run_json(capsys, ["plan", "--model", "gpt3-175b", "--gpus", "1024", "--global-batch", "1536",
                            "--tp", "8", "--pp", "16", "--json"])
    for k in ("tflops_per_gpu", "iteration_s", "memory_gb_per_gpu", "bubble_fraction"):
        assert one[k] > 0
    many = run_json(capsys, ["plan", "--model", "ptdp-1t", "--gpus", "3072", "--global-batch", "3072", "--json"])
    best = many["candidates"][0]
    assert best["tp"] == 8 and best["pp"] >= 32  # PTD-P used t=8, p=64


def test_plan_prints_why_the_best_layout(capsys):
    """The table shows cp, the schedule and the ZeRO stage; the best layout's reasons
    follow, one line per axis searched, as the planner states them."""
    from minitron.analysis import plan
    from minitron.config import PRESETS
    argv = ["plan", "--model", "llama3-70b", "--gpus", "1024", "--global-batch", "512", "--cluster", "h100-dgx",
            "--software", "megatron-core-2024", "--zero", "1", "--recompute", "selective", "--top", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    best = plan(PRESETS["llama3-70b"], 1024, 512, "h100-dgx", software="megatron-core-2024", zero=1,
                recompute="selective", top=1)[0]
    cols = out[1].split()
    assert cols[:6] == ["t", "p", "d", "v", "b", "ep"] and cols[-3:] == ["cp", "schedule", "zero"]
    row = out[2].split()
    assert row[:6] + row[-3:] == [str(best[k]) for k in ("tp", "pp", "dp", "vpp", "microbatch_size", "ep", "cp",
                                                         "schedule", "zero")]
    assert [line for line in out if line.startswith("why ")] == [f"why {k}: {v}" for k, v in best["reasons"].items()]


@pytest.mark.parametrize("argv,words", [
    (["--gpus", "1000", "--tp", "8", "--pp", "16"], "does not divide --gpus 1000"),
    (["--gpus", "8", "--cluster", "tpu-pod"], "unknown cluster 'tpu-pod'"),
    (["--gpus", "8"], "fits no layout"),
])
def test_plan_bad_input(capsys, argv, words):
    assert main(["plan", "--model", "ptdp-1t", "--global-batch", "16", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err


def test_memory_bad_layout(capsys):
    assert main(["memory", "--model", "tiny", "--nproc", "6", "--dp", "2", "--tp", "2"]) == 2
    assert "world size 6" in capsys.readouterr().err


def test_schedule_json(capsys):
    out = run_json(capsys, ["schedule", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--json"])
    assert out["bubble_fraction"] == pytest.approx(3 / 8) and out["peak_stashed"][0] == 4
    out = run_json(capsys, ["schedule", "--schedule", "interleaved", "--pp", "4", "--vpp", "2",
                            "--microbatches", "8", "--json"])
    assert out["bubble_fraction"] == pytest.approx(3 / 16)
    assert main(["schedule", "--schedule", "interleaved", "--pp", "4", "--vpp", "2", "--microbatches", "3"]) == 2


# ---- the planner uses every flag or refuses it; defaults a user can trust ----------
H100_PLAN = ["plan", "--cluster", "h100-dgx", "--global-batch", "64", "--top", "3"]


@pytest.mark.parametrize("cluster", ["v100-dgx2", "a100-dgx", "h100-dgx"])
def test_plan_default_software_follows_the_cluster(capsys, cluster):
    """Without --software, `plan` prices the software of the cluster's era and says so."""
    from minitron.analysis.cluster import CLUSTERS
    argv = ["plan", "--model", "gpt3-175b", "--gpus", "1024", "--global-batch", "1536", "--cluster", cluster,
            "--tp", "8", "--pp", "16"]
    out = run_json(capsys, [*argv, "--json"])
    assert out["software"] == out["breakdown"]["software"] == CLUSTERS[cluster].software
    assert out["software_default"] is True
    assert main(argv) == 0
    assert f"software {CLUSTERS[cluster].software} (the {cluster} era's default" in capsys.readouterr().out
    named = run_json(capsys, [*argv, "--software", "minitron", "--json"])
    assert named["breakdown"]["software"] == "minitron" and named["software_default"] is False


def test_plan_default_software_in_the_api():
    from minitron.analysis.cluster import CLUSTERS
    from minitron.analysis.planner import cluster_software
    assert [cluster_software(None, c).name for c in CLUSTERS] == ["megatron-2019", "ptdp-2021",
                                                                "megatron-core-2024", "megatron-core-2024",
                                                                "torchtitan-2024"]
    assert cluster_software("current", "h100-dgx").name == "current"


def test_software_help_lists_every_stack(capsys):
    from minitron.analysis.software import SOFTWARE
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")
    assert all(name in text for name in SOFTWARE) and "megatron-core-2024" in text


@pytest.mark.parametrize("software", ["megatron-2019", "ptdp-2021", "korthikanti-2022", "current",
                                      "megatron-core-2024", "minitron"])
def test_planner_never_searches_an_axis_the_software_does_not_run(software):
    """At a sequence long enough for context parallelism, every layout proposed is one the
    software runs: its cp kinds (none for the stacks without), its schedules, FSDP only
    where it shards weights."""
    from minitron.analysis import plan
    from minitron.analysis.software import SOFTWARE
    from minitron.config import PRESETS
    sw = SOFTWARE[software]
    for model in (PRESETS["llama3-8b"].replace(layers=8), PRESETS["gpt-1.3b"].replace(layers=8)):
        for e in plan(model, 32, 32, "h100-dgx", seq_len=32768, software=software, fsdp=bool(sw.fsdp) or None):
            assert e["cp"] == 1 or e["cp_mode"] in sw.context_parallel, e
            assert e["schedule"] in sw.schedules or e["pp"] == 1
            assert e["zero"] != 3 or sw.fsdp
            if not sw.context_parallel:
                assert "cp" not in e["reasons"]


def test_plan_passes_cp_mode_to_the_search(capsys):
    argv = [*H100_PLAN, "--model", "llama3-8b", "--layers", "8", "--seq-len", "32768", "--gpus", "32",
            "--software", "megatron-core-2024"]
    for kind in ("a2a", "allgather", "ring"):
        out = run_json(capsys, [*argv, "--cp-mode", kind, "--cp", "4", "--json"])
        assert {e["cp_mode"] for e in out["candidates"] if e["cp"] > 1} == {kind}
    fixed = run_json(capsys, [*argv, "--tp", "2", "--pp", "2", "--cp", "8", "--cp-mode", "a2a", "--json"])
    assert fixed["cp_mode"] == "a2a"


def test_plan_never_prices_an_all_to_all_train_refuses():
    """All-to-all context parallelism only where `train`'s rule splits the heads over
    tp·cp (config.validate_a2a_heads): the search skips the rest, predict refuses them."""
    from minitron.analysis import PlannedLayout, plan, predict
    from minitron.config import PRESETS, ConfigError, validate_a2a_heads
    for h, kv, t in ((40, 8, 8), (24, 8, 8), (48, 6, 2)):  # 5 and 3 heads, 3 kv heads per rank over cp 8
        m = PRESETS["llama3-8b"].replace(heads=h, hidden=128 * h, kv_heads=kv, layers=8, seq_len=32768)
        lays = plan(m, 32, 32, "h100-dgx", software="megatron-core-2024", cp_modes=("a2a",))
        assert any(e["cp"] > 1 for e in lays)
        for e in lays:
            if e["cp"] > 1:
                validate_a2a_heads(m, e["tp"], e["cp"])  # raises for a layout train refuses
        with pytest.raises(ConfigError, match="--cp-mode a2a"):
            predict(m, PlannedLayout(tp=t, cp=8, cp_mode="a2a"), 8, "h100-dgx")


@pytest.mark.parametrize("argv,words", [
    (["--model", "llama3-70b", "--gpus", "64", "--ep", "4"], "ep = 4: llama3-70b is a dense model"),
    (["--model", "gpt3-175b", "--gpus", "64", "--ep", "2", "--tp", "8", "--pp", "8"], "is a dense model"),
    (["--model", "llama3-8b", "--heads", "16", "--gpus", "64", "--ep", "8"], "custom (llama3-8b with heads=16)"),
    (["--model", "mixtral-8x7b", "--gpus", "64", "--ep", "3"], "ep = 3 does not divide the 8 experts"),
    (["--model", "llama3-8b", "--gpus", "64", "--fp8", "--cluster", "a100-dgx"], "fp8: a100-dgx's A100"),
    (["--model", "gpt3-175b", "--gpus", "64", "--fp8", "--cluster", "v100-dgx2"], "has no FP8 tensor cores"),
    (["--model", "llama3-8b", "--gpus", "64", "--cp", "4", "--software", "ptdp-2021"],
     "software ptdp-2021 runs no context parallelism"),
    (["--model", "llama3-8b", "--gpus", "64", "--cp-mode", "allgather", "--software", "minitron"],
     "cp kind 'allgather': software minitron runs ring, a2a"),
    (["--model", "llama3-8b", "--gpus", "64", "--cp-mode", "a2a", "--software", "current"],
     "software current runs no context parallelism"),
    (["--model", "llama3-8b", "--gpus", "64", "--zero", "3", "--software", "korthikanti-2022"],
     "zero = 3 (FSDP): software korthikanti-2022 does not shard weights"),
    (["--model", "llama3-8b", "--heads", "40", "--kv-heads", "8", "--hidden", "5120", "--gpus", "64", "--tp", "8",
      "--pp", "1", "--cp", "4", "--cp-mode", "a2a"], "--cp-mode a2a splits each tensor rank's 5 heads over --cp 4"),
    (["--model", "mixtral-8x7b", "--gpus", "1000000", "--tp", "8", "--pp", "4"],
     "--gpus 1000000 / (tp*pp*cp = 32) = 31250 data-parallel ranks x --microbatch-size 1 (the default)"),
    (["--model", "llama3-8b", "--gpus", "1048576", "--tp", "8", "--pp", "4", "--microbatch-size", "2"],
     "--global-batch 64 does not split over dp = --gpus 1048576"),
    (["--model", "mixtral-8x7b", "--gpus", "16", "--tp", "1", "--pp", "4", "--ep", "8"],
     "--ep 8 does not divide the tp*cp*dp = 4 ranks"),
    (["--model", "llama3-8b", "--gpus", "1000", "--tp", "8", "--pp", "16"], "= 128 does not divide --gpus 1000"),
])
def test_plan_refuses_what_it_cannot_use_in_one_line(capsys, argv, words):
    assert main([*H100_PLAN, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err, err


@pytest.mark.parametrize("argv,words", [
    (["--pp", "1000000"], "--pp 1000000 x --vpp 1 (the default) x --microbatches 8 (the default)"),
    (["--pp", "1000000"], "use a smaller --pp"),
    (["--microbatches", "20000"], "--pp 4 (the default) x --vpp 1 (the default) x --microbatches 20000"),
    (["--microbatches", "20000"], "use a smaller --microbatches"),
    (["--pp", "8", "--vpp", "4", "--microbatches", "400"], "use a smaller --microbatches"),
    (["--vpp", "5000", "--schedule", "interleaved"], "use a smaller --vpp"),
])
def test_schedule_errors_name_the_setting_given(capsys, argv, words):
    assert main(["schedule", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err, err


@pytest.mark.parametrize("flags,words", [(["--layers", "4"], "layers=4"), (["--hidden", "64"], "hidden=64"),
                                         (["--seq-len", "64", "--layers", "3"], "layers=3, seq_len=64"),
                                         (["--vocab", "512"], "vocab=512")])
def test_plan_json_names_a_model_given_by_flags_custom(capsys, flags, words):
    out = run_json(capsys, ["plan", "--model", "tiny", *flags, "--gpus", "8", "--global-batch", "16", "--json"])
    assert out["model"] == "custom" and out["model_description"] == f"custom (tiny with {words})"
    assert out["model_config"]["name"] == out["model_description"]
    same = run_json(capsys, ["plan", "--model", "tiny", "--gpus", "8", "--global-batch", "16", "--json"])
    assert same["model"] == "tiny"


@pytest.mark.parametrize("argv,words", [
    (["--model", "llama3-8b", "--tp", "8", "--pp", "4", "--nproc", "32"],
     "does not fit V100-SXM3-32GB 32 GB, A100-SXM4-80GB 80 GB, H100-SXM5-80GB 80 GB, H800-SXM5-80GB 80 GB, "
     "H100-HBM2e-96GB 96 GB, H200-SXM-141GB 141 GB "
     "(only B200-180GB)"),
    (["--model", "llama3-8b", "--tp", "8", "--pp", "4", "--nproc", "32", "--seq-len", "16384"],
     "fits no GPU of V100-SXM3-32GB 32 GB, A100-SXM4-80GB 80 GB"),
    (["--model", "llama3-8b", "--tp", "8", "--pp", "4", "--nproc", "32", "--cluster", "h100-dgx"],
     "fits no GPU of H100-SXM5-80GB 80 GB"),
    (["--model", "llama3-8b", "--tp", "8", "--pp", "4", "--nproc", "32", "--seq-len", "2048", "--global-batch", "16",
      "--microbatches", "1", "--cluster", "v100-dgx2"], "fits no GPU of V100-SXM3-32GB 32 GB"),
    (["--model", "llama3-8b", "--tp", "8", "--pp", "4", "--nproc", "32", "--seq-len", "2048", "--global-batch", "16",
      "--microbatches", "1"], "does not fit V100-SXM3-32GB 32 GB (only A100"),
])
def test_memory_warns_when_a_rank_exceeds_the_gpu(capsys, argv, words):
    assert main(["memory", *argv]) == 0
    out = capsys.readouterr().out
    assert words in out and out.count("warning:") == 1
    js = run_json(capsys, ["memory", *argv, "--json"])
    assert js["warning"] and not all(js["fits"].values())


def test_memory_says_nothing_when_it_fits(capsys):
    for argv in (["--model", "small"], ["--model", "tiny", "--dp", "2", "--nproc", "2"],
                 ["--model", "small", "--cluster", "v100-dgx2"]):
        assert main(["memory", *argv]) == 0
        assert "warning" not in capsys.readouterr().out
        assert run_json(capsys, ["memory", *argv, "--json"])["warning"] == ""
    assert main(["memory", "--model", "small", "--cluster", "tpu"]) == 2
    assert "unknown cluster 'tpu'" in capsys.readouterr().err
