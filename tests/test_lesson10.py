"""Lesson 10 (modern blocks under parallelism): every graded question is answered by a figure the
lesson's own computed cells print, and the lesson's checks hold in its stored outputs (the
formulas equal the dry run, the traces equal the analysis, the layouts equal one device).
Fast: reads the stored notebook; no ranks (tests/test_notebooks.py re-runs it under nbval)."""
import re

import pytest

from minitron.course import quiz
from test_lesson_prose import assert_every_question_asked, num, out as matched, outputs


@pytest.fixture(scope="module")
def out() -> str:
    return outputs("10")  # the stored-output reader of test_lesson_prose, which covers lessons 00-09


def _number(pattern: str, _out: str) -> float:
    return num(matched("10", pattern))


WITNESS = {
    # read from the hidden solution cell: no output before a question shows its answer
    "10.kv_rows": r"llama3-70b, t = 4: kv rows per rank (\d+)",
    "10.kv_copies": r"llama3-70b, t = 32: .*copies of each kv head (\d+)",
    "10.swiglu_params": r"llama3-70b: SwiGLU MLP 3hf = ([\d,]+)",
    "10.cp_position": r"s = 128 on N = 4: rank 1's second chunk is chunk 6, its first position (\d+)",
    "10.kv_saved_per_element": r"one kv head fewer: (\d+) elements per token and key/value element",
}


def test_every_question_of_lesson_10_is_witnessed():
    assert_every_question_asked("10", WITNESS)


@pytest.mark.parametrize("qid", sorted(WITNESS))
def test_question_answered_by_the_lesson(out, qid):
    witness = _number(WITNESS[qid], out)
    assert quiz.grade(qid, witness)[0], (qid, witness, quiz.QUESTIONS[qid].answer())
    assert not quiz.grade(qid, witness * 1.01 + 1)[0]


def test_stored_outputs_show_the_checks_holding(out):
    assert "worst error over all 24 cases: 0.0 %" in out  # derived saved activations = dry run
    assert out.count("equal: True") == 5 and "equal: False" not in out  # 3 tp traces, ring, a2a
    diffs = [float(x) for x in re.findall(r"difference ([\d.e+-]+)\)", out)]
    assert len(diffs) == 4 and max(diffs[:3]) < 1e-12 and diffs[3] < 1e-6  # tp4 x kv 4, 2, 1; transformers
    assert "= chunk_ids" in out and "DIFFERENT" not in out
    assert "global angles = rows of the full table: True" in out
    # the rotary property the prose states: a shift of both positions keeps the score
    a, b, c = (float(x) for x in re.search(r"q_5·k_2 = (\S+), q_42·k_39 = (\S+), q_5·k_39 = (\S+)", out).groups())
    assert a == b and a != c
