"""Activation recomputation (minitron/recompute.py) on its own: the same gradients as
without it, a second backward through a kept graph (zb-h1's W after B), nothing kept
after the backward, and a region that does not rerun the same operations refused."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from minitron.recompute import recompute


def _region(x, w, v):
    return ((x @ w).softmax(-1) @ v).tanh()


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 8, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]


def _grads(recomputed: bool, backwards: int = 1):
    x, w, v = _inputs()
    y = (recompute(_region, x, w, v) if recomputed else _region(x, w, v)) * 2
    for i in range(backwards):
        y.sum().backward(retain_graph=i < backwards - 1)
    return [t.grad for t in (x, w, v)]


@pytest.mark.parametrize("backwards", [1, 2])
def test_gradients_equal_the_plain_region_bitwise(backwards):
    for got, want in zip(_grads(True, backwards), _grads(False, backwards)):
        assert torch.equal(got, want)


def test_eval_is_the_plain_region():
    x, w, v = _inputs()
    with torch.no_grad():
        assert torch.equal(recompute(_region, x, w, v), _region(x, w, v))


def test_hooks_see_the_inputs_and_every_recomputed_tensor_and_nothing_outlives_the_backward():
    alive, seen = weakref.WeakSet(), []

    class Box:
        def __init__(self, t):
            self.t = t

    def pack(t):
        box = Box(t)
        alive.add(box)
        seen.append(tuple(t.shape))
        return box

    x, w, v = _inputs()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.t):
        y = recompute(_region, x, w, v, hooks=(pack, lambda box: box.t))
        assert len(seen) == 3  # the forward: the region's three inputs, nothing else
        y.sum().backward()
    assert len(seen) > 3  # the rerun's saved tensors went through the same hooks
    del y
    gc.collect()
    assert len(alive) == 0


def test_a_region_that_reruns_differently_is_refused():
    calls = []

    def moody(x):
        calls.append(1)
        return x.exp() if len(calls) == 1 else x.exp().exp()

    x = _inputs()[0]
    y = recompute(moody, x)
    with pytest.raises(RuntimeError, match="recomputation saved 2 tensors where the forward saved 1"):
        y.sum().backward()
