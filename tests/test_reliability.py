"""Nothing lost, nothing silently wrong, nothing hangs: each class of fault planted several
ways, in-process (one rank) unless a second process is the point.

* a damaged or forged checkpoint is refused in one line (checksums, structure, finite
  values, `latest` inside its folder), by resume, sample, export and `minitron check-ckpt`;
* a resume names every setting that differs from the checkpoint's and refuses those that
  break its equality with an uninterrupted run unless --allow-resume-change, the data
  position (meta.json's "data": what every later step's sampler reads) compared whole;
* no output flag can name an input or anything inside a checkpoint folder; --overwrite
  deletes only the engine's own folders; export refuses a folder of another model;
* a non-finite model is never published (the message names --lr), a save the disk refuses
  leaves no step_N.tmp and names the rank and the space;
* a checkpoint folder is locked while a run writes it; a lock left by a killed run is named;
* a requeued job whose work is done exits 0; a FIFO as --data is refused at once.
"""
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from minitron.checkpoint import FolderLock, lock_holder
from minitron.config import PRESETS, ParallelConfig, TrainConfig
from minitron.tools.cli import main
from minitron.tools.resume_checks import check_resume
from minitron.tools.testing import reseal

TRAIN = ["train", "--global-batch", "4", "--no-progress", "--sample", "0", "--eval-every", "0", "--no-report"]
TEXT = "To be, or not to be, that is the question.\n" * 300


def refused(capsys, argv, *words, code=2):
    """The command exits with `code`, one line on stderr holding every one of `words`."""
    got = main([str(a) for a in argv])
    err = "\n".join(ln for ln in capsys.readouterr().err.strip().splitlines()
                    if not ln.startswith("minitron: note:"))  # e.g. a resume that goes further: --steps
    assert got == code, err
    assert err.startswith("minitron: error:") and "\n" not in err and "Traceback" not in err, err
    for w in words:
        assert w in err, err
    return err


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A checkpoint folder of the tiny model at steps 1 and 2 (float64), and a text."""
    d = tmp_path_factory.mktemp("reliability")
    (d / "text.txt").write_text(TEXT)
    assert main(TRAIN + ["--steps", "2", "--ckpt-dir", str(d / "ck"), "--ckpt-every", "1", "--dtype", "float64"]) == 0
    return d


def damaged(run, tmp_path, how):
    """A copy of the run's checkpoint folder with step 2 damaged by `how(step_dir)`."""
    ck = tmp_path / "ck"
    shutil.copytree(run / "ck", ck)
    how(ck / "step_0000002")
    return ck


def _edit_shards(fn, seal=True):
    def how(step):
        f = step / "rank_00000.pt"
        shards = torch.load(f, weights_only=True)
        fn(shards)
        torch.save(shards, f)
        if seal:
            reseal(step)
    return how


def _flip_bytes(step):
    """Flip bytes in the middle of the tensor data (the zip archive stays readable)."""
    f = step / "rank_00000.pt"
    data = bytearray(f.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 8):
        data[i] ^= 0xFF
    f.write_bytes(bytes(data))


def _first(shards):
    return shards[sorted(shards)[0]]


def _edit_data(**fields):
    def how(step):
        meta = json.loads((step / "meta.json").read_text())
        meta["data"].update(fields)
        (step / "meta.json").write_text(json.dumps(meta))
    return how


DAMAGES = {
    "flipped bytes": (_flip_bytes, "does not match its checksum"),
    "shard replaced by another run's": (lambda s: shutil.copy(s.parent / "step_0000001" / "rank_00000.pt",
                                                               s / "rank_00000.pt"), "does not match its checksum"),
    "meta without checksums": (lambda s: (s / "meta.json").write_text(json.dumps(
        {k: v for k, v in json.loads((s / "meta.json").read_text()).items() if k != "files"})), "has no checksums"),
    "exp_avg_sq removed": (_edit_shards(lambda sh: _first(sh).pop("exp_avg_sq")), "lacks optimizer state"),
    "all optimizer state removed": (_edit_shards(lambda sh: [r.pop(k) for r in sh.values()
                                                             for k in ("exp_avg", "exp_avg_sq", "step")]),
                                    "lacks optimizer state"),
    "a NaN parameter": (_edit_shards(lambda sh: _first(sh)["param"].view(-1)[0].fill_(float("nan"))),
                        "non-finite values"),
    "a huge full shape": (_edit_shards(lambda sh: _first(sh).update(full_shape=[2**22, 2**22],
                                                                     region=[[0, 2**22], [0, 2**22]])),
                          "is not a tensor of shape"),
    "a huge shape, a small region": (_edit_shards(lambda sh: _first(sh).update(
        full_shape=[2**22] * len(_first(sh)["full_shape"]))), "is missing shards of"),
    "a region outside its shape": (_edit_shards(lambda sh: _first(sh).update(
        region=[[1, d + 1] for d in _first(sh)["full_shape"]])), "region outside its shape"),
    "a record dropped": (_edit_shards(lambda sh: sh.pop(sorted(sh)[0])), "does not match the model"),
    "a data position off its step": (_edit_data(step=1), "states a data position that is not its step 2's"),
}


