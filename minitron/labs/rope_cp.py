"""Lab 10b: rotary embeddings on a context-parallel shard (the engine's
``minitron.parallel.context_parallel.local_positions``, ``minitron.model.rotary_angles`` and
``rotate``).

Under ``--cp N`` rank r holds chunks r and 2N−1−r of the sequence cut into 2N chunks (the
causal load balance); rotary positions must rotate each token by the angle of its *global*
position, or the scores between tokens of different ranks use the wrong distances. The learner
writes:

* ``positions(n_local, cp, r) -> LongTensor [n_local]``: the global positions of rank r's tokens;
* ``rope(x, cos, sin) -> x rotated``: x [..., s, d] rotated by the angles whose cos and sin
  [s, d] are given (angle i on dimensions i and i + d/2, computed by the engine from the
  learner's positions, in float32 as transformers does), in the rotate-half convention (dimension
  i paired with i + d/2, as Hugging Face stores Llama's q and k): ``x·cos + rotate_half(x)·sin``,
  ``rotate_half(x) = [−x₂, x₁]``.

Every rank ``exec``s the source and checks, armed with a :class:`~.runner.Tripwire`:

1. ``positions`` for N up to 8 and several chunk sizes, every rank: local positions, a
   contiguous shard (no load balance) and a swapped pair of chunks named;
2. ``rope`` against the formula on float64 tensors (several d, arbitrary angles): neighbour
   pairs (Meta's original layout) and the rotation the other way named.

The ranks agree on the first problem; otherwise the pieces go into the engine: the layer
namespace's ring attention receives q and k as the engine rotated them, takes the engine's
rotation back off and rotates them with the learner's ``positions`` and ``rope`` before the
engine's ring attention (nothing is patched; cos and sin from the engine's ``rotary_angles`` of
the learner's positions). A small Llama trains 2 float64 steps under
``--cp 4`` and ``--cp 2 --tp 2`` against the single-device model (1e-9).

    result = check_rope_cp(SOURCE)   # {"ok", "message", "max_loss_abs_diff", "max_param_rel_diff"}
"""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import torch

from .. import model as model_module
from ..config import ParallelConfig
from ..parallel import context_parallel, tensor
from .runner import (TOL, LAB_LLAMA, TWO_FLOAT64_STEPS, LabError, Tripwire, agree, call, load, run_sources, train_swapped,
                     training_verdict, verdict_over_runs)

NAMES = ("positions", "rope")
MODEL = LAB_LLAMA.replace(seq_len=32, rope_base=500.0, name="lab-rope")
TRAIN = TWO_FLOAT64_STEPS
WORLD = 4
RUNS = ((4, 1), (2, 2))  # (cp, tp)
FORBIDDEN = ("minitron.parallel.context_parallel.local_positions", "minitron.parallel.context_parallel.chunk_ids",
             "minitron.model.rotary_angles", "minitron.model.rotate", "minitron.labs.rope_cp")
_CASE = itertools.count()
AXIS = "cp"


def _watch() -> Tripwire:
    return Tripwire({"minitron.parallel.context_parallel.local_positions": context_parallel.local_positions,
                     "minitron.parallel.context_parallel.chunk_ids": context_parallel.chunk_ids,
                     "minitron.model.rotary_angles": model_module.rotary_angles,
                     "minitron.model.rotate": model_module.rotate,
                     "minitron.labs.rope_cp": _positions})


def _learner(watch: Tripwire, what: str, fn, *args):
    with watch.armed():
        return call(what, fn, *args)


# --- the checker's own answers ------------------------------------------------------------------
def _positions(n_local: int, cp: int, r: int) -> torch.Tensor:
    c = n_local // 2
    a, b = r, 2 * cp - 1 - r
    return torch.cat([torch.arange(a * c, (a + 1) * c), torch.arange(b * c, (b + 1) * c)])


def _rope(x, cos, sin, pairs="half", sign=1.0):
    """x rotated by the angles of cos, sin [s, d] (angle i on dimensions i and i + d/2)."""
    d = x.shape[-1]
    c, s = cos[..., : d // 2], sign * sin[..., : d // 2]
    if pairs == "half":
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]  # neighbours (Meta's layout)
    return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)


# --- 1. positions -----------------------------------------------------------------------------------
def _check_positions(fn, watch) -> str:
    for cp in (1, 2, 3, 4, 8):
        for c in (1, 3, 4):
            n_local = 2 * c
            for r in reversed(range(cp)):  # the last rank first: local and contiguous differ there
                got = _learner(watch, "your positions", fn, n_local, cp, r)
                want = _positions(n_local, cp, r)
                if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                    return (f"your positions({n_local}, cp={cp}, r={r}) returned "
                            f"{list(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}: return a "
                            f"tensor of the {n_local} positions of the rank's tokens")
                if torch.equal(got.long(), want):
                    continue
                where = f"your positions({n_local}, cp={cp}, r={r}) gave {got.tolist()}"
                if torch.equal(got.long(), torch.arange(n_local)):
                    return (f"{where}: local positions; rotate each token by its place in the whole sequence "
                            f"(chunks r and 2N−1−r of 2N), or scores across ranks use the wrong distances")
                if torch.equal(got.long(), torch.arange(r * n_local, (r + 1) * n_local)):
                    return (f"{where}: a contiguous shard, but rank r holds chunks r and 2N−1−r of 2N (the causal "
                            f"load balance): {want.tolist()}")
                if torch.equal(got.long().sort().values, want.sort().values):
                    return f"{where}: the right positions in another order; the tokens are chunk r, then chunk 2N−1−r"
                return f"{where}, want {want.tolist()} (chunks r and 2N−1−r of 2N chunks of {c})"
    return ""


