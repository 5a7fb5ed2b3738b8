"""Lab 09b: the all-to-all re-layout of Ulysses attention (DeepSpeed-Ulysses, Jacobs et al. 2023;
the engine's ``--cp-mode a2a``, ``minitron.parallel.context_parallel.ulysses_attention``).

Under context parallelism each of N ranks holds s/N tokens of every head. Ulysses turns that
sequence shard into a head shard before attention — every token of H/N heads — so attention is
ordinary causal attention over the whole sequence, and turns the output back after. The
learner writes the two re-layouts, each one ``comm.all_to_all`` on the 'cp' axis:

* ``seq_to_heads(x, comm) -> [b, H/N, N·s_loc, d]`` from x ``[b, H, s_loc, d]``: rank r gets head
  block r (heads r·H/N .. (r+1)·H/N − 1), with the tokens of rank 0, then rank 1, ... (the
  *gathered* order);
* ``heads_to_seq(y, comm) -> [b, N·H_loc, s_loc, d]`` from y ``[b, H_loc, N·s_loc, d]``: the inverse.

Every rank ``exec``s the source and checks both on 4 ranks with tensors whose every element
names its head and token: the shape, the heads a rank gets (interleaved heads named), the order
of the tokens (blocks of the wrong rank named), the inverse, and the calls from the trace (one
all-to-all on 'cp' each). The ranks agree on the first problem; otherwise the checker's Ulysses
attention — the learner's re-layouts, their gradients being each other (an all-to-all's
backward is the inverse all-to-all), the load-balanced chunks put in natural order, kv heads
sent to the ranks of their queries when fewer than N — replaces the engine's ring attention in
the layer namespace (nothing is patched), and a small Llama trains 2 float64 steps under
``--cp 4`` and ``--cp 2 --tp 2``, each against the single-device model (1e-9).

    result = check_ulysses(SOURCE)   # {"ok", "message", "max_loss_abs_diff", "max_param_rel_diff"}
"""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import torch

from ..config import ParallelConfig
from ..parallel import tensor
from ..parallel.context_parallel import chunk_ids
from .runner import (TOL, LAB_LLAMA, LabError, TWO_FLOAT64_STEPS, Tripwire, agree, call, describe_calls, load, run_sources,
                     traced, train_swapped, training_verdict, verdict_over_runs, watched)

NAMES = ("seq_to_heads", "heads_to_seq")
MODEL = LAB_LLAMA.replace(name="lab-ulysses")
TRAIN = TWO_FLOAT64_STEPS
WORLD = 4
RUNS = ((4, 1), (2, 2))  # (cp, tp) trained on the 4 ranks
FORBIDDEN = ("minitron.parallel.context_parallel._seq_to_heads", "minitron.parallel.context_parallel._heads_to_seq",
             "minitron.parallel.context_parallel._SeqToHeads", "minitron.parallel.context_parallel._HeadsToSeq",
             "minitron.parallel.context_parallel.ulysses_attention", "minitron.labs.ulysses")
_CASE = itertools.count()
AXIS = "cp"


def _watch() -> Tripwire:
    """Armed only while the learner's code runs."""
    return Tripwire(watched("minitron.parallel.context_parallel._seq_to_heads",
                            "minitron.parallel.context_parallel._heads_to_seq",
                            "minitron.parallel.context_parallel.ulysses_attention"))


def _learner(watch: Tripwire, what: str, fn, *args):
    with watch.armed():
        return call(what, fn, *args)


# --- 1. the re-layouts on named tensors -------------------------------------------------------------
def _full(b: int, h: int, s: int, d: int) -> torch.Tensor:
    """[b, H, s, d] whose every element is its own index: head and token readable from the value."""
    return torch.arange(b * h * s * d, dtype=torch.float64).reshape(b, h, s, d)


