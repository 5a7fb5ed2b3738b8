"""Lab 11c: the experts' all-to-all hidden under their computation (DeepSeek-V3, arXiv
2412.19437 §3.2.1; the engine's ``minitron.parallel.expert_overlap``, ``--ep-overlap``).

The learner writes ``overlapped_dispatch(tokens, experts, gates, keep, num_experts, comm,
run_experts)``, ``token_dispatch``'s contract (lab 11a), with each all-to-all of rows in two
halves *by local expert* (every ep rank's experts ``[0, a)`` and ``[a, E/ep)``): both halves'
dispatches posted, half 1's waited, its experts run while half 2's rows travel, half 1's
combine posted, half 2's dispatch waited, its experts run while half 1's combine travels,
then both combines waited and the rows un-permuted. SOURCE is given lab 11a's pieces
(``permute``, ``Dispatch``, ``by_expert``, ``unpermute``) and the async all-to-all inside
autograd (``Flight``, ``Post``, ``Wait``: a post's backward waits, a wait's backward posts).

On 4 gloo ranks, ``--ep 4`` with 12 experts (3 a rank: halves of 1 and 2) and ``--ep 2
--dp 2`` with 10 (5 a rank) over the same ranks, each rank's tokens of a routing every rank
knows (a different number per rank, uneven counts, an idle expert, dropped choices), the
experts the checker's own matrices, through a watched Comm that logs each all-to-all posted,
each wait and each start of ``run_experts``, in order. Checked, in order:

1. every all-to-all on 'ep' (the wrong group named before it is issued), the rows and split
   sizes of each adding up and agreeing between the ranks (compared through the rendezvous
   store before it is issued, so that a mis-split never reaches gloo), none blocking;
2. ``run_experts`` called once per half, with the counts of all E/ep local experts (zero
   outside the half), each local expert's rows exactly its tokens and all in one half;
3. the order: half 1's experts run while half 2's dispatch is in flight (posted before,
   waited after), half 2's while half 1's combine is (waiting at once, half 2's dispatch
   posted late, both dispatches waited first, half 1's combine posted late or waited before
   the second half's experts named); every posted all-to-all waited;
4. the output and the gradients of tokens and gates against the gate-weighted sum of the
   checker's experts;
5. the bytes on 'ep' of forward and backward equal to the plain ``token_dispatch``'s on the
   same data (the counts exchanged once; the same rows in two messages instead of one).

The ranks agree on the first problem; otherwise the function is handed to the engine
(``Trainer(layers=...)``, a layer namespace carrying it) and a small mixture of experts
trains for 2 float64 steps on ``--ep 2 --dp 2 --ep-overlap`` (6 experts) and ``--ep 4
--ep-overlap`` (8 experts, a capacity factor: tokens dropped) against the single-device
model, and each rank's traced first step against the analysis: on 'ep' the plain layout's bytes
(from the step's routing counts, ``analysis.experts``) in ``all_to_all_calls(ep_overlap=True)``
calls per MoE block. A profile hook refuses the engine's own overlapped dispatch while the
learner's code runs.

    result = check_overlapped_dispatch(SOURCE)   # {"ok", "message", "max_loss_abs_diff", ...}
"""
from __future__ import annotations

import datetime
import itertools
import json
from types import SimpleNamespace

import torch

from ..analysis.comm import comm_bytes_per_step
from ..analysis.experts import all_to_all_calls, moe_blocks
from ..config import PRESETS, ParallelConfig, TrainConfig
from ..parallel.expert_overlap import Flight, Post, Wait
from ..parallel.experts import Dispatch, by_expert, permute, token_dispatch, unpermute
# lab 11a's rows of 6, top-2, experts that are the checker's own matrices and their gate-weighted sum
from .dispatch import H, K, _expert_weight, _sorted_rows, _want_y
from ..tools.testing import routed_all_to_all_bytes, traced_step_bytes
from .runner import (TOL, LabError, Tripwire, agree, call, comm_on, layout_flags, run_sources,
                     training_verdict, verdict_over_runs, versus_one_device, watched)

