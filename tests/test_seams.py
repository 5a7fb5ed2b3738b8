"""The package's seams, read from its source: imports flow one way, no import cycles,
no module patches another.

Every `import` and `from ... import` is parsed, function-level ones included (a lazy
import is still a dependency). The engine's layers, lowest first:

    config, placement, grid, model_flops → comm, data, tokenizer, optim, checkpoint, recompute, launch, preemption, hf, corpus, rope
    → context → parallel/ → moe, mla → mtp → model → train → fault_tolerance

and around them, never imported by the engine: analysis/, viz/, tools/, course/, labs/.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "minitron"

ENGINE_LAYERS = [
    {"config", "placement", "grid", "model_flops"},
    {"comm", "data", "tokenizer", "optim", "checkpoint", "dcp_format", "recompute", "launch", "preemption", "hf",
     "hf_moe", "hf_deepseek", "hf_families", "corpus", "rope"},
    {"context"},
    {"parallel"},
    {"moe", "mla"},
    {"mtp"},
    {"model"},
    {"train"},
    {"fault_tolerance"},
]
TOOLING = {"analysis", "viz", "tools", "course", "labs"}


def _modules() -> dict[str, Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        parts = f.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


MODULES = _modules()


def _targets(name: str, node: ast.AST) -> set[str]:
    """The package modules an import statement in module `name` loads."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in MODULES}
    pkg = name if MODULES[name].name == "__init__.py" else name.rsplit(".", 1)[0]
    if node.level:
        base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    found = {target} if target in MODULES else set()
    found |= {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES}
    return found


def _imports() -> dict[str, set[str]]:
    edges = {}
    for name, f in MODULES.items():
        tree = ast.parse(f.read_text())
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps |= _targets(name, node)
        edges[name] = deps - {name, "minitron"}  # the package's __init__ is its public face
    return edges


EDGES = _imports()


