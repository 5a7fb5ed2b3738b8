"""Data parallelism written on torch.distributed collectives (no DistributedDataParallel).

Every data-parallel rank holds the same model (or the same tensor/pipeline part of it) and
1/d of the global batch. A microbatch loss is the mean over its tokens scaled by 1/m, so
the m backward passes of a rank sum to the gradient of its slice of the batch, and the
mean over the d ranks is the gradient of the whole global batch: exactly what one device
computes. Three ways to get that mean, from the textbook to the engine:

``NaiveDataParallel`` (``--dp-impl naive``)
    After the last backward, one all-reduce per parameter, then divide by d. Nothing
    overlaps: the network waits for backward, then backward's result waits for the network.

``BucketedDataParallel`` (``--dp-impl bucketed``, the default)
    Every gradient lives in one flat buffer (``p.grad`` is a view into it, so nothing is
    copied), laid out in reverse order of use — the order backward produces gradients — and
    cut into buckets of about ``--bucket-mb``. A post-accumulate-grad hook on each parameter
    counts, during the *last* microbatch's backward, the gradients still missing in each
    bucket; when a bucket is complete its all-reduce starts asynchronously and runs while
    backward computes the gradients of the layers below. Buckets start in bucket order, the
    same on every rank (collectives must be issued in the same order everywhere). Earlier
    microbatches only accumulate into the buffer: no communication at all. ``finish()``
    waits for every handle. The 1/d is applied before the sum (pre-scaling).

``BucketedDataParallel(shard=True)`` + ``ShardedAdamW`` (``--zero1``)
    The same buffer, with buckets whose sizes are multiples of d (the buffer is padded up
    to a multiple of d). Each bucket is *reduce-scattered*: rank r receives the summed
    r-th 1/d slice of every bucket — the gradient of its shard. `ShardedAdamW` keeps AdamW
    state for that shard only (1/d of the memory), clips with the exact global norm, steps
    the shard and all-gathers the updated parameters straight into a flat parameter buffer
    that the parameters are views of. Call bytes per step: reduce-scatter ``ceil(n/d)·d``
    elements, all-gather ``ceil(n/d)`` (see ``minitron.analysis``).

    The all-gather overlaps the *next forward* (ZeRO, Rajbhandari et al. 2020; Megatron-LM's
    distributed optimizer, ``--overlap-param-gather``): ``step()`` only launches it, one
    asynchronous call per bucket in forward order (the first layers' bucket first), and a
    forward pre-hook on each module waits for the buckets of its parameters just before it
    runs — the first layers compute while the last layers' parameters are still on the
    wire. That is the optimizer's side (``ParamGather``, owned by ``ShardedAdamW``): the
    gradient buckets know nothing of it, and plain bucketed data parallelism runs no
    forward hooks. Whatever reads parameters outside a forward (evaluation, checkpoints,
    the next optimizer step) calls ``optimizer.wait_params()`` first.

Each parameter is averaged over its own data group (``ShardInfo.data_axes``, named by
``ProcessGrid.data_axis``): a dense parameter over every rank that holds it and reads other
tokens (dp, and cp, ep when on), an expert of a mixture only over the ranks that hold the
same expert (dp, cp: not ep, over which the experts are split). An expert's gradient is
already the sum over the ep ranks whose tokens it served (the all-to-all's backward
brought their gradients to it), so every gradient is summed over its own group and divided
by the number of data replicas of the dense group: the mean over the whole batch, as one
device computes it. The bucketed buffer keeps each group's parameters together, in buckets
of their own (``buckets.plan_by_axis``).

Gradients that must also be summed over another axis (``ShardInfo.grad_sync``: the tied
embedding between the first and last stage, LayerNorm under sequence parallelism) are
summed in ``finish()`` too: after the data-parallel average for the replicated optimizer;
with ZeRO-1 *before* the reduce-scatter (the stages' shards do not line up), so they sit
at the end of the buffer and their buckets start in ``finish()``.

ZeRO-2 and ZeRO-3 (``--zero 2|3``) shard gradients and parameters too: see
``minitron.parallel.zero``.

The interface every implementation offers the training loop and the pipeline runtime::

    dp.zero_grad()                    # once per step, before the first microbatch
    with dp.microbatch(last=k == m - 1):
        loss.backward()               # hooks may start communication (last microbatch only)
    dp.finish()                       # every gradient whole and averaged
"""
from __future__ import annotations

