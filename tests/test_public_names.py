"""Names with one home, read from the source (AST).

* The pipeline schedule is reached by its public names only: no test, lab checker, lab or
  lesson imports or reads a private (``_name``) name of the schedule modules
  (`parallel/schedules.py`, `schedule_actions.py`, `schedule_comms.py`,
  `schedule_check.py`, `analysis/pipeline_sim.py`). The comms insertion labs and tests
  need is public (`schedule_comms.with_comms`, `with_timed_comms`), and so is the virtual
  clock (`schedule_check.execute`). (`tests/test_lab_seams.py` holds the labs to the
  engine's public names in general.)
* A constant stated once: the validation batches' first step (`data.VALIDATION_STEP`), the
  ranks' collective timeout (`config.RANK_TIMEOUT_S`), and the oracle's float64 tolerance in
  the lab checkers (`config.TOLERANCE`, the labs' `runner.TOL`).
"""
from __future__ import annotations

import ast
import json
from functools import lru_cache
from pathlib import Path

from minitron import data
from minitron.config import RANK_TIMEOUT_S, TOLERANCE
from minitron.labs.runner import TOL

from test_lab_seams import _module  # the module a `from X import` names, relative ones resolved

ROOT = Path(__file__).resolve().parent.parent
SCHEDULE_MODULES = ("minitron.parallel.schedules", "minitron.parallel.schedule_actions",
                    "minitron.parallel.schedule_comms", "minitron.parallel.schedule_check",
                    "minitron.analysis.pipeline_sim")


