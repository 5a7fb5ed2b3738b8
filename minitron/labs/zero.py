"""Lab 03b: ZeRO-1 over one gradient bucket (Rajbhandari et al. 2020, stage 1; the engine's
``--zero1``: ``BucketedDataParallel(shard=True)`` and ``ShardedAdamW`` in
:mod:`minitron.parallel.data`).

The learner writes two functions of one flat bucket of n elements (n a multiple of the d
data-parallel ranks; rank r owns elements [r·n/d, (r+1)·n/d)):

* ``reduce_scatter_grads(comm, grad)`` -> this rank's n/d elements of the *mean* gradient
  over the d ranks. The engine calls it from the backward hook that sees the bucket's
  last gradient (during the last microbatch's backward, overlapping the rest of it).
* ``update_params(comm, grad_shard, param, state, lr)``: step this rank's shard of the
  parameters with ``adam(shard, grad_shard, state, lr)`` (given: AdamW without weight
  decay, elementwise, exactly torch's), then all-gather the shards into ``param`` in place.

The checker trains a tiny GPT on 4 gloo ranks (float64, 2 steps of 2 microbatches,
several buckets; ``--dp 4``, then ``--dp 2 --tp 2``) with these in place of the engine's reduce-scatter and sharded step, and
checks, in this order: each returned gradient shard against the true mean (computed
aside); the parameter bucket identical on every rank after ``update_params``; the data-
parallel calls of every step, traced, against ``analysis.data_parallel.dp_calls`` (op, phase,
count, bytes); the optimizer state held per rank against ``model_state_bytes``
(2·ceil(n/d)·e); losses and parameters against the single-device model.

    result = check_zero1(SOURCE)   # {"ok", "message", "calls", "optimizer_bytes", ...}
"""
from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist

from ..config import ParallelConfig, TrainConfig
from ..parallel.data import BucketedDataParallel, ShardedAdamW
from .runner import (LAB_GPT, TOL, LabError, Tripwire, call, comm_on, layout_flags, load, run_sources, training_verdict,
                     verdict_over_runs, versus_one_device)

MODEL = LAB_GPT
TRAIN = TrainConfig(steps=2, global_batch=8, microbatches=2, dtype="float64", warmup=1, weight_decay=0.0,
                    clip=0.0, progress=False, eval_every=0, sample_tokens=0)
