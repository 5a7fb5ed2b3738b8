"""The lessons' graded questions (`minitron.course.quiz`) and what every lesson must contain.

Each check is fed its right answer (computed by the quiz from the engine), a wrong one and
no answer; every lesson states objectives and a time estimate, grades at least three
questions that exist, and keeps its solutions hidden. Fast: no ranks are started.
"""
import json
import re
from pathlib import Path

import pytest

from minitron.course import quiz

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.ipynb"))


def _wrong(right):
    if isinstance(right, tuple):
        return "certainly not this"
    if isinstance(right, (list, frozenset)):
        return [x + 1 for x in sorted(right)]
    return float(right) * 1.5 + 1


@pytest.mark.parametrize("qid", quiz.questions())
def test_each_check_grades_right_and_wrong(qid, capsys):
    right = quiz.QUESTIONS[qid].answer()
    given = right[0] if isinstance(right, tuple) else right
    quiz.check(qid, given)
    assert capsys.readouterr().out.strip() == "right"
    quiz.check(qid, _wrong(right))
    out = capsys.readouterr().out.strip()
    assert out.startswith("wrong — ") and len(out) > len("wrong — ") + 10, out
    quiz.check(qid, ...)
    assert "no answer yet" in capsys.readouterr().out
    assert quiz.grade(qid, given)[0] and not quiz.grade(qid, _wrong(right))[0]


def test_answers_are_forgiving_about_form():
    assert quiz.grade("04.f_backward", "All_Reduce")[0]
    assert quiz.grade("00.dp_group", (1, 3))[0]
    assert quiz.grade("00.dp_group", [3, 1])[0]          # a group is a set: any order
    assert not quiz.grade("00.dp_group", [1, 3, 3])[0] and not quiz.grade("00.dp_group", "13")[0]
    assert quiz.grade("09.chunks", [6, 1])[0] and not quiz.grade("09.chunks", [1, 5])[0]
    assert quiz.grade("02.bubble_1f1b", "0.4375")[0]
    assert not quiz.grade("02.bubble_1f1b", "three eighths")[0]
    with pytest.raises(KeyError, match="no question"):
        quiz.grade("99.nothing", 1)


def _cells(nb):
    return json.loads(nb.read_text())["cells"]


@pytest.mark.parametrize("nb", LESSONS, ids=[p.stem for p in LESSONS])
def test_lesson_has_objectives_questions_and_hidden_solutions(nb):
    cells = _cells(nb)
    head = "".join(cells[0]["source"])
    assert "objectives" in head.lower() and re.search(r"\d+\s*min", head), \
        f"{nb.name}: the first cell states objectives and a time estimate"
    lesson = nb.name[:2]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    asked = [q for src in code for q in re.findall(r'check\("([0-9]{2}\.[a-z0-9_]+)"', src)]
    assert len(set(asked)) >= 3, f"{nb.name}: at least three graded questions"
    assert set(asked) <= set(quiz.questions(lesson)), f"{nb.name}: unknown question ids"
    for c in cells:
        src = "".join(c["source"])
        if c["cell_type"] == "code" and re.search(r'check\("', src):
            assert re.search(r'check\("[^"]+",\s*\.\.\.\)', src), \
                f"{nb.name}: a check cell is stored unanswered ({src!r})"
    solutions = [c for c in cells if c["cell_type"] == "code"
                 and c["metadata"].get("jupyter", {}).get("source_hidden")]
    assert solutions, f"{nb.name}: the solutions of its 'Try it' prompts are hidden cells"
    for c in cells:
        for o in c.get("outputs", []):
            assert o["output_type"] != "error" and o.get("name") != "stderr", \
                f"{nb.name}: tool noise or an error stored in an output: {''.join(o.get('text', ''))[:80]!r}"
    text = "".join("".join(c["source"]) for c in cells)
    assert not re.search(r"\b[Ii]ssue\s*#?\d", text), f"{nb.name}: no issue numbers"
    for src in code:
        assert not re.search(r"(?<![\w.])(?:[A-Za-z]\w*\.)+_[a-z]\w*", src), \
            f"{nb.name}: a code cell uses a private engine name: {src[:80]!r}"
