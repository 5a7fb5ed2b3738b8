"""Lab 04a: Megatron's conjugate operators f and g (``minitron.parallel.tensor._F``, ``_G``).

Every rank `exec`s the learner's source, checks `F` and `G` on one rank-dependent tensor
(shape, forward, backward), swaps them into the engine, trains a tiny GPT with tensor
parallelism for 2 float64 steps and puts the engine's own operators back; rank 0 compares
the run with the single-device reference (:mod:`minitron.tools.verify`).

    result = check_f_and_g(SOURCE)   # {"ok", "max_loss_abs_diff", "max_param_rel_diff", "message"}
"""
from __future__ import annotations

import torch

from ..config import ModelConfig, ParallelConfig, TrainConfig
from .runner import LabError, call, load, run_sources, train_swapped

MODEL = ModelConfig(layers=1, hidden=16, heads=4, seq_len=16, vocab=256, name="lab")
TRAIN = TrainConfig(steps=2, global_batch=4, dtype="float64", warmup=1, progress=False,
                    eval_every=0, sample_tokens=0)
TOL = 1e-9  # float64 (minitron.tools.verify.TOLERANCE)


def _unit_check(comm, F, G) -> str:
    """'' if F and G behave on a rank-dependent input, else what went wrong. Raises
    LabError when one returns something that is not a tensor of the input's shape."""
    t, r = comm.size("tp"), comm.index("tp")
    x = torch.full((3,), float(r + 1), dtype=torch.float64, requires_grad=True)
    total = float(sum(range(1, t + 1)))  # what an all-reduce of (rank + 1) gives
    want = {"F": ("identity forward", 1.0, "all-reduce backward", total),
            "G": ("all-reduce forward", total, "identity backward", 1.0)}
    for name, fn in (("F", F), ("G", G)):
        fwd_what, fwd_scale, bwd_what, bwd_want = want[name]
        y = call(f"your {name}.forward", fn.apply, x, comm)
        if not isinstance(y, torch.Tensor) or y.shape != x.shape:
            got = f"a tensor of shape {list(y.shape)}" if isinstance(y, torch.Tensor) else repr(y)[:60]
            raise LabError(f"your {name}.forward returned {got} for an input of shape {list(x.shape)}: "
                           f"{name} must return a tensor of its input's shape")
        if not y.requires_grad:
            raise LabError(f"your {name}.forward returned a tensor without a gradient: use "
                           f"{name}.apply's autograd (return a new tensor from forward, not x.detach())")
        got_fwd = float(y.detach()[0])
        if got_fwd != fwd_scale * (r + 1):
            return (f"your {name}'s forward returned {got_fwd} on tp rank {r} for an input of {r + 1.0} "
                    f"(expected {fwd_scale * (r + 1)}): {name} is {fwd_what}, {bwd_what}")
        (dx,) = call(f"your {name}.backward", torch.autograd.grad, y, x, torch.ones_like(y))
        if dx is None or dx.shape != x.shape:
            got = "None" if dx is None else f"shape {list(dx.shape)}"
            raise LabError(f"your {name}.backward returned a gradient of {got} for an input of shape "
                           f"{list(x.shape)}: return one gradient of the input's shape, then None for comm")
        # the upstream gradient is ones on every rank: all-reduce gives t, identity gives 1
        got_bwd, exp_bwd = float(dx[0]), (t if bwd_want == total else 1.0)
        if got_bwd != exp_bwd:
            return (f"your {name}'s backward returned {got_bwd} on tp rank {r} for a gradient of ones "
                    f"(expected {float(exp_bwd)}): {name} is {fwd_what}, {bwd_what}")
    return ""


def _f_and_g_job(comm, source: str) -> dict | None:
    from ..parallel import tensor

    ns = load(source, ("F", "G"), {"torch": torch})
    F, G = ns["F"], ns["G"]
    problem = _unit_check(comm, F, G)
    layout = ParallelConfig(tp=comm.size("tp"), device="cpu")
    res = train_swapped(comm, MODEL, layout, TRAIN, tensor, _F=F, _G=G)
    if res is None:  # not rank 0
        return None
    ok = res["max_loss_abs_diff"] <= TOL and res["max_param_rel_diff"] <= TOL and not problem
    if ok:
        msg = "your F and G train exactly like the single-device model"
    else:
        msg = (problem or "F and G pass the one-tensor check but training differs") + (
            f" (loss differs by {res['max_loss_abs_diff']:.3g}, worst parameter "
            f"{res['worst_param']} by {res['max_param_rel_diff']:.3g})")
    return {"ok": ok, "max_loss_abs_diff": res["max_loss_abs_diff"],
            "max_param_rel_diff": res["max_param_rel_diff"], "message": msg}


def check_f_and_g_all(sources: list[str], tp: int = 2, timeout: float = 60) -> list[dict]:
    """`check_f_and_g` for several sources, in as few launches as their outcomes allow."""
    return run_sources(_f_and_g_job, ParallelConfig(tp=tp, device="cpu"), sources, timeout)


def check_f_and_g(source: str, tp: int = 2, timeout: float = 60) -> dict:
    """Lab 04a: train a tiny GPT with tensor parallelism (`tp` gloo ranks, float64, 2 steps)
    using the classes `F` and `G` defined in `source` in place of the engine's f and g,
    and compare it with the single-device model. Returns {"ok", "max_loss_abs_diff",
    "max_param_rel_diff", "message"}, or {"ok": False, "message"} when the code does not
    compile, raises, returns a wrong shape, or runs past `timeout` seconds."""
    return check_f_and_g_all([source], tp, timeout)[0]
