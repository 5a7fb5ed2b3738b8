"""Fault-tolerant replicas on torchft (minitron/fault_tolerance.py), faults planted for real:

* SIGKILL of a rank of a replica (2 replicas x tp2) at a step the test picks (the rank kills itself with it, after
  the step's quorum: its peer is then inside the step's gradient all-reduce): the other
  replica takes the step again alone and keeps stepping; the launcher restarts the killed
  one (after 1 s), which recovers live from its peer (torchft's HTTP checkpoint transport, no
  file) and rejoins. Both replicas' final parameters equal the single-device replay of the
  steps as they were taken (each step's batch: the rows of the replicas that averaged it),
  in float64; the steps with one replica are said in the metrics.
* SIGSTOP of every rank of a replica (2 replicas x pp2), for ever: the other replica goes on
  alone; the launcher sees the stopped one commit nothing past the bound while its peer
  commits, ends it and restarts it; that life is SIGKILLed while it recovers from its peer
  (the state received, not loaded); the third recovers, rejoins and loses its last stage
  (SIGKILL); the fourth rejoins to the end; both replicas end with the replay's parameters.
* In both runs with a planted kill, a traced step of every rank (--trace) equals the
  analysis's bytes per axis and op, the 'replica' axis (torchft's all-reduce) included.
* SIGKILL of the Lighthouse: every replica's next quorum fails within its timeout, and each
  stops with a line naming the Lighthouse and a checkpoint of its last committed step.
* In-process: the state a healthy replica sends holds its data position (``data.position``),
  and a replica whose sampler reads otherwise refuses it, naming the field.

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
from minitron.analysis.comm import comm_bytes_per_step
from minitron.analysis.params import param_count
from minitron.checkpoint import latest
from minitron.tools.testing import traced_step_bytes

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

    def __call__(self, replica: int, life: int, step: int) -> None:
        if life == 0 and self.lighthouse and replica == 0 and step == self.at:
            os.kill(int(os.environ[ftm.LIGHTHOUSE_PID_ENV]), signal.SIGKILL)
        elif (life == 0 and replica == self.kill and int(os.environ["RANK"]) == self.rank and step >= self.at
              and self.taken >= 2):
            os.kill(os.getpid(), signal.SIGKILL)
        self.taken += 1
        time.sleep(self.seconds)


class StopThenKills(Pace):
    """Replica `replica`'s three faults, one per life: every rank SIGSTOPs itself (for ever:
    only the launcher's SIGKILL ends it) at the first step from `at` on at which it has taken
    two steps; in the next life rank 0 SIGKILLs itself while it recovers from its peer (the
    peer's state received, not yet loaded); in the third, rank 1 SIGKILLs itself once it has
    taken two steps (after the step's quorum: its peer is inside the step)."""

    def __init__(self, seconds: float, replica: int, at: int):
        super().__init__(seconds)
        self.replica, self.at = replica, at

    def recovering(self, replica: int, life: int) -> None:
        if replica == self.replica and life == 1 and int(os.environ["RANK"]) == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    def __call__(self, replica: int, life: int, step: int) -> None:
        if replica == self.replica and self.taken >= 2:
            if life == 0 and step >= self.at:
                os.kill(os.getpid(), signal.SIGSTOP)
            elif life == 2 and int(os.environ["RANK"]) == 1:
                os.kill(os.getpid(), signal.SIGKILL)
        super().__call__(replica, life, step)


def _runs(steps: list[int]) -> list[list[int]]:
    """`steps` (sorted) as runs of consecutive steps."""
    runs = []
    for s in steps:
        if runs and s == runs[-1][-1] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    return runs


def _assert_traced_step_is_the_analysis(path, layout: ParallelConfig, train: TrainConfig, step: int) -> None:
    """Every rank of each replica, in `step` (committed once, by both): its traced bytes per
    axis and op = the analysis's, the 'replica' axis (torchft's all-reduce) included."""
    recs = [json.loads(line) for line in open(path)]
    for r in (0, 1):
        mine = [x for x in recs if x["replica"] == r]
        for k in range(layout.world):
            want = comm_bytes_per_step(MODEL, layout, train, pp_rank=k // layout.tp, replicas=2)
            assert traced_step_bytes(mine, k, step) == want, (r, k)


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
    train = train.replace(trace=str(tmp_path / "trace.jsonl"))
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
    _assert_traced_step_is_the_analysis(train.trace, ParallelConfig(tp=2), train, 39)


@pytest.mark.multirank
@needs_torchft
def test_a_pipelined_replica_stopped_then_killed_in_recovery_then_killed_rejoins_each_time(tmp_path):
    """2 replicas x pp2 (the replica all-reduce per pipeline stage): replica 1 is stopped
    (SIGSTOP of both stages, for ever); replica 0 goes on alone; the launcher sees replica
    1 commit nothing past `stalled_s` while its peer commits, ends and restarts it; that life
    is SIGKILLed while it recovers; the next recovers, rejoins, trains and loses its last
    stage (SIGKILL); the fourth rejoins to the end. Both equal the replay; a step's trace =
    the analysis."""
    train = _train(tmp_path, steps=100).replace(trace=str(tmp_path / "trace.jsonl"))
    ft = ftm.FaultTolerance(replicas=2, restart_after_s=0.5, timeout_s=3, quorum_timeout_s=4, deadline_s=150)
    lines = []
    out = ftm.train_replicas(MODEL, ParallelConfig(pp=2), train, None, ft, fault=StopThenKills(0.2, 1, at=4),
                             log=lines.append)
    assert out["restarts"] == {0: 0, 1: 3}, (out["restarts"], lines)
    assert len(lines) == 3 and "replica 1 committed no step for 10 s" in lines[0] and "stopped or hung" in lines[0]
    assert all("replica 1 lost a rank" in line for line in lines[1:]) and "(restart 3)" in lines[2], lines
    taken = out["taken"]
    assert sorted(taken) == list(range(100)) and out["quorum_sizes_agree"], taken
    # replica 1's steps are its three committing lives' (the second never committed), one run of
    # consecutive steps each, in order, the last to the end; replica 0 alone in between (after the
    # stop always; after the last kill only if the fourth life joined a step late: timing decides)
    recs = [json.loads(line) for line in open(train.metrics)]
    lives = [[x["step"] - 1 for x in recs if x["replica"] == 1 and x["life"] == life] for life in (0, 2, 3)]
    assert [s for life in lives for s in life] == sorted(s for s in taken if 1 in taken[s]), (lives, taken)
    assert all(_runs(life) == [life] for life in lives) and lives[2][-1] == 99, lives
    assert lives[1][0] > lives[0][-1] + 1, lives  # the stop: replica 0 stepped alone until the restart
    assert lives[0][-1] >= 3 and all(taken[s] == [0] for s in taken if 1 not in taken[s])
    ends = out["replicas"]
    assert ends[0]["life"] == 0 and ends[1]["life"] == 3
    ref = ftm.replay(MODEL, train, taken, 2)
    for r in (0, 1):
        assert ends[r]["stopped"] is None
        assert _max_diff(ends[r]["params"], ref) < 1e-10, r
    _assert_traced_step_is_the_analysis(train.trace, ParallelConfig(pp=2), train, 99)


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


class FakeGroup:
    """A replica group as the launcher's supervisor sees it (no process): its first life
    stalls, every later one loses a rank; `polls` polls of ended() before it ends (0: never)."""

    def __init__(self, replica: int, life: int, bad: bool, polls: int = 0):
        self.replica, self.life, self.bad, self.polls, self.killed = replica, life, bad, polls, False

    def lost(self) -> bool:
        return self.bad and self.life > 0

    def stalled(self, others, bound_s) -> bool:
        return self.bad and self.life == 0

    def ended(self) -> bool:
        self.polls -= 1
        return self.polls == 0

    def kill(self) -> None:
        self.killed = True

    def outcome(self) -> list:
        return [{"life": self.life}]


def test_a_replica_out_of_restarts_ends_in_a_named_state_and_the_others_finish():
    """The supervisor alone: replica 1 stalls (ended, restarted), then loses a rank in every
    life; after --ft-max-restarts it is not restarted, said so, and replica 0 still finishes."""
    class Alive:
        alive = staticmethod(lambda: True)

    ft = ftm.FaultTolerance(replicas=2, max_restarts=2, deadline_s=30)
    groups = {0: FakeGroup(0, 0, bad=False, polls=40), 1: FakeGroup(1, 0, bad=True)}
    lines = []
    outcomes, restarts = ftm._supervise(groups, lambda r, life: FakeGroup(r, life, bad=True), Alive, ft, lines.append)
    assert restarts == {0: 0, 1: 2} and outcomes[0] == [{"life": 0}], (outcomes, restarts)
    assert outcomes[1] == ["replica 1 lost a rank after 2 restarts; not restarted (--ft-max-restarts)"], outcomes
    assert "stopped or hung" in lines[0] and "(restart 1)" in lines[0] and "lost a rank" in lines[1], lines
    assert groups[1].killed and groups[1].life == 2 and not groups[0].killed


def test_the_replica_axis_is_one_all_reduce_of_the_whole_gradient_per_step():
    """One replica on one device sends its whole gradient once per step over 'replica', and
    nothing else; without replicas there is no such axis."""
    train = TrainConfig(steps=2, global_batch=4)
    assert comm_bytes_per_step(MODEL, ParallelConfig(), train, replicas=2) == {
        "replica": {"all_reduce": param_count(MODEL) * 4}}
    assert comm_bytes_per_step(MODEL, ParallelConfig(), train) == {}


def test_what_replicas_do_not_support_is_refused_in_one_line():
    train = TrainConfig(steps=2, global_batch=4)
    ft = ftm.FaultTolerance(replicas=2)
    for layout, words in ((ParallelConfig(cp=2), "--cp"), (ParallelConfig(dp=2), "--dp"),
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
    for extra, words in ((["--cp", "2"], "--cp"), (["--nproc", "2"], "drop --nproc"), (["--zero1"], "ZeRO"),
                         (["--timeline", str(tmp_path / "t.json")], "--timeline")):
        assert main(base + extra) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("minitron: error: --ft-replicas") and words in err and "\n" not in err, err
    assert not (tmp_path / "m.jsonl").exists()


def test_a_recovering_replica_receives_the_data_position_and_refuses_another():
    """What a healthy replica sends holds its data position (``data.position``, what a
    checkpoint states); a replica whose sampler reads otherwise refuses it, naming the field."""
    from minitron.comm import Comm
    from minitron.data import load_corpus, position
    from minitron.train import Trainer

    train, corpus = TrainConfig(steps=2, global_batch=4, dtype="float64"), load_corpus("")
    healthy = Trainer(MODEL, ParallelConfig(), train, Comm(), corpus)
    healthy.step(0)
    state = ftm.trainer_state(healthy)
    assert state["data"] == position(train, MODEL.seq_len, len(corpus.split()[0]), 1)
    ftm.load_trainer_state(Trainer(MODEL, ParallelConfig(), train, Comm(), corpus), state)
    with pytest.raises(ConfigError, match=r"--seed 1234 there, 7 here") as e:
        ftm.load_trainer_state(Trainer(MODEL, ParallelConfig(), train.replace(seed=7), Comm(), corpus), state)
    assert "\n" not in str(e.value)
