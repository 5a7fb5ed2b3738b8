"""One door for communication: every collective and point-to-point call goes through here.

`Comm` wraps torch.distributed for a :class:`~minitron.grid.ProcessGrid`, addressing
groups by *axis* ('tp', 'dp', 'pp', 'cube_i', ..., 'embed', 'world'). A call on an
axis of size 1 is a no-op and is not recorded: nothing crosses a wire.

With a :class:`CommTrace` attached, each call appends one record
``{rank, step, microbatch, op, axis, bytes, phase, shape, dtype}`` where ``bytes`` is the payload
of the local tensor handed to the call: the whole tensor for all_reduce, broadcast,
send and recv; the local *shard* for all_gather; the full local *input* for
reduce_scatter. Without a trace the only cost is one ``is None`` test per call.

One axis is not a process group of the grid: ``'replica'``, the fault-tolerant replicas of
``fault_tolerance.py``, each a world of its own, averaged through the torchft `Manager` a
Comm is given where it is made (:meth:`Comm.with_replicas`); its size is the step's quorum.
"""
from __future__ import annotations

import itertools
import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .grid import ProcessGrid

# the axis of fault-tolerant replicas (torchft replica groups): no group of the grid, a
# quorum decided step by step (fault_tolerance.py)
REPLICA_AXIS = "replica"

# Under --compile every call here runs eagerly (a graph break): a compiled graph would
# freeze the trace labels (step, phase) and cannot own a gloo process group.
eager = torch.compiler.disable


@dataclass
class CommTrace:
    """The recorded calls of one rank (a list of dicts), written as JSON lines."""

    records: list = field(default_factory=list)

    def add(self, **rec) -> dict:
        self.records.append(rec)
        return rec

    def completed(self, rec: dict, waited: float | None) -> None:
        """The call of `rec` is done, waited for since `waited` (a ``time.perf_counter()``;
        None: since it was issued, a blocking call). Nothing here: a :class:`TimedTrace`
        stamps the record."""

    def write(self, path: str) -> None:
        with open(path, "a") as f:
            for r in self.records:
                f.write(json.dumps(r) + "\n")

    def select(self, **match) -> list[dict]:
        return select(self.records, **match)

    def total_bytes(self, **match) -> int:
        return sum(r["bytes"] for r in self.select(**match))


class TimedTrace(CommTrace):
    """A :class:`CommTrace` whose records also carry ``t`` (the
    ``time.perf_counter()`` when the call was issued) and ``seq``, a counter shared with
    :meth:`stamp`, so that calls and other events have one total order; once the call is
    done, ``waited`` (when the rank began to wait for it: ``t`` for a blocking call, the
    ``Pending.wait()`` for an asynchronous one) and ``done`` (when the wait returned).
    Between ``t`` and ``waited`` the rank computed while the call was in flight: that is
    the time the call could hide under (:func:`minitron.viz.comm.exposure_by_axis`)."""

    def __init__(self):
        super().__init__()
        self.counter = itertools.count()

    def stamp(self) -> tuple[int, float]:
        """(sequence number, time) for an event that is not a call."""
        return next(self.counter), time.perf_counter()

    def add(self, **rec) -> dict:
        seq, t = self.stamp()
        return super().add(**rec, seq=seq, t=t)

    def completed(self, rec: dict, waited: float | None) -> None:
        rec["waited"] = rec["t"] if waited is None else waited
        rec["done"] = time.perf_counter()


@dataclass
class Pending:
    """A collective in flight: ``wait()`` blocks until it is done and returns its
    result. Holds the input too, so that it lives as long as the transfer."""

    result: torch.Tensor
    work: object = None
    source: torch.Tensor | None = None
    dtype: torch.dtype | None = None  # the caller's dtype, when the wire's differs
    then: object = None  # local work that completes the result once the transfer is done
    records: tuple = ()  # the trace records of the call(s), told when they are done
    trace: CommTrace | None = None

    @eager
    def wait(self) -> torch.Tensor:
        waited = time.perf_counter() if self.records else None
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.then is not None:
            self.then, then = None, self.then
            then()
        for rec in self.records:
            self.trace.completed(rec, waited)
        self.records = ()
        return self.result if self.dtype is None else self.result.to(self.dtype)


@dataclass
class _Works:
    """Several work handles waited as one (the two halves of a ring step)."""

    works: list

    def wait(self) -> None:
        for w in self.works:
            w.wait()


