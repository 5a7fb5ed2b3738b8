#!/usr/bin/env bash
# Issue 8's GPU figures on one GPU (H100 or H200), in one go: the machine, a correctness
# check of the CUDA path against the CPU, then `minitron bench` of a ~1.3B GPT at
# sequence 2048 in bf16, eager and compiled, each with a profile of what limits it.
# Run from the repository root on a GPU node:  bash benchmarks/gpu.sh [OUTDIR]
# (PYTHONPATH=. lets it run from a checkout without installing; torch, einops and tqdm
# must be importable). Copy the JSON figures into RESULTS.md with the date and machine.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/machine.txt"
$PY -c "import torch; print('torch', torch.__version__, torch.version.cuda)" | tee -a "$OUT/machine.txt"

# 1. The CUDA path trains the same model as the CPU path (float64, tight tolerance).
$PY - <<'EOF' | tee "$OUT/cuda_vs_cpu.txt"
import torch
from minitron.config import ParallelConfig, TrainConfig, preset
from minitron.train import Trainer
m, t = preset("small"), TrainConfig(global_batch=8, dtype="float64", progress=False)
gpu, cpu = Trainer(m, ParallelConfig(device="cuda"), t), Trainer(m, ParallelConfig(device="cpu"), t)
diffs = [abs(gpu.step(i) - cpu.step(i)) for i in range(3)]
worst = max(float((p.cpu() - q).abs().max()) for p, q in zip(gpu.params, cpu.params))
print(f"cuda vs cpu float64: max |loss diff| {max(diffs):.3e}, max |param diff| {worst:.3e}")
assert max(diffs) < 1e-9 and worst < 1e-9
EOF

# 2. The benchmark: ~1.3B parameters, s = 2048, bf16 autocast with fp32 master weights.
# Microbatches of 2 sequences: minitron and PlainGPT (16 bytes of state per parameter
# each, ~42 GB together) plus one step's activations must fit in 80 GB.
BENCH=(bench --model gpt-1.3b --precision bf16 --global-batch 8 --microbatches 4 --bench-steps 8 --warmup-steps 3 --profile --json)
$PY -m minitron "${BENCH[@]}" | tail -1 | tee "$OUT/bench_eager.json"
$PY -m minitron "${BENCH[@]}" --compile | tail -1 | tee "$OUT/bench_compiled.json"
$PY - "$OUT" <<'EOF'
import json, sys
for name in ("bench_eager", "bench_compiled"):
    r = json.load(open(f"{sys.argv[1]}/{name}.json"))
    print(f"{name}: step {r['minitron_step_s']:.3f} s, overhead {r['overhead_ratio']:.3f}, "
          f"{r['model_flops_per_s'] / 1e12:.0f} TFLOP/s, MFU {r['mfu']:.3f} of measured "
          f"{r['device_peak_flops_per_s'] / 1e12:.0f}, {r['mfu_datasheet'] or 0:.3f} of datasheet")
    print("    by kind: " + ", ".join(f"{k} {v:.1%}" for k, v in r["profile_kinds"].items())
          + f"; MFU if only matmuls and attention took time: {r['mfu_ceiling']:.3f}")
    for p in r["profile"][:8]:
        print(f"    {p['share']:6.1%}  {p['kind']:>13}  {p['op'][:70]}")
EOF
