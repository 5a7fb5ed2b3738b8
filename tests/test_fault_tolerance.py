"""Fault-tolerant replicas on torchft (minitron/fault_tolerance.py), faults planted for real:

* SIGKILL of a rank of a replica (2 replicas x tp2) at a step the test picks (the rank kills itself with it, after
  the step's quorum: its peer is then inside the step's gradient all-reduce): the other
  replica takes the step again alone and keeps stepping; the launcher restarts the killed
  one (after 1 s), which recovers live from its peer (torchft's HTTP checkpoint transport, no
  file) and rejoins. Both replicas' final parameters equal the single-device replay of the
  steps as they were taken (each step's batch: the rows of the replicas that averaged it),
  in float64; the steps with one replica are said in the metrics.
* SIGSTOP of every rank of a replica (2 replicas x tp2), for ever: the other replica goes on
  alone; the launcher sees the stopped one commit nothing past the bound while its peer
  commits, ends it and restarts it; that life is SIGKILLed while it recovers from its peer
  (the state received, not loaded), and the third life recovers and rejoins; both replicas
  end with the replay's parameters.
* SIGKILL of the Lighthouse: every replica's next quorum fails within its timeout, and each
  stops with a line naming the Lighthouse and a checkpoint of its last committed step.

Faults are planted through the launcher's `fault(replica, life, step)` hook, which runs on
every rank before each step; `Pace` slows the steps so that the restarted replica (a new
process: imports, model, recovery) is back before the run ends on this 2-core machine.
"""
import importlib.util
import json
import os
import signal
import time

import pytest
import torch

from minitron import fault_tolerance as ftm
from minitron.config import ConfigError, ParallelConfig, TrainConfig, preset
from minitron.checkpoint import latest

# the refusals need no torchft; the runs do (`make env` installs it)
needs_torchft = pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="torchft is not installed")

MODEL = preset("tiny")


def _train(tmp_path, steps: int) -> TrainConfig:
    return TrainConfig(steps=steps, global_batch=4, dtype="float64", warmup=2, eval_every=0, sample_tokens=0,
                       progress=False, metrics=str(tmp_path / "metrics.jsonl"), ckpt_dir=str(tmp_path / "ckpt"))


class Pace:
    """Every step takes at least `seconds` (a planted slowness, on every rank), and rank
    `rank` of replica `kill` SIGKILLs itself at the first step from `at` on in its first life
    at which it has already taken two steps (a replica that started late and healed is killed
    only once it has trained; `lighthouse`: replica 0 kills the Lighthouse at step `at`)."""

    def __init__(self, seconds: float, kill: int | None = None, at: int = -1, lighthouse: bool = False,
                 rank: int = 0):
        self.seconds, self.kill, self.at, self.lighthouse, self.rank = seconds, kill, at, lighthouse, rank
        self.taken = 0  # steps this process has begun (each rank counts its own)

    def __call__(self, replica: int, life: int, step: int | None) -> None:
        if step is None:  # a recovery (no step taken)
            return
        if life == 0 and self.lighthouse and replica == 0 and step == self.at:
            os.kill(int(os.environ[ftm.LIGHTHOUSE_PID_ENV]), signal.SIGKILL)
        elif (life == 0 and replica == self.kill and int(os.environ["RANK"]) == self.rank and step >= self.at
              and self.taken >= 2):
            os.kill(os.getpid(), signal.SIGKILL)
        self.taken += 1
        time.sleep(self.seconds)


class StopThenKillInRecovery(Pace):
    """Every rank of replica `stop` SIGSTOPs itself at the first step from `at` on in its
    first life at which it has taken two steps (the whole replica frozen, for ever: only the
    launcher's SIGKILL ends it); in its second life, its rank `rank` SIGKILLs itself while
    it recovers from its peer (the peer's state received, not yet loaded)."""

    def __init__(self, seconds: float, stop: int, at: int, rank: int = 0):
        super().__init__(seconds)
        self.stop, self.at, self.rank = stop, at, rank

    def __call__(self, replica: int, life: int, step: int | None) -> None:
        if replica == self.stop and life == 1 and step is None and int(os.environ["RANK"]) == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)
        elif replica == self.stop and life == 0 and step is not None and step >= self.at and self.taken >= 2:
            os.kill(os.getpid(), signal.SIGSTOP)
        super().__call__(replica, life, step)


