"""PTD-P's analytical takeaways, measured on the engine (lesson 6).

Takeaway 3 of Narayanan et al. 2021 (§3.4): with a global batch of B sequences, microbatches
of b sequences and p pipeline stages, the time of one batch through a pipeline is

    (B/b + p − 1) · (t_f(b) + t_b(b))

where t_f(b) and t_b(b) are the forward and backward time of one microbatch on one stage.
Larger b uses the hardware better (t(b)/b falls) but makes fewer microbatches and so a
larger bubble (p − 1 of them). :func:`time_microbatch` measures t_f and t_b on the engine's
own GPT; :func:`pipeline_batch_time` evaluates the formula.
"""
from __future__ import annotations

import time

import torch

from ..config import ModelConfig
from ..context import Context
from ..model import GPT


def time_microbatch(model: ModelConfig, sizes=(1, 2, 4, 8), repeats: int = 3, seed: int = 0) -> list[dict]:
    """Seconds of one forward (t_f) and one backward (t_b) of the engine's GPT on a
    microbatch of b sequences, for each b in `sizes` (the fastest of `repeats`, after a
    warm-up): ``[{b, t_f, t_b}]``."""
    gpt = GPT(model, Context(dtype=torch.float32))
    g = torch.Generator().manual_seed(seed)
    rows = []
    for b in sizes:
        x = torch.randint(0, model.vocab, (b, model.seq_len), generator=g)
        y = torch.randint(0, model.vocab, (b, model.seq_len), generator=g)
        best_f = best_b = float("inf")
        for k in range(repeats + 1):
            t0 = time.perf_counter()
            loss = gpt(x, y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            gpt.zero_grad(set_to_none=True)
            if k:  # the first pass warms up
                best_f, best_b = min(best_f, t1 - t0), min(best_b, t2 - t1)
        rows.append({"b": b, "t_f": best_f, "t_b": best_b})
    return rows


def pipeline_batch_time(global_batch: int, b: int, p: int, t_f: float, t_b: float) -> float:
    """PTD-P §3.4: ``(B/b + p − 1) · (t_f(b) + t_b(b))``, the time of a batch of B
    sequences in microbatches of b through p stages."""
    return (global_batch / b + p - 1) * (t_f + t_b)
