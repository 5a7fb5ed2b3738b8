"""Settings for every test session, and its hygiene check.

A session must clean up after itself: no `torchelastic_*` folder (the elastic agent's
scratch space), no `minitron_ranks_*` or `minitron-lab-*` folder (the launcher's and a lab
checker's) and no new /dev/shm entry (shared memory, named semaphores) may outlive
it. The session gets a temporary folder of its own (TMPDIR, for the ranks and commands it
starts too), so what is found there is its own even while other sessions run beside it;
a /dev/shm entry counts when it is new and no live process maps or holds it (nor, for a
multiprocessing semaphore, a live resource tracker will unlink it). Checked in
`pytest_sessionfinish`, which runs after any selection (-k, -x, a single test): the
session then fails with one line naming what was left.
"""
import atexit
import getpass
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

# One thread per rank and per test process: the machine has 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

SHM = Path("/dev/shm")
# what a launch leaves in the temporary folder when it does not clean up: the elastic agent's
# scratch space, minitron's launcher folder (pids, heartbeats; removed by the launcher, or by
# its ranks when the launcher is killed) and a lab checker's result folder
SCRATCH_LEFTOVERS = ("torchelastic_*", "minitron_ranks_*", "minitron-lab-*")
_STATE = pytest.StashKey[dict]()
_SHARE = pytest.StashKey["str | None"]()


def _shm_entries() -> set[str]:
    return {str(p) for p in SHM.iterdir()} if SHM.is_dir() else set()


def _shm_in_use() -> set[str]:
    """The /dev/shm entries that a live process maps or holds open, and multiprocessing's
    named semaphores (sem.mp-*) while a resource tracker lives: it unlinks them when its
    program ends (this session's own tracker ends after this check)."""
    used, tracker = set(), False
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            tracker = tracker or b"multiprocessing.resource_tracker" in (proc / "cmdline").read_bytes()
            for line in (proc / "maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    used.add(line[line.index("/dev/shm/"):].removesuffix(" (deleted)"))
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("/dev/shm/"):
                    used.add(target)
        except OSError:  # a process that ended meanwhile, or not ours to read
            continue
    return used | ({e for e in _shm_entries() if Path(e).name.startswith("sem.mp-")} if tracker else set())


def leftovers(scratch: Path, shm_before: set[str], grace_s: float = 10) -> list[str]:
    """What a session left behind: launch folders (SCRATCH_LEFTOVERS) in its temporary folder, and
    /dev/shm entries that appeared since `shm_before` and that no live process uses, still
    there after `grace_s` seconds (a multiprocessing program's resource tracker unlinks its
    semaphores as the program ends: a command that is just ending is given that time)."""
    found = sorted(str(p) for pattern in SCRATCH_LEFTOVERS for p in scratch.glob(pattern))
    end = time.monotonic() + grace_s
    while True:
        shm = (_shm_entries() - shm_before) - _shm_in_use()
        if not shm or time.monotonic() > end:
            return found + sorted(shm)
        time.sleep(0.5)


def _remove_scratch(state: dict) -> None:
    """At exit, after multiprocessing has removed its own folders from the scratch folder
    (registered before multiprocessing is imported, so run after its exit handler): remove
    the folder of a clean session."""
    if state.get("clean"):
        shutil.rmtree(state["scratch"], ignore_errors=True)


# `make test` (scripts/run_tests.sh) runs the suite as two sessions side by side, one per core:
# the "ranks" share (tests that start ranks, a Slurm cluster or a browser: each takes the
# machine's cores for itself, so they run one after another, and a timing-sensitive test — a
# watchdog, a heartbeat, a preemption — keeps the machine it was written for) and the "single"
# share (single-process tests, and the notebooks: a kernel is one process, their launches are
# of 2-4 ranks). MINITRON_TEST_SHARE picks one; unset, a session runs everything.
RANKS_SHARE_MARKERS = ("multirank", "slurm", "browser")
SINGLE_SHARE_FILES = ("test_notebooks.py", "test_lab_notebooks.py")
SHARES = ("ranks", "single")
SHARE_ENV = "MINITRON_TEST_SHARE"


def test_share(item) -> str:
    """The share ("ranks" or "single") a collected test runs in."""
    if item.path.name in SINGLE_SHARE_FILES:
        return "single"
    return "ranks" if any(item.get_closest_marker(m) for m in RANKS_SHARE_MARKERS) else "single"


def pytest_configure(config):
    share = os.environ.pop(SHARE_ENV, None)  # popped: the pytest sessions a test starts run whole
    if share is not None and share not in SHARES:
        raise pytest.UsageError(f"{SHARE_ENV}={share!r}: choose one of {', '.join(SHARES)} (or leave it unset)")
    config.stash[_SHARE] = share


def pytest_collection_modifyitems(config, items):
    share = config.stash.get(_SHARE, None)
    if share is None:
        return
    keep = [i for i in items if test_share(i) == share]
    config.hook.pytest_deselected(items=[i for i in items if test_share(i) != share])
    items[:] = keep


def pytest_sessionstart(session):
    scratch = Path(tempfile.mkdtemp(prefix="minitron_tests_"))
    state = {"scratch": scratch, "shm": _shm_entries(), "env": os.environ.get("TMPDIR"), "tempdir": tempfile.tempdir}
    session.config.stash[_STATE] = state
    atexit.register(_remove_scratch, state)
    # torch.compile's cache stays where it was, shared between sessions (it is not scratch)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"))
    os.environ["TMPDIR"] = str(scratch)  # for the processes the tests start
    tempfile.tempdir = str(scratch)  # for this one (tempfile's documented override)


def pytest_sessionfinish(session, exitstatus):
    state = session.config.stash.get(_STATE, None)
    if state is None:
        return
    tempfile.tempdir = state["tempdir"]
    if state["env"] is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = state["env"]
    left = leftovers(state["scratch"], state["shm"])
    if not left:
        state["clean"] = True
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    line = (f"the test session left behind {', '.join(left)}: a test or the code it runs does not clean up "
            f"(remove them by hand once found)")
    if reporter is not None:
        reporter.write("\n")  # after the progress dots
        reporter.write_line(line, red=True)
    else:
        print(line)
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
