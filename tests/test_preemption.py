"""Faults of the processes around a run, on real gloo ranks:

* the launcher dies (SIGKILL, as the OOM killer does): every rank exits within seconds,
  no process is left and no checkpoint is written after the kill;
* the job is preempted (SIGTERM to the launcher): the ranks finish the step in progress,
  agree on the step to stop after, checkpoint it and the command exits with
  EXIT_PREEMPTED; resuming ends bitwise equal (float32, same layout) to a run that was
  never interrupted, and the metrics hold each step once;
* the signal comes while the ranks are still starting (SIGTERM to the launcher, or Ctrl-C's
  SIGINT to the whole process group): no rank trains, the command says so in one line,
  exits with EXIT_PREEMPTED and leaves no process behind.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from minitron.preemption import EXIT_PREEMPTED, SignalLog, StopOnSignal, agree_before_start
from minitron.tools.testing import run_cli

TRAIN = ["train", "--nproc", "2", "--tp", "2", "--global-batch", "4", "--no-progress", "--sample", "0",
         "--eval-every", "0"]


def _start(argv, **kw):
    return subprocess.Popen([sys.executable, "-m", "minitron", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, **kw)


def _wait_for_steps(metrics: Path, n: int, proc, timeout: float = 240) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    raise AssertionError(f"no {n} steps in {timeout} s")


def _descendants(pid: int) -> dict[int, int]:
    """Every process below `pid` (from /proc: children of children...), with its parent."""
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, frontier = {}, {pid}
    while frontier:
        frontier = {c for c, p in parent.items() if p in frontier} - set(out)
        out.update({c: parent[c] for c in frontier})
    return out


def _alive(pids) -> set[int]:
    alive = set()
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z":
                alive.add(p)
        except OSError:
            pass
    return alive


def _checkpoints(d: Path) -> list[str]:
    return sorted(p.name for p in d.glob("step_*") if not p.name.endswith(".tmp"))


@pytest.mark.multirank
def test_ranks_die_with_their_launcher(tmp_path):
    ckpt, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    proc = _start(TRAIN + ["--steps", "100000", "--ckpt-dir", str(ckpt), "--ckpt-every", "2",
                           "--metrics", str(metrics)])
    _wait_for_steps(metrics, 3, proc)
    family = _descendants(proc.pid)
    ranks = {p for p, parent in family.items() if parent != proc.pid}  # the fork server's children
    assert len(ranks) == 2, family
    proc.kill()
    proc.communicate()
    killed = time.time()
    while _alive(ranks) and time.time() < killed + 10:
        time.sleep(0.1)
    assert not _alive(ranks), f"ranks still running 10 s after the launcher's death: {_alive(ranks)}"
    while _alive(family) and time.time() < killed + 30:  # the fork server and resource tracker follow
        time.sleep(0.1)
    assert not _alive(family), f"left behind: {_alive(family)}"
    time.sleep(0.5)  # a save renamed in the very instant of the kill has landed by now
    saved, steps = _checkpoints(ckpt), len(metrics.read_text().splitlines())
    time.sleep(3)
    assert _checkpoints(ckpt) == saved and len(metrics.read_text().splitlines()) == steps


def _shards(d: Path, step: int) -> dict:
    return {r: torch.load(d / f"step_{step:07d}" / f"rank_{r:05d}.pt", weights_only=True) for r in range(2)}


@pytest.mark.multirank
def test_sigterm_checkpoints_and_resume_is_bitwise_equal(tmp_path):
    steps = 60
    a, b, mb = tmp_path / "a", tmp_path / "b", tmp_path / "b.jsonl"
    proc = _start(TRAIN + ["--steps", str(steps), "--ckpt-dir", str(b), "--ckpt-every", "1000",
                           "--metrics", str(mb)])
    _wait_for_steps(mb, 3, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    stopped = int((b / "latest").read_text().split("_")[1])
    assert 3 < stopped < steps, stopped  # the step in progress, then the agreed one
    line = [ln for ln in err.splitlines() if ln.startswith("minitron:")]
    assert line == [f"minitron: stopped by SIGTERM after step {stopped}; checkpoint {b}/step_{stopped:07d}: "
                    f"continue with --resume (exit code {EXIT_PREEMPTED})"], err[-3000:]
    assert len(mb.read_text().splitlines()) == stopped

    code, out, err = run_cli(TRAIN + ["--steps", str(steps), "--ckpt-dir", str(b), "--resume", "--metrics", str(mb)])
    assert code == 0, err[-3000:]
    assert [json.loads(x)["step"] for x in mb.read_text().splitlines()] == list(range(1, steps + 1))
    code, out, err = run_cli(TRAIN + ["--steps", str(steps), "--ckpt-dir", str(a)])
    assert code == 0, err[-3000:]
    sa, sb = _shards(a, steps), _shards(b, steps)
    for r in range(2):
        assert sa[r].keys() == sb[r].keys()
        for name in sa[r]:
            for field in ("param", "exp_avg", "exp_avg_sq"):
                assert torch.equal(sa[r][name][field], sb[r][name][field]), (r, name, field)


def test_ranks_agree_on_the_step_to_stop_after():
    """The agreement, played out on one store: rank 0 runs ahead and passes read-back 6
    before rank 1, which alone got the signal, reaches it and proposes read-back 7. Both
    stop at 7, neither earlier; a later proposal (rank 0's own signal) does not move it."""
    import torch.distributed as dist

    store = dist.HashStore()
    r0, r1 = StopOnSignal(store), StopOnSignal(store)
    for _ in range(5):
        assert not r0.should_stop() and not r1.should_stop()
    assert not r0.should_stop()  # read-back 6, no proposal yet
    r1._log(signal.SIGTERM)  # what its handler does
    assert not r1.should_stop() and r1.signal == "SIGTERM"  # read-back 6: proposes 7
    r0._log(signal.SIGINT)
    assert r0.should_stop() and r1.should_stop()  # both at read-back 7
    assert r0.readbacks == r1.readbacks == 7
    single = StopOnSignal(None)
    assert not single.should_stop()
    single._log(signal.SIGUSR1)
    assert single.should_stop()  # one process stops at its next read-back


def test_resaving_the_step_latest_names_never_leaves_it_dangling(tmp_path, monkeypatch):
    """Saving again the very step `latest` names (a resumed run that stops where it began)
    removes that folder before renaming the new one into place: a crash in between must
    leave `latest` on a complete checkpoint, and the next save must put things right."""
    import shutil as sh

    from minitron import checkpoint as ckpt
    from minitron.config import PRESETS, ParallelConfig, TrainConfig
    from minitron.train import Trainer

    tr = Trainer(PRESETS["tiny"], ParallelConfig(), TrainConfig(steps=2, global_batch=4))
    tr.step(0)
    ckpt.save(str(tmp_path), 1, tr)
    real = sh.rmtree

    def dies_after_removing(path, *a, **k):
        real(path, *a, **k)
        if Path(path).name == "step_0000001":
            raise KeyboardInterrupt  # the process dies right after the old folder is gone
    monkeypatch.setattr(sh, "rmtree", dies_after_removing)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(str(tmp_path), 1, tr)
    monkeypatch.undo()
    assert ckpt.check(ckpt.latest(str(tmp_path)))["step"] == 1  # still a complete checkpoint
    ckpt.save(str(tmp_path), 1, tr)
    assert ckpt.latest(str(tmp_path)).name == "step_0000001" and ckpt.check(ckpt.latest(str(tmp_path)))["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_0000001"]


@pytest.mark.multirank
@pytest.mark.parametrize("sig,to_group", [(signal.SIGTERM, False), (signal.SIGINT, True)], ids=["SIGTERM", "Ctrl-C"])
def test_a_signal_while_the_ranks_start_stops_before_training(tmp_path, sig, to_group):
    """The signal arrives as the launcher starts its first helper process (the fork server
    is about to import torch for the ranks): every rank agrees not to train."""
    ckpt, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    proc = _start(TRAIN + ["--steps", "50", "--ckpt-dir", str(ckpt), "--metrics", str(metrics)],
                  start_new_session=True)
    end = time.time() + 240
    while not _descendants(proc.pid) and time.time() < end:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    os.killpg(proc.pid, sig) if to_group else proc.send_signal(sig)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    assert "Traceback" not in err and "Error" not in err, err[-3000:]
    assert [ln for ln in err.splitlines() if ln.startswith("minitron:")] == [
        f"minitron: stopped by {sig.name} before the first step; nothing was trained: run the same command "
        f"again (exit code {EXIT_PREEMPTED})"], err[-3000:]
    assert not metrics.exists() or not metrics.read_text().strip()  # no step ran
    assert _checkpoints(ckpt) == []
    gone = time.time() + 30
    while subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True).stdout.strip() and time.time() < gone:
        time.sleep(0.2)
    assert not subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.strip()