def _max_diff(full: dict, ref: dict) -> float:
    assert full.keys() == ref.keys()
    return max((full[k]["param"] - ref[k]["param"]).abs().max().item() for k in ref)


@pytest.mark.multirank
@needs_torchft
def test_a_killed_replica_rejoins_live_and_the_run_equals_its_replay(tmp_path):
    """2 replicas x tp2 (4 ranks): tensor rank 1 of replica 1 is killed; its replica is
    ended and restarted as a whole, and both of its ranks recover from replica 0's."""
    train = _train(tmp_path, steps=40)
    ft = ftm.FaultTolerance(replicas=2, restart_after_s=1.0, timeout_s=10, quorum_timeout_s=20, deadline_s=150)
    lines = []
    out = ftm.train_replicas(MODEL, ParallelConfig(tp=2), train, None, ft, fault=Pace(0.1, kill=1, at=5, rank=1),
                             log=lines.append)
    assert out["restarts"] == {0: 0, 1: 1} and len(lines) == 1 and "replica 1 lost a rank" in lines[0]
    taken = out["taken"]
    assert sorted(taken) == list(range(40)), (taken, out["restarts"], lines)  # every step by someone
    assert out["quorum_sizes_agree"], taken
    # a replica may start late (the first quorum does not wait for it; it then recovers live from the
    # other, as after a kill): replica 1 is killed once it has trained, at step 5 or later
    first = min(s for s in taken if 1 in taken[s])
    kill = min(s for s in taken if s > first and 1 not in taken[s])
    assert kill >= 5 and 1 in taken[kill - 1], taken  # it took part in the step before its kill
    back = min(s for s in taken if s > kill and taken[s] == [0, 1])
    assert all(taken[s] == [0] for s in range(kill, back)), taken  # the killed step retaken alone, and on
    assert all(taken[s] == [0, 1] for s in range(back, 40)), taken  # rejoined, to the end
    alone = [s for s, rs in taken.items() if len(rs) == 1]
    assert out["fewer_replicas"] == [s + 1 for s in alone]
    # the metrics say it: every committed step of each replica, with how many took part
    recs = [json.loads(line) for line in open(train.metrics)]
    assert {r["step"] for r in recs if r["fewer_replicas"]} == {s + 1 for s in alone}
    assert all(r["replicas"] == 1 for r in recs if r["fewer_replicas"])
    assert not (tmp_path / "ckpt").exists()  # the recovery was live: nothing on disk
    # both replicas end with the single-device replay's parameters (the recovered one too)
    ref = ftm.replay(MODEL, train, taken, 2)
    ends = out["replicas"]
    assert ends[0]["life"] == 0 and ends[1]["life"] == 1
    for r in (0, 1):
        assert ends[r]["stopped"] is None
        assert _max_diff(ends[r]["params"], ref) < 1e-10, r
    # the oracle can fail: the replay as if every step had both replicas differs
    wrong = ftm.replay(MODEL, train, {s: [0, 1] for s in taken}, 2)
    assert _max_diff(ends[0]["params"], wrong) > 1e-6


