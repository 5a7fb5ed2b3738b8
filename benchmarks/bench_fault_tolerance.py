"""What a lost replica costs under fault-tolerant data parallelism (minitron/fault_tolerance.py, torchft).

One run of 2 replicas (tiny model, float64, one rank each): replica 1 SIGKILLs itself at step
`--kill-at` (after the step's quorum, as in tests/test_fault_tolerance.py) and the launcher
restarts it after `--restart-after` seconds; with `--fault stop` it SIGSTOPs itself instead (for
ever), and the launcher ends it once it has committed nothing for `FaultTolerance.stalled_s`
while replica 0 commits, then restarts it. From the committed steps' wall times (the metrics' "time"):

* the step time with 2 replicas before the kill, with 1 replica while it is away, and with 2
  again after it rejoined (medians; their ratios, side by side in the same run);
* the stall of the healthy replica at the fault: from its last commit before it to its
  first commit alone (the failed all-reduce, then the Lighthouse's heartbeat timeout and a
  new quorum; a stopped peer keeps its sockets open, so the all-reduce fails only at its
  timeout, `--timeout`);
* the time from the fault to the first step both replicas commit again (for a stop, the
  launcher's bound first; then the restart: a new process, its model, torchft's live
  recovery from replica 0).

    python benchmarks/bench_fault_tolerance.py [--steps 400 --kill-at 50 --restart-after 2]
        [--fault {kill,stop} --timeout S] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minitron import fault_tolerance as ftm  # noqa: E402
from minitron.config import ParallelConfig, TrainConfig, preset  # noqa: E402


class KillAt:
    """Replica 1 sends itself `signal` (SIGKILL, SIGSTOP) at step `step` of its first life
    (picklable: module level)."""

    def __init__(self, step: int, sig: int = signal.SIGKILL):
        self.step, self.sig = step, sig

    def __call__(self, replica: int, life: int, step: int) -> None:
        if replica == 1 and life == 0 and step == self.step:
            os.kill(os.getpid(), self.sig)


def phases(recs: list[dict], kill_at: int) -> dict:
    """The medians and latencies of the module doc from replica 0's committed steps."""
    r0 = sorted((r for r in recs if r["replica"] == 0), key=lambda r: r["step"])
    t = {r["step"]: r["time"] for r in r0}
    n = {r["step"]: r["replicas"] for r in r0}
    dt = {s: t[s] - t[s - 1] for s in t if s - 1 in t}
    killed = kill_at + 1  # the metrics' step of the killed step (1-based)
    back = min(s for s in n if s > killed and n[s] == 2)
    med = lambda steps: statistics.median(dt[s] for s in steps) if steps else float("nan")  # noqa: E731
    both = med([s for s in dt if s < killed and n[s] == n[s - 1] == 2])
    alone = med([s for s in dt if killed < s < back])
    again = med([s for s in dt if s > back])
    return {"step_s_2_replicas": both, "step_s_1_replica": alone, "step_s_after_rejoin": again,
            "stall_at_fault_s": t[killed] - t[killed - 1], "fault_to_rejoin_s": t[back] - t[killed - 1],
            "steps_alone": back - killed, "ratio_alone_vs_both": alone / both}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--kill-at", type=int, default=50)
    ap.add_argument("--restart-after", type=float, default=2.0, help="seconds before the lost replica is restarted")
    ap.add_argument("--fault", choices=("kill", "stop"), default="kill", help="SIGKILL or SIGSTOP of replica 1")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds a quorum or a replica all-reduce may take (train's --ft-timeout; "
                         "default: FaultTolerance's)")
    ap.add_argument("--smoke", action="store_true", help="a short run, nothing written")
    args = ap.parse_args(argv)
    import importlib.util

    if importlib.util.find_spec("torchft") is None:
        print("torchft is not installed: nothing measured (`make env` installs it)")
        return 0
    steps, kill_at = (30, 5) if args.smoke else (args.steps, args.kill_at)
    with tempfile.TemporaryDirectory() as d:
        train = TrainConfig(steps=steps, global_batch=4, dtype="float64", warmup=2, eval_every=0, sample_tokens=0,
                            progress=False, metrics=str(Path(d) / "m.jsonl"))
        timeouts = {"timeout_s": args.timeout, "quorum_timeout_s": args.timeout} if args.timeout else {}
        ft = ftm.FaultTolerance(replicas=2, restart_after_s=args.restart_after, **timeouts)
        sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}[args.fault]
        out = ftm.train_replicas(preset("tiny"), ParallelConfig(), train, None, ft, fault=KillAt(kill_at, sig))
        recs = [json.loads(line) for line in open(train.metrics)]
    try:
        result = phases(recs, kill_at)
    except ValueError:  # the restarted replica was not back before the end (a short run)
        result = {"rejoined": False}
    print(json.dumps({"steps": steps, "fault": args.fault, "at": kill_at, "timeout": ft.timeout_s,
                      "stalled_s": ft.stalled_s, "restarts": out["restarts"], **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