@pytest.mark.parametrize("name", list(DAMAGES))
def test_damaged_checkpoint_is_refused_everywhere(run, tmp_path, capsys, name):
    how, words = DAMAGES[name]
    ck = damaged(run, tmp_path, how)
    refused(capsys, TRAIN + ["--steps", "4", "--ckpt-dir", ck, "--resume", "--dtype", "float64"], words)
    refused(capsys, ["sample", "--ckpt-dir", ck, "--tokens", "2"], words)
    refused(capsys, ["export", "--ckpt-dir", ck, "--hf", tmp_path / "hf"], words)
    if name == "a record dropped":  # whole in itself: the model it must fit tells the difference
        return
    assert main(["check-ckpt", str(ck)]) == 1
    out = capsys.readouterr().out
    assert "ok  step_0000001" in out and "BAD step_0000002" in out and words in out, out


def test_check_ckpt_on_sound_folders(run, capsys):
    assert main(["check-ckpt", str(run / "ck")]) == 0
    out = capsys.readouterr().out
    assert "2 of 2 checkpoint(s) sound" in out and "<- latest" in out, out
    assert main(["check-ckpt", str(run / "ck" / "step_0000001"), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["ok"] and res["checkpoints"][0]["step"] == 1
    refused(capsys, ["check-ckpt", str(run / "nothing")], "does not exist")
    refused(capsys, ["check-ckpt", str(run)], "holds no checkpoint")


@pytest.mark.parametrize("pointer", ["../elsewhere/step_0000002", "/etc", "step_0000002/../../ck2",
                                     "meta.json", "", "step_0000002 extra"])
def test_latest_stays_inside_its_folder(run, tmp_path, capsys, pointer):
    ck = damaged(run, tmp_path, lambda s: None)
    (ck / "latest").write_text(pointer)
    refused(capsys, TRAIN + ["--steps", "4", "--ckpt-dir", ck, "--resume", "--dtype", "float64"],
            "not a step folder inside")
    refused(capsys, ["sample", "--ckpt-dir", ck, "--tokens", "2"], "not a step folder inside")


def test_latest_through_a_link_outside_is_refused(run, tmp_path, capsys):
    ck = damaged(run, tmp_path, lambda s: None)
    outside = tmp_path / "outside"
    shutil.move(ck / "step_0000002", outside)
    (ck / "step_0000002").symlink_to(outside)
    refused(capsys, TRAIN + ["--steps", "4", "--ckpt-dir", ck, "--resume", "--dtype", "float64"],
            "not a step folder inside")


@pytest.mark.parametrize("flags,named", [
    (["--seed", "7"], "--seed 7 (the checkpoint's is 1234)"),
    (["--global-batch", "8"], "--global-batch 8 (the checkpoint's is 4)"),
    (["--lr", "0.01"], "--lr 0.01 (the checkpoint's is 0.003)"),
    (["--dtype", "float32"], "--dtype float32 (the checkpoint's is float64)"),
    (["--data", "{text}"], "--data {text}"),
])
def test_resume_refuses_settings_that_break_exactness(run, tmp_path, capsys, flags, named):
    ck = damaged(run, tmp_path, lambda s: None)
    flags = [f.format(text=run / "text.txt") for f in flags]
    named = named.format(text=run / "text.txt")
    base = TRAIN + ["--steps", "3", "--ckpt-dir", ck, "--resume", "--dtype", "float64"]
    refused(capsys, base + flags, named, "--allow-resume-change")
    assert main([str(a) for a in base + flags + ["--allow-resume-change"]]) == 0
    err = capsys.readouterr().err
    assert f"minitron: note: resuming with {named}" in err, err


def test_resume_notes_the_harmless_changes(run, tmp_path, capsys):
    ck = damaged(run, tmp_path, lambda s: None)
    assert main([str(a) for a in TRAIN + ["--steps", "3", "--ckpt-dir", ck, "--resume", "--dtype", "float64",
                                          "--microbatches", "2"]]) == 0
    err = capsys.readouterr().err
    assert "note: resuming with --steps 3 (the checkpoint's is 2)" in err
    assert "note: resuming with --microbatches 2 (the checkpoint's is 1)" in err, err
    lines = []  # another layout (no ranks started here: the check alone)
    step = check_resume(str(run / "ck"), "yes", PRESETS["tiny"], TrainConfig(steps=3, global_batch=4, dtype="float64"),
                        log=lines.append, layout=ParallelConfig(tp=2, dp=2))
    assert step == 2 and lines == ["minitron: note: resuming with --steps 3 (the checkpoint's is 2)",
                                   "minitron: note: resuming with the layout dp2.tp2.pp1 (the checkpoint's is "
                                   "dp1.tp1.pp1; checkpoints are layout-independent)"], lines


def test_the_checkpoint_states_its_data_position_and_resume_compares_it_whole(run, tmp_path):
    """meta.json's "data" is ``data.position`` at its step (the sampler's every input); a resume
    whose sampler would read otherwise (--pack on a checkpoint of windows, another padding of
    --pack-balance document) is refused, naming it (a position edited off its step: DAMAGES)."""
    from minitron.config import ConfigError
    from minitron.data import load_corpus, position

    meta = json.loads((run / "ck" / "step_0000002" / "meta.json").read_text())
    train = TrainConfig(steps=2, global_batch=4, dtype="float64")
    assert meta["data"] == position(train, PRESETS["tiny"].seq_len, len(load_corpus("").split()[0]), 2)
    with pytest.raises(ConfigError, match=r"--pack documents \(the checkpoint's is windows\).*--allow-resume-change"):
        check_resume(str(run / "ck"), "yes", PRESETS["tiny"], train.replace(steps=3, pack=True))
    # --pack-balance document pads documents to 2*cp: a resume at another cp would read other rows
    ck = damaged(run, tmp_path, _edit_data(sampler="documents", pack_pad=4))
    with pytest.raises(ConfigError, match=r"--pack-balance document's padding 8 \(the checkpoint's is 4\)"):
        check_resume(str(ck), "yes", PRESETS["tiny"], train.replace(steps=3, pack=True, pack_balance="document",
                                                                   pack_pad=8))
    assert check_resume(str(ck), "yes", PRESETS["tiny"], train.replace(steps=3, pack=True, pack_balance="document",
                                                                      pack_pad=4)) == 2


def test_requeued_job_whose_work_is_done_exits_0(run, tmp_path, capsys):
    ck = damaged(run, tmp_path, lambda s: None)
    assert main([str(a) for a in TRAIN + ["--steps", "2", "--ckpt-dir", ck, "--resume", "auto",
                                          "--dtype", "float64"]]) == 0
    err = capsys.readouterr().err.strip()
    assert "nothing left to train (exit code 0)" in err and "already reached --steps 2" in err, err
    refused(capsys, TRAIN + ["--steps", "2", "--ckpt-dir", ck, "--resume", "--dtype", "float64"], "already at --steps 2")


# --- outputs ------------------------------------------------------------------------------
OUTPUTS = [
    (["--metrics", "{ck}/latest"], "--metrics"),
    (["--trace", "{ck}/step_0000002/rank_00000.pt"], "--trace"),
    (["--metrics", "{ck}/step_0000001/meta.json"], "--metrics"),
    (["--metrics", "{ck}/notes.jsonl"], "--metrics"),
    (["--metrics", "{new}/m.jsonl", "--ckpt-dir", "{new}"], "--metrics"),  # this run's own (new) folder
    (["--tensorboard", "{ck}"], "--tensorboard"),
    (["--tensorboard", "{ck}/tb"], "--tensorboard"),
    (["--ckpt-dir", "{ck}/step_0000002/inner"], "--ckpt-dir"),
    (["--metrics", "{d}/m.jsonl", "--data", "{d}/m.loss.png"], "--metrics' loss figure"),
]


@pytest.mark.parametrize("flags,flag", OUTPUTS)
def test_outputs_never_touch_a_checkpoint_or_an_input(run, tmp_path, capsys, flags, flag):
    ck = damaged(run, tmp_path, lambda s: None)
    (tmp_path / "m.loss.png").write_text(TEXT)
    before = {p: p.read_bytes() for p in ck.rglob("*") if p.is_file()}
    argv = TRAIN + ["--steps", "1"] + [f.format(ck=ck, new=tmp_path / "new", d=tmp_path) for f in flags]
    err = refused(capsys, argv, flag)
    assert "checkpoint folder" in err or "input of this run" in err, err
    assert {p: p.read_bytes() for p in ck.rglob("*") if p.is_file()} == before


def test_other_commands_outputs(run, tmp_path, capsys):
    ck = damaged(run, tmp_path, lambda s: None)
    refused(capsys, ["verify", "--steps", "1", "--trace", ck / "latest"], "inside the checkpoint folder")
    refused(capsys, ["schedule", "--plot", ck / "step_0000001" / "s.png"], "inside the checkpoint folder")
    refused(capsys, ["tokenize", "--data", run / "text.txt", "--out", ck / "t.bin"], "inside the checkpoint folder")
    refused(capsys, ["export", "--ckpt-dir", ck, "--hf", ck], "inside the checkpoint folder")
    refused(capsys, ["export", "--ckpt-dir", ck, "--hf", ck / "step_0000002"], "inside the checkpoint folder")


def test_export_refuses_a_folder_of_another_model(run, tmp_path, capsys):
    hf = tmp_path / "gpt2"
    hf.mkdir()
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        (hf / f).write_text("{}")
    refused(capsys, ["export", "--ckpt-dir", run / "ck", "--hf", hf], "already holds other files (tokenizer.json)")
    assert (hf / "model.safetensors").read_text() == "{}"
    mine = tmp_path / "mine"
    assert main(["export", "--ckpt-dir", str(run / "ck"), "--hf", str(mine)]) == 0
    assert main(["export", "--ckpt-dir", str(run / "ck"), "--hf", str(mine)]) == 0  # its own files: replaced
    assert sorted(p.name for p in mine.iterdir()) == ["config.json", "model.safetensors"]


def test_overwrite_deletes_only_what_the_engine_wrote(run, tmp_path, capsys):
    ck = damaged(run, tmp_path, lambda s: None)
    (ck / "step_notes").mkdir()
    (ck / "step_notes" / "todo.txt").write_text("mine")
    (ck / "steps.txt").write_text("mine")
    assert main([str(a) for a in TRAIN + ["--steps", "1", "--ckpt-dir", ck, "--overwrite"]]) == 0
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_0000001", "step_notes", "steps.txt"]
    (ck / "step_0000005").mkdir()
    (ck / "step_0000005" / "results.csv").write_text("mine")
    refused(capsys, TRAIN + ["--steps", "1", "--ckpt-dir", ck, "--overwrite"], "is not a checkpoint minitron wrote",
            "nothing was deleted")
    assert (ck / "step_0000001" / "meta.json").exists() and (ck / "step_0000005" / "results.csv").exists()


# --- non-finite models, full disks ------------------------------------------------------------
@pytest.mark.parametrize("lr", ["1e39", "1e300"])
def test_a_nonfinite_model_is_never_published(tmp_path, capsys, lr):
    """An --lr finite in float64 but past float32's range (1e39), or one that overflows the
    update (1e300): the parameters are NaN after step 1, whose loss was finite."""
    ck = tmp_path / "ck"
    assert main(TRAIN + ["--steps", "2", "--ckpt-dir", str(ck), "--ckpt-every", "1"]) == 0
    err = refused(capsys, TRAIN + ["--steps", "4", "--ckpt-dir", ck, "--ckpt-every", "1", "--resume",
                                   "--lr", lr, "--allow-resume-change"],
                  "not finite after step 3", "lower --lr", f"the last checkpoint, {ck}/step_0000002")
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_0000001", "step_0000002"], err
    assert (ck / "latest").read_text() == "step_0000002"
    assert main(["check-ckpt", str(ck)]) == 0


def test_a_file_size_limit_is_named_as_the_machines(run, tmp_path):
    """A file-size limit (RLIMIT_FSIZE, `ulimit -f`) smaller than a shard: the save fails with
    EFBIG (Python ignores SIGXFSZ); one line names the limit and how to raise it (not a full
    disk: the disk has room), no step_N.tmp is left, `latest` still names a sound checkpoint."""
    ck, limit = Path(damaged(run, tmp_path, lambda s: None)), 100_000

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    p = subprocess.run([sys.executable, "-m", "minitron", *TRAIN, "--steps", "3", "--ckpt-dir", str(ck), "--resume",
                        "--dtype", "float64"], capture_output=True, text=True, timeout=300, preexec_fn=small_files,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith("minitron: note:")]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert "rank 0 could not write its shard" in lines[0] and f"file-size limit (ulimit -f: {limit:,} bytes)" in \
        lines[0] and "ulimit -f unlimited" in lines[0] and "free some space" not in lines[0], lines[0]
    assert sorted(x.name for x in ck.iterdir()) == ["latest", "step_0000001", "step_0000002"], list(ck.iterdir())
    assert (ck / "latest").read_text() == "step_0000002" and main(["check-ckpt", str(ck)]) == 0


@pytest.mark.parametrize("limit", [4096, 300_000])
def test_the_shard_writer_names_a_file_size_limit(tmp_path, limit):
    """The shard writer itself under two limits (set in this process around the one write):
    the limit in bytes and how to raise it, no partial shard left."""
    from minitron.checkpoint import _verdict, _write_shard

    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))
    try:
        _write_shard(tmp_path, 0, {"w": {"param": torch.zeros(200_000), "full_shape": [200_000], "region": [[0, 200_000]]}})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
    kind, message = _verdict(tmp_path, 1, 3, 0.1)
    assert kind == "disk" and f"this machine's file-size limit (ulimit -f: {limit:,} bytes)" in message, message
    assert "ulimit -f unlimited" in message and not list(tmp_path.glob("*.pt*")), message


