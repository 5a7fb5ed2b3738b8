"""Lab 1: estimate the bytes a training rank holds, and meet the measurement.

The learner writes ``estimate(model, layout, train, stage) -> dict``: the bytes one rank
at pipeline stage `stage` holds during a training step of minitron's GPT, under the
keys of :func:`minitron.analysis.memory.memory_on_rank`:

* ``params_bytes``: the rank's parameters (its layers, split over t; the embeddings on
  the first and last stage);
* ``grads_bytes``: one gradient per parameter;
* ``optimizer_bytes``: AdamW's two moments per parameter (``exp_avg``, ``exp_avg_sq``);
* ``activations_bytes``: what autograd saves for the backward (Korthikanti et al. 2022,
  Table 2, in the run's dtype with 1-byte dropout masks), for every microbatch in flight
  on the stage: 1F1B keeps min(p − stage, m) of them.

The checker measures the same quantities on real gloo ranks: one launch of 2 ranks
trains one step of a small GPT in each of three layouts, ``--dp 2``, ``--tp 2 --sp`` and
``--pp 2`` (1F1B, 4 microbatches), and :func:`minitron.tools.measure.measure_step_memory`
counts every rank's parameters, gradients, optimizer state and the peak of the saved
tensors. The learner's estimate must equal the model states exactly and come within
``ACT_TOL`` of the activations; the first component off is named in one line, with the
layout, the stage, by how much and what that layout asks for.

    result = check_memory_estimator(SOURCE)     # {"ok", "message", "rows"}
    measured = measure()                        # to check several sources with one launch
    check_memory_estimator(SOURCE, measured=measured)
"""
from __future__ import annotations

from ..config import ModelConfig, ParallelConfig, TrainConfig, validate
from .runner import LabError, Tripwire, call, deadline, describe, fail, load, screen

NAME = "estimate"
MODEL = ModelConfig(layers=4, hidden=32, heads=4, seq_len=32, vocab=256, dropout=0.1, name="lab")
TRAIN = TrainConfig(global_batch=8, microbatches=4, steps=1, warmup=1, eval_every=0, progress=False,
                    sample_tokens=0)
LAYOUTS = {  # what each layout asks of the estimate
    "--dp 2": (ParallelConfig(dp=2, device="cpu"),
               "each data-parallel rank holds the whole model and its optimizer state; its microbatch is "
               "global_batch / (d·m) sequences"),
    "--tp 2 --sp": (ParallelConfig(tp=2, sp=True, device="cpu"),
                    "tensor parallelism splits QKV, the projection, fc, fc2 and the embeddings over t (LayerNorms "
                    "and the row-parallel biases are replicated); sequence parallelism splits the rest of the "
                    "activations, LayerNorm inputs and dropout masks included, over t too (Table 2: 34/t)"),
    "--pp 2": (ParallelConfig(pp=2, schedule="1f1b", device="cpu"),
               "a stage holds its layers (the first also the embeddings, the last the final LayerNorm and the "
               "output layer), and 1F1B keeps the activations of min(p − stage, m) microbatches in flight"),
}
# what a component asks whatever the layout (the others: what the layout asks)
COMPONENT_HINTS = {
    "grads_bytes": "one gradient per parameter, in the parameter's dtype",
    "optimizer_bytes": "AdamW keeps two moments per parameter (exp_avg and exp_avg_sq) in the parameter's "
                       "dtype; float32 parameters are their own master copy",
}
STATES = ("params_bytes", "grads_bytes", "optimizer_bytes")
KEYS = (*STATES, "activations_bytes")
# Parameters, gradients and optimizer state are counted exactly. The activations are
# an estimate: Table 2 leaves out a few bytes per token that the measurement counts
# (LayerNorm's mean and variance, the token ids and the loss's targets), about 1 % here;
# forgetting a part of the table (the stash, sequence parallelism's 1/t) is 15 % or more.
ACT_TOL = 0.05
FORBIDDEN = ("minitron.analysis", "minitron.tools.measure")  # the engine's own estimate


def _measure_job(comm, model, train, layouts) -> dict:
    """On each of the launch's ranks: one step of `model` in every layout (a process grid
    of its own on the same ranks), measured: {layout name: (stage, bytes)}."""
    import torch.distributed as dist

    from ..comm import Comm
    from ..data import load_corpus
    from ..grid import ProcessGrid
    from ..tools.measure import measure_step_memory
    from ..train import Trainer

    corpus = load_corpus("")
    out = {}
    for name, layout in layouts.items():
        grid = ProcessGrid(tp=layout.tp, dp=layout.dp, pp=layout.pp)
        grid.rank = dist.get_rank()
        grid.build_groups()
        layout_comm = Comm(grid)
        out[name] = (layout_comm.index("pp"), measure_step_memory(Trainer(model, layout, train, layout_comm,
                                                                          corpus)))
    return out


