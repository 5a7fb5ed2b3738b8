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

from .config import ModelConfig, ParallelConfig, TrainConfig
from .data import batch
from .train import DTYPES, Trainer, model_flops_per_step

DATASHEET_PEAK = {  # dense, bf16/fp16 tensor-core FLOP/s
    "H100": 989e12, "H200": 989e12, "A100": 312e12, "V100": 125e12,
}


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_peak(dtype=torch.float32, device=None, n: int | None = None, reps: int = 5) -> float:
    """Measured dense matmul FLOP/s: median over `reps` of one n×n @ n×n product."""
    device = device or torch.device("cpu")
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    times = []
    for _ in range(reps + 2):
        sync(device)
        t0 = time.perf_counter()
        (a @ b).sum()  # .sum() keeps the product from being optimised away
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(times[2:])


def datasheet_peak(device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in DATASHEET_PEAK.items() if k in name), None)


class PlainGPT(nn.Module):
    """The same GPT shape in plain PyTorch modules: the benchmark's reference."""

    def __init__(self, m: ModelConfig):
        super().__init__()
        self.m = m
        self.wte, self.wpe = nn.Embedding(m.vocab, m.hidden), nn.Embedding(m.seq_len, m.hidden)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(
            ln1=nn.LayerNorm(m.hidden), qkv=nn.Linear(m.hidden, 3 * m.hidden), proj=nn.Linear(m.hidden, m.hidden),
            ln2=nn.LayerNorm(m.hidden), fc=nn.Linear(m.hidden, m.ffn_hidden), fc2=nn.Linear(m.ffn_hidden, m.hidden),
        )) for _ in range(m.layers))
        self.ln_f, self.head = nn.LayerNorm(m.hidden), nn.Linear(m.hidden, m.vocab, bias=False)

    def forward(self, idx, targets):
        b, s = idx.shape
        x = self.wte(idx) + self.wpe.weight[:s]
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](x)).view(b, s, self.m.heads, 3, -1).permute(3, 0, 2, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + blk["proj"](y.transpose(1, 2).reshape(b, s, -1))
            x = x + blk["fc2"](F.gelu(blk["fc"](blk["ln2"](x))))
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _plain_stepper(m: ModelConfig, t: TrainConfig, corpus, device, precision: str):
    model = PlainGPT(m).to(device=device, dtype=DTYPES[t.dtype])
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(0.9, 0.95), weight_decay=t.weight_decay,
                            fused=device.type == "cuda" or None)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    def step(i):
        x, y = batch(corpus, m.seq_len, t.global_batch, t.seed, i)
        x, y = x.to(device), y.to(device)
        opt.zero_grad(set_to_none=True)
        for xm, ym in zip(x.chunk(t.microbatches), y.chunk(t.microbatches)):
            with amp:
                loss = model(xm, ym) / t.microbatches
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip)
        opt.step()
    return step


def bench_single(m: ModelConfig, layout: ParallelConfig, t: TrainConfig, corpus, steps: int = 10,
                 warmup: int = 3) -> dict:
    """Single-device benchmark: minitron and PlainGPT alternating, plus the matmul peak."""
    tr = Trainer(m, layout, t, corpus=corpus)
    device = tr.ctx.device
    plain = _plain_stepper(m, t, tr.train_data, device, layout.precision)
    peak_dtype = torch.bfloat16 if layout.precision == "bf16" else DTYPES[t.dtype]
    peak = matmul_peak(peak_dtype, device)
    mine, ref = [], []
    for i in range(warmup + steps):
        for fn, out in ((tr.step, mine), (plain, ref)):
            sync(device)
            t0 = time.perf_counter()
            fn(i)
            sync(device)
            if i >= warmup:
                out.append(time.perf_counter() - t0)
    step_s, ref_s = statistics.median(mine), statistics.median(ref)
    flops = model_flops_per_step(m, t.global_batch)
    sheet = datasheet_peak(device)
    return {
        "model": m.name, "layout": layout.describe(), "dtype": t.dtype, "precision": layout.precision,
        "threads": torch.get_num_threads(), "device": str(device), "global_batch": t.global_batch,
        "minitron_step_s": step_s, "reference_step_s": ref_s, "overhead_ratio": step_s / ref_s,
        "tokens_per_s": t.global_batch * m.seq_len / step_s, "model_flops_per_s": flops / step_s,
        "device_peak_flops_per_s": peak, "mfu": flops / step_s / peak,
        "mfu_datasheet": flops / step_s / sheet if sheet else None, "steps_timed": steps,
    }


def bench_job(comm, m, p, t, corpus, extra) -> dict | None:
    """Multi-rank step time of a layout (median after warm-up), reported by rank 0."""
    tr = Trainer(m, p, t, comm, corpus)
    steps, warmup = extra.get("steps", 10), extra.get("warmup", 3)
    times = []
    for i in range(warmup + steps):
        comm.barrier()
        t0 = time.perf_counter()
        tr.step(i)
        comm.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    if comm.grid.rank != 0:
        return None
    step_s = statistics.median(times)
    return {"layout": p.describe(), "world": p.world, "minitron_step_s": step_s,
            "tokens_per_s": t.global_batch * m.seq_len / step_s,
            "model_flops_per_s": model_flops_per_step(m, t.global_batch) / step_s}

