"""Lab 07a: FP8 tensorwise (current) scaling with its amax reduction under tensor parallelism
(Micikevicius et al. 2022, "FP8 Formats for Deep Learning"; the engine's
``minitron.parallel.fp8`` tensorwise recipe, torchao's default).

The learner writes the three steps of tensorwise scaling, as the engine calls them
(``fp8.TensorScaling``):

* ``amax(x, comm, axes)``: max|x| of the *whole* tensor, as one device sees it: this rank's
  max, all-reduced (op='max') over each grid axis in `axes`, the ranks that hold the other
  shards of x (the engine passes 'tp' where the tensor's features are split, 'cp' where its
  tokens are); the ranks outside `axes` hold other tensors (another replica's batch);
* ``quantize(x, amax, fmt)``: ``(q, scale)``: scale = finfo(fmt).max / max(amax, 1e-12),
  computed in float64 and kept in float32 (the scales an FP8 GEMM takes), and
  q = clamp(x·scale, ±finfo(fmt).max) cast to `fmt` (values beyond the format saturate);
* ``fp8_format(role)``: the format of 'input', 'weight' (E4M3) and 'grad', the output
  gradient (E5M2: gradients need range more than precision).

Every rank ``exec``s the source and checks it (armed with a :class:`~.runner.Tripwire`: the
engine's own quantization is refused whatever the route): the formats; ``quantize`` on
tensors of random shapes and magnitudes in both formats, an amax below the tensor's (a
scale that saturates) and an all-zero tensor, against the scale and FP8 values the recipe
defines (an inverted scale, a float64 scale, no saturation, no floor named); ``amax`` on
shards of random sizes and magnitudes over every set of axes the layout has, by value and
by trace (no reduction, a sum, the wrong axes, the whole world, communication outside
``comm`` named). The ranks agree on the first problem; otherwise the three are handed to
the engine (``tensor.layers(fp8_scaling=...)``; nothing is patched) and a tiny GPT trains
under ``--precision fp8 --fp8-recipe tensorwise`` on ``--tp 2 --dp 2 --sp`` and then on
``--tp 2 --cp 2`` (the same 4 ranks), 2 float64 steps each, against the single-device FP8
model (1e-9; one microbatch per replica's, as tensorwise's amax spans a microbatch).

    result = check_fp8_scaling(SOURCE)   # {"ok", "message", "max_loss_abs_diff", ...}
"""
from __future__ import annotations

import itertools
import math

import torch

from ..config import ParallelConfig
from ..parallel import tensor
from ..parallel.fp8 import TensorScaling
from .runner import (LAB_GPT, LAB_GPT_STEPS, TOL, Tripwire, call, describe_calls, engine_piece, flags_of, loaded, on_each_layout, run_sources,
                     traced, training_verdict, verdict_over_runs, versus_one_device, watched)

NAMES = ("amax", "quantize", "fp8_format")
MODEL = LAB_GPT
TRAIN = LAB_GPT_STEPS
FP8 = dict(precision="fp8", fp8_recipe="tensorwise", device="cpu")
# 4 ranks laid out twice: tensor shards inside 2 replicas (a reduction over the whole world mixes
# the replicas' batches), then tensor x context (the tokens split over 'cp': a reduction over
# 'tp' alone misses them)
LAYOUTS = (ParallelConfig(tp=2, dp=2, sp=True, **FP8), ParallelConfig(tp=2, cp=2, **FP8))
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
NAMES_OF = {E4M3: "E4M3", E5M2: "E5M2"}
FLOOR = 1e-12  # the amax floor (torchao's EPS): an all-zero tensor gets a finite scale
FORBIDDEN = ("minitron.parallel.fp8",)  # the engine's quantization: every function of it
WATCHED = ("minitron.parallel.fp8.global_amax", "minitron.parallel.fp8.quantize_scaled",
           "minitron.parallel.fp8.amax_to_scale", "minitron.parallel.fp8.to_fp8",
           "minitron.parallel.fp8.tensorwise_quantize", "minitron.parallel.fp8.tensorwise_format")
# the engine's backward quantizes X and W again with the scales your forward computed
# (with your formats, looked up before the call): its own cast, not your code
REQUANTIZE = "minitron.parallel.fp8.Fp8State.requantize"
_CASE = itertools.count()  # the case number in this launch: the same on every rank
RECIPE = ("tensorwise: scale = finfo(fmt).max / amax in float64, kept in float32; "
          "q = clamp(x·scale, ±max) cast to fmt")


