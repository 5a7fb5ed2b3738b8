"""Every lab notebook, both ways round: a learner's untouched notebook fails where it
should and says why in one line; the solution next to it is the same notebook solved.

For every ``labs/NN_name.ipynb`` (found by glob, so a new lab is covered the day it lands)
and its ``labs/solutions/NN_name.ipynb``:

* the learner's notebook, its stubs untouched, FAILS under
  ``pytest --nbval-lax labs/NN_name.ipynb`` (the command a learner grades with), and fails
  at its grading cell (the last code cell, or one that calls a ``check_`` function) with a
  one-line message naming a function still to write. The checkers refuse a stub before
  any rank starts, so this is quick;
* outside the cells the learner fills in (those with ``# your code here``, and answers
  left as ``...``), the two notebooks are identical; every function and class of the
  learner's stub cells (also inside ``SOURCE = '''...'''``) is defined in the solution
  with the same signature, and an answer cell is the same cell with its ``...`` filled
  in; a solution may add cells after the learner's (wrong answers shown);
* the notebook opens with its objectives, a time estimate and what to read first.

That the solutions pass (``pytest --nbval``) is ``tests/test_notebooks.py``.
"""
import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LABS = sorted((ROOT / "labs").glob("*.ipynb"))
STUB = "# your code here"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def _text(cell: dict) -> str:
    return "".join(cell["source"])


def _code(path: Path) -> list[str]:
    return [_text(c) for c in _cells(path) if c["cell_type"] == "code"]


def _parse(src: str) -> ast.Module:
    """A code cell as Python (IPython's %magic and !shell lines left out)."""
    return ast.parse("\n".join(ln for ln in src.splitlines() if not ln.lstrip().startswith(("%", "!"))))


