"""The training loop, for every layout.

`Trainer` builds this rank's part of the model from (model, layout, train) configs and
a `Comm`, and `Trainer.step(i)` runs one optimizer step on the global batch of step i:
microbatches, gradient accumulation, data-parallel sync, exact global clipping, AdamW.
It is what `minitron train` and `minitron verify` run, and what notebooks can drive
directly (a single-device Trainer needs no process group at all).
"""
from __future__ import annotations

import json
import math
import time
from contextlib import nullcontext
from dataclasses import asdict

import torch

from . import data as data_mod
from .comm import Comm, TimedTrace, wire_dtype_for
from .config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from .context import TORCH_DTYPES, Context
from .launch import resolve_device
from .model import GPT, layers_for
from .model_flops import model_flops_per_step
from .moe import moe_layers
from .mtp import targets_on_rank
from .optim import AdamW, Optimizer, lr_at, unique_params
from .packing import PackedCorpus
from .parallel.context_parallel import local_tokens
from .parallel import fp8
from .parallel.data import make_data_parallel, sharded_optimizer
from .parallel.pipeline import PipelineRuntime, forward_microbatch, microbatch_parts
from .parallel.zero import sharded_data_parallel
from .placement import placement_of, stage_layers
from .preemption import StopOnSignal, process_group_store

class NonFiniteLoss(ConfigError):
    """The loss became NaN or infinite: the run stops there, naming the step."""


def gather_points(chunk: GPT) -> list[tuple]:
    """Where a forward waits for ZeRO-1's parameter all-gather: each block before it runs,
    the head (final LayerNorm and output layer, which ``head`` reads without calling) before
    ``ln_f``, and everything else (embeddings) when the chunk's forward starts."""
    points = [(b, list(b.parameters())) for b in chunk.blocks.values()]
    if chunk.last:
        early = set(chunk.wte.parameters()) if chunk.first else set()  # tied: used first
        points.append((chunk.ln_f, [p for p in (*chunk.ln_f.parameters(), *chunk.lm_head.parameters())
                                    if p not in early]))
    later = {p for _, ps in points for p in ps}
    return [(chunk, [p for p in chunk.parameters() if p not in later])] + points


def zero_units(chunk: GPT) -> list[tuple]:
    """ZeRO-2/3's units of a model chunk, in forward order: the root (embeddings, final
    norm, output layer: everything outside the blocks) and then each block."""
    inside = {p for b in chunk.blocks.values() for p in b.parameters()}
    root = [p for p in chunk.parameters() if p not in inside]
    # (a MoE's selection bias has no gradient: it stays whole, outside the units)
    return [(chunk, root, "root")] + [(b, [p for p in b.parameters() if p.requires_grad], "block")
                                      for b in chunk.blocks.values()]


def params_of(chunks) -> list:
    """The unique parameters of model chunks (a tied weight once)."""
    return unique_params(p for c in chunks for p in c.parameters())


def default_data_parallel(params, comm: Comm, layout: ParallelConfig, chunks):
    """The layout's gradient synchroniser, the default ``Trainer(data_parallel=...)`` factory
    ``(params, comm, layout, chunks) -> dp`` (`chunks`: this rank's model chunks, which the
    Trainer hands every factory): ZeRO-2/3's unit-by-unit reduce-scatter (``--zero 2|3``:
    units from the chunks' blocks), else naive, bucketed or ZeRO-1's bucketed reduce-scatter
    (``--dp-impl``, ``--zero1``), given each chunk's parameters (one a chunk shares with
    another, the V's embedding, once per chunk: its gradient is whole after both backwards)."""
    if layout.zero >= 2:  # ZeRO-2/3: gradients (and parameters) sharded unit by unit
        return sharded_data_parallel([u for c in chunks for u in zero_units(c)], comm, layout.zero)
    return make_data_parallel([p for c in chunks for p in c.parameters()], comm, layout)


