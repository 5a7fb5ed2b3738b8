"""Lab 6's checker (``minitron.labs.trillion_layout``): PTD-P's layout and the planner's
best pass, the usual mistakes each get their own line, the questions' answers are the
engine's. No ranks: the judge is the throughput model."""
import pytest

from minitron.labs.trillion_layout import MARGIN, QUESTIONS, check_trillion_layout, grade_question

STUB = 'def choose_layout():\n    raise NotImplementedError  # your code here\n'


def layout(tp=8, pp=64, dp=6, vpp=1, b=1) -> str:
    return (f"def choose_layout():\n"
            f"    return {{'tp': {tp}, 'pp': {pp}, 'dp': {dp}, 'vpp': {vpp}, 'microbatch_size': {b}}}\n")


def test_ptdp_and_the_planners_best_pass():
    ptdp = check_trillion_layout(layout())
    assert ptdp["ok"], ptdp
    assert 0 < ptdp["iteration_s"] / ptdp["best_s"] - 1 <= MARGIN  # 1F1B: a little slower than interleaved
    best = check_trillion_layout(layout(vpp=2))
    assert best["ok"] and best["iteration_s"] == best["best_s"], best


@pytest.mark.parametrize("source, words", [
    (layout(tp=16, pp=32), "t = 16 spans 2 nodes of 8 GPUs"),
    (layout(pp=16, dp=24), "needs 145 GB per GPU, more than the A100-SXM4-80GB's 80 GB"),
    (layout(b=2), "13% slower than the best layout's (t = 8, p = 64, d = 6, v = 2, b = 1: 95.9 s), more than 10%: "
                  "the bubble is 25% of the ideal time"),
    (layout(dp=4), "t·p·d = 8·64·4 = 2048 GPUs, not the cluster's 3072"),
    (layout(vpp=2, b=16), "the interleaved schedule needs at least p microbatches (m ≥ p)"),
    (layout(vpp=3), "p·v = 64·3 = 192 model chunks for 128 layers"),
    (layout(pp=24, dp=16, vpp=2, b=3), "v = 2 with m = 64 microbatches for p = 24 stages: the engine interleaves "
                                       "any m ≥ p"),
    (layout(tp=3, pp=64, dp=16), "t = 3 does not divide the 160 heads"),
    (layout(b=5), "the global batch 3072 does not split into d·b = 6·5"),
    (STUB, "choose_layout is not written yet"),
    ("def choose_layout():\n    return (8, 64, 6, 1, 1)\n", "returned tuple: return a dict with the keys tp, pp"),
    ("def choose_layout():\n    return {'tp': 8, 'pp': 64, 'dp': 6.0, 'vpp': 1, 'microbatch_size': 1}\n",
     "returned dp = 6.0: every degree is a positive integer"),
    ("from minitron.analysis import plan\ndef choose_layout():\n    return plan()[0]\n",
     "your code uses the engine's own minitron.analysis.plan"),
    ("def choose_layout():\n    return {'tp': 8}[1]\n", "KeyError: 1 in choose_layout, line 2 of your code"),
])
def test_mistakes_get_one_line(source, words):
    res = check_trillion_layout(source)
    assert not res["ok"] and words in res["message"] and "\n" not in res["message"], res


def test_questions_are_graded_against_the_engine():
    for qid, q in QUESTIONS.items():
        assert grade_question(qid, q.answer()) == (True, "right")
        ok, msg = grade_question(qid, q.answer() * 2)
        assert not ok and msg.startswith("wrong — ")
    assert grade_question("bubble_1f1b", 63 / 512)[0]
    assert grade_question("tp_within_node", 8)[0] and not grade_question("tp_within_node", 16)[0]
    assert grade_question("states_gb", ...)[1].startswith("no answer yet")


@pytest.mark.parametrize("module", ["importlib.import_module('minitron.analysis.' + 'planner')",
                                    "sys.modules['minitron.analysis' + '.planner']",
                                    "__import__('minitron.analysis.' + 'planner', fromlist=['x'])"])
def test_the_planner_is_refused_whatever_the_route(module):
    source = f"import importlib, sys\ndef choose_layout():\n    P = {module}\n    return P.plan(None, 0, 0, None)[0]\n"
    res = check_trillion_layout(source)
    assert res["message"].startswith("your code runs the engine's own minitron.analysis.planner (from line 4 of "
                                     "your code: `return P.plan(None, 0, 0, None)[0]`)"), res


def test_every_question_counts_in_the_verdict():
    """What the old checker let through: a layout that passes with questions unanswered or
    answered wrong (check_question only printed)."""
    right = {qid: QUESTIONS[qid].answer() for qid in ("tp_within_node", "states_gb", "bubble_1f1b",
                                                       "bubble_interleaved")}
    res = check_trillion_layout(layout(vpp=2), answers=right)
    assert res["ok"] and res["message"].endswith("; the 4 questions are answered right"), res
    res = check_trillion_layout(layout(vpp=2), answers={**right, "bubble_1f1b": ...})
    assert res["message"] == ("your layout passes, but question 'bubble_1f1b' has no answer yet: replace ... in its "
                              "cell with your answer")
    res = check_trillion_layout(layout(vpp=2), answers={**right, "bubble_interleaved": 63 / 512})
    assert not res["ok"] and res["message"].startswith(
        "your layout passes, but your answer to question 'bubble_interleaved' (0.123046875) is wrong — with v chunks")