# --- the formats --------------------------------------------------------------------
def _check_formats(fp8_format) -> str:
    want = {"input": E4M3, "weight": E4M3, "grad": E5M2}
    for role, fmt in want.items():
        got = call(f"your fp8_format('{role}')", fp8_format, role)
        if got not in NAMES_OF:
            return (f"your fp8_format('{role}') returned {got!r}: return torch.float8_e4m3fn or "
                    f"torch.float8_e5m2")
        if got != fmt and role == "grad":
            return ("E4M3 for gradients: your fp8_format('grad') is E4M3, tensorwise quantizes the output "
                    f"gradient in E5M2 (max {torch.finfo(E5M2).max:g} against E4M3's {torch.finfo(E4M3).max:g}: "
                    "a gradient spans more binades than it needs mantissa bits)")
        if got != fmt:
            return (f"E5M2 for the {role}s: your fp8_format('{role}') is E5M2, tensorwise quantizes inputs and "
                    f"weights in E4M3 (one more mantissa bit: precision where the range suffices)")
    return ""


# --- quantize -------------------------------------------------------------------------
def _want(x: torch.Tensor, amax: torch.Tensor, fmt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The recipe's (q, scale), the checker's own arithmetic."""
    top = torch.finfo(fmt).max
    scale = (top / amax.double().clamp_min(FLOOR)).float()
    return (x.double() * scale.double()).clamp(-top, top).to(fmt), scale


def _quantize_cases(g: torch.Generator) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.dtype]]:
    """(what, x, amax, fmt): random shapes and magnitudes in both formats, an amax below the
    tensor's (saturation) and an all-zero tensor."""
    cases = []
    for i in range(4):
        shape = [int(n) for n in torch.randint(2, 12, (1 + i % 3,), generator=g)]
        mag = 10.0 ** float(torch.empty(()).uniform_(-5, 4, generator=g))
        x = torch.randn(shape, generator=g, dtype=torch.float64) * mag
        for fmt in (E4M3, E5M2):
            cases.append((f"an {NAMES_OF[fmt]} tensor of shape {shape}", x, x.abs().amax(), fmt))
    x = torch.randn(7, 5, generator=g, dtype=torch.float64) * 300
    cases.append(("an amax 8x below the tensor's (a scale from an older amax, as delayed scaling's)", x,
                  x.abs().amax() / 8, E5M2))
    cases.append(("an all-zero tensor", torch.zeros(3, 4, dtype=torch.float64), torch.zeros((), dtype=torch.float64),
                  E4M3))
    return cases


def _scale_problem(what: str, scale, want: torch.Tensor, amax: torch.Tensor, fmt: torch.dtype) -> str:
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
        return (f"your quantize returned a scale of {type(scale).__name__} for {what}: return one scale, a "
                f"tensor of one element")
    top, got = torch.finfo(fmt).max, scale.detach().double().reshape(())
    if not torch.isfinite(got):
        return (f"your scale for {what} is {got.item()}: floor the amax at {FLOOR:g} (max(amax, {FLOOR:g}), "
                f"torchao's EPS) so that an all-zero tensor gets a finite scale")
    inverse = float(amax.double().clamp_min(FLOOR)) / top
    if math.isclose(float(got), inverse, rel_tol=1e-6):
        return (f"scale inverted: your scale for {what} is amax / max = {float(got):.4g}, the recipe's is max / "
                f"amax = {float(want):.4g}: x·scale maps the amax onto the format's largest value, and the GEMM "
                f"dequantizes q / scale")
    if not math.isclose(float(got), float(want), rel_tol=1e-6):
        return (f"your scale for {what} is {float(got):.6g}, the recipe's is {float(want):.6g} = "
                f"{top:g} / {float(amax):.6g} ({RECIPE})")
    if scale.dtype != torch.float32:
        return (f"your scale is {scale.dtype}: keep it in float32, as the scales an FP8 GEMM takes (computed "
                f"in float64, then rounded once: (max / amax.double()).float())")
    if not torch.equal(scale.reshape(()), want):
        return (f"your scale for {what} differs from the recipe's in its last bits ({float(got)!r} against "
                f"{float(want)!r}): compute max / amax in float64 (amax.double()) and round once to float32")
    return ""


def _values_problem(what: str, q, want: torch.Tensor, x: torch.Tensor, fmt: torch.dtype) -> str:
    if not isinstance(q, torch.Tensor) or q.shape != x.shape:
        got = f"shape {list(q.shape)}" if isinstance(q, torch.Tensor) else type(q).__name__
        return f"your quantize returned values of {got} for {what}: return q with x's shape {list(x.shape)}"
    if q.dtype != fmt:
        return (f"your quantize returned {q.dtype} values for {what} in {NAMES_OF[fmt]}: cast x·scale to fmt "
                f"({fmt}), the FP8 grid")
    got = q.double()
    if not torch.isfinite(got).all():
        bad = int((~torch.isfinite(got)).sum())
        return (f"saturation not handled: your quantize gives {bad} inf/nan values for {what}: clamp x·scale to "
                f"±finfo(fmt).max ({torch.finfo(fmt).max:g}) before the cast (values beyond the format saturate)")
    diff = got != want.double()
    if diff.any():
        i = int(diff.flatten().nonzero()[0])
        return (f"your FP8 values for {what} differ from the recipe's at {int(diff.sum())} of {diff.numel()} "
                f"elements (first: {got.flatten()[i].item():g} against {want.double().flatten()[i].item():g}): "
                f"{RECIPE}")
    return ""


def _check_quantize(quantize) -> str:
    g = torch.Generator().manual_seed(7)
    for what, x, amax, fmt in _quantize_cases(g):
        out = call("your quantize", quantize, x.clone(), amax.clone(), fmt)
        if not isinstance(out, tuple) or len(out) != 2:
            return (f"your quantize returned {type(out).__name__} for {what}: return a pair (q, scale), the FP8 "
                    f"values and the scale")
        want_q, want_s = _want(x, amax, fmt)
        problem = _scale_problem(what, out[1], want_s, amax, fmt) or _values_problem(what, out[0], want_q, x, fmt)
        if problem:
            return problem
    return ""


# --- amax -----------------------------------------------------------------------------
def _axes_of(comm) -> list[str]:
    return [a for a in ("tp", "cp", "dp") if comm.size(a) > 1]


def _coords(comm) -> list[dict]:
    """Every rank's coordinates along the layout's axes (rank order)."""
    grid = comm.grid
    return [{a: grid.axis_index(a, r) for a in _axes_of(comm)} for r in range(grid.world)]


def _shards(comm, g: torch.Generator, shape) -> list[torch.Tensor]:
    """Every rank's shard (the same draw on every rank), its magnitude growing with the rank
    from a random start: the largest value of every group of ranks sits on its last rank,
    so that on rank 0 no reduction, each set of axes and the whole world all differ."""
    start = float(torch.empty(()).uniform_(-4, 2, generator=g))
    return [torch.randn(shape, generator=g, dtype=torch.float64) * 10.0 ** (start + 2 * r)
            for r in range(comm.grid.world)]


def _over(local: list[float], coords: list[dict], me: int, axes, reduce=max) -> float:
    """`reduce` of the ranks' local maxima over the ranks that differ from rank `me` only along `axes`."""
    keep = [a for a in coords[me] if a not in axes]
    return reduce(m for m, c in zip(local, coords) if all(c[a] == coords[me][a] for a in keep))


def _amax_problem(comm, got, calls, axes: tuple, local: list[float], coords: list[dict], what: str) -> str:
    me = comm.grid.rank
    if not isinstance(got, torch.Tensor) or got.numel() != 1:
        return (f"your amax returned {type(got).__name__ if not isinstance(got, torch.Tensor) else list(got.shape)} "
                f"for {what}: return max|x| as a tensor of one element")
    value, want = float(got.detach().double().reshape(())), _over(local, coords, me, axes)
    flags = ", ".join(f"'{a}'" for a in axes)
    split = f"split over {flags}" if axes else "whole on each rank (axes = ())"
    no_reduction = (f"no amax reduction: your amax for {what} is this rank's own max, not the whole tensor's: "
                    f"all-reduce it (comm.all_reduce(a, axis, op='max')) over each axis in axes ({flags})")
    if axes and not calls and value == local[me]:  # right here only where this rank holds the largest value
        return no_reduction
    if value != want:
        layout_axes = _axes_of(comm)
        if value == local[me]:
            return no_reduction
        if value == _over(local, coords, me, axes, sum):
            return (f"your amax for {what} is the sum of the ranks' maxima: all-reduce with op='max' "
                    f"(comm.all_reduce's default op is 'sum')")
        for n in range(1, len(layout_axes) + 1):
            for wrong in itertools.combinations(layout_axes, n):
                if value == _over(local, coords, me, wrong):
                    world = set(wrong) == set(layout_axes)
                    return ((f"amax reduced over the whole world: " if world else "amax reduced over the wrong "
                             f"axes: ") + f"your amax for {what} is the max over "
                            f"{', '.join(repr(a) for a in wrong)}, where the tensor is {split}: reduce over the axes "
                            f"given only (the ranks outside them hold other tensors: another replica's batch)")
        return f"your amax for {what} is {value:.6g}, the whole tensor's max|x| is {want:.6g}"
    reduces = [c for c in calls if c["op"] == "all_reduce"]
    if axes and not calls:
        return (f"your amax for {what} reduces without comm: use comm.all_reduce(a, axis, op='max') for each axis "
                f"(the engine sees, and traces, all communication through comm)")
    if sorted(c["axis"] for c in reduces) != sorted(axes) or len(calls) != len(axes):
        return (f"your amax for {what} communicates {describe_calls(calls)}: it needs one all-reduce (op='max') "
                f"of one element on each axis in axes ({flags or 'none'})")
    return ""


def _check_amax(comm, amax) -> str:
    g = torch.Generator().manual_seed(11)
    coords, layout_axes = _coords(comm), _axes_of(comm)
    sets = [()] + [s for n in range(1, 3) for s in itertools.combinations([a for a in layout_axes if a != "dp"], n)]
    for axes in sets:
        for _ in range(2):
            shape = [int(n) for n in torch.randint(2, 9, (2,), generator=g)]
            shards = _shards(comm, g, shape)
            local = [float(s.abs().max()) for s in shards]
            x = shards[comm.grid.rank].clone()
            got, calls = traced(comm, call, "your amax", amax, x, comm, axes)
            what = (f"a shard of shape {shape} split over {', '.join(repr(a) for a in axes)}" if axes else
                    f"a tensor of shape {shape} that no axis splits")
            problem = _amax_problem(comm, got, calls, axes, local, coords, what)
            if problem:
                return problem
    return ""


def _unit_check(comm, amax, quantize, fp8_format) -> str:
    """'' when the three pass every unit check on this rank's layout, else the first problem."""
    return _check_formats(fp8_format) or _check_quantize(quantize) or _check_amax(comm, amax)


# --- the run inside the engine ------------------------------------------------------------
def _train(comm, layout, scaling: TensorScaling, watch: Tripwire) -> dict | None:
    """The tiny GPT under tensorwise FP8 with the learner's scaling, vs the single-device FP8
    model trained on one microbatch per replica's (rank 0's verdict)."""
    from ..train import Trainer

    with watch.armed():
        tr = Trainer(MODEL, layout, TRAIN, comm, layers=tensor.layers(fp8_scaling=scaling))
        losses = [tr.step(i) for i in range(TRAIN.steps)]
    reference = TRAIN.replace(microbatches=TRAIN.microbatches * layout.data_replicas)
    return training_verdict(versus_one_device(comm, tr, losses, MODEL, reference), "tensorwise scaling", "", TOL)


def _job(comm, source: str, timeout: float) -> dict | None:
    case = next(_CASE)
    watch = Tripwire(watched(*WATCHED), allowed=(engine_piece(REQUANTIZE),))
    amax, quantize, fp8_format = loaded(comm, source, NAMES, {"torch": torch}, watch, f"fp8/{case}", timeout)
    scaling = TensorScaling(amax=amax, quantize=quantize, fmt=fp8_format)
    runs = on_each_layout(comm, LAYOUTS, f"fp8/{case}", timeout, watch,
                          lambda c: _unit_check(c, amax, quantize, fp8_format),
                          lambda c, layout: _train(c, layout, scaling, watch))
    if comm.grid.rank != 0:
        return None
    return verdict_over_runs(runs, f"your tensorwise scaling trains exactly like the single-device FP8 model "
                                   f"({flags_of(runs)})")


def check_fp8_scaling_all(sources: list[str], timeout: float = 60) -> list[dict]:
    """`check_fp8_scaling` for several sources, in as few launches as their outcomes allow."""
    return run_sources(_job, LAYOUTS[0], sources, timeout, timeout, forbidden=FORBIDDEN, names=NAMES)


def check_fp8_scaling(source: str, timeout: float = 60) -> dict:
    """Lab 07a: check `amax`, `quantize` and `fp8_format` defined in `source` on 4 gloo ranks
    (the formats; quantize's scale and FP8 values on random tensors, saturation and an
    all-zero tensor; amax's value and calls over every set of axes), then train a tiny GPT
    under ``--precision fp8 --fp8-recipe tensorwise`` with them in place of the engine's on
    ``--tp 2 --dp 2 --sp`` and ``--tp 2 --cp 2`` (float64, 2 steps each) against the
    single-device FP8 model. Returns {"ok", "message", "max_loss_abs_diff",
    "max_param_rel_diff"}, or {"ok": False, "message"} naming the first problem (also when
    the code does not compile, is still the stub, uses the engine's own quantization, raises
    or runs past `timeout` seconds)."""
    return check_fp8_scaling_all([source], timeout)[0]