# --- the lock --------------------------------------------------------------------------------
def test_a_folder_written_by_a_run_is_locked(run, tmp_path, capsys):
    ck = damaged(run, tmp_path, lambda s: None)
    with FolderLock(str(ck)).acquire():
        assert lock_holder(str(ck)).startswith(f"pid {os.getpid()} on ")
        refused(capsys, TRAIN + ["--steps", "4", "--ckpt-dir", ck, "--resume", "--dtype", "float64"],
                "is in use by another run", f"pid {os.getpid()}")
        refused(capsys, TRAIN + ["--steps", "1", "--ckpt-dir", ck, "--overwrite"], "is in use by another run")
        assert main(["check-ckpt", str(ck)]) == 0
        assert "a run is writing this folder" in capsys.readouterr().out
    assert not (ck / "lock").exists()
    assert main([str(a) for a in TRAIN + ["--steps", "3", "--ckpt-dir", ck, "--resume", "--dtype", "float64"]]) == 0
    assert not (ck / "lock").exists()


def test_a_lock_left_by_a_killed_run_is_named_and_taken_over(run, tmp_path, capsys):
    ck = damaged(run, tmp_path, lambda s: None)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from minitron.checkpoint import FolderLock; "
                               f"FolderLock({str(ck)!r}).acquire(); print('locked', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        refused(capsys, TRAIN + ["--steps", "3", "--ckpt-dir", ck, "--resume", "--dtype", "float64"],
                f"is in use by another run (pid {holder.pid} on ")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate()
    assert lock_holder(str(ck)).startswith(f"stale: pid {holder.pid}")
    assert main(["check-ckpt", str(ck)]) == 0
    assert f"lock: stale: pid {holder.pid}" in capsys.readouterr().out
    assert main([str(a) for a in TRAIN + ["--steps", "3", "--ckpt-dir", ck, "--resume", "--dtype", "float64"]]) == 0
    err = capsys.readouterr().err
    assert f"note: {ck}/lock was left by a run that did not end cleanly (pid {holder.pid} on " in err, err
    assert not (ck / "lock").exists()