def _top(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def _layer(name: str) -> int | None:
    for i, layer in enumerate(ENGINE_LAYERS):
        if _top(name) in layer:
            return i
    return None


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(EDGES[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(EDGES):
        if v not in index:
            visit(v)
    return out


def test_the_checker_sees_the_package():
    # a checker that parsed nothing would pass everything
    assert {"minitron.train", "minitron.parallel.tensor", "minitron.tools.cli", "minitron.analysis.memory"} <= set(MODULES)
    assert "minitron.model" in EDGES["minitron.train"]


def test_no_import_cycles():
    cycles = _cycles()
    assert not cycles, "import cycles (lazy imports count): " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_engine_never_imports_the_tooling():
    bad = [f"{m} -> {d}" for m in sorted(EDGES) if _layer(m) is not None
           for d in sorted(EDGES[m]) if _top(d) in TOOLING]
    assert not bad, "the engine imports tooling/teaching layers: " + ", ".join(bad)


def test_engine_layers_import_downwards():
    bad = [f"{m} -> {d}" for m in sorted(EDGES) if _layer(m) is not None
           for d in sorted(EDGES[m]) if _layer(d) is not None and _layer(d) > _layer(m)]
    assert not bad, "an engine layer imports a higher one: " + ", ".join(bad)


TENSOR_MODES = {"minitron.parallel.tensor", "minitron.parallel.summa", "minitron.parallel.cube"}


def test_no_tensor_parallel_mode_imports_a_sibling():
    """What the 1-D, 2-D and 3-D modes share lives in parallel/ops.py and parallel/layers.py."""
    assert TENSOR_MODES <= set(MODULES)
    bad = [f"{m} -> {d}" for m in sorted(TENSOR_MODES) for d in sorted(EDGES[m]) if d in TENSOR_MODES - {m}]
    assert not bad, "a tensor-parallel mode imports a sibling mode: " + ", ".join(bad)


def _module_aliases(tree: ast.AST) -> set[str]:
    """Names bound to modules in a file (`import x`, `from . import y`, `import a.b as c`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name.split(".")[0]) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                base = "." * node.level + (node.module or "")
                # `from pkg import mod`: a module when pkg.mod is one of ours or a known stdlib/torch module
                if node.level and not node.module or f"{base}.{a.name}".lstrip(".") in MODULES:
                    names.add(a.asname or a.name)
    return names


def _assigned_attributes(tree: ast.AST):
    """(line, node) for each attribute assigned (`a.b = ...`, `a.b += ...`, `x, a.b = ...`)
    and each `setattr` call. Item assignment (`os.environ[k] = v`) changes a container's
    contents, not an attribute, and is not listed."""
    def attributes(target):
        if isinstance(target, ast.Attribute):
            yield target
        elif isinstance(target, (ast.Tuple, ast.List)):
            for t in target.elts:
                yield from attributes(t)
        elif isinstance(target, ast.Starred):
            yield from attributes(target.value)

    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for sub in attributes(t):
                yield node.lineno, sub
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            yield node.lineno, node


def test_no_module_patches_another():
    """No assignment to an imported module's attribute, and no `setattr` at all except on
    `self`/`cls` (a setattr on anything else is a patch the reader cannot see)."""
    bad = []
    for name, f in MODULES.items():
        tree = ast.parse(f.read_text())
        aliases = _module_aliases(tree)
        for line, node in _assigned_attributes(tree):
            where = f"{f.relative_to(PKG.parent)}:{line}"
            if isinstance(node, ast.Call):
                target = node.args[0] if node.args else None
                if not (isinstance(target, ast.Name) and target.id in {"self", "cls"}):
                    bad.append(f"{where} setattr({ast.unparse(target) if target else ''}, ...)")
            elif isinstance(node.value, ast.Name) and node.value.id in aliases:
                bad.append(f"{where} assigns {node.value.id}.{node.attr}")
    assert not bad, "modules patched: " + "; ".join(bad)


def test_no_assignment_to_another_objects_private_attribute():
    """`x._name = ...` only on `self` (or `cls`): a lab or a measurement injects through
    public arguments instead of reaching into another object's privates."""
    bad = []
    for f in MODULES.values():
        for line, node in _assigned_attributes(ast.parse(f.read_text())):
            if isinstance(node, ast.Call):
                name = node.args[1] if len(node.args) > 1 else None
                if (isinstance(name, ast.Constant) and isinstance(name.value, str) and name.value.startswith("_")
                        and not name.value.startswith("__")):
                    bad.append(f"{f.relative_to(PKG.parent)}:{line} setattr(..., {name.value!r})")
                continue
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            own = isinstance(node.value, ast.Name) and node.value.id in {"self", "cls"}
            where = f"{f.relative_to(PKG.parent)}:{line}"
            if private and not own:
                bad.append(f"{where} .{node.attr}")
    assert not bad, "assignments to another object's private attribute: " + "; ".join(bad)


# --- a Comm holds no state set from outside ----------------------------------------
COMM = PKG / "comm.py"


def _comm_attributes() -> set[str]:
    """Every attribute of a ``Comm``: those ``Comm.__init__`` sets, and the names its class
    body defines (methods and the read-only properties trace, phase, step, microbatch, wire_dtype)."""
    cls = next(n for n in ast.parse(COMM.read_text()).body if isinstance(n, ast.ClassDef) and n.name == "Comm")
    names = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    names |= {t.attr for _, t in _assigned_attributes(init) if isinstance(t, ast.Attribute)}
    return names | {n.lstrip("_") for n in names}


def _comm_bound_names(tree: ast.AST) -> set[str]:
    """Names a file binds to a Comm: `x = Comm(...)`, `x = setup_rank(...)`, `x = ….with_wire_dtype(...)`,
    and parameters annotated `Comm`."""
    makers = {"Comm", "setup_rank", "with_wire_dtype"}
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            f = node.value.func
            if (f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)) in makers:
                out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.arg) and node.annotation is not None and "Comm" in ast.unparse(node.annotation):
            out.add(node.arg)
    return out


def comm_assignments(source: str, path: str = "<source>") -> list[str]:
    """`path:line x.attr` for each assignment (or setattr) to an attribute of a Comm in
    `source`: on an expression ending in a name that says comm (`comm`, `tr.comm`,
    `ctx.comm`, `c_comm`) or a name bound to a Comm in the file."""
    tree, attrs = ast.parse(source), _comm_attributes()
    bound = _comm_bound_names(tree)

    def is_comm(e) -> bool:
        last = e.attr if isinstance(e, ast.Attribute) else e.id if isinstance(e, ast.Name) else ""
        return "comm" in last.lower() or (isinstance(e, ast.Name) and e.id in bound)

    bad = []
    for line, node in _assigned_attributes(tree):
        if isinstance(node, ast.Call):
            target = node.args[0] if node.args else None
            if target is not None and is_comm(target):
                bad.append(f"{path}:{line} setattr({ast.unparse(target)}, ...)")
        elif node.attr in attrs and is_comm(node.value):
            bad.append(f"{path}:{line} {ast.unparse(node)}")
    return bad


def test_nothing_outside_comm_assigns_to_a_comm():
    """The trace is installed for a scope (``Comm.tracing``), the step and microbatch labels
    too (``Comm.labelled``), the phase by ``Comm.in_phase``, the wire dtype where the Comm is
    made: no module of minitron/ (the labs' code, minitron/labs, included) assigns to a
    Comm's attributes; and the scan finds the assignments the engine used to make."""
    bad = [b for name, f in MODULES.items() if f != COMM
           for b in comm_assignments(f.read_text(), str(f.relative_to(PKG.parent)))]
    assert not bad, "assignments to a Comm's attributes outside comm.py: " + "; ".join(bad)
    planted = ("def f(tr, ctx, comm, x: 'Comm'):\n    tr.comm.trace = None\n    ctx.comm.wire_dtype = 1\n"
               "    comm.step, comm.microbatch = 0, None\n    x.phase = 'fwd'\n    setattr(comm, 'trace', None)\n"
               "    c = Comm()\n    c.trace = None\n    tr.step = 3\n")
    assert sorted(b.split(" ", 1)[1] for b in comm_assignments(planted)) == sorted([
        "tr.comm.trace", "ctx.comm.wire_dtype", "comm.step", "comm.microbatch", "x.phase",
        "setattr(comm, ...)", "c.trace"])


# a layout (ParallelConfig, PlannedLayout) or a TrainConfig read loosely: a getattr with a
# default, a dict-or-attribute reader, a dict taken in its place
_LOOSE_LAYOUT = re.compile(r'getattr\((layout|parallel|train|lay|L)\b, "\w+", |\blayout_get\(|'
                           r'isinstance\((layout|parallel|lay), dict\)')


def loose_layout_reads(source: str, name: str = "<source>") -> list[str]:
    """``name:line`` of each loose read of a layout in `source`."""
    return [f"{name}:{i}" for i, line in enumerate(source.splitlines(), 1) if _LOOSE_LAYOUT.search(line)]


def test_layouts_are_read_by_their_fields():
    """One layout type, read by attribute: no module of minitron/ reads a layout or a train
    config through a getattr with a default or a dict-or-attribute reader (a field misspelled
    or missing there reads as its default); and the scan finds the readers it replaced."""
    bad = [b for f in MODULES.values() for b in loose_layout_reads(f.read_text(), str(f.relative_to(PKG.parent)))]
    assert not bad, "loose reads of a layout: " + "; ".join(bad)
    planted = ('t = int(layout_get(layout, "tp", 1) or 1)\nep = getattr(layout, "ep", 1)\n'
               'e = getattr(train, "dtype", "float32")\nif isinstance(layout, dict):\n    pass\n'
               't = layout.tp\nname = getattr(fn, "__name__", "rank")\n')
    assert loose_layout_reads(planted) == ["<source>:1", "<source>:2", "<source>:3", "<source>:4"]


def test_no_lazy_name_is_also_a_submodule():
    """A package that imports its names on first use (PEP 562) must not export a name that is
    also one of its submodules: importing the submodule binds the name to the module, and
    `from package import name` then returns the module or the function by import order."""
    import importlib
    import pkgutil

    for package, homes in (("minitron", "_HOMES"), ("minitron.analysis", "_HOMES")):
        pkg = importlib.import_module(package)
        submodules = {m.name for m in pkgutil.iter_modules(pkg.__path__)}
        clashes = sorted(set(getattr(pkg, homes)) & submodules)
        assert not clashes, f"{package} exports {clashes}, also its submodules' names"


# --- the command line split by command ----------------------------------------------
TOOLS_MODULE_LINES, TOOLS_FUNCTION_LINES = 400, 60


def test_tools_modules_and_functions_are_short():
    """No module of minitron/tools/ (commands/ included) over 400 lines and no function there
    over 60 (ast: end_lineno - lineno + 1): one module per command or family, each readable."""
    tools = sorted((PKG / "tools").rglob("*.py"))
    assert {"cli.py", "preflight.py", "options.py", "train.py"} <= {f.name for f in tools}
    long_modules = [f"{f.relative_to(PKG.parent)} {n}" for f in tools
                    if (n := len(f.read_text().splitlines())) > TOOLS_MODULE_LINES]
    long_functions = [f"{f.relative_to(PKG.parent)}:{node.lineno} {node.name} {n}" for f in tools
                      for node in ast.walk(ast.parse(f.read_text()))
                      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                      and (n := node.end_lineno - node.lineno + 1) > TOOLS_FUNCTION_LINES]
    assert not long_modules, f"modules of minitron/tools/ over {TOOLS_MODULE_LINES} lines: " + ", ".join(long_modules)
    assert not long_functions, (f"functions in minitron/tools/ over {TOOLS_FUNCTION_LINES} lines: "
                                + ", ".join(long_functions))


LONG_FUNCTION_LINES = 60  # a function longer than this is split
MAX_LONG_FUNCTIONS = 5
# The functions still over LONG_FUNCTION_LINES (none in minitron/tools/, whose own test
# holds every function to 60): none may be added, and an entry that has been split must
# leave the list (it is exact).
LONG_FUNCTIONS = {
    "minitron/analysis/comm.py:comm_items",
    "minitron/config.py:validate_parallel",
    "minitron/launch.py:launch_local",
    "minitron/parallel/schedules.py:_dualpipe_v",
    "minitron/parallel/schedule_check.py:execute",
}


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, lines) of every function and method in `tree`, nested ones included;
    lines counted as end_lineno − lineno + 1 (decorators not counted)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node.end_lineno - node.lineno + 1
            yield from _functions(node, prefix + node.name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")
        else:
            yield from _functions(node, prefix)


def long_functions() -> dict[str, int]:
    """{"path:qualified name": lines} of minitron/'s functions over LONG_FUNCTION_LINES."""
    out = {}
    for f in sorted(MODULES.values()):
        path = f.relative_to(PKG.parent).as_posix()
        for name, lines in _functions(ast.parse(f.read_text())):
            if lines > LONG_FUNCTION_LINES:
                out[f"{path}:{name}"] = lines
    return out


def test_at_most_five_long_functions():
    """At most MAX_LONG_FUNCTIONS functions of minitron/ are over LONG_FUNCTION_LINES lines,
    exactly those of LONG_FUNCTIONS, none new; and the counter sees a long one."""
    long = long_functions()
    listed = ", ".join(f"{k} ({n} lines)" for k, n in sorted(long.items(), key=lambda kv: -kv[1]))
    new = sorted(set(long) - LONG_FUNCTIONS)
    assert not new, f"functions over {LONG_FUNCTION_LINES} lines: {', '.join(new)}: split them (all: {listed})"
    assert len(long) <= MAX_LONG_FUNCTIONS, f"{len(long)} functions over {LONG_FUNCTION_LINES} lines: {listed}"
    split = sorted(LONG_FUNCTIONS - set(long))
    assert not split, f"no longer over {LONG_FUNCTION_LINES} lines, remove from LONG_FUNCTIONS: {', '.join(split)}"
    planted = "class A:\n    def f(self):\n        def g():\n" + "            pass\n" * 61
    assert dict(_functions(ast.parse(planted))) == {"A.f": 63, "A.f.g": 62}
