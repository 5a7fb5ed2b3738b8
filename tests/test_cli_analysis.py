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
    (["--gpus", "1000", "--tp", "8", "--pp", "16"], "does not divide 1000 GPUs"),
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
