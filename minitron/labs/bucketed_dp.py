"""Lab 03a: bucketed, overlapped gradient synchronisation (the engine's
``minitron.parallel.data.BucketedDataParallel``, without ZeRO).

The learner writes ``BucketedGradSync(params, comm, bucket_mb)`` with the engine's
data-parallel interface: ``zero_grad()``, ``microbatch(last)`` (a context manager around
one microbatch's backward) and ``finish()``. A post-accumulate-grad hook on every
parameter counts, during the last microbatch's backward, the gradients each bucket still
misses; buckets hold the parameters in reverse order (the order backward produces their
gradients) and close at the first parameter that brings them to ``bucket_elements``; a
complete bucket's all-reduce starts at once, asynchronously, and ``finish()`` waits for
them all. The result is the mean over the d data-parallel ranks.

The checker runs on 3 gloo ranks (``--dp 3``: an odd count, float64), at the notebook's
size (a 4-layer GPT, 2 microbatches, buckets of ``BUCKET_MB``) and then at ``HELD_OUT``, a
size the notebook does not show (another model, bucket size and microbatch count: buckets
planned for the notebook's parameters fail there), checks every step as below (a counter
that is not reset between steps fails in the second), and

1. passes the learner's class to the Trainer (``Trainer(data_parallel=...)``) behind a
   look-out: its own gradient hooks, registered first, log when each gradient is ready,
   and the ``comm`` the learner's class gets logs when each all-reduce is issued (and
   whether it is asynchronous) and when its handle is waited for; from that log:
   no communication before the last microbatch, no synchronous all-reduce and no wait
   during backward, and the first bucket issued *before the last gradient exists* —
   i.e. the all-reduces overlap backward;
2. counts the traced data-parallel calls and bytes of the step against the analysis
   (``analysis.data_parallel.dp_calls``, ``analysis.comm.dp_bytes_per_step``);
3. compares every gradient after ``finish()`` with the engine's on the same ranks
   (a sum, a double 1/d or any other multiple of the mean named, a bucket never sent),
   then compares the run with the single-device model.

    result = check_bucketed_dp(SOURCE)   # {"ok", "message", "calls", "bytes", "overlapped", ...}
"""
from __future__ import annotations

import dataclasses
import itertools
from contextlib import contextmanager

import torch

from ..analysis.comm import dp_bytes_per_step
from ..analysis.data_parallel import dp_calls
from ..config import ModelConfig, ParallelConfig, TrainConfig
from ..parallel.buckets import bucket_elements
from ..parallel.data import make_data_parallel
from .runner import TOL, LabError, Tripwire, agree, call, describe, fail, load, run_sources, training_verdict, versus_one_device

MODEL = ModelConfig(layers=4, hidden=16, heads=4, seq_len=16, vocab=256, name="lab")
TRAIN = TrainConfig(steps=2, global_batch=12, microbatches=2, dtype="float64", warmup=1, progress=False,
                    eval_every=0, sample_tokens=0)
BUCKET_MB = 0.02  # ~2600 float64 elements: a handful of buckets in the lab's model
# 3 ranks: an odd count, so that a mean hard-wired to 2 ranks fails
LAYOUT = ParallelConfig(dp=3, dp_impl="bucketed", bucket_mb=BUCKET_MB, device="cpu")
# a second size the notebook does not show: another model, bucket size and microbatch count,
# so that buckets planned for the notebook's parameters (or its bucket count) fail there
HELD_OUT = (ModelConfig(layers=3, hidden=24, heads=4, seq_len=16, vocab=320, name="lab-held-out"),
            dataclasses.replace(LAYOUT, bucket_mb=0.013), TRAIN.replace(global_batch=18, microbatches=3))
NAMES = ("BucketedGradSync",)
# the engine's own gradient synchronisation: not an answer to this lab
FORBIDDEN = ("minitron.parallel.data.BucketedDataParallel", "minitron.parallel.data.make_data_parallel",
             "minitron.parallel.data.NaiveDataParallel", "minitron.parallel.data.FlatShards")
_CASE = itertools.count()  # the case number in this launch: the same on every rank (agree's keys)


def learner_namespace() -> dict:
    """What the learner's source may use without importing it."""
    return {"torch": torch, "contextmanager": contextmanager, "bucket_elements": bucket_elements}


