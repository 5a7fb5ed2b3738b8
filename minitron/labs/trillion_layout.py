"""Lab 6: a layout for the trillion-parameter model of PTD-P Table 1.

Narayanan et al. (2021) trained a 1008B-parameter GPT (128 layers, h = 25600, 160 heads,
sequence 2048) on 3072 A100s with a global batch of 3072. The learner chooses the
layout, ``choose_layout() -> {"tp", "pp", "dp", "vpp", "microbatch_size"}``, reasoning
with the rules of §3 (tensor parallelism inside a node, pipeline parallelism across
nodes until the model fits, data parallelism for the rest, a microbatch size that keeps
the bubble small); the engine's own planner must not be called (it is the answer).

The checker judges the layout with the engine's models of the cluster
(:mod:`minitron.analysis.cluster`, mixed-precision Adam and the software's
recomputation, ``ptdp-2021`` by default), in this order, each failure in one line:

1. the GPUs: t·p·d equals the cluster's GPU count;
2. tensor parallelism stays within a node (t ≤ GPUs per node) and divides the heads and
   the hidden size;
3. the pipeline: p·v model chunks, at least one layer each; the global batch divides
   into d·b; interleaving (v > 1) needs p > 1 and at least p microbatches (the engine
   schedules any m ≥ p; the throughput model prices m a multiple of p);
4. the memory: :func:`~minitron.analysis.memory.memory_estimate` within the GPU's
   memory;
5. the time: the predicted iteration within ``MARGIN`` of the best layout
   :func:`~minitron.analysis.planner.plan` finds for the same cluster (the largest part
   of the difference is named: bubble, communication, compute).

Questions about the choice are graded in the notebook with :func:`check_question`
(``right`` or ``wrong — <hint>``), their answers computed by the engine.

    result = check_trillion_layout(SOURCE)   # {"ok", "message", "iteration_s", "best_s", ...}
"""
from __future__ import annotations

import math

from ..analysis import PlannedLayout, bubble_fraction, get_cluster, memory_estimate, params_per_rank, plan, predict
from ..analysis.published import PTDP_TABLE1, ptdp_model
from ..course.quiz import Question
from .runner import LabError, Tripwire, call, fail, load, screen

NAME = "choose_layout"
KEYS = ("tp", "pp", "dp", "vpp", "microbatch_size")
# the planner itself: calling it hands back the answer
FORBIDDEN = ("minitron.analysis.planner", "minitron.analysis.plan", "minitron.tools.sweep")
# a layout whose predicted iteration is at most 10 % slower than the planner's best
# passes: PTD-P's own layout (1F1B, t = 8, p = 64) is 4 % slower than the interleaved
# one, and the throughput model is itself within ~15 % of the published runs
MARGIN = 0.10
_BILLIONS, _HEADS, _HIDDEN, _LAYERS, _T, _P, GPUS, GLOBAL_BATCH, _TFLOPS = PTDP_TABLE1[-1]
MODEL = ptdp_model(_HEADS, _HIDDEN, _LAYERS)
CLUSTER = "a100-dgx"
SOFTWARE = "ptdp-2021"
# the parts of an iteration (Prediction.breakdown) a slow layout is compared by
PARTS = {"bubble": "the pipeline bubble", "tp_comm": "tensor-parallel all-reduces",
         "pp_comm": "pipeline sends", "dp_comm_exposed": "the data-parallel all-reduce",
         "compute": "compute (small matrix multiplies run below peak)", "optimizer": "the optimizer step"}


def _describe(lay: dict) -> str:
    return (f"t = {lay['tp']}, p = {lay['pp']}, d = {lay['dp']}, v = {lay['vpp']}, "
            f"b = {lay['microbatch_size']}")


def _read(out) -> dict:
    if not isinstance(out, dict) or set(KEYS) - set(out):
        got = sorted(out) if isinstance(out, dict) else type(out).__name__
        raise LabError(f"your {NAME} returned {got}: return a dict with the keys {', '.join(KEYS)}")
    lay = {k: out[k] for k in KEYS}
    bad = [k for k, x in lay.items() if isinstance(x, bool) or not isinstance(x, int) or x < 1]
    if bad:
        raise LabError(f"your {NAME} returned {bad[0]} = {lay[bad[0]]!r}: every degree is a positive integer")
    return lay