def test_ranks_agree_on_a_signal_noted_while_starting():
    """agree_before_start: each rank posts what its SignalLog noted during start-up; every
    rank reads the same answer, the signal if any rank got one."""
    import threading

    import torch.distributed as dist

    log = SignalLog().install()
    try:
        store, answers = dist.HashStore(), {}
        threads = [threading.Thread(target=lambda r=r: answers.update({r: agree_before_start(store, 2, r)}))
                   for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert answers == {0: None, 1: None}
        log(signal.SIGTERM)  # rank 1 noted a signal (both ranks share this process's log here)
        store = dist.HashStore()
        store.set("minitron/signal_before_start/0", "")  # rank 0 posted nothing
        assert agree_before_start(store, 2, 1) == "SIGTERM"
        assert agree_before_start(None, 1, 0) == "SIGTERM"  # one process: its own note
    finally:
        log.restore()
    assert not isinstance(signal.getsignal(signal.SIGTERM), SignalLog)


EARLY_SIGNAL = '''
import os
import signal

from minitron.launch import launch_local
from minitron.preemption import SignalLog, installed_log


def noted():
    return installed_log().signal


if __name__ == "__main__":
    SignalLog().install()  # what `minitron train` installs first
    os.kill(os.getpid(), signal.SIGTERM)  # noted, not fatal: no rank has started yet
    print(sorted(launch_local(noted, (), 2, stop_on_signal=True).items()))
'''


@pytest.mark.multirank
def test_a_signal_noted_before_the_launcher_starts_reaches_every_rank(tmp_path):
    """The signal arrives before the launcher installs its own handlers (the command's
    SignalLog notes it): the launcher passes it on as if it had just arrived, and every rank
    starts with it noted (so a training loop would agree not to train)."""
    script = tmp_path / "early_signal.py"
    script.write_text(EARLY_SIGNAL)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "[(0, 'SIGTERM'), (1, 'SIGTERM')]", r.stdout
