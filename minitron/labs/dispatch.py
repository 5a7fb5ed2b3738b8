"""Lab 11a: token dispatch for expert parallelism (GShard, Lepikhin et al. 2021 §2.2; the
engine's ``minitron.parallel.experts.token_dispatch``).

Under ``--ep n`` ep rank r holds experts [r·E/n, (r+1)·E/n) and routes its own tokens. The
learner writes the four moves of one MoE layer:

* ``permute(experts, keep, num_experts) -> (order, counts)``: the kept (token, choice) pairs
  (indices into the flattened [T·k] choices) sorted by expert, and the kept choices per
  expert (E counts);
* ``exchange_counts(counts, comm) -> received`` [n, E/n]: row s is what ep rank s sends to
  each of this rank's experts (one all-to-all of the counts on 'ep');
* ``AllToAll`` / ``all_to_all(x, comm, send, recv)``: the rows of x in blocks of ``send[s]``
  to each rank s, ``recv[s]`` from each; its backward is the same exchange with the split
  sizes swapped;
* ``dispatch_tokens(tokens, experts, gates, keep, num_experts, comm, run_experts) -> y``:
  permute, exchange the counts, send the rows, regroup what arrives (grouped by source rank,
  then expert) by local expert, ``run_experts(rows, counts)``, send the outputs back and
  un-permute: each token's gate-weighted sum of its kept experts' outputs.

On 4 gloo ranks (``--ep 4``, 8 experts: uneven counts, an expert that receives no token,
dropped choices, two routings), each piece is checked against the checker's own arithmetic
(every rank's tokens are known to every rank from the seeds; the experts are the checker's
matrices, so the right answer needs no communication), with the usual mistakes named;
then ``dispatch_tokens`` is handed to the engine (``Trainer(layers=...)`` with a layer
namespace carrying it; nothing patched) and a small mixture of experts trains for 3
float64 steps under ``--ep 2 --dp 2`` and ``--ep 4`` (a capacity factor: tokens dropped)
against the single-device model (1e-9). A profile hook refuses the engine's own dispatch
(``minitron.parallel.experts``) whatever the route, while the learner's code runs.

    result = check_dispatch(SOURCE)   # {"ok", "message", "max_loss_abs_diff", "max_param_rel_diff"}
"""
from __future__ import annotations

import datetime
import itertools
import math
from types import SimpleNamespace

import torch

from ..config import PRESETS, ParallelConfig, TrainConfig
from ..parallel import experts as engine_experts
from .runner import (TOL, LabError, Tripwire, agree, call, comm_on, describe_calls, run_sources, traced, training_verdict,
                     verdict_over_runs, versus_one_device)

NAMES = ("permute", "exchange_counts", "all_to_all", "dispatch_tokens")
FORBIDDEN = ("minitron.parallel.experts", "minitron.labs.dispatch")
WORLD = 4
E, H, K = 8, 6, 2  # the unit checks: 8 experts, rows of 6, top-2
MODEL = PRESETS["moe-tiny"].replace(experts=8, seq_len=16, name="lab-dispatch")
TRAIN = TrainConfig(steps=3, global_batch=4, dtype="float64", lr=1e-2, warmup=1, progress=False, eval_every=0,
                    sample_tokens=0)
RUNS = ((ParallelConfig(ep=2, dp=2, device="cpu"), MODEL),
        (ParallelConfig(ep=4, device="cpu"), MODEL.replace(capacity_factor=1.0)))
_CASE = itertools.count()  # the case number in this launch: the same on every rank


def _watch() -> Tripwire:
    """Armed only while the learner's code runs: the engine's dispatch module, the checker."""
    return Tripwire({"minitron.parallel.experts": engine_experts, "minitron.labs.dispatch": _want_y,
                     "minitron.labs.dispatch.counts": _counts, "minitron.labs.dispatch.routing": _routing})


def _learner(watch: Tripwire, what: str, fn, *args):
    with watch.armed():
        return call(what, fn, *args)