NAME = "overlapped_dispatch"
FORBIDDEN = ("minitron.parallel.expert_overlap",)
WATCHED = ("minitron.parallel.expert_overlap.overlapped_token_dispatch", "minitron.parallel.expert_overlap.halves")
GIVEN = {"torch": torch, "permute": permute, "Dispatch": Dispatch, "by_expert": by_expert, "unpermute": unpermute,
         "Flight": Flight, "Post": Post, "Wait": Wait}
WORLD = 4
# the unit checks: (layout, experts): 3 and 5 experts a rank, halves of unequal size
UNITS = ((ParallelConfig(ep=4, device="cpu"), 12), (ParallelConfig(ep=2, dp=2, device="cpu"), 10))
MODEL = PRESETS["moe-tiny"].replace(layers=1, experts=6, seq_len=16, name="lab-ep-overlap")
TRAIN = TrainConfig(steps=2, global_batch=4, dtype="float64", lr=1e-2, warmup=1, progress=False, eval_every=0,
                    sample_tokens=0)
RUNS = ((ParallelConfig(ep=2, dp=2, ep_overlap=True, device="cpu"), MODEL),
        (ParallelConfig(ep=4, ep_overlap=True, device="cpu"), MODEL.replace(experts=8, capacity_factor=1.0)))
HOW = ("post both halves' dispatches, wait for half 1's, run its experts while half 2's travels, post half 1's "
       "combine, wait for half 2's dispatch, run its experts while half 1's combine travels")
_CASE = itertools.count()  # the case number in this launch: the same on every rank


