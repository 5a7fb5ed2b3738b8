"""The contract between the model and a tensor-parallel mode: what ``model.py`` is written
against, written once. Each mode supplies one :class:`Layers` — 1-D Megatron
(``tensor.layers()``), the 2-D / 2.5-D SUMMA grid (``summa.layers()``), the 3-D cube
(``cube.layers()``) — and a lab builds one with a learner's piece in it (``tensor.layers(
f=...)``, ``dataclasses.replace(tensor.layers(), ...)``) and passes it to the Trainer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .context_parallel import ring_attention


@dataclass(frozen=True)
class Layers:
    """The pieces a layout builds the model from. Module factories are called with the
    parameter's layout-independent name, the full sizes and the :class:`~minitron.context.Context`;
    each returns a module holding this rank's shard of the single-device weight."""

    name: str  # "1d", "2d" (2-D and 2.5-D) or "3d"
    # (name, d_in, d_out, ctx, std, bias=True, blocks=0, parts=1) -> module: the first
    # linear of a pair, output features split (QKV, fc); `blocks` rows that stay whole
    # (heads), `parts` interleaved row groups (SwiGLU's [gate|up])
    linear_in: Callable
    # (name, d_in, d_out, ctx, std, bias=True) -> module: the second linear, partial sums;
    # the caller leaves the region, then adds ``.bias``
    linear_out: Callable
    enter: Callable  # (x, ctx) -> x: into the tensor-parallel region (Megatron's f)
    leave: Callable  # (x, ctx) -> x: out of it (g, or --sp's reduce-scatter)
    # (linear, x, ctx) -> leave(linear(x), ctx): the second linear and the exit as one step
    # (--tp-overlap decomposes the two together); the caller then adds ``linear.bias``
    leave_linear: Callable
    layer_norm: Callable  # (name, h, ctx, kind="layernorm"|"rmsnorm", eps, bias) -> module
    embedding: Callable  # (name, vocab, h, ctx, std, grad_sync) -> module: also the output layer
    position: Callable  # (name, seq_len, h, ctx, std) -> parameter: the learned position table
    scatter: Callable  # (x, ctx) -> x: after the embedding, onto this rank's sequence shard
    logits: Callable  # (x, head, ctx) -> this rank's logits
    loss: Callable  # (logits, targets, head, ctx) -> the mean loss
    boundary_shape: Callable  # (micro_batch, tokens, h, ctx) -> the hidden states' shape between stages
    keep_mask: Callable  # (ctx, site, key, shape, p, device, inside) -> this rank's part of a dropout mask
    ring_attention: Callable  # (q, k, v, comm) -> attention over the context group (--cp)


def _identity(x, ctx):
    return x


def _apply(linear, x, ctx):
    return linear(x)


def grid_layers(name: str, *, linear_in, linear_out, layer_norm, embedding, position, boundary_shape,
                keep_mask) -> Layers:
    """The layers of a layout whose activations are distributed everywhere (the cube, the
    SUMMA grid): there is no tensor-parallel region to enter or leave, and the output layer
    computes its logits and loss itself. Context parallelism composes with 1-D only, so
    `ring_attention` is never called here."""
    return Layers(
        name=name, linear_in=linear_in, linear_out=linear_out, enter=_identity, leave=_identity, leave_linear=_apply,
        layer_norm=layer_norm, embedding=embedding, position=position, scatter=_identity,
        logits=lambda x, head, ctx: head.logits(x),
        loss=lambda logits, targets, head, ctx: head.loss(logits, targets),
        boundary_shape=boundary_shape, keep_mask=keep_mask, ring_attention=ring_attention)