def _diagnose_s2h(got, full, n, r) -> str:
    b, h, s, d = full.shape
    hl, sl = h // n, s // n
    if torch.equal(got, full[:, r::n]):
        return (f"your seq_to_heads gives rank {r} heads {list(range(r, h, n))}: every {n}th head; rank r holds the "
                f"block of heads r·H/N .. (r+1)·H/N − 1 ({list(range(r * hl, (r + 1) * hl))})")
    heads = full[:, r * hl:(r + 1) * hl]
    if torch.equal(got.sort(dim=2).values, heads.sort(dim=2).values):
        return (f"your seq_to_heads gives rank {r} the right heads but its tokens in another order: the sequence is "
                f"rank 0's {sl} tokens, then rank 1's, ... (the blocks in the order of the ranks that sent them)")
    if torch.equal(got.sort(dim=1).values, heads.sort(dim=1).values):
        return f"your seq_to_heads gives rank {r} its heads in another order: keep them in order"
    return (f"your seq_to_heads gives rank {r} values that are not its heads ({r * hl}..{(r + 1) * hl - 1}) of every "
            f"token: split the heads into N blocks, block j to rank j (comm.all_to_all sends dim 0's j-th block "
            f"to rank j)")


def _check_relayouts(s2h, h2s, comm, watch) -> str:
    n, r = comm.size(AXIS), comm.index(AXIS)
    for b, h, sl, d in ((1, 4, 3, 2), (2, 8, 5, 3), (3, 12, 2, 4)):
        full = _full(b, h, n * sl, d)
        x = full[:, :, r * sl:(r + 1) * sl].clone()
        got, calls = traced(comm, _learner, watch, "your seq_to_heads", s2h, x.clone(), comm)
        want = full[:, r * (h // n):(r + 1) * (h // n)]
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            return (f"your seq_to_heads turned x {list(x.shape)} into "
                    f"{list(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}: want "
                    f"[b, H/N, N·s_loc, d] = {list(want.shape)} on {n} ranks")
        if not torch.equal(got, want):
            return _diagnose_s2h(got, full, n, r)
        if [(c["op"], c["axis"]) for c in calls] != [("all_to_all", AXIS)]:
            return (f"your seq_to_heads communicates {describe_calls(calls)}: it is exactly one all-to-all on "
                    f"'{AXIS}' (each rank keeps one block and sends the others: 1/N of what an all-gather moves each)")
        back, calls = traced(comm, _learner, watch, "your heads_to_seq", h2s, want.clone(), comm)
        if not isinstance(back, torch.Tensor) or back.shape != x.shape:
            return (f"your heads_to_seq turned y {list(want.shape)} into "
                    f"{list(back.shape) if isinstance(back, torch.Tensor) else type(back).__name__}: want "
                    f"[b, N·H_loc, s_loc, d] = {list(x.shape)}")
        if not torch.equal(back, x):
            return (f"your heads_to_seq(seq_to_heads(x)) is not x on rank {r}: it is the inverse, sequence block j "
                    f"to rank j, and the heads received put back in the order of the ranks that sent them")
        if [(c["op"], c["axis"]) for c in calls] != [("all_to_all", AXIS)]:
            return f"your heads_to_seq communicates {describe_calls(calls)}: it is exactly one all-to-all on '{AXIS}'"
    return ""


# --- 2. inside the engine ------------------------------------------------------------------------------
class _Relayout(torch.autograd.Function):
    """The learner's re-layout forward; backward, its inverse (an all-to-all's gradient is the
    all-to-all the other way)."""

    @staticmethod
    def forward(ctx, x, lab, forward_name):
        ctx.lab, ctx.back = lab, "heads_to_seq" if forward_name == "seq_to_heads" else "seq_to_heads"
        return _learner(lab.watch, f"your {forward_name}", lab.fns[forward_name], x, lab.comm)

    @staticmethod
    def backward(ctx, dy):
        lab = ctx.lab
        return _learner(lab.watch, f"your {ctx.back}", lab.fns[ctx.back], dy.contiguous(), lab.comm), None, None


def _natural(n: int, c: int) -> torch.Tensor:
    """Where each token of the natural order sits in the gathered order (rank r's chunks r and 2N−1−r)."""
    gathered = torch.cat([torch.arange(a * c, (a + 1) * c) for r in range(n) for a in chunk_ids(n, r)])
    return torch.argsort(gathered)


def _attention(q, k, v, lab):
    """Causal attention of this rank's chunks with heads spread over 'cp' by the learner's re-layouts."""
    n = lab.comm.size(AXIS)
    kv = torch.stack([k, v])
    if kv.shape[2] < n:  # fewer kv heads than ranks: each to the ranks of its query heads
        kv = kv.repeat_interleave(n // kv.shape[2], dim=2)
    order = _natural(n, q.shape[-2] // 2)
    qh = _Relayout.apply(q, lab, "seq_to_heads")[:, :, order]
    kvh = _Relayout.apply(kv.flatten(0, 1), lab, "seq_to_heads")[:, :, order].unflatten(0, (2, -1))
    y = torch.nn.functional.scaled_dot_product_attention(qh, kvh[0], kvh[1], is_causal=True,
                                                         enable_gqa=kvh.shape[2] != qh.shape[1])
    return _Relayout.apply(y[:, :, torch.argsort(order)].contiguous(), lab, "heads_to_seq")


def _job(comm, source: str, timeout: float) -> dict | None:
    case = next(_CASE)
    watch = _watch()
    try:
        with watch.armed():
            ns = load(source, NAMES, {"torch": torch})
        problem = _check_relayouts(ns["seq_to_heads"], ns["heads_to_seq"], comm, watch)
    except LabError as e:
        problem = str(e)
    agree(comm, f"ulysses/{case}", problem, timeout)
    from ..comm import Comm, CommTrace
    from ..grid import ProcessGrid

    verdicts = []  # every rank trains every run; rank 0 judges at the end
    for cp, tp in RUNS:
        layout = ParallelConfig(cp=cp, tp=tp, device="cpu")  # ring mode: the namespace's attention is ours
        c = Comm(ProcessGrid(tp=tp, cp=cp, rank=comm.grid.rank).build_groups(), CommTrace())
        lab = SimpleNamespace(fns={n: ns[n] for n in NAMES}, comm=c, watch=watch)
        layers = SimpleNamespace(**{**vars(tensor.layers()),
                                    "ring_attention": lambda q, k, v, _comm, lab=lab: _attention(q, k, v, lab)})
        res = train_swapped(c, MODEL, layout, TRAIN, layers=layers)
        verdicts.append((f"--cp {cp} --tp {tp}", training_verdict(res, "seq_to_heads and heads_to_seq", "", TOL)))
    if comm.grid.rank != 0:
        return None
    return verdict_over_runs(verdicts, "your seq_to_heads and heads_to_seq train exactly like the single-device "
                                       "model (Ulysses attention under --cp 4, and --cp 2 --tp 2)")


def check_ulysses_all(sources: list[str], timeout: float = 90) -> list[dict]:
    """`check_ulysses` for several sources, in as few launches as their outcomes allow."""
    return run_sources(_job, ParallelConfig(cp=WORLD, device="cpu"), sources, timeout, timeout,
                       forbidden=FORBIDDEN, names=NAMES)


def check_ulysses(source: str, timeout: float = 90) -> dict:
    """Lab 09b: check `seq_to_heads` and `heads_to_seq` defined in `source` (Ulysses' all-to-all
    re-layouts) on 4 gloo ranks, then train a small Llama with Ulysses attention built from them
    (``--cp 4`` and ``--cp 2 --tp 2``, float64, 2 steps each) against the single-device model.
    Returns {"ok", "message", "max_loss_abs_diff", "max_param_rel_diff"}, or {"ok": False,
    "message"} naming the first problem."""
    return check_ulysses_all([source], timeout)[0]
