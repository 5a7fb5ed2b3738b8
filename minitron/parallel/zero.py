"""ZeRO stages 2 and 3: gradients, then parameters too, sharded over the data-parallel ranks.

ZeRO (Rajbhandari et al. 2020, §5) removes the copies data parallelism keeps of every
model state. Stage 1 (``parallel/data.py``) shards AdamW's state; here:

Stage 2 (``--zero 2``): gradients are reduce-scattered into this rank's shard *during
backward*, unit by unit and microbatch by microbatch, and the full gradient is never kept:
a unit's gradients land in a small staging buffer that is freed once its reduce-scatter
is done. AdamW steps the shard (``ShardedAdamW``) and the updated shards are all-gathered
back into the full parameters, overlapping the next forward as ZeRO-1 does.

Stage 3 (``--zero 3``, fully sharded, as PyTorch's FSDP): parameters are sharded at rest.
A unit's parameters are all-gathered just before its forward and freed after it, gathered
again just before its backward and freed when its gradients are done (§5.3); the next
unit's all-gather is started early (prefetch) so that it overlaps the current unit's
compute. Gradients are reduce-scattered as in stage 2.

Units: a transformer block each, and per model chunk a root unit holding everything else
(embeddings, final norm, output layer), gathered at the chunk's first forward of a step
and kept until the step ends (FSDP keeps its root module's parameters the same way: they
are used at the very start and the very end). Each unit is padded to a multiple of d in a
flat layout (``parallel.buckets.plan_units``) and rank r owns the r-th 1/d of every unit; a
parameter is a view into its unit's full buffer, whose storage is freed (resized to zero
bytes, as FSDP does) while the unit is sharded. Autograd keeps referring to the parameter
itself, so re-gathering the storage before the backward is all that backward needs.

Traffic per step for Ψ parameter elements and one microbatch: stage 2 a reduce-scatter and
an all-gather (one all-reduce's worth, like stages 0 and 1); stage 3 two all-gathers and a
reduce-scatter, 1.5× (``analysis.zero.zero_calls`` counts every call).

The interface is the data-parallel one (``parallel/data.py``) plus what ``ShardedAdamW``
and checkpoints need: ``shard_grad``, ``own_ranges``, ``segments``, ``read_param_shard``,
``start_param_gather``, ``gather_flat``, ``materialize``.
"""
from __future__ import annotations

from collections import deque
from contextlib import contextmanager

import torch

from .buckets import plan_units
from ..comm import Comm
from ..optim import unique_params
from .data import FlatShards, GroupedData, by_data_group, grad_axis, param_axis
from .fp8_gather import Fp8WeightGather, fp8_weights, split_fp8_units