def default_optimizer(chunks):
    """The layout's optimizer for model `chunks`, as a ``Trainer(optimizer=...)`` factory
    ``(params, dp, layout, train) -> optim.Optimizer``: replicated AdamW, or ZeRO's sharded
    AdamW; with ZeRO-1 its parameter all-gather overlaps the next forward (``ParamGather``:
    a forward pre-hook per block waits for its buckets)."""
    def build(params, dp, layout: ParallelConfig, train: TrainConfig) -> Optimizer:
        if not layout.zero1:
            return AdamW(params, train, dp.comm)
        if layout.zero >= 2:  # ZeRO-2/3's data-parallel object gathers its own units
            return sharded_optimizer(dp, train)
        return sharded_optimizer(dp, train, [pt for c in chunks for pt in gather_points(c)])
    return build


class Trainer:
    """This rank's part of the model, its gradient sync and optimizer, and one step.

    The pieces a lab or a measurement replaces are passed in, never patched:

    * `layers`: the layer namespace the model is built from (default ``layers_for(layout)``;
      e.g. ``parallel.tensor.layers(f=MyF)``, ``parallel.cube.layers(linear=MyLinear3D)``);
    * `schedule`: a pipeline ``Schedule`` (per-rank action lists) for the runtime to run
      instead of ``layout.schedule``'s;
    * `data_parallel`: ``factory(params, comm, layout, chunks)`` -> the gradient synchroniser,
      handed this rank's model chunks (ZeRO-3's units are built from them; default
      :func:`default_data_parallel`);
    * `optimizer`: ``factory(params, dp, layout, train)`` -> an ``optim.Optimizer``
      (default :func:`default_optimizer`);
    * `rows_of`: ``rows_of(step)`` -> the rows of step's global batch this rank reads (default:
      its data rank's share, ``data.dp_rows``; a fault-tolerant replica's share, or the
      rows of the replicas a step really averaged for its single-device replay);
    * `document_ids`: ``document_ids(x, separator)`` -> each token's document under --pack
      (default ``packing.document_ids``; lab 09c passes a learner's).

    Two Trainers in one process share nothing.
    """

    def __init__(self, model: ModelConfig, layout: ParallelConfig, train: TrainConfig,
                 comm: Comm | None = None, corpus=None, *, layers=None, schedule=None,
                 data_parallel=None, optimizer=None, rows_of=None, document_ids=None):
        self.mcfg, self.layout, self.tcfg = model, layout, train
        self.rows_of = rows_of
        # activations travel in bf16 under --precision bf16 (tensor-parallel collectives, p2p):
        # set where the Comm is made (launch.setup_rank), or a view of the one handed in
        self.comm = (comm or Comm()).with_wire_dtype(wire_dtype_for(layout))
        device = resolve_device(layout, self.comm.grid.world)
        self.ctx = Context(self.comm, layout, TORCH_DTYPES[train.dtype], device, seed=train.seed,
                           microbatches=train.microbatches)
        self.corpus = corpus if corpus is not None else data_mod.load_corpus(train.data)
        self.train_data, self.val_data = self.corpus.split()
        data_mod.check_corpus(self.val_data, model.seq_len, model.vocab)
        # --pack: each split read as whole documents (packing.py); None draws plain windows
        pack = {"ids_of": document_ids, "pad_to": train.pack_pad, "balance": train.pack_balance}
        self.packed = {"train": PackedCorpus(self.train_data, model.seq_len, "the training split", **pack),
                       "val": PackedCorpus(self.val_data, model.seq_len, "the held-out tenth", **pack)} \
            if train.pack else None
        self.layers = layers or layers_for(layout)
        self.chunks = self._build_chunks(schedule)
        if layout.compile:  # fuse each block's elementwise work; Comm's collectives run eager
            for c in self.chunks:
                for block in c.blocks.values():
                    block.compile()  # in place: parameter names and checkpoints unchanged
        self.params = params_of(self.chunks)
        if train.init_from:  # Hugging Face weights, sliced for this layout like a checkpoint's
            from .checkpoint import import_state
            from .hf import load_full

            import_state(self.params, None, load_full(train.init_from, model))
        self.dp = (data_parallel or default_data_parallel)(self.params, self.comm, layout, self.chunks)
        self.optimizer: Optimizer = (optimizer or default_optimizer(self.chunks))(self.params, self.dp, layout, train)
        self.pipeline = None
        if layout.pp > 1:
            self.pipeline = PipelineRuntime(self.chunks, self.ctx, layout, train.microbatches,
                                            record=bool(train.timeline), schedule=schedule)
        elif schedule is not None:
            raise ValueError("a pipeline schedule needs pipeline parallelism (pp > 1)")
        self.step_idx = 0
        self.last_moe = None  # the last step's routing (reduce_routing_and_update_bias), with MoE layers
        self.last_grad_norm = torch.zeros(())  # the last step's gradient norm, on the device

    def _build_chunks(self, schedule=None) -> list[GPT]:
        """This rank's model chunks: one unless the schedule has several per rank, each
        the stage its placement gives it (the interleaved loop of PTD-P §2.2.2, or the V of
        zb-v and dualpipe-v: stages r and 2p-1-r) as the layout schedule's placement says
        (:func:`~minitron.placement.placement_of`); a schedule handed in brings its own.
        A rank holding both ends (the V's rank 0) builds the first stage's chunk first and
        hands its embedding to the last stage's (``GPT(embedding=)``: one ``wte``)."""
        pp_rank, stages = self.comm.index("pp"), stage_layers(self.mcfg, self.layout)
        placement = schedule.placement if schedule is not None else placement_of(self.layout)
        order = sorted(range(self.layout.vpp), key=lambda c: placement.stage(pp_rank, c))  # the first stage first
        chunks: dict[int, GPT] = {}
        for c in order:
            first, last = placement.chunk_ends(pp_rank, c)
            shared = chunks[order[0]].wte if last and not first and chunks and chunks[order[0]].first else None
            chunks[c] = GPT(self.mcfg, self.ctx, stages[placement.stage(pp_rank, c)], first, last,
                            layers=self.layers, embedding=shared)
        return [chunks[c] for c in range(self.layout.vpp)]

    @property
    def model(self) -> GPT:
        """The model, when this rank holds all of it in one chunk."""
        return self.chunks[0]

    # --- data -----------------------------------------------------------------------
    def rows(self, step: int, subset: str = "train"):
        """This data-parallel rank's rows of the global batch of `step`, whole sequences:
        (x, y, documents), documents None without --pack (``packing.Documents``)."""
        train = self.tcfg
        # ep × dp replicas read different rows (ep fastest: ProcessGrid.data_index)
        if self.rows_of is not None and subset == "train":
            rows = self.rows_of(step)
        else:
            rows = data_mod.dp_rows(train.global_batch, self.layout.data_replicas, self.comm.grid.data_index())
        if self.packed is not None:
            x, y, docs = self.packed[subset].batch(train.global_batch, train.seed, step, rows)
            return x, y, docs.to(self.ctx.device)
        src = self.train_data if subset == "train" else self.val_data
        return (*data_mod.batch(src, self.mcfg.seq_len, train.global_batch, train.seed, step, rows), None)

    def local_batch(self, step: int, subset: str = "train"):
        """This data-parallel rank's rows of the global batch of `step` (with context
        parallelism, only this context rank's chunks of each sequence)."""
        return self._on_rank(*self.rows(step, subset))

    def _on_rank(self, x, y, docs=None):
        """Whole rows -> this context rank's chunks of them, on the device (the targets with
        the tokens ahead of each that multi-token prediction reads: ``mtp.targets_on_rank``;
        --pack-balance document: the chunks of every document of `docs`)."""
        if docs is not None and docs.balance == "document":
            x, y = (local_tokens(t, self.comm, docs=docs) for t in (x, y))  # (--pack refuses MTP)
        else:
            x, y = local_tokens(x, self.comm), targets_on_rank(y, self.mcfg.mtp_depths, self.comm)
        return x.to(self.ctx.device, non_blocking=True), y.to(self.ctx.device, non_blocking=True)

    def microbatches(self, step: int):
        """[(x, y)] per microbatch, [(x, y, documents)] with --pack (the documents of whole
        rows: attention and the positions take this rank's part of them)."""
        x, y, docs = self.rows(step)
        m = self.tcfg.microbatches
        x, y = self._on_rank(x, y, docs)
        if docs is None:
            return list(zip(x.chunk(m), y.chunk(m)))
        return list(zip(x.chunk(m), y.chunk(m), docs.chunk(m)))

    # --- one step -------------------------------------------------------------------
    def step(self, step: int | None = None, *, saved_tensors: tuple | None = None) -> float:
        """One optimizer step on the global batch of `step`; returns the global mean loss.
        Synchronous: the parameters are final on return (ZeRO-1's all-gather waited for).
        `saved_tensors`: a ``(pack, unpack)`` pair of saved-tensor hooks to run the step
        under (a memory meter's): every tensor saved for the backward goes through them,
        what activation recomputation saves again in the backward included."""
        loss = self.step_async(step, saved_tensors=saved_tensors)
        self.optimizer.wait_params()
        return float(loss)

    @property
    def grad_norm(self) -> float:
        """The global gradient norm of the last step (before clipping); reading it waits for
        the device (``last_grad_norm`` is the same as a device tensor)."""
        return float(self.last_grad_norm)

    def step_async(self, step: int | None = None, *, saved_tensors: tuple | None = None) -> torch.Tensor:
        """`step` without reading anything back from the device: returns the global mean
        loss as a 0-dim tensor, so that a GPU keeps working while the host queues the
        next step. The training loop reads losses back every `--log-every` steps.
        With ZeRO-1 the parameters' all-gather is still in flight on return: the next
        forward waits for it layer by layer; anything else calls ``optimizer.wait_params()``.
        `saved_tensors`: as :meth:`step` (the hook through which a memory meter observes)."""
        step = self.step_idx if step is None else step
        self.comm.begin_step(step)  # the trace's label; the step itself is passed on
        self.ctx.saved_tensors = saved_tensors
        try:
            with torch.autograd.graph.saved_tensors_hooks(*saved_tensors) if saved_tensors else nullcontext():
                loss = self._run_step(step)
        finally:
            self.ctx.saved_tensors = None
        self.step_idx = step + 1
        return loss

    def _run_step(self, step: int) -> torch.Tensor:
        """:meth:`step_async`'s work: forward and backward of step `step`'s microbatches
        (the step passed on to the dropout keys), the gradient sync, the optimizer, the
        routing; returns the global mean loss."""
        for c in self.chunks:
            c.train()
        self.dp.zero_grad()  # keeps p.grad as views into the bucket buffer
        for m in self.moe:
            m.reset_stats()
        mbs = self.microbatches(step)
        if self.pipeline is not None:
            loss_sum = self.pipeline.run(mbs, self.dp, step)
        else:
            loss_sum = self._forward_backward(mbs, step)
        with self.comm.in_phase("optim"):
            fp8.end_step(self.chunks, self.comm)  # --fp8-recipe delayed: the step's amaxes into the history
            self.dp.finish()  # gradients averaged over dp, summed over grad_sync axes
            # exact global clipping and AdamW (ZeRO: on this rank's shard, then the all-gather)
            self.last_grad_norm = self.optimizer.step(lr_at(step, self.tcfg), max_norm=self.tcfg.clip)
        self.last_moe = self.reduce_routing_and_update_bias()
        return self.reduce_loss(loss_sum)

    @property
    def moe(self) -> list:
        """This rank's mixture-of-experts blocks (``moe.MoE``), in layer order."""
        return moe_layers(self.chunks)

    def reduce_routing_and_update_bias(self) -> dict | None:
        """Sum the step's routing counts over the data replicas and the pipeline (all-reduces
        on the 'log' phase), move each router's DeepSeek-V3 selection bias from them (the same
        on every rank; arXiv 2412.19437 §2.1.2), and return the routing per MoE layer of the
        model (every stage's): choices per expert before capacity (the load balance) and the
        fraction of choices dropped by capacity. None without MoE layers."""
        ids = [i for i in range(self.mcfg.layers) if self.mcfg.is_moe_block(i)]
        if not ids:
            return None
        t = torch.zeros(len(ids), 2, self.mcfg.experts, dtype=torch.float64, device=self.ctx.device)
        for m in self.moe:
            t[ids.index(m.layer), 0], t[ids.index(m.layer), 1] = m.routed, m.kept
        with self.comm.in_phase("log"):  # tensor ranks hold the same counts: not summed over tp
            self.comm.all_reduce(t, self.comm.grid.data_axis())
            self.comm.all_reduce(t, "pp")
        for m in self.moe:
            m.update_bias(t[ids.index(m.layer), 0])
        routed, kept = t[:, 0], t[:, 1]
        return {"tokens_per_expert": routed.tolist(), "dropped": float(1 - kept.sum() / routed.sum())}

    def _forward_backward(self, mbs, step: int) -> torch.Tensor:
        """pp = 1: each microbatch's forward (the pipeline's, ``forward_microbatch``) and its
        backward; the data-parallel hooks communicate in the last one only."""
        m, total = len(mbs), torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for k, mb in enumerate(mbs):
            x, y, docs = microbatch_parts(mb)
            with self.comm.labelled(microbatch=k):
                loss = forward_microbatch(self.model, self.ctx, x, y, step, k, m, docs=docs)
                with self.comm.in_phase("bwd"), self.dp.microbatch(last=k == m - 1):
                    loss.backward()
            total += loss.detach().double()
        return total

    def reduce_loss(self, loss_sum: torch.Tensor | None) -> torch.Tensor:
        """The global-batch mean loss on every rank (a 0-dim float64 tensor): the last
        stage's tensor rank 0 of each data-parallel replica contributes its mean (of each
        context rank: the mean over its equal share of the tokens); one 'log'-phase all-reduce."""
        t = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        if loss_sum is not None and self.comm.index("tp") == 0:
            t += loss_sum.double() / (self.layout.data_replicas * self.layout.cp)
        with self.comm.in_phase("log"):
            self.comm.all_reduce(t, "world")
        return t

    @torch.no_grad()
    def evaluate(self, batches: int | None = None) -> float:
        """Mean validation loss over `batches` fixed validation batches (single-stage models;
        with a pipeline, the pipeline runtime's forward-only pass)."""
        n = batches or self.tcfg.eval_batches
        self.optimizer.wait_params()  # the forward hooks would too; evaluation reads them all anyway
        for c in self.chunks:
            c.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for i in range(n):
            x, y, docs = self.rows(data_mod.VALIDATION_STEP + i, subset="val")
            x, y = self._on_rank(x, y)
            if self.pipeline is not None:
                out = self.pipeline.forward_only(x, y, docs=docs)  # eval: no dropout, so no key
                total += out if out is not None else 0.0
            else:
                with self.comm.in_phase("log"), self.ctx.autocast():
                    total += self.model(x, y, docs=docs).double()
        has = self.pipeline is None or self.chunks[-1].last
        return float(self.reduce_loss(total / n if has else None))