# --- the checker's data: every rank's routing, from seeds ------------------------------------------
def _routing(seed: int, rank: int, tokens: int):
    """Rank `rank`'s tokens [T, H], choices [T, K], gates and keep mask of routing `seed`:
    skewed toward the low experts, expert 5 never chosen, a few choices dropped."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(tokens, H, generator=g, dtype=torch.float64)
    weights = torch.tensor([6.0, 1, 3, 1, 2, 0, 1, 4]) * (1 + seed * torch.arange(E) % 3)
    experts = torch.multinomial(weights.expand(tokens, E), K, replacement=False, generator=g)
    gates = torch.rand(tokens, K, generator=g, dtype=torch.float64) + 0.1
    keep = torch.rand(tokens, K, generator=g) > 0.15
    return x, experts, gates, keep


def _expert_weight(e: int) -> torch.Tensor:
    return torch.randn(H, H, generator=torch.Generator().manual_seed(77 + e), dtype=torch.float64) / H ** 0.5


def _counts(experts, keep) -> torch.Tensor:
    return torch.bincount(experts[keep], minlength=E)


class _Experts:
    """The checker's ``run_experts`` for ep rank r: expert e multiplies by its own matrix.
    It records (never raises: the other ranks are inside the same collectives) whether the
    rows it was given are exactly, as multisets, the tokens routed to each local expert."""

    def __init__(self, want_rows: list, local: range):
        self.want, self.local, self.problem, self.calls = want_rows, local, "", 0

    def __call__(self, rows, counts):
        self.calls += 1
        counts = [int(c) for c in counts]
        if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or sum(counts) != rows.shape[0]:
            self.problem = self.problem or (
                f"run_experts got {list(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__} rows "
                f"with counts {counts} that do not add up: pass the received rows grouped by local expert and "
                f"their count per local expert")
            return torch.zeros_like(rows) if isinstance(rows, torch.Tensor) else rows
        want_counts = [w.shape[0] for w in self.want]
        if counts != want_counts:
            self.problem = self.problem or (
                f"your local experts {list(self.local)} were given {counts} rows, want {want_counts} (every rank's "
                f"kept choices of them): the receive sizes come from the exchanged counts")
        else:
            self.problem = self.problem or self._rows_problem(rows.detach().split(counts))
        parts = rows.split(counts) if counts == want_counts else [rows[:0]] * len(self.local)
        outs = [p @ _expert_weight(e).t() for p, e in zip(parts, self.local)]
        return torch.cat(outs) if counts == want_counts else torch.zeros_like(rows)


    def _rows_problem(self, parts) -> str:
        """'' when each local expert got exactly its tokens (as a multiset), else the mistake:
        rows of other local experts (arrival not regrouped), or tokens scaled (gated too early)."""
        bad = next((j for j, (got, want) in enumerate(zip(parts, self.want))
                    if not torch.equal(_sorted_rows(got), _sorted_rows(want))), None)
        if bad is None:
            return ""
        everything, wanted = torch.cat(parts), torch.cat(self.want)
        if torch.equal(_sorted_rows(everything), _sorted_rows(wanted)):
            return (f"expert {self.local[bad]} was given rows routed to other experts: rows arrive grouped by "
                    f"source rank, then by expert; regroup them by local expert (expert-major) before run_experts")
        if _same_directions(everything, wanted):
            return ("the experts were given the tokens multiplied by their gates: the gates weigh the experts' "
                    "outputs in the combine (y = sum of g * expert(x)), not the rows sent to the experts")
        return (f"expert {self.local[bad]} was given rows that are not the tokens routed to it: send the "
                f"tokens themselves, in the order permute gives")


def _same_directions(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The rows of `a` and `b` are, as multisets, the same up to a positive factor each."""
    if a.shape != b.shape or not a.shape[0]:
        return False
    unit = lambda m: _sorted_rows(m / m.norm(dim=1, keepdim=True).clamp_min(1e-300))
    return bool(torch.allclose(unit(a), unit(b), rtol=TOL, atol=1e-12))


def _sorted_rows(rows: torch.Tensor) -> torch.Tensor:
    return rows[torch.argsort(rows[:, 0])] if rows.shape[0] else rows


def _want_y(x, experts, gates, keep, weighted=True, drop=True):
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(K):
            if keep[t, j] or not drop:
                y[t] += (gates[t, j] if weighted else 1.0) * (_expert_weight(int(experts[t, j])) @ x[t])
    return y


