"""`minitron train | verify | schedule | memory | plan | bench | tokenize | sample | export | sweep | check-ckpt`:
the command line.

Every option is checked before any process group starts; bad input prints one line,
`minitron: error: <problem and fix>`, and exits with status 2 (an error inside a rank too,
as one line). A training run stopped by SIGTERM/SIGINT/SIGUSR1 after checkpointing exits
with status 75 (`preemption.EXIT_PREEMPTED`).

Each command builds its own subparser next to the command it runs (`tools/commands/`,
`tools/check_ckpt.py`); this module registers them, in the order `--help` lists them.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading

from ..config import ConfigError
from . import check_ckpt
from .commands import bench, memory, plan, schedule, sweep, text, train, verify
from .commands.ranks import Interrupted
from .preflight import finite_positive


def build_parser() -> argparse.ArgumentParser:
    """The `minitron` parser: one subparser per command, each added by its own module."""
    ap = argparse.ArgumentParser(prog="minitron", description="Megatron-style parallel GPT training, small.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for family in (train, verify, schedule, memory, plan, bench):
        family.add_parser(sub)
    text.add_parsers(sub)  # tokenize, sample, export
    sweep.add_parser(sub)
    check_ckpt.add_parser(sub)
    return ap


def main(argv=None) -> int:
    """Parse `argv`, run the command; every error becomes one line and an exit code."""
    ap = build_parser()
    args = ap.parse_args(argv)
    from ..preemption import SignalLog

    # train: a signal from here on is noted (and ends the run cleanly), not fatal
    log = SignalLog().install() if args.cmd == "train" and threading.current_thread() is threading.main_thread() else None
    try:
        if hasattr(args, "timeout"):
            finite_positive("--timeout", args.timeout)
        return args.fn(args)
    except ConfigError as e:
        print(f"minitron: error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        print(f"minitron: stopped by {e.signal.name}", file=sys.stderr)
        return 128 + e.signal.value
    except KeyboardInterrupt:
        print("minitron: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one line for the user; the traceback on request
        if os.environ.get("MINITRON_DEBUG"):
            raise
        first = (str(e).strip().splitlines() or [""])[0][:300]
        print(f"minitron: error: {type(e).__name__}: {first} (MINITRON_DEBUG=1 prints the traceback)", file=sys.stderr)
        return 1
    finally:
        if log is not None and argv is not None:  # called from Python: give the caller its handlers back
            log.restore()
        elif log is not None:  # the program: its exit code is said; a second Ctrl-C must not change it
            log.ignore_from_now()


def entry() -> None:
    """The `minitron` program (also `python -m minitron`): run main() and exit with its code.

    A rank that torchrun or srun started ends with os._exit once main() has returned (its
    process group already destroyed): the interpreter's finalisation is skipped, where a C++
    thread of the process group that is still joinable calls std::terminate and turns a
    finished run's exit 0 into 134 (seen under srun, task 1, after the report was written)."""
    code = main()
    # only a command that started ranks imported the launcher (and made a process group);
    # `--help` and the analyses must not pay for importing torch to ask
    launch = sys.modules.get("minitron.launch")
    if launch is not None and launch.under_launcher():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)
    sys.exit(code)



if __name__ == "__main__":
    entry()