# --- work that never ends ----------------------------------------------------------------------
def test_a_fifo_as_data_is_refused_at_once(tmp_path, capsys):
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "folder" / "a.txt")
    t = time.monotonic()
    refused(capsys, TRAIN + ["--steps", "1", "--data", fifo], "not a regular file")
    refused(capsys, TRAIN + ["--steps", "1", "--data", tmp_path / "folder"], "not a regular file")
    refused(capsys, ["tokenize", "--data", fifo, "--out", tmp_path / "t.bin"], "not a regular file")
    os.mkfifo(tmp_path / "tok.bin")
    refused(capsys, TRAIN + ["--steps", "1", "--data", tmp_path / "tok.bin"], "not a regular file")
    refused(capsys, TRAIN + ["--steps", "1", "--metrics", fifo], "not a regular file")
    assert time.monotonic() - t < 60


# --- exit codes --------------------------------------------------------------------------------
def test_two_ctrl_c_exit_with_the_code_printed(tmp_path):
    """Ctrl-C stops the run at a step boundary with a checkpoint; a second Ctrl-C after the
    command printed its exit code (while the interpreter finalizes, which restores the
    default handlers) does not turn the 75 it printed into death by SIGINT."""
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "minitron", *TRAIN, "--steps", "100000", "--ckpt-dir", str(ck),
                             "--ckpt-every", "1000", "--metrics", str(m)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        end = time.monotonic() + 240
        while not (m.exists() and m.read_text().count("\n") >= 2):
            assert proc.poll() is None and time.monotonic() < end, proc.stderr.read()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        line = proc.stderr.readline()
        time.sleep(1.5)  # the command has returned: the interpreter is finalizing (seconds, here)
        proc.send_signal(signal.SIGINT)  # the second Ctrl-C
        rest = proc.stderr.read()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert line.startswith("minitron: stopped by SIGINT after step ") and line.strip().endswith("(exit code 75)"), \
        line + rest
    assert proc.returncode == 75 and not rest.strip(), (proc.returncode, rest)