class ShardedDataParallel(FlatShards):
    """ZeRO stage 2 or 3 over `units`: ``[(module, params, kind)]`` with kind 'root' or
    'block', each chunk's root first and then its blocks in forward order.

    `axis`: the axis the gradients are averaged over (default: data parallel, with the
    context ranks under context parallelism). `max_in_flight`: reduce-scatters allowed to
    run before the oldest is waited for (bounds the staging buffers alive at once).
    `unit` (stage 3, a lab's): ``unit(comm, axis, shard, full)`` -> an object that does one
    unit's communication in place of the engine's, synchronously (no prefetch):
    ``before_forward()``, ``after_forward()``, ``before_backward()`` and
    ``after_backward(grad)`` -> this rank's shard of the mean gradient (`full`: the unit's
    flat buffer, its storage freed at rest; `shard`: this rank's slice of it).
    `fp8`: {weight: Fp8State} of the units whose parameters are all FP8 linears' weights,
    which stage 3 gathers in FP8 for the forward and backward (``parallel/fp8_gather.py``).
    """

    def __init__(self, units, comm: Comm, stage: int, axis: str | None = None, max_in_flight: int = 2,
                 unit=None, fp8: dict | None = None):
        if stage not in (2, 3):
            raise ValueError(f"ShardedDataParallel is ZeRO stage 2 or 3, not {stage}")
        self.comm, self.stage, self.shard = comm, stage, True
        self.axis = axis or grad_axis(comm)
        axes = {param_axis(p, comm) for _, ps, _ in units for p in ps}
        if axes - {self.axis}:  # experts split over ep: another data group (see sharded_data_parallel)
            raise ValueError(f"ZeRO-{stage} shards every unit over one data group, not {sorted(axes)}")
        self.replicas = comm.size(grad_axis(comm))  # every gradient is a mean over all data replicas
        self.d, self.rank = comm.size(self.axis), comm.index(self.axis)
        self.max_in_flight = max_in_flight
        self._take_units(units)
        self._flat_layout()
        self.fp8_gathers = self._fp8_gathers(fp8 or {})
        self._start_state()
        self._link_units()
        self.unit_ops = None  # the passed-in units' communication, when `unit` is given
        if unit is not None:
            if stage != 3 or self.fp8_gathers:
                raise ValueError("a unit passed in does ZeRO-3's gathers: it needs stage 3 and no FP8 gathers")
            self.unit_ops = [unit(comm, self.axis, self.param_shard[slice(*self._shard_range(u))], self.full[u])
                             for u in range(len(self.units))]
        self._install_hooks()

    # --- set-up -----------------------------------------------------------------------------------
    def _take_units(self, units) -> None:
        """Keep the units that hold parameters (each once), with the model chunk of each:
        every chunk starts with its root, even one with no parameters."""
        chunk, chunks = -1, []
        for _, _, kind in units:
            chunk += kind == "root"
            chunks.append(chunk)
        keep = [i for i, (_, ps, _) in enumerate(units) if ps]
        self.units = [(units[i][0], unique_params(units[i][1]), units[i][2]) for i in keep]
        self.chunk_of = [chunks[i] for i in keep]
        self.params = [p for _, ps, _ in self.units for p in ps]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"sharded data parallelism needs one parameter dtype, got {sorted(map(str, dtypes))}")

    def _flat_layout(self) -> None:
        """Each unit padded to a multiple of d in one flat layout (``plan_units``); every
        parameter becomes a view into its unit's full buffer; this rank's parameter shard
        (stage 3) and gradient shard."""
        dtype, device = self.params[0].dtype, self.params[0].device
        self.offsets, self.buckets, self.numel = plan_units([[p.numel() for p in ps] for _, ps, _ in self.units],
                                                            self.d)
        self.offset = dict(zip(self.params, self.offsets))
        self.unit_of = {p: u for u, (_, ps, _) in enumerate(self.units) for p in ps}
        self.element_size = self.params[0].element_size()
        self.full = [torch.zeros(b.numel, dtype=dtype, device=device) for b in self.buckets]
        with torch.no_grad():
            for p in self.params:
                view = self._unit_view(p)
                view.copy_(p.detach())
                p.data = view
        self.param_shard = torch.zeros(self.numel // self.d, dtype=dtype, device=device) if self.stage == 3 else None
        self.shard_grad = torch.zeros(self.numel // self.d, dtype=dtype, device=device)

    def _fp8_gathers(self, weights: dict) -> dict:
        """{unit: its Fp8WeightGather} for the units made only of FP8-gathered weights."""
        gathers = {}
        for u, (_, ps, _) in enumerate(self.units):
            if self.stage == 3 and ps and all(p in weights for p in ps):
                start = self.buckets[u].start
                spans = [(self.offset[p] - start, p.numel(), weights[p]) for p in ps]
                gathers[u] = Fp8WeightGather(spans, self.rank, self.buckets[u].numel // self.d, self.comm, self.axis)
        return gathers

    def _start_state(self) -> None:
        """Every unit gathered, nothing in flight; stage 3 then writes the initial values
        into this rank's shard and frees every unit (sharded at rest, §5.3)."""
        self.gathered = [True] * len(self.units)
        self._gathers: dict = {}  # unit -> all-gather in flight
        self._fp8_bytes: dict = {}  # unit -> the FP8 bytes its all-gather fills, decoded on the wait
        self._pinned: set = set()  # units gathered by materialize(): kept, written back on release
        self._staging: list = [None] * len(self.units)  # unit -> its gradients of this round
        self._pending = [len(ps) for _, ps, _ in self.units]
        self._in_flight: deque = deque()  # (unit, work, staging, output) of reduce-scatters
        self.gathered_bytes = self.peak_gathered_bytes = sum(f.numel() for f in self.full) * self.element_size
        self.staging_bytes = self.peak_staging_bytes = 0
        if self.stage == 3:
            self._pinned = set(range(len(self.units)))  # the initial values: written into the shard
            self._release()
            for u in range(len(self.units)):
                self._free(u)
            self.peak_gathered_bytes = 0

    def _link_units(self) -> None:
        """Units in forward order within a chunk: a unit's forward prefetches the next one,
        a block's backward the one before it."""
        self._next = [None] * len(self.units)
        self._prev = [None] * len(self.units)
        for u in range(len(self.units) - 1):
            if self.units[u + 1][2] == "block" and self.chunk_of[u + 1] == self.chunk_of[u]:  # the same chunk
                self._next[u] = u + 1
                if self.units[u][2] == "block":
                    self._prev[u + 1] = u

    def _install_hooks(self) -> None:
        """A gradient hook per parameter (reduce-scatter a unit when its last gradient is
        in), a forward pre-hook per unit (gather), and in stage 3 a forward hook per block
        (free after its forward)."""
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.params]
        for u, (mod, _, kind) in enumerate(self.units):
            self._hooks.append(mod.register_forward_pre_hook(self._before_forward(u)))
            if self.stage == 3 and kind == "block":
                self._hooks.append(mod.register_forward_hook(self._after_forward(u)))


    # --- the flat layout (as BucketedDataParallel's, one bucket per unit) ----------------------
    def _unit_view(self, p) -> torch.Tensor:
        """`p`'s place in its unit's full buffer."""
        u = self.unit_of[p]
        off = self.offset[p] - self.buckets[u].start
        return self.full[u][off:off + p.numel()].view_as(p)

    def _view(self, flat: torch.Tensor, p) -> torch.Tensor:
        """`p`'s place in a tensor of the whole flat layout's size."""
        off = self.offset[p]
        return flat[off:off + p.numel()].view_as(p)

    def _shard_range(self, u: int) -> tuple[int, int]:
        """Where unit u's piece of this rank's shard sits in the flat shard."""
        b = self.buckets[u]
        return b.start // self.d, b.end // self.d

    # --- parameters: gather, free, and the optimizer's view of them ------------------------------
    def _gather(self, u: int, wait: bool, exact: bool = False) -> None:
        """Make unit u's parameters whole: start its all-gather (stage 3: into re-allocated
        storage) unless it is gathered or on its way; with `wait`, complete it. A unit of
        FP8 weights is gathered in FP8 for compute, in the working dtype when `exact`."""
        if not self.gathered[u]:
            b, full = self.buckets[u], self.full[u]
            full.untyped_storage().resize_(b.numel * self.element_size)
            self.gathered[u] = True
            self.gathered_bytes += b.numel * self.element_size
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
            lo, hi = self._shard_range(u)
            if u in self.fp8_gathers and not exact:
                self._fp8_bytes[u] = torch.empty(b.numel, dtype=torch.uint8, device=full.device)
                message = self.fp8_gathers[u].encode(self.param_shard[lo:hi])
                self._gathers[u] = self.comm.all_gather(message, self.axis, out=self._fp8_bytes[u], async_op=True)
            else:
                self._gathers[u] = self.comm.all_gather(self.param_shard[lo:hi], self.axis, out=full, async_op=True)
        if wait and u in self._gathers:
            work = self._gathers.pop(u)
            if work is not None:
                work.wait()
            if u in self._fp8_bytes:
                self.fp8_gathers[u].decode(self._fp8_bytes.pop(u), self.full[u])

    def _free(self, u: int) -> None:
        """Stage 3: give unit u's full storage back (its parameters keep their shapes)."""
        if self.gathered[u] and u not in self._pinned:
            self._gather(u, wait=True)  # never free under a transfer
            self.full[u].untyped_storage().resize_(0)
            if u in self.fp8_gathers:
                self.fp8_gathers[u].release()
            self.gathered[u] = False
            self.gathered_bytes -= self.buckets[u].numel * self.element_size

    def read_param_shard(self, out: torch.Tensor) -> None:
        """This rank's slice of every unit's parameters into `out` (stage 3: the shard is
        the truth; units gathered by ``materialize`` are written back into it first)."""
        if self.stage == 3:
            self._release()
            if out is not self.param_shard:
                out.copy_(self.param_shard)
            return
        self.wait_params()
        for u, full in enumerate(self.full):
            lo, hi = self._shard_range(u)
            k = hi - lo
            out[lo:hi] = full[self.rank * k:(self.rank + 1) * k]

    def start_param_gather(self, shard: torch.Tensor) -> None:
        """After the optimizer step. Stage 2: launch the all-gather of the updated `shard`
        into the full parameters, one call per unit in forward order; each unit's forward
        waits for its own. Stage 3: nothing (every forward gathers what it needs)."""
        if self.stage == 3:
            assert shard is self.param_shard, "ZeRO-3's optimizer steps the data-parallel shard itself"
            self._new_weights()
            return
        self.wait_params()
        for u, b in enumerate(self.buckets):
            lo, hi = self._shard_range(u)
            self._gathers[u] = self.comm.all_gather(shard[lo:hi], self.axis, out=self.full[u], async_op=True)

    def wait_params(self) -> None:
        """Complete the parameter all-gathers in flight (stage 2: the parameters are then
        final; stage 3 keeps them sharded: see `materialize`)."""
        for u in list(self._gathers):
            self._gather(u, wait=True)

    def materialize(self) -> None:
        """Every parameter whole and current, to be read or overwritten outside a forward
        (checkpoints, full weights): stage 3 gathers every unit and keeps them until the
        next step starts, writing this rank's slice back into the shard then."""
        self.wait_params()
        if self.stage == 3:
            for u in range(len(self.units)):
                if u in self.fp8_gathers and u not in self._pinned:
                    self._free(u)  # gathered on the FP8 grid for compute: gather the exact values
                self._gather(u, wait=True, exact=True)
                self._pinned.add(u)

    def _release(self) -> None:
        """Stage 3: write materialized units back into the shard; free every unit."""
        for u in sorted(self._pinned):
            lo, hi = self._shard_range(u)
            k = hi - lo
            self.param_shard[lo:hi] = self.full[u][self.rank * k:(self.rank + 1) * k]
        self._pinned.clear()
        for u in range(len(self.units)):
            self._free(u)
        self._new_weights()

    def _new_weights(self) -> None:
        """The shard may have changed (an optimizer step, a load): FP8 scales are reduced anew."""
        for g in self.fp8_gathers.values():
            g.new_step()

    # --- forward and backward hooks ----------------------------------------------------------------
    def _before_forward(self, u: int):
        @torch.compiler.disable
        def hook(module, args):
            if self._passed_in(u, "before_forward"):
                return
            self._gather(u, wait=True)  # stage 2: the all-gather after the last step
            if self.stage == 3 and self._next[u] is not None:
                self._gather(self._next[u], wait=False)  # prefetch: overlaps this unit's compute
        return hook

    def _after_forward(self, u: int):
        def hook(module, args, output):
            if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(self._before_backward(u))  # runs before the unit's backward
            if not self._passed_in(u, "after_forward"):
                self._free(u)
        return hook

    def _before_backward(self, u: int):
        def hook(grad):
            if self._passed_in(u, "before_backward"):
                return
            self._gather(u, wait=True)
            if self._prev[u] is not None:
                self._gather(self._prev[u], wait=False)  # the next unit backward reaches
        return hook

    # --- gradients: reduce-scatter each unit as soon as its backward is done ------------------------
    def _grad_ready(self, p) -> None:
        """Post-accumulate-grad hook: move `p`'s gradient into its unit's staging buffer;
        when the unit is complete, reduce-scatter it (and, stage 3, free the unit)."""
        u = self.unit_of[p]
        if self._staging[u] is None:
            self._staging[u] = torch.zeros(self.buckets[u].numel, dtype=p.dtype, device=p.device)
            self.staging_bytes += self.buckets[u].numel * self.element_size
            self.peak_staging_bytes = max(self.peak_staging_bytes, self.staging_bytes)
        off = self.offset[p] - self.buckets[u].start
        self._staging[u][off:off + p.numel()].view_as(p).add_(p.grad)
        p.grad = None  # no full gradient is kept
        self._pending[u] -= 1
        if self._pending[u] == 0 and self.unit_ops is not None:
            self._reduce_passed_in(u)
        elif self._pending[u] == 0:
            self._reduce(u)
            if self.stage == 3 and self.units[u][2] == "block":
                self._free(u)

    def _passed_in(self, u: int, moment: str) -> bool:
        """Run a passed-in unit's `moment` (before_forward, after_forward, before_backward);
        False when the engine does its own."""
        if self.unit_ops is None:
            return False
        getattr(self.unit_ops[u], moment)()
        self.gathered[u] = moment != "after_forward"
        return True

    def _reduce_passed_in(self, u: int) -> None:
        """A passed-in unit's after_backward: its shard of the mean gradient joins this
        rank's (the unit frees its parameters itself)."""
        staging, self._staging[u] = self._staging[u], None
        self._pending[u] = len(self.units[u][1])
        lo, hi = self._shard_range(u)
        self.shard_grad[lo:hi] += self.unit_ops[u].after_backward(staging)
        self.gathered[u] = False
        self.staging_bytes -= staging.numel() * self.element_size

    def _reduce(self, u: int) -> None:
        staging, self._staging[u] = self._staging[u], None
        self._pending[u] = len(self.units[u][1])
        staging.div_(self.replicas)  # pre-scale: the sum of the scaled gradients is the mean
        out = torch.empty(self.buckets[u].numel // self.d, dtype=staging.dtype, device=staging.device)
        work = self.comm.reduce_scatter(staging, self.axis, out=out, async_op=True)
        self._in_flight.append((u, work, staging, out))
        while len(self._in_flight) > self.max_in_flight:
            self._drain_one()

    def _drain_one(self) -> None:
        u, work, staging, out = self._in_flight.popleft()
        if work is not None:
            work.wait()
        lo, hi = self._shard_range(u)
        self.shard_grad[lo:hi] += out
        self.staging_bytes -= staging.numel() * self.element_size

    def _drain(self) -> None:
        while self._in_flight:
            self._drain_one()

    # --- the step's life cycle (the data-parallel interface) ---------------------------------------
    def zero_grad(self) -> None:
        """Start a step: no gradient anywhere; stage 3: every unit sharded."""
        if self.stage == 3:
            self._release()
        self.shard_grad.zero_()
        for p in self.params:
            p.grad = None

    @contextmanager
    def microbatch(self, last: bool):
        """Wrap a microbatch's backward: every microbatch reduce-scatters (there is no full
        gradient to accumulate into); its last reduce-scatters are waited for at the end."""
        yield
        self._drain()

    def finish(self) -> None:
        """Reduce-scatter what is left (units whose backward did not complete), wait for
        everything; afterwards ``shard_grad`` is this rank's shard of the mean gradient.
        Stage 3 frees the root units, kept since the step's first forward."""
        for u in range(len(self.units)):
            if self._staging[u] is not None:
                (self._reduce_passed_in if self.unit_ops is not None else self._reduce)(u)
        self._drain()
        if self.stage == 3:
            for u in range(len(self.units)):
                self._free(u)


def sharded_data_parallel(units, comm: Comm, stage: int):
    """ZeRO-2/3 over `units` as ``Trainer`` builds them: one :class:`ShardedDataParallel`, or
    with expert parallelism one per data group (dense parameters over every data replica,
    experts over the replicas holding the same experts), each over the units' parameters
    of its group (a block is then two units, each gathered and freed by its own hooks)."""
    fp8 = fp8_weights(units) if stage == 3 else {}
    units = split_fp8_units(units, fp8)
    groups = by_data_group([p for _, ps, _ in units for p in ps], comm)
    if len(groups) == 1:
        return ShardedDataParallel(units, comm, stage, fp8=fp8)
    parts = []
    for axis, ps in groups.items():
        mine = set(ps)
        parts.append(ShardedDataParallel([(m, [p for p in u if p in mine], k) for m, u, k in units], comm, stage,
                                         axis=axis, fp8=fp8))
    return GroupedData(parts)
