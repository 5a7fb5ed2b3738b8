"""Preemption-safe training: a signal ends the run at a step boundary, with a checkpoint.

A cluster takes nodes back by signalling the job (Slurm sends SIGTERM, or the signal of
``--signal=[B:]SIG@SECONDS`` that many seconds before the time limit; a user presses
Ctrl-C). Dying there loses up to ``--ckpt-every`` steps. Instead, as Megatron's
``--exit-signal-handler`` does, every rank only *records* the signal; the training loop
finishes the step in progress, all ranks agree on one step to stop after, write a
checkpoint of it, and the command exits with :data:`EXIT_PREEMPTED` — so that a batch
script (or Slurm's requeue) can tell "stopped early, resume me" from success and failure.

Agreement without an extra collective: the signal may reach the ranks at different
moments (or only some of them), and a rank that stops one step before the others would
leave them waiting in a collective. Every step ends with an all-reduce over all ranks
(the loss), so at the moment a rank reads its loss back after step k, no rank has read
back step k+1 yet. A rank holding a signal therefore proposes "stop at the next read-back"
in the process group's key-value store (first proposal wins, ``compare_set``), and every
rank looks at the store at each read-back: all of them see the proposal in time and stop
after the same step. The store is the rendezvous' control channel, not the training
wire: no byte of the traced communication changes.

A signal during start-up (the command checking its input, the ranks importing and joining
the process group) is noted by a :class:`SignalLog` that the command installs as soon as it
runs (only Python's own import of torch comes before: a signal there ends the process as
it would any program that has not begun); before the first step the ranks compare notes
(:func:`agree_before_start`) and, if any rank was signalled, none trains: nothing was done,
so nothing needs saving, and the command exits with :data:`EXIT_PREEMPTED` as well. 75
rather than 128 + the signal: running the same command again loses nothing (it starts
over, or continues from the checkpoint it had resumed from, which is unchanged), which is
what "try again" promises, and a batch script requeues a job preempted while starting as
it does one preempted while training.
"""
from __future__ import annotations

import signal
import threading

# sysexits.h EX_TEMPFAIL: "a temporary failure; the user is invited to retry". A run that
# exits with it stopped early on a signal, after writing a checkpoint: run it again with
# --resume (a Slurm script requeues the job on this code).
EXIT_PREEMPTED = 75

SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")  # Slurm's --signal often names USR1
_KEY = "minitron/stop_at_readback"
_START_KEY = "minitron/signal_before_start"


class SignalLog:
    """A signal handler that only notes the first signal: a rank installs it as it starts,
    so that a preemption during its start-up is not lost; `StopOnSignal` takes it over."""

    def __init__(self):
        self.signal: str | None = None
        self._saved: dict = {}

    def __call__(self, signum, frame=None) -> None:
        self.signal = self.signal or signal.Signals(signum).name

    def install(self) -> "SignalLog":
        for name in SIGNALS:
            sig = getattr(signal, name)
            self._saved[sig] = signal.signal(sig, self)
        return self

    def ignore_from_now(self) -> None:
        """Ignore these signals from here on (SIG_IGN), for a program that has decided (and
        printed) its exit code: Python restores the default handlers while it finalizes,
        so a signal then would still end it with 128 + the signal instead."""
        for name in SIGNALS:
            signal.signal(getattr(signal, name), signal.SIG_IGN)
        self._saved = {}

    def restore(self) -> None:
        """Put back the handlers that `install` replaced."""
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved = {}


def installed_log() -> SignalLog | None:
    """The SignalLog now handling SIGTERM in this process, if one is."""
    handler = signal.getsignal(signal.SIGTERM)
    return handler if isinstance(handler, SignalLog) else None


def agree_before_start(store, world: int, rank: int) -> str | None:
    """Call on every rank before the first step: the signal any rank noted while starting
    (the same answer on every rank), or None. Each rank posts what its SignalLog noted
    and reads every rank's post, through the process group's store (None: one process)."""
    log = installed_log()
    noted = log.signal if log is not None else None
    if store is None or world == 1:
        return noted
    store.set(f"{_START_KEY}/{rank}", noted or "")
    keys = [f"{_START_KEY}/{r}" for r in range(world)]
    store.wait(keys)
    return next((name for name in (store.get(k).decode() for k in keys) if name), None)


class StopOnSignal:
    """Records SIGTERM/SIGINT/SIGUSR1 instead of dying; `should_stop()` at every read-back
    says, identically on every rank, whether to stop there.

    ``store`` is the process group's key-value store (None for a single process).
    Use as a context manager around the training loop; the previous handlers come back
    on exit. Outside the main thread (signals cannot be caught there) it only agrees."""

    def __init__(self, store=None):
        self.store = store
        self._log = SignalLog()
        self.readbacks = 0  # read-backs passed: the same count on every rank
        self._saved: dict = {}

    @property
    def signal(self) -> str | None:
        """The name of the first signal this process received, or None."""
        return self._log.signal

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for name in SIGNALS:
                sig = getattr(signal, name)
                self._saved[sig] = signal.signal(sig, self._log)
                if isinstance(self._saved[sig], SignalLog) and self._saved[sig].signal:
                    self._log.signal = self._log.signal or self._saved[sig].signal  # came during start-up
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved = {}

    def should_stop(self) -> bool:
        """Call at each loss read-back, on every rank: True when the run must stop here."""
        self.readbacks += 1
        if self.store is None:
            return self.signal is not None
        if self.signal is not None:  # propose the next read-back (the first proposal wins)
            agreed = int(self.store.compare_set(_KEY, "", str(self.readbacks + 1)))
        elif self.store.check([_KEY]):
            agreed = int(self.store.get(_KEY))
        else:
            return False
        return self.readbacks >= agreed


def process_group_store():
    """The default process group's key-value store, or None when there is no group.
    (torch exposes it only under a private name; it is the store every rank joined.)"""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    return dist.distributed_c10d._get_default_store()
