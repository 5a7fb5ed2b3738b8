"""Lab 03c: one ZeRO-3 unit (Rajbhandari et al. 2020, stage 3, §5.3; PyTorch's FSDP; the
engine's ``--zero 3``: :class:`minitron.parallel.zero.ShardedDataParallel`).

A unit (a transformer block, or the root: embeddings, final norm, head) keeps its
parameters as one flat buffer ``full`` of n elements (n padded to a multiple of the d
data-parallel ranks), whose storage is *freed* between uses; rank r owns ``shard``, its
elements [r·k, (r+1)·k) with k = n/d, and the optimizer steps only that. The learner
writes the class ``Unit(comm, axis, shard, full)`` with the unit's four moments:

* ``before_forward()`` and ``before_backward()``: give ``full`` its storage back and
  all-gather every rank's shard into it (the backward needs the weights again: they were
  freed after the forward);
* ``after_forward()``: free ``full``'s storage;
* ``after_backward(grad)`` -> this rank's k elements of the *mean* gradient over the d
  ranks (``grad``: this rank's n-element gradient of the unit), by one reduce-scatter;
  then free ``full``.

The checker passes the class to the engine's ZeRO-3 (``ShardedDataParallel(unit=...)``,
nothing patched), trains a tiny GPT whose parameter sizes are not multiples of d on d = 4
gloo ranks (float64, 3 steps of 2 microbatches) and checks, at every moment of every unit:
the storage held (freed or whole), ``full`` against every rank's shard gathered aside
(a shard at the wrong offset is named), the calls issued (one all-gather of k elements;
one reduce-scatter of n, no all-reduce), each gradient shard against the true mean (the
sum, a mean divided twice, another rank's slice are named); then losses and parameters
against the single-device model. While the learner's unit trains, a profile hook watches
the code objects of the engine's own gathers, frees and reduce-scatters: reached by any
route (an import, ``importlib``, ``sys.modules``, an object found through ``gc``), they
are refused.

    result = check_zero3(SOURCE)   # {"ok", "message", "calls", ...}
"""
from __future__ import annotations

import sys
import uuid

import torch
import torch.distributed as dist

from ..config import ModelConfig, ParallelConfig, TrainConfig
from ..parallel.zero import ShardedDataParallel
from ..train import Trainer, zero_units
from .routes import changed, escape, snapshot
from .runner import TOL, YOUR_CODE, LabError, agree, call, comm_on, describe_calls, engine_piece, load, run_sources, \
    training_verdict, verdict_over_runs, versus_one_device
from .zero import close, divisor

# hidden 10, 2 heads of 5, a 9-token context: no parameter and no unit is a multiple of 4
MODEL = ModelConfig(layers=2, hidden=10, heads=2, seq_len=9, vocab=256, name="lab")
TRAIN = TrainConfig(steps=3, global_batch=8, microbatches=2, dtype="float64", warmup=1, progress=False,
                    eval_every=0, sample_tokens=0)
DP = 4  # the ranks of the launch
# the layouts each unit trains in, on the same 4 ranks: every rank a data-parallel rank, then 2
# data-parallel ranks x 2 tensor ranks (a mean hard-wired to 4, or taken over the world, is wrong there)
LAYOUTS = (ParallelConfig(dp=4, zero=3, device="cpu"), ParallelConfig(dp=2, tp=2, zero=3, device="cpu"))
NAMES = ("Unit",)
FORBIDDEN = ("minitron.parallel.zero",)  # the engine's ZeRO-2/3, read in the source before any rank starts
ENGINE_FILE = sys.modules[ShardedDataParallel.__module__].__file__
# the engine's own communication of a unit: with a unit passed in, none of it runs during a step
ENGINE_PIECE = {engine_piece(f"minitron.parallel.zero.ShardedDataParallel.{m}").__code__: f"ShardedDataParallel.{m}"
                for m in ("_gather", "_reduce", "_drain_one")}


GUARDED = ("minitron.labs.runner", "minitron.labs.routes", __name__)  # what the learner's code may not change


