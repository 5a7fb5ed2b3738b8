"""Lab checkers: run the learner's version of one engine function inside the real engine.

The learner's code arrives as *source text* (a class defined in a notebook cannot be
pickled to a forkserver rank); every rank `exec`s it, swaps the result into the engine,
trains, and puts the engine's own code back. Rank 0 compares the run with the
single-device reference (:mod:`minitron.verify`).

    result = check_f_and_g(SOURCE)   # {"ok", "max_loss_abs_diff", "max_param_rel_diff", "message"}
"""
from __future__ import annotations

import torch

from .config import ModelConfig, ParallelConfig, TrainConfig
from .testing import run_on_ranks

MODEL = ModelConfig(layers=1, hidden=16, heads=4, seq_len=16, vocab=256, name="lab")
TRAIN = TrainConfig(steps=2, global_batch=4, dtype="float64", warmup=1, progress=False,
                    eval_every=0, sample_tokens=0)
TOL = 1e-9  # float64 (minitron.verify.TOLERANCE)


def _unit_check(comm, F, G) -> str:
    """'' if F and G behave on a rank-dependent input, else what went wrong."""
    t, r = comm.size("tp"), comm.index("tp")
    x = torch.full((3,), float(r + 1), dtype=torch.float64, requires_grad=True)
    total = float(sum(range(1, t + 1)))  # what an all-reduce of (rank + 1) gives
    want = {"F": ("identity forward", 1.0, "all-reduce backward", total),
            "G": ("all-reduce forward", total, "identity backward", 1.0)}
    for name, fn in (("F", F), ("G", G)):
        fwd_what, fwd_scale, bwd_what, bwd_want = want[name]
        y = fn.apply(x, comm)
        got_fwd = float(y.detach()[0])
        if got_fwd != fwd_scale * (r + 1):
            return (f"your {name}'s forward returned {got_fwd} on tp rank {r} for an input of {r + 1.0} "
                    f"(expected {fwd_scale * (r + 1)}): {name} is {fwd_what}, {bwd_what}")
        (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
        # the upstream gradient is ones on every rank: all-reduce gives t, identity gives 1
        got_bwd, exp_bwd = float(dx[0]), (t if bwd_want == total else 1.0)
        if got_bwd != exp_bwd:
            return (f"your {name}'s backward returned {got_bwd} on tp rank {r} for a gradient of ones "
                    f"(expected {float(exp_bwd)}): {name} is {fwd_what}, {bwd_what}")
    return ""


def _f_and_g_job(comm, source: str) -> dict | None:
    from .checkpoint import gather_full
    from .parallel import tensor
    from .train import Trainer
    from .verify import compare, reference_run

    ns: dict = {"torch": torch}
    exec(compile(source, "<your F and G>", "exec"), ns)
    F, G = ns["F"], ns["G"]
    problem = _unit_check(comm, F, G)
    saved = tensor._F, tensor._G
    tensor._F, tensor._G = F, G
    try:
        tr = Trainer(MODEL, ParallelConfig(tp=comm.size("tp"), device="cpu"), TRAIN, comm)
        losses = [tr.step(i) for i in range(TRAIN.steps)]
    finally:
        tensor._F, tensor._G = saved
    full = gather_full(tr)
    if comm.grid.rank != 0:
        return None
    torch.manual_seed(TRAIN.seed)
    ref_losses, ref = reference_run(MODEL, TRAIN, tr.corpus, TRAIN.steps)
    res = compare(losses, full, ref_losses, ref)
    ok = res["max_loss_abs_diff"] <= TOL and res["max_param_rel_diff"] <= TOL and not problem
    if ok:
        msg = "your F and G train exactly like the single-device model"
    else:
        msg = (problem or "F and G pass the one-tensor check but training differs") + (
            f" (loss differs by {res['max_loss_abs_diff']:.3g}, worst parameter "
            f"{res['worst_param']} by {res['max_param_rel_diff']:.3g})")
    return {"ok": ok, "max_loss_abs_diff": res["max_loss_abs_diff"],
            "max_param_rel_diff": res["max_param_rel_diff"], "message": msg}


def check_f_and_g(source: str, tp: int = 2) -> dict:
    """Lab 1: train a tiny GPT with tensor parallelism (`tp` gloo ranks, float64, 2 steps)
    using the classes `F` and `G` defined in `source` in place of the engine's f and g,
    and compare it with the single-device model. Returns {"ok", "max_loss_abs_diff",
    "max_param_rel_diff", "message"}."""
    try:
        compile(source, "<your F and G>", "exec")
    except SyntaxError as e:
        return {"ok": False, "max_loss_abs_diff": float("nan"), "max_param_rel_diff": float("nan"),
                "message": f"your source does not compile: {e}"}
    return run_on_ranks(_f_and_g_job, ParallelConfig(tp=tp, device="cpu"), source)[0]