def train_job(comm: Comm, model: ModelConfig, layout: ParallelConfig, tc: TrainConfig, corpus, extra=None) -> dict:
    """`minitron train` on one rank (the job `launch.rank_main` runs): no rank trains when one
    was signalled while the ranks started (preemption.py); else :func:`train`, watched by the
    run report the command passes in `extra["report"]`."""
    from .preemption import agree_before_start

    signalled = agree_before_start(process_group_store(), comm.grid.world, comm.grid.rank)
    if signalled:
        return {"preempted": {"step": None, "signal": signalled, "checkpoint": False}}
    return train(model, layout, tc, comm, corpus=corpus, observer=(extra or {}).get("report"))


def train(model: ModelConfig, layout: ParallelConfig, tc: TrainConfig, comm: Comm | None = None,
          corpus=None, log=print, observer=None) -> dict:
    """The `minitron train` job on this rank: train, evaluate, checkpoint, sample.

    Returns a summary dict (first/last validation loss, losses per step, ...).
    `observer` (the run report's, passed in by the command line): ``observer.start(trainer)``
    once the Trainer is built; each step runs inside ``observer.watching(trainer, step)``,
    which installs what it observes through (a trace, the pipeline's recording) and yields
    the saved-tensor hooks the Trainer's step takes (or None); ``observer.finish(trainer)``
    is called on every rank after training; its result is the summary's "report".
    With ``tc.timeline`` every call of the run is timed (:class:`~minitron.comm.TimedTrace`)
    and written to the timeline beside the pipeline's actions.
    """
    comm = comm or Comm()
    with comm.tracing(TimedTrace() if tc.timeline else comm.trace):
        return _train_run(model, layout, tc, comm, corpus, log, observer)


