"""Lab 04a: Megatron's conjugate operators f and g (``minitron.parallel.tensor._F``, ``_G``).

Every rank `exec`s the learner's source and checks `F` and `G` on one tensor that differs
per element and per rank, with an incoming gradient that is not ones: the shape, the
whole value of each forward and backward (a mean for a sum, an ignored gradient and a
partly summed tensor named), and the calls each issues
(counted in the trace: f's forward and g's backward communicate nothing, f's backward and
g's forward exactly one all-reduce on 'tp'). The ranks agree on the first problem found;
otherwise the Trainer builds its layers with them (``tensor.layers(f=F, g=G)``), a tiny
GPT trains with tensor parallelism on 4 ranks (so that an operator hard-wired to 2 ranks fails) for 2 float64
steps, and rank 0 compares the run with the single-device reference
(:mod:`minitron.tools.verify`); then the unit checks and the run again on ``--tp 2 --dp 2``.

    result = check_f_and_g(SOURCE)   # {"ok", "max_loss_abs_diff", "max_param_rel_diff", "message"}
"""
from __future__ import annotations

import itertools

import torch

from ..config import ParallelConfig
from .runner import (LAB_GPT, LAB_GPT_STEPS, TOL, LabError, Tripwire, agree, call, describe_calls, flags_of, loaded, run_sources,
                     swapped_on_each_layout, traced, verdict_over_runs, watched)