def reduce_scatter_single(out: torch.Tensor, x: torch.Tensor, group=None, async_op: bool = False) -> Pending:
    """Reduce-scatter `x` along dim 0 into `out` over `group` (the engine's, every
    caller's); returns a :class:`Pending`, done already unless `async_op`.

    gloo's own reduce-scatter costs a whole all-reduce and more (1 MB on 2 ranks of this
    course's CPU machine: 2.8 ms, the all-reduce 1.7 ms). An all-to-all moves the same
    (n-1)/n of `x` out of each rank and in, after which each rank sums its n pieces itself
    (0.6 ms, the sum included): so on gloo, that; elsewhere (NCCL) the backend's own. The
    pieces are a transient copy of `x`, freed with the Pending."""
    if dist.get_backend(group) != "gloo":
        return Pending(out, dist.reduce_scatter_single(out, x, group=group, async_op=async_op))
    n = dist.get_world_size(group)
    pieces = torch.empty_like(x)  # row block j: rank j's block for this rank
    work = dist.all_to_all_single(pieces, x, group=group, async_op=async_op)
    done = Pending(out, work, then=lambda: torch.sum(pieces.view(n, *out.shape), 0, out=out))
    if not async_op:
        done.wait()
    return done


def wire_dtype_for(layout) -> torch.dtype | None:
    """The dtype a layout's activations travel in: bfloat16 under ``--precision bf16``
    (Megatron's bf16 activations), else None (as computed)."""
    return torch.bfloat16 if layout.precision == "bf16" else None


