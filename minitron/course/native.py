"""Lesson 12's rank jobs: the layouts minitron builds by hand, built again with PyTorch's
own APIs, on the same ranks, from the same weights and the same batches.

* data parallelism, fully sharded: ``fully_shard`` (FSDP2) per block and on the root,
  next to minitron's ZeRO-3 (``--dp 2 --zero 3``);
* 1-D tensor parallelism: ``parallelize_module`` with ``ColwiseParallel`` on QKV and the
  first MLP linear, ``RowwiseParallel`` on the two output linears (Megatron-LM Fig. 3),
  next to ``--tp 2``;
* a pipeline: ``PipelineStage`` and ``Schedule1F1B`` from ``torch.distributed.pipelining``,
  next to ``--pp 2 --schedule 1f1b``.

The native model (:class:`NativeGPT`) is plain ``nn.Linear``/``nn.LayerNorm``/``nn.Embedding``
modules whose parameters carry minitron's names and shapes, so it loads the single-device
minitron GPT's weights (:func:`reference_weights`) and computes the same function: what
differs between the two runs is only who splits and communicates. Both sides step with
``optim.make_adamw`` at ``optim.lr_at``; clipping is off (``TRAIN.clip = 0``: a global norm
across pipeline stages is one more collective the native APIs leave to the caller).

What each native run communicated is recorded by :class:`WireLog`, a dispatch mode that
sees every ``c10d`` operator (FSDP2's all-gathers and reduce-scatters, DTensor's
all-reduces, the pipeline's sends and receives) with its tensor's bytes, the counterpart of
minitron's :class:`~minitron.comm.CommTrace`.

    from minitron.tools.testing import run_on_ranks
    out = run_on_ranks(native_job, ParallelConfig(dp=2))[0]   # {"fsdp": ..., "tp": ..., "pp": ...}
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..comm import Comm, CommTrace
from ..config import ModelConfig, ParallelConfig, TrainConfig
from ..context import Context
from ..grid import ProcessGrid
from ..model import GPT
from ..optim import lr_at, make_adamw
from ..train import Trainer

MODEL = ModelConfig(layers=2, hidden=32, heads=4, seq_len=32, vocab=256, name="native")
TRAIN = TrainConfig(steps=3, global_batch=8, microbatches=4, dtype="float64", warmup=1, clip=0.0,
                    progress=False, eval_every=0, sample_tokens=0)
RANKS = 2


# --- the native model: plain modules, minitron's parameter names ---------------------------------
class NativeAttention(nn.Module):
    """Causal attention over `nn.Linear`s. The QKV rows are head-major ([head][q|k|v][d], as
    minitron's), so ``ColwiseParallel`` slices whole heads; the head count is read from the
    local shape (``-1``), as it must be once the linear is split."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv, self.proj = nn.Linear(cfg.hidden, 3 * cfg.hidden), nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class NativeMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc, self.fc2 = nn.Linear(cfg.hidden, cfg.ffn_hidden), nn.Linear(cfg.ffn_hidden, cfg.hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc(x)))


class NativeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.hidden), NativeAttention(cfg)
        self.ln2, self.mlp = nn.LayerNorm(cfg.hidden), NativeMLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class NativeGPT(nn.Module):
    """The GPT (no dropout, untied head) or one pipeline stage of it, in plain PyTorch
    modules; forward returns logits on the last stage, hidden states elsewhere (the loss
    is the caller's: ``torch.distributed.pipelining`` takes it as ``loss_fn``)."""

    def __init__(self, cfg: ModelConfig, layer_ids=None, first: bool = True, last: bool = True):
        super().__init__()
        self.first, self.last = first, last
        ids = range(cfg.layers) if layer_ids is None else layer_ids
        if first:
            self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
            self.wpe = nn.Parameter(torch.zeros(cfg.seq_len, cfg.hidden))
        self.blocks = nn.ModuleDict({str(i): NativeBlock(cfg) for i in ids})
        if last:
            self.ln_f, self.lm_head = nn.LayerNorm(cfg.hidden), nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, x):
        if self.first:
            x = self.wte(x) + self.wpe[: x.shape[1]]
        for block in self.blocks.values():
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def loss_fn(logits, targets):
    """Mean cross-entropy over the tokens, minitron's loss."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def reference_weights(cfg: ModelConfig = MODEL, train: TrainConfig = TRAIN) -> dict:
    """{name: tensor} of minitron's single-device GPT (same seed): the weights every layout
    slices, and what the native model starts from."""
    gpt = GPT(cfg, Context(dtype=torch.float64, seed=train.seed))
    return {n: p.detach().clone() for n, p in gpt.named_parameters()}


def native_model(cfg: ModelConfig = MODEL, train: TrainConfig = TRAIN, **stage) -> NativeGPT:
    """A NativeGPT (or stage: ``layer_ids=, first=, last=``) holding minitron's weights."""
    net = NativeGPT(cfg, **stage).double()
    full = reference_weights(cfg, train)
    with torch.no_grad():
        for n, p in net.named_parameters():
            p.copy_(full[n])
    return net