def _train_run(model: ModelConfig, layout: ParallelConfig, tc: TrainConfig, comm: Comm, corpus, log,
               observer) -> dict:
    """:func:`train`'s run, inside the trace it installs."""
    from .checkpoint import gather_full

    tr = Trainer(model, layout, tc, comm, corpus)
    if observer is not None:
        observer.start(tr)
    rank0 = comm.grid.rank == 0
    start = _resume(tr, tc, rank0, log)
    metrics = open(tc.metrics, "a") if (tc.metrics and rank0) else None
    bar = _progress_bar(tc, start) if (rank0 and tc.progress) else None
    first_val = tr.evaluate() if start == 0 else None
    val_losses = {} if first_val is None else {0: first_val}
    losses, speeds, preempted, stop = _train_steps(tr, tc, start, observer, metrics, bar, val_losses)
    _close_run(tr, tc, comm, bar, metrics)
    summary = {"losses": losses, "val_losses": val_losses, "layout": layout.describe(),
               "model": asdict(model), "steps": tc.steps, "tokens_per_s": speeds}
    if observer is not None:
        summary["report"] = observer.finish(tr)  # collective
    if preempted:  # the command exits with preemption.EXIT_PREEMPTED
        summary["preempted"] = {"step": preempted, "signal": stop.signal or "a signal on another rank",
                                "checkpoint": bool(tc.ckpt_dir)}
        return summary
    if tc.sample_tokens:
        full = gather_full(tr)  # any layout -> full weights on rank 0
        if full is not None:
            summary["sample"] = sample(single_device_model(model, full, tc), n=tc.sample_tokens, corpus=tr.corpus)
    return summary


