"""The command line's contracts: bad input is one line and exit 2; resume is exact."""
import shutil

import pytest
import torch

from minitron.tools.cli import main
from minitron.comm import read_trace
from minitron.tools.testing import last_json, run_cli

TRAIN = ["train", "--model", "tiny", "--global-batch", "4", "--no-progress", "--sample", "0", "--eval-every", "0"]


def one_line_error(capsys, argv, words):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("minitron: error:") and words in err and "\n" not in err, err


@pytest.mark.parametrize("argv,words", [
    (["--nproc", "3", "--dp", "2"], "world size 3 != dp*tp*pp"),
    (["--hidden", "30"], "not divisible by 4 heads"),
    (["--data", "/no/such/file.txt"], "does not exist"),
    (["--steps", "0"], "--steps must be a positive"),
    (["--steps", "-5"], "--steps must be a positive"),
    (["--model", "gpt5"], "unknown model preset 'gpt5'"),
    (["--tp", "3", "--nproc", "3"], "not divisible by --tp 3"),
    (["--schedule", "zigzag", "--pp", "2"], "unknown schedule"),
])
def test_bad_input_is_one_line(capsys, argv, words):
    one_line_error(capsys, TRAIN + argv, words)


def test_empty_data_file(capsys, tmp_path):
    (tmp_path / "e.txt").write_text("")
    one_line_error(capsys, TRAIN + ["--data", str(tmp_path / "e.txt")], "is empty")


def test_exit_code_from_a_real_process():
    code, out, err = run_cli(TRAIN + ["--nproc", "4", "--dp", "3"])
    assert code == 2 and err.strip().count("\n") == 0 and "world size 4" in err and "Traceback" not in err


def _train(ckpt, steps=20, resume=False, extra=()):
    argv = TRAIN + ["--steps", str(steps), "--ckpt-dir", str(ckpt), "--ckpt-every", "10", "--dtype", "float64",
                    "--metrics", str(ckpt) + ".jsonl", *extra] + (["--resume"] if resume else [])
    assert main(argv) == 0


def _params(path):
    return torch.load(path / "rank_00000.pt", weights_only=True)


def test_resume_is_bitwise_exact(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    _train(a)
    shutil.copytree(a, b)
    shutil.rmtree(b / "step_0000020")
    (b / "latest").write_text("step_0000010")  # as if stopped right after step 10
    _train(b, resume=True)
    pa, pb = _params(a / "step_0000020"), _params(b / "step_0000020")
    assert pa.keys() == pb.keys()
    for k in pa:
        for field in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(pa[k][field], pb[k][field]), (k, field)
    assert "resumed from" in capsys.readouterr().out


def test_corrupt_and_truncated_checkpoints(tmp_path, capsys):
    a = tmp_path / "a"
    _train(a, steps=10)
    f = a / "step_0000010" / "rank_00000.pt"
    f.write_bytes(f.read_bytes()[:100])  # truncated
    one_line_error(capsys, TRAIN + ["--steps", "20", "--ckpt-dir", str(a), "--resume"], "does not match its checksum")
    f.write_bytes(b"garbage" * 10)
    one_line_error(capsys, TRAIN + ["--steps", "20", "--ckpt-dir", str(a), "--resume"], "does not match its checksum")
    (a / "step_0000010" / "meta.json").unlink()
    one_line_error(capsys, TRAIN + ["--steps", "20", "--ckpt-dir", str(a), "--resume"], "no meta.json")


def test_mismatched_checkpoint(tmp_path, capsys):
    a = tmp_path / "a"
    _train(a, steps=10)
    one_line_error(capsys, TRAIN + ["--steps", "20", "--hidden", "64", "--ckpt-dir", str(a), "--resume"],
                   "holds another model (hidden 32 -> 64, ffn 128 -> 256): use its model flags (--hidden 32 --ffn 128)")


def test_verify_single_device_json():
    assert main(["verify", "--json", "--steps", "2"]) == 0


@pytest.mark.multirank
def test_multirank_resume_and_verify(tmp_path):
    """dp2 x tp2 on 4 real gloo ranks: verify passes and resume is bitwise exact."""
    trace = tmp_path / "trace.jsonl"
    code, out, err = run_cli(["verify", "--nproc", "4", "--dp", "2", "--tp", "2", "--microbatches", "2", "--json",
                              "--trace", str(trace)])
    res = last_json(out)
    assert code == 0 and res["ok"], (out, err)
    assert res["max_loss_abs_diff"] <= 1e-9 and res["max_param_rel_diff"] <= 1e-9
    recs = read_trace(trace)
    assert {r["rank"] for r in recs} == {0, 1, 2, 3}
    assert {"rank", "step", "op", "axis", "bytes", "phase"} <= set(recs[0])
    assert {(r["op"], r["axis"]) for r in recs} >= {("all_reduce", "tp"), ("all_reduce", "dp")}
    assert {r["phase"] for r in recs} >= {"fwd", "bwd", "optim"}
    a, b = tmp_path / "a", tmp_path / "b"
    base = TRAIN + ["--nproc", "4", "--dp", "2", "--tp", "2", "--steps", "20", "--ckpt-every", "10",
                    "--dtype", "float64"]
    assert run_cli(base + ["--ckpt-dir", str(a)])[0] == 0
    shutil.copytree(a, b)
    shutil.rmtree(b / "step_0000020")
    (b / "latest").write_text("step_0000010")
    code, out, err = run_cli(base + ["--ckpt-dir", str(b), "--resume"])
    assert code == 0, err
    for r in range(4):
        pa = torch.load(a / "step_0000020" / f"rank_{r:05d}.pt", weights_only=True)
        pb = torch.load(b / "step_0000020" / f"rank_{r:05d}.pt", weights_only=True)
        for k in pa:
            assert torch.equal(pa[k]["param"], pb[k]["param"]), k
