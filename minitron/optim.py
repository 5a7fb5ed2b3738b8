"""AdamW, the learning-rate schedule and exact global gradient clipping.

Clipping must see the gradient norm of the *whole* model, not of one shard: each
rank sums the squares of the shards it owns (a replicated parameter is counted on one
copy only, see ShardInfo.replicas) and one all-reduce over the model-parallel ranks
gives the global norm. Data-parallel replicas hold identical gradients after the sync,
so they are not summed again.

The Trainer drives every optimizer through one small protocol (:class:`Optimizer`):
replicated AdamW here, ZeRO's sharded AdamW in ``parallel/data.py`` (every ZeRO stage),
or a lab's.
"""
from __future__ import annotations

import math
from typing import Protocol

import torch

from .comm import Comm
from .config import TrainConfig


def lr_at(step: int, train: TrainConfig) -> float:
    """Linear warm-up to `lr`, then cosine decay to `min_lr` at the last step."""
    if step < train.warmup:
        return train.lr * (step + 1) / train.warmup
    progress = (step - train.warmup) / max(1, train.steps - train.warmup)
    return train.min_lr + 0.5 * (train.lr - train.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def unique_params(params) -> list[torch.nn.Parameter]:
    return list({id(p): p for p in params}.values())


def make_adamw(params, train: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases and LayerNorm)."""
    params = unique_params(params)
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": train.weight_decay}, {"params": other, "weight_decay": 0.0}]
    # fused: one kernel over all tensors, on GPUs and CPUs alike (4x faster than the
    # per-op foreach path for a small model on one CPU thread)
    return torch.optim.AdamW(groups, lr=train.lr, betas=(0.9, 0.95), eps=1e-8, fused=bool(params) or None)


class Optimizer(Protocol):
    """What the Trainer and the checkpoints ask of an optimizer."""

    def step(self, lr: float, max_norm: float = 0.0) -> torch.Tensor:
        """Clip to `max_norm` (0: no clipping) with the exact global norm, update the
        parameters; returns the gradient norm before clipping (a device tensor)."""

    def wait_params(self) -> None:
        """Complete what the step left in flight (ZeRO's parameter all-gather): afterwards
        the parameters can be read outside a forward."""

    def materialize(self) -> None:
        """Every parameter whole and current, to be read or overwritten (checkpoints)."""

    def export_param_state(self) -> dict:
        """{param: {"exp_avg", "exp_avg_sq", "step"}} in the parameters' local shapes."""

    def import_param_state(self, states: dict) -> None:
        """The inverse of ``export_param_state``."""

    def state_tensors(self) -> list[torch.Tensor]:
        """The state tensors this rank holds (their bytes are the optimizer's memory)."""


class AdamW:
    """Replicated AdamW behind the :class:`Optimizer` protocol: every data-parallel rank
    steps the whole (tensor/pipeline-local) parameters after the gradient sync, clipping
    with the exact global norm (:func:`clip_`)."""

    def __init__(self, params, train: TrainConfig, comm: Comm):
        self.params, self.comm = unique_params(params), comm
        self.adamw = make_adamw(self.params, train)

    @property
    def state(self) -> dict:
        """torch's per-parameter state ({param: {"step", "exp_avg", "exp_avg_sq"}})."""
        return self.adamw.state

    def step(self, lr: float, max_norm: float = 0.0) -> torch.Tensor:
        norm = clip_(self.params, max_norm, self.comm)
        for g in self.adamw.param_groups:
            g["lr"] = lr
        self.adamw.step()
        return norm

    def wait_params(self) -> None:
        """Nothing in flight: the parameters are current after every step."""

    materialize = wait_params

    def export_param_state(self) -> dict:
        return {p: self.adamw.state.get(p, {}) for p in self.params}

    def import_param_state(self, states: dict) -> None:
        for p, st in states.items():
            self.adamw.state[p] = st

    def state_tensors(self) -> list[torch.Tensor]:
        return [st[k] for st in self.adamw.state.values() for k in ("exp_avg", "exp_avg_sq") if k in st]


def owns_copy(p, comm: Comm, sharded: bool = False) -> bool:
    """True on the one copy of a replicated parameter that counts toward the norm (a dense
    parameter is also copied on every expert-parallel rank, over which the norm sums the
    experts: it counts on ep rank 0; `sharded`: a ZeRO shard, whose pieces differ over ep)."""
    ep_copy = ("ep",) if "ep" in p.shard.data_axes and not sharded else ()
    return all(comm.index(a) == 0 for a in p.shard.replicas + ep_copy)


def sum_of_squares(tensors, device) -> torch.Tensor:
    """Σ x² over every entry of `tensors`, a 0-dim float64 tensor on `device`: one fused
    norm kernel over the list (as clip_grad_norm_ does), no float64 copies."""
    tensors = list(tensors)
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float64)).square().sum()


def local_sq_norm(params, comm: Comm) -> torch.Tensor:
    """Sum of squared gradient entries of the shards this rank counts."""
    params = unique_params(params)
    return sum_of_squares((p.grad.detach() for p in params if p.grad is not None and owns_copy(p, comm)),
                          params[0].device if params else None)


def global_grad_norm(params, comm: Comm) -> torch.Tensor:
    """The exact L2 norm of the full model's gradient, a 0-dim float64 tensor on the
    device (all-reduces over the model-parallel axes, ep's experts included; ZeRO-1 also
    sums over dp, see parallel/data.py)."""
    sq = local_sq_norm(params, comm)
    for axis in ("tp", "pp", "ep"):
        comm.all_reduce(sq, axis)
    return sq.sqrt()


def clip_coef(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / (norm + 1e-6)), as torch.nn.utils.clip_grad_norm_ computes it,
    left on the device: a Python `if norm > max_norm` would wait for the GPU every step."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def clip_(params, max_norm: float, comm: Comm) -> torch.Tensor:
    """Scale gradients so that the global norm is at most `max_norm`; returns the norm
    (a device tensor: no host synchronisation)."""
    norm = global_grad_norm(params, comm)
    if max_norm > 0:
        grads = [p.grad for p in unique_params(params) if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, clip_coef(norm, max_norm).to(grads[0].dtype))
    return norm


def sync_replicated_grads(params, comm: Comm) -> None:
    """Sum the gradients of parameters whose copies saw different data (ShardInfo.grad_sync):
    LayerNorm under sequence parallelism, the tied embedding on the first and last stage."""
    for p in unique_params(params):
        if p.grad is not None:
            for axis in p.shard.grad_sync:
                comm.all_reduce(p.grad, axis)