# --- the look-out ------------------------------------------------------------------------------
class _Handle:
    """An async all-reduce's work handle that logs when it is waited for."""

    def __init__(self, work, log):
        self.work, self.log = work, log

    def wait(self, *args, **kwargs):
        self.log.append(("wait",))
        return self.work.wait(*args, **kwargs) if self.work is not None else True

    def is_completed(self):
        return self.work is None or self.work.is_completed()


class _LoggedComm:
    """The Trainer's Comm as the learner's class sees it: every call passes through, and
    each all-reduce on the gradient axis is logged (issued, asynchronous or not, waited)."""

    def __init__(self, comm, log):
        self.comm, self.log = comm, log

    def __getattr__(self, name):
        return getattr(self.comm, name)

    def all_reduce(self, t, axis, op="sum", async_op=False, **kwargs):
        self.log.append(("issue", axis, bool(async_op), t.numel() * t.element_size()))
        work = self.comm.all_reduce(t, axis, op=op, async_op=async_op, **kwargs)
        return _Handle(work, self.log) if async_op else work


class _LookOut:
    """The data-parallel object the Trainer gets: the learner's (or the engine's) behind a
    log of gradient hooks and communication; keeps the gradients `finish()` leaves."""

    def __init__(self, make, params, comm, layout):
        self.log, self.last = [], False
        self.params = [p for p in params if p.requires_grad]
        for i, p in enumerate(self.params):  # before the learner's hooks: they run first
            p.register_post_accumulate_grad_hook(self._hook(i))
        self.inner = make(params, _LoggedComm(comm, self.log), layout)
        self.grads: list | None = None

    def _hook(self, i):
        def hook(p):
            self.log.append(("grad", i, self.last))
        return hook

    def __getattr__(self, name):  # wait_params, materialize, ...: the learner's, else nothing to do
        inner = self.__dict__.get("inner")
        if inner is not None and hasattr(inner, name):
            return getattr(inner, name)
        if name in ("wait_params", "materialize"):
            return lambda: None
        raise AttributeError(name)

    def zero_grad(self):
        self.log.clear()
        call("BucketedGradSync.zero_grad", self.inner.zero_grad)

    @contextmanager
    def microbatch(self, last: bool):
        self.last = last
        self.log.append(("backward", last))
        ctx = call("BucketedGradSync.microbatch", self.inner.microbatch, last)
        with ctx:
            yield
        self.log.append(("backward done", last))

    def finish(self):
        self.log.append(("finish",))
        call("BucketedGradSync.finish", self.inner.finish)
        self.log.append(("finished",))
        self.grads = [None if p.grad is None else p.grad.detach().clone() for p in self.params]


def _make_learner(cls):
    def make(params, comm, layout):
        return call("BucketedGradSync.__init__", cls, params, comm, layout.bucket_mb)
    return make


def _engine(params, comm, layout):
    return make_data_parallel(params, comm, layout)


# --- reading the log ---------------------------------------------------------------------------
def _overlap_problem(log: list, m: int) -> str:
    """'' when the log of one step shows buckets issued asynchronously during the last
    microbatch's backward, before its last gradient, and waited for only afterwards."""
    issues = [i for i, e in enumerate(log) if e[0] == "issue" and e[1] in ("dp", "dp_cp")]
    if not issues:
        return ("no all-reduce on the 'dp' axis went through `comm`: call comm.all_reduce(flat, 'dp', "
                "async_op=True) for every bucket")
    grads_last = [i for i, e in enumerate(log) if e[0] == "grad" and e[2]]
    finish = next(i for i, e in enumerate(log) if e[0] == "finish")
    early = next((i for i in issues if not any(e[0] == "backward" and e[1] for e in log[:i])), None)
    if early is not None:
        return (f"an all-reduce starts during an earlier microbatch of the {m}: only the last microbatch's "
                "backward starts buckets (the earlier ones only accumulate into .grad)")
    sync = [i for i in issues if not log[i][2]]
    if any(i < finish for i in sync):
        return ("your hook issues a blocking all-reduce (async_op=False): backward stops until the bucket "
                "has crossed the wire, so nothing overlaps; start it with async_op=True and wait for "
                "the handles in finish()")
    waits = [i for i, e in enumerate(log) if e[0] == "wait"]
    if waits and grads_last and waits[0] < grads_last[-1]:
        return ("your hook waits for a bucket's all-reduce (handle.wait()) while backward still has "
                "gradients to compute, so nothing overlaps: keep the handles and wait for them in finish()")
    if issues[0] > finish:
        return ("the all-reduces start only in finish(), after backward: start each bucket's from the "
                "gradient hook as soon as its last gradient has arrived, so that it overlaps the rest "
                "of backward")
    if grads_last and issues[0] > grads_last[-1]:
        return ("your first bucket is complete only when the last gradient arrives, so nothing overlaps "
                "backward: fill the buckets in reverse parameter order (the order backward produces "
                "the gradients), so that the first bucket fills first")
    return ""


