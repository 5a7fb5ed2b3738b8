#!/bin/bash
# A scaling sweep: one `slurm/train.sbatch` job per layout, one metrics file per layout,
# and a last job that tabulates them (throughput, model FLOP/s, final loss).
#
#   LAYOUTS="dp8.tp1.pp1 dp4.tp2.pp1 dp2.tp4.pp1 dp2.tp2.pp2" GPUS_PER_NODE=8 slurm/sweep.sh
#   LAYOUTS="dp1.tp1.pp1 dp2.tp1.pp1 dp4.tp1.pp1" MODEL=tiny STEPS=20 WAIT=1 slurm/sweep.sh  # CPU, local
#   slurm/sweep.sh --summary runs/sweep-20250101-120000       # (re)print the table of a sweep
#
# A layout is dpD.tpT.ppP (optionally .vV for interleaved stages: dp2.tp2.pp2.v2, which
# sets SCHEDULE=interleaved unless SCHEDULE is given). Its job gets D*T*P tasks on
# ceil(D*T*P / TASKS_PER_NODE) nodes, tasks spread evenly, placed in blocks: with the
# tensor rank varying fastest, each tensor-parallel group of T <= TASKS_PER_NODE ranks
# stays inside one node (see the header of train.sbatch for the whole mapping).
#
# Environment (all optional):
#   LAYOUTS         the layouts (default: the 8-rank ones above)
#   TASKS_PER_NODE  tasks (= GPUs) per node (default: GPUS_PER_NODE, else 8)
#   GPUS_PER_NODE   GPUs per node to request (default 0: CPU ranks, BACKEND=gloo)
#   OUT             output folder (default runs/sweep-<date>); OUT/<layout>.metrics.jsonl,
#                   OUT/<layout>.out (job log), OUT/summary.txt
#   CHAIN=1         run the jobs one after another (--dependency=afterany), so they do not
#                   share nodes and timings are fair (default 1; 0: all at once)
#   WAIT=1          block until the sweep is done, then print the summary
#   SBATCH_ARGS     more sbatch flags for every job (e.g. "--partition=gpu --time=00:30:00")
#   MODEL, STEPS, GLOBAL_BATCH, MICROBATCHES, DTYPE, ARGS, PYTHON ... as in train.sbatch.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

die() { echo "sweep.sh: error: $*" >&2; exit 2; }

pick_python() {
  if [[ -n ${PYTHON:-} ]]; then echo "$PYTHON"
  elif [[ -n ${VIRTUAL_ENV:-}${CONDA_PREFIX:-} ]] && command -v python >/dev/null; then echo python
  elif [[ -x .venv/bin/python ]]; then echo "$PWD/.venv/bin/python"
  else echo python3; fi
}

summary() {  # summary DIR [LAYOUT...]: one row per layout (default: per DIR/*.metrics.jsonl)
  "$(pick_python)" - "$@" <<'EOF'
import json, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
layouts = sys.argv[2:] or [f.name[: -len(".metrics.jsonl")] for f in sorted(out.glob("*.metrics.jsonl"))]
rows, failed = [], []
for layout in layouts:
    f = out / f"{layout}.metrics.jsonl"
    recs = [json.loads(line) for line in f.read_text().splitlines() if line.strip()] if f.exists() else []
    if not recs:
        failed.append(layout)
        continue
    timed = recs[min(2, len(recs) - 1):]  # skip warm-up steps
    rows.append((layout, recs[-1]["step"], recs[-1]["loss"],
                 statistics.median(r["tokens_per_s"] for r in timed),
                 statistics.median(r["model_flops_per_s"] for r in timed)))
print(f"{'layout':<18} {'steps':>6} {'loss':>8} {'tokens/s':>12} {'model TFLOP/s':>14}")
for layout, steps, loss, tps, fps in rows:
    print(f"{layout:<18} {steps:>6} {loss:>8.4f} {tps:>12.1f} {fps / 1e12:>14.4f}")
for layout in failed:
    print(f"{layout:<18} no metrics: see {out / (layout + '.out')}")
sys.exit(1 if failed else 0)
EOF
}

