"""Starting ranks: locally through PyTorch's own launcher, or under torchrun / srun.

* Under torchrun the environment already has RANK, WORLD_SIZE, MASTER_ADDR, ...
* Under srun we translate SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID and the first
  host of the job into the same variables.
* Otherwise `--nproc N` starts N local ranks with `torch.distributed.launcher`
  (the engine behind `torch.distributed.run`), standalone c10d rendezvous.

Collectives get a timeout, so a dead peer ends the run with an error, never a hang. Local
ranks are also watched from the launcher (:class:`Watchdog`): a rank that dies ends the
others at once (they would otherwise sit in a collective, and the elastic agent gives
them 30 s), and a rank that stops answering (SIGSTOP, a hung device, a swapped-out
machine: no heartbeat) is ended once its peers have given up on it, so that the run ends
with one line naming it instead of the launcher waiting for it forever.
"""
from __future__ import annotations

import datetime
import os
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import traceback
import uuid
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from .comm import Comm, CommTrace, wire_dtype_for
from .config import RANK_TIMEOUT_S, ConfigError, ParallelConfig
from .grid import ProcessGrid
from .preemption import SignalLog, installed_log

STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def under_launcher() -> bool:
    """True when torchrun or srun (with several tasks) started this process."""
    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return True
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ


def env_world() -> int:
    return int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))


def slurm_to_torch_env() -> None:
    """Map srun's variables onto torch.distributed's (MASTER_ADDR = first host)."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    if "MASTER_ADDR" not in os.environ:
        nodes = os.environ.get("SLURM_JOB_NODELIST", "localhost")
        try:
            first = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True,
                                   text=True, check=True).stdout.split()[0]
        except (OSError, subprocess.CalledProcessError, IndexError):
            first = nodes.split(",")[0]
        os.environ["MASTER_ADDR"] = first
    os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000))


def resolve_device(layout: ParallelConfig, world: int) -> torch.device:
    """The one place where the device is chosen: CUDA (this rank's local GPU) with the
    nccl backend, or for a single-device run when a GPU is present and --device allows;
    otherwise the CPU (gloo ranks)."""
    want = layout.device
    cuda = torch.cuda.is_available() and (layout.backend == "nccl" or world == 1)
    if want == "cuda" or (want == "auto" and cuda):
        # a task may see one GPU (--gpus-per-task) or the node's: wrap the local rank
        local = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
        return torch.device("cuda", local if world > 1 else torch.cuda.current_device())
    return torch.device("cpu")


def setup_rank(layout, backend: str = "gloo", timeout_s: float = RANK_TIMEOUT_S, trace: bool = False) -> Comm:
    """Join the process group (if world > 1), build the grid's groups, return a Comm."""
    world = env_world() if under_launcher() else 1
    grid = ProcessGrid.for_layout(layout)
    if world > 1:
        slurm_to_torch_env()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("SLURM_NTASKS_PER_NODE", world)))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))
        timeout = datetime.timedelta(seconds=timeout_s)
        if backend == "nccl":
            torch.cuda.set_device(resolve_device(layout, world))
        dist.init_process_group(backend=backend, timeout=timeout)
        grid.rank = dist.get_rank()
        grid.build_groups(timeout=timeout)
    return Comm(grid, CommTrace() if trace else None, wire_dtype=wire_dtype_for(layout))


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def rank_session(layout, timeout_s: float = RANK_TIMEOUT_S, trace: bool = False):
    """On one rank: join the process group and build the grid and its `Comm` (`setup_rank`),
    and leave the group on the way out, whatever happened in between."""
    comm = setup_rank(layout, layout.backend, timeout_s, trace=trace)
    try:
        yield comm
    finally:
        teardown()


@dataclass
class RankFailed:
    """What a rank returns instead of raising: the launcher reports one line, not 80."""

    rank: int
    message: str
    config: bool  # a ConfigError (the cause) rather than a consequence (a peer that left)