def measure(model: ModelConfig = MODEL, train: TrainConfig = TRAIN) -> dict:
    """The bytes measured on real ranks in each of :data:`LAYOUTS`, one launch of 2 ranks:
    {layout name: {stage: measure_step_memory's dict}} (ranks of a stage agree)."""
    from ..tools.testing import run_on_ranks

    layouts = {name: lay for name, (lay, _) in LAYOUTS.items()}
    for lay in layouts.values():
        validate(model, lay, train)
    world = {lay.world for lay in layouts.values()}
    assert len(world) == 1, "the layouts share one launch: give them the same number of ranks"
    per_rank = run_on_ranks(_measure_job, ParallelConfig(dp=world.pop(), device="cpu"), model, train, layouts)
    out: dict = {name: {} for name in layouts}
    for rank, res in sorted(per_rank.items()):
        for name, (stage, got) in res.items():
            out[name].setdefault(stage, got)
    return out


def _estimates(fn, model, train) -> dict:
    """The learner's estimate for every (layout, stage), checked for shape."""
    out = {}
    for name, (layout, _) in LAYOUTS.items():
        for stage in range(layout.pp):
            got = call(f"your {NAME}", fn, model, layout, train, stage)
            if not isinstance(got, dict) or set(KEYS) - set(got):
                have = sorted(got) if isinstance(got, dict) else type(got).__name__
                raise LabError(f"your {NAME} returned {have} for {name}, stage {stage}: return a dict with the keys "
                               f"{', '.join(KEYS)}")
            try:
                out[name, stage] = {k: float(got[k]) for k in KEYS}
            except (TypeError, ValueError):
                raise LabError(f"your {NAME} returned a non-number for {name}, stage {stage}: every value is a "
                               f"count of bytes") from None
    return out


def _verdict(estimates: dict, measured: dict) -> dict:
    rows = []
    for name, (_, asks) in LAYOUTS.items():
        for stage, got in sorted(measured[name].items()):
            est = estimates[name, stage]
            rows.append({"layout": name, "stage": stage,
                         **{f"{k} est": est[k] for k in KEYS}, **{f"{k} measured": got[k] for k in KEYS}})
            for k in KEYS:
                want, mine = got[k], est[k]
                ratio = mine / want if want else float("inf")
                off = mine != want if k in STATES else abs(ratio - 1) > ACT_TOL
                if off:
                    tol = "exactly" if k in STATES else f"within {ACT_TOL:.0%}"
                    return {"ok": False, "rows": rows,
                            "message": f"{k} on {name}, stage {stage}: your estimate {mine:.0f}, measured {want} "
                                       f"({ratio:.2f}x; must agree {tol}): {COMPONENT_HINTS.get(k, asks)}"}
    return {"ok": True, "rows": rows,
            "message": f"your {NAME} equals the measured model states on {', '.join(LAYOUTS)} and comes within "
                       f"{ACT_TOL:.0%} of the measured activations on every stage"}


def _watch() -> Tripwire:
    """The engine's own estimates (every module of :mod:`minitron.analysis`) and its
    measurement, watched while the learner's estimate runs."""
    import importlib
    import pkgutil

    from .. import analysis
    from ..tools import measure as measuring

    modules = {f"minitron.analysis.{m.name}": importlib.import_module(f"minitron.analysis.{m.name}")
               for m in pkgutil.iter_modules(analysis.__path__)}
    return Tripwire({"minitron.analysis": analysis, **modules, "minitron.tools.measure": measuring})


def check_memory_estimator(source: str, measured: dict | None = None, timeout: float = 60) -> dict:
    """Lab 1: compare `estimate(model, layout, train, stage)` defined in `source` with the
    bytes measured on real ranks (:func:`measure`, or `measured` from an earlier call) in
    each of :data:`LAYOUTS`: model states exactly, activations within ``ACT_TOL``.
    Returns {"ok", "message", "rows"} (rows: estimate and measurement per layout and
    stage), or {"ok": False, "message"} naming the first problem in one line, also when
    the code does not compile, raises or runs past `timeout` seconds."""
    try:
        screen(source, (NAME,), FORBIDDEN)
        with deadline(timeout), _watch().armed():
            fn = load(source, (NAME,))[NAME]
            estimates = _estimates(fn, MODEL, TRAIN)
    except Exception as e:  # LabError, or the alarm of an endless loop
        return fail(describe(e, f"your {NAME}"))
    return _verdict(estimates, measured if measured is not None else measure())
