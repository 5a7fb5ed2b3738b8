"""Activation recomputation: keep a region's inputs, redo its forward in the backward.

A transformer layer saves about ``sbh(34 + 5as/h)`` bytes of activations for its backward
(Korthikanti et al. 2022, §4.1). Full recomputation keeps only each layer's input and
recomputes the rest layer by layer in the backward; selective recomputation (§5) redoes
only the attention core, softmax(QK^T/√d)·V, whose ``5as/h`` term grows with the
sequence while its FLOPs are few.

How, without running the region's backward by hand: while the region runs forward,
every tensor autograd saves is replaced by a placeholder (a saved-tensor pack hook).
The first time the backward asks a placeholder for its tensor, the region runs again
from its saved inputs, with gradients on, this time keeping what it saves; each
placeholder then hands its tensor over once and lets go of it, so recomputed tensors
live only until their node has used them. A second backward through the same graph
(zb-h1's W after its B) recomputes again. Autograd's graph is the ordinary one, so the
region's weights are reached by the usual accumulators (data-parallel hooks, B/W split).

No random state is saved and restored: the engine's dropout masks are functions of an
explicit key (``parallel/random.py``), which the region is given again.
"""
from __future__ import annotations

import weakref
from contextlib import nullcontext

import torch
from torch.autograd.graph import saved_tensors_hooks


_TENSOR = object()  # where a tensor argument stands in a frame's template of the arguments


class _SaveInputs(torch.autograd.Function):
    """Saves the region's tensor inputs for its backward, under the hooks of the caller
    (a memory meter sees them) and for as long as the graph lives."""

    @staticmethod
    def forward(ctx, anchor, *tensors):
        ctx.save_for_backward(*tensors)
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx, grad):
        return (None,) * (1 + len(ctx.saved_tensors))


class _Slot:
    """A placeholder for the `index`-th tensor the region saved."""

    __slots__ = ("index", "__weakref__")

    def __init__(self, index: int):
        self.index = index


class _Frame:
    """One recomputed region: how to run it again, and what its last run saved."""

    def __init__(self, fn, args, hooks):
        self.fn, self.hooks, self.count = fn, hooks, 0
        self.template = [_TENSOR if isinstance(a, torch.Tensor) else a for a in args]  # the rest as given
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        self.saver = _SaveInputs.apply(torch.empty(0, requires_grad=True), *tensors).grad_fn
        # autocast as in the forward: the backward runs outside the caller's autocast region
        self.device_type = tensors[0].device.type if tensors else "cpu"
        self.autocast = (torch.is_autocast_enabled(self.device_type), torch.get_autocast_dtype(self.device_type))
        self.kept: list = []  # the last recomputation's saved tensors; None once handed over

    def pack(self, x):
        slot = _Slot(self.count)
        self.count += 1
        weakref.finalize(slot, self.forget, slot.index)  # the graph let go: so do we
        return slot

    def forget(self, index: int) -> None:
        if index < len(self.kept):
            self.kept[index] = None

    def unpack(self, slot):
        if slot.index >= len(self.kept) or self.kept[slot.index] is None:
            self.rerun()
        held, self.kept[slot.index] = self.kept[slot.index], None
        return self.hooks[1](held) if self.hooks else held

    def rerun(self) -> None:
        tensors = iter(t.detach().requires_grad_(t.requires_grad) for t in self.saver.saved_tensors)
        args = [next(tensors) if a is _TENSOR else a for a in self.template]
        kept: list = []

        def keep(x):
            # detached: a tensor holding its own grad_fn would tie the rerun's graph into a
            # reference cycle through its saved variables (and keep all of it alive)
            x = x.detach() if x.requires_grad else x
            kept.append(self.hooks[0](x) if self.hooks else x)
            return x  # the rerun's own graph is thrown away; only `kept` matters

        enabled, dtype = self.autocast
        with torch.enable_grad(), torch.autocast(self.device_type, dtype=dtype, enabled=enabled), \
                saved_tensors_hooks(keep, lambda x: x):
            self.fn(*args)
        if len(kept) != self.count:
            raise RuntimeError(f"recomputation saved {len(kept)} tensors where the forward saved {self.count}: "
                               "the recomputed region must run the same operations")
        self.kept = kept


def recompute(fn, *args, hooks=None):
    """``fn(*args)`` whose saved activations are recomputed in the backward instead of kept.

    `hooks`: an optional ``(pack, unpack)`` pair of saved-tensor hooks that the tensors
    the recomputation keeps go through as well (a memory meter's; the region's inputs and
    the rest of the step go through the caller's ``saved_tensors_hooks`` as usual).
    Without gradients (evaluation) this is just ``fn(*args)``.
    """
    if not torch.is_grad_enabled():
        return fn(*args)
    frame = _Frame(fn, args, hooks)
    with saved_tensors_hooks(frame.pack, frame.unpack):
        return fn(*args)
