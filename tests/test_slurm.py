"""The Slurm scripts, run for real against a Slurm cluster (DESIGN.md, Testing).

When no Slurm answers here and we are root (CI on a fresh clone), the module first runs
`slurm/setup_local_slurm.sh`: Debian's slurmctld + slurmd + munge on localhost. Then
`slurm/verify.sbatch` proves a 4-task dp2.tp2 layout against the single-device model (and
a verify job whose tolerance cannot be met fails), `slurm/train.sbatch` trains 2 ranks for
a few steps and writes metrics, `slurm/sweep.sh` runs a one-layout sweep, and a bad layout
is refused with one clear line.

Jobs go only to the local test cluster (ClusterName=minitron, written by the setup
script); set MINITRON_TEST_SLURM=any to submit to another cluster's default partition.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SLURM = ROOT / "slurm"
UP_STATES = {"idle", "mixed", "allocated", "completing"}

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]


def _node_states() -> set[str]:
    if not shutil.which("sinfo"):
        return set()
    try:
        r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return {s.strip().rstrip("*~#!%$@^-") for s in r.stdout.split()} if r.returncode == 0 else set()


def _nodes() -> list[str]:
    r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, timeout=60)
    return sorted(set(r.stdout.split()))


def _cluster_name() -> str:
    r = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=60)
    for line in r.stdout.splitlines():
        if line.split("=")[0].strip() == "ClusterName":
            return line.split("=", 1)[1].strip()
    return ""


@pytest.fixture(scope="module")
def cluster():
    """A Slurm that answers, with a node up; starting the local one when we may."""
    if not _node_states() & UP_STATES:
        if not sys.platform.startswith("linux"):
            pytest.skip("no Slurm here, and slurm/setup_local_slurm.sh needs Linux")
        if os.geteuid() != 0:
            pytest.skip("no Slurm answers here and we are not root: run `sudo slurm/setup_local_slurm.sh` "
                        "(CI runs as root and starts it itself)")
        if not (shutil.which("slurmctld") or shutil.which("apt-get")):
            pytest.skip("no Slurm installed and no apt-get to install Debian's slurm-wlm")
        r = subprocess.run(["bash", str(SLURM / "setup_local_slurm.sh")], capture_output=True, text=True,
                           timeout=900)
        assert r.returncode == 0, f"setup_local_slurm.sh failed:\n{r.stdout}\n{r.stderr}"
        assert _node_states() & UP_STATES, "setup_local_slurm.sh finished but no node is up"
    name = _cluster_name()
    if name != "minitron" and os.environ.get("MINITRON_TEST_SLURM") != "any":
        pytest.skip(f"the Slurm here is cluster '{name}', not the local test cluster 'minitron': "
                    f"set MINITRON_TEST_SLURM=any to submit test jobs to it")
    # Job files go under the repository (a shared filesystem on a real cluster; runs/ is ignored).
    work = ROOT / "runs" / f"test-slurm-{uuid.uuid4().hex[:8]}"
    work.mkdir(parents=True)
    yield work
    shutil.rmtree(work, ignore_errors=True)


def _env(**extra) -> dict:
    """Our environment without a surrounding job's or launcher's variables."""
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items()
           if k not in drop and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", **{k: str(v) for k, v in extra.items()})
    return env


def _sbatch(work: Path, name: str, script: str, *flags: str, args: tuple = (), **env):
    """`sbatch --wait`: returns (exit status of the job, its output)."""
    out = work / f"{name}.out"
    cmd = ["sbatch", "--wait", "--job-name", f"test-{name}", "--chdir", str(ROOT), "--output", str(out),
           "--time", "00:10:00", *flags, str(SLURM / script), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env(**env))
    text = out.read_text() if out.exists() else ""
    return r.returncode, f"$ {' '.join(cmd)}\n{r.stdout}{r.stderr}--- job output ---\n{text}", text


def test_verify_sbatch_dp2_tp2(cluster):
    rc, log, out = _sbatch(cluster, "verify", "verify.sbatch", "--nodes", "1", "--ntasks", "4",
                           TP=2, MODEL="tiny", DTYPE="float64", BACKEND="gloo", STEPS=2)
    assert rc == 0, log
    assert "verify dp2.tp2.pp1 vs single device" in out, log
    assert "->  OK" in out and "FAILED" not in out, log
    assert out.count("verify dp2.tp2.pp1 vs single device") == 1, "only rank 0 should report:\n" + log


def test_verify_sbatch_across_two_nodes(cluster):
    # Two tasks per node, tensor-parallel pairs inside a node, data-parallel pairs across the
    # node boundary (ranks 0,2 and 1,3): MASTER_ADDR is node1, and node2's ranks reach it.
    if len(_nodes()) < 2:
        pytest.skip("this Slurm has one node: slurm/setup_local_slurm.sh starts two")
    rc, log, out = _sbatch(cluster, "verify-2n", "verify.sbatch", "--nodes", "2", "--ntasks-per-node", "2",
                           TP=2, MODEL="tiny", DTYPE="float64", BACKEND="gloo", STEPS=2)
    assert rc == 0, log
    assert "dp2.tp2.pp1 on 4 tasks, 2 node(s)" in out, log
    placement = [line.split() for line in out.splitlines() if line.strip().startswith("rank ")]
    nodes = {int(r[1]): r[3] for r in placement}
    assert len(nodes) == 4 and nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2], log
    assert "->  OK" in out and "FAILED" not in out, log


def test_verify_sbatch_job_fails_when_the_oracle_does(cluster):
    # tp2 differs from one device by ~1e-13 (float rounding): an impossible tolerance must fail the job.
    rc, log, out = _sbatch(cluster, "verify-fail", "verify.sbatch", "--nodes", "1", "--ntasks", "2",
                           args=("--tol", "1e-30"), TP=2, MODEL="tiny", STEPS=1, BACKEND="gloo")
    assert rc == 1, log
    assert "->  FAILED" in out, log


def test_verify_sbatch_refuses_a_bad_layout(cluster):
    rc, log, out = _sbatch(cluster, "bad", "verify.sbatch", "--nodes", "1", "--ntasks", "3", TP=2)
    assert rc == 2, log
    assert "3 tasks are not divisible by TP*PP = 2" in out, log


def test_train_sbatch_writes_metrics(cluster):
    metrics = cluster / "train" / "metrics.jsonl"
    rc, log, out = _sbatch(cluster, "train", "train.sbatch", "--nodes", "1", "--ntasks", "2",
                           args=("--eval-every", "0", "--sample", "0"),
                           MODEL="tiny", STEPS=4, GLOBAL_BATCH=4, BACKEND="gloo", METRICS=metrics)
    assert rc == 0, log
    assert "minitron train: dp2.tp1.pp1 on 2 tasks" in out, log
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4], log
    assert all(r["loss"] > 0 and r["tokens_per_s"] > 0 for r in recs)


def test_sweep_one_metrics_file_per_layout(cluster):
    out = cluster / "sweep"
    r = subprocess.run(["bash", str(SLURM / "sweep.sh")], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=_env(LAYOUTS="dp1.tp1.pp1", MODEL="tiny", STEPS=3, GLOBAL_BATCH=4, OUT=out, WAIT=1,
                                ARGS="--eval-every 0 --sample 0", SBATCH_ARGS="--time=00:10:00"))
    log = r.stdout + r.stderr
    assert r.returncode == 0, log
    assert len((out / "dp1.tp1.pp1.metrics.jsonl").read_text().splitlines()) == 3, log
    table = (out / "summary.txt").read_text()
    assert "tokens/s" in table and "dp1.tp1.pp1" in table and "no metrics" not in table, log


def _job_state(job: str) -> str:
    r = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=60)
    fields = dict(f.split("=", 1) for f in r.stdout.split() if "=" in f)
    return f"{fields.get('JobState', 'GONE')} restarts={fields.get('Restarts', '?')}"


def _wait_for(what, check, timeout: float = 300, every: float = 0.5):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = check()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def test_preempted_job_requeues_and_ends_equal_to_an_uninterrupted_one(cluster):
    """Two identical 2-node training jobs; one is signalled as Slurm's --signal=B:TERM@120
    would before its time limit: it checkpoints, exits 75, requeues itself and resumes. Both
    must end with the same losses and bitwise the same parameters and optimizer state."""
    from minitron import checkpoint

    steps = 24
    jobs = {}
    for name in ("whole", "preempted"):
        d = cluster / name
        cmd = ["sbatch", "--parsable", "--job-name", f"test-{name}", "--chdir", str(ROOT), "--output",
               str(d / "job.out"), "--nodes", "2", "--ntasks-per-node", "1", "--time", "00:10:00",
               str(SLURM / "train.sbatch"), "--eval-every", "0", "--sample", "0"]
        d.mkdir()
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                           env=_env(MODEL="tiny", STEPS=steps, GLOBAL_BATCH=4, BACKEND="gloo", CKPT_DIR=d / "ckpt",
                                    CKPT_EVERY=steps, METRICS=d / "metrics.jsonl"))
        assert r.returncode == 0, r.stderr
        jobs[name] = (r.stdout.strip().split(";")[0], d)
    job, d = jobs["preempted"]
    lines = lambda path: path.read_text().splitlines() if path.exists() else []  # noqa: E731
    _wait_for("five steps of the job", lambda: len(lines(d / "metrics.jsonl")) >= 5, timeout=240)
    # What --signal=B:TERM@120 does at the time limit: SIGTERM to the batch script only.
    subprocess.run(["scancel", "--batch", "--signal=TERM", job], check=True, timeout=60)
    _wait_for("the requeue", lambda: _job_state(job) == "PENDING restarts=1", timeout=240)
    # Slurm holds a requeued job back for a while before it may start again; shorten the wait,
    # but not to zero: each slurmd revokes the first run's credential with a time stamp in whole
    # seconds, and a second run allocated within that second is killed ("Job credential revoked").
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now+5"], capture_output=True, timeout=60)

    def ended(j, dd):
        latest = dd / "ckpt" / "latest"
        done = latest.exists() and latest.read_text().strip().endswith(f"{steps:07d}")
        state = _job_state(j)
        if not state.startswith(("RUNNING", "PENDING", "COMPLETING", "CONFIGURING", "REQUEUE")):
            assert done, f"job {j} ended ({state}) without its step-{steps} checkpoint:\n" + "\n".join(
                lines(dd / "job.out")[-30:])
            return True
        return False

    for name, (j, dd) in jobs.items():
        _wait_for(f"the end of job {name}", lambda j=j, dd=dd: ended(j, dd), timeout=420)
    out = (d / "job.out").read_text()
    stopped = [ln for ln in out.splitlines() if "stopped by SIGUSR1 after step" in ln]
    assert len(stopped) == 1, out
    k = int(stopped[0].split("after step ")[1].split(";")[0])
    assert 5 <= k < steps, out
    assert "requeueing job" in out and "(run 2 of this job)" in out and f"at step {k}" in out, out
    whole = [json.loads(x) for x in lines(jobs["whole"][1] / "metrics.jsonl")]
    again = [json.loads(x) for x in lines(d / "metrics.jsonl")]
    assert [r["step"] for r in again] == list(range(1, steps + 1)), "every step once in the metrics"
    assert [r["loss"] for r in again] == [r["loss"] for r in whole]
    a = checkpoint.load_full(checkpoint.latest(str(jobs["whole"][1] / "ckpt")))
    b = checkpoint.load_full(checkpoint.latest(str(d / "ckpt")))
    assert a.keys() == b.keys()
    for name in a:
        for key, value in a[name].items():
            if hasattr(value, "shape"):
                assert value.equal(b[name][key]), f"{name}.{key} differs after the requeue"


def test_sweep_sbatch_point_across_two_nodes(cluster):
    """`minitron sweep` under srun: one point of a series on two nodes, its row appended."""
    if len(_nodes()) < 2:
        pytest.skip("this Slurm has one node: slurm/setup_local_slurm.sh starts two")
    out = cluster / "sweep-2n.jsonl"
    rc, log, text = _sbatch(cluster, "sweep-2n", "sweep.sbatch", "--nodes", "2", "--ntasks-per-node", "2",
                            LAYOUT="dp2.tp2", OUT=out, STEPS=2, BACKEND="gloo")
    assert rc == 0, log
    row = json.loads(out.read_text().splitlines()[-1])
    assert row["layout"] == "dp2.tp2.pp1" and row["world"] == 4 and row["global_batch"] == 16, log
    assert row["step_s"] > 0 and row["bytes_per_axis"]["dp"] > 0 and row["bytes_per_axis"]["tp"] > 0, log