def validity_problem(lay: dict, cluster: str = CLUSTER, model=MODEL, gpus: int = GPUS,
                     global_batch: int = GLOBAL_BATCH) -> str:
    """'' when the layout can run, else the first rule it breaks (steps 1-3 above)."""
    c = get_cluster(cluster)
    t, p, d, v, b = (lay[k] for k in KEYS)
    if t * p * d != gpus:
        return (f"t·p·d = {t}·{p}·{d} = {t * p * d} GPUs, not the cluster's {gpus}: every GPU holds one "
                f"(tensor, pipeline, data) coordinate, so d = GPUs / (t·p)")
    if t > c.gpus_per_node:
        return (f"t = {t} spans {t // c.gpus_per_node} nodes of {c.gpus_per_node} GPUs: the tensor-parallel "
                f"all-reduces (several per layer and microbatch, on the critical path) would cross the network, "
                f"{c.inter_bw / c.gpus_per_node / 1e9:.0f} GB/s per GPU instead of NVLink's {c.intra_bw / 1e9:.0f}: "
                f"keep t within a node and use the pipeline across nodes")
    if model.heads % t or model.hidden % t:
        return f"t = {t} does not divide the {model.heads} heads and the hidden size {model.hidden}"
    if p * v > model.layers:
        return (f"p·v = {p}·{v} = {p * v} model chunks for {model.layers} layers: each chunk needs at least "
                f"one layer")
    if global_batch % (d * b):
        return (f"the global batch {global_batch} does not split into d·b = {d}·{b} = {d * b} sequences per "
                f"microbatch step: choose b dividing {global_batch} / d")
    m = global_batch // (d * b)
    if v > 1 and p == 1:
        return f"v = {v} model chunks per pipeline rank need a pipeline: p = 1 has no bubble to shrink"
    if v > 1 and m < p:
        return (f"v = {v} (interleaved) with m = {global_batch}/(d·b) = {m} microbatches for p = {p} stages: "
                f"the interleaved schedule needs at least p microbatches (m ≥ p); lower b or v")
    if v > 1 and m % p:
        return (f"v = {v} with m = {m} microbatches for p = {p} stages: the engine interleaves any m ≥ p (in "
                f"groups of at least p), but the throughput model prices the interleaved schedule only for m a "
                f"multiple of p (PTD-P's); choose b or d so that p divides m")
    return ""


def judge(lay: dict, cluster: str = CLUSTER, software: str = SOFTWARE) -> dict:
    """The verdict on a layout of the 1T model (steps 1-5 of the module docstring)."""
    problem = validity_problem(lay, cluster)
    if problem:
        return fail(problem)
    c = get_cluster(cluster)
    try:
        pred = predict(MODEL, lay, GLOBAL_BATCH, c, software=software)
    except ValueError as e:
        return fail(f"the throughput model cannot price {_describe(lay)}: {e}")
    if pred.memory_gb_per_gpu * 1e9 > c.memory_bytes:
        states = params_per_rank(MODEL, PlannedLayout.of(lay)) * 16 / 1e9  # mixed-precision Adam: 16 B per param
        return fail(f"{_describe(lay)} needs {pred.memory_gb_per_gpu:.0f} GB per GPU, more than the "
                    f"{c.gpu}'s {c.memory_bytes / 1e9:.0f} GB (model states alone {states:.0f} GB at 16 bytes per "
                    f"parameter): a larger p spreads the layers over more GPUs, a smaller b holds fewer activations")
    best = plan(MODEL, GPUS, GLOBAL_BATCH, c, software=software, top=1)[0]
    best_lay = {k: best[k] for k in KEYS}
    slower = pred.iteration_s / best["iteration_s"] - 1
    out = {"iteration_s": pred.iteration_s, "best_s": best["iteration_s"], "memory_gb": pred.memory_gb_per_gpu,
           "bubble_fraction": pred.bubble_fraction, "tflops_per_gpu": pred.tflops_per_gpu, "best": best_lay}
    if slower > MARGIN:
        ref = predict(MODEL, best_lay, GLOBAL_BATCH, c, software=software).breakdown
        extra = {k: pred.breakdown[k] - ref[k] for k in PARTS}
        worst = max(extra, key=extra.get)
        why = (f"the bubble is {pred.bubble_fraction:.0%} of the ideal time (m = {pred.breakdown['microbatches']} "
               f"microbatches of b = {lay['microbatch_size']} for p = {lay['pp']}: (p − 1)/m"
               f"{'/v' if lay['vpp'] > 1 else ''})" if worst == "bubble" else f"{PARTS[worst]} take longer")
        return {**out, "ok": False,
                "message": f"{_describe(lay)} fits ({pred.memory_gb_per_gpu:.0f} GB) but its predicted iteration, "
                           f"{pred.iteration_s:.1f} s, is {slower:.0%} slower than the best layout's "
                           f"({_describe(best_lay)}: {best['iteration_s']:.1f} s), more than {MARGIN:.0%}: {why}, "
                           f"{extra[worst]:.1f} s more"}
    return {**out, "ok": True,
            "message": f"{_describe(lay)} fits ({pred.memory_gb_per_gpu:.0f} GB of {c.memory_bytes / 1e9:.0f}) and "
                       f"its predicted iteration, {pred.iteration_s:.1f} s ({pred.tflops_per_gpu:.0f} TFLOP/s per "
                       f"GPU), is within {MARGIN:.0%} of the best layout's ({_describe(best_lay)}: "
                       f"{best['iteration_s']:.1f} s)"}


