#!/usr/bin/env bash
# The whole suite as two pytest sessions side by side (`make test`, what CI runs): the "ranks"
# share (tests that start ranks, a Slurm cluster or a browser, one after another) in view, and
# the "single" share (single-process tests and the notebooks) beside it, its report printed
# after. The split lives in tests/conftest.py (test_share). Exit status: the first failing share's.
set -u
PY=${1:-.venv/bin/python}
cd "$(dirname "$0")/.."
log=$(mktemp "${TMPDIR:-/tmp}/minitron-single-share.XXXXXX")
start=$(date +%s)
MINITRON_TEST_SHARE=single "$PY" -m pytest -q --durations=10 >"$log" 2>&1 &
single=$!
trap 'kill "$single" 2>/dev/null; rm -f "$log"' EXIT
echo "tests: the single-process share runs beside this one (its report follows)"
MINITRON_TEST_SHARE=ranks "$PY" -m pytest -q --durations=15
ranks_rc=$?
wait "$single"
single_rc=$?
echo
echo "=== the single-process share (ran beside the tests above) ==="
cat "$log"
echo "tests: both shares done in $(( $(date +%s) - start )) s (ranks exit $ranks_rc, single exit $single_rc)"
[ "$ranks_rc" -ne 0 ] && exit "$ranks_rc"
exit "$single_rc"
