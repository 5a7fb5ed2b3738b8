"""`minitron bench`: minitron beside plain PyTorch and beside the device's own peak.

In one run: the dense matmul peak of the device (a large matmul in the run's dtype),
minitron's step time on the layout, and the step time of `PlainGPT` — a GPT of the same
shape written for the benchmark with no parallelism machinery (nanoGPT style) — on the
same batches. The ratio of the two step times is the engine's overhead; model FLOP/s
over the measured peak is the MFU. Warm-up steps are excluded; medians are reported,
and the two models alternate step by step so that machine noise hits both alike.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from ..analysis.flops import hardware_flops_per_iteration
from ..config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from ..model_flops import model_flops_per_step
from ..context import TORCH_DTYPES
from ..data import batch
from ..train import Trainer

DATASHEET_PEAK = {  # dense bf16/fp16 tensor-core FLOP/s; the first name found in the device's wins
    "H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H200": 989e12, "A100": 312e12, "V100": 125e12,
}


class StepTimer:
    """Wall time of each step. On a GPU, CUDA events around each step, read once at the
    end, so that timing adds no host synchronisation inside the loop (a gap where the
    GPU waits for the host still counts); on the CPU, perf_counter."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.marks = []

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Durations between consecutive pairs of marks (start, end, start, end, ...)."""
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks[::2], self.marks[1::2])]
        return [b - a for a, b in zip(self.marks[::2], self.marks[1::2])]


class MatmulProbe:
    """One dense n×n @ n×n product in the run's dtype: the device's peak, sampled
    between the benchmark's steps so that it sees the same machine load they do."""

    def __init__(self, dtype=torch.float32, device=None, n: int | None = None):
        device = device or torch.device("cpu")
        n = n or (8192 if device.type == "cuda" else 1024)
        self.a, self.b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
        self.out = torch.empty(n, n, dtype=dtype, device=device)
        self.flops = 2 * n ** 3

    def __call__(self, _step=None):
        torch.mm(self.a, self.b, out=self.out)


# A benchmark's timed and warm-up steps: a few dozen give a steady mean; past this bound a
# typo (an extra zero or three) would keep the machine busy for hours.
MAX_BENCH_STEPS = 1000


def check_counts(bench_steps: int, warmup_steps: int) -> None:
    """--bench-steps and --warmup-steps within MAX_BENCH_STEPS (a ConfigError otherwise)."""
    for flag, n in (("--bench-steps", bench_steps), ("--warmup-steps", warmup_steps)):
        if n > MAX_BENCH_STEPS:
            raise ConfigError(f"{flag} {n} is more than the {MAX_BENCH_STEPS} a benchmark needs (each step is timed "
                              f"{'twice: minitron and plain PyTorch' if flag == '--bench-steps' else 'as warm-up'}): "
                              f"use 10 to 100")


def probe_dtype(layout: ParallelConfig, train: TrainConfig) -> torch.dtype:
    """The dtype the run's matmuls use: bf16 under autocast, else the parameters'."""
    return torch.bfloat16 if layout.precision == "bf16" else TORCH_DTYPES[train.dtype]


def alternate(runs: dict, device, warmup: int, steps: int) -> dict[str, float]:
    """Median seconds of each callable in `runs` (called with the step index), after
    `warmup` untimed rounds; they alternate round by round, so noise hits all alike."""
    for i in range(warmup):  # compilation, allocator and autotuning warm-up
        for fn in runs.values():
            fn(i)
    timers = {k: StepTimer(device) for k in runs}
    for i in range(warmup, warmup + steps):
        for k, fn in runs.items():
            timers[k].mark()
            fn(i)
            timers[k].mark()
    return {k: statistics.median(timers[k].seconds()) for k in runs}


def matmul_peak(dtype=torch.float32, device=None, n: int | None = None, reps: int = 5) -> float:
    """Measured dense matmul FLOP/s: median over `reps` products (after two warm-ups)."""
    probe = MatmulProbe(dtype, device, n)
    return probe.flops / alternate({"peak": probe}, probe.a.device, 2, reps)["peak"]