from collections import Counter
from contextlib import ExitStack, contextmanager

import torch

from .buckets import Bucket, bucket_elements, plan_by_axis
from ..comm import Comm
from ..config import ParallelConfig, TrainConfig
from ..optim import clip_coef, owns_copy, sum_of_squares, sync_replicated_grads, unique_params


def grad_axis(comm: Comm) -> str:
    """The axis gradients are averaged over: the data-parallel ranks, and under context
    parallelism the context ranks too ('dp_cp': the same weights on different tokens;
    Megatron-Core's data-parallel group "with context parallel")."""
    return comm.grid.data_axis()


def param_axis(p, comm: Comm) -> str:
    """The group parameter `p`'s gradient is averaged over: its own data axes
    (``ShardInfo.data_axes``; an expert's leave out ep)."""
    return comm.grid.data_axis(p.shard.data_axes)


class NaiveDataParallel:
    """All-reduce every gradient after backward (one call per parameter)."""

    def __init__(self, params, comm: Comm):
        self.params, self.comm = unique_params(params), comm
        self.axis = grad_axis(comm)
        self.d = comm.size(self.axis)
        self.axes = {p: param_axis(p, comm) for p in self.params}

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @contextmanager
    def microbatch(self, last: bool):
        """Wrap a microbatch's backward; only the last one will be synchronised."""
        yield

    def finish(self) -> None:
        """Average gradients over the data-parallel group (before the optimizer step)."""
        if self.d > 1:
            for p in self.params:
                if p.grad is not None:
                    self.comm.all_reduce(p.grad, self.axes[p])  # nothing on a group of one
                    p.grad.div_(self.d)  # every replica's share of the batch (see the module doc)
        sync_replicated_grads(self.params, self.comm)