def _watch() -> Tripwire:
    """The planner (and the sweep that runs it), watched while the learner's function runs."""
    from ..analysis import planner
    from ..tools import sweep

    return Tripwire({"minitron.analysis.planner": planner, "minitron.tools.sweep": sweep})


def check_trillion_layout(source: str, cluster: str = CLUSTER, software: str = SOFTWARE,
                          answers: dict | None = None) -> dict:
    """Lab 6: judge the layout `choose_layout()` (defined in `source`) returns for the 1T
    model of PTD-P Table 1 on its 3072 GPUs of `cluster`: valid, fits in memory, predicted
    iteration within ``MARGIN`` of the planner's best; then `answers` (the notebook's
    ``ANSWERS``: question id -> number), each of :data:`ASKED` graded like
    :func:`check_question` (every question the lab asks counts in its verdict). Returns
    {"ok", "message", ...} with one line naming the first problem (also when the code does
    not compile, raises, is still the stub or reaches the planner, or a question is
    unanswered or wrong). Needs no ranks: the judge is the engine's throughput model."""
    try:
        screen(source, (NAME,), FORBIDDEN)
        with _watch().armed():
            fn = load(source, (NAME,))[NAME]
            lay = _read(call(f"your {NAME}", fn))
    except LabError as e:
        return fail(str(e))
    verdict = judge(lay, cluster, software)
    if not verdict["ok"] or answers is None:
        return verdict
    for qid in ASKED:
        if qid not in answers or answers[qid] is Ellipsis:
            return {**verdict, "ok": False, "message": f"your layout passes, but question {qid!r} has no answer yet: "
                                                       f"replace ... in its cell with your answer"}
        right, said = grade_question(qid, answers[qid])
        if not right:
            return {**verdict, "ok": False, "message": f"your layout passes, but your answer to question {qid!r} "
                                                       f"({answers[qid]!r}) is {said}"}
    return {**verdict, "message": verdict["message"] + f"; the {len(ASKED)} questions are answered right"}


# --- the questions ------------------------------------------------------------------------------
def _ptdp_layout() -> PlannedLayout:
    return PlannedLayout(tp=_T, pp=_P, dp=GPUS // (_T * _P), vpp=1, microbatch_size=1)


QUESTIONS: dict[str, Question] = {
    "tp_within_node": Question(
        lambda: get_cluster(CLUSTER).gpus_per_node,
        "tensor parallelism all-reduces b·s·h several times per layer: it needs NVLink, the GPUs of one node."),
    "states_gb": Question(
        lambda: params_per_rank(MODEL, _ptdp_layout()) * 16 / 1e9,
        "parameters per GPU at t = 8, p = 64 (about 1008e9 / (8·64), plus the embedding on the first stage), "
        "times 16 bytes (2 fp16 weights, 2 gradients, 12 of fp32 master weights and Adam moments), in GB.",
        rel_tol=0.02),
    "bubble_1f1b": Question(
        lambda: bubble_fraction("1f1b", _P, GLOBAL_BATCH // (GPUS // (_T * _P)), 1),
        "1F1B's bubble over the ideal time is (p − 1)/m, with m = global batch / (d·b) microbatches.",
        rel_tol=0.01),
    "bubble_interleaved": Question(
        lambda: bubble_fraction("interleaved", _P, GLOBAL_BATCH // (GPUS // (_T * _P)), 2),
        "with v chunks per rank each step is v times shorter: the bubble is (p − 1)/(v·m).", rel_tol=0.01),
    "memory_gb": Question(
        lambda: memory_estimate(MODEL, _ptdp_layout(), GLOBAL_BATCH, recompute="full")["total_bytes"] / 1e9,
        "model states plus the activations of the microbatches in flight on the first stage (p of them with "
        "1F1B; full recomputation keeps each layer's input only), in GB: memory_estimate(...)['total_bytes'].",
        rel_tol=0.05),
}


# the questions the notebook asks (graded with the layout: check_trillion_layout(..., answers=ANSWERS))
ASKED = ("tp_within_node", "states_gb", "bubble_1f1b", "bubble_interleaved")


def grade_question(question_id: str, answer) -> tuple[bool, str]:
    """(right?, 'right' or 'wrong — <hint>') for a number answering one of :data:`QUESTIONS`."""
    if question_id not in QUESTIONS:
        raise KeyError(f"no question {question_id!r}; the questions are {sorted(QUESTIONS)}")
    q = QUESTIONS[question_id]
    if answer is Ellipsis:
        return False, "no answer yet — replace ... with your answer and run the cell again"
    try:
        right = math.isclose(float(answer), float(q.answer()), rel_tol=q.rel_tol)
    except (TypeError, ValueError):
        right = False
    return (True, "right") if right else (False, f"wrong — {q.hint}")


def check_question(question_id: str, answer) -> None:
    """Print ``right`` or ``wrong — <hint>`` for `answer` to the lab's question `question_id`."""
    print(grade_question(question_id, answer)[1])