def read_trace(path: str) -> list[dict]:
    """Load a trace file written by ``--trace`` (all ranks, JSON lines)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def select(records: list[dict], **match) -> list[dict]:
    """The records whose fields equal every `match` (e.g. ``rank=0, step=1, axis='dp'``),
    in issue order."""
    return [r for r in records if all(r.get(k) == v for k, v in match.items())]


@dataclass
class _Scope:
    """What a Comm and its views (:meth:`Comm.with_wire_dtype`) share: the trace installed
    for the current scope and the labels its records get. Changed only by the context
    managers of :class:`Comm` (:meth:`~Comm.tracing`, :meth:`~Comm.labelled`,
    :meth:`~Comm.in_phase`), each restoring it on exit."""
    trace: CommTrace | None = None
    phase: str = "other"
    step: int = 0
    microbatch: int | None = None


class Comm:
    """Collectives and p2p on the axes of a grid, optionally traced.

    Everything a Comm holds is fixed where it is made (the grid, dry or not, the wire
    dtype) or installed for a scope by its own context managers, never assigned from
    outside: a trace by :meth:`tracing`; the labels of the trace records — `phase`
    ('fwd', 'bwd', 'optim', 'log', 'other') by :meth:`in_phase`, `microbatch` (None
    outside a microbatch) by :meth:`labelled`, `step` by :meth:`begin_step` — which only
    label records (the dropout keys get the step and microbatch passed explicitly,
    ``parallel/pipeline.py``).
    """

    def __init__(self, grid: ProcessGrid | None = None, trace: CommTrace | None = None, dry: bool = False,
                 wire_dtype: torch.dtype | None = None, *, scope: _Scope | None = None, replicas=None):
        self.grid = grid or ProcessGrid()
        # the torchft Manager of the 'replica' axis (None: no such axis, its size is 1)
        self._replicas = replicas
        # the trace and the labels (`scope`: those of the Comm this one is a view of)
        self._scope = scope if scope is not None else _Scope(trace)
        # A dry run (the analysis's): one rank's view of a layout with no process group,
        # on the meta device. Every call is recorded as usual and returns a result of the
        # right shape, but nothing is sent: the analysis runs the model's own forward and
        # backward to read what it holds and what it would send (analysis/dry_run.py).
        self.dry = dry
        # the dtype activations and their gradients travel in between tensor ranks and
        # pipeline stages: bf16 under --precision bf16 (Megatron's bf16 activations,
        # :func:`wire_dtype_for`), else None (as computed). Only calls marked
        # `activation=True` use it: parameters and gradient reductions never change dtype.
        self._wire_dtype = wire_dtype

    # --- what it is, and the scope it records in ---------------------------------
    @property
    def wire_dtype(self) -> torch.dtype | None:
        return self._wire_dtype

    def with_wire_dtype(self, dtype: torch.dtype | None) -> "Comm":
        """This Comm with activations on the wire in `dtype` (itself when it has that
        already): a view sharing the grid, the trace and the labels (a Trainer's, when
        the Comm handed to it was made for another precision)."""
        if dtype == self._wire_dtype:
            return self
        return Comm(self.grid, dry=self.dry, wire_dtype=dtype, scope=self._scope, replicas=self._replicas)

    def with_replicas(self, manager) -> "Comm":
        """This Comm with a 'replica' axis: the fault-tolerant replicas whose quorum the
        torchft `manager` decides each step (``fault_tolerance.py``); a view sharing the
        grid, the trace and the labels."""
        return Comm(self.grid, dry=self.dry, wire_dtype=self._wire_dtype, scope=self._scope, replicas=manager)

    @property
    def trace(self) -> CommTrace | None:
        return self._scope.trace

    @property
    def phase(self) -> str:
        return self._scope.phase

    @property
    def step(self) -> int:
        return self._scope.step

    @property
    def microbatch(self) -> int | None:
        return self._scope.microbatch

    @contextmanager
    def tracing(self, trace: CommTrace | None):
        """Record the calls made inside into `trace` (None: record nothing); the trace
        installed before comes back on exit. Yields `trace`."""
        old, self._scope.trace = self._scope.trace, trace
        try:
            yield trace
        finally:
            self._scope.trace = old

    def begin_step(self, step: int) -> None:
        """Label the records of the calls from now on with training step `step` (the
        Trainer's, as the step begins): what runs after it until the next one begins (an
        evaluation, a checkpoint) is labelled with it too. A label only: the step itself
        is passed to what needs it (the dropout keys)."""
        self._scope.step = step

    @contextmanager
    def labelled(self, **labels):
        """Label the records of the calls made inside with `step` and/or `microbatch`
        (the Trainer's step, the pipeline's microbatch); the labels before come back on
        exit."""
        unknown = set(labels) - {"step", "microbatch"}
        if unknown:
            raise TypeError(f"a trace record has no label {', '.join(sorted(unknown))}: use step or microbatch")
        old = {k: getattr(self._scope, k) for k in labels}
        vars(self._scope).update(labels)
        try:
            yield self
        finally:
            vars(self._scope).update(old)

    # --- bookkeeping ------------------------------------------------------------
    def size(self, axis: str) -> int:
        if axis == REPLICA_AXIS:  # the replicas in this step's quorum
            return 1 if self._replicas is None else self._replicas.num_participants()
        return self.grid.axis_size(axis)

    def index(self, axis: str) -> int:
        return self.grid.axis_index(axis)

    def group(self, axis: str):
        return self.grid.groups.get(axis)

    @contextmanager
    def in_phase(self, phase: str):
        old, self._scope.phase = self._scope.phase, phase
        try:
            yield
        finally:
            self._scope.phase = old

    def _record(self, op: str, axis: str, t: torch.Tensor, labels: dict | None = None) -> dict | None:
        """Append the call's record to the trace installed (if any) and return it."""
        if self.trace is not None:
            rec = dict(rank=self.grid.rank, step=self.step, microbatch=self.microbatch, op=op, axis=axis,
                       bytes=t.numel() * t.element_size(), phase=self.phase,
                       shape=list(t.shape), dtype=str(t.dtype).replace("torch.", ""))
            return self.trace.add(**{**rec, **(labels or {})})
        return None

    def _done(self, rec: dict | None) -> None:
        """A blocking call of `rec` has returned: tell the trace (a timed one stamps it)."""
        if rec is not None:
            self.trace.completed(rec, None)

    def _pending(self, result, work, rec: dict | None, source=None, dtype=None) -> Pending:
        """A call in flight whose `rec` the trace is told of when it is waited for."""
        return Pending(result, work, source, dtype, records=(rec,) if rec is not None else (), trace=self.trace)

    def wire_dtype_of(self, dtype: torch.dtype, activation: bool = True) -> torch.dtype:
        """The dtype a tensor of `dtype` travels in: `wire_dtype` when it carries activations
        (bf16 under --precision bf16, even where autocast keeps fp32), else its own. The one
        rule for collectives and pipeline sends and receives alike."""
        return self.wire_dtype if activation and self.wire_dtype is not None else dtype

    def on_wire(self, t: torch.Tensor, activation: bool = True) -> torch.Tensor:
        """`t` as it travels (see :meth:`wire_dtype_of`)."""
        return t.to(self.wire_dtype_of(t.dtype, activation))

    # --- collectives --------------------------------------------------------------
    # `activation=True`: the tensor is an activation or its gradient; it travels in
    # `wire_dtype` and the result comes back in the tensor's own dtype.
    @eager
    def all_reduce(self, t: torch.Tensor, axis: str, op: str = "sum", async_op: bool = False,
                   activation: bool = False):
        """In-place all-reduce of `t` over `axis` (op: 'sum' or 'max'; 'avg' on the replica
        axis). Returns `t`, or the work handle when `async_op` (not with a change of dtype on
        the wire)."""
        if axis == REPLICA_AXIS and self._replicas is not None:
            return self._replica_all_reduce(t, op)
        if self.size(axis) == 1:
            return None if async_op else t
        x = self.on_wire(t, activation)
        rec = self._record("all_reduce", axis, x)
        if self.dry:
            return None if async_op else t
        rop = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        work = dist.all_reduce(x, op=rop, group=self.group(axis), async_op=async_op)
        if async_op:
            assert x is t, "an asynchronous all-reduce cannot change dtype on the wire"
            return self._pending(t, work, rec)
        self._done(rec)
        return t if x is t else t.copy_(x)

    def _replica_all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        """`t` averaged (or summed) over the replicas of this step's quorum, through torchft's
        `Manager.allreduce` on its reconfigurable gloo group. A replica lost during the call
        is not an error here: torchft notes it, the tensor is then unusable, and the step is
        not committed (``Manager.should_commit``), so nothing reads it."""
        rec = self._record("all_reduce", REPLICA_AXIS, t)
        if not self.dry:
            rop = {"avg": dist.ReduceOp.AVG, "sum": dist.ReduceOp.SUM}[op]
            self._replicas.allreduce(t, reduce_op=rop).wait()
            self._done(rec)
        return t

    @eager
    def all_gather(self, t: torch.Tensor, axis: str, dim: int = 0, async_op: bool = False,
                   activation: bool = False, out: torch.Tensor | None = None):
        """Concatenate every rank's `t` along `dim`, in axis order. With `async_op`,
        returns a :class:`Pending` whose ``wait()`` gives the result. `out`: a contiguous
        buffer to gather into along dim 0 (ZeRO's flat parameter buffers), returned."""
        n = self.size(axis)
        if out is not None:
            return self._into(out, t, axis, "all_gather", dist.all_gather_single, async_op)
        if n == 1:
            return Pending(t) if async_op else t
        return self._along_dim("all_gather", dist.all_gather_single, t, axis, dim, t.shape[dim] * n, async_op,
                               activation)

    @eager
    def reduce_scatter(self, t: torch.Tensor, axis: str, dim: int = 0, async_op: bool = False,
                       activation: bool = False, out: torch.Tensor | None = None):
        """Sum `t` over the axis and keep this rank's 1/n slice along `dim`. With
        `async_op`, returns a :class:`Pending` whose ``wait()`` gives the result. `out`: a
        contiguous buffer for this rank's slice along dim 0 (ZeRO's gradient shards), returned."""
        n = self.size(axis)
        if out is not None:
            return self._into(out, t, axis, "reduce_scatter", reduce_scatter_single, async_op)
        if n == 1:
            return Pending(t) if async_op else t
        return self._along_dim("reduce_scatter", reduce_scatter_single, t, axis, dim, t.shape[dim] // n,
                               async_op, activation)

    def _along_dim(self, op: str, collective, t, axis: str, dim: int, rows: int, async_op: bool, activation: bool):
        """`collective` of `t` along `dim` into a result of `rows` along it (all-gather: n
        times t's, reduce-scatter: 1/n): moved to dim 0 for torch's single-tensor
        collectives, and back."""
        w = self.on_wire(t, activation)
        rec = self._record(op, axis, w)
        x = w.movedim(dim, 0).contiguous()
        out = torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
        work = None if self.dry else collective(out, x, group=self.group(axis), async_op=async_op)
        return self._result(out.movedim(0, dim), work, x, t.dtype, async_op, rec)

    def _into(self, out, t, axis: str, op: str, collective, async_op: bool):
        """`op` of `t` into the caller's buffer `out` (master dtype: parameters and
        gradients never change dtype on the wire)."""
        n = self.size(axis)
        whole, part = (t, out) if op == "reduce_scatter" else (out, t)
        if whole.numel() != n * part.numel():
            raise ValueError(f"{op} over '{axis}' ({n} ranks): {'out' if part is out else 'the input'} holds "
                             f"{part.numel()} elements, 1/{n} of {whole.numel()} is {whole.numel() / n:g}: size it "
                             f"by comm.size('{axis}')")
        if n == 1:
            out.copy_(t)
            return Pending(out) if async_op else out
        rec = self._record(op, axis, t)
        work = None if self.dry else collective(out, t, group=self.group(axis), async_op=async_op)
        if async_op:
            return self._pending(out, work, None if self.dry else rec, t)
        if not self.dry:
            self._done(rec)
        return out

    def _result(self, out, work, source, dtype, async_op, rec):
        """The collective's output in the caller's `dtype`: now, or a Pending for later."""
        rec = None if self.dry else rec
        if async_op:
            return self._pending(out, work, rec, source, dtype if out.dtype != dtype else None)
        self._done(rec)
        return out.to(dtype)

    @eager
    def broadcast(self, t: torch.Tensor, axis: str, src_index: int = 0, async_op: bool = False):
        """Broadcast `t` from the rank at position `src_index` of the axis. Returns `t`, or
        with `async_op` a :class:`Pending` whose ``wait()`` gives it (SUMMA's prefetch under
        --tp-overlap); traced when posted, the same record either way."""
        return self._rooted("broadcast", dist.broadcast, t, axis, src_index, async_op)

    @eager
    def reduce(self, t: torch.Tensor, axis: str, dst_index: int = 0, async_op: bool = False):
        """Sum `t` over the axis into the rank at position `dst_index` (SUMMA's partial
        products): there `t` holds the sum afterwards; elsewhere its content is undefined.
        Returns `t`, or with `async_op` a :class:`Pending` whose ``wait()`` gives it."""
        return self._rooted("reduce", lambda x, root, group, async_op: dist.reduce(
            x, dst=root, op=dist.ReduceOp.SUM, group=group, async_op=async_op), t, axis, dst_index, async_op)

    def _rooted(self, op: str, collective, t: torch.Tensor, axis: str, index: int, async_op: bool):
        """A collective with a root (broadcast from it, reduce into it) on `t` in place."""
        if self.size(axis) == 1:
            return Pending(t) if async_op else t
        rec = self._record(op, axis, t)
        if self.dry:
            return Pending(t) if async_op else t
        work = collective(t, self.grid.axis_ranks(axis)[index], group=self.group(axis), async_op=async_op)
        if async_op:
            return self._pending(t, work, rec)
        self._done(rec)
        return t

    @eager
    def all_to_all(self, t: torch.Tensor, axis: str, send_splits=None, recv_splits=None,
                   activation: bool = False, async_op: bool = False):
        """All-to-all along dim 0 over `axis`: the i-th block of `t`'s rows goes to the
        axis' i-th rank, and the result holds the blocks received, in axis order. Blocks
        are equal without splits; `send_splits` / `recv_splits` give each block's rows (the
        experts' token dispatch, whose sizes vary, exchanged beforehand). The trace records
        `t`, the rows sent (the block kept by this rank included), when the call is posted.
        With `async_op`, returns a :class:`Pending` whose ``wait()`` gives the result
        (``--ep-overlap``'s halves, ``parallel/expert_overlap.py``)."""
        n = self.size(axis)
        if n == 1:
            return Pending(t) if async_op else t
        w = self.on_wire(t, activation).contiguous()
        rec = self._record("all_to_all", axis, w)
        rows = sum(recv_splits) if recv_splits is not None else w.shape[0]
        out = torch.empty((rows, *w.shape[1:]), dtype=w.dtype, device=w.device)
        work = None
        if not self.dry:
            work = dist.all_to_all_single(out, w, None if recv_splits is None else list(recv_splits),
                                          None if send_splits is None else list(send_splits), group=self.group(axis),
                                          async_op=async_op)
        return self._result(out, work, w, t.dtype, async_op, rec)

    def gather_object(self, obj, dst: int = 0):
        """Pickle-gather `obj` from every rank to global rank `dst` (checkpoint assembly,
        verification; not part of training traffic). Returns the list on `dst`."""
        if self.grid.world == 1 or self.dry:
            return [obj]
        out = [None] * self.grid.world if self.grid.rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def write_spans(self, path: str) -> None:
        """Append every rank's timed calls (the :class:`TimedTrace` installed) to `path` as
        JSON lines ``{"kind": "comm", "global_rank", "axis", "op", "step", "phase",
        "microbatch", "bytes", "start", "waited", "end"}``, in ``time.time()`` seconds like
        the pipeline's actions (``--timeline``): issued, begun to be waited for, done.
        Collective: every rank calls it; global rank 0 writes. Receives are left out (a
        ring shift is its send's span), and the pipeline's sends and receives (unstamped)."""
        offset = time.time() - time.perf_counter()
        mine = [{"kind": "comm", "global_rank": self.grid.rank, "axis": r["axis"], "op": r["op"], "step": r["step"],
                 "phase": r["phase"], "microbatch": r["microbatch"], "bytes": r["bytes"], "start": r["t"] + offset,
                 "waited": r["waited"] + offset, "end": r["done"] + offset}
                for r in (self.trace.records if self.trace is not None else []) if "done" in r and r["op"] != "recv"]
        everyone = self.gather_object(mine, dst=0)
        if self.grid.rank == 0:
            with open(path, "a") as f:
                for recs in everyone:
                    f.writelines(json.dumps(r) + "\n" for r in recs)

    def barrier(self) -> None:
        if self.grid.world > 1 and not self.dry:
            dist.barrier()

    # --- point to point -------------------------------------------------------------
    @eager
    def p2p_handle_per_op(self, axis: str = "pp") -> bool:
        """Whether :meth:`p2p` returns one work handle per op (gloo) rather than one for
        the whole batch (NCCL, whose batch is a single grouped launch)."""
        return dist.get_backend(self.group(axis)) == "gloo"

    def p2p(self, ops: list[tuple[str, torch.Tensor, int]], axis: str = "pp"):
        """Post a batch of ('send'|'recv', tensor, peer_index_on_axis[, labels]) as one
        ``batch_isend_irecv``; returns the list of work handles to wait on. The optional
        `labels` dict overrides trace fields of that op (a batch of the pipeline mixes
        'fwd' activations and 'bwd' gradients of different microbatches)."""
        if not ops:
            return []
        ranks = self.grid.axis_ranks(axis)
        p2p_ops = []
        for kind, t, peer, *labels in ops:
            self._record(kind, axis, t, *labels)
            if self.dry:
                continue
            fn = dist.isend if kind == "send" else dist.irecv
            p2p_ops.append(dist.P2POp(fn, t, ranks[peer], group=self.group(axis)))
        return dist.batch_isend_irecv(p2p_ops) if p2p_ops else []

    @eager
    def shift(self, t: torch.Tensor, axis: str, step: int = 1, tag: int = 0, activation: bool = True,
              labels: dict | None = None) -> Pending:
        """One step of a ring on `axis`: send `t` to the rank `step` places on and receive
        the tensor of the rank `step` places back, both posted now (``isend``/``irecv``);
        returns a :class:`Pending` whose ``wait()`` gives the received tensor, in `t`'s
        dtype. Traced as one 'send' and one 'recv' of `t` as it travels (the decomposed
        collective matmuls of ``parallel/collective_matmul.py`` count their chunks so).
        `tag` keeps two rings between the same pair of ranks apart (gloo matches by it)."""
        n, i = self.size(axis), self.index(axis)
        w = self.on_wire(t, activation).contiguous()
        buf = torch.empty_like(w)
        recs = [self._record(kind, axis, x, labels) for kind, x in (("send", w), ("recv", buf))]
        dtype = t.dtype if buf.dtype != t.dtype else None
        if self.dry:
            return Pending(buf, None, w, dtype)
        ranks, group = self.grid.axis_ranks(axis), self.group(axis)
        ops = [dist.P2POp(dist.isend, w, ranks[(i + step) % n], group=group, tag=tag),
               dist.P2POp(dist.irecv, buf, ranks[(i - step) % n], group=group, tag=tag)]
        return Pending(buf, _Works(dist.batch_isend_irecv(ops)), w, dtype,
                       records=tuple(r for r in recs if r is not None), trace=self.trace)
