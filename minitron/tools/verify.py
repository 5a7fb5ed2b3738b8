"""The oracle: a parallel layout must equal the single-device model.

`verify_job` trains the layout for N steps, gathers the full weights to rank 0 and
trains the single-device reference there — the same GPT class with every parallel
degree 1, same seed, same global batches (microbatches of the same size). It reports
the largest difference of the per-step losses and the largest relative difference of
any parameter tensor (max |Δ| / max |reference|) after the last step.
"""
from __future__ import annotations

import torch

from ..checkpoint import gather_full
from ..config import ModelConfig, ParallelConfig, TrainConfig
from ..train import Trainer

# float64 sums in another order agree to ~1e-14; Adam's update amplifies that a little.
TOLERANCE = {"float64": 1e-9, "float32": 2e-4, "bfloat16": 5e-2}


def reference_run(model: ModelConfig, train: TrainConfig, corpus, steps: int):
    """The single-device run: losses per step and its trainer."""
    ref = Trainer(model, ParallelConfig(), train, corpus=corpus)
    return [ref.step(i) for i in range(steps)], ref


def compare(losses, full: dict, ref_losses, ref_trainer) -> dict:
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    worst, worst_name = 0.0, ""
    for p in ref_trainer.params:
        mine = full[p.shard.name]["param"].to(p.dtype)
        scale = p.detach().abs().max().clamp_min(1e-30)
        d = float((mine - p.detach()).abs().max() / scale)
        if d > worst:
            worst, worst_name = d, p.shard.name
    return {"max_loss_abs_diff": loss_diff, "max_param_rel_diff": worst, "worst_param": worst_name}


def versus_one_device(comm, tr, losses, model: ModelConfig, train: TrainConfig) -> dict | None:
    """A trainer's run (`losses`, its parameters gathered from every rank: collective)
    against the single-device model trained on the same data: :func:`compare`'s dict plus
    ``reference_losses`` on rank 0, None on the other ranks. `train` describes the
    reference's steps (its microbatches: the whole global batch accumulated on one device)."""
    full = gather_full(tr)
    if comm.grid.rank != 0:
        return None
    torch.manual_seed(train.seed)
    ref_losses, ref = reference_run(model, train, tr.corpus, train.steps)
    return {**compare(losses, full, ref_losses, ref), "reference_losses": ref_losses}


def verify_job(comm, model, layout, train, corpus, extra) -> dict | None:
    """Run on every rank; rank 0 returns the verdict (a dict), others None."""
    tr = Trainer(model, layout, train, comm, corpus)
    losses = [tr.step(i) for i in range(train.steps)]
    if comm.trace is not None and train.trace:
        comm.trace.write(train.trace)
    if train.timeline and tr.pipeline is not None:
        tr.pipeline.write_timeline(train.timeline)
    reference = train.replace(microbatches=train.microbatches * layout.dp, trace="")
    res = versus_one_device(comm, tr, losses, model, reference)
    if res is None:
        return None
    tol = (extra or {}).get("tol") or TOLERANCE[train.dtype]
    res.update(ok=res["max_loss_abs_diff"] <= tol and res["max_param_rel_diff"] <= tol, tolerance=tol,
               steps=train.steps, layout=layout.describe(), losses=losses)
    return res