def _trace_problem(comm, tr, n: int, e: int, bucket_mb: float, step: int = 0) -> tuple[str, dict]:
    """('', {calls, bytes}) when the traced data-parallel calls of `step` equal the analysis."""
    d = comm.size("dp")
    recs = [r for r in comm.trace.records if r["axis"] == "dp" and r["step"] == step and r["op"] == "all_reduce"]
    calls, nbytes = len(recs), sum(r["bytes"] for r in recs)
    order = [p for p in reversed(tr.params) if p.requires_grad]
    want = dp_calls([p.numel() for p in order], d, "bucketed", False, bucket_mb, e)[0]
    total = dp_bytes_per_step(n, d, False, e)["all_reduce"]
    got = {"calls": calls, "bytes": nbytes}
    if nbytes != total:
        what = "less" if nbytes < total else "more"
        return (f"your all-reduces carry {nbytes} bytes per step, {what} than every gradient once ({n} "
                f"elements x {e} bytes = {total}, analysis.comm.dp_bytes_per_step): "
                + ("a bucket is never sent? (the last one may not be full: send it in finish())"
                   if nbytes < total else "a gradient is sent twice?")), got
    if calls != want["calls"]:
        cap = bucket_elements(bucket_mb, e)
        return (f"{calls} all-reduces per step, the analysis' bucket plan has {want['calls']} (a bucket "
                f"closes at the first parameter that brings it to bucket_elements(bucket_mb, "
                f"element_size) = {cap} elements)"), got
    return "", got


def _grad_problem(mine: list, ref: list, names: list, d: int) -> str:
    """'' when the learner's gradients after finish() equal the engine's."""
    bad = [i for i, (a, b) in enumerate(zip(mine, ref))
           if a is None or not torch.allclose(a, b, rtol=TOL, atol=1e-300)]
    if not bad:
        return ""
    i = bad[0]
    scale = float(mine[i].abs().sum() / ref[i].abs().sum().clamp_min(1e-300)) if mine[i] is not None else 0.0
    if all(mine[j] is not None and torch.allclose(mine[j], ref[j] * scale, rtol=TOL, atol=1e-300) for j in bad):
        if abs(scale - d) < TOL * d:
            return (f"after finish() every gradient is {d} times the mean: the all-reduce sums over the d = {d} "
                    "ranks; divide by d (before or after it) for the mean")
        if abs(scale - 1 / d) < TOL:
            return (f"after finish() every gradient is the mean divided by d = {d} once more (1/d²): divide the "
                    "sum by d once, before or after the all-reduce, not both")
        return (f"after finish() every gradient is {scale:.4g}× the mean over the d = {d} ranks: the all-reduce "
                f"sums the d gradients; divide by d = comm.size('dp') once")
    if mine[i] is None:
        return f"after finish() {names[i]}.grad is None: keep the gradients in .grad"
    return (f"after finish() {len(bad)} parameters' gradients (first {names[i]}) differ from the mean over "
            "the ranks: a bucket never all-reduced, or its result not copied back into .grad?")


def _watch() -> Tripwire:
    """The engine's own gradient synchronisation, watched while the learner's run trains."""
    from ..parallel import data

    return Tripwire({"minitron.parallel.data.BucketedDataParallel": data.BucketedDataParallel,
                     "minitron.parallel.data.FlatShards": data.FlatShards,
                     "minitron.parallel.data.NaiveDataParallel": data.NaiveDataParallel,
                     "minitron.parallel.data.make_data_parallel": data.make_data_parallel})