def datasheet_peak(device) -> float | None:
    """The datasheet's dense bf16 peak of a known GPU (None on the CPU or an unknown GPU)."""
    return peak_for_name(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def peak_for_name(name: str) -> float | None:
    """'NVIDIA H100 PCIe' -> 756e12: the most specific entry of DATASHEET_PEAK in `name`."""
    return next((v for k, v in DATASHEET_PEAK.items() if k in name), None)


class PlainBlock(nn.Module):
    """One pre-LN transformer block in plain PyTorch (nanoGPT style)."""

    def __init__(self, model: ModelConfig):
        super().__init__()
        self.heads = model.heads
        self.ln1, self.ln2 = nn.LayerNorm(model.hidden), nn.LayerNorm(model.hidden)
        self.qkv, self.proj = nn.Linear(model.hidden, 3 * model.hidden), nn.Linear(model.hidden, model.hidden)
        self.fc, self.fc2 = nn.Linear(model.hidden, model.ffn_hidden), nn.Linear(model.ffn_hidden, model.hidden)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, self.heads, 3, -1).permute(3, 0, 2, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, -1))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class PlainGPT(nn.Module):
    """The same GPT shape in plain PyTorch modules: the benchmark's reference."""

    def __init__(self, model: ModelConfig):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(model.vocab, model.hidden), nn.Embedding(model.seq_len, model.hidden)
        self.blocks = nn.ModuleList(PlainBlock(model) for _ in range(model.layers))
        self.ln_f, self.head = nn.LayerNorm(model.hidden), nn.Linear(model.hidden, model.vocab, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe.weight[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _plain_stepper(model: ModelConfig, train: TrainConfig, corpus, device, precision: str, compile: bool = False):
    net = PlainGPT(model).to(device=device, dtype=TORCH_DTYPES[train.dtype])
    if compile:  # as minitron's --compile does: each block
        for block in net.blocks:
            block.compile()
    opt = torch.optim.AdamW(net.parameters(), lr=train.lr, betas=(0.9, 0.95), weight_decay=train.weight_decay,
                            fused=True)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    def step(i):
        x, y = batch(corpus, model.seq_len, train.global_batch, train.seed, i)
        x, y = x.to(device), y.to(device)
        opt.zero_grad(set_to_none=True)
        for xm, ym in zip(x.chunk(train.microbatches), y.chunk(train.microbatches)):
            with amp:
                loss = net(xm, ym) / train.microbatches
            loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), train.clip)
        opt.step()
    return step