# --- what the native run put on the wire -----------------------------------------------------------
class WireLog(TorchDispatchMode):
    """Records every ``c10d`` operator dispatched while active: ``(op, bytes)`` with the
    bytes of its local input (a send's or all-gather's shard, a reduce-scatter's full
    buffer, an all-reduce's tensor), op names shortened (``all_gather``, ``reduce_scatter``,
    ``all_reduce``, ``send``, ``recv``). Waits and wrappers are left out."""

    NAMES = {"_allgather_base_": "all_gather", "all_gather_into_tensor": "all_gather",
             "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
             "allreduce_": "all_reduce", "all_reduce": "all_reduce", "send": "send", "recv_": "recv"}

    def __init__(self):
        super().__init__()
        self.records: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        base = func._schema.name.split("::")[-1]
        if func.namespace in ("c10d", "_c10d_functional") and base in self.NAMES:
            op = self.NAMES[base]
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
            # all_gather(out, in): the input is the second tensor; reduce_scatter(out, in): the full buffer
            t = tensors[1] if op in ("all_gather", "reduce_scatter") and len(tensors) > 1 else tensors[0]
            self.records.append((op, t.numel() * t.element_size()))
        return func(*args, **(kwargs or {}))


def summarize(records) -> dict:
    """{op: [calls, bytes]} of `records`, ``(op, bytes)`` pairs."""
    out: dict = {}
    for op, nbytes in records:
        calls, total = out.get(op, (0, 0))
        out[op] = (calls + 1, total + nbytes)
    return dict(sorted(out.items()))


def minitron_calls(trace: CommTrace, step: int) -> dict:
    """``summarize`` of minitron's trace of one step on this rank, the loss's 'log' all-reduce
    left out (the native loop averages its loss outside the recorded region too)."""
    return summarize((r["op"].replace("_single", ""), r["bytes"]) for r in trace.records
                     if r["step"] == step and r["phase"] != "log")


# --- the jobs ------------------------------------------------------------------------------------
def _comm_for(layout: ParallelConfig) -> Comm:
    """A traced Comm for `layout` on the running process group (collective: every rank builds
    the same groups), so that one launch can run several layouts."""
    grid = ProcessGrid(tp=layout.tp, dp=layout.dp, pp=layout.pp)
    grid.rank = dist.get_rank()
    return Comm(grid.build_groups(), CommTrace())


def _minitron(layout: ParallelConfig, train: TrainConfig) -> tuple[Trainer, list[float], dict]:
    """minitron's run of `layout`: the trainer, its losses and its calls of the last step."""
    tr = Trainer(MODEL, layout, train, _comm_for(layout))
    losses = [tr.step(i) for i in range(train.steps)]
    return tr, losses, minitron_calls(tr.comm.trace, train.steps - 1)