if [[ ${1:-} == --summary ]]; then
  [[ -d ${2:-} ]] || die "--summary needs a sweep folder"
  shift
  summary "$@"
  exit
fi
command -v sbatch >/dev/null || die "no sbatch here: run on a Slurm login node (or slurm/setup_local_slurm.sh)"

LAYOUTS=${LAYOUTS:-"dp8.tp1.pp1 dp4.tp2.pp1 dp2.tp4.pp1 dp2.tp2.pp2"}
GPUS_PER_NODE=${GPUS_PER_NODE:-0}
if (( GPUS_PER_NODE > 0 )); then TASKS_PER_NODE=${TASKS_PER_NODE:-$GPUS_PER_NODE}; fi
TASKS_PER_NODE=${TASKS_PER_NODE:-8}
OUT=${OUT:-runs/sweep-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
read -r -a sb_extra <<<"${SBATCH_ARGS:-}"

ids=()
prev=""
for layout in $LAYOUTS; do
  [[ $layout =~ ^dp([0-9]+)\.tp([0-9]+)\.pp([0-9]+)(\.v([0-9]+))?$ ]] \
    || die "layout '$layout' is not dpD.tpT.ppP[.vV], e.g. dp2.tp2.pp1"
  dp=${BASH_REMATCH[1]} tp=${BASH_REMATCH[2]} pp=${BASH_REMATCH[3]} vpp=${BASH_REMATCH[5]:-1}
  n=$((dp * tp * pp))
  nodes=$(( (n + TASKS_PER_NODE - 1) / TASKS_PER_NODE ))
  (( n % nodes == 0 )) || die "layout $layout: $n tasks do not spread evenly over $nodes nodes of $TASKS_PER_NODE"
  per_node=$((n / nodes))
  if (( nodes > 1 && tp > per_node )); then
    echo "sweep.sh: warning: $layout: TP=$tp > $per_node tasks per node, tensor groups span nodes" >&2
  fi
  sched=${SCHEDULE:-}
  if [[ -z $sched && $vpp -gt 1 ]]; then sched=interleaved; fi
  args=(--parsable --job-name="minitron-$layout" --output="$OUT/$layout.out"
        --nodes="$nodes" --ntasks="$n" --ntasks-per-node="$per_node")
  if (( GPUS_PER_NODE > 0 )); then args+=(--gpus-per-node="$per_node"); fi
  if [[ ${CHAIN:-1} == 1 && -n $prev ]]; then args+=(--dependency="afterany:$prev"); fi
  exports="ALL,DP=$dp,TP=$tp,PP=$pp,VPP=$vpp,METRICS=$OUT/$layout.metrics.jsonl"
  if [[ -n $sched ]]; then exports+=",SCHEDULE=$sched"; fi
  if (( GPUS_PER_NODE == 0 )); then exports+=",BACKEND=${BACKEND:-gloo}"; fi
  rm -f "$OUT/$layout.metrics.jsonl"
  id=$(sbatch "${args[@]}" "${sb_extra[@]}" --export="$exports" "$HERE/train.sbatch")
  id=${id%%;*}
  echo "submitted $layout: job $id ($n tasks on $nodes node(s))"
  ids+=("$id")
  prev=$id
done

dep=$(IFS=:; echo "afterany:${ids[*]}")
wait_flag=()
if [[ ${WAIT:-0} == 1 ]]; then wait_flag=(--wait); fi
py=$(pick_python)
rc=0
sid=$(sbatch --parsable "${wait_flag[@]}" --job-name=minitron-sweep-summary --ntasks=1 \
  "${sb_extra[@]}" --dependency="$dep" --output="$OUT/summary.txt" \
  --export="ALL,PYTHON=$py" --wrap="bash '$HERE/sweep.sh' --summary '$OUT' $LAYOUTS") || rc=$?
echo "summary job ${sid%%;*}: $OUT/summary.txt"
if [[ ${WAIT:-0} == 1 ]]; then
  cat "$OUT/summary.txt"
  exit "$rc"
fi