def _definitions(src: str) -> dict[str, str]:
    """{'F.forward': '(ctx, x, comm)', 'combine': '(out, lse, out_b, lse_b)', ...}: the
    functions and classes a cell defines, also in the source strings it assigns (SOURCE)."""
    found: dict[str, str] = {}

    def visit(node, prefix=""):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                found[prefix + child.name] = "class(" + ", ".join(ast.unparse(b) for b in child.bases) + ")"
                visit(child, prefix + child.name + ".")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found[prefix + child.name] = f"({ast.unparse(child.args)})"

    tree = _parse(src)
    visit(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            try:
                visit(ast.parse(node.value.value))
            except SyntaxError:
                pass
    return found


def _stubbed(src: str) -> set[str]:
    """The names (functions, methods and their classes) whose body in `src` or in the
    strings it assigns still raises NotImplementedError."""
    names: set[str] = set()

    def visit(node, cls=""):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, child.name)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if any(isinstance(n, ast.Raise) and n.exc is not None and "NotImplementedError" in ast.unparse(n.exc)
                       for n in ast.walk(child)):
                    names.update({child.name, cls} - {""})

    tree = _parse(src)
    visit(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and STUB in node.value:
            visit(ast.parse(node.value))
    return names


def _answer_blanks(src: str) -> bool:
    """Does the cell leave an answer for the learner, an `...` (Ellipsis) in its code?"""
    try:
        return any(isinstance(n, ast.Constant) and n.value is Ellipsis for n in ast.walk(_parse(src)))
    except SyntaxError:
        return False


@pytest.mark.parametrize("lab", LABS, ids=[p.stem for p in LABS])
def test_untouched_lab_fails_at_grading_with_one_line(lab):
    pytest.importorskip("nbval", reason="the course extras are not installed: pip install -e .[course]")
    code = _code(lab)
    stub_cells = [src for src in code if STUB in src]
    assert stub_cells, f"{lab.name} has no cell with `{STUB}` for the learner to fill in"
    stubbed = set().union(*(_stubbed(src) for src in stub_cells))
    assert stubbed, f"{lab.name}: its `{STUB}` cells raise no NotImplementedError"
    grading = {len(code) - 1} | {i for i, src in enumerate(code) if "check_" in src and "import" not in src}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1"}
    cmd = [sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env", "-p", "no:cacheprovider",
           "-q", "-rf", str(lab.relative_to(ROOT))]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = ANSI.sub("", p.stdout + p.stderr)
    assert p.returncode != 0, f"{lab.name} passes with its stubs untouched:\n{out[-3000:]}"
    failed = [int(n) for n in re.findall(rf"FAILED \S*{re.escape(lab.name)}::Cell (\d+)", out)]
    assert failed, f"{' '.join(cmd)} failed without a failing cell:\n{out[-3000:]}"
    assert failed[0] in grading, (f"{lab.name} fails at code cell {failed[0]}, before its grading cell "
                                  f"({sorted(grading)}): a learner must reach the checker's verdict\n{out[-3000:]}")
    errors = re.findall(r"^(?:\w+\.)*(\w*(?:Error|Exception)): (.+)$", out, flags=re.M)
    assert errors, f"{lab.name}: no exception line in the failure:\n{out[-3000:]}"
    kind, message = errors[-1]
    assert len(message) <= 300 and "Traceback" not in message, f"{lab.name}: not one short line: {message}"
    assert any(re.search(rf"\b{re.escape(name)}\b", message) for name in stubbed), (
        f"{lab.name}: the grading message does not name what is left to write ({sorted(stubbed)}): {message}")


@pytest.mark.parametrize("lab", LABS, ids=[p.stem for p in LABS])
def test_stubs_and_solutions_do_not_drift(lab):
    solution = ROOT / "labs" / "solutions" / lab.name
    assert solution.exists(), f"{lab.name} has no solution in labs/solutions/"
    mine, theirs = _cells(lab), _cells(solution)
    assert len(theirs) >= len(mine), f"{solution.name} has fewer cells than {lab.name}"
    for i, (a, b) in enumerate(zip(mine, theirs)):
        assert a["cell_type"] == b["cell_type"], f"{lab.name} cell {i}: {a['cell_type']} vs {b['cell_type']}"
        if a["cell_type"] == "code" and STUB in _text(a):
            want, got = _definitions(_text(a)), _definitions(_text(b))
            for name, signature in want.items():
                assert name in got, f"{solution.name} cell {i} does not define {name}, the learner's stub does"
                assert got[name] == signature, (f"{name}: the stub in {lab.name} cell {i} has {signature}, the "
                                                f"solution {got[name]}")
        elif a["cell_type"] == "code" and _answer_blanks(_text(a)):
            # an answer to fill in, e.g. check_question("q1", ...): the solution ends with the same cell,
            # answered (the lines that work the answer out may come first)
            pattern = ".+?".join(re.escape(part) for part in _text(a).split("..."))
            assert re.search(rf"(?:^|\n){pattern}\s*\Z", _text(b), re.S), (f"{lab.name} cell {i}: the solution is not this cell "
                                                           f"with its `...` answered: {_text(b)[:120]!r}")
        else:
            assert _text(a) == _text(b), (f"{lab.name} and its solution differ in cell {i}, which is not one the "
                                          f"learner fills in: change both")


@pytest.mark.parametrize("lab", LABS + sorted((ROOT / "labs" / "solutions").glob("*.ipynb")),
                         ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_lab_says_what_why_how_long_and_what_to_read(lab):
    cells = _cells(lab)
    first_code = next((i for i, c in enumerate(cells) if c["cell_type"] == "code"), len(cells))
    intro = "\n".join(_text(c) for c in cells[:first_code] if c["cell_type"] == "markdown")
    assert re.search(r"objective", intro, re.I), f"{lab.name}: no objectives before the first code cell"
    assert re.search(r"\b\d+\s*(?:[-–]\s*\d+\s*)?(?:min|minutes|hours?)\b", intro, re.I), (
        f"{lab.name}: no time estimate (e.g. 'about 30 minutes') before the first code cell")
    assert re.search(r"read first|before you start|prerequisite", intro, re.I), (
        f"{lab.name}: does not say what to read first (a lesson) before the first code cell")
