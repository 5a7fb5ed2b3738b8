"""Measure what one training step holds in memory on this rank.

The counterpart of :func:`minitron.analysis.memory.memory_on_rank`: same keys, counted
from a real :class:`~minitron.train.Trainer` step instead of formulas.

* params_bytes: the bytes of the rank's unique local parameters;
* grads_bytes: the bytes of ``p.grad`` after the step;
* optimizer_bytes: AdamW's ``exp_avg`` + ``exp_avg_sq`` (ZeRO-1: its shard tensors);
* buffers_bytes: the data-parallel buffers only: the distinct storages behind parameters,
  gradients and the data-parallel engine's flat buffers (``grad_buffer``,
  ``param_buffer``, ``shard_grad``, ZeRO-1's ``shard_param``) minus the parameters and
  gradients. The pipeline's send/receive tensors (in ``memory_on_rank``'s estimate) are
  communication buffers and are not measured;
* activations_bytes: the peak over the step of the bytes saved for the backward and
  still alive (saved-tensor hooks counted by :class:`minitron.analysis.dry_run.SavedBytes`,
  the dry run's meter; parameters excluded; one count per storage), together
  with the pipeline stash (the stage inputs of the microbatches in flight). A
  recomputed region (``--recompute``) holds its inputs, and during its backward what
  its recomputation saves again (``Trainer.step(saved_tensors=)`` hands the meter's
  hooks to :mod:`minitron.recompute`) until each tensor has been used.

From a notebook: ``run_on_ranks(memory_job, layout, model, layout, train)``.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

from ..analysis.dry_run import SavedBytes


def stash_observer(meter: SavedBytes):
    """A pipeline runtime observer (``PipelineRuntime.observing``) that counts the stash:
    a microbatch's stage input from its F to the end of its B."""
    def observe(action, stage_input) -> None:
        key = (action.mb, action.chunk)
        if action.op == "F" and stage_input is not None:
            meter.hold(key, [stage_input])
        elif action.op == "B":
            meter.release(key)
    return observe


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _storages(tensors) -> int:
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def measure_step_memory(trainer, step: int = 0) -> dict:
    """Run training step `step` of `trainer` and return the bytes this rank holds.

    Keys as :func:`minitron.analysis.memory.memory_on_rank` (``params_bytes,
    grads_bytes, optimizer_bytes, activations_bytes, buffers_bytes, total_bytes``); see
    the module docstring for what each counts (``buffers_bytes``: data-parallel buffers
    only). The trainer's pipeline runtime, if any, is observed to count its stash.
    """
    return measured_step(trainer, step)[1]


def measured_step(trainer, step: int = 0) -> tuple[float, dict]:
    """:func:`measure_step_memory` that also returns the step's loss: (loss, bytes)."""
    with measuring(trainer) as memory:
        loss = trainer.step(step, saved_tensors=memory.hooks)
    return loss, memory.bytes


class StepMemory:
    """What :func:`measuring` hands out: ``hooks``, the saved-tensor hooks the Trainer's
    step runs under, and after the block ``bytes``, the rank's bytes (as
    :func:`measure_step_memory` returns them)."""

    def __init__(self, meter):
        self.hooks, self.bytes = (meter.pack, meter.unpack), None


@contextmanager
def measuring(trainer):
    """Measure the memory of the one step the block runs (``trainer.step`` or
    ``step_async`` with ``saved_tensors=memory.hooks``): the saved tensors through the
    hooks, the pipeline's stash through its observer; yields a :class:`StepMemory`
    whose ``bytes`` are set on exit. How a training run measures its own first step
    without anything but the Trainer running it (the run report)."""
    tr = trainer
    meter = SavedBytes(tr.params)
    memory = StepMemory(meter)
    with tr.pipeline.observing(stash_observer(meter)) if tr.pipeline is not None else nullcontext():
        yield memory
    if meter.now or meter.alive:  # a leak would make the peak meaningless
        raise RuntimeError("saved tensors outlived the step")
    memory.bytes = _held_bytes(tr, meter.peak)


def _held_bytes(tr, activations: int) -> dict:
    """The bytes a rank holds after a step whose saved activations peaked at `activations`."""
    if tr.layout.zero >= 2:
        return _sharded_state_bytes(tr, activations)
    grads = [p.grad for p in tr.params if p.grad is not None]
    if tr.layout.zero1:  # one buffer set per data group under --ep (parallel/data.GroupedData)
        parts = zip(getattr(tr.dp, "parts", [tr.dp]), getattr(tr.optimizer, "parts", [tr.optimizer]))
        flat = [t for d, o in parts for t in (d.grad_buffer, d.param_buffer, d.shard_grad, o.shard_param)]
    else:
        flat = [tr.dp.grad_buffer] if hasattr(tr.dp, "grad_buffer") else []
    params, grad_bytes = _nbytes(tr.params), _nbytes(grads)
    out = {"params_bytes": params, "grads_bytes": grad_bytes, "optimizer_bytes": _nbytes(tr.optimizer.state_tensors()),
           "activations_bytes": activations,
           "buffers_bytes": _storages([*tr.params, *grads, *flat]) - params - grad_bytes}
    out["total_bytes"] = sum(out.values())
    return out


def _sharded_state_bytes(tr, activations: int) -> dict:
    """ZeRO-2/3 (``parallel/zero.py``): the parameters (stage 3: this rank's shard), the
    gradient shard, AdamW's two moments of the shard; buffers: the peaks of the gathered
    units and of the gradient staging buffers during the step, and stage 2's padding."""
    parts = getattr(tr.dp, "parts", [tr.dp])  # one per data group under --ep (parallel/data.GroupedData)
    stage, held = parts[0].stage, [p for d in parts for p in d.params]
    loose = [p for p in tr.params if all(p is not q for q in held)]  # in no unit: a MoE's selection bias
    params = sum(_nbytes([d.param_shard]) for d in parts) + _nbytes(loose) if stage == 3 else _nbytes(tr.params)
    padding = sum(_nbytes(d.full) for d in parts) - _nbytes(held) if stage == 2 else 0
    gathered = sum(d.peak_gathered_bytes for d in parts) if stage == 3 else 0
    out = {"params_bytes": params, "grads_bytes": sum(_nbytes([d.shard_grad]) for d in parts),
           "optimizer_bytes": _nbytes(tr.optimizer.state_tensors()), "activations_bytes": activations,
           "buffers_bytes": gathered + sum(d.peak_staging_bytes for d in parts) + padding}
    out["total_bytes"] = sum(out.values())
    return out


def memory_job(comm, model, layout, train, step: int = 0) -> dict:
    """Rank job for :func:`minitron.tools.testing.run_on_ranks`: build a Trainer, measure one
    step; returns :func:`measure_step_memory`'s dict plus ``stage`` (this rank's pipeline
    stage, for ``memory_on_rank(model, layout, train, stage)``)."""
    from ..train import Trainer

    return {"stage": comm.index("pp"), **measure_step_memory(Trainer(model, layout, train, comm), step)}
