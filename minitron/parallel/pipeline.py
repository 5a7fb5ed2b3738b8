"""The pipeline runtime: execute a schedule (``parallel/schedules.py``) on this rank.

The schedule is data: ``Schedule.steps(rank)`` is this rank's ordered list of compute
actions (F, B, W of microbatch k on local chunk c) and communication batches. The
runtime walks that list and does what each step says; no schedule logic lives here,
so GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V and DualPipe-V are all the same loop::

    for step in schedule.steps(rank):
        batch of sends/receives -> one batch_isend_irecv; wait for its receives
        F(k, c) -> forward of chunk c on microbatch k (token ids on the first stage,
                   else the activation received for it), keep the output for B,
                   queue the output for the send that follows
        B(k, c) -> backward from the received gradient (last stage: from loss/m),
                   queue the input's gradient for the send that follows
        W(k, c) -> (split-backward kinds) the weight gradients that B left out

Stages and chunks. Chunk c of pipeline rank r is the virtual stage the schedule's
``Placement`` gives it (``Trainer._build_chunks`` builds it from the same object):
``c*p + r`` in Megatron's interleaved loop, r and 2p-1-r in the V of ZB-V and
DualPipe-V; its layers come from ``placement.stage_layers`` (even, or ``--stage-layers``
for an uneven split). The first stage embeds, the last one applies the final norm, the
head and the loss: under the V both are chunks of rank 0, which therefore holds the
loss. Where two consecutive stages share a rank (the V's turn on rank p-1) the output
of one becomes the input of the other in memory, a fresh leaf as if received, and the
input's gradient goes back the same way: no message.

DualPipe-V's overlapped F&B units (a forward of one chunk and the full backward of the
other) run here one action after the other: on the CPU the overlap is only a pairing in
the schedule (its communication is batched around the pair), not concurrent compute.

What crosses a stage boundary. The hidden states [b, s, h] (``GPT.boundary_shape``:
[b, s/t, h] under sequence parallelism, the cube's local block under 3-D), in the
run's dtype, and the gradient of the same shape back. With ``--precision bf16`` autocast
computes in bf16 while the residual stream stays in the fp32 of the master weights; the
wire carries bf16 (``Comm.wire_dtype``, as Megatron sends its bf16 activations): a send
casts, a receive casts back. Shapes are known in advance, so a receive allocates
its buffer without a handshake. Once handed to the wire an output's storage belongs to
the send alone: ``out.data`` is replaced by an empty tensor (Megatron's
``deallocate_output_tensor``) and the memory goes when the send completes. B only needs
the output's ``grad_fn``, so it starts from its
:class:`~torch.autograd.graph.GradientEdge` rather than from the tensor.

Blocking. A received tensor is waited for right before the compute that consumes it
(a batch may also carry a gradient that only the B after the next F needs). Where the
backend gives a handle per op (gloo), the runtime moves communication
earlier, never later and never out of order: each send is posted as soon as its tensor
exists (a stage output right after its F, not after the B the schedule batches it with)
and stays in flight until the end of the step, so a rank never idles until its
neighbour posts the matching receive: the *eager* semantics under which
``schedule_check.validate`` proves every schedule deadlock-free; and each batch's receives
are posted with the batch before it, so the transfer overlaps this rank's compute
(gloo moves the data only once both sides have posted). torch.distributed.pipelining
does both. With NCCL's one handle per batch the runtime posts each batch where the
schedule says and waits for all of it (the blocking semantics, proved as well).

Scatter/gather (``--scatter-gather``, PTD-P §4.1). With 1-D tensor parallelism (not
``--sp``) the boundary tensor is replicated on the t ranks of a tensor group, and each
of them would send the same b·s·h elements to its peer on the next stage. Instead each
sends only its 1/t of the flattened tensor; the receivers all-gather the pieces over
their tensor group (a fast intra-node link in the paper's clusters). Gradients mirror
this: the input gradient is replicated too (the f operator all-reduces it), so each
rank sends its 1/t and the upstream group all-gathers.

Loss and data parallelism. The last stage returns ``loss/m`` per microbatch and
``run`` returns their sum (the mean over the step's microbatches) there, None
elsewhere. The backward that completes a chunk's last microbatch (its last B, or its
last W in the split-backward kinds) runs inside ``dp.microbatch(last=True)``: only then do the data-parallel
hooks count gradients and start their bucketed all-reduces, overlapping the rest of
the schedule; ``Trainer.step`` calls ``dp.finish()`` after ``run``.

ZB-H1: splitting a backward into B (input gradient) and W (weight gradients).
B must produce the stage input's gradient as soon as possible and leave the weight
gradients for later, without doing the work twice. In the autograd graph of a stage,
the nodes on a path from the output to the stage input are the *input path*; every
parameter hangs off it through nodes of its own (a transpose, an all-gather, or the
parameter's gradient accumulator directly). Call an input-path node with such a
parameter branch a *frontier* node (a linear's ``AddmmBackward``, a LayerNorm's backward).

* B registers a pre-hook on each frontier node that keeps the gradient flowing into
  it, then runs ``torch.autograd.grad(output, stage_input, grad, retain_graph=True)``.
  Autograd computes only what the stage input needs: every frontier node is run with
  its parameter outputs masked off, so no weight gradient is computed, and the graph
  (the saved activations) is kept.
* W restarts autograd at the frontier nodes, from the gradients B kept:
  ``torch.autograd.backward([GradientEdge(node, i)], kept_grads, inputs=params)``.
  Only the parameter branches run, and the gradients are *accumulated into .grad*
  by the parameters' own accumulators, so data-parallel hooks fire exactly as in an
  ordinary backward. Frontier nodes that share a parameter (a weight used twice) are
  run in one call, with pre-hooks that pin each node's incoming gradient to the kept
  one so that nothing is counted twice.

This is the approach of ``torch.distributed.pipelining`` (``stage_backward_input`` /
``stage_backward_weight``), written small. The first stage has no input gradient to
send, so its B is the whole backward and its W does nothing.

``--timeline FILE``: every compute action's start and end (``time.time()``, comparable
across the processes of a node; on a GPU after a synchronize) is recorded on each rank;
``write_timeline`` gathers the records to global rank 0, which appends those of the
first pipeline (tensor and data-parallel rank 0; ``rank`` is the pipeline rank) as
JSON lines
``{"rank", "op", "mb", "chunk", "start", "end", "step", "global_rank"}``:
what :func:`minitron.viz.pipeline.plot_timeline` draws, like a ``Simulation``'s records.
"""
from __future__ import annotations