class EngineWatch:
    """While active (``with watch:``), a profile hook on this thread records the first call
    of the engine's own ZeRO-3 piece: one of ``ENGINE_PIECE``'s code objects, or any
    function of ``parallel/zero.py`` called while the learner's code is on the stack. It
    sees what actually ran, whatever route reached it."""

    def __init__(self):
        self.found = ""
        self.route = ""  # a route around the watch taken (routes.escape, a patched checker): its line

    def _hook(self, frame, event, arg):
        if self.found:
            return
        escaped = escape(frame, event, arg, YOUR_CODE, __file__)
        if escaped:
            self.found, self.route = escaped, f"your code {escaped}: the checker grades what runs where it watches"
        if event != "call" or self.found:
            return
        code = frame.f_code
        if code in ENGINE_PIECE:
            self.found = ENGINE_PIECE[code]
        elif code.co_filename == ENGINE_FILE:
            f = frame.f_back
            while f is not None and f.f_code.co_filename != YOUR_CODE:
                f = f.f_back
            if f is not None:
                self.found = f"{getattr(code, 'co_qualname', code.co_name)} (called from your {f.f_code.co_name})"

    def __enter__(self):
        self._old, self._installed = sys.getprofile(), self._hook  # (a bound method is new at each access)
        self._before = snapshot(GUARDED)
        sys.setprofile(self._installed)
        return self

    def __exit__(self, *exc):
        still = sys.getprofile() is self._installed
        sys.setprofile(self._old)
        patched = changed(GUARDED, self._before)
        if patched and not self.found:
            self.found, self.route = patched, f"your code changed the checker's own {patched}: leave the checker alone"
        if not still and not self.found:
            self.found = "(the checker's watch was switched off: sys.setprofile)"

    def problem(self) -> str:
        if self.route:
            return self.route
        return (f"your code runs the engine's own ZeRO-3, {self.found}: the lab asks you to gather, free "
                f"and reduce-scatter the unit yourself" if self.found else "")


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