def _job(comm, source: str, timeout: float) -> dict | None:
    case = next(_CASE)
    with _watch().armed():  # the source's top level runs watched too
        cls = load(source, NAMES, learner_namespace())["BucketedGradSync"]
    verdicts = [_one_size(comm, cls, model, layout, train, f"{case}/{size}", timeout,
                          f"at a size the notebook does not show ({model.layers} layers of {model.hidden}, buckets "
                          f"of {layout.bucket_mb} MB, {train.microbatches} microbatches): " if size else "")
                for size, (model, layout, train) in enumerate([(MODEL, LAYOUT, TRAIN), HELD_OUT])]
    if verdicts[0] is None:  # not rank 0
        return None
    return next((v for v in verdicts if not v["ok"]), verdicts[0])


def _one_size(comm, cls, model, layout, train, key: str, timeout: float, where: str) -> dict | None:
    """The checks at one size: every step the overlap, the trace against the analysis and
    the gradients against the engine's; then the run against the single-device model.
    `where` leads every message (which size)."""
    from ..train import Trainer

    made = {}

    def factory(make, name):
        def build(params, c, lay, chunks):
            made[name] = _LookOut(make, params, c, lay)
            return made[name]
        return build

    ref = Trainer(model, layout, train, comm, data_parallel=factory(_engine, "engine"))
    ref_grads = []
    for i in range(train.steps):  # the engine's gradients of every step, to compare with
        ref.step(i)
        ref_grads.append(made["engine"].grads)
    comm.trace.records.clear()
    watch = _watch()
    tr, losses, numbers = None, [], {}
    for i in range(train.steps):  # every step: a hook or a counter that works only once fails
        try:
            with watch.armed():
                if tr is None:
                    tr = Trainer(model, layout, train, comm, data_parallel=factory(_make_learner(cls), "yours"))
                losses.append(tr.step(i))
            look = made["yours"]
            n = sum(p.numel() for p in look.params)
            e = look.params[0].element_size()
            problem = _overlap_problem(look.log, train.microbatches)
            if not problem:
                problem, got = _trace_problem(comm, tr, n, e, layout.bucket_mb, i)
                numbers = numbers or got
            if not problem:
                names = [p.shard.name for p in look.params]
                problem = _grad_problem(look.grads, ref_grads[i], names, comm.size("dp"))
            if problem and i > 0:
                problem = f"in step {i + 1} (step 1 was right): {problem}"
        except LabError as e:  # the learner's code raised, or ran the engine's own
            problem = str(e)
        agree(comm, f"bucketed-dp/{key}/{i}", where + problem if problem else "", timeout)
    res = versus_one_device(comm, tr, losses, model, train)
    verdict = training_verdict(res, "gradient sync", "your buckets fill in backward order, their all-reduces "
                               "overlap backward, carry the analysis' bytes, average over the ranks, and "
                               f"train on {layout.dp} ranks exactly like the single-device model, at the "
                               "notebook's size and at another one", TOL)
    if verdict is not None:
        verdict.update(numbers, overlapped=True, message=verdict["message"] if verdict["ok"] else where + verdict["message"])
    return verdict


def check_bucketed_dp_all(sources: list, timeout: float = 60) -> list[dict]:
    """`check_bucketed_dp` of several sources in as few launches as their outcomes allow."""
    return run_sources(_job, ParallelConfig(dp=LAYOUT.dp, device="cpu"), sources, timeout, timeout,
                       forbidden=FORBIDDEN, names=NAMES)


def check_bucketed_dp(source: str, timeout: float = 60) -> dict:
    """Lab 03a: the learner's `BucketedGradSync` on 3 data-parallel gloo ranks (float64), at
    the notebook's size and at a held-out one (``HELD_OUT``), every step: the all-reduces overlap backward (issued asynchronously from the
    hooks before the last gradient, waited for in finish), calls and bytes equal the
    analysis, the gradients after finish() are the mean the engine computes, and 2
    training steps equal the single-device model. Returns {"ok", "message", "calls",
    "bytes", "overlapped", "max_loss_abs_diff", "max_param_rel_diff"} or {"ok": False,
    "message"}."""
    try:
        return check_bucketed_dp_all([source], timeout)[0]
    except Exception as e:  # a surprise in the checker itself
        return fail(describe(e))
