"""Running a command's job on every rank: the machine checked first (`preflight`), the
ranks started here or found under torchrun/srun (each enters through `launch.rank_main`),
a rank's error (`launch.RankFailed`) turned into one line, a signal to the launcher into
:class:`Interrupted`."""
from __future__ import annotations

import os
import threading

from ...config import RANK_TIMEOUT_S, ConfigError


class Interrupted(Exception):
    """The launcher got SIGTERM/SIGINT while its ranks ran (they were told to stop too)."""

    def __init__(self, sig):
        super().__init__(sig.name)
        self.signal = sig


def preflight(model, layout, train) -> None:
    """What the machine must offer before any rank starts: GPUs, a launcher, memory."""
    from ..preflight import check_environment, check_memory

    check_environment(layout)
    check_memory(model, layout, train)


def run_ranks(job, model, layout, train, corpus, extra=None, stop_on_signal: bool = False):
    """Run `job(comm, m, p, t, corpus, extra)` on every rank; return rank 0's result.
    A rank's error becomes one ConfigError here (the cause first: a refusal, then the
    lowest rank's failure); a signal to the launcher becomes :class:`Interrupted`.
    `stop_on_signal` (training): a signal is noted and the ranks stop at a step boundary
    (preemption.py) rather than being ended."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from ... import launch
    from ...preemption import SignalLog, installed_log

    preflight(model, layout, train)
    world = layout.world
    timeout_s = (extra or {}).get("timeout", RANK_TIMEOUT_S)
    entry = (job, layout, (model, layout, train, corpus, extra), timeout_s, bool(train.trace))
    if world == 1 or launch.under_launcher():
        if launch.under_launcher() and launch.env_world() != world:
            raise ConfigError(f"the launcher started {launch.env_world()} ranks but the layout has {world}: "
                              f"match --nproc-per-node/--ntasks to the layout")
        if stop_on_signal and threading.current_thread() is threading.main_thread() and installed_log() is None:
            SignalLog().install()  # a preemption during start-up is noted, not fatal
        results = {0: launch.rank_main(*entry)}
    else:
        try:
            results = launch.launch_local(launch.rank_main, entry, world,
                                          stop_on_signal=stop_on_signal, timeout_s=timeout_s)
        except SignalException as e:
            raise Interrupted(e.sigval) from None
        except launch.RankLost as e:  # the launcher's watchdog: a rank died or stopped answering
            raise ConfigError(f"{e.lost}; the other ranks were ended (MINITRON_DEBUG=1 shows their messages)") from None
        except ChildFailedError as e:
            rank, failure = e.get_first_failure()
            how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
            hint = ("its launcher died" if failure.exitcode == launch.EXIT_ORPHANED else
                    "out of memory?" if failure.exitcode in (-9, 137) else "see the messages above")
            raise ConfigError(f"rank {rank} died ({how}; {hint}): rerun with fewer ranks or a smaller model "
                              f"to narrow it down") from None
    failed = sorted((r for r in results.values() if isinstance(r, launch.RankFailed)),
                    key=lambda f: (not f.config, f.rank))
    if failed:
        raise ConfigError(failed[0].message)
    return results[0]


def reporting() -> bool:
    """Only global rank 0 reports (every rank runs this CLI under torchrun/srun)."""
    from ... import launch

    return not launch.under_launcher() or int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0))) == 0