# --- the whole model description ------------------------------
@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """A checkpoint folder of moe-tiny (rotary, RMSNorm, 4 experts, top-2) at step 1 (float64)."""
    d = tmp_path_factory.mktemp("moe")
    assert main(TRAIN + ["--model", "moe-tiny", "--steps", "1", "--ckpt-dir", str(d / "ck"), "--dtype", "float64"]) == 0
    return d


@pytest.mark.parametrize("flags,named,fix", [
    (["--positions", "rope"], "positions learned -> rope", "--positions learned"),
    (["--norm", "rmsnorm"], "norm layernorm -> rmsnorm", "--norm layernorm"),
    (["--no-bias"], "bias True -> False", "--bias"),
    (["--norm-eps", "1e-6"], "norm_eps 1e-05 -> 1e-06", "--norm-eps 1e-05"),
    (["--activation", "gelu_tanh"], "activation gelu -> gelu_tanh", "--activation gelu"),
    (["--kv-heads", "2"], "kv_heads 4 -> 2", "--kv-heads 4"),
    (["--ffn", "64"], "ffn 128 -> 64", "--ffn 128"),
    (["--experts", "4"], "experts 0 -> 4", "--experts 0"),  # dense -> MoE: not "--layers/--hidden/--tied?"
    (["--positions", "rope", "--norm", "rmsnorm", "--no-bias"], "norm layernorm -> rmsnorm, positions learned -> "
     "rope, bias True -> False", "--allow-model-change norm,positions,bias"),
])
def test_resume_compares_the_whole_model(run, tmp_path, capsys, flags, named, fix):
    """Every field of the description that differs is named with both values, with the flags
    that give the checkpoint's model and the flag that allows exactly those fields."""
    refused(capsys, TRAIN + ["--steps", "3", "--ckpt-dir", run / "ck", "--resume", "--dtype", "float64"] + flags,
            "holds another model", named, fix, "--allow-model-change")  # refused: the folder is left as it was