import json
import time
from collections import deque
from contextlib import contextmanager, nullcontext

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from .schedule_actions import SPLIT_BACKWARD, Action, Schedule
from .schedule_check import validate
from .schedules import make_schedule


# --- splitting a backward into B (input gradient) and W (weight gradients) -----------------
def _input_path(root, target) -> dict:
    """{node: True if `target` is reachable from it} for every node under `root`
    (an iterative depth-first search; graphs are a few hundred nodes per stage)."""
    reaches, stack = {}, [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if children_done:
            reaches[node] = node is target or any(reaches[c] for c, _ in node.next_functions if c is not None)
        elif node not in reaches:
            reaches[node] = False  # placeholder: in progress (the graph is acyclic)
            stack.append((node, True))
            stack.extend((c, False) for c, _ in node.next_functions if c is not None and c not in reaches)
    return reaches


def _params_under(node) -> set:
    """The leaf tensors (parameters) whose gradient accumulators lie under `node`."""
    out, seen, stack = set(), set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if getattr(n, "variable", None) is not None:  # an AccumulateGrad node
            out.add(n.variable)
        stack.extend(c for c, _ in n.next_functions if c is not None)
    return out


def _frontier_groups(root, stage_input: torch.Tensor) -> list[tuple[list, list]]:
    """Frontier nodes of the graph under `root` (input-path nodes with a parameter
    branch), grouped so that no parameter lies under two groups: [(nodes, params)]."""
    target = get_gradient_edge(stage_input).node
    reaches = _input_path(root, target)
    groups: list[tuple[list, set]] = []
    for node, on_path in reaches.items():
        if not on_path or node is target:
            continue
        params = set()
        for c, _ in node.next_functions:
            if c is not None and not reaches[c]:
                params |= _params_under(c)
        if not params:
            continue
        nodes = [node]
        for g in [g for g in groups if g[1] & params]:  # merge groups sharing a parameter
            groups.remove(g)
            nodes += g[0]
            params |= g[1]
        groups.append((nodes, params))
    return [(nodes, list(params)) for nodes, params in groups]


def backward_input(root, grad, stage_input: torch.Tensor):
    """B of zb-h1: the stage input's gradient only. Returns it and the deferred W (a
    callable that accumulates the weight gradients into .grad)."""
    groups = _frontier_groups(root.node, stage_input)
    kept: dict = {}

    def keep(node):
        def hook(grad_outputs):
            kept[node] = grad_outputs
        return hook

    handles = [n.register_prehook(keep(n)) for nodes, _ in groups for n in nodes]
    try:
        (dx,) = torch.autograd.grad(root, stage_input, grad, retain_graph=True)
    finally:
        for h in handles:
            h.remove()

    def weight_grads():
        for nodes, params in groups:
            roots, grads, pins = [], [], []
            for n in nodes:
                gs = kept.pop(n, None) or ()
                roots += [GradientEdge(n, i) for i, g in enumerate(gs) if g is not None]
                grads += [g for g in gs if g is not None]
                if len(nodes) > 1:  # the node's gradient is the kept one, not kept + what flows in
                    pins.append(n.register_prehook(lambda _, gs=gs: gs))
            try:
                if roots:
                    torch.autograd.backward(roots, grads, retain_graph=True, inputs=params)
            finally:
                for h in pins:
                    h.remove()

    return dx, weight_grads


# --- one microbatch's forward: the pipeline's F and the Trainer's pp = 1 loop alike ---------------
def microbatch_parts(mb: tuple) -> tuple:
    """(x, y, documents) of a microbatch: (x, y), or (x, y, documents) with --pack, whose
    ``packing.Documents`` every stage reads (positions and the document mask travel with it)."""
    x, y, *docs = mb
    return x, y, docs[0] if docs else None


def forward_microbatch(chunk, context, x, targets, step: int, k: int, m: int, phase: str = "fwd", docs=None):
    """Forward of microbatch `k` of this rank's `m` of training step `step` through model
    chunk `chunk`: trace records in `phase` (the caller labels them with the microbatch),
    the dropout key (`step`, index of the microbatch in the global batch: data-parallel
    rank · m + k, layout-independent), and autocast under --precision bf16. The last chunk
    returns its loss scaled by 1/m (the m backward passes then sum to the gradient of this
    rank's share of the batch); any other chunk returns its hidden states. `docs`: the
    microbatch's documents (``packing.Documents``, --pack), read by every chunk."""
    comm = context.comm
    key = (step, comm.grid.data_index() * m + k)  # ep × dp replicas read different rows
    with comm.in_phase(phase), context.autocast():
        out = chunk(x, targets if chunk.last else None, key, docs=docs)
    return out / m if chunk.last else out


# --- the runtime ---------------------------------------------------------------------------
class PipelineRuntime:
    """Executes this rank's part of the schedule `layout.schedule` for its chunks, or of
    `schedule` when one is given (a Schedule built elsewhere, e.g. a lab's; validated here,
    and its p, v, m must be the layout's pp, vpp and `microbatches`).

    `observer`, when given (or for a while, :meth:`observing`), is called after every
    compute action as ``observer(action, stage_input)`` (`stage_input`: the tensor an F
    consumed, None on the first stage and after B and W): what a measurement needs to see,
    without reaching in (``tools/measure.py`` counts the stash with it)."""

    def __init__(self, chunks, ctx, layout, microbatches: int, record: bool = True,
                 schedule: Schedule | None = None, observer=None):
        self.chunks, self.ctx, self.comm, self.observer = list(chunks), ctx, ctx.comm, observer
        if schedule is None:
            schedule = make_schedule(layout.schedule, layout.pp, layout.vpp, microbatches)
        elif (schedule.p, schedule.v, schedule.m) != (layout.pp, layout.vpp, microbatches):
            raise ValueError(f"the schedule is for p={schedule.p}, v={schedule.v}, m={schedule.m}; this run "
                             f"has pp={layout.pp}, vpp={layout.vpp}, microbatches={microbatches}")
        self.schedule: Schedule = validate(schedule)
        self.rank = self.comm.index("pp")
        self.steps = self.schedule.steps(self.rank)
        self.split_backward = self.schedule.kind in SPLIT_BACKWARD  # B = input gradient, W = weight gradients
        # where the next (previous) stage of a chunk lives on this rank too (the V's turn on rank
        # p-1), its output (input gradient) is handed over in memory instead of sent
        pl = self.schedule.placement

        def mine(stage):  # this rank's chunk holding `stage`, or None
            if 0 <= stage < pl.num_stages and pl.locate(stage)[0] == self.rank:
                return pl.locate(stage)[1]
            return None

        self.local_next = {c: mine(pl.stage(self.rank, c) + 1) for c in range(len(self.chunks))}
        self.local_prev = {c: mine(pl.stage(self.rank, c) - 1) for c in range(len(self.chunks))}
        for c, chunk in enumerate(self.chunks):
            if (chunk.first, chunk.last) != (self.schedule.is_first(self.rank, c), self.schedule.is_last(self.rank, c)):
                raise ValueError(f"chunk {c} of pipeline rank {self.rank} is not virtual stage "
                                 f"{self.schedule.stage(self.rank, c)} of the schedule")
        self.t = self.comm.size("tp")
        self.scatter_gather = (layout.scatter_gather and self.t > 1 and layout.tp_mode == "1d"
                               and not layout.sp)
        # the step that completes each chunk's last microbatch: the data-parallel sync goes there
        done = {c: "W" if self.split_backward and not ch.first else "B" for c, ch in enumerate(self.chunks)}
        self.final_steps = {max(i for i, s in enumerate(self.steps)
                                if isinstance(s, Action) and s.op == done[c] and s.chunk == c)
                            for c in done}
        self.forward_steps = Schedule(self.schedule.kind, self.schedule.p, self.schedule.v, self.schedule.m,
                                      forward_only_actions(self.schedule)).steps(self.rank)
        self.record, self.records = record, []
        # where the backend gives a handle per op, sends go as soon as their tensor exists and
        # each batch's receives are posted with the batch before it (see _exchange)
        self.per_op = self.comm.p2p_handle_per_op("pp")
        batches = [i for i, s in enumerate(self.steps) if isinstance(s, tuple)]
        self.next_batch = {i: self.steps[j] for i, j in zip(batches, batches[1:])} if self.per_op else {}
        self.sends_in_order = [a for i in batches for a in self.steps[i] if a.op.startswith("send")]

    @contextmanager
    def observing(self, observer):
        """Call `observer(action, stage_input)` after every compute action within the block."""
        old, self.observer = self.observer, observer
        try:
            yield self
        finally:
            self.observer = old

    # --- one training step -------------------------------------------------------------------
    def run(self, mbs, dp, step: int = 0):
        """Forward and backward of the microbatches `mbs` ([(x, y)] of this data-parallel rank)
        of training step `step` (the dropout keys') as the schedule says; gradients
        accumulate in .grad. Returns the sum of loss/m over the microbatches on the last
        stage (a float64 tensor), None elsewhere."""
        self._begin(mbs, dp, step)
        for i, mb in self._labelled(self.steps):
            with self.comm.labelled(microbatch=mb):
                self._run_step(i, self.steps[i])
        return self._end()

    def _run_step(self, i: int, step) -> None:
        """Step `i` of the rank's schedule: a batch of sends and receives, or F, B, W."""
        if isinstance(step, tuple):
            self._exchange(step, self.next_batch.get(i, ()))
        elif step.op == "F":  # no gradient flows in a forward: no data-parallel wrapper
            self._wait_for_input(step)
            with self._timed(step):
                inp = self._F(step)
            self._post_ready_sends()
            if self.observer is not None:
                self.observer(step, inp)
        else:
            self._wait_for_input(step)
            with self._timed(step), self.dp.microbatch(last=i in self.final_steps):
                (self._B if step.op == "B" else self._W)(step)
            self._post_ready_sends()
            if self.observer is not None:
                self.observer(step, None)

    @torch.no_grad()
    def forward_only(self, x, y, step: int = 0, docs=None):
        """Evaluation: the loss of the batch (x, y) on the last stage (None elsewhere), split
        into the schedule's m microbatches and run through the training schedule with every
        backward action removed (`step`: the dropout keys', which evaluation does not use;
        `docs`: the batch's documents with --pack)."""
        m = self.schedule.m
        mbs = list(zip(x.chunk(m), y.chunk(m))) if docs is None else list(zip(x.chunk(m), y.chunk(m), docs.chunk(m)))
        self._begin(mbs, None, step, phase="log")
        for i, mb in self._labelled(self.forward_steps):
            with self.comm.labelled(microbatch=mb):
                if isinstance(self.forward_steps[i], tuple):
                    self._exchange(self.forward_steps[i])
                else:
                    self._wait_for_input(self.forward_steps[i])
                    self._F(self.forward_steps[i])
        self._stash.clear()
        return self._end()

    @staticmethod
    def _labelled(steps):
        """(index, microbatch) of each of `steps`: the microbatch its trace records are
        labelled with, the compute action's own (a batch of sends and receives: the
        compute's before it, None before the first)."""
        mb = None
        for i, step in enumerate(steps):
            mb = mb if isinstance(step, tuple) else step.mb
            yield i, mb

    def _begin(self, mbs, dp, step: int, phase=None):
        if len(mbs) != self.schedule.m:
            raise ValueError(f"the schedule has {self.schedule.m} microbatches, got {len(mbs)}")
        self.mbs, self.dp, self.phase, self.train_step = mbs, dp, phase, step
        self.shape = self.chunks[0].boundary_shape(mbs[0][0].shape[0])
        self.numel = 1
        for n in self.shape:
            self.numel *= n
        self._inputs, self._grads, self._sends = {}, {}, {}  # keyed by (mb, chunk)
        self._stash, self._weight_grads, self._in_flight, self._posted = {}, {}, [], {}
        self._unsent = deque(self.sends_in_order if self.per_op and phase is None else ())
        self.loss = torch.zeros((), dtype=torch.float64, device=self.ctx.device) if self.chunks[-1].last else None

    def _end(self):
        for work, _ in self._in_flight:
            work.wait()
        self._in_flight = []
        leftovers = [d for d in (self._inputs, self._grads, self._sends, self._weight_grads, self._posted,
                                 self._unsent) if d]
        if leftovers:
            raise RuntimeError(f"pipeline step ended with unconsumed tensors: {leftovers}")
        loss, self.loss, self.mbs = self.loss, None, None
        return loss

    def _timed(self, a: Action):
        """Record the action's start and end (`--timeline`); nothing when not recording."""
        return self._recorded(a) if self.record else nullcontext()

    @contextmanager
    def _recorded(self, a: Action):
        sync = self.ctx.device.type == "cuda"  # time the kernels, not their launch
        if sync:
            torch.cuda.synchronize(self.ctx.device)
        t0 = time.time()
        yield
        if sync:
            torch.cuda.synchronize(self.ctx.device)
        self.records.append({"rank": self.rank, "op": a.op, "mb": a.mb, "chunk": a.chunk,
                             "start": t0, "end": time.time(), "step": self.train_step,
                             "global_rank": self.comm.grid.rank})

    def _phase(self, direction: str) -> str:
        return self.phase or direction

    # --- compute ---------------------------------------------------------------------------------
    def _F(self, a: Action):
        """Forward of microbatch a.mb on chunk a.chunk; returns the stage input it consumed
        (None on the first stage, whose input is token ids)."""
        chunk, key, m = self.chunks[a.chunk], (a.mb, a.chunk), self.schedule.m
        x, y, docs = microbatch_parts(self.mbs[a.mb])
        inp = x if chunk.first else self._inputs.pop(key)
        out = forward_microbatch(chunk, self.ctx, inp, y, self.train_step, a.mb, m, self._phase("fwd"), docs)
        if chunk.last:
            self.loss += out.detach().double()
        else:
            out = out.to(self.ctx.dtype)  # the residual stream's dtype (a no-op unless autocast left bf16)
            nxt = self.local_next[a.chunk]
            if nxt is None:
                self._sends[("fwd", *key)] = out.detach()
            else:  # the next stage is ours: its input is a fresh leaf, as if received
                self._inputs[(a.mb, nxt)] = out.detach().requires_grad_(torch.is_grad_enabled())
        if torch.is_grad_enabled():
            self._stash[key] = (None if chunk.first else inp, out)
        return None if chunk.first else inp

    def _B(self, a: Action) -> None:
        chunk, key = self.chunks[a.chunk], (a.mb, a.chunk)
        inp, out = self._stash.pop(key)
        # the last stage starts from its loss; others from the output's graph edge (data freed)
        root, grad = (out, None) if chunk.last else (get_gradient_edge(out), self._grads.pop(key))
        with self.comm.in_phase("bwd"):
            if chunk.first:
                torch.autograd.backward(root, grad)
                return
            if self.split_backward:
                dx, self._weight_grads[key] = backward_input(
                    get_gradient_edge(out), torch.ones_like(out) if grad is None else grad, inp)
            else:
                torch.autograd.backward(root, grad)
                dx = inp.grad
        prev = self.local_prev[a.chunk]
        if prev is None:
            self._sends[("bwd", *key)] = dx
        else:  # the previous stage is ours: its B starts from this gradient
            self._grads[(a.mb, prev)] = dx

    def _W(self, a: Action) -> None:
        work = self._weight_grads.pop((a.mb, a.chunk), None)  # None on the first stage (B did it all)
        if work is not None:
            with self.comm.in_phase("bwd"):
                work()

    # --- communication ---------------------------------------------------------------------------
    def _exchange(self, batch: tuple, next_batch: tuple = ()) -> None:
        """One batch of sends and receives, posted together (batch_isend_irecv); with
        scatter/gather, 1/t of each tensor travels and the receiver all-gathers.

        Each received tensor is waited for by the compute that consumes it
        (:meth:`_wait_for_input`). Where the backend gives a handle per op (gloo), this
        batch's sends went already, as soon as their tensors existed
        (:meth:`_post_ready_sends`), and stay in flight until the end of the step (the
        *eager* send semantics under which ``validate`` proves every schedule
        deadlock-free); its receives were posted with the batch before, and the receives
        of `next_batch` are posted now, a compute action before they are needed, so the
        transfer overlaps this rank's compute (gloo moves the data only once both sides
        have posted; torch.distributed.pipelining posts a receive when its sender
        computes). Posting a receive never blocks and keeps each peer's FIFO order, and a
        wait moved later never adds a dependency, so the proof still holds. One handle
        per batch (NCCL): post the batch as the schedule says, wait for all of it."""
        self._in_flight = [(w, t) for w, t in self._in_flight if not w.is_completed()]
        sends = [a for a in batch if a.op.startswith("send") and _tensor_key(a) in self._sends]
        receives = [a for a in batch if a.op.startswith("recv")]
        posting = [a for a in receives if a not in self._posted] + [
            a for a in next_batch if a.op.startswith("recv")]
        ops = [self._send_op(a) for a in sends] + [self._receive_op(a) for a in posting]
        works = self.comm.p2p(ops)
        if self.per_op:
            for (kind, t, *_), work in zip(ops, works):
                if kind == "send":
                    self._in_flight.append((work, t))  # t keeps the data alive until sent
            for a, (_, buf, *_), work in zip(posting, ops[len(sends):], works[len(sends):]):
                self._posted[a] = (buf, work)
        else:
            for work in works:
                work.wait()
            for a, (_, buf, *_) in zip(posting, ops[len(sends):]):
                self._posted[a] = (buf, None)
        del ops
        self._release_outputs(sends)
        for a in receives:  # waited for by the compute that consumes it (_wait_for_input)
            (self._inputs if a.op == "recv_fwd" else self._grads)[(a.mb, a.chunk)] = (a, *self._posted.pop(a))

    def _wait_for_input(self, action: Action) -> None:
        """Wait for the received tensor that `action` consumes (an F's stage input, a B's
        output gradient), if any, only now, right before it: a batch may hold a gradient
        that only the B after the next F needs, and that F need not wait for it
        (torch.distributed.pipelining also waits at the consumer). Gathered over tp with
        scatter/gather, in the run's dtype."""
        received = self._inputs if action.op == "F" else self._grads
        key = (action.mb, action.chunk)
        if action.op == "W" or not isinstance(received.get(key), tuple):
            return  # nothing received for it (first or last stage, W)
        a, buf, work = received[key]
        if work is not None:
            work.wait()
        direction = a.op[-3:]
        if self.scatter_gather:
            with self.comm.in_phase(self._phase(direction)):
                buf = self.comm.all_gather(buf, "tp", dim=0)
        buf = buf.view(self.shape).to(self.ctx.dtype).detach()
        received[key] = buf.requires_grad_(torch.is_grad_enabled()) if direction == "fwd" else buf

    def _post_ready_sends(self) -> None:
        """(A handle per op) post, in the schedule's order, every send whose tensor exists:
        a stage output leaves right after its F, not after the B the schedule batches it
        with. Only earlier, never reordered, so each peer's FIFO matching is unchanged."""
        ready = []
        while self._unsent and _tensor_key(self._unsent[0]) in self._sends:
            ready.append(self._unsent.popleft())
        if ready:
            ops = [self._send_op(a) for a in ready]
            for (_, t, *_), work in zip(ops, self.comm.p2p(ops)):
                self._in_flight.append((work, t))  # t keeps the data alive until sent
            self._release_outputs(ready)

    def _release_outputs(self, sends) -> None:
        """The output's data is the wire's now: keep only its graph (for B)."""
        for a in sends:
            key = (a.mb, a.chunk)
            if a.op == "send_fwd" and key in self._stash:
                out = self._stash[key][1]
                if out._base is None:
                    out.data = torch.empty(0, dtype=out.dtype, device=out.device)

    def _labels(self, a: Action) -> dict:
        return {"phase": self._phase(a.op[-3:]), "microbatch": a.mb}

    def _send_op(self, a: Action) -> tuple:
        """The p2p op sending the tensor of `a` (its 1/t with scatter/gather)."""
        t = self._sends.pop(_tensor_key(a))
        if self.scatter_gather:
            t = t.reshape(-1)[self._my_slice()]
        return ("send", self.comm.on_wire(t).contiguous(), a.peer, self._labels(a))

    def _receive_op(self, a: Action) -> tuple:
        """The p2p op receiving into a fresh buffer for `a` (shapes are known in advance)."""
        n = self.numel // self.t if self.scatter_gather else self.numel
        buf = torch.empty(n, dtype=self.comm.wire_dtype_of(self.ctx.dtype), device=self.ctx.device)
        return ("recv", buf, a.peer, self._labels(a))

    def _my_slice(self) -> slice:
        k = self.numel // self.t
        r = self.comm.index("tp")
        return slice(r * k, (r + 1) * k)

    # --- the measured timeline ---------------------------------------------------------------------
    def write_timeline(self, path: str) -> None:
        """Append the recorded actions of the first pipeline to `path` as JSON lines
        (collective: every rank calls it; global rank 0 writes)."""
        everyone = self.comm.gather_object(self.records, dst=0)
        if self.comm.grid.rank != 0:
            return
        grid = self.comm.grid
        first_pipeline = set(grid.axis_ranks("pp", 0))
        with open(path, "a") as f:
            for recs in everyone:
                for r in recs:
                    if r["global_rank"] in first_pipeline:
                        f.write(json.dumps(r) + "\n")


def _tensor_key(send: Action) -> tuple:
    """Where the tensor of a send waits in ``_sends``: (direction, microbatch, chunk)."""
    return send.op[-3:], send.mb, send.chunk


def forward_only_actions(schedule: Schedule) -> tuple:
    """The schedule's actions without the backward ones (B, W and the gradient sends and
    receives): the forward order of the same schedule, used for evaluation. Removing the
    backward half keeps every rank's forward order and the FIFO matching of its messages,
    and it cannot deadlock (tests/test_pipeline.py simulates it for many (p, v, m))."""
    keep = ("F", "recv_fwd", "send_fwd")
    return tuple(tuple(a for a in row if a.op in keep) for row in schedule.actions)