def rank_main(job, layout, args: tuple, timeout_s: float = RANK_TIMEOUT_S, trace: bool = False):
    """A job's entry on every rank, local or under torchrun/srun: `job(comm, *args)` in a
    :func:`rank_session`; its result, or a :class:`RankFailed` (a ConfigError's text, or the
    first line of any other error) for the launcher to report."""
    rank = int(os.environ.get("RANK", 0))
    try:
        with rank_session(layout, timeout_s, trace) as comm:
            return job(comm, *args)
    except ConfigError as e:
        return RankFailed(rank, str(e), True)
    except Exception as e:  # noqa: BLE001 - a rank reports, the launcher prints one line
        if os.environ.get("MINITRON_DEBUG"):
            traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return RankFailed(rank, f"rank {rank} failed: {type(e).__name__}: {first} "
                                f"(MINITRON_DEBUG=1 prints the traceback)", False)


# A rank whose launcher died exits with this status (128 + SIGKILL, what the launcher got).
EXIT_ORPHANED = 137


def die_with(pid: int, leftovers: str = "") -> None:
    """End this process as soon as process `pid` (its launcher) is gone.

    Local ranks are children of a fork server, not of the launcher, so the kernel's
    parent-death signal (PR_SET_PDEATHSIG) would watch the wrong process. A daemon thread
    waits on a pidfd of the launcher instead (immune to pid reuse; polling where pidfds
    are missing) and ends the rank at once: no step, no checkpoint after the launcher's
    death, no rank left training alone or waiting forever in a collective. The folder
    `leftovers` (the launcher's scratch space, which it can no longer remove) goes too."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # gone already
        if leftovers:
            shutil.rmtree(leftovers, ignore_errors=True)
        os._exit(EXIT_ORPHANED)
    except (AttributeError, OSError):
        fd = None

    def watch():
        if fd is not None:
            select.select([fd], [], [])
        else:
            while _alive(pid):
                time.sleep(0.5)
        if leftovers:
            shutil.rmtree(leftovers, ignore_errors=True)
        os._exit(EXIT_ORPHANED)

    threading.Thread(target=watch, name="minitron-launcher-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _rank_file(scratch, rank: int, kind: str) -> Path:
    """What a local rank leaves in the launcher's scratch folder for the Watchdog: its pid,
    beat (the heartbeat's mtime), raised (its error's first line), done (it returned)."""
    return Path(scratch) / f"rank{rank}.{kind}"


def _rank_of(launcher: int, scratch: str, stop_on_signal: bool, fn, *args):
    """A local rank: watch the launcher, leave its pid for the launcher's signal
    forwarding, then run `fn(*args)`. With `stop_on_signal`, SIGTERM/SIGINT are noted
    from the start (a training loop stops on them, preemption.StopOnSignal) — also one
    the launcher got before this rank had left its pid."""
    die_with(launcher, scratch)  # its thread keeps STOP_SIGNALS blocked: they reach the main thread
    log = SignalLog().install() if stop_on_signal else None
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked since the fork server started
    rank = int(os.environ.get("RANK", 0))
    _heartbeat(_rank_file(scratch, rank, "beat"))
    _rank_file(scratch, rank, "pid").write_text(str(os.getpid()))
    early = Path(scratch) / "signal"
    if early.exists():  # the launcher was signalled before this rank had left its pid
        sig = int(early.read_text() or signal.SIGTERM)
        log(sig) if log is not None else os.kill(os.getpid(), sig)
    try:
        out = fn(*args)
    except BaseException as e:  # its own error, most often a peer's loss seen in a collective
        first = (str(e).strip().splitlines() or [""])[0]
        _rank_file(scratch, rank, "raised").write_text(f"{type(e).__name__}: {first}")
        raise
    _rank_file(scratch, rank, "done").touch()  # returned: its silence from now on is not a hang
    return out


HEARTBEAT_S = 0.5  # how often a local rank shows it is alive (a file's mtime; Watchdog reads it)


def _heartbeat(path: Path) -> None:
    """A daemon thread that touches `path` every HEARTBEAT_S: it runs while the rank's
    process runs (also while its main thread waits in a collective), and stops when the
    process is stopped (SIGSTOP), killed, or wedged without releasing the interpreter."""
    path.touch()

    def beat():
        while True:
            time.sleep(HEARTBEAT_S)
            try:
                os.utime(path)
            except OSError:
                return  # the launcher removed its scratch folder: the run is over

    threading.Thread(target=beat, name="minitron-heartbeat", daemon=True).start()


class Watchdog:
    """The launcher's eye on its local ranks (a thread; `start`, then `stop`).

    * A rank whose process is gone without having returned (killed, crashed) ends the
      others at once (SIGKILL): they would wait in a collective until its timeout, then
      the elastic agent's 30 s grace. `lost` names it.
    * A rank without a heartbeat for `quiet_s` once another rank has returned (its peers
      gave up on it: a collective timed out), or for `timeout_s` + `quiet_s` in any case,
      is stopped, hung or swapped out: it is ended (SIGKILL) and named in `lost`.

    A stop of the whole process group (Ctrl-Z) stops the watchdog too: a pause in its own
    loop resets what it has seen, so a resumed run is not taken for a hung one."""

    def __init__(self, scratch: str, timeout_s: float, quiet_s: float = 5.0, period_s: float = 0.25):
        self.scratch, self.timeout_s, self.quiet_s, self.period_s = Path(scratch), timeout_s, quiet_s, period_s
        self.lost: str | None = None
        self.candidates: dict[int, int] = {}  # {rank: pid}: the dead ranks a "died" verdict chose from
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="minitron-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _ranks(self) -> dict[int, int]:
        out = {}
        for f in self.scratch.glob("rank*.pid"):
            try:
                out[int(f.stem[4:])] = int(f.read_text())
            except (ValueError, OSError):
                pass  # being written
        return out

    def _run(self) -> None:
        seen: dict[int, tuple[float, float]] = {}  # rank -> (heartbeat mtime, when it last changed)
        peers_lost_since = None  # when only ranks that lost a peer were first found ended
        last = time.monotonic()
        while not self._stop.wait(self.period_s):
            now = time.monotonic()
            if now - last > 4 * self.period_s + 1:  # we were stopped ourselves: start over
                seen = {}
            last = now
            ranks = self._ranks()
            done = {r for r in ranks if _rank_file(self.scratch, r, "done").exists()}
            dead, silent = [], {}
            for r, pid in sorted(ranks.items()):
                if r in done:
                    continue
                if _gone(pid):
                    dead.append(r)
                    continue
                try:
                    mtime = _rank_file(self.scratch, r, "beat").stat().st_mtime
                except OSError:
                    continue
                if seen.get(r, (None,))[0] != mtime:
                    seen[r] = (mtime, now)
                silent[r] = now - seen[r][1]
            # a peer that gave up on a silent rank (its collective timed out) may end first:
            # the silent one is the cause
            quiet = {r: t for r, t in silent.items() if t > self.timeout_s + self.quiet_s or
                     ((done or dead) and t > (self.quiet_s if not dead else 3.0))}
            if quiet:
                r = max(quiet, key=quiet.get)
                self._end(ranks, f"rank {r} stopped answering (no heartbeat for {quiet[r]:.0f} s: stopped, hung "
                                 f"or swapped out; pid {ranks[r]})")
                return
            if dead:  # a peer that lost its connection to the dead rank may end in the same poll:
                # the cause left no error of its own (a peer raises when it loses it), and of those
                # the one a signal ended (SIGKILL, the OOM killer; /proc shows it while unreaped);
                # one the elastic agent ended (SIGTERM to the rest, once it saw the cause) comes last
                unexplained = [r for r in dead if not _rank_file(self.scratch, r, "raised").exists()]
                if not unexplained:  # only peers that lost the cause have ended: a killed rank can
                    # take a moment to be gone (its memory torn down), give it a few polls to show
                    peers_lost_since = peers_lost_since or now
                    if now - peers_lost_since < 3.0:
                        continue
                self.candidates = {r: ranks[r] for r in unexplained or dead}
                r = min(self.candidates, key=lambda r: _likelihood_of_cause(_end_signal(ranks[r])))
                self._end(ranks, _died(r, ranks[r]))
                return

    def verdict(self, failed: ChildFailedError) -> str | None:
        """The watchdog's line, its choice among dead ranks re-ranked by the exit signals the
        elastic agent saw (the watchdog reads them from /proc only while a rank is unreaped;
        they were all dead, so its own SIGKILLs did not change them)."""
        if not self.candidates:
            return self.lost
        sig = {r: _end_signal(pid) or max(0, -getattr(failed.failures.get(r), "exitcode", 0))
               for r, pid in self.candidates.items()}
        r = min(self.candidates, key=lambda r: _likelihood_of_cause(sig[r]))
        return _died(r, self.candidates[r])

    def cause_of_failure(self) -> str | None:
        """The dead rank to name when the elastic agent reported a failure first (its poll can
        see a peer's error exit before the killed rank's own): one rank that ended without
        returning or raising, while every rank that raised had only lost a peer. None when
        that is not so (a rank's own error is the agent's to report)."""
        ranks = self._ranks()
        files = {r: _rank_file(self.scratch, r, "raised") for r in ranks}
        raised = {r: f.read_text() for r, f in files.items() if f.exists()}
        if not raised or not all(any(s in text for s in PEER_LOST) for text in raised.values()):
            return None
        silent = [r for r in sorted(ranks) if r not in raised and not _rank_file(self.scratch, r, "done").exists()
                  and _gone(ranks[r])]
        return _died(silent[0], ranks[silent[0]]) if len(silent) == 1 else None

    def _end(self, ranks: dict[int, int], why: str) -> None:
        self.lost = why
        for pid in ranks.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


# What gloo's collectives raise on a rank whose peer is gone (its connection reset or closed).
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


class RankLost(ChildFailedError):
    """The run ended because the Watchdog found a rank dead or silent: `lost` names it
    (the agent's failures are kept, as in any ChildFailedError)."""

    def __init__(self, lost: str, failed: ChildFailedError):
        super().__init__(failed.name, failed.failures)
        self.lost = lost


def _unreported_failure(watchdog: "Watchdog", name: str, wait_s: float = 5.0) -> ChildFailedError:
    """The failure of a run that the elastic agent could not report (it stopped at a rank's
    unwritten error file, with the other ranks left running): the watchdog is given `wait_s`
    to name the dead rank, every rank still running is ended (SIGKILL), and the failure is a
    RankLost naming it (a ChildFailedError with one entry per rank when it names none)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    end = time.monotonic() + wait_s
    while watchdog.lost is None and time.monotonic() < end:
        time.sleep(0.05)
    ranks = watchdog._ranks()
    signals = {r: _end_signal(pid) for r, pid in ranks.items()}  # read before they are reaped
    for pid in ranks.values():
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    failed = ChildFailedError(name, {r: ProcessFailure(local_rank=r, pid=pid, exitcode=-signals[r] or 1,
                                                        error_file="") for r, pid in ranks.items()}
                              or {0: ProcessFailure(local_rank=0, pid=-1, exitcode=1, error_file="")})
    lost = watchdog.verdict(failed) or watchdog.cause_of_failure()
    return RankLost(lost, failed) if lost else failed


def _end_signal(pid: int) -> int:
    """The signal that ended the (not yet reaped) process `pid`, 0 if none or unknown (reaped):
    the exit status in /proc/PID/stat's 52nd field, as wait() reports it (its low 7 bits)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[-1]) & 0x7F if len(fields) >= 50 else 0
    except (OSError, ValueError, IndexError):
        return 0


def _likelihood_of_cause(sig: int) -> int:
    """Order among dead ranks, the likeliest cause first: ended by a signal other than the
    agent's SIGTERM (SIGKILL, SIGSEGV), then unknown (already reaped), then SIGTERM."""
    return 2 if sig == signal.SIGTERM else 0 if sig else 1


def _died(rank: int, pid: int) -> str:
    return f"rank {rank} died (pid {pid} ended without returning)"


def _gone(pid: int) -> bool:
    """The process has ended (reaped, or a zombie its parent has not reaped yet)."""
    return not _alive(pid) or _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def _start_fork_server() -> None:
    """Start the fork server (if it is not running) with SIGINT/SIGTERM blocked: a blocked
    signal stays blocked across fork and exec. The server then never dies of a Ctrl-C sent
    to the whole process group while it imports torch (the launcher would get an
    EOFError and the ranks a traceback), and every rank forked from it starts blocked too:
    a signal waits until `_rank_of` has its handlers in place, then arrives. The launcher's
    own signals are only held back for the moment of the fork, then delivered."""
    from multiprocessing import forkserver, resource_tracker

    resource_tracker.ensure_running()  # first: starting it unblocks the signals again
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _forward_to_ranks(scratch: str):
    """A signal handler for the launcher: pass SIGTERM/SIGINT on to every local rank and
    keep waiting for them. They stop at a step boundary, checkpoint and return (see
    preemption.py), and their results come back as usual. (The elastic agent's own
    handling would stop waiting for results and hold the ranks until its shutdown timeout.)
    A second signal ends the ranks at once (SIGKILL): Ctrl-C twice for ranks that hang."""
    def forward(signum, frame):
        forward.received.append(signum)
        (Path(scratch) / "signal").write_text(str(signum))  # for ranks still starting
        for f in Path(scratch).glob("*.pid"):
            try:
                os.kill(int(f.read_text()), signum if len(forward.received) == 1 else signal.SIGKILL)
            except (ValueError, OSError):
                pass  # a rank that already left
    forward.received = []  # the signals the launcher got
    return forward


def _quiet_agent_logs() -> dict:
    """Silence the elastic agent's own log lines (a rank that fails or is signalled gets a
    40-line traceback from it) while minitron reports one line; MINITRON_DEBUG=1 keeps them.
    Returns {logger: previous level} for restoring."""
    import logging

    if os.environ.get("MINITRON_DEBUG"):
        return {}
    out = {}
    for name, logger in list(logging.root.manager.loggerDict.items()):
        quiet = name.startswith(("torch.distributed.elastic", "torch.multiprocessing"))
        if quiet and isinstance(logger, logging.Logger):
            out[logger] = logger.level
            logger.setLevel(logging.CRITICAL)
    return out


def launch_local(fn, args: tuple, nproc: int, start_method: str = "forkserver",
                 stop_on_signal: bool = False, timeout_s: float = RANK_TIMEOUT_S) -> dict:
    """Run `fn(*args)` on `nproc` local ranks via torch.distributed's elastic launcher.
    Returns {rank: return value}. SIGTERM/SIGINT to the launcher are passed on to the
    ranks; with `stop_on_signal` the ranks note them instead of dying (a training loop
    then stops at a step boundary with a checkpoint). A rank that dies or stops
    answering ends the run (:class:`Watchdog`; `timeout_s`: the ranks' collective
    timeout) with a ConfigError naming it.

    `forkserver`: a clean single-threaded server imports torch and minitron once, and
    every rank is forked from it — fast like `fork`, but without inheriting the locks of
    the launcher's threads (a rank forked while another thread held glibc's resolver
    lock can hang in rendezvous)."""
    import multiprocessing as mp

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if start_method == "forkserver":
        mp.set_forkserver_preload(["torch", "torch.distributed", "minitron.train"])
        _start_fork_server()
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    # the agent's per-run folder (it would leave /tmp/torchelastic_* behind): ours, removed after
    log_dir = tempfile.mkdtemp(prefix="minitron_ranks_")
    # SIGTERM/SIGINT are ours (forwarded to the ranks); the agent keeps SIGHUP/SIGQUIT
    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex[:8],
                       rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0,
                       monitor_interval=0.05, start_method=start_method, signals_to_handle="SIGHUP,SIGQUIT",
                       logs_specs=DefaultLogsSpecs(log_dir=log_dir))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The elastic agent installs its own SIGTERM/SIGINT... handlers; put ours back after,
    # so that a notebook kernel that launched ranks still shuts down quietly.
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    forward = _forward_to_ranks(log_dir)
    quiet = _quiet_agent_logs()
    if threading.current_thread() is threading.main_thread():
        early = installed_log()  # the command's: a signal while it was starting
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, forward)
        if early is not None and early.signal:
            forward(signal.Signals[early.signal], None)  # as the handler is called: (signum, frame)
    watchdog = Watchdog(log_dir, timeout_s).start()
    try:
        return elastic_launch(cfg, _rank_of)(os.getpid(), log_dir, stop_on_signal, fn, *args)
    except EOFError:  # torch's spawn read the error file of a rank that ended with an error before
        # the rank had written it (a race inside torch.multiprocessing): the watchdog's eyes instead
        raise _unreported_failure(watchdog, getattr(fn, "__name__", "rank")) from None
    except ChildFailedError as e:
        if forward.received:  # the ranks ended because we passed a signal on: say that
            sig = signal.Signals(forward.received[0])
            raise SignalException(f"the launcher got {sig.name}", sigval=sig) from None
        lost = watchdog.verdict(e) or watchdog.cause_of_failure()
        if lost:
            raise RankLost(lost, e) from None
        raise
    finally:
        watchdog.stop()
        for logger, level in quiet.items():
            logger.setLevel(level)
        shutil.rmtree(log_dir, ignore_errors=True)
        if threading.current_thread() is threading.main_thread():
            for s, handler in saved.items():
                signal.signal(s, handler)