# --- 2. the rotation ----------------------------------------------------------------------------------
def _check_rope(fn, watch) -> str:
    g = torch.Generator().manual_seed(3)
    for d in (4, 8, 12):
        x = torch.randn(2, 3, 5, d, generator=g, dtype=torch.float64)
        ang = torch.rand(5, d // 2, generator=g, dtype=torch.float64) * 6.0
        cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
        x0 = x.clone()
        got = _learner(watch, "your rope", fn, x, cos, sin)
        if not torch.equal(x, x0):
            return "your rope changed x in place: return a new tensor (autograd and the engine still use x)"
        want = _rope(x, cos, sin)
        if not isinstance(got, torch.Tensor) or got.shape != x.shape:
            return (f"your rope returned {list(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__} "
                    f"for x {list(x.shape)}: return x rotated, in its shape")
        if torch.allclose(got, want, rtol=1e-12, atol=1e-12):
            continue
        where = f"your rope (d = {d})"
        if torch.allclose(got, _rope(x, cos, sin, pairs="neighbours"), rtol=1e-12, atol=1e-12):
            return (f"{where} pairs neighbouring dimensions (2i, 2i+1), Meta's original layout; Hugging Face's Llama "
                    f"weights (and minitron's) pair i with i + d/2: rotate_half(x) = [−x₂, x₁]")
        if torch.allclose(got, _rope(x, cos, sin, sign=-1.0), rtol=1e-12, atol=1e-12):
            return f"{where} rotates the other way: x·cos + rotate_half(x)·sin with rotate_half(x) = [−x₂, x₁]"
        return (f"{where} differs from the rotation by {float((got - want).abs().max()):.3g}: "
                f"x·cos + rotate_half(x)·sin, dimension i paired with i + d/2")
    return ""


# --- 3. inside the engine --------------------------------------------------------------------------
def _attention(q, k, v, comm, lab):
    """The engine's ring attention on q, k rotated by the learner's pieces (the engine's
    rotation taken off first)."""
    n, r = comm.size(AXIS), comm.index(AXIS)
    d = q.shape[-1]
    cos, sin = model_module.rotary_angles(context_parallel.local_positions(q.shape[-2], comm), d, lab.base, q.device)
    # the inverse of a rotation by (cos, sin) is the transpose over cos² + sin² (float32 tables: not exactly 1)
    norm = (cos.to(q.dtype) ** 2 + sin.to(q.dtype) ** 2)
    q0, k0 = model_module.rotate(q, cos, -sin) / norm, model_module.rotate(k, cos, -sin) / norm
    pos = _learner(lab.watch, "your positions", lab.positions, q.shape[-2], n, r)
    cos, sin = model_module.rotary_angles(pos, d, lab.base, q.device)  # float32 angles, as the engine's
    qr = _learner(lab.watch, "your rope", lab.rope, q0, cos, sin)
    kr = _learner(lab.watch, "your rope", lab.rope, k0, cos, sin)
    return context_parallel.ring_attention(qr, kr, v, comm)


def _job(comm, source: str, timeout: float) -> dict | None:
    case = next(_CASE)
    watch = _watch()
    try:
        with watch.armed():
            ns = load(source, NAMES, {"torch": torch})
        problem = _check_positions(ns["positions"], watch) or _check_rope(ns["rope"], watch)
    except LabError as e:
        problem = str(e)
    agree(comm, f"rope-cp/{case}", problem, timeout)
    from ..comm import Comm, CommTrace
    from ..grid import ProcessGrid

    verdicts = []
    for cp, tp in RUNS:
        layout = ParallelConfig(cp=cp, tp=tp, device="cpu")
        c = Comm(ProcessGrid(tp=tp, cp=cp, rank=comm.grid.rank).build_groups(), CommTrace())
        lab = SimpleNamespace(positions=ns["positions"], rope=ns["rope"], base=MODEL.rope_base, watch=watch)
        layers = SimpleNamespace(**{**vars(tensor.layers()),
                                    "ring_attention": lambda q, k, v, cm, lab=lab: _attention(q, k, v, cm, lab)})
        res = train_swapped(c, MODEL, layout, TRAIN, layers=layers)
        verdicts.append((f"--cp {cp} --tp {tp}", training_verdict(res, "positions and rope", "", TOL)))
    if comm.grid.rank != 0:
        return None
    return verdict_over_runs(verdicts, "your positions and rope train exactly like the single-device model (--cp 4, "
                                       "and --cp 2 --tp 2: ring attention on rotated q and k)")


def check_rope_cp_all(sources: list[str], timeout: float = 90) -> list[dict]:
    """`check_rope_cp` for several sources, in as few launches as their outcomes allow."""
    return run_sources(_job, ParallelConfig(cp=WORLD, device="cpu"), sources, timeout, timeout,
                       forbidden=FORBIDDEN, names=NAMES)


def check_rope_cp(source: str, timeout: float = 90) -> dict:
    """Lab 10b: check `positions` and `rope` defined in `source` (the global positions of a
    context rank's tokens and the rotary rotation) on 4 gloo ranks, then train a small Llama
    with them (``--cp 4`` and ``--cp 2 --tp 2``, float64, 2 steps each) against the
    single-device model. Returns {"ok", "message", "max_loss_abs_diff", "max_param_rel_diff"},
    or {"ok": False, "message"} naming the first problem."""
    return check_rope_cp_all([source], timeout)[0]
