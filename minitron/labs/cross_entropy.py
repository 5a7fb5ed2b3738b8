"""Lab 04b: the vocabulary-parallel cross-entropy (Megatron-LM, Shoeybi et al. 2019, §3;
the engine's ``minitron.parallel.tensor._VocabParallelCrossEntropy``).

The learner writes ``VocabParallelCrossEntropy``, a ``torch.autograd.Function`` with the
engine's signature: ``forward(ctx, logits, target, start, vocab, comm, axis="tp")`` takes
this rank's logits [N, V'/t] (vocabulary ids [start, start + V'/t) of the vocabulary
padded to V'; ids ≥ `vocab` are padding) and returns the per-token loss [N], all-reducing
over `axis` only per-token scalars (the max, the target logit, the sum of exponentials);
``backward(ctx, dloss)`` returns this rank's slice of (softmax − one-hot(target))·dloss
and ``None`` for the five other inputs, without communicating.

Every rank `exec`s the source and checks the class on rank-dependent slices of one set of
float64 logits whose vocabulary is not a multiple of t (the last rank holds a padded id):

1. the forward returns a per-token loss [N] that is finite, equal to ``F.cross_entropy`` on
   the gathered logits, and communicates only all-reduces of at most 3·N values, on the
   axis it is given (a call with ``axis="world"``);
2. the backward communicates nothing and equals autograd's gradient of
   ``F.cross_entropy`` (weighted by an uneven dloss) on this rank's slice;
3. with logits around +1000 (exp overflows float64 past 709) both stay finite and right.

A wrong number is diagnosed against the usual mistakes (padded ids not masked, a max or
a sum not all-reduced, the one-hot missing or on every rank, dloss ignored). The ranks
agree on the first problem found (through the rendezvous store, so a rank that failed
alone still reports) and all stop there; otherwise the class is swapped into the engine,
a tiny GPT with vocabulary 257 (padded to 260 on 4 ranks) trains with ``--tp 4`` for 2
float64 steps, and rank 0 compares it with the single-device model.

    result = check_vocab_parallel_ce(SOURCE)   # {"ok", "message", "max_loss_abs_diff", ...}
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from ..config import ModelConfig, ParallelConfig, pad_vocab
from .runner import (LAB_GPT_STEPS, TOL, LabError, Tripwire, agree, call, describe_calls, flags_of, loaded, run_sources,
                     swapped_on_each_layout, verdict_over_runs, watched)

MODEL = ModelConfig(layers=1, hidden=16, heads=4, seq_len=16, vocab=257, name="lab")  # 260 on 4 ranks
TRAIN = LAB_GPT_STEPS
TP = 4  # tensor-parallel ranks: more than 2, so that nothing hard-wired to 2 passes
# the notebook's layout, then 2 tensor ranks in each of 2 replicas (other slices, other padding): a slice
# start or a padding hard-wired to the notebook's t fails there
LAYOUTS = (ParallelConfig(tp=TP, device="cpu"), ParallelConfig(tp=2, dp=TP // 2, device="cpu"))
NAME = "VocabParallelCrossEntropy"
PER_RANK, TOKENS = 4, 12  # the unit checks' slice: 4 ids per rank, the last 1 or 3 padding
PADS = (1, 3)  # padded ids in the unit checks: a vocabulary that needs more than one
BIG = 1000.0  # exp(1000) overflows float64 (whose largest exponent is ~709.8)
_CASE = itertools.count()  # the case number in this launch: the same on every rank
# the engine's own version of the piece: not an answer to this lab
FORBIDDEN = ("minitron.parallel.tensor._VocabParallelCrossEntropy",
             "minitron.parallel.tensor.vocab_parallel_cross_entropy", "minitron.parallel.tensor.output_loss")


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-10, atol=1e-10))


def _where(d: torch.Tensor) -> tuple[int, int]:
    """(row, column) of the largest entry of |d| (d 1-D: column 0)."""
    i = int(d.abs().reshape(-1).argmax())
    return divmod(i, d.shape[-1]) if d.dim() == 2 else (i, 0)


def _targets(t: int, vocab: int) -> list[int]:
    """TOKENS target ids: the first, second and last id of every rank's slice (a shard's
    boundaries, where an off-by-one shows, and one id inside), those below `vocab`."""
    ids = [q * PER_RANK + o for o in (0, 1, PER_RANK - 1) for q in range(t)]
    ids = [i for i in ids if i < vocab]
    return (ids + [(3 * k) % vocab for k in range(TOKENS)])[:TOKENS]


class _Data:
    """One set of float64 logits [N, t·PER_RANK] (vocabulary t·PER_RANK − pads: the last
    `pads` ids are padding), targets on every rank, and what each rank should get."""

    def __init__(self, t: int, r: int, shift: float = 0.0, pads: int = 1):
        self.t, self.r, self.per = t, r, PER_RANK
        self.vocab = t * PER_RANK - pads
        g = torch.Generator().manual_seed(1234)
        self.full = torch.randn(TOKENS, t * PER_RANK, generator=g, dtype=torch.float64) * 2 + shift
        self.target = torch.tensor(_targets(t, self.vocab))
        self.dloss = (torch.arange(TOKENS, dtype=torch.float64) + 1) / TOKENS  # uneven on purpose
        self.start = r * PER_RANK
        self.cols = slice(self.start, self.start + PER_RANK)
        self.mine = (self.target // PER_RANK) == r  # tokens whose target this rank holds
        valid = self.full[:, :self.vocab]
        self.loss = F.cross_entropy(valid, self.target, reduction="none")
        leaf = self.full.clone().requires_grad_()
        ce = F.cross_entropy(leaf[:, :self.vocab], self.target, reduction="none")
        (self.grad_full,) = torch.autograd.grad(ce, leaf, self.dloss)
        self.grad = self.grad_full[:, self.cols]

    def local(self, requires_grad: bool = True) -> torch.Tensor:
        return self.full[:, self.cols].clone().requires_grad_(requires_grad)

    # --- what the usual mistakes give (forward) --------------------------------------------
    def loss_without_mask(self) -> torch.Tensor:
        return F.cross_entropy(self.full, self.target, reduction="none")

    def loss_counting(self, ids: range) -> torch.Tensor:
        """The loss when the padded ids `ids` are counted as if they were words."""
        return F.cross_entropy(torch.cat([self.full[:, :self.vocab], self.full[:, ids.start:ids.stop]], -1),
                               self.target, reduction="none")

    def at_a_boundary(self) -> torch.Tensor:
        """The tokens whose target is the first or the last id of a rank's slice."""
        o = self.target % self.per
        return (o == 0) | (o == self.per - 1)

    def loss_with_local_max(self) -> torch.Tensor:
        """Each rank shifts by its own max (not all-reduced) before the sums are added."""
        valid = self.full[:, :self.vocab]
        parts = [valid[:, q * self.per:(q + 1) * self.per] for q in range(self.t)]
        maxes = torch.stack([p.max(-1).values for p in parts])  # [t, N]
        total = sum((p - m.unsqueeze(-1)).exp().sum(-1) for p, m in zip(parts, maxes))
        rows = torch.arange(TOKENS)
        x_t = valid[rows, self.target]
        return total.log() - (x_t - maxes[self.target // self.per, rows])

    def loss_with_local_sum(self) -> torch.Tensor:
        """The sum of exponentials of this rank's ids only."""
        valid = self.full[:, :self.vocab]
        mine = valid[:, self.start:min(self.start + self.per, self.vocab)]
        return torch.logsumexp(mine, -1) - valid[torch.arange(TOKENS), self.target]

    # --- and in the backward ------------------------------------------------------------------
    def softmax(self) -> torch.Tensor:
        p = torch.zeros_like(self.full)
        p[:, :self.vocab] = torch.softmax(self.full[:, :self.vocab], -1)
        return p[:, self.cols]

    def one_hot(self, everywhere: bool = False) -> torch.Tensor:
        local_t = self.target - self.start
        oh = torch.zeros(TOKENS, self.per, dtype=torch.float64)
        rows = torch.arange(TOKENS)
        hit = torch.ones(TOKENS, dtype=torch.bool) if everywhere else self.mine
        oh[rows[hit], local_t.clamp(0, self.per - 1)[hit]] = 1.0
        return oh


def _forward(comm, cls, data: _Data, axis: str = "tp"):
    """Call the learner's forward; the loss, the local logits and the calls it made."""
    x = data.local()
    n = len(comm.trace.records) if comm.trace is not None else 0
    loss = call(f"your {NAME}.forward", cls.apply, x, data.target, data.start, data.vocab, comm, axis)
    calls = comm.trace.records[n:] if comm.trace is not None else []
    if not isinstance(loss, torch.Tensor) or loss.shape != (TOKENS,):
        got = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else repr(loss)[:60]
        raise LabError(f"your {NAME}.forward returned {got} for N={TOKENS} tokens: return the per-token "
                       f"loss, a tensor of shape [{TOKENS}] (the engine takes the mean itself)")
    if not loss.requires_grad:
        raise LabError(f"your {NAME}.forward returned a tensor without a gradient: use {NAME}.apply's "
                       f"autograd (return a new tensor from forward, not a detached one)")
    return loss, x, calls


def _diagnose_loss(data: _Data, got: torch.Tensor) -> str:
    r = data.r
    if _close(got, data.loss_without_mask()):
        return (f"your loss counts the padded vocabulary ids (those >= vocab: id {data.vocab} on the last rank "
                f"for vocab {data.vocab}): set their logits to -inf before the max and the sum of exponentials")
    padded = data.t * data.per
    for a in range(data.vocab, padded):
        for b in range(a + 1, padded + 1):
            if (a, b) != (data.vocab, padded) and _close(got, data.loss_counting(range(a, b))):
                ids = f"id {a}" if b == a + 1 else f"ids {a}..{b - 1}"
                return (f"your loss counts the padded {ids} (vocab {data.vocab}, padded to {padded}: ids "
                        f"{data.vocab}..{padded - 1} are padding): mask every id >= vocab, however many there are")
    if _close(got, data.loss_with_local_max()):
        return ("the ranks shifted the logits by different maxima: all-reduce the max (op='max') so that "
                "every rank subtracts the same one before exponentiating")
    if _close(got, data.loss_with_local_sum()):
        return (f"your loss on tp rank {r} uses only this rank's sum of exponentials: all-reduce (sum) the "
                f"sum of exponentials over the ranks")
    ok = (got - data.loss).abs() <= 1e-10 * (1 + data.loss.abs())
    edge = data.at_a_boundary()
    if not bool(ok.all()) and bool(ok[~edge].all()):
        wrong = sorted({int(i) for i in data.target[~ok]})
        return (f"your loss is wrong only for tokens whose target is the first or last id of a rank's slice "
                f"(target ids {', '.join(map(str, wrong))}; {data.per} ids per rank): an off-by-one in which rank "
                f"holds the target: rank r holds ids start <= id < start + V/t, and exactly one rank does")
    if bool(ok[data.mine].all()) and not bool(ok[~data.mine].all()):
        return (f"your loss on tp rank {r} is right only for the tokens whose target id this rank holds: "
                f"all-reduce (sum) the target logit (the other ranks contribute 0)")
    i, _ = _where(got - data.loss)
    return (f"your per-token loss on tp rank {r} differs from F.cross_entropy on the gathered logits by "
            f"{float((got - data.loss)[i]):.3g} at token {i} (target id {int(data.target[i])})")


def _diagnose_grad(data: _Data, got: torch.Tensor) -> str:
    r, w = data.r, data.dloss.unsqueeze(-1)
    sm, oh = data.softmax(), data.one_hot()
    if _close(got, sm * w):
        return ("your gradient is softmax * dloss: subtract the one-hot of the target (1 at the target id, "
                "on the rank that holds it)")
    if _close(got, sm - oh):
        return ("your gradient ignores dloss (the incoming gradient of each token's loss): multiply "
                "(softmax - one-hot) by dloss.unsqueeze(-1)")
    if _close(got, (sm - data.one_hot(everywhere=True)) * w):
        return ("your gradient subtracts the one-hot on ranks that do not hold the target: only the rank with "
                "start <= target < start + V/t does (the others' clamped index points at some other id)")
    if _close(got, -data.grad):
        return "your gradient has the wrong sign: it is (softmax - one-hot(target)) * dloss"
    pad = torch.arange(data.start, data.start + data.per) >= data.vocab
    if pad.any() and _close(got[:, ~pad], data.grad[:, ~pad]):
        return (f"your gradient at the padded id {data.vocab} (>= vocab) is not 0: a masked id has no "
                f"probability (take the softmax of the masked logits)")
    i, j = _where(got - data.grad)
    return (f"your gradient on tp rank {r} differs from (softmax - one-hot(target)) * dloss (autograd of "
            f"F.cross_entropy on the gathered logits, this rank's slice) by {float((got - data.grad)[i, j]):.3g} "
            f"at token {i}, vocabulary id {data.start + j}")


def _backward(comm, loss, x, data: _Data):
    n = len(comm.trace.records) if comm.trace is not None else 0
    (dx,) = call(f"your {NAME}.backward", lambda: torch.autograd.grad(loss, x, data.dloss, allow_unused=True))
    calls = comm.trace.records[n:] if comm.trace is not None else []
    if dx is None or dx.shape != x.shape:
        got = "None" if dx is None else f"shape {list(dx.shape)}"
        raise LabError(f"your {NAME}.backward returned a gradient of {got} for logits of shape "
                       f"{list(x.shape)}: return the logits' gradient first, then None for each other input")
    return dx, calls


def _unit_check(comm, cls) -> str:
    """'' when the class passes every unit check on this rank, else the first problem."""
    t, r = comm.size("tp"), comm.index("tp")
    for pads in PADS:
        problem = _unit_check_pads(comm, cls, t, r, pads)
        if problem:
            return problem
    return _unit_check_rest(comm, cls, t, r)


def _unit_check_pads(comm, cls, t: int, r: int, pads: int) -> str:
    """The forward and backward on logits with `pads` padded ids."""
    data = _Data(t, r, pads=pads)
    loss, x, calls = _forward(comm, cls, data)
    bad = ~torch.isfinite(loss.detach())
    if bad.any():
        i = int(bad.nonzero()[0])
        value = float(loss.detach()[i])
        return (f"your per-token loss is {value} on tp rank {r} (token {i}) for logits of order 1"
                + (": is a masked -inf multiplied by 0 somewhere? Pick the target logit by indexing or "
                   "torch.where, not by multiplying with a mask" if value != value else ""))
    if any(c["axis"] != "tp" for c in calls):
        return (f"your forward communicates {describe_calls(calls)}: reduce over the `axis` it is given ('tp' "
                f"here, the ranks that share the vocabulary), not over other ranks")
    if not _close(loss.detach(), data.loss):
        return _diagnose_loss(data, loss.detach())
    values = sum(int(torch.Size(c["shape"]).numel()) for c in calls)
    if any(c["op"] != "all_reduce" for c in calls) or values > 3 * TOKENS:
        return (f"your forward communicates {describe_calls(calls)} for N={TOKENS} tokens: the logits are never "
                f"gathered, only per-token scalars are all-reduced (the max, the target logit and the sum "
                f"of exponentials: 3*N = {3 * TOKENS} values)")
    dx, calls = _backward(comm, loss, x, data)
    if calls:
        return (f"your backward communicates {describe_calls(calls)}: it needs nothing from the other ranks "
                f"(its slice of softmax - one-hot, from what the forward all-reduced)")
    if not _close(dx, data.grad):
        return _diagnose_grad(data, dx)
    return ""


def _unit_check_rest(comm, cls, t: int, r: int) -> str:
    """The axis it is given, and logits around +1000."""
    data = _Data(t, r)
    _, _, calls = _forward(comm, cls, data, axis="world")
    if any(c["axis"] != "world" for c in calls):
        return (f"called with axis='world' your forward communicates {describe_calls(calls)}: use the `axis` "
                f"argument for every collective (the 3-D cube passes 'cube_j')")
    big = _Data(t, r, shift=BIG)
    loss, x, _ = _forward(comm, cls, big)
    if not torch.isfinite(loss.detach()).all():
        return (f"with logits around {BIG:g} your loss is {float(loss.detach().max())} (exp overflows "
                f"float64 past ~709): subtract the all-reduced max from the logits before exponentiating")
    if not _close(loss.detach(), big.loss):
        return f"with logits around {BIG:g}: " + _diagnose_loss(big, loss.detach())
    dx, _ = _backward(comm, loss, x, big)
    if not torch.isfinite(dx).all():
        return (f"with logits around {BIG:g} your gradient holds {float(dx[~torch.isfinite(dx)][0])}: compute "
                f"the softmax from the logits minus the all-reduced max (or save it from the forward)")
    if not _close(dx, big.grad):
        return f"with logits around {BIG:g}: " + _diagnose_grad(big, dx)
    return ""


def _ce_job(comm, source: str, timeout: float) -> dict | None:
    from ..parallel import tensor

    case = next(_CASE)
    watch = Tripwire(watched("minitron.parallel.tensor._VocabParallelCrossEntropy"))
    cls, = loaded(comm, source, (NAME,), {"torch": torch}, watch, f"ce/{case}", timeout)
    runs = swapped_on_each_layout(comm, LAYOUTS, f"ce/{case}", timeout, watch, lambda c: _unit_check(c, cls),
                                  tensor.layers(vocab_cross_entropy=cls), NAME, MODEL, TRAIN, TOL)
    if comm.grid.rank != 0:
        return None
    padded = " and ".join(f"{pad_vocab(MODEL.vocab, layout.tp)} on {layout.tp} ranks" for layout in LAYOUTS)
    return verdict_over_runs(runs, f"your {NAME} trains exactly like the single-device model (vocabulary {MODEL.vocab}, "
                                   f"padded to {padded}: {flags_of(runs)})")


def check_vocab_parallel_ce_all(sources: list[str], timeout: float = 60) -> list[dict]:
    """`check_vocab_parallel_ce` for several sources, in as few launches as their outcomes allow."""
    return run_sources(_ce_job, LAYOUTS[0], sources, timeout, timeout,
                       forbidden=FORBIDDEN, names=(NAME,))


def check_vocab_parallel_ce(source: str, timeout: float = 60) -> dict:
    """Lab 04b: check the class `VocabParallelCrossEntropy` defined in `source` on 4 gloo
    ranks against ``F.cross_entropy`` on the gathered logits (forward, gradient, padded ids,
    logits around +1000, what it communicates), then train a tiny GPT with it in place of
    the engine's (``--tp 4``, float64, 2 steps) and compare with the single-device model;
    then the same on ``--tp 2 --dp 2``. Returns {"ok", "message", "max_loss_abs_diff",
    "max_param_rel_diff"}, or {"ok": False, "message"} naming the first problem, also
    when the code does not compile, raises, returns a wrong shape or runs past `timeout`
    seconds."""
    return check_vocab_parallel_ce_all([source], timeout)[0]
