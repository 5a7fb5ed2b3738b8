"""Bad input, across the commands: each case exits non-zero with one line naming the
problem and the fix, no traceback, and (where the input is knowable then) before any
rank starts — these run the command in-process, so a case that got as far as starting
ranks would show up as a slow test, and one that trained would change no exit code.

Also the silently-wrong cases: token ids past --vocab under --tp, --resume into another
model, outputs that overwrite an input, a non-finite loss,
a validation loss compared with itself.
"""
import json
import os
import shutil

import numpy as np
import pytest
import torch

from minitron.tools.cli import main
from minitron.tools.commands.train import validation_summary
from minitron.tools.testing import reseal, run_cli

TRAIN = ["train", "--global-batch", "4", "--no-progress", "--sample", "0", "--eval-every", "0"]
TEXT = "To be, or not to be, that is the question.\n" * 300


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Inputs the cases refer to as {name}: a text, a token file with ids past its
    declared vocabulary, a folder, a plain file, and a checkpoint of the tiny model."""
    d = tmp_path_factory.mktemp("bad_input")
    (d / "text.txt").write_text(TEXT)
    ids = np.arange(20000, dtype=np.uint16) % 400  # ids up to 399 ...
    ids.tofile(d / "tokens.bin")
    (d / "tokens.json").write_text(json.dumps({"dtype": "uint16", "vocab": 300}))  # ... declared 300
    (d / "a_folder").mkdir()
    (d / "a_file").write_text("x")
    (d / "corrupt.gz").write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(256)) * 4)
    ckpt = d / "ckpt"
    assert main(TRAIN + ["--steps", "2", "--ckpt-dir", str(ckpt)]) == 0
    empty = d / "empty_ckpt"
    empty.mkdir()
    broken = d / "broken_meta"
    shutil.copytree(ckpt, broken)
    meta = broken / "step_0000002" / "meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "world": "two"}))
    shards = d / "broken_shards"
    shutil.copytree(ckpt, shards)
    torch.save([1, 2, 3], shards / "step_0000002" / "rank_00000.pt")
    reseal(shards / "step_0000002")  # crafted with a valid checksum: the structure check must catch it
    return {k: str(v) for k, v in dict(dir=d, text=d / "text.txt", tokens=d / "tokens.bin",
                                       folder=d / "a_folder", file=d / "a_file", gz=d / "corrupt.gz",
                                       ckpt=ckpt, empty=empty, broken_meta=broken, broken_shards=shards).items()}


CASES = [
    # --- train: numbers that did nothing or something else, and exited 0 ---
    (TRAIN + ["--stop-at", "-1"], "--stop-at must be 0 (off) or a positive"),
    (TRAIN + ["--ckpt-every", "-5", "--ckpt-dir", "{dir}/c1"], "--ckpt-every must be 0"),
    (TRAIN + ["--eval-every", "-1"], "--eval-every must be 0"),
    (TRAIN + ["--sample", "-3"], "--sample must be 0"),
    (TRAIN + ["--keep-last", "-1", "--ckpt-dir", "{dir}/c2"], "--keep-last must be 0"),
    (TRAIN + ["--stop-at", "50", "--steps", "10"], "--stop-at 50 is past --steps 10"),
    (TRAIN + ["--ckpt-every", "5"], "need --ckpt-dir"),
    (TRAIN + ["--keep-last", "2"], "need --ckpt-dir"),
    (TRAIN + ["--lr", "inf"], "--lr must be a positive finite number"),
    (TRAIN + ["--lr", "nan"], "--lr must be a positive finite number"),
    (TRAIN + ["--lr", "-1"], "--lr must be a positive finite number"),
    (TRAIN + ["--log-every", "0"], "--log-every must be at least 1"),
    (TRAIN + ["--steps", "0"], "--steps must be a positive"),
    (TRAIN + ["--global-batch", "0"], "--global-batch must be at least 1"),
    (TRAIN + ["--microbatches", "0"], "--microbatches must be at least 1"),
    (TRAIN + ["--global-batch", "5", "--dp", "2", "--nproc", "2"], "not divisible by dp*microbatches"),
    (TRAIN + ["--seed", "-1"], "--seed must be in 0.."),
    (TRAIN + ["--seed", str(2**40)], "--seed must be in 0.."),
    # --- model ---
    (TRAIN + ["--ffn", "-8"], "--ffn must be positive, or 0"),
    (TRAIN + ["--vocab", str(2**40)], "too large"),
    (TRAIN + ["--vocab", "0"], "--vocab must be positive"),
    (TRAIN + ["--layers", "0"], "--layers must be positive"),
    (TRAIN + ["--heads", "0"], "--heads must be positive"),
    (TRAIN + ["--seq-len", "-4"], "--seq-len must be positive"),
    (TRAIN + ["--hidden", "30"], "not divisible by 4 heads"),
    (TRAIN + ["--dropout", "1.5"], "dropout must be in [0, 1)"),
    (TRAIN + ["--model", "gpt5"], "unknown model preset 'gpt5'"),
    (TRAIN + ["--model", "gpt3-175b"], "but it has"),  # memory estimate before building it
    # --- layout ---
    (TRAIN + ["--nproc", "3", "--dp", "2"], "world size 3 != dp*tp*pp"),
    (TRAIN + ["--dp", "0"], "--dp must be at least 1"),
    (TRAIN + ["--tp-mode", "4d"], "unknown --tp-mode '4d'"),
    (TRAIN + ["--schedule", "zigzag", "--pp", "2", "--nproc", "2"], "unknown schedule"),
    (TRAIN + ["--recompute", "most"], "unknown --recompute 'most'"),
    (TRAIN + ["--precision", "fp4"], "unknown --precision 'fp4'"),
    (TRAIN + ["--precision", "fp8", "--fp8-recipe", "blockwise"], "unknown --fp8-recipe 'blockwise'"),
    (TRAIN + ["--dtype", "float16"], "unknown --dtype 'float16'"),
    (TRAIN + ["--sp"], "--sp needs tensor parallelism"),
    (TRAIN + ["--stage-layers", "a,b", "--pp", "2", "--nproc", "2"], "--stage-layers 'a,b' must be"),
    (TRAIN + ["--stage-layers", "1,1"], "--stage-layers needs pipeline parallelism"),
    (TRAIN + ["--bucket-mb", "inf"], "--bucket-mb must be a positive finite number"),
    (TRAIN + ["--bucket-mb", "0"], "--bucket-mb must be a positive finite number"),
    (TRAIN + ["--timeout", "0"], "--timeout must be a positive finite number"),
    (TRAIN + ["--timeout", "nan"], "--timeout must be a positive finite number"),
    (TRAIN + ["--timeout", "-1"], "--timeout must be a positive finite number"),
    (TRAIN + ["--timeout", "inf"], "--timeout must be a positive finite number"),
    # --- data ---
    (TRAIN + ["--data", "/no/such/file.txt"], "does not exist"),
    (TRAIN + ["--data", "{gz}"], "cannot be read (error: Error -3"),
    (TRAIN + ["--data", "{tokens}", "--vocab", "300", "--tp", "2", "--nproc", "2"], "holds token id 399"),
    (TRAIN + ["--data", "{tokens}", "--vocab", "200"], "smaller than the corpus' 300"),
    # --- output paths: checked before training, never an input ---
    (TRAIN + ["--data", "{text}", "--seq-len", "200"], "the held-out tenth of the corpus (for evaluation) has only"),
    (["sweep", "--layouts", "dp3", "--base-batch", "4", "--series", "strong"], "the series' global batch 4 (--base-batch 4)"),
    (TRAIN + ["--data", "{text}", "--metrics", "{text}"], "is an input of this run"),
    (TRAIN + ["--data", "{text}", "--trace", "{text}"], "is an input of this run"),
    (TRAIN + ["--data", "{tokens}", "--vocab", "400", "--metrics", "{dir}/tokens.json"], "is an input of this run"),
    (TRAIN + ["--metrics", "{dir}/m.jsonl", "--trace", "{dir}/m.jsonl"], "name the same file"),
    (TRAIN + ["--metrics", "{folder}"], "is a folder"),
    (TRAIN + ["--metrics", "{file}/m.jsonl"], "cannot write into"),
    (TRAIN + ["--ckpt-dir", "{file}"], "is a file: name a folder"),
    (TRAIN + ["--tensorboard", "{file}"], "is a file: name a folder"),
    (TRAIN + ["--ckpt-dir", "{file}/ck"], "cannot write into"),
    (TRAIN + ["--ckpt-dir", "{ckpt}"], "already holds checkpoints"),
    (TRAIN + ["--data", "{dir}/text.txt", "--ckpt-dir", "{dir}"], "holds the training data"),
    # --- resume ---
    (TRAIN + ["--resume"], "--resume needs --ckpt-dir"),
    (TRAIN + ["--resume", "--ckpt-dir", "{empty}"], "no checkpoint in --ckpt-dir"),
    (TRAIN + ["--resume", "--ckpt-dir", "{ckpt}", "--steps", "2"], "already at --steps 2"),
    (TRAIN + ["--resume", "--ckpt-dir", "{ckpt}", "--steps", "9", "--stop-at", "1"], "already at --stop-at 1"),
    (TRAIN + ["--resume", "--ckpt-dir", "{ckpt}", "--layers", "3"], "holds another model (layers 2 -> 3): use its model flags (--layers 2)"),
    (TRAIN + ["--resume", "--ckpt-dir", "{ckpt}", "--heads", "2"], "holds another model (heads 4 -> 2, kv_heads 4 -> 2)"),
    (TRAIN + ["--resume", "--ckpt-dir", "{ckpt}", "--tied"], "tied_embeddings False -> True): use its model flags (no --tied)"),
    (TRAIN + ["--resume", "--ckpt-dir", "{broken_meta}"], "lacks a valid step, world or model"),
    (TRAIN + ["--resume", "--ckpt-dir", "{broken_shards}"], "does not hold valid minitron shards"),
    # --- the machine ---
    (TRAIN + ["--backend", "nccl", "--nproc", "2", "--dp", "2"], "needs a CUDA GPU"),
    (TRAIN + ["--device", "cuda"], "needs a CUDA GPU"),
    # --- verify ---
    (["verify", "--tol", "0"], "--tol must be a positive finite number"),
    (["verify", "--tol", "-1"], "--tol must be a positive finite number"),
    (["verify", "--tol", "nan"], "--tol must be a positive finite number"),
    (["verify", "--tol", "inf"], "--tol must be a positive finite number"),
    (["verify", "--nproc", "3", "--dp", "2"], "world size 3"),
    (["verify", "--trace", "{folder}"], "is a folder"),
    (["verify", "--steps", "0"], "--steps must be a positive"),
    # --- plan ---
    (["plan", "--model", "gpt3-175b", "--gpus", "64", "--global-batch", "64", "--pp", "1", "--vpp", "2"],
     "--vpp 2 interleaves pipeline stages"),
    (["plan", "--model", "gpt3-175b", "--gpus", "64", "--global-batch", "64", "--top", "-1"],
     "--top must be at least 1"),
    (["plan", "--model", "gpt3-175b", "--gpus", "0", "--global-batch", "64"], "--gpus must be at least 1"),
    (["plan", "--model", "gpt3-175b", "--gpus", "64", "--global-batch", "-2"], "--global-batch must be at least 1"),
    (["plan", "--model", "gpt3-175b", "--gpus", "64", "--global-batch", "64", "--tp", "-2"], "--tp must be at least 0"),
    # --- bench ---
    (["bench", "--bench-steps", "0"], "--bench-steps must be at least 1"),
    (["bench", "--threads", "-2"], "--threads at least 0"),
    (["bench", "--warmup-steps", "-1"], "--warmup-steps and --threads at least 0"),
    (["bench", "--bucket-mb", "-1"], "--bucket-mb must be a positive finite number"),
    # --- schedule ---
    (["schedule", "--pp", "64", "--microbatches", "20000"], "more than the 10000 simulated here"),
    (["schedule", "--pp", "0"], "--pp must be at least 1"),
    (["schedule", "--microbatches", "-1"], "--microbatches must be at least 1"),
    (["schedule", "--plot", "{dir}/s.gif"], "unknown file type '.gif'"),
    (["schedule", "--plot", "{folder}"], "is a folder"),
    # --- memory ---
    (["memory", "--tp", "3", "--nproc", "3"], "not divisible by --tp 3"),
    (["memory", "--model", "nano"], "unknown model preset"),
    # --- tokenize ---
    (["tokenize", "--data", "{text}", "--out", "{dir}/out.txt"], "unknown file type '.txt'"),
    (["tokenize", "--data", "{dir}/in.bin", "--out", "{dir}/in.bin"], "is an input of this run"),
    (["tokenize", "--data", "{text}", "--out", "{file}/x.bin"], "cannot write into"),
    # --- work that would not end, native aborts ---
    (["bench", "--bench-steps", "100000"], "--bench-steps 100000 is more than the 1000"),
    (["bench", "--warmup-steps", "5000"], "--warmup-steps 5000 is more than the 1000"),
    (["sample", "--ckpt-dir", "{ckpt}", "--tokens", "10000000"], "more than the 100,000 sampled here"),
    (["sample", "--ckpt-dir", "{ckpt}", "--temperature", "nan"], "--temperature must be a positive finite"),
    (["sample", "--ckpt-dir", "{ckpt}", "--temperature", "inf"], "--temperature must be a positive finite"),
    (["tokenize", "--data", "{text}", "--out", "{dir}/v.bin", "--vocab", str(2**32)], "more than the 4,194,304"),
    (["tokenize", "--data", "{text}", "--out", "{dir}/v.bin", "--vocab", str(2**60)], "more than the 4,194,304"),
    # --- outputs checked before minutes of measuring ---
    (["sweep", "--out", "/proc/sweep.jsonl", "--layouts", "dp1"], "--out /proc/sweep.jsonl: cannot write into /proc"),
    (["sweep", "--measure-machine", "/proc/m.json"], "--measure-machine /proc/m.json: cannot write into /proc"),
    (["sweep", "--out", "{text}", "--data", "{text}", "--layouts", "dp1"], "is an input of this run"),
    # --- checkpoints as inputs and outputs ---
    (["check-ckpt", "{dir}/no_such_ckpt"], "does not exist"),
    (["check-ckpt", "{folder}"], "holds no checkpoint"),
    (["export", "--ckpt-dir", "{ckpt}", "--hf", "{ckpt}/latest"], "is a file: name a folder"),
    (["export", "--ckpt-dir", "{ckpt}", "--hf", "{dir}"], "already holds other files"),
    (TRAIN + ["--metrics", "{ckpt}/latest"], "inside the checkpoint folder"),
    (TRAIN + ["--trace", "{ckpt}/step_0000002/meta.json"], "inside the checkpoint folder"),
    (TRAIN + ["--resume", "--ckpt-dir", "{ckpt}", "--steps", "4", "--seed", "5"], "--seed 5 (the checkpoint's is 1234)"),
    (TRAIN + ["--resume", "--ckpt-dir", "{ckpt}", "--steps", "4", "--global-batch", "8"], "--allow-resume-change"),
    # --- the whole model description on --resume ---
    (TRAIN + ["--resume", "--ckpt-dir", "{ckpt}", "--steps", "4", "--positions", "rope"], "positions learned -> rope"),
    (TRAIN + ["--resume", "--ckpt-dir", "{ckpt}", "--steps", "4", "--norm-eps", "1e-6"], "norm_eps 1e-05 -> 1e-06"),
    (TRAIN + ["--resume", "--ckpt-dir", "{ckpt}", "--steps", "4", "--experts", "4", "--norm", "rmsnorm"],
     "--allow-model-change norm,experts"),
    (TRAIN + ["--resume", "--ckpt-dir", "{ckpt}", "--steps", "4", "--allow-model-change", "rope-base"],
     "has the same rope_base"),
    (TRAIN + ["--resume", "--ckpt-dir", "{ckpt}", "--steps", "4", "--allow-model-change", "colour"],
     "no model field colour"),
    (TRAIN + ["--allow-model-change", "norm"], "changes the model a --resume continues: add --resume"),
]


def _fill(argv, files):
    return [a.format(**files) for a in argv]


@pytest.mark.parametrize("argv,words", CASES, ids=[f"{i:02d}-{a[0]}-{w[:40]}" for i, (a, w) in enumerate(CASES)])
def test_one_line_refusal(capsys, files, argv, words):
    if "--backend" in argv or "--device" in argv:
        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
    code = main(_fill(argv, files))
    err = capsys.readouterr().err.strip()
    assert code not in (0, None), err
    assert err.startswith("minitron: error:") and "\n" not in err and "Traceback" not in err, err
    assert words in err, err


def test_at_least_sixty_cases():
    assert len(CASES) >= 60


def test_overwrite_and_resume_auto_and_keep_last(tmp_path, capsys):
    """The ways through a folder with checkpoints: --overwrite starts again, --resume auto
    starts when there is none and continues when there is, --keep-last prunes."""
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    base = TRAIN + ["--ckpt-dir", str(ck), "--ckpt-every", "1", "--metrics", str(m)]
    assert main(base + ["--steps", "3", "--resume", "auto", "--keep-last", "2"]) == 0  # none yet: starts
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_0000002", "step_0000003"]
    (ck / "step_0000009.tmp").mkdir()  # a save killed half-way
    assert main(base + ["--steps", "5", "--resume", "auto", "--keep-last", "2"]) == 0
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_0000004", "step_0000005"]
    assert [json.loads(x)["step"] for x in m.read_text().splitlines()] == [1, 2, 3, 4, 5]
    assert main(base + ["--steps", "2", "--overwrite"]) == 0
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_0000001", "step_0000002"]
    assert "resumed from" in capsys.readouterr().out


def test_no_duplicate_metrics_after_resume(tmp_path):
    """A run stopped between checkpoints wrote metrics past its last checkpoint; resuming
    trains those steps again and the file holds each step once."""
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    base = TRAIN + ["--ckpt-dir", str(ck), "--ckpt-every", "2", "--metrics", str(m)]
    assert main(base + ["--steps", "4"]) == 0
    (ck / "latest").write_text("step_0000002")  # as if killed after step 4's metrics, before its save
    shutil.rmtree(ck / "step_0000004")
    assert main(base + ["--steps", "6", "--resume"]) == 0
    assert [json.loads(x)["step"] for x in m.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]


def test_nonfinite_loss_names_the_step(capsys):
    assert main(TRAIN + ["--steps", "6", "--lr", "1e30"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "the loss is nan at step 2" in err and "lower --lr" in err, err


def test_one_validation_is_not_compared_with_itself(capsys):
    """--eval-every 0 evaluates once, before the first step: the command reports that loss,
    not "X -> X (0% lower)"; with two evaluations, the change (or a rise) between them."""
    assert main(TRAIN + ["--steps", "2", "--no-report"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("validation loss")]
    assert len(lines) == 1 and "->" not in lines[0] and "at step 0 (the only evaluation" in lines[0], lines
    assert validation_summary({0: 5.5, 10: 2.75, 5: 3.0}) == \
        "validation loss 5.500 (step 0) -> 2.750 (step 10): 50.0% lower"
    assert validation_summary({0: 2.0, 4: 3.0}).endswith("50.0% higher")


def test_launcher_environment(capsys, monkeypatch):
    """A torchrun-like environment without MASTER_ADDR, and a Slurm batch script that is
    not an srun task, are refused at once instead of waiting for peers that never come."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert main(TRAIN + ["--steps", "1", "--nproc", "2", "--dp", "2"]) == 2
    assert "MASTER_ADDR" in capsys.readouterr().err
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    assert main(TRAIN + ["--steps", "1", "--nproc", "2", "--dp", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a task started by srun" in err and "\n" not in err, err


@pytest.mark.parametrize("env,words", [
    ({"RANK": "5", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}, "RANK=5 is outside WORLD_SIZE=2"),
    ({"RANK": "-1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}, "RANK=-1 is outside"),
    ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK='one' is not a number"),
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}, "SLURM_PROCID=3 is outside SLURM_NTASKS=2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
      "MASTER_PORT": "29999"}, "LOCAL_RANK=4 is outside LOCAL_WORLD_SIZE=2"),
])
def test_launcher_numbers_outside_the_world(capsys, monkeypatch, env, words):
    """A launcher environment whose rank lies outside its world (or is no number) is one line
    at once, not C++ stack frames from the rendezvous after 24 s."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
              "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(TRAIN + ["--steps", "1", "--nproc", "2", "--dp", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err, err


@pytest.mark.multirank
def test_errors_inside_ranks_are_one_line(tmp_path):
    """A cause that only shows inside the ranks (the loss diverges on 2 tensor ranks)
    reaches the user as one line, not a launcher traceback."""
    code, out, err = run_cli(TRAIN + ["--steps", "6", "--lr", "1e30", "--nproc", "2", "--tp", "2"], timeout=300)
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("W1", "I1"))]
    assert code == 2 and lines == [lines[-1]] and "the loss is nan at step 2" in lines[-1], err
    assert "Traceback" not in err