@pytest.mark.parametrize("flags,named", [
    (["--top-k", "1"], "top_k 2 -> 1"), (["--router", "sigmoid"], "router softmax -> sigmoid"),
    (["--capacity-factor", "1.25"], "capacity_factor 0.0 -> 1.25"), (["--aux-loss", "0.1"], "aux_loss 0.01 -> 0.1"),
    (["--rope-base", "500000"], "rope_base 10000.0 -> 500000.0"), (["--experts", "8"], "experts 4 -> 8"),
    (["--moe-every", "2"], "moe_every 1 -> 2"), (["--bias-update", "0.001"], "bias_update 0.0 -> 0.001"),
])
def test_resume_compares_the_experts_and_the_rotary_base(moe_run, capsys, flags, named):
    base = TRAIN + ["--model", "moe-tiny", "--steps", "3", "--ckpt-dir", moe_run / "ck", "--resume", "--dtype", "float64"]
    refused(capsys, base + flags, "holds another model", named)


def test_resume_checks_only_fields_that_act(run, moe_run):
    """Fields that change nothing are not refused: a dense model's top-k, learned positions'
    rope base, a gate normalisation that is the same for top-2, the dropout, the name."""
    lines = []
    for ck, model in ((run / "ck", PRESETS["tiny"].replace(top_k=1, router="sigmoid", rope_base=5e5, dropout=0.1,
                                                            name="renamed")),
                      (moe_run / "ck", PRESETS["moe-tiny"].replace(gate_norm="always", ffn=64))):
        assert check_resume(str(ck), "yes", model, TrainConfig(steps=3, global_batch=4, dtype="float64"),
                            log=lines.append) >= 1
    model_notes = [ln for ln in lines if "another model" in ln]
    assert model_notes == ["minitron: note: resuming with another model: dropout 0.0 -> 0.1, name tiny -> renamed"], lines


