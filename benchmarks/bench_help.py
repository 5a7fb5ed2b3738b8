"""How long `minitron --help` and every subcommand's `--help` take to answer.

Each is a fresh ``python -m minitron <command> --help`` process (the interpreter's start-up
included, as a user sees it), run ``--repeats`` times in alternation; the median wall time per
command is printed. The goal is under 2 s each on the 2-core course machine: the command
line imports torch only inside the commands that need it.

    .venv/bin/python benchmarks/bench_help.py                    # this checkout, 5 rounds
    .venv/bin/python benchmarks/bench_help.py --before /tmp/before # beside another tree, alternating
    .venv/bin/python benchmarks/bench_help.py --smoke            # one round of two commands (the tests)

Prints one line per command and a JSON line at the end ({command: median seconds}).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def subcommands(root: str) -> list[str]:
    """The subcommands the parser of the tree at ``root`` knows (asked in a child process)."""
    code = ("import argparse; from minitron.tools.cli import build_parser; "
            "sub = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)][0]; "
            "print(' '.join(sub.choices))")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=_env(root), capture_output=True,
                         text=True, check=True)
    return out.stdout.split()


def _env(root: str) -> dict:
    return {**os.environ, "PYTHONPATH": root}


def help_seconds(root: str, argv: list[str]) -> float:
    """Wall seconds of one ``python -m minitron ARGV --help`` (it must exit 0)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "minitron", *argv, "--help"], cwd=root, env=_env(root),
                   stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def _label(argv: list[str]) -> str:
    return " ".join(argv) or "(none)"


def time_trees(roots: dict[str, str], commands: list[list[str]], repeats: int) -> dict:
    """{tree: {command: median seconds}}, the trees' runs of a command alternating within each
    round (a shared machine's load drifts; alternation puts both sides under the same load)."""
    times = {t: {_label(c): [] for c in commands} for t in roots}
    for _ in range(repeats):
        for c in commands:
            for t, root in roots.items():
                times[t][_label(c)].append(help_seconds(root, c))
    return {t: {c: round(statistics.median(x), 3) for c, x in per.items()} for t, per in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=ROOT, help="the tree whose minitron is timed (default: this checkout)")
    ap.add_argument("--before", default="", help="another tree (e.g. `git archive` of an older commit), timed "
                    "in alternation with --root")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="one round of `--help` and `train --help`")
    args = ap.parse_args(argv)
    commands = [[]] + [[c] for c in subcommands(args.root)]
    if args.smoke:
        commands, args.repeats = commands[:2], 1
    roots = {"before": args.before, "now": args.root} if args.before else {"now": args.root}
    medians = time_trees(roots, commands, args.repeats)
    for c in medians["now"]:
        was = f" (before: {medians['before'][c]:.2f} s)" if "before" in medians else ""
        print(f"minitron {c if c != '(none)' else ''} --help: {medians['now'][c]:.2f} s{was}, median of {args.repeats}")
    print(json.dumps(medians))
    return 0


if __name__ == "__main__":
    sys.exit(main())
