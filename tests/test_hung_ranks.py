"""A rank that dies or stops answering ends the run with one line naming it (the
launcher's watchdog, minitron/launch.py), on real gloo ranks:

* SIGKILL of one rank (a crash, the OOM killer): reported within 10 s, every other rank
  ended at once (they would sit in a collective, then in the elastic agent's 30 s grace);
* SIGSTOP of one rank (a hung device, a swapped-out machine): its peer's collective times
  out after the timeout, and the run ends within timeout + 30 s naming the stopped rank
  (the launcher used to wait for it forever).

Both through `launch_local` in this process (the fork server is warm); the command's path
to its one line (`run_ranks`: "minitron: error: rank 1 stopped answering ...") is a
`RankLost` like these.
"""
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from minitron.config import ParallelConfig
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from minitron.launch import RankLost, launch_local, setup_rank, teardown

from test_preemption import _alive


def _collectives_until_lost(folder: str, timeout: float):
    """Every rank: leave its pid, then all-reduce until a peer is lost."""
    comm = setup_rank(ParallelConfig(dp=2), "gloo", timeout)
    Path(folder, f"{comm.grid.rank}.pid").write_text(str(os.getpid()))
    try:
        t = torch.ones(8)
        while True:
            comm.all_reduce(t, "world")
            time.sleep(0.02)
    finally:
        teardown()


def _lose_rank_1(tmp_path, how, timeout):
    """Run the job on 2 ranks, send `how` to rank 1 once both run; (the launcher's error,
    seconds from the signal to it, rank pids)."""
    got, pids = {}, {}

    def strike():
        while len(list(tmp_path.glob("*.pid"))) < 2:
            time.sleep(0.1)
        time.sleep(1)  # a few all-reduces in
        pids.update({r: int((tmp_path / f"{r}.pid").read_text()) for r in (0, 1)})
        got["t"] = time.monotonic()
        os.kill(pids[1], how)

    threading.Thread(target=strike, daemon=True).start()
    with pytest.raises(ChildFailedError) as lost:
        launch_local(_collectives_until_lost, (str(tmp_path), timeout), 2, timeout_s=timeout)
    return lost.value, time.monotonic() - got["t"], pids


@pytest.mark.multirank
def test_a_killed_rank_is_reported_within_10_s(tmp_path):
    lost, said, pids = _lose_rank_1(tmp_path, signal.SIGKILL, 60)
    if isinstance(lost, RankLost):  # the watchdog saw it first
        assert lost.lost == f"rank 1 died (pid {pids[1]} ended without returning)"
    else:  # the elastic agent did (its peer failed at once: "connection closed"); the kill is rank 1's
        assert lost.failures[1].signal_name() == "SIGKILL", lost.failures
    assert said < 10, f"reported {said:.1f} s after the kill"
    assert not _alive(pids.values())


@pytest.mark.multirank
def test_a_stopped_rank_ends_the_run_naming_it(tmp_path):
    timeout = 5
    lost, said, pids = _lose_rank_1(tmp_path, signal.SIGSTOP, timeout)
    assert isinstance(lost, RankLost), lost
    assert lost.lost.startswith("rank 1 stopped answering (no heartbeat for") and f"pid {pids[1]})" in lost.lost
    assert said < timeout + 30, f"reported {said:.1f} s after the stop"
    assert not _alive(pids.values())