def _edit_meta(fn):
    def how(step):
        meta = json.loads((step / "meta.json").read_text())
        fn(meta["model"])
        (step / "meta.json").write_text(json.dumps(meta))
    return how


def test_an_old_checkpoint_and_a_field_this_minitron_does_not_know(run, tmp_path, capsys):
    """A record without a field (written before it existed) compares as its default and is
    named; a field unknown here (a newer minitron's) is refused, naming it."""
    ck = damaged(run, tmp_path, _edit_meta(lambda m: [m.pop(k) for k in ("gate_norm", "capacity_factor")]))
    lines = []
    check_resume(str(ck), "yes", PRESETS["tiny"], TrainConfig(steps=3, global_batch=4, dtype="float64"), log=lines.append)
    assert any("records no capacity_factor (written by an older minitron): taken as its default 0.0" in ln
               for ln in lines) and any("records no gate_norm" in ln for ln in lines), lines
    shutil.rmtree(ck)
    ck = damaged(run, tmp_path, _edit_meta(lambda m: m.update(mla_rank=64)))
    refused(capsys, TRAIN + ["--steps", "3", "--ckpt-dir", ck, "--resume", "--dtype", "float64"],
            "mla_rank 64 -> (a field this minitron does not know)")


def _params_of(step) -> dict:
    from minitron.checkpoint import load_full

    return {k: v["param"] for k, v in load_full(step).items()}


def test_an_allowed_model_change_names_what_it_drops_and_what_is_new(run, tmp_path, capsys):
    """learned -> rope: wpe.weight named as dropped, then absent from the next checkpoint;
    rope -> learned again: wpe.weight named as initialised afresh; the other tensors carried."""
    ck = damaged(run, tmp_path, lambda s: None)
    base = TRAIN + ["--ckpt-dir", ck, "--resume", "--dtype", "float64"]
    assert main([str(a) for a in base + ["--steps", "3", "--positions", "rope", "--allow-model-change", "positions",
                                         "--keep-last", "1"]]) == 0
    err = capsys.readouterr().err
    assert "resuming with another model: positions learned -> rope" in err, err
    assert "1 parameter(s) dropped (the new model has no such parameter; the next checkpoint will not hold it): " \
           "wpe.weight" in err, err
    assert "wpe.weight" not in _params_of(ck / "step_0000003")
    assert main([str(a) for a in base + ["--steps", "4", "--allow-model-change", "positions"]]) == 0
    err = capsys.readouterr().err
    assert "1 parameter(s) initialised afresh (the checkpoint has none): wpe.weight" in err, err
    assert "wpe.weight" in _params_of(ck / "step_0000004")
    refused(capsys, base + ["--steps", "5", "--allow-model-change", "norm"], "--allow-model-change norm",
            "has the same norm")
    refused(capsys, TRAIN + ["--steps", "1", "--allow-model-change", "norm"], "add --resume")
    refused(capsys, base + ["--steps", "5", "--allow-model-change", "colour"], "no model field colour")


