"""The experts' all-to-all overlapped with their computation (``--ep-overlap``): each MoE
call's dispatch and combine split in two halves, so that one half's all-to-all is in
flight while the other half's experts run (DeepSeek-V3, arXiv 2412.19437 §3.2.1:
computation-communication overlap). Megatron-Core's ``--overlap-moe-expert-parallel-comm``
pairs one microbatch's forward with another's backward instead, as DualPipe does; this
splits one call, so it works without a second microbatch in flight.

DeepSeek-V3 hides the all-to-all of one micro-batch under the computation of another
(DualPipe's forward and backward chunks paired). Inside one MoE call the same idea needs
two pieces of independent work: we cut the call's rows in two halves *by local expert*
(each ep rank's experts ``[0, a)`` and ``[a, E/ep)``, a = ⌊E/ep / 2⌋), not by token,
because then

* the one counts all-to-all of the unsplit dispatch (``Dispatch``) already says every
  half's split sizes: no second exchange, so the bytes of a step are the unoverlapped
  layout's exactly (the E counts once, the same rows in two messages instead of one);
* each expert sees all its rows in one piece, and a capacity factor keeps its meaning
  (the keep mask is taken before the split, over the whole microbatch), so every layout
  still computes the one device's function bit for bit in float64.

Forward, per MoE call (``post``: an async ``Comm.all_to_all``, ``wait``: its Pending)::

    counts all-to-all (sync) · post dispatch 1 · post dispatch 2 · wait dispatch 1 ·
    experts of half 1 [dispatch 2 in flight] · post combine 1 · wait dispatch 2 ·
    experts of half 2 [combine 1 in flight] · post combine 2 · wait combine 1 · wait combine 2

Backward, the same pairs in reverse (:class:`Post` and :class:`Wait`: a wait's backward
posts the gradient's all-to-all, the matching post's backward waits for it). The autograd
engine runs the later-made node first, so combine 2's and combine 1's gradients are posted,
half 2's experts run backward under combine 1's, then half 1's under dispatch 2's
(``tests/test_ep_overlap.py`` reads the order off a log). On gloo the async calls run on
the process group's worker threads while this thread computes.

Chosen over overlapping the shared experts with the dispatch because it needs no shared
experts (moe-tiny has none) and keeps ``token_dispatch``'s contract (lab 11a): the shared
MLP of DeepSeek-V3 runs after the call, as without the flag.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm import Comm
from .experts import Dispatch, by_expert, permute, unpermute


class Flight:
    """One all-to-all of a half and its gradient's: what :class:`Post` and :class:`Wait`
    of that one message hand each other (made per message, never reused)."""

    def __init__(self, comm: Comm, axis: str, send: list, recv: list):
        self.comm, self.axis, self.send, self.recv = comm, axis, send, recv
        self.forward = self.backward = None  # the Pendings in flight

    def post(self, x: torch.Tensor):
        """The rows `x` sent (`send` rows to each rank, `recv` from each), not waited."""
        self.forward = self.comm.all_to_all(x, self.axis, self.send, self.recv, activation=True, async_op=True)

    def post_gradient(self, g: torch.Tensor):
        """The gradient sent back the same way (split sizes swapped), not waited."""
        self.backward = self.comm.all_to_all(g.contiguous(), self.axis, self.recv, self.send, activation=True,
                                             async_op=True)


class Post(torch.autograd.Function):
    """Posts `flight`'s all-to-all of `x`; returns an empty token that carries the graph to
    :class:`Wait`. Backward: waits for the gradient's all-to-all that Wait's backward posted."""

    @staticmethod
    def forward(ctx, x, flight: Flight):
        ctx.flight = flight
        flight.post(x)
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _token):
        pending, ctx.flight.backward = ctx.flight.backward, None
        return pending.wait(), None


class Wait(torch.autograd.Function):
    """The rows of `flight`'s all-to-all, waited for. Backward: posts their gradient's."""

    @staticmethod
    def forward(ctx, token, flight: Flight):
        ctx.flight = flight
        pending, flight.forward = flight.forward, None
        return pending.wait()

    @staticmethod
    def backward(ctx, g):
        ctx.flight.post_gradient(g)
        return g.new_zeros(0), None


@dataclass(frozen=True)
class Half:
    """The rows of one half: the local experts ``[lo, hi)`` of every ep rank.

    `pairs`: this rank's kept (token, choice) pairs of the half, in expert order; `send` /
    `recv`: its rows to / from each ep rank; `perm` / `inverse`: arrival order (source,
    expert) to (expert, source) and back; `local_counts`: rows per local expert (all
    E/ep of them, zero outside the half)."""

    pairs: torch.Tensor
    send: list
    recv: list
    perm: torch.Tensor
    inverse: torch.Tensor
    local_counts: list


def halves(plan: Dispatch, order: torch.Tensor, choice: torch.Tensor) -> tuple[Half, Half]:
    """The two halves of `plan`'s rows (see the module docstring); `order`: the pairs in
    expert order (``permute``), `choice`: every pair's expert."""
    e_local = plan.sent_counts.shape[1]
    out = []
    for lo, hi in ((0, e_local // 2), (e_local // 2, e_local)):
        received = plan.received_counts[:, lo:hi]
        perm, inverse = by_expert(received)
        local = torch.zeros(e_local, dtype=torch.long)
        local[lo:hi] = received.sum(0)
        j = choice[order] % e_local
        out.append(Half(order[(j >= lo) & (j < hi)], plan.sent_counts[:, lo:hi].sum(1).tolist(),
                        received.sum(1).tolist(), perm, inverse, local.tolist()))
    return out[0], out[1]


def overlapped_token_dispatch(tokens: torch.Tensor, experts: torch.Tensor, gates: torch.Tensor, keep: torch.Tensor,
                              num_experts: int, comm: Comm, run_experts) -> torch.Tensor:
    """``token_dispatch``'s contract (``parallel/experts.py``), its all-to-alls in two halves
    overlapped with the experts (the order in the module docstring); needs ep > 1 and at
    least two experts per ep rank (``config.validate``)."""
    k = experts.shape[1]
    order, counts = permute(experts, keep, num_experts)
    plan = Dispatch(counts, comm)
    parts = halves(plan, order, experts.flatten())
    dispatched = [Flight(comm, "ep", h.send, h.recv) for h in parts]
    tokens_in_flight = [Post.apply(tokens[h.pairs // k], f) for h, f in zip(parts, dispatched)]
    combined = []
    for h, f, token in zip(parts, dispatched, tokens_in_flight):
        arrived = Wait.apply(token, f)
        out = run_experts(arrived[h.perm.to(arrived.device)], h.local_counts)
        back = Flight(comm, "ep", h.recv, h.send)
        combined.append((back, Post.apply(out[h.inverse.to(out.device)], back)))
    rows = torch.cat([Wait.apply(token, back) for back, token in combined])
    return unpermute(tokens, torch.cat([h.pairs for h in parts]), k, gates, rows)