def _resume(tr: Trainer, tc: TrainConfig, rank0: bool, log) -> int:
    """The step to start from: the latest checkpoint's with ``tc.resume`` (every rank
    loads its shards; rank 0 says so), else 0."""
    from . import checkpoint as ckpt

    if not (tc.resume and tc.ckpt_dir):
        return 0
    start = ckpt.load_latest(tc.ckpt_dir, tr)
    if rank0 and start:
        log(f"resumed from {tc.ckpt_dir} at step {start}")
    return start


def _progress_bar(tc: TrainConfig, start: int):
    """Rank 0's progress bar over the run's steps (``tc.progress``)."""
    from tqdm.auto import tqdm

    return tqdm(total=tc.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)


def _train_steps(tr: Trainer, tc: TrainConfig, start: int, observer, metrics, bar,
                 val_losses: dict) -> tuple[list, list, int | None, StopOnSignal]:
    """The steps from `start`: losses stay on the device until a read-back (every
    ``log_every`` steps, an evaluation, a checkpoint or the last step); a SIGTERM/SIGINT
    checkpoints and stops at the next read-back, on every rank at the same step. Fills
    `val_losses`; returns (losses, tokens/s per step, the step preempted at or None, the
    signal handler)."""
    from . import checkpoint as ckpt

    end = min(tc.steps, tc.stop_at) if tc.stop_at else tc.steps
    losses, speeds, pending, t_last = [], [], [], time.perf_counter()  # pending: losses still on the device
    stop, preempted = StopOnSignal(process_group_store()), None  # SIGTERM/SIGINT: checkpoint, then stop
    with stop:
        for step in range(start, end):
            with observer.watching(tr, step) if observer is not None else nullcontext() as hooks:
                loss = tr.step_async(step, saved_tensors=hooks)  # the loop always runs the Trainer's step
            pending.append((step, loss, tr.last_grad_norm, tr.last_moe))
            evaluate = tc.eval_every and ((step + 1) % tc.eval_every == 0 or step + 1 == end)
            ckpt_now = tc.ckpt_dir and ((tc.ckpt_every and (step + 1) % tc.ckpt_every == 0) or step + 1 == end)
            if not (evaluate or ckpt_now or len(pending) == tc.log_every or step + 1 == end):
                continue
            # read back: one host synchronisation per `log_every` steps
            recs = _read_back(tr, tc, pending, (time.perf_counter() - t_last) / len(pending))
            losses += [r["loss"] for r in recs]
            speeds += [r["tokens_per_s"] for r in recs]
            if stop.should_stop() and step + 1 < end:  # every rank agrees on this step
                preempted, evaluate, ckpt_now = step + 1, False, bool(tc.ckpt_dir)
            if evaluate:
                recs[-1]["val_loss"] = val_losses[step + 1] = tr.evaluate()
            if ckpt_now:
                ckpt.save(tc.ckpt_dir, step + 1, tr, tc.keep_last)
            _publish(tr, recs, observer, metrics, bar)
            pending, t_last = [], time.perf_counter()
            if preempted:
                break
    return losses, speeds, preempted, stop