MODEL = LAB_GPT
TRAIN = LAB_GPT_STEPS
TP = 4  # tensor-parallel ranks: more than 2, so that nothing hard-wired to 2 passes
# the notebook's layout, then 2 tensor ranks inside 2 data-parallel replicas: an operator right only at
# the notebook's t, or reducing over the launch's ranks rather than the 'tp' group, fails there
LAYOUTS = (ParallelConfig(tp=TP, device="cpu"), ParallelConfig(tp=2, dp=TP // 2, device="cpu"))
# the engine's own operators (and the functions that apply them): not an answer to this lab
FORBIDDEN = ("minitron.parallel.tensor._F", "minitron.parallel.tensor._G",
             "minitron.parallel.tensor.enter_region", "minitron.parallel.tensor.leave_region")
_CASE = itertools.count()  # the case number in this launch: the same on every rank
# what each direction of each operator does (Megatron-LM §3, Fig. 3): (forward, backward)
RULES = {"F": ("identity", "all-reduce"), "G": ("all-reduce", "identity")}
HOLDS = {"F": "X", "G": "the whole gradient"}  # what an identity direction finds on every rank


def _rule(name: str) -> str:
    fwd, bwd = RULES[name]
    return f"{name} is {fwd} forward, {bwd} backward"


def _check_calls(name: str, direction: str, calls: list, right: bool = True) -> str:
    """'' when one direction of an operator issued the calls it should, else what is wrong
    (`right`: whether its value is)."""
    want = RULES[name][0 if direction == "forward" else 1]
    if want == "identity" and calls:
        return (f"your {name}'s {direction} communicates {describe_calls(calls)}: it is the identity, every rank "
                f"already holds {HOLDS[name]} ({_rule(name)})")
    if want == "all-reduce":
        if not calls:
            return (f"your {name}'s {direction} sums over the ranks without comm: use comm.all_reduce(t, 'tp') "
                    f"(the engine sees, and traces, all communication through comm)" if right else
                    f"your {name}'s {direction} communicates nothing: it is one all-reduce on 'tp' ({_rule(name)})")
        if [(c["op"], c["axis"]) for c in calls] != [("all_reduce", "tp")]:
            return (f"your {name}'s {direction} communicates {describe_calls(calls)}: it is exactly one "
                    f"all-reduce on 'tp' ({_rule(name)})")
    return ""


def _first(rule: str, calls_problem: str, value_problem: str) -> str:
    """The problem that explains a direction best: for an identity, a call it should not
    make (an all-reduce then divided by t has the right value); for an all-reduce, a wrong
    value first (a missing all-reduce shows there)."""
    first, second = (calls_problem, value_problem) if rule == "identity" else (value_problem, calls_problem)
    if "communicates nothing" in calls_problem:  # no all-reduce at all: that is the mistake
        first = calls_problem
    return first or second


def _value_problem(name: str, direction: str, got: torch.Tensor, want: torch.Tensor, ones: torch.Tensor | None,
                   r: int, t: int) -> str:
    """'' when `got` is `want`, else which mistake it is: the incoming gradient ignored
    (`ones`: the value with a gradient of ones), a mean instead of a sum, only some elements."""
    if torch.equal(got, want):
        return ""
    rule = _rule(name)
    if ones is not None and torch.equal(got, ones):
        return (f"your {name}'s {direction} ignores the incoming gradient: on tp rank {r} of {t} it returned what a "
                f"gradient of ones gives ({got.tolist()}), not what dy = {_DY(r).tolist()} gives ({rule})")
    if torch.allclose(got * t, want, rtol=1e-12, atol=0):
        return (f"your {name}'s {direction} returned the mean over the {t} ranks, not the sum ({got.tolist()} on tp "
                f"rank {r}, expected {want.tolist()}): {rule}")
    bad = [i for i in range(want.numel()) if got[i] != want[i]]
    return (f"your {name}'s {direction} returned {got.tolist()} on tp rank {r} of {t} (expected {want.tolist()}; "
            f"element{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} wrong): {rule}")


def _X(r: int) -> torch.Tensor:
    """tp rank r's input: a different value per element and per rank (an all-reduce sums
    them; an operator that looks at one element, or that assumes equal ranks, is seen)."""
    return (r + 1) * torch.tensor([1.0, 10.0, 100.0], dtype=torch.float64)


def _DY(r: int) -> torch.Tensor:
    """tp rank r's incoming gradient: not ones, so that a backward that ignores it is seen."""
    return (r + 2) * torch.tensor([3.0, 5.0, 7.0], dtype=torch.float64)


def _unit_check(comm, F, G) -> str:
    """'' if F and G behave on a rank-dependent input and gradient, else the first problem.
    Raises LabError when one returns something that is not a tensor of the input's shape."""
    t, r = comm.size("tp"), comm.index("tp")
    for name, fn in (("F", F), ("G", G)):
        fwd, bwd = RULES[name]
        x = _X(r).requires_grad_()
        y, calls = traced(comm, call, f"your {name}.forward", fn.apply, x, comm)
        if not isinstance(y, torch.Tensor) or y.shape != x.shape:
            got = f"a tensor of shape {list(y.shape)}" if isinstance(y, torch.Tensor) else repr(y)[:60]
            raise LabError(f"your {name}.forward returned {got} for an input of shape {list(x.shape)}: "
                           f"{name} must return a tensor of its input's shape")
        if not y.requires_grad:
            raise LabError(f"your {name}.forward returned a tensor without a gradient: use "
                           f"{name}.apply's autograd (return a new tensor from forward, not x.detach())")
        want = sum(_X(q) for q in range(t)) if fwd == "all-reduce" else _X(r)
        value = _value_problem(name, "forward", y.detach(), want, None, r, t)
        problem = _first(fwd, _check_calls(name, "forward", calls, not value), value)
        if problem:
            return problem
        (dx,), calls = traced(comm, call, f"your {name}.backward", torch.autograd.grad, y, x, _DY(r))
        if dx is None or dx.shape != x.shape:
            got = "None" if dx is None else f"shape {list(dx.shape)}"
            raise LabError(f"your {name}.backward returned a gradient of {got} for an input of shape "
                           f"{list(x.shape)}: return one gradient of the input's shape, then None for comm")
        reduced = bwd == "all-reduce"
        want = sum(_DY(q) for q in range(t)) if reduced else _DY(r)
        ones = torch.full_like(want, float(t if reduced else 1))
        value = _value_problem(name, "backward", dx.detach(), want, ones, r, t)
        problem = _first(bwd, _check_calls(name, "backward", calls, not value), value)
        if problem:
            return problem
    return ""


def _f_and_g_job(comm, source: str, timeout: float) -> dict | None:
    from ..parallel import tensor

    case = next(_CASE)
    watch = Tripwire(watched("minitron.parallel.tensor._F", "minitron.parallel.tensor._G"))
    F, G = loaded(comm, source, ("F", "G"), {"torch": torch}, watch, f"f-and-g/{case}", timeout)
    runs = swapped_on_each_layout(comm, LAYOUTS, f"f-and-g/{case}", timeout, watch, lambda c: _unit_check(c, F, G),
                                  tensor.layers(f=F, g=G), "F and G", MODEL, TRAIN, TOL)
    if comm.grid.rank != 0:
        return None
    return verdict_over_runs(runs, f"your F and G train exactly like the single-device model ({flags_of(runs)})")


def check_f_and_g_all(sources: list[str], timeout: float = 60) -> list[dict]:
    """`check_f_and_g` for several sources, in as few launches as their outcomes allow."""
    return run_sources(_f_and_g_job, LAYOUTS[0], sources, timeout, timeout,
                       forbidden=FORBIDDEN, names=("F", "G"))


def check_f_and_g(source: str, timeout: float = 60) -> dict:
    """Lab 04a: check the classes `F` and `G` defined in `source` on 4 gloo ranks (the
    value and the traced calls of each forward and backward), then train a tiny GPT with
    tensor parallelism (float64, 2 steps) with them in place of the engine's f and g and
    compare it with the single-device model; then the same on 2 tensor ranks in each of 2
    data-parallel replicas (``--tp 2 --dp 2``). Returns {"ok", "max_loss_abs_diff",
    "max_param_rel_diff", "message"}, or {"ok": False, "message"} when the code does not
    compile, uses the engine's own operators, is still the stub, raises, returns a wrong
    shape or value, communicates the wrong calls, or runs past `timeout` seconds."""
    return check_f_and_g_all([source], timeout)[0]