@pytest.mark.multirank
@needs_torchft
def test_a_stopped_replica_is_restarted_and_one_killed_while_it_recovers_again(tmp_path):
    """2 replicas x tp2: both ranks of replica 1 SIGSTOP themselves (for ever); replica 0
    keeps committing alone; the launcher sees replica 1 silent past `stalled_s` while its
    peer commits, ends it (SIGKILL) and restarts it; that life is SIGKILLed while it recovers
    from replica 0; the third life recovers and rejoins to the end; both equal the replay."""
    train = _train(tmp_path, steps=60)
    ft = ftm.FaultTolerance(replicas=2, restart_after_s=0.5, timeout_s=3, quorum_timeout_s=4, deadline_s=150)
    lines = []
    out = ftm.train_replicas(MODEL, ParallelConfig(tp=2), train, None, ft,
                             fault=StopThenKillInRecovery(0.25, stop=1, at=4), log=lines.append)
    assert out["restarts"] == {0: 0, 1: 2}, (out["restarts"], lines)
    assert len(lines) == 2 and "replica 1 committed no step for 10 s" in lines[0] and "stopped or hung" in lines[0]
    assert "replica 1 lost a rank" in lines[1] and "(restart 2)" in lines[1], lines
    taken = out["taken"]
    assert sorted(taken) == list(range(60)) and out["quorum_sizes_agree"], taken
    first = min(s for s in taken if 1 in taken[s])
    stop = min(s for s in taken if s > first and 1 not in taken[s])
    back = min(s for s in taken if s > stop and taken[s] == [0, 1])
    assert stop >= 4 and all(taken[s] == [0] for s in range(stop, back)), taken  # replica 0 went on alone
    assert all(taken[s] == [0, 1] for s in range(back, 60)), taken  # the third life rejoined, to the end
    recs = [json.loads(line) for line in open(train.metrics)]
    assert {r["life"] for r in recs if r["replica"] == 1} == {0, 2}  # the second life never committed
    ends = out["replicas"]
    assert ends[0]["life"] == 0 and ends[1]["life"] == 2
    ref = ftm.replay(MODEL, train, taken, 2)
    for r in (0, 1):
        assert ends[r]["stopped"] is None
        assert _max_diff(ends[r]["params"], ref) < 1e-10, r


@pytest.mark.multirank
@needs_torchft
def test_a_killed_lighthouse_stops_every_replica_with_a_checkpoint(tmp_path):
    train = _train(tmp_path, steps=200)
    ft = ftm.FaultTolerance(replicas=2, timeout_s=5, quorum_timeout_s=5, deadline_s=90)
    t0 = time.monotonic()
    out = ftm.train_replicas(MODEL, ParallelConfig(), train, None, ft, fault=Pace(0.05, at=4, lighthouse=True))
    assert time.monotonic() - t0 < 80
    assert max(out["taken"]) < 199  # stopped, not finished
    for r in (0, 1):
        end = out["replicas"][r]
        assert "no quorum: the Lighthouse" in end["stopped"] and "did not answer" in end["stopped"], end
        step = int(latest(str(tmp_path / "ckpt" / f"replica{r}")).name.split("_")[1])
        assert end["checkpoint"] and step == max(s for s, rs in out["taken"].items() if r in rs) + 1


def test_what_replicas_do_not_support_is_refused_in_one_line():
    train = TrainConfig(steps=2, global_batch=4)
    ft = ftm.FaultTolerance(replicas=2)
    for layout, words in ((ParallelConfig(pp=2), "--pp"), (ParallelConfig(dp=2), "--dp"),
                          (ParallelConfig(zero1=True), "ZeRO")):
        with pytest.raises(ConfigError, match=words) as e:
            ftm.check(MODEL, layout, train, ft)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="global-batch 6"):
        ftm.check(MODEL, ParallelConfig(), train.replace(global_batch=6), ftm.FaultTolerance(replicas=4))


def test_the_command_refuses_before_any_rank_starts(capsys, tmp_path):
    from minitron.tools.cli import main

    base = ["train", "--model", "tiny", "--ft-replicas", "2", "--steps", "2", "--global-batch", "4", "--no-progress",
            "--metrics", str(tmp_path / "m.jsonl")]
    for extra, words in ((["--pp", "2"], "--pp"), (["--nproc", "2"], "drop --nproc"), (["--zero1"], "ZeRO")):
        assert main(base + extra) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("minitron: error: --ft-replicas") and words in err and "\n" not in err, err
    assert not (tmp_path / "m.jsonl").exists()
