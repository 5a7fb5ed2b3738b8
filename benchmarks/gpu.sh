#!/usr/bin/env bash
# The GPU figures on one GPU (H100 or H200), in one go: the machine, a correctness check of
# the CUDA path against the CPU, `minitron bench` of a ~1.3B GPT at sequence 2048 in bf16,
# eager and compiled, each with a profile of what limits it, and a Llama 3 8B-shaped
# training run (its blocks, 4 of its 32 layers: a whole 8B model's 16 bytes of state per
# parameter would not fit one GPU) with tokens/s and MFU against the datasheet.
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

# 2b. FP8 (--precision fp8): the real kernel (torch._scaled_mm) against the CPU's emulation
# on the same quantized operands, then the benchmark's GPT with tensorwise and MXFP8 GEMMs
# beside the bf16 figures above. The FP8 runs keep everything outside the linears in fp32
# (no autocast; MXFP8 is emulated on the GPU too): a check that the recipe runs, not a
# Transformer Engine speed claim.
$PY - <<'EOF' | tee "$OUT/fp8_kernel_vs_emulation.txt"
import torch
from minitron.parallel import fp8
from minitron.config import ParallelConfig
from minitron.context import Context
torch.manual_seed(0)
for recipe in ("tensorwise", "rowwise"):
    x, w = torch.randn(256, 512, device="cuda"), torch.randn(384, 512, device="cuda") * 0.02
    ctx = Context(layout=ParallelConfig(precision="fp8", fp8_recipe=recipe))
    st = fp8.Fp8State("probe.fp8", recipe, fp8.Shards(), ctx)
    assert fp8.has_fp8_kernel(x), "this GPU has no FP8 kernel (compute capability 8.9+)"
    gpu = fp8.fp8_linear(x, w, None, st)
    cpu = fp8.fp8_linear(x.cpu(), w.cpu(), None, st)
    rel = float((gpu.cpu() - cpu).abs().max() / cpu.abs().max())
    print(f"fp8 {recipe}: _scaled_mm vs emulation max rel diff {rel:.2e}")
    assert rel < (1e-2 if recipe == "rowwise" else 1e-5)  # rowwise's kernel writes bf16
EOF
for R in tensorwise mxfp8; do
  $PY -m minitron bench --model gpt-1.3b --precision fp8 --fp8-recipe $R --global-batch 8 --microbatches 4 \
      --bench-steps 8 --warmup-steps 3 --json | tail -1 | tee "$OUT/bench_fp8_$R.json"
done

# 3. A Llama 3 8B-shaped run: h 4096, ffn 14336 (SwiGLU), 32 heads over 8 kv heads, rotary
# positions (θ 500,000), RMSNorm, vocabulary 128,256; 4 of its 32 layers at sequence 4096,
# bf16 autocast. Model FLOPs from model_flops.model_flops_per_step (GQA and SwiGLU counted).
LLAMA=(train --model llama3-8b --layers 4 --seq-len 4096 --precision bf16 --global-batch 8 --microbatches 8
       --steps 12 --log-every 4 --eval-every 0 --sample 0 --no-progress --metrics "$OUT/llama3_8b_shape.jsonl")
$PY -m minitron "${LLAMA[@]}" | tee "$OUT/llama3_8b_shape.txt"
$PY - "$OUT" <<'EOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(f"{sys.argv[1]}/llama3_8b_shape.jsonl") if '"tokens_per_s"' in line]
rows = rows[len(rows) // 3:]  # past the first steps (allocator, kernels' first calls)
tps = statistics.median(r["tokens_per_s"] for r in rows)
flops = statistics.median(r["model_flops_per_s"] for r in rows)
print(f"llama3-8b-shaped (4 layers, s 4096, bf16): {tps:,.0f} tokens/s, {flops / 1e12:.0f} TFLOP/s, "
      f"MFU {flops / 989e12:.3f} of the H100 SXM's dense bf16 989 TFLOP/s")
EOF