def _notebook_code(path: Path) -> str:
    """A notebook's code cells as one source, IPython's magics and shell lines blanked."""
    cells = json.loads(path.read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    return "\n".join("" if ln.lstrip().startswith(("%", "!")) else ln for ln in code.splitlines())


def _sources():
    """(path, source, package) of every test, lab checker, lab and lesson."""
    for path in sorted([*(ROOT / "tests").glob("*.py"), *(ROOT / "minitron" / "labs").glob("*.py")]):
        yield path, path.read_text(), "minitron.labs" if path.parent.name == "labs" else None
    for path in sorted([*(ROOT / "labs").glob("*.ipynb"), *(ROOT / "labs" / "solutions").glob("*.ipynb"),
                        *(ROOT / "lessons").glob("*.ipynb")]):
        yield path, _notebook_code(path), None


def private_schedule_names(source: str, package: str | None = None) -> list[str]:
    """'line N: module._name' for each private name of a schedule module imported, or read
    through a name bound to one (``from minitron.parallel import schedules as S``; ``S._x``)."""
    tree, modules, found = ast.parse(source), {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = _module(node, package)
            for a in node.names:
                full = f"{mod}.{a.name}"
                if full in SCHEDULE_MODULES:
                    modules[a.asname or a.name] = full
                elif mod in SCHEDULE_MODULES and a.name.startswith("_"):
                    found.append(f"line {node.lineno}: {full}")
        elif isinstance(node, ast.Import):
            modules.update({a.asname: a.name for a in node.names if a.name in SCHEDULE_MODULES and a.asname})
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in modules):
            found.append(f"line {node.lineno}: {modules[node.value.id]}.{node.attr}")
    return sorted(found, key=lambda f: int(f.split(":")[0].split()[1]))


def test_no_private_schedule_name_is_used_outside_the_engine():
    bad = {str(path.relative_to(ROOT)): found for path, source, package in _sources()
           if (found := private_schedule_names(source, package))}
    assert not bad, f"private names of the schedule modules used (make them public or use the public one): {bad}"


def test_the_scan_finds_the_old_private_routes():
    """The routes the labs and tests took before the comms insertion was public."""
    planted = ("from minitron.parallel import schedules as S\n"
               "from minitron.parallel.schedule_comms import _producer, with_comms\n"
               "import minitron.parallel.schedule_check as C\n"
               "S._with_comms(2, 1, 0, [])\nC._matches\nS.make_schedule\n")
    assert private_schedule_names(planted) == ["line 2: minitron.parallel.schedule_comms._producer",
                                               "line 4: minitron.parallel.schedules._with_comms",
                                               "line 5: minitron.parallel.schedule_check._matches"]
    assert private_schedule_names("from ..parallel.schedule_comms import _producer\n", "minitron.labs") == [
        "line 1: minitron.parallel.schedule_comms._producer"]


@lru_cache(maxsize=None)
def _nodes(path: Path) -> tuple:
    """Every AST node of a file, parsed once for the checks below."""
    return tuple(ast.walk(ast.parse(path.read_text())))


def _constants(paths, value):
    """'path:line' of every numeric literal equal to `value` (its type too: 300 is not 300.0)."""
    return [f"{p.relative_to(ROOT)}:{n.lineno}" for p in paths for n in _nodes(p)
            if isinstance(n, ast.Constant) and type(n.value) is type(value) and n.value == value]


def _package(*folders):
    return sorted(f for d in folders for f in (ROOT / d).rglob("*.py"))


def test_the_validation_step_is_stated_once():
    assert data.VALIDATION_STEP == 10_000_000
    assert _constants(_package("minitron", "benchmarks"), data.VALIDATION_STEP) == [
        f"minitron/data.py:{_line_of('minitron/data.py', 'VALIDATION_STEP = ')}"]


LAUNCHERS = ("setup_rank", "rank_session", "rank_main", "launch_local")  # launch.py's, each with a timeout_s


def test_the_rank_timeout_is_stated_once():
    """Every default of a rank's collective timeout (the launcher's, the flags', the tests'
    launches) reads `config.RANK_TIMEOUT_S`; a literal 300 elsewhere is some other figure."""
    defaults = []
    for p in _package("minitron"):
        for n in _nodes(p):
            if isinstance(n, ast.arguments):
                named = [*n.posonlyargs, *n.args][-len(n.defaults):] if n.defaults else []
                pairs = list(zip(named, n.defaults)) + [(a, d) for a, d in zip(n.kwonlyargs, n.kw_defaults) if d]
                defaults += [(p, d) for a, d in pairs if "timeout" in a.arg]
            elif isinstance(n, ast.Call):
                defaults += [(p, k.value) for k in n.keywords if k.arg in ("default", "timeout_s")]
                callee = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
                if callee in LAUNCHERS:  # the launcher's functions, the timeout passed by position
                    defaults += [(p, a) for a in n.args]
                if isinstance(n.func, ast.Attribute) and n.func.attr == "get" and n.args[:1] and \
                        isinstance(n.args[0], ast.Constant) and n.args[0].value == "timeout":
                    defaults += [(p, a) for a in n.args[1:]]
    literal = [f"{p.relative_to(ROOT)}:{d.lineno}" for p, d in defaults
               if isinstance(d, ast.Constant) and d.value == RANK_TIMEOUT_S]
    assert defaults and not literal, f"the rank timeout restated as a literal: {literal}"


def test_the_labs_compare_with_the_oracles_tolerance():
    """No lab checker restates the float64 tolerance as a literal `tol=`/`rtol=`."""
    assert TOL == TOLERANCE["float64"]
    found = [f"{p.relative_to(ROOT)}:{n.lineno}" for p in _package("minitron/labs")
             for n in _nodes(p)
             if (isinstance(n, ast.keyword) and n.arg in ("tol", "rtol") and isinstance(n.value, ast.Constant)
                 and n.value.value == TOL)
             or (isinstance(n, ast.arguments) and any(isinstance(d, ast.Constant) and d.value == TOL
                                                      for d in n.defaults))]
    assert not found, f"the float64 tolerance restated in the labs: {found}"


def _line_of(path: str, text: str) -> int:
    return next(i for i, ln in enumerate((ROOT / path).read_text().splitlines(), 1) if ln.startswith(text))