class _AdamW:
    """minitron's AdamW (``optim.make_adamw``: same groups, betas, eps) over native
    parameters: one per kind of tensor, since a fused step takes DTensors or plain tensors,
    not both (tensor parallelism leaves LayerNorms and embeddings plain). AdamW is
    elementwise, so splitting it changes nothing."""

    def __init__(self, params, train: TrainConfig):
        params, self.train = list(params), train
        kinds = {}
        for p in params:
            kinds.setdefault(type(p.data).__name__, []).append(p)
        self.opts = [make_adamw(ps, train) for ps in kinds.values()]

    def step(self, step: int) -> None:
        for opt in self.opts:
            for g in opt.param_groups:
                g["lr"] = lr_at(step, self.train)
            opt.step()

    def zero_grad(self) -> None:
        for opt in self.opts:
            opt.zero_grad(set_to_none=True)


def _mean_over_world(x: float) -> float:
    t = torch.tensor(x, dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _max_param_diff(full: dict | None, net_params: dict) -> float | None:
    """Largest relative difference between minitron's full weights and the native ones."""
    if full is None:
        return None
    worst = 0.0
    for n, p in net_params.items():
        ref = full[n if n in full else n + ".weight"]["param"]  # minitron's position table is "wpe.weight"
        worst = max(worst, float((p.detach() - ref).abs().max() / ref.abs().max()))
    return worst


def fsdp_job(comm, train: TrainConfig = TRAIN) -> dict:
    """FSDP2 on a 1-D mesh of every rank vs minitron's ZeRO-3 on the same ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ..checkpoint import gather_full

    d = dist.get_world_size()
    tr, theirs, their_calls = _minitron(ParallelConfig(dp=d, zero=3), train)
    mesh = init_device_mesh("cpu", (d,), mesh_dim_names=("dp",))
    net = native_model(train=train)
    for block in net.blocks.values():
        fully_shard(block, mesh=mesh)  # a unit per block: gathered before its forward and its backward
    fully_shard(net, mesh=mesh)  # the root unit: embeddings, final norm, head
    opt = _AdamW(net.parameters(), train)
    losses, wire = [], []
    for step in range(train.steps):
        log, total = WireLog(), 0.0
        with log:
            for x, y in tr.microbatches(step):  # this rank's rows, as minitron's dp rank takes them
                loss = loss_fn(net(x), y) / train.microbatches
                loss.backward()
                total += float(loss.detach())
            opt.step(step)
        opt.zero_grad()
        losses.append(_mean_over_world(total))
        wire.append(summarize(log.records))
    full = gather_full(tr)
    params = {n: p.full_tensor() for n, p in net.named_parameters()}
    return {"minitron": theirs, "native": losses, "native_calls": wire[-1],
            "minitron_calls": their_calls,
            "max_param_rel_diff": _max_param_diff(full, params),
            "root_gather_bytes": sum(p.to_local().numel() * p.element_size() for n, p in net.named_parameters()
                                     if not n.startswith("blocks.")),
            "shards": {n: (tuple(p.shape), tuple(p.to_local().shape), str(p.placements))
                       for n, p in list(net.named_parameters())[:3]}}


TP_PLAN = {"attn.qkv": "colwise", "attn.proj": "rowwise", "mlp.fc": "colwise", "mlp.fc2": "rowwise"}


def tp_job(comm, train: TrainConfig = TRAIN) -> dict:
    """``parallelize_module`` (column-wise QKV and fc, row-wise proj and fc2) vs ``--tp``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from ..checkpoint import gather_full

    t = dist.get_world_size()
    tr, theirs, their_calls = _minitron(ParallelConfig(tp=t), train)
    mesh = init_device_mesh("cpu", (t,), mesh_dim_names=("tp",))
    net = native_model(train=train)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for block in net.blocks.values():
        parallelize_module(block, mesh, {name: styles[s]() for name, s in TP_PLAN.items()})
    opt = _AdamW(net.parameters(), train)
    losses, wire = [], []
    for step in range(train.steps):
        log, total = WireLog(), 0.0
        with log:
            for x, y in tr.microbatches(step):  # every tensor rank reads the same rows
                loss = loss_fn(net(x), y) / train.microbatches
                loss.backward()
                total += float(loss.detach())
            opt.step(step)
        opt.zero_grad()
        losses.append(total)
        wire.append(summarize(log.records))
    full = gather_full(tr)
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach()) for n, p in net.named_parameters()}
    b = train.global_batch // train.microbatches
    return {"minitron": theirs, "native": losses, "native_calls": wire[-1],
            "minitron_calls": their_calls,
            "max_param_rel_diff": _max_param_diff(full, params),
            "activation_bytes": b * MODEL.seq_len * MODEL.hidden * 8,
            "minitron_activation_all_reduces": sum(
                1 for r in tr.comm.trace.records if r["step"] == train.steps - 1 and r["op"] == "all_reduce"
                and r["shape"] == [b, MODEL.seq_len, MODEL.hidden])}