# --- the unit checks -------------------------------------------------------------------------
def _check_permute(fn, watch, experts, keep) -> str:
    got = _learner(watch, "your permute", fn, experts.clone(), keep.clone(), E)
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(g, torch.Tensor) for g in got)):
        return f"your permute returned {type(got).__name__}: return (order, counts), two tensors"
    order, counts = (g.long().flatten() for g in got)
    flat, kept = experts.flatten(), keep.flatten()
    want_counts = _counts(experts, keep)
    if counts.tolist() == torch.bincount(flat, minlength=E).tolist() and not kept.all():
        return ("your permute counts every choice, also those dropped by the capacity (keep False): count and "
                "order only the kept ones")
    if counts.tolist() != want_counts.tolist():
        return f"your permute's counts {counts.tolist()}, want {want_counts.tolist()} (kept choices per expert)"
    if sorted(order.tolist()) != kept.nonzero().flatten().tolist():
        return ("your permute's order is not the kept choices, each once: indices into the flattened [T·k] "
                "choices where keep is True")
    if flat[order].tolist() != sorted(flat[order].tolist()):
        return ("your permute's order is not grouped by expert: sort the kept choices by expert, so that the "
                "rows for each destination rank are one contiguous block")
    return ""


def _check_exchange(fn, comm, watch, all_counts, r, n) -> str:
    counts = all_counts[r].clone()
    got, calls = traced(comm, _learner, watch, "your exchange_counts", fn, counts, comm)
    want = torch.stack([c.view(n, E // n)[r] for c in all_counts])
    if not isinstance(got, torch.Tensor) or got.numel() != want.numel():
        return (f"your exchange_counts returned {type(got).__name__ if not isinstance(got, torch.Tensor) else list(got.shape)}:"
                f" return [ep, E/ep] = {list(want.shape)}, row s what rank s sends to each of your experts")
    if tuple(got.shape) != tuple(want.shape):
        return (f"your exchange_counts returned shape {list(got.shape)} on --ep {n}: return [ep, E/ep] = "
                f"{list(want.shape)}, one row per source rank (transposed, or shaped for another ep?)")
    got = got.reshape(want.shape).long()
    if torch.equal(got, all_counts[r].view(n, E // n)):
        return ("your exchange_counts returns this rank's own counts: the counts were not exchanged; every rank "
                "needs what each other rank sends to its experts (an all-to-all of the E counts on 'ep')")
    if torch.equal(got, want.t().reshape(want.shape)) and not torch.equal(got, want):
        return "your exchange_counts mixes up sources and experts: row s is what rank s sends, one column per local expert"
    if not torch.equal(got, want):
        return f"your exchange_counts gives rank {r} {got.tolist()}, want {want.tolist()}"
    ops = [(c["op"], c["axis"], math.prod(c["shape"])) for c in calls]
    if ops != [("all_to_all", "ep", E)]:  # the E counts, in whatever dtype
        gathered = any(c["op"] == "all_gather" for c in calls)
        return (f"your exchange_counts communicates {describe_calls(calls)}"
                + (": gathering every rank's counts moves ep times the bytes (each rank needs only what is sent to "
                   "its own experts)" if gathered else "")
                + f": it is one all-to-all of this rank's E = {E} counts on 'ep'")
    return ""


def _check_all_to_all(fn, comm, watch, r, n) -> str:
    send = [(r + 2 * s) % 4 for s in range(n)]  # rank r sends (r + 2s) % 4 rows to s (zero rows included)
    recv = [(s + 2 * r) % 4 for s in range(n)]
    rows = lambda s, d: torch.arange(4 * H, dtype=torch.float64).reshape(4, H)[:(s + 2 * d) % 4] + 100 * s + 10 * d
    x = torch.cat([rows(r, d) for d in range(n)]).requires_grad_(True)
    got = _learner(watch, "your all_to_all", fn, x, comm, list(send), list(recv))
    want = torch.cat([rows(s, r) for s in range(n)])
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or not torch.equal(got.detach(), want):
        return (f"your all_to_all(send={send}, recv={recv}) on rank {r} does not give the blocks received from each "
                f"rank in rank order ({list(want.shape)} rows)")
    if not got.requires_grad:
        return "your all_to_all's output has no gradient: make it an autograd Function whose backward sends the gradient back"
    weight = torch.arange(want.numel(), dtype=torch.float64).reshape(want.shape) + r  # rank r's weight on its rows
    try:
        with watch.armed():
            (gx,) = torch.autograd.grad((got * weight).sum(), x)
    except LabError:
        raise
    except Exception as e:
        return (f"your all_to_all's backward fails ({type(e).__name__}): it is the same exchange with the split "
                f"sizes swapped (send recv's, receive send's)")
    # the gradient of the rows sent to d is d's weight on them: d's rows from r start after those from s < r
    back = []
    for d in range(n):
        recv_d = [(s + 2 * d) % 4 for s in range(n)]
        w_d = torch.arange(sum(recv_d) * H, dtype=torch.float64).reshape(-1, H) + d
        back.append(w_d[sum(recv_d[:r]):sum(recv_d[:r + 1])])
    if not torch.equal(gx, torch.cat(back)):
        return ("your all_to_all's backward does not send each gradient back to the rank its row came from: "
                "the backward is the same all-to-all with the split sizes swapped")
    return ""


def _check_dispatch(fn, comm, watch, seed, r, n) -> str:
    T = 5 + 3 * r + seed  # a different number of tokens on every rank
    data = [_routing(seed, s, 5 + 3 * s + seed) for s in range(n)]
    x, experts, gates, keep = data[r]
    local = range(r * E // n, (r + 1) * E // n)
    want_rows = [torch.cat([d[0][((d[1] == e) & d[3]).any(1)] for d in data]) for e in local]
    run = _Experts(want_rows, local)
    x = x.clone().requires_grad_(True)
    gates = gates.clone().requires_grad_(True)
    y = _learner(watch, "your dispatch_tokens", fn, x, experts.clone(), gates, keep.clone(), E, comm, run)
    want = _want_y(x.detach(), experts, gates.detach(), keep)
    if run.problem:
        return f"your dispatch_tokens (routing {seed}, rank {r}): {run.problem}"
    if run.calls != 1:
        return f"your dispatch_tokens called run_experts {run.calls} times: once, with every row this rank's experts receive"
    if not isinstance(y, torch.Tensor) or y.shape != want.shape:
        return (f"your dispatch_tokens returned {type(y).__name__ if not isinstance(y, torch.Tensor) else list(y.shape)}:"
                f" return [T, h] = {list(want.shape)}, one row per token")
    where = f"your dispatch_tokens (routing {seed}, rank {r}, {T} tokens)"
    if not torch.allclose(y.detach(), want, rtol=1e-12, atol=1e-12):
        d = y.detach()
        if torch.allclose(d, _want_y(x.detach(), experts, gates.detach(), keep, weighted=False), rtol=1e-12, atol=1e-12):
            return (f"{where} adds the experts' outputs unweighted: multiply each by its gate (the router's "
                    f"probability) before summing them per token")
        if torch.allclose(d.sum(0), want.sum(0), rtol=TOL, atol=1e-9):
            return (f"{where} gives the right outputs to the wrong tokens: the combine brings the rows back in "
                    f"permuted (expert) order; un-permute them (row i belongs to token order[i] // k)")
        return f"{where} differs from the experts' gate-weighted sum by {float((d - want).abs().max()):.3g}"
    # backward: the gradients of the tokens and the gates
    weight = torch.linspace(-1, 1, want.numel(), dtype=torch.float64).reshape(want.shape)
    try:
        with watch.armed():
            gx, gg = torch.autograd.grad((y * weight).sum(), (x, gates), allow_unused=True)
    except LabError:
        raise
    except Exception as e:
        return f"{where}: its backward fails ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    xr, gr = x.detach().clone().requires_grad_(True), gates.detach().clone().requires_grad_(True)
    wx, wg = torch.autograd.grad((_want_y(xr, experts, gr, keep) * weight).sum(), (xr, gr))
    if gg is None or not torch.allclose(gg, wg, rtol=1e-10, atol=1e-12):
        return f"{where}: the gates get no gradient or a wrong one: weigh the outputs by the gates inside autograd"
    if gx is None or not torch.allclose(gx, wx, rtol=1e-10, atol=1e-12):
        return f"{where}: the tokens' gradient is wrong: the dispatch and the combine must both carry it back"
    return ""


def _step(comm, key: str, check, timeout: float, where: str = "") -> None:
    """Run one unit check on every rank; LabError on every rank when one found a problem."""
    try:
        problem = check()
    except LabError as e:
        problem = str(e)
    agree(comm, key, problem and problem + where, timeout)


def _job(comm, source: str, timeout: float) -> dict | None:
    case = next(_CASE)
    from ..comm import Comm, CommTrace
    from ..grid import ProcessGrid

    watch = _watch()
    grid = ProcessGrid(ep=WORLD, rank=comm.grid.rank).build_groups(timeout=datetime.timedelta(seconds=timeout))
    c = Comm(grid, CommTrace())
    r, n = grid.coord().ep, WORLD
    try:
        with watch.armed():
            ns = load_source(source)
        seed0 = [_routing(0, s, 5 + 3 * s) for s in range(n)]
        problem = _check_permute(ns["permute"], watch, seed0[r][1], seed0[r][3])
    except LabError as e:
        problem = str(e)
    agree(comm, f"dispatch/{case}/permute", problem, timeout)
    steps = [("exchange", lambda: _check_exchange(ns["exchange_counts"], c, watch,
                                                  [_counts(d[1], d[3]) for d in seed0], r, n)),
             ("all_to_all", lambda: _check_all_to_all(ns["all_to_all"], c, watch, r, n)),
             ("dispatch0", lambda: _check_dispatch(ns["dispatch_tokens"], c, watch, 0, r, n)),
             ("dispatch1", lambda: _check_dispatch(ns["dispatch_tokens"], c, watch, 1, r, n))]
    for key, check in steps:
        _step(comm, f"dispatch/{case}/{key}", check, timeout)
    # the same pieces on --ep 2 (4 experts a rank) over the same ranks: sizes the notebook does not show
    c2 = comm_on(comm, ParallelConfig(ep=2, dp=WORLD // 2, device="cpu"))
    r2, seed2 = c2.index("ep"), [_routing(2, s, 4 + 5 * s) for s in range(2)]
    for key, check in (("exchange", lambda: _check_exchange(ns["exchange_counts"], c2, watch,
                                                            [_counts(d[1], d[3]) for d in seed2], r2, 2)),
                       ("all_to_all", lambda: _check_all_to_all(ns["all_to_all"], c2, watch, r2, 2)),
                       ("dispatch", lambda: _check_dispatch(ns["dispatch_tokens"], c2, watch, 2, r2, 2))):
        _step(comm, f"dispatch/{case}/ep2-{key}", check, timeout, " (at --ep 2; right at --ep 4)")

    def learners_dispatch(*args):
        return _learner(watch, "your dispatch_tokens", ns["dispatch_tokens"], *args)

    from ..parallel import tensor
    from ..train import Trainer
    layers = SimpleNamespace(**{**vars(tensor.layers()), "token_dispatch": learners_dispatch})
    verdicts = []
    for layout, model in RUNS:
        g = ProcessGrid.for_layout(layout, comm.grid.rank).build_groups(timeout=datetime.timedelta(seconds=timeout))
        tr = Trainer(model, layout, TRAIN, Comm(g, CommTrace()), layers=layers)
        losses = [tr.step(i) for i in range(TRAIN.steps)]
        # the reference runs the whole global batch on one device, one microbatch per data replica:
        # the microbatch is the token set the balancing loss and the capacity are taken over
        res = versus_one_device(comm, tr, losses, model, TRAIN.replace(microbatches=layout.data_replicas))
        verdicts.append((layout.describe(), training_verdict(res, "dispatch_tokens", "", TOL)))
    if comm.grid.rank != 0:
        return None
    return verdict_over_runs(verdicts, "your token dispatch trains exactly like the single-device model (--ep 2 "
                                       "--dp 2, and --ep 4 with tokens dropped by the capacity)")


def load_source(source: str) -> dict:
    """The learner's namespace (torch imported for them)."""
    from .runner import load
    return load(source, NAMES, {"torch": torch})


def check_dispatch_all(sources: list[str], timeout: float = 90) -> list[dict]:
    """`check_dispatch` for several sources, in as few launches as their outcomes allow."""
    return run_sources(_job, ParallelConfig(dp=WORLD, device="cpu"), sources, timeout, timeout,
                       forbidden=FORBIDDEN, names=NAMES)


def check_dispatch(source: str, timeout: float = 90) -> dict:
    """Lab 11a: check `permute`, `exchange_counts`, `all_to_all` and `dispatch_tokens` defined
    in `source` on 4 gloo ranks (--ep 4, 8 experts, uneven counts, an idle expert, dropped
    choices), then train a small mixture of experts with the learner's dispatch inside the
    engine (--ep 2 --dp 2 and --ep 4 with a capacity; float64, 3 steps) against the
    single-device model. Returns {"ok", "message", "max_loss_abs_diff", "max_param_rel_diff"},
    or {"ok": False, "message"} naming the first problem (also when the code does not
    compile, is a stub, uses the engine's own dispatch, raises or runs past `timeout`)."""
    return check_dispatch_all([source], timeout)[0]