# --- the checker's data: every rank's routing, from seeds ------------------------------------------
def _routing(seed: int, rank: int, experts: int):
    """Rank `rank`'s tokens [T, H], choices [T, K], gates and keep mask: T differs per rank,
    the last expert is never chosen, a few choices dropped."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    tokens = 7 + 3 * rank + seed
    x = torch.randn(tokens, H, generator=g, dtype=torch.float64)
    weights = torch.rand(experts, generator=g) + 0.5
    weights[-1] = 0
    choice = torch.multinomial(weights.expand(tokens, experts), K, replacement=False, generator=g)
    gates = torch.rand(tokens, K, generator=g, dtype=torch.float64) + 0.1
    keep = torch.rand(tokens, K, generator=g) > 0.15
    return x, choice, gates, keep


# --- what the learner's call did, in order ------------------------------------------------------
class _Pending:
    """An all-to-all in flight (the Comm's Pending) whose ``wait`` the log sees."""

    def __init__(self, pending, i: int, log: list):
        self._pending, self._i, self._log, self.waited = pending, i, log, False

    def wait(self):
        if not self.waited:
            self.waited = True
            self._log.append(("wait", self._i))
        return self._pending.wait()

    def __getattr__(self, name):
        return getattr(self._pending, name)


class _Watched:
    """The Comm the unit checks hand the learner: the real one (every byte through it, traced),
    each all-to-all of rows logged ('post', i, async?) and its Pending's wait ('wait', i); a
    call on another axis, or with rows and split sizes that do not add up or that the ranks
    disagree on, refused before it is issued."""

    def __init__(self, comm, key: str, timeout: float):
        self._comm, self.key, self.timeout = comm, key, timeout
        self.log, self.pendings, self.posts = [], [], 0

    def all_to_all(self, t, axis, send_splits=None, recv_splits=None, activation=False, async_op=False):
        if axis != "ep":
            raise LabError(f"your all-to-all runs on '{axis}', not on 'ep': the experts are split over the ep "
                           f"group (Flight(comm, 'ep', send, recv)); the '{axis}' ranks hold the same experts")
        if t.dim() < 2:  # the counts
            return self._comm.all_to_all(t, axis, send_splits, recv_splits, activation=activation, async_op=async_op)
        i, self.posts = self.posts, self.posts + 1
        self._agree_sizes(i, t.shape[0], send_splits, recv_splits)
        self.log.append(("post", i, bool(async_op)))
        out = self._comm.all_to_all(t, axis, send_splits, recv_splits, activation=activation, async_op=async_op)
        if not async_op:
            self.log.append(("wait", i))
            return out
        self.pendings.append(_Pending(out, i, self.log))
        return self.pendings[-1]

    def _agree_sizes(self, i: int, rows: int, send, recv) -> None:
        """Every rank of this ep group posts its rows and split sizes to the store and reads
        its peers': the same verdict on each, before the call is issued (gloo would abort the
        process on a mismatch; a rank that refused alone would leave its peers waiting)."""
        from torch.distributed.distributed_c10d import _get_default_store

        store, c = _get_default_store(), self._comm
        group = "-".join(f"{a}{v}" for a, v in sorted(vars(c.grid.coord()).items()) if a != "ep")
        base, n = f"minitron-lab/{self.key}/{group}/a2a{i}/", c.size("ep")
        store.set(base + str(c.index("ep")), json.dumps([rows, *(None if v is None else [int(x) for x in v] for v in (send, recv))]))
        keys = [base + str(s) for s in range(n)]
        store.wait(keys, datetime.timedelta(seconds=max(3.0, self.timeout / 3)))
        sizes = [json.loads(store.get(k).decode()) for k in keys]
        for a, (rows_a, send_a, recv_a) in enumerate(sizes):
            if send_a is None or recv_a is None or sum(send_a) != rows_a:
                raise LabError(f"your all-to-all {i} sends {rows_a} rows with split sizes {send_a} on ep rank {a}: "
                               f"each half sends its own rows, as many to each ep rank as the half's experts there "
                               f"have counted (send and receive sizes given)")
        for a in range(n):
            for b in range(n):
                if sizes[a][1][b] != sizes[b][2][a]:
                    raise LabError(
                        f"the ranks' split sizes of your all-to-all {i} disagree: ep rank {a} sends {sizes[a][1][b]} "
                        f"rows to ep rank {b}, which expects {sizes[b][2][a]}: both sides of a half come from the "
                        f"same local experts' columns of the exchanged counts (send plan.sent_counts[:, lo:hi]"
                        f".sum(1), receive plan.received_counts[:, lo:hi].sum(1))")

    def settle(self) -> list[int]:
        """Wait for what the learner left in flight (the ranks stay in step); their numbers."""
        left = [p._i for p in self.pendings if not p.waited]
        for p in self.pendings:
            if not p.waited:
                p._pending.wait()
        return left

    def __getattr__(self, name):
        return getattr(self._comm, name)


class _Experts:
    """The checker's ``run_experts`` for one ep rank: local expert j multiplies by its own
    matrix. It logs each start and records (never raises: the peers are inside the same
    collectives) whether each call's rows are whole experts' tokens, in the right place."""

    def __init__(self, want_rows: list, local: range, log: list):
        self.want, self.local, self.log, self.given, self.problem = want_rows, local, log, [], ""

    def __call__(self, rows, counts):
        half = len(self.given)
        self.log.append(("experts", half))
        counts = [int(c) for c in counts]
        self.given.append(counts)
        n = len(self.local)
        if len(counts) != n or sum(counts) != rows.shape[0]:
            self.problem = self.problem or (
                f"run_experts of half {half + 1} got {rows.shape[0]} rows with counts {counts} for {n} local experts: "
                f"give it the counts of all E/ep = {n} local experts, zero outside the half (counts[j] rows for "
                f"local expert j), or its rows run through the wrong experts")
            return rows * 0
        outs = []
        for j, (part, want) in enumerate(zip(rows.split(counts), self.want)):
            if part.shape[0] and part.shape[0] != want.shape[0]:
                self.problem = self.problem or (
                    f"local expert {j} got {part.shape[0]} of its {want.shape[0]} rows in half {half + 1}: cut the "
                    f"halves by local expert (each expert's rows all in one half), not by token")
            elif part.shape[0] and not torch.equal(_sorted_rows(part.detach()), _sorted_rows(want)):
                self.problem = self.problem or (
                    f"half {half + 1}'s local expert {j} was given rows routed to other experts: regroup each half's "
                    f"arrival (source, expert) by its own experts (by_expert of the half's columns of the received "
                    f"counts)")
            outs.append(part @ _expert_weight(self.local[j]).t())
        return torch.cat(outs)

    def coverage(self) -> str:
        """'' when each local expert's rows ran exactly once over the calls, else the problem."""
        if self.problem:
            return self.problem
        if len(self.given) != 2:
            return (f"your dispatch ran the experts {len(self.given)} time(s): once per half, two (" + HOW + ")"
                    if self.given else "your dispatch never called run_experts")
        for j, want in enumerate(self.want):
            runs = sum(1 for counts in self.given if counts[j])
            if want.shape[0] and runs != 1:
                return f"local expert {j}'s rows ran in {runs} halves: each local expert's rows once, in its half"
        if any(sum(c) == 0 for c in self.given) and sum(w.shape[0] for w in self.want):
            return ("one of your halves carries no rows: it hides nothing; split the local experts in two, [0, a) and "
                    "[a, E/ep) with a = E/ep // 2")
        return ""


def _in_flight(log: list, at: int) -> list[int]:
    """The async all-to-alls posted before event `at` and waited after it (or never)."""
    posted = [e[1] for e in log[:at] if e[0] == "post" and e[2]]
    waited = {e[1] for e in log[:at] if e[0] == "wait"}
    return [i for i in posted if i not in waited]


def _order(log: list) -> str:
    """'' when each half's experts run under an all-to-all in flight, else the mistake."""
    blocking = [e[1] for e in log if e[0] == "post" and not e[2]]
    if blocking:
        return (f"your all-to-all {blocking[0]} blocks (comm.all_to_all without async_op, AllToAll, "
                f"Dispatch.dispatch or .combine): nothing runs while its rows travel; post it with "
                f"Post.apply(rows, Flight(comm, 'ep', send, recv)) and Wait.apply(token, flight) when you need them")
    first, second = (log.index(("experts", h)) for h in (0, 1))
    posts = [i for i, e in enumerate(log) if e[0] == "post"]
    if all(i + 1 < len(log) and log[i + 1] == ("wait", log[i][1]) for i in posts):
        return ("your dispatch waits for each all-to-all right after posting it (no overlap: the two halves run "
                "one after the other, every transfer exposed): " + HOW)
    if not _in_flight(log, first):
        if sum(1 for e in log[:first] if e[0] == "post") < 2:
            return ("half 2's dispatch is posted only after half 1's experts ran, so nothing travels under them: "
                    "post both halves' dispatches before running any expert")
        return ("both halves' dispatches are waited for before half 1's experts run, so nothing travels under them: "
                "wait only for half 1's rows, and for half 2's after half 1's experts")
    if not _in_flight(log, second):
        if not any(e[0] == "post" for e in log[first:second]):
            return ("half 1's combine is posted only after half 2's experts ran: post it as soon as half 1's "
                    "experts are done, so that it travels under half 2's")
        return ("half 1's combine is waited for before half 2's experts run (the combine before the second half's "
                "experts): wait for it after them, so that it travels under them")
    return ""


def _check(fn, comm, watch, key: str, experts: int, seed: int, timeout: float) -> str:
    """One overlapped call of the learner's `fn` on this rank (forward and backward), watched;
    '' or the first problem."""
    n, r = comm.size("ep"), comm.index("ep")
    data = [_routing(seed, s, experts) for s in range(n)]
    x, choice, gates, keep = data[r]
    e_local = experts // n
    local = range(r * e_local, (r + 1) * e_local)
    want_rows = [torch.cat([d[0][((d[1] == e) & d[3]).any(1)] for d in data]) for e in local]
    w = _Watched(comm, key, timeout)
    run = _Experts(want_rows, local, w.log)
    xs, gs = x.clone().requires_grad_(True), gates.clone().requires_grad_(True)
    mark = len(comm.trace.records)
    with watch.armed():
        y = call(f"your {NAME}", fn, xs, choice.clone(), gs, keep.clone(), experts, w, run)
    left = w.settle()
    problem = run.coverage() or _order(w.log)
    if problem:
        return problem
    if left:
        return f"your dispatch posts all-to-all(s) {left} and never waits for them: wait for each (Wait.apply)"
    want = _want_y(x, choice, gates, keep)
    if not isinstance(y, torch.Tensor) or y.shape != want.shape:
        return (f"your {NAME} returned {list(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__}: return "
                f"[T, h] = {list(want.shape)}, each token's gate-weighted sum of its kept experts' outputs")
    if not torch.allclose(y.detach(), want, rtol=1e-12, atol=1e-12):
        return (f"your {NAME}'s output on ep rank {r} differs from the experts' gate-weighted sum by "
                f"{float((y.detach() - want).abs().max()):.3g}: each half's outputs go back in its arrival order "
                f"(the inverse of its regrouping) and come home in its pairs' order; un-permute with those pairs")
    weight = torch.linspace(-1, 1, want.numel(), dtype=torch.float64).reshape(want.shape)
    with watch.armed():
        gx, gg = call(f"your {NAME}'s backward",
                      lambda: torch.autograd.grad((y * weight).sum(), (xs, gs), allow_unused=True))
    left = w.settle()
    xr, gr = x.clone().requires_grad_(True), gates.clone().requires_grad_(True)
    wx, wg = torch.autograd.grad((_want_y(xr, choice, gr, keep) * weight).sum(), (xr, gr))
    if gx is None or not torch.allclose(gx, wx, rtol=1e-10, atol=1e-12) or left:
        return (f"your {NAME}'s tokens get a wrong gradient on ep rank {r}: the rows must reach the experts through "
                f"Post.apply and Wait.apply (their backward is the all-to-all back), not the Pending's result")
    if gg is None or not torch.allclose(gg, wg, rtol=1e-10, atol=1e-12):
        return f"your {NAME}'s gates get a wrong gradient: weigh the outputs by the gates inside autograd (unpermute)"
    mine = comm.trace.records[mark:]
    return _same_bytes(mine, comm, data, r, experts, local)


def _same_bytes(mine, comm, data, r: int, experts: int, local: range) -> str:
    """The plain ``token_dispatch`` on the same rows (forward and backward) moves the same
    bytes on 'ep' as the learner's call did."""
    x, choice, gates, keep = data[r]
    xs, gs = x.clone().requires_grad_(True), gates.clone().requires_grad_(True)
    mark = len(comm.trace.records)
    run = lambda rows, counts: torch.cat([p @ _expert_weight(e).t() for p, e in zip(rows.split(list(counts)), local)])
    y = token_dispatch(xs, choice, gs, keep, experts, comm, run)
    torch.autograd.grad(y.sum(), (xs, gs))
    plain = comm.trace.records[mark:]
    if sum(r["bytes"] for r in mine) != sum(r["bytes"] for r in plain) or len(mine) != len(plain) + 4:
        got, want = sum(r["bytes"] for r in mine), sum(r["bytes"] for r in plain)
        counts = sum(1 for r in mine if len(r["shape"]) == 1)
        return (f"your call moves {got} bytes on 'ep' ({len(mine)} all-to-alls, {counts} of them counts) against the "
                f"plain dispatch's {want}: the halves carry the same rows, and the counts are exchanged once "
                f"(Dispatch: each half's sizes are its experts' columns of them)")
    return ""


def _trained(comm, fn, watch, timeout: float) -> list[tuple[str, dict | None]]:
    """The learner's dispatch in the engine's place, each of RUNS against the single-device
    model, its first step's trace against the analysis (:func:`_step_problem`)."""
    from ..comm import Comm, CommTrace
    from ..grid import ProcessGrid
    from ..parallel import tensor
    from ..train import Trainer

    def learners(*args):
        return call(f"your {NAME}", fn, *args)

    layers = SimpleNamespace(**{**vars(tensor.layers()), "token_dispatch": learners})
    out = []
    for layout, model in RUNS:
        g = ProcessGrid.for_layout(layout, comm.grid.rank).build_groups(timeout=datetime.timedelta(seconds=timeout))
        c = Comm(g, CommTrace())
        with watch.armed():
            tr = Trainer(model, layout, TRAIN, c, layers=layers)
            losses = [tr.step(0)]
            step0 = dict(coord=vars(g.coord()), calls=[d[0] for m in tr.moe for d in m.dispatches],
                         traced=traced_step_bytes(c.trace.records, comm.grid.rank, 0),
                         calls_on_ep=sum(r["op"] == "all_to_all" for r in c.trace.records if r["step"] == 0))
            losses += [tr.step(i) for i in range(1, TRAIN.steps)]
        ranks = comm.gather_object(step0)
        # the reference: one microbatch per data replica (the capacity's token set)
        res = versus_one_device(comm, tr, losses, model, TRAIN.replace(microbatches=layout.data_replicas))
        flags = layout_flags(layout) + " --ep-overlap"
        verdict = training_verdict(res, NAME, "", TOL)
        problem = _step_problem(ranks, model, layout) if ranks else ""
        out.append((flags, {"ok": False, "message": problem} if problem and verdict["ok"] else verdict))
    return out


def _step_problem(ranks: list[dict], model, layout) -> str:
    """'' when every rank's traced first step moved on 'ep' what the analysis says (the
    all-to-all from the step's routing counts: the plain layout's bytes) in
    ``all_to_all_calls(ep_overlap=True)`` calls per MoE block, else the first rank that did not."""
    want = comm_bytes_per_step(model, layout, TRAIN, pp_rank=0).get("ep", {})
    calls = all_to_all_calls(True) * len(moe_blocks(model)) * TRAIN.microbatches
    for r in ranks:
        expected = {**want, "all_to_all": routed_all_to_all_bytes(ranks, r, model, 8)}
        if r["traced"].get("ep") != expected or r["calls_on_ep"] != calls:
            return (f"your {NAME} passes the checks above, but in the engine's step ep rank {r['coord']['ep']} "
                    f"moved {r['traced'].get('ep')} on 'ep' in {r['calls_on_ep']} all-to-alls against the analysis' "
                    f"{expected} in {calls} (the plain layout's bytes, in two halves)")
    return ""


def _job(comm, source: str, timeout: float) -> dict | None:
    from .runner import load

    case = next(_CASE)
    watch = Tripwire(watched(*WATCHED))
    problem, ns = "", {}
    try:
        with watch.armed():
            ns = load(source, (NAME,), GIVEN)
    except LabError as e:
        problem = str(e)
    agree(comm, f"epov/{case}/load", problem, timeout)
    for i, (layout, experts) in enumerate(UNITS):
        c = comm if i == 0 else comm_on(comm, layout)
        try:
            problem = _check(ns[NAME], c, watch, f"epov/{case}/{i}", experts, i, timeout)
        except LabError as e:
            problem = str(e)
        where = f" ({layout_flags(layout)}, {experts} experts)"
        agree(comm, f"epov/{case}/{i}/done", problem and problem + where, timeout)
    runs = _trained(comm, ns[NAME], watch, timeout)
    if comm.grid.rank != 0:
        return None
    return verdict_over_runs(runs, f"your {NAME} hides each half's all-to-all under the other half's experts, "
                                   f"moves the plain layout's bytes and trains exactly like the single-device model "
                                   f"(--ep 2 --dp 2 and --ep 4, --ep-overlap)")


def check_overlapped_dispatch_all(sources: list[str], timeout: float = 60) -> list[dict]:
    """`check_overlapped_dispatch` for several sources, in as few launches as their outcomes allow."""
    return run_sources(_job, UNITS[0][0], sources, timeout, timeout, forbidden=FORBIDDEN, names=(NAME,))


def check_overlapped_dispatch(source: str, timeout: float = 60) -> dict:
    """Lab 11c: check `overlapped_dispatch` defined in `source` on 4 gloo ranks (--ep 4 with
    12 experts, then --ep 2 --dp 2 with 10): the all-to-alls on 'ep', asynchronous, split by
    local expert, each half's experts run while the other half's all-to-all is in flight, the
    output and gradients, the plain dispatch's bytes; then train a small mixture of experts
    with it in the engine's place (--ep 2 --dp 2 and --ep 4 with a capacity, --ep-overlap,
    float64, 2 steps) against the single-device model. Returns {"ok", "message",
    "max_loss_abs_diff", "max_param_rel_diff"}, or {"ok": False, "message"} naming the first
    problem (also when the code does not compile, is a stub, uses the engine's own overlapped
    dispatch, raises or runs past `timeout` seconds)."""
    return check_overlapped_dispatch_all([source], timeout)[0]