def test_an_allowed_shape_change_initialises_the_tensors_afresh(moe_run, tmp_path, capsys):
    ck = tmp_path / "ck"
    shutil.copytree(moe_run / "ck", ck)
    assert main([str(a) for a in TRAIN + ["--model", "moe-tiny", "--ckpt-dir", ck, "--resume", "--dtype", "float64",
                                          "--steps", "2", "--experts", "8", "--allow-model-change", "experts"]]) == 0
    err = capsys.readouterr().err
    assert "resuming with another model: experts 4 -> 8" in err
    assert "initialised afresh (the checkpoint's has another shape): blocks.0.mlp.experts.fc.weight" in err, err
    assert list(_params_of(ck / "step_0000002")["blocks.0.mlp.experts.fc.weight"].shape)[0] == 8


def _split_over_ep(step, region_of=None):
    """Rewrite a one-rank MoE checkpoint as ep2 writes it: every dense tensor in both files
    (replicas), each expert tensor's experts split between them; `region_of(name, rank, lo, hi)`
    may move rank 1's experts elsewhere (taking the values of that region), checksums resealed."""
    shards = torch.load(step / "rank_00000.pt", weights_only=True)
    files = [{}, {}]
    for name, rec in shards.items():
        if ".experts." not in name:
            files[0][name], files[1][name] = rec, dict(rec)
            continue
        E = rec["full_shape"][0]
        for r in (0, 1):
            lo, hi = (region_of or (lambda n, r, lo, hi: (lo, hi)))(name, r, r * E // 2, (r + 1) * E // 2)
            part = {k: (v[lo:hi].clone() if isinstance(v, torch.Tensor) else v) for k, v in rec.items()}
            part["region"] = [[lo, hi]] + rec["region"][1:]
            files[r][name] = part
    for r in (0, 1):
        torch.save(files[r], step / f"rank_{r:05d}.pt")
    meta = json.loads((step / "meta.json").read_text())
    (step / "meta.json").write_text(json.dumps({**meta, "world": 2}))
    reseal(step)


def test_check_ckpt_and_resume_accept_an_ep2_checkpoint_that_tiles(moe_run, tmp_path):
    """An ep2-shaped checkpoint (dense tensors replicated, experts split): check-ckpt passes,
    resume accepts it and assembles the same tensors as the one-rank checkpoint."""
    sound = tmp_path / "sound"
    shutil.copytree(moe_run / "ck", sound)
    _split_over_ep(sound / "step_0000001")
    assert main(["check-ckpt", str(sound)]) == 0
    whole, split = _params_of(moe_run / "ck" / "step_0000001"), _params_of(sound / "step_0000001")
    assert sorted(whole) == sorted(split) and all(torch.equal(whole[k], split[k]) for k in whole)
    assert main([str(a) for a in TRAIN + ["--model", "moe-tiny", "--steps", "2", "--resume", "--dtype", "float64",
                                          "--ckpt-dir", sound]]) == 0


@pytest.mark.parametrize("name,region_of,words", [
    ("rank 1 duplicates rank 0's region", lambda n, r, lo, hi: (0, 2) if "fc2" in n and r == 1 else (lo, hi),
     "is missing shards of 'blocks.0.mlp.experts.fc2.weight' ("),
    ("rank 1's region shifted onto rank 0's", lambda n, r, lo, hi: (1, 3) if n.endswith("1.mlp.experts.fc.weight")
     and r == 1 else (lo, hi), "overlapping shards of 'blocks.1.mlp.experts.fc.weight' (regions [0:2, 0:128, 0:32] "
     "and [1:3, 0:128, 0:32]"),
    ("every expert tensor duplicated", lambda n, r, lo, hi: (2, 4), "is missing shards of"),
])
def test_check_ckpt_verifies_the_shards_tile_every_tensor(moe_run, tmp_path, capsys, name, region_of, words):
    """check-ckpt passes exactly what resume accepts: shards that leave a gap or overlap
    (checksums rewritten) are refused by both, naming the tensor and the regions."""
    bad = tmp_path / "bad"
    shutil.copytree(moe_run / "ck", bad)
    _split_over_ep(bad / "step_0000001", region_of)
    capsys.readouterr()
    assert main(["check-ckpt", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "BAD step_0000001" in out and words in out, out
    refused(capsys, TRAIN + ["--model", "moe-tiny", "--steps", "2", "--resume", "--dtype", "float64", "--ckpt-dir", bad],
            words)