BUCKET_MB = 0.02  # ~2.6k float64 elements: this 12k-parameter model gets 5 buckets
BETAS, EPS = (0.9, 0.95), 1e-8  # the engine's AdamW (minitron.optim.make_adamw)
DP = 4  # data-parallel ranks: more than 2, so that nothing hard-wired to 2 passes
# the notebook's layout, then 2 data-parallel ranks x 2 tensor ranks in the same launch: a mean hard-wired
# to the notebook's d, or taken over the launch's ranks rather than the 'dp' group, fails there
LAYOUTS = (ParallelConfig(dp=DP, zero1=True, bucket_mb=BUCKET_MB, device="cpu"),
           ParallelConfig(dp=DP // 2, tp=2, zero1=True, bucket_mb=BUCKET_MB, device="cpu"))
NAMES = ("reduce_scatter_grads", "update_params")
# the engine's own ZeRO (its sharded optimizers and buckets): not an answer to this lab
FORBIDDEN = ("minitron.parallel.zero", "minitron.parallel.data.ShardedAdamW",
             "minitron.parallel.data.BucketedDataParallel", "minitron.parallel.data.FlatShards")


@torch.no_grad()
def adam(param: torch.Tensor, grad: torch.Tensor, state: dict, lr: float) -> None:
    """AdamW without weight decay on flat tensors, in place: what ``torch.optim.AdamW``
    computes for each element. `state` (a dict kept between steps) gets the step count and
    the two moments, ``exp_avg`` and ``exp_avg_sq``, each the size of `param`."""
    if not state:
        state.update(step=0, exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param))
    beta1, beta2 = BETAS
    state["step"] += 1
    t = state["step"]
    state["exp_avg"].lerp_(grad, 1 - beta1)
    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2 ** t)).add_(EPS)
    param.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1 ** t))


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`a` equals `b` to float64 rounding, relative to b's largest element (also lab 03c's test)."""
    return a.shape == b.shape and bool((a - b).abs().max() <= 1e-12 * b.abs().max().clamp_min(1e-300))


def divisor(got: torch.Tensor, mean: torch.Tensor, d: int) -> int:
    """c when `got` is the sum over the d ranks divided by a whole c other than d, else 0."""
    norm = float(got.norm())
    if norm == 0:
        return 0
    c = round(d * float(mean.norm()) / norm)
    return c if 1 < c <= 1024 and c != d and close(got, mean * d / c) else 0


def _diagnose(got, grad, full_mean, d: int, r: int, world: int) -> str:
    """Why the shard `got` is not this rank's slice of the mean gradient (`world`: the launch's ranks)."""
    k = full_mean.numel() // d
    mine = slice(r * k, (r + 1) * k)
    if close(got, full_mean[mine] * d):
        return "it is the sum over the ranks, not the mean: divide by d (before or after the reduce-scatter)"
    c = divisor(got, full_mean[mine], d)
    if c and c == d ** 2 and c != world:
        return (f"it is the mean divided by d = {d} once more (1/d²): divide the sum by d once, before or after "
                f"the reduce-scatter, not both")
    if c:
        return (f"it is the sum divided by {c}, not by d = {d} ({d / c:.4g}× the mean): the mean divides by the size "
                f"of the data-parallel group, comm.size('dp') (a d hard-wired to {c}, or another group's size?)")
    scale = float(got.abs().sum() / full_mean[mine].abs().sum().clamp_min(1e-300))
    if abs(scale - 1) > TOL and close(got, full_mean[mine] * scale):
        return f"it is {scale:.4g}× the mean: the reduce-scatter sums the d = {d} ranks' gradients; divide by d once"
    for j in range(d):
        if j != r and close(got, full_mean[j * k:(j + 1) * k]):
            return (f"it is rank {j}'s slice of the mean: rank r owns elements [r*n/d, (r+1)*n/d) "
                    f"of the bucket")
    if close(got, grad[mine]) or close(got, grad[mine] / d):
        return "it holds only this rank's own gradient: reduce (sum) over the data-parallel ranks"
    err = float((got - full_mean[mine]).abs().max())
    return f"it differs from this rank's slice of the mean by up to {err:.3g}"


class _LabBuckets(BucketedDataParallel):
    """ZeRO-1's gradient buckets (``BucketedDataParallel(shard=True)``) whose bucket start
    calls the learner's reduce-scatter and checks what it returns against the mean
    computed aside."""

    def __init__(self, params, comm, bucket_mb: float, fn):
        super().__init__(params, comm, bucket_mb, shard=True)
        self.fn = fn

    def start_bucket(self, b) -> None:
        dp, d, r = self, self.d, self.rank
        grad = dp.grad_buffer[b.start:b.end]
        truth = grad.clone()  # the mean, by a plain all-reduce that bypasses Comm (not traced)
        dist.all_reduce(truth, group=dp.comm.group("dp"))
        truth /= d
        local = grad.clone()
        got = call("reduce_scatter_grads", self.fn, dp.comm, grad)
        k = b.numel // d
        if not isinstance(got, torch.Tensor) or got.numel() != k:
            what = f"{got.numel()} elements" if isinstance(got, torch.Tensor) else repr(got)[:40]
            raise LabError(f"reduce_scatter_grads returned {what} for a bucket of n={b.numel} on d={d} ranks: "
                           f"return this rank's n/d = {k} elements of the mean gradient")
        got = got.reshape(-1).to(truth.dtype)
        if not close(got, truth[r * k:(r + 1) * k]):
            raise LabError(f"reduce_scatter_grads on dp rank {r}, bucket {b.index} (n={b.numel}): "
                           + _diagnose(got, local, truth, d, r, dp.comm.grid.world))
        dp.shard_grad[b.start // d:b.end // d] = got


class _LabZeroOne(ShardedAdamW):
    """``ShardedAdamW`` (ZeRO-1's optimizer) whose step calls the learner's `update_params`
    once per bucket (no clipping: the lab trains with clip=0). Its all-gather is done when
    the step returns: nothing is left in flight to wait for."""

    def __init__(self, dp, fn):  # no super().__init__: the learner keeps the state
        self.dp, self.comm, self.fn, self.steps = dp, dp.comm, fn, 0
        self.states = [{} for _ in dp.buckets]

    def wait_params(self) -> None:
        """Nothing in flight: the learner's update_params all-gathers before it returns."""

    materialize = wait_params

    def export_param_state(self) -> dict:
        """No per-parameter state to export: the learner's `state` dicts are the lab's own
        (the run is compared with the single-device model by its parameters)."""
        return {p: {} for p in self.dp.params}

    def state_bytes(self) -> int:
        def size(x):
            if isinstance(x, torch.Tensor):
                return x.numel() * x.element_size()
            if isinstance(x, dict):
                return sum(size(v) for v in x.values())
            if isinstance(x, (list, tuple)):
                return sum(size(v) for v in x)
            return 0
        return sum(size(s) for s in self.states)

    @torch.no_grad()
    def step(self, lr: float, max_norm: float = 0.0) -> float:
        dp, d = self.dp, self.dp.d
        for b in dp.buckets:
            param = dp.param_buffer[b.start:b.end]
            grad_shard = dp.shard_grad[b.start // d:b.end // d]
            call("update_params", self.fn, self.comm, grad_shard, param, self.states[b.index], lr)
            total = param.clone()
            dist.all_reduce(total, group=self.comm.group("dp"))  # aside, not traced
            if not close(total, param * d):
                raise LabError(f"after update_params the parameter bucket {b.index} differs between the "
                               f"data-parallel ranks: all-gather every rank's updated shard into `param`")
        return 0.0


def _watch() -> Tripwire:
    """The engine's own ZeRO, watched while the learner's run trains: its sharded optimizers
    (all of :mod:`minitron.parallel.zero`), the bucket reduce-scatter and the sharded step
    that the lab's buckets and optimizer replace."""
    from ..parallel import zero

    return Tripwire({"minitron.parallel.zero": zero,
                     "minitron.parallel.data.BucketedDataParallel.start_bucket": BucketedDataParallel.start_bucket,
                     "minitron.parallel.data.ShardedAdamW.step": ShardedAdamW.step,
                     "minitron.parallel.data.ShardedAdamW.grad_norm": ShardedAdamW.grad_norm})


def _calls_summary(calls) -> str:
    return ", ".join(f"{c['op']} x{c['calls']} in {c['phase']} ({c['bytes']} B)" for c in calls) or "none"


def _zero1_job(comm, source: str) -> dict | None:
    with _watch().armed():
        ns = load(source, NAMES, {"torch": torch, "adam": adam})
    verdicts = []
    for i, layout in enumerate(LAYOUTS):
        try:
            verdicts.append((layout_flags(layout), _zero1_run(comm if i == 0 else comm_on(comm, layout), layout, ns)))
        except LabError as e:  # said with the layout it was found on, after the notebook's
            raise (LabError(f"{layout_flags(layout)}: {e}") if i else e) from None
    if comm.grid.rank != 0:
        return None
    out = verdict_over_runs(verdicts, f"your ZeRO-1 trains exactly like the single-device model on {DP} data-parallel "
                                      f"ranks and on {LAYOUTS[1].dp} (x {LAYOUTS[1].tp} tensor ranks), moving what "
                                      f"dp_calls predicts and keeping 1/d of Adam's state")
    out.update({k: verdicts[0][1][k] for k in ("calls", "optimizer_bytes", "optimizer_bytes_replicated")})
    return out


def _zero1_run(comm, layout: ParallelConfig, ns: dict) -> dict | None:
    """Train on `layout` with the learner's functions; check shards, calls, state bytes and the run."""
    from ..analysis.data_parallel import dp_calls, model_state_bytes
    from ..train import Trainer

    d = comm.size("dp")
    with _watch().armed():
        tr = Trainer(MODEL, layout, TRAIN, comm, data_parallel=lambda params, c, lay, chunks: _LabBuckets(
            params, c, lay.bucket_mb, ns["reduce_scatter_grads"]),
            optimizer=lambda params, dp, lay, train: _LabZeroOne(dp, ns["update_params"]))
        opt = tr.optimizer
        losses = [tr.step(i) for i in range(TRAIN.steps)]

    predicted = model_state_bytes(MODEL, layout, TRAIN)
    held = opt.state_bytes()
    if held != predicted["optimizer_bytes_zero1"]:
        raise LabError(f"dp rank {comm.index('dp')} holds {held} bytes of optimizer state; ZeRO-1 keeps "
                       f"2*ceil(n/d)*e = {predicted['optimizer_bytes_zero1']:.0f} (Adam's two moments of this "
                       f"rank's shard only; replicated Adam: {predicted['optimizer_bytes_replicated']:.0f})")

    # the data-parallel calls of every step against the closed form (the engine's own ZeRO-1
    # also all-reduces the 8-byte gradient norm for clipping, which this lab leaves out)
    e = tr.dp.grad_buffer.element_size()
    want = [c for c in dp_calls([p.numel() for p in tr.dp.params], d, "bucketed", zero1=True,
                                bucket_mb=BUCKET_MB, bytes_per_el=e) if c["op"] != "all_reduce"]
    for step in range(TRAIN.steps):
        seen = defaultdict(lambda: [0, 0])
        for rec in comm.trace.records:
            if rec["axis"] == "dp" and rec["step"] == step:
                seen[rec["op"], rec["phase"]][0] += 1
                seen[rec["op"], rec["phase"]][1] += rec["bytes"]
        got = [{"op": op, "phase": ph, "calls": n, "bytes": nb} for (op, ph), (n, nb) in seen.items()]
        key = lambda c: (c["op"], c["phase"])  # noqa: E731
        if step == 0:
            calls = got
        if sorted(got, key=key) != sorted(want, key=key):
            reduces = {c["phase"] for c in got if c["op"] == "all_reduce"}
            hint = (": an all-reduce of the gradients moves twice a reduce-scatter's bytes on the wire, and "
                    "each rank needs only its shard" if "bwd" in reduces else
                    ": ZeRO-1 needs no all-reduce after backward, each rank steps its own shard and one "
                    "all-gather shares them" if reduces else "")
            raise LabError(f"your data-parallel calls in step {step}: {_calls_summary(got)}; ZeRO-1's "
                           f"(analysis.data_parallel.dp_calls): {_calls_summary(want)}{hint}")

    res = versus_one_device(comm, tr, losses, MODEL, TRAIN.replace(microbatches=TRAIN.microbatches * d))
    if res is None:
        return None
    res.update(calls=calls, optimizer_bytes=held, optimizer_bytes_replicated=predicted["optimizer_bytes_replicated"])
    return training_verdict(res, "ZeRO-1", "", TOL)


def check_zero1_all(sources: list[str], timeout: float = 60) -> list[dict]:
    """`check_zero1` for several sources, in as few launches as their outcomes allow."""
    return run_sources(_zero1_job, ParallelConfig(dp=DP, device="cpu"), sources, timeout,
                       forbidden=FORBIDDEN, names=NAMES)


def check_zero1(source: str, timeout: float = 60) -> dict:
    """Lab 03b: train a tiny GPT on 4 gloo ranks (float64, 2 steps; ``--dp 4``, then
    ``--dp 2 --tp 2``) with the learner's
    `reduce_scatter_grads` and `update_params` in place of the engine's ZeRO-1 bucket
    reduce-scatter and sharded AdamW step; check each gradient shard, the parameters after
    the all-gather, the traced calls (dp_calls), the optimizer bytes (model_state_bytes)
    and the run against the single-device model. Returns {"ok", "message", "calls",
    "optimizer_bytes", "optimizer_bytes_replicated", "max_loss_abs_diff",
    "max_param_rel_diff", ...}, or {"ok": False, "message"} naming the first problem."""
    return check_zero1_all([source], timeout)[0]