class _Checked:
    """What the engine gets in place of a unit: the learner's ``Unit`` plus the checks of
    each moment (the ranks agree on the first problem through the rendezvous store)."""

    def __init__(self, comm, axis, shard, full, *, learner, watch: EngineWatch, token: str, index: int):
        self.comm, self.axis, self.shard, self.full = comm, axis, shard, full
        self.watch, self.token, self.u, self.count = watch, token, index, 0
        self.d, self.r = comm.size(axis), comm.index(axis)
        self.n, self.k, self.e = full.numel(), shard.numel(), full.element_size()
        self.calls: list = []
        self.mine = call("Unit", learner, comm, axis, shard, full)

    def _run(self, moment: str, *args):
        self.count += 1
        start = len(self.comm.trace.records)
        out = call(f"Unit.{moment}", getattr(self.mine, moment), *args)
        calls = self.comm.trace.records[start:]
        self.calls += [(moment, c["op"], c["bytes"]) for c in calls]
        return out, calls

    def _agree(self, moment: str, problem: str) -> None:
        problem = self.watch.problem() or problem
        agree(self.comm, f"{self.token}/{self.u}/{moment}/{self.count}", problem, 30)

    def _unit(self) -> str:
        return f"unit {self.u} (n = {self.n} elements, k = {self.k} per rank)"

    # --- the moments ---------------------------------------------------------------------------------
    def _gathered(self, moment: str) -> None:
        _, calls = self._run(moment)
        self._agree(moment, self._check_gathered(moment, calls))

    def before_forward(self) -> None:
        self._gathered("before_forward")

    def before_backward(self) -> None:
        self._gathered("before_backward")

    def after_forward(self) -> None:
        _, calls = self._run("after_forward")
        problem = ""
        if _storage(self.full) > 0:
            problem = (f"Unit.after_forward kept {self._unit()} gathered ({_storage(self.full)} bytes): free "
                       f"`full`'s storage after the forward (resize it to 0), ZeRO-3 keeps only the 1/d shard "
                       f"between uses")
        elif calls:
            problem = f"Unit.after_forward issued {describe_calls(calls)}: freeing needs no communication"
        self._agree("after_forward", problem)

    def after_backward(self, grad):
        truth = grad.clone()  # the mean over the ranks, aside (a plain all-reduce: not traced)
        dist.all_reduce(truth, group=self.comm.group(self.axis))
        truth /= self.d
        local = grad.clone()
        out, calls = self._run("after_backward", grad)
        problem = self._check_grad(out, calls, truth, local)
        if not problem and _storage(self.full) > 0:
            problem = (f"Unit.after_backward left {self._unit()} gathered: free `full` once its gradient is "
                       f"reduce-scattered (ZeRO-3 frees a unit after its backward)")
        self._agree("after_backward", problem)
        return out.reshape(-1).to(grad.dtype)

    # --- the checks -------------------------------------------------------------------------------------
    def _check_gathered(self, moment: str, calls) -> str:
        if _storage(self.full) < self.n * self.e:
            if moment == "before_backward":
                return (f"Unit.before_backward left {self._unit()} freed: gather it again before the backward "
                        f"(after_forward freed it, and the backward needs the weights for the input's gradient)")
            return (f"Unit.before_forward left {self._unit()} freed: give `full` its storage back "
                    f"(resize it to n * element_size bytes) and all-gather every rank's shard into it")
        truth = torch.empty(self.n, dtype=self.full.dtype)  # every rank's shard, gathered aside
        dist.all_gather_single(truth, self.shard.contiguous(), group=self.comm.group(self.axis))
        full, k = self.full.detach().reshape(-1), self.k
        if not torch.equal(full, truth):
            for j in range(self.d):
                seg = truth[j * k:(j + 1) * k]
                if torch.equal(full[j * k:(j + 1) * k], seg):
                    continue
                for i in range(self.d):
                    if i != j and torch.equal(full[i * k:(i + 1) * k], seg):
                        return (f"Unit.{moment}: rank {j}'s shard is at elements [{i * k}, {(i + 1) * k}) of "
                                f"`full`; rank j's k = {k} elements belong at [j*k, (j+1)*k)")
            if torch.equal(full[self.r * k:(self.r + 1) * k], truth[self.r * k:(self.r + 1) * k]):
                return (f"Unit.{moment}: `full` holds this rank's shard but not the others': all-gather every "
                        f"rank's shard")
            err = float((full - truth).abs().max())
            return f"Unit.{moment}: `full` differs from every rank's shard gathered by up to {err:.3g}"
        ops = [(c["op"], c["axis"], c["bytes"]) for c in calls]
        if ops != [("all_gather", self.axis, k * self.e)]:
            return (f"Unit.{moment} issued {describe_calls(calls)}: gathering a unit is one all-gather of this "
                    f"rank's k = {k} elements on '{self.axis}'")
        return ""

    def _check_grad(self, out, calls, truth, local) -> str:
        k, r = self.k, self.r
        if not isinstance(out, torch.Tensor) or out.numel() != k:
            what = f"{out.numel()} elements" if isinstance(out, torch.Tensor) else repr(out)[:40]
            return (f"Unit.after_backward returned {what} for {self._unit()} on d = {self.d} ranks: return this "
                    f"rank's k = {k} elements of the mean gradient")
        if any(c["op"] == "all_reduce" for c in calls):
            return (f"Unit.after_backward all-reduces the gradient ({describe_calls(calls)}): a reduce-scatter "
                    f"moves half the bytes and leaves each rank only the shard it updates")
        ops = [(c["op"], c["axis"], c["bytes"]) for c in calls]
        if [op for op, _, _ in ops] == ["reduce_scatter"] and ops[0][1] != self.axis:
            other = ops[0][1]
            return (f"Unit.after_backward reduce-scatters over '{other}' ({self.comm.size(other)} ranks): the "
                    f"wrong group; the mean is over the unit's data-parallel ranks, `axis` = '{self.axis}' "
                    f"(d = {self.d} here)")
        if ops != [("reduce_scatter", self.axis, self.n * self.e)]:
            return (f"Unit.after_backward issued {describe_calls(calls)}: one reduce-scatter of the unit's "
                    f"n = {self.n} elements on '{self.axis}'")
        got, want = out.detach().reshape(-1).to(truth.dtype), truth[r * k:(r + 1) * k]
        if close(got, want):
            return ""
        if close(got, want * self.d):
            why = "it is the sum over the ranks, not the mean: divide by d (once, before or after the reduce-scatter)"
        elif (c := divisor(got, want, self.d)) and c == self.d ** 2 and c != self.comm.grid.world:
            why = "it is the mean divided by d a second time: divide by d once"
        elif c:
            why = (f"it is the sum divided by {c}, not by d = {self.d}: the mean divides by the size of the "
                   f"unit's data-parallel group, comm.size(axis) (a d hard-wired to {c}, or another group's size?)")
        elif any(close(got, truth[j * k:(j + 1) * k]) for j in range(self.d) if j != r):
            j = next(j for j in range(self.d) if j != r and close(got, truth[j * k:(j + 1) * k]))
            why = f"it is rank {j}'s slice of the mean: rank r owns elements [r*k, (r+1)*k) of the unit"
        elif close(got, local[r * k:(r + 1) * k]) or close(got, local[r * k:(r + 1) * k] / self.d):
            why = "it holds only this rank's own gradient: reduce (sum) over the data-parallel ranks"
        else:
            why = f"it differs from this rank's slice of the mean by up to {float((got - want).abs().max()):.3g}"
        return f"Unit.after_backward on rank {r}, {self._unit()}: {why}"