def _read_back(tr: Trainer, tc: TrainConfig, pending: list, dt: float) -> list[dict]:
    """The records of the `pending` steps (loss, learning rate, gradient norm, speed at
    `dt` seconds a step, MoE scalars); NonFiniteLoss at the first step whose loss is not
    finite (the loss is all-reduced: every rank stops at the same step)."""
    tokens_per_step = tc.global_batch * tr.mcfg.seq_len
    recs = [{"step": i + 1, "loss": float(loss), "lr": lr_at(i, tc), "grad_norm": float(norm),
             "tokens_per_s": tokens_per_step / dt, "model_flops_per_s": _step_flops(tr, tc, i) / dt,
             **(moe or {})}
            for i, loss, norm, moe in pending]
    bad = next((r for r in recs if not math.isfinite(r["loss"])), None)
    if bad is not None:
        raise NonFiniteLoss(f"the loss is {bad['loss']} at step {bad['step']}: training diverged; "
                            f"lower --lr (it is {tc.lr:g}) or resume from an earlier checkpoint")
    return recs


def _step_flops(tr: Trainer, tc: TrainConfig, step: int) -> float:
    """Model FLOPs of `step`: under --pack each of the global batch's documents attended at
    its own length (``model_flops_per_step(documents=)``; the step's rows drawn again, as
    every rank draws its own from the seed and step), whole sequences otherwise."""
    docs = tr.packed["train"].batch(tc.global_batch, tc.seed, step)[2].lengths() if tr.packed is not None else None
    return model_flops_per_step(tr.mcfg, tc.global_batch, documents=docs)


