"""Expert parallelism: the experts of a mixture split over the 'ep' axis, and the tokens
sent to the rank that holds their expert and back (GShard, Lepikhin et al. 2021 §2.2;
Megatron-Core's ``MoEAlltoAllTokenDispatcher``, torchtitan's ``AllToAllTokenDispatcher``).

Ep rank r holds experts ``[r·E/ep, (r+1)·E/ep)`` (:func:`local_experts`). Each rank routes
its own tokens (its rows of the batch: ep ranks read different data, like dp ranks), then:

1. *permute*: the (token, choice) pairs it keeps, sorted by expert (the caller's ``order``),
   so that the rows for each destination rank are one contiguous block;
2. *exchange counts*: an all-to-all of the E per-expert counts (E/ep to each rank), so
   that every rank knows how many rows it will receive from each other rank;
3. *dispatch*: an all-to-all of the rows with those variable split sizes; the rows that
   arrive, grouped by source rank, are regrouped by local expert (:meth:`Dispatch.by_expert`);
4. the local experts run on their rows; the outputs are put back in arrival order
   (:meth:`Dispatch.arrival_order`);
5. *combine*: the reverse all-to-all brings each output row back to the rank of its token,
   in that rank's permuted order, where the caller un-permutes (an index-add weighted by
   the gates).

The backward of an all-to-all is the all-to-all with the split sizes swapped
(:class:`AllToAll`), so a step moves, per MoE layer and microbatch on each rank, the E
counts once and the token rows four times (dispatch and combine, forward and backward):
``analysis/experts.py`` computes those bytes from the counts, and a traced step agrees.
Every call goes through ``Comm.all_to_all`` (traced, on the 'ep' axis); with ep = 1 the
same code runs without a call.
"""
from __future__ import annotations

import torch

from ..comm import Comm


def local_experts(experts: int, comm: Comm) -> slice:
    """The experts this expert-parallel rank holds: a contiguous block of E/ep."""
    n = experts // comm.size("ep")
    r = comm.index("ep")
    return slice(r * n, (r + 1) * n)


class AllToAll(torch.autograd.Function):
    """The rows of `x` in blocks of `send` rows to each rank of `axis`, `recv` rows from each;
    its backward sends the gradient back the same way (split sizes swapped)."""

    @staticmethod
    def forward(ctx, x, comm: Comm, axis: str, send: list, recv: list):
        ctx.comm, ctx.axis, ctx.send, ctx.recv = comm, axis, send, recv
        return comm.all_to_all(x, axis, send, recv, activation=True)

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.all_to_all(g.contiguous(), ctx.axis, ctx.recv, ctx.send, activation=True), None, None, None, None


def by_expert(received_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows that arrived in (source, expert) order, ``received_counts[r, j]`` rows from
    source r for local expert j: the permutation that regroups them as (expert, source),
    and its inverse."""
    n, e_local = received_counts.shape
    flat = received_counts.flatten()
    starts = (torch.cumsum(flat, 0) - flat).view(n, e_local)
    pieces = [torch.arange(int(starts[r, j]), int(starts[r, j] + received_counts[r, j]))
              for j in range(e_local) for r in range(n)]
    perm = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
    return perm, torch.argsort(perm)


class Dispatch:
    """One dispatch of permuted rows over the ep axis, and what its combine needs.

    `counts`: this rank's rows per expert (all E, int64, the rows in expert order);
    after construction, ``send``/``recv`` are the rows sent to / received from each ep
    rank and ``local_counts`` the rows each local expert receives (from every rank)."""

    def __init__(self, counts: torch.Tensor, comm: Comm, axis: str = "ep"):
        self.comm, self.axis = comm, axis
        n = comm.size(axis)
        e_local = counts.numel() // n
        # who sends how much to whom: one all-to-all of the E counts (E/ep to each rank)
        received = comm.all_to_all(counts, axis)  # [n * e_local]: source r's counts for my experts
        self.sent_counts = counts.view(n, e_local)
        self.received_counts = received.view(n, e_local)
        self.send = self.sent_counts.sum(1).tolist()
        self.recv = self.received_counts.sum(1).tolist()
        self.local_counts = self.received_counts.sum(0)
        if n == 1:
            return
        self.perm, self.inverse = by_expert(self.received_counts)

    def dispatch(self, rows: torch.Tensor) -> torch.Tensor:
        """Send `rows` (this rank's, in expert order); return the rows of the local experts,
        grouped by expert (``local_counts`` rows each)."""
        if self.comm.size(self.axis) == 1:  # one rank holds every expert: the rows stay
            return rows
        arrived = AllToAll.apply(rows, self.comm, self.axis, self.send, self.recv)
        return arrived[self.perm.to(arrived.device)]

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`dispatch`: the local experts' outputs (grouped by expert)
        back to the ranks of their tokens, in each rank's own expert order."""
        if self.comm.size(self.axis) == 1:
            return out
        arrival = out[self.inverse.to(out.device)]
        return AllToAll.apply(arrival, self.comm, self.axis, self.recv, self.send)


def token_dispatch(tokens: torch.Tensor, experts: torch.Tensor, gates: torch.Tensor, keep: torch.Tensor,
                   num_experts: int, comm: Comm, run_experts) -> torch.Tensor:
    """One MoE layer's tokens through their experts and back (steps 1–5 above): `tokens`
    [T, h], the chosen `experts` and their `gates` [T, k], `keep` [T, k] (the choices within
    capacity), E = `num_experts` (ep rank r holds E/ep of them); `run_experts(rows, counts)` runs this rank's E/ep experts on rows grouped by
    local expert. Returns [T, h]: each token's gate-weighted sum of its kept experts' outputs.
    A layer namespace may carry its own ``token_dispatch`` of this contract (lab 11a)."""
    k = experts.shape[1]
    order, counts = permute(experts, keep, num_experts)
    plan = Dispatch(counts, comm)
    out_rows = plan.combine(run_experts(plan.dispatch(tokens[order // k]), plan.local_counts.tolist()))
    return unpermute(tokens, order, k, gates, out_rows)


def permute(experts: torch.Tensor, keep: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept (token, choice) pairs, as indices into ``experts.flatten()``, sorted by
    expert (token order within one), and the kept choices per expert (all E)."""
    choice = experts.flatten()
    kept = keep.flatten().nonzero().squeeze(1)
    order = kept[torch.sort(choice[kept], stable=True).indices]
    return order, torch.bincount(choice[kept], minlength=num_experts)


def unpermute(tokens: torch.Tensor, order: torch.Tensor, k: int, gates: torch.Tensor,
              out_rows: torch.Tensor) -> torch.Tensor:
    """Each token the gate-weighted sum of its experts' outputs: `out_rows` row i is the
    output for pair ``order[i]`` (token ``order[i] // k``)."""
    return torch.zeros_like(tokens).index_add(0, order // k, out_rows * gates.flatten()[order, None])