# What kind of work an operator is (by its profiler name, ATen on CPU and GPU alike).
OP_KINDS = (
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addmv", "aten::_scaled_mm")),
    ("attention", ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")),
    ("optimizer", ("adamw", "Optimizer.step", "_foreach_")),
    ("communication", ("c10d::", "nccl", "gloo", "record_param_comms")),
)


def op_kind(name: str) -> str:
    """'matmul', 'attention', 'optimizer', 'communication' or 'other' (elementwise,
    norms, copies, the framework's own work) for a profiler operator name."""
    for kind, marks in OP_KINDS:
        if any(name == m or (not m.startswith("aten::") and m in name) for m in marks):
            return kind
    return "other"


def profile_steps(step, device, first: int, n: int = 2, top: int = 12) -> dict:
    """What limits a step: torch.profiler over `n` steps, self time per operator (device
    time on a GPU, CPU time otherwise), as shares of the total.

    Returns ``{"ops": [top operators], "kinds": {kind: share}}`` with kinds from
    :func:`op_kind`. On a GPU only host-side operators are counted, each with the time
    of the kernels it launched (the kernels themselves are listed by the profiler too:
    counting both would count every kernel twice)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for i in range(first, first + n):
            step(i)
        if cuda:
            torch.cuda.synchronize()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if e.device_type == DeviceType.CPU and getattr(e, attr, 0) > 0]
    total = sum(getattr(e, attr) for e in events)
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    kinds: dict[str, float] = {k: 0.0 for k, _ in OP_KINDS} | {"other": 0.0}
    for e in events:
        kinds[op_kind(e.key)] += getattr(e, attr) / total
    ops = [{"op": e.key, "kind": op_kind(e.key), "share": getattr(e, attr) / total,
            "calls_per_step": e.count / n, "ms_per_step": getattr(e, attr) / 1e3 / n} for e in events[:top]]
    return {"ops": ops, "kinds": kinds}


def mfu_ceiling(mfu: float, kinds: dict) -> float:
    """The MFU the step would reach if everything but its matmuls and attention took no
    time (the kernels as fast as they ran): what fusing or removing the rest can buy."""
    useful = kinds["matmul"] + kinds["attention"]
    return mfu / useful if useful > 0 else float("nan")


def bench_single(model: ModelConfig, layout: ParallelConfig, train: TrainConfig, corpus=None, steps: int = 10,
                 warmup: int = 3, profile: bool = False) -> dict:
    """Single-device benchmark: minitron and PlainGPT alternating, plus the matmul peak;
    with `profile`, also where minitron's step spends its time (`profile_steps`).
    `corpus`: the built-in text when None. ``hfu`` counts recomputed forwards too
    (``layout.recompute``; PlainGPT never recomputes)."""
    tr = Trainer(model, layout, train, corpus=corpus)
    device = tr.ctx.device
    plain = _plain_stepper(model, train, tr.train_data, device, layout.precision, layout.compile)
    probe = MatmulProbe(probe_dtype(layout, train), device)
    med = alternate({"minitron": tr.step_async, "reference": plain, "peak": probe}, device, warmup, steps)
    step_s, ref_s, mm_s = med["minitron"], med["reference"], med["peak"]
    peak = probe.flops / mm_s
    flops = model_flops_per_step(model, train.global_batch)
    sheet = datasheet_peak(device)
    out = {
        "model": model.name, "layout": layout.describe(), "dtype": train.dtype, "precision": layout.precision,
        "threads": torch.get_num_threads(), "device": str(device), "global_batch": train.global_batch,
        "minitron_step_s": step_s, "reference_step_s": ref_s, "overhead_ratio": step_s / ref_s,
        "tokens_per_s": train.global_batch * model.seq_len / step_s, "model_flops_per_s": flops / step_s,
        "device_peak_flops_per_s": peak, "mfu": flops / step_s / peak,
        "hfu": hardware_flops_per_iteration(model, train.global_batch, layout.recompute) / step_s / peak,
        "mfu_datasheet": flops / step_s / sheet if sheet else None, "steps_timed": steps,
    }
    if profile:
        prof = profile_steps(tr.step_async, device, first=warmup + steps)
        out.update(profile=prof["ops"], profile_kinds=prof["kinds"],
                   mfu_ceiling=mfu_ceiling(out["mfu"], prof["kinds"]))
    return out


def bench_job(comm, m, p, t, corpus, extra) -> dict | None:
    """Multi-rank step time of a layout (median after warm-up), reported by rank 0, with
    the per-device matmul peak measured on every rank at once between the steps (so that
    it sees the cores or links the ranks share); MFU is against world × that peak."""
    tr = Trainer(m, p, t, comm, corpus)
    device = tr.ctx.device
    probe = MatmulProbe(probe_dtype(p, t), device)
    steps, warmup = extra.get("steps", 10), extra.get("warmup", 3)
    times = {"step": StepTimer(device), "peak": StepTimer(device)}
    for i in range(warmup + steps):
        for k, fn in (("step", tr.step), ("peak", probe)):
            comm.barrier()
            if i >= warmup:
                times[k].mark()
            fn(i)
            comm.barrier()
            if i >= warmup:
                times[k].mark()
    step_s, mm_s = (statistics.median(times[k].seconds()) for k in ("step", "peak"))
    if comm.grid.rank != 0:
        return None
    flops_per_s = model_flops_per_step(m, t.global_batch) / step_s
    peak = p.world * probe.flops / mm_s
    return {"layout": p.describe(), "world": p.world, "minitron_step_s": step_s,
            "tokens_per_s": t.global_batch * m.seq_len / step_s, "model_flops_per_s": flops_per_s,
            "device_peak_flops_per_s": probe.flops / mm_s, "mfu": flops_per_s / peak,
            "hfu": hardware_flops_per_iteration(m, t.global_batch, p.recompute) / step_s / peak}
