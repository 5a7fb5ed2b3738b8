"""The labs reach the engine through its seams only: no lab subclasses the
Trainer (its pieces are passed in: ``layers=``, ``schedule=``, ``data_parallel=`` whose
factory receives the model chunks, ``optimizer=``), and no lab imports or reads a private
(``_name``) name of the engine. What a lab *refuses* is named as a string (``FORBIDDEN``,
``runner.watched``), not imported. Read from the source (AST) of ``minitron/labs/*.py`` and of
every code cell of ``labs/*.ipynb`` and ``labs/solutions/*.ipynb``."""
import ast
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _sources():
    for path in sorted((ROOT / "minitron" / "labs").glob("*.py")):
        yield path.relative_to(ROOT), path.read_text(), "minitron.labs"
    for path in sorted([*(ROOT / "labs").glob("*.ipynb"), *(ROOT / "labs" / "solutions").glob("*.ipynb")]):
        cells = json.loads(path.read_text())["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        code = "\n".join("" if ln.lstrip().startswith(("%", "!")) else ln for ln in code.splitlines())
        yield path.relative_to(ROOT), code, None


def _module(node: ast.ImportFrom, package: str | None) -> str:
    """The absolute module an ``from X import`` names (relative imports inside minitron.labs)."""
    if not node.level:
        return node.module or ""
    base = package.split(".")[:len(package.split(".")) - node.level + 1] if package else []
    return ".".join(base + ([node.module] if node.module else []))


def _engine(name: str) -> bool:
    return name.startswith("minitron.") and not name.startswith("minitron.labs")


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def violations(source: str, package: str | None) -> list[str]:
    """'line N: ...' for each subclass of the Trainer and each private engine name imported or
    read (an attribute of a name bound to an engine import)."""
    tree, bound, found = ast.parse(source), {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = _module(node, package)
            for a in node.names:
                full = f"{mod}.{a.name}"
                if _engine(full):
                    bound[a.asname or a.name] = full
                    if _private(a.name):
                        found.append(f"line {node.lineno}: imports {full}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if _engine(a.name + "."):
                    bound[a.asname or a.name.split(".")[0]] = a.asname and a.name or a.name.split(".")[0]
                    if any(_private(p) for p in a.name.split(".")):
                        found.append(f"line {node.lineno}: imports {a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                found.append(f"line {node.lineno}: reads {ast.unparse(node)} ({bound[base.id]})")
        elif isinstance(node, ast.ClassDef):
            for b in node.bases:
                name = ast.unparse(b)
                if name.split(".")[-1] == "Trainer" or bound.get(name, "").endswith(".Trainer"):
                    found.append(f"line {node.lineno}: class {node.name} subclasses the Trainer ({name})")
    return found


@pytest.mark.parametrize("path,source,package", list(_sources()), ids=lambda v: str(v) if isinstance(v, pathlib.Path) else "")
def test_no_lab_subclasses_the_trainer_or_reads_a_private_engine_name(path, source, package):
    assert not violations(source, package), f"{path}: {violations(source, package)}"


def test_the_scan_finds_what_it_forbids():
    planted = '''
from ..train import Trainer
from ..parallel.tensor import _F
from ..parallel import zero
import minitron.parallel.tensor as t

class Mine(Trainer):
    pass

x = zero.ShardedDataParallel._gather
y = t._G
ok = zero.ShardedDataParallel.__init__
'''
    found = violations(planted, "minitron.labs")
    assert sorted(f.split(":")[0] for f in found) == ["line 10", "line 11", "line 3", "line 7"], found
    assert violations("from .runner import _frames\n", "minitron.labs") == []  # the labs' own helpers
