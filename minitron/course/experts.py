"""The rank job of the mixture-of-experts lesson (lesson 11): one launch of 2 ranks that
trains a small mixture of experts (``moe-tiny``) for a few traced float64 steps under
``--ep 2`` and returns, per rank, the losses, the traced all-to-all calls and bytes on the
'ep' axis and the routing counts of every dispatch (every ep rank's kept choices per
expert), and on rank 0 the same steps on one device for the comparison.

It lives in a module because every rank is a fresh process that imports it by name.
"""
from __future__ import annotations

from ..comm import Comm, CommTrace
from ..config import PRESETS, ParallelConfig, TrainConfig

MOE = PRESETS["moe-tiny"].replace(seq_len=16)  # 4 experts, top-2, SwiGLU experts, h = 32
STEPS = 2


def train_config(**kw) -> TrainConfig:
    """Four sequences per step (two per ep rank), float64: the comparison is exact to rounding."""
    return TrainConfig(steps=STEPS, global_batch=4, lr=1e-2, warmup=1, eval_every=0, dtype="float64",
                       progress=False, sample_tokens=0, **kw)


def expert_parallel_job(comm, model=MOE) -> dict:
    """On each of 2 ranks: `model` under ``--ep 2`` (see the module docstring)."""
    from ..grid import ProcessGrid
    from ..train import Trainer

    layout = ParallelConfig(ep=2)
    grid = ProcessGrid.for_layout(layout, comm.grid.rank).build_groups()
    c = Comm(grid, CommTrace())
    tr = Trainer(model, layout, train_config(), c)
    losses, counts, routing = [], [], []
    for i in range(STEPS):
        losses.append(tr.step(i))
        counts += [d[0] for m in tr.moe for d in m.dispatches]  # this rank's kept choices per expert, per call
        routing.append(tr.last_moe)
    a2a = [r for r in c.trace.records if r["op"] == "all_to_all" and r["axis"] == "ep"]
    mine = {"ep_rank": grid.coord().ep, "losses": losses, "counts": counts, "routing": routing,
            "a2a_calls": len(a2a), "a2a_bytes": sum(r["bytes"] for r in a2a)}
    everyone = c.gather_object(mine)
    if grid.rank != 0:
        return {}
    ref = Trainer(model, ParallelConfig(), train_config(microbatches=2))
    ref_losses = [ref.step(i) for i in range(STEPS)]
    return {"ranks": everyone, "one_device_losses": ref_losses}