# --- a flat buffer cut into buckets, each split evenly over the data-parallel ranks --------------
class FlatShards:
    """Where this rank's 1/d shard of a flat, bucketed buffer lies (ZeRO-1 and ZeRO-2/3 alike).

    The buffer holds ``params`` back to back at ``offsets`` (``numel`` elements in all); each
    bucket (a ZeRO unit) is padded to a multiple of d and rank r owns its r-th d-th part, so
    the shard is every bucket's part in order. Needs ``buckets, offsets, params, numel, d,
    rank, comm, axis`` on the instance."""

    def own_ranges(self) -> list[tuple[int, int, int]]:
        """(flat start, flat end, shard start) of this rank's slice of every bucket (unit)."""
        out = []
        for b in self.buckets:
            k = b.numel // self.d
            out.append((b.start + self.rank * k, b.start + (self.rank + 1) * k, b.start // self.d))
        return out

    def segments(self) -> list[tuple]:
        """(param, shard start, shard end, element offset in the param) of every piece of a
        parameter that lies in this rank's shard."""
        out = []
        for lo, hi, s0 in self.own_ranges():
            for p, off in zip(self.params, self.offsets):
                a, b = max(lo, off), min(hi, off + p.numel())
                if a < b:
                    out.append((p, s0 + a - lo, s0 + b - lo, a - off))
        return out

    def gather_flat(self, shard: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """All-gather a shard-sized tensor into a buffer-sized one (bucket by bucket)."""
        out = torch.empty(self.numel, dtype=shard.dtype, device=shard.device) if out is None else out
        works = [self.comm.all_gather(shard[b.start // self.d:b.end // self.d], self.axis,
                                      out=out[b.start:b.end], async_op=True) for b in self.buckets]
        for w in works:
            w.wait()
        return out


# --- bucketed, overlapped all-reduce (and reduce-scatter for ZeRO-1) ------------------------------
class BucketedDataParallel(FlatShards):
    """Flat gradient buckets whose collectives overlap the last microbatch's backward.

    `shard=False`: all-reduce (every rank ends with the whole averaged gradient in
    ``p.grad``). `shard=True` (ZeRO-1): reduce-scatter into ``shard_grad`` (this rank's
    1/d of the averaged flat gradient), and the parameters become views into
    ``param_buffer`` so that the optimizer can all-gather into them. `overlap=False`
    makes one bucket that starts in ``finish()`` (the naive flavour). A parameter listed
    more than once in `params` (used by that many of the rank's model chunks: the V's
    embedding) gets a gradient from each chunk's last backward: its buckets wait for all.
    """

    def __init__(self, params, comm: Comm, bucket_mb: float = 4.0, shard: bool = False,
                 overlap: bool = True, axis: str | None = None):
        self.axis = axis or grad_axis(comm)  # ZeRO-1 of one data group (GroupedData): that group's
        self.comm, self.d, self.rank = comm, comm.size(self.axis), comm.index(self.axis)
        self.replicas = comm.size(grad_axis(comm))  # every gradient is a mean over all data replicas
        self.shard = shard
        params = list(params)
        uses = Counter(map(id, params))  # the chunks that use each parameter
        order = [p for p in reversed(unique_params(params)) if p.requires_grad]  # ~ order of backward
        if shard:  # summed over another axis before the reduce-scatter: at the end (see finish)
            order = [p for p in order if not p.shard.grad_sync] + [p for p in order if p.shard.grad_sync]
        axes = [param_axis(p, comm) for p in order]
        if shard and set(axes) != {self.axis}:
            raise ValueError(f"ZeRO-1 shards one flat buffer over one data group, not {sorted(set(axes))}")
        groups = list(dict.fromkeys(axes))  # each data group's parameters together, backward order kept
        order = [p for g in groups for p, a in zip(order, axes) if a == g]
        axes = sorted(axes, key=groups.index)
        self.params = order
        self.uses = [uses[id(p)] for p in order]  # gradients each parameter receives in a last microbatch
        dtypes = {p.dtype for p in order}
        if len(dtypes) != 1:
            raise ValueError(f"bucketed data parallelism needs one parameter dtype, got {sorted(map(str, dtypes))}")
        dtype, device = order[0].dtype, order[0].device
        cap = bucket_elements(bucket_mb, order[0].element_size()) if overlap else sum(p.numel() for p in order)
        self.offsets, self.buckets, self.numel = plan_by_axis([p.numel() for p in order], axes, cap,
                                                              self.d if shard else 1)
        for b in self.buckets:
            b.late = shard and any(order[i].shard.grad_sync for i in b.tensors)
        self.bucket_of = {p: [b.index for b in self.buckets if i in b.tensors] for i, p in enumerate(order)}
        self.offset = dict(zip(order, self.offsets))
        # ZeRO-1 gathers start in forward order: the bucket holding the earliest-used parameter
        # first (the reverse of the buffer, except the grad_sync buckets at its end)
        fwd = {p: i for i, p in enumerate(unique_params(params))}
        self.gather_order = sorted(range(len(self.buckets)),
                                   key=lambda k: min(fwd[order[i]] for i in self.buckets[k].tensors))

        self.grad_buffer = torch.zeros(self.numel, dtype=dtype, device=device)
        self.views = {p: self._view(self.grad_buffer, p) for p in order}
        for p in order:
            p.grad = self.views[p]
        if shard:
            self.param_buffer = torch.zeros(self.numel, dtype=dtype, device=device)
            with torch.no_grad():
                for p in order:
                    view = self._view(self.param_buffer, p)
                    view.copy_(p.detach())
                    p.data = view
            self.shard_grad = torch.zeros(self.numel // self.d, dtype=dtype, device=device)
        self._sync = False
        self._handles: list = []
        self._reset()
        if overlap and any(comm.size(b.axis) > 1 for b in self.buckets):
            self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in order]

    def _view(self, flat: torch.Tensor, p) -> torch.Tensor:
        """`p`'s place in a buffer-sized flat tensor, shaped like `p`."""
        off = self.offset[p]
        return flat[off:off + p.numel()].view_as(p)

    # --- the step's life cycle ------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Zero the gradient buffer in place (``set_to_none`` would cut ``p.grad`` loose)."""
        self.grad_buffer.zero_()
        for p in self.params:
            if p.grad is None or p.grad.data_ptr() != self.views[p].data_ptr():
                p.grad = self.views[p]
        self._reset()

    def _reset(self) -> None:
        self._pending = [sum(self.uses[i] for i in b.tensors) for b in self.buckets]
        self._next = 0  # the next bucket to start: buckets start in order on every rank

    @contextmanager
    def microbatch(self, last: bool):
        """Wrap a microbatch's backward: only within `last=True` do hooks start buckets."""
        old, self._sync = self._sync, last
        try:
            yield
        finally:
            self._sync = old

    def _grad_ready(self, p) -> None:
        """Post-accumulate-grad hook: `p`'s gradient of this backward is in the buffer."""
        if not self._sync:
            return
        self._adopt(p)
        for b in self.bucket_of[p]:
            self._pending[b] -= 1
        self._start_buckets()

    def _adopt(self, p) -> None:
        """If something replaced ``p.grad`` (e.g. ``zero_grad(set_to_none=True)``), copy it
        back into the buffer and make ``p.grad`` the view again."""
        view = self.views[p]
        if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view

    def _start_buckets(self, force: bool = False, late: bool = False) -> None:
        """Start, in order, the buckets that are complete (all remaining ones with
        `force`; late ones only with `late`)."""
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if (b.late and not late) or (self._pending[b.index] > 0 and not force):
                return
            self.start_bucket(b)
            self._next += 1

    def start_bucket(self, b: Bucket) -> None:
        """Start bucket `b`'s collective (asynchronous): all-reduce, or with ZeRO-1 the
        reduce-scatter into ``shard_grad``; pre-scaled by 1/d."""
        flat = self.grad_buffer[b.start:b.end]
        flat.div_(self.replicas)  # pre-scale over every data replica: the sum of the scaled gradients is the mean
        if self.shard:
            out = self.shard_grad[b.start // self.d:b.end // self.d]
            work = self.comm.reduce_scatter(flat, b.axis, out=out, async_op=True)
        else:
            work = self.comm.all_reduce(flat, b.axis, async_op=True)
        if work is not None:
            self._handles.append(work)

    def finish(self) -> None:
        """Start what the hooks did not, wait for everything: afterwards ``p.grad`` is the
        averaged gradient (ZeRO-1: ``shard_grad`` is this rank's shard of it)."""
        for b in self.buckets[self._next:]:
            for i in b.tensors:
                self._adopt(self.params[i])
        self._start_buckets(force=True)
        if self.shard:
            sync_replicated_grads([p for p in self.params if p.shard.grad_sync], self.comm)
            self._start_buckets(force=True, late=True)
        for w in self._handles:
            w.wait()
        self._handles = []
        if not self.shard:
            sync_replicated_grads(self.params, self.comm)
        self._reset()

    # --- ZeRO-1 helpers ---------------------------------------------------------------------------
    def read_param_shard(self, out: torch.Tensor) -> None:
        """Copy this rank's slice of every bucket of ``param_buffer`` into `out`."""
        for lo, hi, s0 in self.own_ranges():
            out[s0:s0 + hi - lo] = self.param_buffer[lo:hi]



# --- ZeRO-1: the parameter all-gather, overlapped with the next forward (the optimizer's side) ----
class ParamGather:
    """ZeRO-1's all-gather of the updated parameter shard into ``dp.param_buffer`` (the
    parameters are views of it), one asynchronous call per bucket in forward order, each
    waited for by a forward pre-hook just before the first module that reads its
    parameters runs. Owned by ``ShardedAdamW``; `points` as in :meth:`wait_before`."""

    def __init__(self, dp: BucketedDataParallel, points=()):
        self.dp = dp
        self._gathers: dict = {}  # bucket index -> all-gather handle not yet waited for
        self._hooks: list = []
        if points:
            self.wait_before(points)

    def start_param_gather(self, shard: torch.Tensor) -> None:
        """Launch the all-gather of the updated shard into ``param_buffer``, one asynchronous
        call per bucket in forward order, and return at once: the forward pre-hooks (see
        `wait_before`) or `wait_params` complete them. `shard` must not change until then."""
        self.wait_params()
        dp = self.dp
        for k in dp.gather_order:
            b = dp.buckets[k]
            self._gathers[k] = dp.comm.all_gather(shard[b.start // dp.d:b.end // dp.d], dp.axis,
                                                  out=dp.param_buffer[b.start:b.end], async_op=True)

    @property
    def pending_gathers(self) -> list[int]:
        """Buckets whose parameter all-gather has been launched but not waited for."""
        return sorted(self._gathers)

    def _wait_buckets(self, buckets) -> None:
        for k in buckets:
            work = self._gathers.pop(k, None)
            if work is not None:
                work.wait()

    def wait_params(self) -> None:
        """Complete every pending parameter all-gather: call before reading parameters
        outside a forward (evaluation, checkpoints, the optimizer step)."""
        self._wait_buckets(list(self._gathers))

    materialize = wait_params  # every parameter whole and current (for checkpoints)

    def wait_before(self, points) -> None:
        """`points`: [(module, params)]; a forward pre-hook on each module waits for the
        buckets of its `params`. Every parameter must be covered (else a forward could read
        it stale): list a module that runs before the parameter is used."""
        covered = set()
        for module, params in points:
            buckets = sorted({k for p in params for k in self.dp.bucket_of.get(p, ())})
            covered.update(params)
            if buckets:
                self._hooks.append(module.register_forward_pre_hook(self._waiter(buckets)))
        missing = [p.shard.name for p in self.dp.params if p not in covered]
        if missing:
            raise ValueError(f"no forward waits for the all-gather of {missing[:3]}")

    def _waiter(self, buckets):
        @torch.compiler.disable  # runs eagerly, also inside a compiled block (a graph break)
        def hook(module, args):
            if self._gathers:
                self._wait_buckets(buckets)
        return hook


def _merge(ranges) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in sorted(ranges):
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b])
    return [tuple(r) for r in out]


def _complement(ranges, n: int) -> list[tuple[int, int]]:
    """The pieces of range(n) outside the sorted, disjoint `ranges`."""
    out, start = [], 0
    for a, b in ranges:
        if a > start:
            out.append((start, a))
        start = b
    return out + ([(start, n)] if start < n else [])


class ShardedAdamW:
    """ZeRO's sharded optimizer: AdamW whose state covers only this rank's 1/d of the flat
    parameters. Stage 1 with a ``BucketedDataParallel(shard=True)`` and a ``ParamGather``
    (`gather`: the updated shard's all-gather, overlapped with the next forward); stages 2
    and 3 with a ``minitron.parallel.zero.ShardedDataParallel``, which gathers its units
    itself (`gather` defaults to it). ``dp`` offers ``shard_grad``, ``own_ranges``,
    ``segments``, ``read_param_shard``; ``gather`` offers ``start_param_gather``,
    ``wait_params``, ``materialize``. The optimizer protocol of ``minitron.optim``.

    The same math as ``torch.optim.AdamW`` with the Trainer's groups (weight decay on
    tensors of dim >= 2 only, betas (0.9, 0.95), eps 1e-8), applied elementwise to the shard.
    Clipping uses the exact global norm: squares summed over this rank's shard (one copy
    of a replicated parameter, as in ``optim.owns_copy``), all-reduced over dp, tp and pp.
    """

    def __init__(self, dp: BucketedDataParallel, train: TrainConfig, gather=None, betas=(0.9, 0.95),
                 eps: float = 1e-8):
        if not dp.shard:
            raise ValueError("ShardedAdamW needs a BucketedDataParallel built with shard=True")
        self.dp, self.comm = dp, dp.comm
        self.gather = gather if gather is not None else dp
        self.betas, self.eps, self.weight_decay = betas, eps, train.weight_decay
        n = dp.numel // dp.d
        like = dp.shard_grad
        self.exp_avg, self.exp_avg_sq = torch.zeros_like(like), torch.zeros_like(like)
        # ZeRO-3: the parameters live in the shard (the data-parallel object's); else a copy
        own = getattr(dp, "param_shard", None)
        self.shard_param = own if own is not None else torch.zeros(n, dtype=like.dtype, device=like.device)
        self.steps = 0
        segs = dp.segments()
        self._decay = _merge((a, b) for p, a, b, _ in segs if p.dim() >= 2)
        self._counted = _merge((a, b) for p, a, b, _ in segs if owns_copy(p, self.comm, sharded=True))
        self._no_decay = _complement(self._decay, n)
        self._step = torch.zeros((), dtype=torch.float32, device=like.device)  # read by the fused kernel

    def state_tensors(self) -> list[torch.Tensor]:
        """The optimizer state this rank holds: Adam's two moments of its shard."""
        return [self.exp_avg, self.exp_avg_sq]

    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank (exp_avg and exp_avg_sq)."""
        return sum(t.numel() * t.element_size() for t in self.state_tensors())

    def wait_params(self) -> None:
        """Complete the parameters' all-gather left in flight by the last step."""
        self.gather.wait_params()

    def materialize(self) -> None:
        """Every parameter whole and current, to be read or overwritten (checkpoints)."""
        self.gather.materialize()

    def grad_sq(self) -> torch.Tensor:
        """The squared norm of every gradient this optimizer steps, over all ranks: the
        shards summed over the data group, tp and pp (and ep for experts, split over it)."""
        g = self.dp.shard_grad
        sq = sum_of_squares((g[a:b] for a, b in self._counted), g.device)
        over_ep = () if "ep" in self.dp.axis.split("_") else ("ep",)
        for axis in (self.dp.axis, "tp", "pp", *over_ep):
            self.comm.all_reduce(sq, axis)
        return sq

    def grad_norm(self) -> torch.Tensor:
        """The exact global gradient norm, from the shards (a 0-dim device tensor)."""
        return self.grad_sq().sqrt()

    @torch.no_grad()
    def step(self, lr: float, max_norm: float = 0.0, norm: torch.Tensor | None = None) -> torch.Tensor:
        """Clip, step the shard, launch the parameters' all-gather (the next forward or
        ``wait_params()`` completes it); returns the gradient norm (`norm`: the global one,
        given by a :class:`GroupedOptimizer`)."""
        self.wait_params()  # reads param_buffer and overwrites the shard being sent
        g, p = self.dp.shard_grad, self.shard_param
        norm = self.grad_norm() if norm is None else norm
        if max_norm > 0:
            g.mul_(clip_coef(norm, max_norm).to(g.dtype))
        self.dp.read_param_shard(p)  # current values (they may have been loaded)
        self.steps += 1
        self._step.fill_(self.steps)
        # AdamW on the shard's pieces in one fused pass, the kernel torch.optim.AdamW(fused=True)
        # runs (decoupled weight decay on matrices only): p *= 1 - lr·wd; m = β1·m + (1-β1)·g;
        # v = β2·v + (1-β2)·g²; p -= lr/(1-β1^t) · m / (sqrt(v)/sqrt(1-β2^t) + eps). Elementwise
        # torch ops would pass over the shard eight times (3x slower than the replicated step).
        beta1, beta2 = self.betas
        for ranges, wd in ((self._decay, self.weight_decay), (self._no_decay, 0.0)):
            if ranges:
                pieces = [[t[a:b] for a, b in ranges] for t in (p, g, self.exp_avg, self.exp_avg_sq)]
                torch._fused_adamw_(*pieces, [], [self._step] * len(ranges), lr=lr, beta1=beta1, beta2=beta2,
                                    weight_decay=wd, eps=self.eps, amsgrad=False, maximize=False)
        self.gather.start_param_gather(p)
        return norm

    # --- layout-independent checkpoints (minitron/checkpoint.py) ------------------------------------
    def export_param_state(self) -> dict:
        """{param: {"exp_avg", "exp_avg_sq", "step"}} with full local shapes (collective over dp)."""
        self.wait_params()
        if self.steps == 0:
            return {p: {} for p in self.dp.params}
        with self.comm.in_phase("checkpoint"):
            full = {k: self.dp.gather_flat(getattr(self, k)) for k in ("exp_avg", "exp_avg_sq")}
        return {p: {"exp_avg": self.dp._view(full["exp_avg"], p), "exp_avg_sq": self.dp._view(full["exp_avg_sq"], p),
                    "step": float(self.steps)} for p in self.dp.params}

    def import_param_state(self, states: dict) -> None:
        """Load per-parameter state of full local shapes; keep this rank's shard."""
        for key in ("exp_avg", "exp_avg_sq"):
            full = torch.zeros(self.dp.numel, dtype=self.exp_avg.dtype, device=self.exp_avg.device)
            for p in self.dp.params:
                if key in states.get(p, {}):
                    self.dp._view(full, p).copy_(states[p][key])
            mine = getattr(self, key)
            for lo, hi, s0 in self.dp.own_ranges():
                mine[s0:s0 + hi - lo] = full[lo:hi]
        steps = {float(st["step"]) for st in states.values() if "step" in st}
        self.steps = int(max(steps)) if steps else 0


# --- ZeRO over several data groups (expert parallelism: dense over ep × dp, experts over dp) -------
def by_data_group(params, comm: Comm) -> dict:
    """{data group: its parameters}, the dense group first (``param_axis``)."""
    groups: dict = {grad_axis(comm): []}
    for p in params:
        groups.setdefault(param_axis(p, comm), []).append(p)
    return {a: ps for a, ps in groups.items() if ps}


class GroupedData:
    """One ZeRO synchroniser per data group, driven as one: dense parameters sharded over
    every data replica, experts over the replicas that hold the same experts. Each part
    keeps its own flat buffers, buckets and hooks; their collectives are on different
    groups, each issued in the same order by every member."""

    def __init__(self, parts):
        self.parts, self.comm, self.shard = list(parts), parts[0].comm, True
        self.params = [p for d in self.parts for p in d.params]

    def zero_grad(self) -> None:
        for d in self.parts:
            d.zero_grad()

    @contextmanager
    def microbatch(self, last: bool):
        with ExitStack() as stack:
            for d in self.parts:
                stack.enter_context(d.microbatch(last))
            yield

    def finish(self) -> None:
        for d in self.parts:
            d.finish()

    def materialize(self) -> None:
        for d in self.parts:
            if hasattr(d, "materialize"):
                d.materialize()


class GroupedOptimizer:
    """ZeRO's sharded AdamW of each data group (:class:`GroupedData`'s parts), clipped by one
    global norm: the groups' squared norms summed (the optimizer protocol of ``minitron.optim``)."""

    def __init__(self, parts):
        self.parts = list(parts)

    @torch.no_grad()
    def step(self, lr: float, max_norm: float = 0.0) -> torch.Tensor:
        for o in self.parts:
            o.wait_params()
        norm = sum(o.grad_sq() for o in self.parts).sqrt()
        for o in self.parts:
            o.step(lr, max_norm, norm=norm)
        return norm

    def wait_params(self) -> None:
        for o in self.parts:
            o.wait_params()

    def materialize(self) -> None:
        for o in self.parts:
            o.materialize()

    def state_tensors(self) -> list:
        return [t for o in self.parts for t in o.state_tensors()]

    def state_bytes(self) -> int:
        return sum(o.state_bytes() for o in self.parts)

    def export_param_state(self) -> dict:
        return {k: v for o in self.parts for k, v in o.export_param_state().items()}

    def import_param_state(self, states: dict) -> None:
        for o in self.parts:
            o.import_param_state({p: states[p] for p in o.dp.params if p in states})


def sharded_optimizer(dp, train: TrainConfig, points=None):
    """ZeRO's optimizer for `dp` (one synchroniser or a :class:`GroupedData`): ``ShardedAdamW``
    per part; with ZeRO-1 (`points`: where forwards wait) each part's all-gather overlaps
    the next forward (``ParamGather``)."""
    def one(d):
        return ShardedAdamW(d, train, gather=ParamGather(d, points) if points is not None else None)
    return GroupedOptimizer([one(d) for d in dp.parts]) if isinstance(dp, GroupedData) else one(dp)


def make_data_parallel(params, comm: Comm, layout: ParallelConfig):
    """The gradient synchroniser chosen by `--dp-impl` (and `--zero1`)."""
    if comm.size(grad_axis(comm)) == 1:
        return NaiveDataParallel(params, comm)
    overlap = layout.dp_impl == "bucketed"
    if layout.zero1:
        groups = by_data_group([p for p in params if p.requires_grad], comm)  # a shared one as often as used
        if len(groups) > 1:
            return GroupedData([BucketedDataParallel(ps, comm, layout.bucket_mb, shard=True, overlap=overlap, axis=a)
                                for a, ps in groups.items()])
        return BucketedDataParallel(params, comm, layout.bucket_mb, shard=True, overlap=overlap)
    if overlap:
        return BucketedDataParallel(params, comm, layout.bucket_mb)
    return NaiveDataParallel(params, comm)