def _train(comm, layout: ParallelConfig, ns: dict, token: str) -> dict | None:
    """Train the tiny GPT on `layout` under the engine's ZeRO-3 with the learner's unit (handed
    in through the Trainer's ``data_parallel=`` factory, which receives the model chunks the
    units are made of): rank 0 gets the comparison with the single-device model, with the
    units and their calls."""
    watch, counter = EngineWatch(), iter(range(10 ** 6))

    def unit(c, axis, shard, full):
        return _Checked(c, axis, shard, full, learner=ns["Unit"], watch=watch, token=token, index=next(counter))

    def zero3(params, c, lay, chunks):
        return ShardedDataParallel([u for ch in chunks for u in zero_units(ch)], c, 3, unit=unit)

    tr = Trainer(MODEL, layout, TRAIN, comm, data_parallel=zero3)
    with watch:
        losses = [tr.step(i) for i in range(TRAIN.steps)]
    agree(comm, f"{token}/end", watch.problem(), 30)
    units = tr.dp.unit_ops
    res = versus_one_device(comm, tr, losses, MODEL, TRAIN.replace(microbatches=TRAIN.microbatches * layout.dp))
    if res is not None:
        res.update(units=[{"n": u.n, "k": u.k} for u in units],
                   calls=sorted({(m, op, b) for u in units for m, op, b in u.calls}))
    return res


def _zero3_job(comm, source: str) -> dict | None:
    with EngineWatch() as early:  # the source's top level runs watched too
        ns = load(source, NAMES, {"torch": torch})
    if early.problem():
        raise LabError(early.problem())
    token = [uuid.uuid4().hex[:8] if comm.grid.rank == 0 else None]  # one key per case, the same on every rank
    dist.broadcast_object_list(token, src=0)  # (untraced: the checker's, not the learner's)
    verdicts = []
    for i, layout in enumerate(LAYOUTS):
        flags = f"--dp {layout.dp}" + (f" --tp {layout.tp}" if layout.tp > 1 else "")
        try:
            res = _train(comm_on(comm, layout), layout, ns, f"z3-{token[0]}-{i}")
        except LabError as e:  # a unit's check is said with the layout it failed on; the engine's piece is not
            raise (e if str(e).startswith("your code") else LabError(f"{flags}: {e}")) from None
        verdicts.append((flags, training_verdict(res, "ZeRO-3 unit", "", TOL)))
    if comm.grid.rank != 0:
        return None
    out = verdict_over_runs(verdicts, "your ZeRO-3 unit trains exactly like the single-device model on 4 data-"
                                      "parallel ranks and on 2 (x 2 tensor ranks): gathered before each forward and "
                                      "backward, freed after, gradients reduce-scattered")
    layouts = [{k: x for k, x in v.items() if k not in ("units", "calls")} for _, v in verdicts]  # copies: no cycle
    out.update(layouts=layouts, units=verdicts[0][1]["units"], calls=verdicts[0][1]["calls"])
    return out


def check_zero3_all(sources: list[str], timeout: float = 90) -> list[dict]:
    """`check_zero3` for several sources, in as few launches as their outcomes allow."""
    return run_sources(_zero3_job, ParallelConfig(dp=DP, device="cpu"), sources, timeout,
                       forbidden=FORBIDDEN, names=NAMES)


def check_zero3(source: str, timeout: float = 90) -> dict:
    """Lab 03c: train a tiny GPT on 4 gloo ranks (float64, 3 steps) under the engine's ZeRO-3
    with the learner's ``Unit`` doing every unit's gathers, frees and gradient reduce-scatter,
    twice: ``--dp 4``, then ``--dp 2 --tp 2`` (a mean hard-wired to one d, or taken over the
    wrong group, fails there); check each moment (storage held, values gathered, calls, the
    gradient shard) and each run against the single-device model. Returns {"ok", "message",
    "units", "calls", "max_loss_abs_diff", "max_param_rel_diff", "layouts", ...} ("units" and
    "calls" of the --dp 4 run), or {"ok": False, "message"} naming the first problem."""
    return check_zero3_all([source], timeout)[0]
