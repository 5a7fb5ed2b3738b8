"""The lessons run and reproduce their stored outputs (`pytest --nbval`).

Each notebook runs in its own `python -m pytest --nbval` subprocess from the repository
root (the kernel is this environment's Python): every cell must run without an error
and print what the notebook stores, except cells marked `# NBVAL_IGNORE_OUTPUT`
(timings, paths). Images are not compared, their text is. A notebook that starts
ranks of its own (`run_cli`, `run_on_ranks`, a lab checker) is marked `multirank`. Of the
labs only the solutions run: a learner's unsolved lab fails its grading cell by design.

After changing a lesson or an engine function it calls, store fresh outputs with
`.venv/bin/jupyter nbconvert --to notebook --execute --inplace lessons/NN_topic.ipynb`.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "lessons").glob("*.ipynb"))
LAB_SOLUTIONS = sorted((ROOT / "labs" / "solutions").glob("*.ipynb"))


def _param(nb: Path):
    starts_ranks = any(s in nb.read_text() for s in ("run_cli(", "run_on_ranks(", "minitron.labs"))
    return pytest.param(nb, id=nb.stem, marks=[pytest.mark.multirank] if starts_ranks else [])


@pytest.mark.parametrize("notebook", [_param(nb) for nb in NOTEBOOKS + LAB_SOLUTIONS])
def test_lesson_notebook(notebook):
    pytest.importorskip("nbval", reason="the course extras are not installed: pip install -e .[course]")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pytest", "--nbval", "--nbval-current-env", "-q",
           "-p", "no:cacheprovider", str(notebook.relative_to(ROOT))]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"{' '.join(cmd)} failed:\n{p.stdout[-6000:]}\n{p.stderr[-2000:]}"


def test_lessons_exist():
    names = {nb.name for nb in NOTEBOOKS}
    assert {"01_memory_and_flops.ipynb", "02_pipeline_schedules.ipynb"} <= names


@pytest.mark.parametrize("notebook", [pytest.param(nb, id=f"{nb.parent.name}/{nb.stem}")
                                      for nb in NOTEBOOKS + LAB_SOLUTIONS + sorted((ROOT / "labs").glob("*.ipynb"))])
def test_stored_outputs_are_what_the_cells_print_for_the_learner(notebook):
    """No stored output is tool noise: nothing a command or library writes on stderr (a
    command's progress lines, a library's warnings), no internal issue references. (nbval
    does not see the kernel's stderr, so a stored stderr stream would also not reproduce.)"""
    import json
    import re

    for i, cell in enumerate(json.loads(notebook.read_text())["cells"]):
        for out in cell.get("outputs", []):
            text = "".join(out.get("text", []) or out.get("data", {}).get("text/plain", []))
            assert out.get("name") != "stderr", f"{notebook.name} cell {i} stores stderr: {text[:200]!r}"
            assert not re.search(r"\bissues? #?\d+\b", text, re.I), f"{notebook.name} cell {i}: {text[:200]!r}"