def _publish(tr: Trainer, recs: list[dict], observer, metrics, bar) -> None:
    """Hand read-back records to the observer (which may add scalars such as the MFU),
    then append them to the metrics file and show the last on the progress bar."""
    if observer is not None:
        observer.records(tr, recs)  # may add scalars (MFU) before they are written
    if metrics:
        metrics.writelines(json.dumps(r) + "\n" for r in recs)
        metrics.flush()
    if bar is not None:
        last = recs[-1]
        bar.set_postfix(loss=f"{last['loss']:.3f}", tok_s=f"{last['tokens_per_s']:.0f}",
                        **({"val": f"{last['val_loss']:.3f}"} if "val_loss" in last else {}))
        bar.update(len(recs))


def _close_run(tr: Trainer, tc: TrainConfig, comm: Comm, bar, metrics) -> None:
    """After the last step: close the progress bar and metrics file, write the trace and
    (collectively) the timeline where asked: the pipeline's actions, then every rank's calls."""
    if bar is not None:
        bar.close()
    if metrics:
        metrics.close()
    if comm.trace is not None and tc.trace:
        comm.trace.write(tc.trace)
    if tc.timeline and tr.pipeline is not None:
        tr.pipeline.write_timeline(tc.timeline)  # collective: rank 0 writes the first pipeline's
    if tc.timeline:
        comm.write_spans(tc.timeline)  # collective: rank 0 writes every rank's


def single_device_model(model: ModelConfig, full: dict, tc: TrainConfig) -> GPT:
    """A one-device GPT holding the full weights assembled from any layout's shards."""
    from .checkpoint import import_state

    gpt = GPT(model, Context(dtype=TORCH_DTYPES[tc.dtype], seed=tc.seed))
    import_state(list(gpt.parameters()), None, full)
    return gpt


def sample(gpt: GPT, prompt: str = "ROMEO:", n: int = 200, seed: int = 0, corpus=None,
           temperature: float = 0.8, top_k: int = 40) -> str | None:
    """Generate `n` tokens of text after `prompt` from a single-device model, in the
    corpus' tokens (bytes by default); None for a token file without its tokenizer."""
    corpus = corpus if corpus is not None else data_mod.ByteCorpus
    ids = corpus.encode(prompt)
    if not ids:
        return None
    idx = torch.tensor([ids], dtype=torch.long)
    out = gpt.eval().generate(idx, n, temperature, top_k, generator=torch.Generator().manual_seed(seed))
    return corpus.decode(out[0].tolist())

