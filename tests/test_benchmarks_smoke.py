"""Benchmarks are tested code: every script in benchmarks/ runs its `--smoke` mode (a tiny
model, one round, no results file written), so an interface change breaks this test rather
than a benchmark a user finds broken. A script without `--smoke` fails here."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
HELPERS = {"harness.py"}  # what the scripts share: a library, not a benchmark
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py") if p.name not in HELPERS)


def run_smoke(name: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(BENCHMARKS / name), "--smoke"], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=BENCHMARKS.parent)


def test_there_are_benchmarks():
    assert {"bench_pipeline.py", "bench_compile.py", "cube_vs_1d.py"} <= set(SCRIPTS)


@pytest.mark.multirank
@pytest.mark.parametrize("name", SCRIPTS)
def test_smoke_mode_runs(name):
    r = run_smoke(name)
    assert r.returncode == 0, f"{name} --smoke exited {r.returncode}:\n{r.stderr[-3000:]}"
    assert r.stdout.strip(), f"{name} --smoke printed nothing"


@pytest.mark.parametrize("argv, words", [
    (["bench_pipeline.py", "--schedules", "1f1b", "gpipe-ish"], "unknown schedule gpipe-ish: choose from 1f1b, interleaved"),
    (["cube_vs_1d.py", "--models", "tokens", "bigger"], "unknown model bigger: choose from tokens, weights"),
    (["bench_fp8.py", "--runs", "fp8", "bf16"], "unknown run fp8: choose from fp32, bf16, tensorwise, delayed, rowwise, mxfp8"),
])
def test_unknown_variants_are_refused_in_one_line(argv, words):
    r = subprocess.run([sys.executable, str(BENCHMARKS / argv[0]), *argv[1:]], capture_output=True,
                       text=True, timeout=300, cwd=BENCHMARKS.parent)
    assert r.returncode != 0 and r.stderr.strip() == words, r.stderr
