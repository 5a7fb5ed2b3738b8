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
``ACT_TOL`` of the activations. Sizes no launch measures, which the learner cannot
special-case, are compared with the engine's own count of the same bytes
(:func:`minitron.analysis.memory.memory_on_rank`, which the measurement equals):
:data:`GENERAL` (a vocabulary that needs padding, t = 3, m < p, bf16 mixed precision's
model states) in :data:`GENERAL_LAYOUTS`.
The first component off is named in one line, with the layout, the stage, by how much,
the usual mistake that accounts for it (an unpadded vocabulary, biases or LayerNorms left
out, 2-byte parameters under bf16, the attention's dropout mask forgotten, more microbatches in flight than m) or else
what that layout asks for.

    result = check_memory_estimator(SOURCE)     # {"ok", "message", "rows"}
    measured = measure()                        # to check several sources with one launch
    check_memory_estimator(SOURCE, measured=measured)
"""
from __future__ import annotations

from ..config import ModelConfig, ParallelConfig, TrainConfig, pad_vocab, validate
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
# sizes no launch measures (the engine's own count instead): a vocabulary of 257 padded to
# a multiple of t, t = 3, and m = 2 microbatches on p = 3 stages (1F1B keeps min(p − stage, m))
GENERAL = ModelConfig(layers=6, hidden=48, heads=6, seq_len=24, vocab=257, dropout=0.1, name="lab-general")
GENERAL_TRAIN = TrainConfig(global_batch=12, microbatches=2, steps=1, warmup=1, eval_every=0, progress=False,
                            sample_tokens=0)
GENERAL_LAYOUTS = {
    "--dp 3": (ParallelConfig(dp=3, device="cpu"), LAYOUTS["--dp 2"][1]),
    "--tp 3 --sp": (ParallelConfig(tp=3, sp=True, device="cpu"),
                    LAYOUTS["--tp 2 --sp"][1] + "; the vocabulary is padded to a multiple of t"),
    "--tp 2 --pp 3 --sp": (ParallelConfig(tp=2, pp=3, sp=True, schedule="1f1b", device="cpu"),
                           LAYOUTS["--pp 2"][1] + ", split over t as on --tp"),
    "--dp 3 --precision bf16": (ParallelConfig(dp=3, precision="bf16", device="cpu"),
                                "bf16 mixed precision keeps the float32 parameters, gradients and moments"),
}
# Under bf16 autocast only the model states are compared: autocast also saves bf16 copies
# of the weights for the backward, which Table 2 does not count (on MODEL, --dp 2, the
# measured activations are 1.5x the engine's Table-2 count in 2-byte elements; the
# measured model states equal the count).
STATES_ONLY = {"--dp 3 --precision bf16"}
# Parameters, gradients and optimizer state are counted exactly. The activations are
# an estimate: Table 2 leaves out a few bytes per token that the measurement counts
# (LayerNorm's mean and variance, the token ids and the loss's targets): Table 2 is
# 0.61-0.75 % under the measurement on MODEL's three layouts and 0.36-0.56 % under the
# engine's count on GENERAL's. Forgetting the attention's dropout mask is 4 % here, a
# part of the table (the stash, sequence parallelism's 1/t) 15 % or more.
ACT_TOL = 0.015
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


def _estimates(fn, model, train, layouts) -> dict:
    """The learner's estimate for every (layout, stage) of `layouts`, checked for shape."""
    out = {}
    for name, (layout, _) in layouts.items():
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


def _vectors(model: ModelConfig, layout: ParallelConfig, stage: int) -> tuple[int, int, int]:
    """(norms, final norm, other biases): the local elements of the LayerNorms' weights and
    biases (the final one's apart) and of the linear layers' biases on a rank of `stage`,
    read from the engine's own model of that stage (its modules built on fake tensors)."""
    from ..analysis.dry_run import named_params
    from ..analysis.params import rank_chunks

    named = named_params(model, layout, rank_chunks(model, layout, stage))
    # the model names its norms ln1, ln2 (each block) and ln_f (the last stage)
    norm = {name: n for name, n in named if name.rpartition(".")[0].split(".")[-1].startswith("ln")}
    return (sum(norm.values()), sum(n for name, n in norm.items() if name.startswith("ln_f.")),
            sum(n for name, n in named if name.endswith(".bias") and name not in norm))


def _mistake(k: str, mine: float, want: float, model: ModelConfig, layout: ParallelConfig, train: TrainConfig,
             stage: int) -> str:
    """The usual mistake that accounts for `mine` instead of `want` (component `k` on
    `stage`), or '' when none does."""
    h, s, a, t, p = model.hidden, model.seq_len, model.heads, layout.tp, layout.pp
    e = 8 if train.dtype == "float64" else 4
    first, last = stage == 0, stage == p - 1
    if k in STATES and layout.precision == "bf16" and 2 * mine == want:
        return ("you count 2-byte parameters under bf16 mixed precision: the parameters stay float32, their own "
                "master copy (autocast casts bf16 copies for the matmuls), and so do the gradients and AdamW's moments")
    layers = model.layers // p
    if k in STATES:
        missing = (want - mine) / (2 * e if k == "optimizer_bytes" else e)  # parameters
        vp, tables = pad_vocab(model.vocab, t), first + last
        norms, final, biases = _vectors(model, layout, stage)
        known = [
            ((vp // t - model.vocab / t) * h * tables, (vp // t - model.vocab // t) * h * tables,
             f"you count the vocabulary unpadded: the embedding and the output layer hold it padded to a multiple "
             f"of t ({model.vocab} → {vp} rows, {vp // t} per rank)"),
            (biases, "you leave out the biases: QKV's and fc's split over t, the projection's and fc2's replicated"),
            (norms - final, norms,
             "you leave out the LayerNorms' weights and biases (two per layer, and the final one on the last stage)"),
        ]
        for *amounts, what in known:
            if any(n and abs(missing - n) < 0.5 for n in amounts):
                return what
        return ""
    b = train.global_batch // (layout.dp * train.microbatches)
    stash, flight = min(p - stage, train.microbatches), p - stage
    if flight != stash and abs(mine / want - flight / stash) <= ACT_TOL:
        return (f"you keep p − stage = {flight} microbatches in flight, but there are only m = "
                f"{train.microbatches}: 1F1B keeps min(p − stage, m)")
    mask = stash * layers * a * s * s * b / t  # attention's dropout mask, 1 byte per score
    if abs((want - mine) - mask) <= ACT_TOL * want:
        return ("you leave out the attention's dropout mask: Table 2's 5as/h counts its scores (2 bytes), "
                "their softmax (2 bytes) and the mask (1 byte) per score")
    return ""


def _verdict(estimates: dict, measured: dict, general: dict) -> dict:
    """The first component off, over MODEL's measured layouts then GENERAL's counted ones."""
    rows = []
    cases = [(name, LAYOUTS, MODEL, TRAIN, measured[name], "measured") for name in LAYOUTS]
    cases += [(name, GENERAL_LAYOUTS, GENERAL, GENERAL_TRAIN, general[name], "the engine counts")
              for name in GENERAL_LAYOUTS]
    for name, layouts, model, train, counts, source in cases:
        layout, asks = layouts[name]
        for stage, got in sorted(counts.items()):
            est = estimates[model.name, name, stage]
            states_only = name in STATES_ONLY and model is GENERAL
            rows.append({"model": model.name, "layout": name, "stage": stage, "activations compared": not states_only,
                         **{f"{k} est": est[k] for k in KEYS}, **{f"{k} measured": got[k] for k in KEYS}})
            for k in STATES if states_only else KEYS:
                want, mine = got[k], est[k]
                ratio = mine / want if want else float("inf")
                off = mine != want if k in STATES else abs(ratio - 1) > ACT_TOL
                if off:
                    tol = "exactly" if k in STATES else f"within {ACT_TOL:.1%}"
                    where = name if model is MODEL else (
                        f"{name} of a {model.layers}-layer GPT with h = {model.hidden}, vocabulary {model.vocab}, "
                        f"m = {train.microbatches}")
                    hint = (_mistake(k, mine, want, model, layout, train, stage)
                            or COMPONENT_HINTS.get(k, asks))
                    return {"ok": False, "rows": rows,
                            "message": f"{k} on {where}, stage {stage}: your estimate {mine:.0f}, {source} {want:.0f} "
                                       f"({ratio:.2f}x; must agree {tol}): {hint}"}
    return {"ok": True, "rows": rows,
            "message": f"your {NAME} equals the measured model states on {', '.join(LAYOUTS)} and comes within "
                       f"{ACT_TOL:.1%} of the measured activations on every stage, and as close to the engine's count "
                       f"on {', '.join(n for n in GENERAL_LAYOUTS if n not in STATES_ONLY)} of a larger GPT "
                       f"(vocabulary {GENERAL.vocab}, m = {GENERAL_TRAIN.microbatches}), model states also on "
                       f"{', '.join(STATES_ONLY)}"}


def counted(model: ModelConfig = GENERAL, train: TrainConfig = GENERAL_TRAIN) -> dict:
    """The engine's own count of the bytes in each of :data:`GENERAL_LAYOUTS`:
    {layout name: {stage: memory_on_rank's dict}} (no ranks start)."""
    from ..analysis.memory import memory_on_rank

    return {name: {stage: memory_on_rank(model, layout, train, stage) for stage in range(layout.pp)}
            for name, (layout, _) in GENERAL_LAYOUTS.items()}


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
    each of :data:`LAYOUTS`, and with the engine's count (:func:`counted`) in each of
    :data:`GENERAL_LAYOUTS`: model states exactly, activations within ``ACT_TOL``.
    Returns {"ok", "message", "rows"} (rows: estimate and measurement per layout and
    stage), or {"ok": False, "message"} naming the first problem in one line, also when
    the code does not compile, raises or runs past `timeout` seconds."""
    try:
        screen(source, (NAME,), FORBIDDEN)
        with deadline(timeout), _watch().armed():
            fn = load(source, (NAME,))[NAME]
            estimates = {(MODEL.name, *key): v for key, v in _estimates(fn, MODEL, TRAIN, LAYOUTS).items()}
            estimates |= {(GENERAL.name, *key): v
                          for key, v in _estimates(fn, GENERAL, GENERAL_TRAIN, GENERAL_LAYOUTS).items()}
    except Exception as e:  # LabError, or the alarm of an endless loop
        return fail(describe(e, f"your {NAME}"))
    return _verdict(estimates, measured if measured is not None else measure(), counted())