def pp_job(comm, train: TrainConfig = TRAIN) -> dict:
    """``PipelineStage`` + ``Schedule1F1B`` over two stages vs ``--pp 2 --schedule 1f1b``."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from ..checkpoint import gather_full
    from ..placement import stage_layers

    p, r = dist.get_world_size(), dist.get_rank()
    layout = ParallelConfig(pp=p, schedule="1f1b")
    tr, theirs, their_calls = _minitron(layout, train)
    layers = stage_layers(MODEL, layout)[r]
    net = native_model(train=train, layer_ids=layers, first=r == 0, last=r == p - 1)
    stage = PipelineStage(net, r, p, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=train.microbatches, loss_fn=loss_fn)  # scales grads by 1/m
    opt = _AdamW(net.parameters(), train)
    losses, wire = [], []
    for step in range(train.steps):
        x, y = tr.local_batch(step)  # the whole batch: the schedule splits it into m microbatches
        log, mb_losses = WireLog(), []
        with log:
            if r == 0:
                schedule.step(x)
            elif r == p - 1:
                schedule.step(target=y, losses=mb_losses)
            else:
                schedule.step()
            opt.step(step)
        opt.zero_grad()
        t = torch.tensor(sum(float(v) for v in mb_losses) / train.microbatches if mb_losses else 0.0,
                         dtype=torch.float64)
        dist.broadcast(t, p - 1)
        losses.append(float(t))
        wire.append(summarize(log.records))
    full = gather_full(tr)
    params = {n: p.detach() for n, p in net.named_parameters()}
    gathered = [None] * p
    dist.all_gather_object(gathered, params)
    merged = {n: v for part in gathered for n, v in part.items()}
    return {"minitron": theirs, "native": losses, "native_calls": wire[-1], "native_calls_first_step": wire[0],
            "minitron_calls": their_calls,
            "max_param_rel_diff": _max_param_diff(full, merged), "stage_layers": layers}


def native_job(comm, which=("fsdp", "tp", "pp"), train: TrainConfig = TRAIN) -> dict:
    """Every comparison of lesson 12 in one launch (`run_on_ranks` on 2 ranks): {name: the
    job's dict} on each rank (rank 0's is the one the lesson prints)."""
    jobs = {"fsdp": fsdp_job, "tp": tp_job, "pp": pp_job}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP2's and pipelining's notes about prototype APIs
        return {name: jobs[name](comm, train) for name in which}


def loss_diffs(result: dict) -> dict:
    """{layout: largest |native - minitron| loss over the steps} of `native_job`'s result."""
    return {k: max(abs(a - b) for a, b in zip(v["native"], v["minitron"])) for k, v in result.items()}


__all__ = ["MODEL", "TRAIN", "RANKS", "NativeGPT", "loss_fn", "reference_weights", "native_model", "WireLog",
           "summarize", "minitron_calls", "fsdp_job", "tp_job", "pp_job", "native_job", "loss_diffs", "TP_PLAN"]
