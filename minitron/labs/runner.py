"""What every lab checker shares: the learner's code, ranks that always report, one-line verdicts.

The learner's code arrives as *source text* (a class or function defined in a notebook
cannot be pickled to a forkserver rank). Whatever it does, the checker answers with a
dict, never a traceback or a hang: ``{"ok": True, ...}`` or ``{"ok": False, "message":
one line naming what is wrong}``:

* it does not compile              -> the line and the parser's complaint (no rank starts)
* it uses the engine's own piece   -> :func:`refuse_engine_copy`: which one, and the line
  (no rank starts; every checker lists its engine names in ``FORBIDDEN``)
* it runs the engine's own piece   -> :class:`Tripwire`: whatever the route (importlib,
  sys.modules, a module's globals, a subclass), seen when the piece's code starts while
  the learner's code is armed; which one, and the line of the learner's code
* a function is still the stub     -> which ones are not written yet (no rank starts)
* it raises                        -> which of your functions, the exception, the line
* it returns something malformed   -> the lab's own check (a :class:`LabError`)
* it loops forever                 -> a per-rank alarm after `timeout` seconds, with the line it was on
* ranks wait for each other        -> the collectives' timeout is cut to `timeout`/3 seconds
  (a collective or message one rank never posts)
* ranks issue different collectives -> gloo aborts the process: the launch reports it
* a rank dies without reporting    -> that rank and its exit code

Each rank runs the lab's job inside a guard that turns any exception into a record; rank
0's verdict wins unless some rank failed, and the most telling failure is reported (your
code's own exception before the engine error it caused, before the peer that lost it).

Several cases can share one launch (``run_cases``: starting ranks is the slow part on a
small machine). After a case the ranks compare notes through the rendezvous store, not
through the process group a failed case may have left out of step: they go on only if
every rank passed or failed cleanly having issued the same communication; otherwise the
remaining cases get a fresh launch.

    verdicts = run_cases(job, layout, [(source_a,), (source_b,)], timeout=60)

``run_sources`` is that for one learner's source per case: :func:`screen` first (compiles,
no engine copy, no stub left, the names defined), so such a source fails before any rank
starts. A new lab's checker is a job ``job(comm, source, *args)`` plus

    def check_mine_all(sources, timeout=60):
        return run_sources(_job, layout, sources, timeout, forbidden=FORBIDDEN, names=NAMES)

and, inside the job: ``load`` the source, check the piece on one tensor (``call`` runs the
learner's code, ``traced`` counts what it communicated, ``describe_calls`` says it),
``agree`` on the first problem, then train (``train_swapped`` / ``versus_one_device``) and
answer with :func:`training_verdict`, the one rule for a run against the single-device
model (ok within the tolerance, else by how much).
"""
from __future__ import annotations

import ast
import datetime
import json
import linecache
import os
import pickle
import signal
import sys
import tempfile
import threading
import traceback
import uuid
from collections import Counter
from contextlib import contextmanager, nullcontext

from ..config import TOLERANCE, ModelConfig, TrainConfig
from .routes import changed, escape, refuse_routes, snapshot

TOL = TOLERANCE["float64"]  # every lab's run against the single-device model (float64)

# The labs that train the smallest GPT inside the engine (03b, 04a, 04c, 04d, 07a, 09): one block of
# width 16 and 4 heads, context 16; and the run most of them judge: 2 float64 steps of 4 sequences.
LAB_GPT = ModelConfig(layers=1, hidden=16, heads=4, seq_len=16, vocab=256, name="lab")
LAB_GPT_STEPS = TrainConfig(steps=2, global_batch=4, dtype="float64", warmup=1, progress=False,
                            eval_every=0, sample_tokens=0)

# The labs that train a small Llama inside the engine (09b, 10a, 10b): its block, at the labs'
# sizes (not a lesson's: 8 query heads of d = 6, 2 kv heads), and its run: 2 float64 steps,
# judged against the single-device model at TOL.
LAB_LLAMA = ModelConfig(layers=1, hidden=48, heads=8, kv_heads=2, ffn=64, seq_len=16, vocab=256, name="lab-llama",
                        norm="rmsnorm", activation="swiglu", positions="rope", bias=False, tied_embeddings=False)
TWO_FLOAT64_STEPS = TrainConfig(steps=2, global_batch=2, dtype="float64", lr=1e-2, warmup=1, progress=False,
                                eval_every=0, sample_tokens=0)

YOUR_CODE = "<your code>"  # the file name of the learner's source in tracebacks
SETUP_TIMEOUT = 120  # s: joining the process group on a loaded machine
# which failure explains a case best (lower first): a finding about your code, then a
# timeout, then an engine error (often caused by what your code returned), then a rank
# that only lost its peer
_PRIORITY = {"check": 0, "learner": 0, "timeout": 1, "engine": 2, "comm": 3}


class LabError(Exception):
    """A finding about the learner's code; its message is the verdict's one line."""


class LabTimeout(Exception):
    """Raised by the per-rank alarm when a case runs past its deadline."""


def fail(message: str) -> dict:
    return {"ok": False, "message": message}


# --- the learner's source ---------------------------------------------------------------------
def compile_source(source):
    """Compile the learner's source (registered for tracebacks) or raise LabError."""
    if not isinstance(source, str):
        raise LabError(f"the checker takes your code as a string (SOURCE = '''...'''), "
                       f"got a {type(source).__name__}")
    try:
        code = compile(source, YOUR_CODE, "exec")
    except SyntaxError as e:
        text = (e.text or "").strip()
        raise LabError(f"your code does not compile: {e.msg} at line {e.lineno}"
                       + (f": `{text}`" if text else "")) from None
    linecache.cache[YOUR_CODE] = (len(source), None, source.splitlines(True), YOUR_CODE)
    return code


def load(source, names: tuple, namespace: dict | None = None) -> dict:
    """Run the learner's source in a fresh namespace (seeded with `namespace`) and return it;
    LabError when it does not compile, raises, or leaves one of `names` undefined."""
    code = compile_source(source)
    ns = dict(namespace or {})
    try:
        exec(code, ns)
    except Exception as e:
        raise LabError(describe(e)) from None
    missing = [n for n in names if not callable(ns.get(n))]
    if missing:
        raise LabError(f"your code defines no {', '.join(missing)}: it must define "
                       f"{' and '.join(names)}")
    return ns


def call(what: str, fn, *args):
    """`fn(*args)`, with an exception of the learner's code described (LabError)."""
    try:
        return fn(*args)
    except Exception as e:
        if isinstance(e, (LabError, LabTimeout)) or _is_comm_error(e):
            raise  # a timeout or a lost peer is ranked with the other ranks' failures (merge)
        raise LabError(describe(e, what)) from None


# --- what the learner's source may not do before any rank starts -------------------------------
def _dotted(node) -> str | None:
    """'a.b.c' for a Name/Attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _engine_names(tree: ast.AST):
    """(line, the full dotted name) of every engine name the source imports or refers to:
    imports resolved through their aliases (``from minitron.parallel import tensor as t``
    makes ``t._F`` read ``minitron.parallel.tensor._F``), and string constants (for
    ``importlib.import_module("...")``)."""
    alias: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
                yield node.lineno, f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, (ast.Attribute, ast.Name)):
            name = _dotted(node)
            if name and name.split(".")[0] in alias:
                head, _, rest = name.partition(".")
                yield node.lineno, alias[head] + ("." + rest if rest else "")
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("minitron")
              and not any(c.isspace() for c in node.value)):  # a module's name, not a docstring mentioning one
            yield node.lineno, node.value


def refuse_engine_copy(source: str, forbidden) -> None:
    """Raise LabError when `source` imports or refers to one of the engine's own versions
    of the piece the lab asks for (`forbidden`: dotted names such as
    ``"minitron.parallel.tensor._F"``, or whole modules such as ``"minitron.parallel.zero"``):
    passing a lab by handing the engine its own function back proves nothing. It reads the
    source (imports, attribute chains through their aliases, strings naming a module); it
    is a guard against the obvious shortcut, not a sandbox."""
    tree = ast.parse(source)
    for line, name in _engine_names(tree):
        star = name.endswith(".*")  # `from module import *` brings every name of the module
        base = name[:-2] if star else name
        for f in forbidden:
            if base == f or base.startswith(f + ".") or (star and f.startswith(base + ".")):
                raise LabError(f"your code uses the engine's own {f} (line {line}): the lab asks you to write "
                               f"it yourself, with what SOURCE is given")


def engine_piece(dotted: str):
    """The engine's object named `dotted` (``"minitron.parallel.tensor._F"``, a method as
    ``"...ShardedDataParallel._gather"``): what a lab *refuses* is named, as a string, like
    its ``FORBIDDEN`` list; a lab imports only the engine's public names. LookupError, naming
    it, when the engine no longer has it (a lab to update, not a silent hole in the watch)."""
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for name in parts[i:]:
                obj = getattr(obj, name)
        except AttributeError:
            break
        return obj
    raise LookupError(f"the engine has no {dotted}: the lab's watch names a piece that moved")


def watched(*dotted: str) -> dict:
    """``{name: the engine's object}`` for a :class:`Tripwire`, each found by :func:`engine_piece`."""
    return {name: engine_piece(name) for name in dotted}


def comm_on(comm, layout):
    """A traced ``Comm`` on the launch's ranks laid out as `layout` (a lab that runs its
    piece on several layouts in one launch: the same ranks, other groups)."""
    from ..comm import Comm, CommTrace
    from ..grid import ProcessGrid

    return Comm(ProcessGrid.for_layout(layout, comm.grid.rank).build_groups(), CommTrace())


def layout_flags(layout) -> str:
    """The command-line flags of a lab's layout, as its messages say them: '--tp 2 --dp 2 --sp'."""
    flags = [f"--{axis} {getattr(layout, axis)}" for axis in ("tp", "cp", "ep", "dp") if getattr(layout, axis) > 1]
    return " ".join(flags + (["--sp"] if layout.sp else []) + (["--tp-overlap"] if layout.tp_overlap else []))


def loaded(comm, source: str, names: tuple, env: dict, watch, key: str, timeout: float) -> list:
    """The learner's `names` from `source` (its top level run watched), in order; a problem
    there (it raised, a name is missing) is agreed by the ranks and raised on each as
    LabError."""
    problem, ns = "", {}
    try:
        with watch.armed():
            ns = load(source, names, env)
    except LabError as e:
        problem = str(e)
    agree(comm, f"{key}/load", problem, timeout)
    return [ns[n] for n in names]


def on_each_layout(comm, layouts, key: str, timeout: float, watch, unit_check, train) -> list[tuple[str, dict | None]]:
    """A lab's part on each of `layouts` in turn, on the same launch's ranks (other groups),
    so that a piece right only at the notebook's size fails at another: `unit_check(c)`
    (watched) gives '' or the first problem on the layout's Comm `c` (the ranks agree on it;
    said after the first layout's flags when a later layout finds it), then `train(c, layout)`
    gives rank 0's verdict. `layouts[0]` is the launch's own layout. Returns [(flags,
    verdict)] for :func:`verdict_over_runs` (verdicts None off rank 0)."""
    out = []
    for i, layout in enumerate(layouts):
        c = comm if i == 0 else comm_on(comm, layout)
        try:
            with watch.armed():
                problem = unit_check(c)
        except LabError as e:  # the learner's code raised or returned a malformed value
            problem = str(e)
        agree(comm, f"{key}/{i}", f"{layout_flags(layout)}: {problem}" if problem and i else problem, timeout)
        out.append((layout_flags(layout), train(c, layout)))
    return out


def swapped_on_each_layout(comm, layouts, key: str, timeout: float, watch, unit_check, layers, name: str,
                           model, train, tol: float) -> list[tuple[str, dict | None]]:
    """:func:`on_each_layout` for a lab whose piece is one of the tensor-parallel layers: the
    unit checks, then the Trainer built with `layers` (the learner's piece in the engine's
    place) trained on each layout and judged against one device (:func:`training_verdict`)."""
    return on_each_layout(comm, layouts, key, timeout, watch, unit_check, lambda c, layout: training_verdict(
        train_swapped(c, model, layout, train, watch, layers=layers), name, "", tol))


def flags_of(runs: list[tuple[str, dict | None]]) -> str:
    """'--tp 4 and --tp 2 --dp 2': the layouts a lab's runs were on, as its messages say them."""
    return " and ".join(flags for flags, _ in runs)


def refuse_checker(source: str) -> None:
    """Raise LabError when `source` imports or names the checker itself (``minitron.labs``: its
    reference answers, its functions, its watch)."""
    for line, name in _engine_names(ast.parse(source)):
        if name == "minitron.labs" or name.startswith("minitron.labs."):
            raise LabError(f"your code uses the checker's own {name} (line {line}): its reference answers and its "
                           f"watch are the checker's; the lab asks you to write the piece yourself")


# --- what the learner's code ran ---------------------------------------------------------------
def _codes(obj, seen=None) -> set:
    """Every code object of a function or class (methods, static and class methods,
    properties, what a decorator wraps, nested functions)."""
    seen = set() if seen is None else seen
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        for f in (obj.fget, obj.fset, obj.fdel):
            if f is not None:
                _codes(f, seen)
        return seen
    if isinstance(obj, type):
        for value in vars(obj).values():
            if isinstance(value, (type(_codes), staticmethod, classmethod, property)):
                _codes(value, seen)
        return seen
    while hasattr(obj, "__wrapped__"):  # a decorator's wrapper is shared code (torch.no_grad's): not the piece
        obj = obj.__wrapped__
    code = getattr(obj, "__code__", None)
    stack = [code] if code is not None else []
    while stack:
        c = stack.pop()
        if c not in seen:
            seen.add(c)
            stack.extend(k for k in c.co_consts if hasattr(k, "co_code"))
    return seen


class Tripwire:
    """What actually ran while the learner's code did: the engine's own piece, reached by
    whatever route (an import, ``importlib``, ``sys.modules``, ``__import__`` of a built
    name, a module's globals, a subclass, the object itself handed back), is seen when its
    code starts, by a profile hook (``sys.setprofile``) that is set only while
    :meth:`armed`. Nothing is patched: the hook compares each starting frame's code object
    with the piece's.

    `pieces`: ``{name said to the learner: function, class or module}`` (a module: every
    function of its file). `allowed`: functions of the checker's own (the ``send`` it hands
    the learner, say) through which a watched piece may run. `communication`: also watch
    every call into torch.distributed's C++ process groups and stores and its ``torch.ops``
    (a lab whose piece *is* a collective built from the messages it is given)."""

    def __init__(self, pieces: dict, allowed=(), communication: bool = False):
        self.codes: dict = {}
        self.files: dict = {}
        self.passages: set = set()
        for name, obj in pieces.items():
            if isinstance(obj, type(sys)):
                self.files[os.path.realpath(obj.__file__)] = name
                self.files[obj.__file__] = name
                # a package's lazy name lookup (PEP 562) only finds the home module, whose code is
                # then seen under its own name: the lookup is a passage, not a piece
                self.passages.update(getattr(vars(obj).get(f), "__code__", None) for f in ("__getattr__", "__dir__"))
            else:
                self.codes.update(dict.fromkeys(_codes(obj), name))
        self.allowed = set().union(*(_codes(a) for a in allowed)) if allowed else set()
        self.communication = communication
        self.c10d = self._c10d_builtins() if communication else set()
        self.seen = ""  # the first piece that ran: its name, and where in the learner's code
        self.escaped = ""  # the first route around the watch the learner's code took (routes.escape)
        # the checker's modules whose names the learner's code may not change: these and the lab's
        self.guarded = (__name__, "minitron.labs.routes", sys._getframe(1).f_globals.get("__name__", __name__))

    @staticmethod
    def _c10d_builtins() -> set:
        """The ids of the C++ functions of torch.distributed's process groups, stores and
        work handles (a profile hook sees a pybind11 method as its function, not bound)."""
        import torch._C._distributed_c10d as c10d

        found = set()
        for name in dir(c10d):
            obj = getattr(c10d, name)
            members = vars(obj).values() if isinstance(obj, type) else [obj]
            found.update(id(getattr(m, "__func__", m)) for m in members
                         if callable(getattr(m, "__func__", m)) and not isinstance(m, type))
        return found

    def _c10d(self, frame, event, arg) -> bool:
        if event == "c_call":
            return id(arg) in self.c10d
        if event == "call" and frame.f_code.co_filename.endswith(os.path.join("torch", "_ops.py")):
            op = frame.f_locals.get("self")
            return "c10d" in str(getattr(op, "_qualified_op_name", getattr(op, "_name", "")))
        return False

    def _hook(self, frame, event, arg) -> None:
        if self.seen:
            return
        if event == "c_call":
            escaped = escape(frame, event, arg, YOUR_CODE, __file__)
            if escaped:
                self.escaped = self.escaped or escaped
                return
        name = None
        if event == "call":
            code = frame.f_code
            name = None if code in self.passages else self.codes.get(code) or self.files.get(code.co_filename)
        if name is None and self.communication and self._c10d(frame, event, arg):
            name = "torch.distributed"
        if name is None:
            return
        where, f = "", frame.f_back if event == "call" else frame
        while f is not None:
            if f.f_code in self.allowed:
                return
            if not where and f.f_code.co_filename == YOUR_CODE:
                where = f" (from line {f.f_lineno} of your code: `{linecache.getline(YOUR_CODE, f.f_lineno).strip()}`)"
            f = f.f_back
        self.seen = name + where

    @contextmanager
    def armed(self):
        """Watch while the block runs; on leaving it, LabError if a piece ran (whatever else
        happened: that is the verdict) or if the learner's code took the hook away."""
        old, before = sys.getprofile(), snapshot(self.guarded)
        sys.setprofile(self._hook)
        try:
            yield self
        finally:
            removed = sys.getprofile() != self._hook
            sys.setprofile(old)
            patched = changed(self.guarded, before)
            if self.escaped:
                raise LabError(f"your code {self.escaped}: the checker grades what runs where it watches; "
                               f"write the piece in SOURCE and run it as it is called")
            if patched:
                raise LabError(f"your code changed the checker's own {patched} while it ran: leave the checker "
                               f"and its watch alone")
            if self.seen:
                raise LabError(f"your code runs the engine's own {self.seen}: the lab asks you to write it "
                               f"yourself (the checker sees what runs, whatever the route to it)")
            if removed:
                raise LabError("your code changed sys.setprofile while it ran: the checker watches what "
                               "runs through it; leave it alone")


def _stubs(tree: ast.AST) -> list[str]:
    """The functions (``Class.method`` for methods) whose body, past a docstring, only raises
    NotImplementedError: the lab's stubs, still unwritten."""
    found = []

    def visit(node, prefix=""):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = [b for b in child.body if not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))]
                if (len(body) == 1 and isinstance(body[0], ast.Raise) and body[0].exc is not None
                        and "NotImplementedError" in ast.unparse(body[0].exc)):
                    found.append(prefix + child.name)
    visit(tree)
    return found


def screen(source, names: tuple = (), forbidden=()) -> None:
    """Everything about the learner's source that needs no rank, in one place for every lab:
    it compiles, it does not use the engine's own piece (:func:`refuse_engine_copy`), and
    no function is still the notebook's stub (one line naming them); LabError otherwise."""
    compile_source(source)
    tree = ast.parse(source)
    refuse_engine_copy(source, forbidden)
    refuse_checker(source)
    refuse_routes(tree, LabError)
    stubs = _stubs(tree)
    if stubs:
        listed = ", ".join(stubs[:-1]) + (" and " if len(stubs) > 1 else "") + stubs[-1]
        raise LabError(f"{listed} {'is' if len(stubs) == 1 else 'are'} not written yet (still "
                       f"`raise NotImplementedError`): fill in the `# your code here` lines in SOURCE")
    defined = {d.name for d in tree.body if isinstance(d, (ast.FunctionDef, ast.ClassDef))}
    defined |= {t.id for d in tree.body if isinstance(d, (ast.Assign, ast.AnnAssign))
                for target in (d.targets if isinstance(d, ast.Assign) else [d.target])
                for t in ast.walk(target) if isinstance(t, ast.Name)}
    missing = [n for n in names if n not in defined]
    if missing:
        raise LabError(f"your code defines no {', '.join(missing)}: it must define {' and '.join(names)}")


# --- what the learner's code communicated --------------------------------------------------------
def traced(comm, fn, *args):
    """``(fn(*args), the calls it issued)``: the records :class:`minitron.comm.CommTrace`
    added while `fn` ran (every collective and message goes through `comm`)."""
    n = len(comm.trace.records) if comm.trace is not None else 0
    out = fn(*args)
    return out, (comm.trace.records[n:] if comm.trace is not None else [])


def describe_calls(records) -> str:
    """'all_reduce of [8] on 'tp', all_gather of [2, 3, 5] on 'tp'' (or 'nothing')."""
    return ", ".join(f"{r['op']} of {list(r['shape'])} on '{r['axis']}'" for r in records) or "nothing"


# --- describing a failure in one line ----------------------------------------------------------
def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


def _frames(e: BaseException):
    return [(f, lineno) for f, lineno in traceback.walk_tb(e.__traceback__)]


def _where_in_your_code(e: BaseException) -> str:
    """'F.backward, line 12 of your code: `return dy`' for the innermost frame of the
    learner's code in the traceback, or ''."""
    mine = [(f, n) for f, n in _frames(e) if f.f_code.co_filename == YOUR_CODE]
    if not mine:
        return ""
    f, n = mine[-1]
    name = getattr(f.f_code, "co_qualname", f.f_code.co_name)
    text = linecache.getline(YOUR_CODE, n).strip()
    where = (f"line {n}" if name == "<module>" else f"{name}, line {n}") + " of your code"
    return where + (f": `{text}`" if text else "")


def _where_in_engine(e: BaseException) -> str:
    frames = [(f, n) for f, n in _frames(e) if "minitron" in f.f_code.co_filename
              and "labs" not in os.path.basename(os.path.dirname(f.f_code.co_filename))]
    if not frames:
        return ""
    f, n = frames[-1]
    path = f.f_code.co_filename
    path = path[path.rindex("minitron"):] if "minitron" in path else path
    return f"{path}:{n} in {f.f_code.co_name}"


def _is_comm_error(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e}"
    return any(s in text for s in ("DistBackendError", "Gloo", "gloo", "Connection closed", "Connection reset",
                                   "Timed out", "timed out", "Broken pipe", "NCCL"))


def classify(e: BaseException) -> str:
    if isinstance(e, LabError):
        return "check"
    if isinstance(e, LabTimeout):
        return "timeout"
    if _is_comm_error(e):
        return "comm"
    return "learner" if _where_in_your_code(e) else "engine"


def describe(e: BaseException, what: str = "") -> str:
    """One line for an exception raised while the learner's code ran (`what`: 'your F')."""
    if isinstance(e, LabError):
        return str(e)
    mine = _where_in_your_code(e)
    if isinstance(e, LabTimeout):
        if mine:
            return f"your code did not finish within {e.args[0]:g} s (an endless loop?): it was at {mine}"
        return (f"the check did not finish within {e.args[0]:g} s: stuck in "
                f"{_where_in_engine(e) or 'the engine'} with your code")
    if _is_comm_error(e):
        text = str(e).lower()
        at = f" (at {mine})" if mine else ""
        if "timed out" in text or "timeout" in text:
            return ("a rank waited past the timeout for a collective or a message its peers never posted: "
                    f"does every rank issue the same communication in the same order?{at}")
        return f"a rank lost its peers: {_first_line(e)[:120]}{at}"
    if mine:
        return f"{_first_line(e)} in {mine}"
    where = _where_in_engine(e)
    return (f"the engine failed with what {what or 'your code'} returned: {_first_line(e)}"
            + (f" ({where})" if where else ""))


# --- deadlines ---------------------------------------------------------------------------------
@contextmanager
def deadline(seconds: float):
    """Raise LabTimeout in the main thread after `seconds` (SIGALRM; a no-op elsewhere).
    A rank blocked inside a collective is ended by the collective's own timeout instead."""
    if (not seconds or threading.current_thread() is not threading.main_thread()
            or not hasattr(signal, "setitimer")):
        yield
        return

    def on_alarm(signum, frame):
        raise LabTimeout(seconds)

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def guarded(fn, *args, timeout: float = 60, what: str = "") -> dict:
    """{"result": fn(*args)} or {"error": one line, "kind": ...}; never raises (but for
    KeyboardInterrupt)."""
    try:
        with deadline(timeout):
            return {"result": fn(*args)}
    except Exception as e:
        return {"error": describe(e, what), "kind": classify(e)}


def _set_timeouts(comm, seconds: float) -> None:
    """Cut every process group's collective timeout to `seconds` (a hang becomes an error)."""
    import torch.distributed as dist

    try:
        from torch.distributed.distributed_c10d import _set_pg_timeout
    except ImportError:  # older torch: the start-up timeout stays
        return
    groups = {id(g): g for g in [dist.group.WORLD, *comm.grid.groups.values()] if g is not None}
    for g in groups.values():
        try:
            _set_pg_timeout(datetime.timedelta(seconds=seconds), g)
        except Exception:
            pass


# --- ranks -------------------------------------------------------------------------------------
def _calls(comm) -> dict:
    """How many calls of each (axis, op) this rank issued in the case (from its trace)."""
    records = comm.trace.records if comm.trace is not None else []
    return dict(Counter(f"{r['axis']}:{r['op']}" for r in records))


def _in_step(comm, run_id: str, i: int, rec: dict, timeout: float) -> bool:
    """After case i: may the ranks go on to the next case on the same process group? Every
    rank posts its outcome to the rendezvous store and reads everyone's: yes when each
    one passed or failed in a check or in the learner's code, having issued the same calls."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    world, rank = dist.get_world_size(), dist.get_rank()
    store = _get_default_store()
    key = f"minitron-lab/{run_id}/{i}/"
    store.set(key + str(rank), json.dumps({"kind": rec.get("kind"), "calls": _calls(comm)}))
    keys = [key + str(r) for r in range(world)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception:
        return False
    notes = [json.loads(store.get(k)) for k in keys]
    return (all(n["kind"] in (None, "check", "learner") for n in notes)
            and all(n["calls"] == notes[0]["calls"] for n in notes))


def _rank_main(job, layout, cases, timeout: float, trace: bool, run_id: str, outdir: str) -> None:
    """On each rank: join, run the cases in order (each guarded), stop early when the ranks
    are out of step. Each case's record goes to `outdir` as soon as it is known, so that
    the parent learns what ran even when a rank is killed later."""
    from ..launch import setup_rank, teardown

    comm = setup_rank(layout, layout.backend, SETUP_TIMEOUT, trace=trace)
    try:
        _set_timeouts(comm, max(3.0, timeout / 3))  # before the alarm: a wait is not a loop
        for i, args in enumerate(cases):
            if comm.trace is not None:
                comm.trace.records.clear()
            rec = guarded(job, comm, *args, timeout=timeout)
            with open(os.path.join(outdir, f"{i}.{comm.grid.rank}.tmp"), "wb") as f:
                pickle.dump(rec, f)
            os.replace(f.name, f.name[:-4] + ".pkl")
            more = i + 1 < len(cases)
            if more and comm.grid.world > 1 and not _in_step(comm, run_id, i, rec, timeout):
                break
    finally:
        with deadline(timeout):
            try:
                teardown()
            except Exception:
                pass


def merge(records: list[dict]) -> dict:
    """One verdict from the ranks' records of a case: rank 0's result, or the failure
    that explains it best."""
    errors = [(_PRIORITY.get(r.get("kind"), 9), rank, r) for rank, r in enumerate(records) if "error" in r]
    if errors:
        _, rank, r = min(errors, key=lambda t: t[:2])
        where = f" (rank {rank})" if len(records) > 1 and r.get("kind") != "check" else ""
        return fail(r["error"] + where)
    verdict = records[0]["result"]
    return verdict if isinstance(verdict, dict) else fail(f"the checker's rank 0 returned {verdict!r}")


def _died(e: BaseException) -> str:
    """One line for a launch that ended with a rank killed (no record of the case)."""
    failures = getattr(e, "failures", None) or {}
    for rank, f in sorted(failures.items()):
        code = getattr(f, "exitcode", None)
        if code == -signal.SIGABRT:
            return (f"rank {rank} was aborted by the communication backend: most likely the ranks issued "
                    "different collectives (a call on one rank met another kind or size of call on its "
                    "peer): every rank must issue the same communication in the same order")
        how = f"signal {-code}" if isinstance(code, int) and code < 0 else f"exit code {code}"
        return f"rank {rank} died without reporting ({how}): killed, or a crash outside Python"
    return f"the ranks did not start: {_first_line(e)}"


def run_cases(job, layout, cases: list[tuple], timeout: float = 60, trace: bool = True) -> list[dict]:
    """Run `job(comm, *case)` for every case on `layout.world` local ranks, in as few
    launches as the outcomes allow; one verdict dict per case (rank 0's return value, or
    the failure that explains the case)."""
    from ..launch import launch_local

    verdicts: list = [None] * len(cases)
    todo = list(range(len(cases)))
    while todo:
        with tempfile.TemporaryDirectory(prefix="minitron-lab-") as outdir:
            args = (job, layout, [cases[i] for i in todo], timeout, trace, uuid.uuid4().hex[:8], outdir)
            try:  # launch_local puts the caller's signal handlers back afterwards
                if layout.world == 1:
                    _rank_main(*args)
                else:
                    launch_local(_rank_main, args, layout.world)
                crash = None
            except Exception as e:  # a rank was killed: the cases it finished still count
                crash = _died(e)
            done = []
            for j in range(len(todo)):
                paths = [os.path.join(outdir, f"{j}.{r}.pkl") for r in range(layout.world)]
                if not all(os.path.exists(p) for p in paths):
                    break
                done.append(merge([pickle.load(open(p, "rb")) for p in paths]))
        for j, v in enumerate(done):
            verdicts[todo[j]] = v
        todo = todo[len(done):]
        if todo and crash:  # the case that was running when a rank died
            verdicts[todo.pop(0)] = fail(crash)
        elif todo and not done:  # should not happen: every launch runs its first case
            for i in todo:
                verdicts[i] = fail("the ranks ended without running the check")
            break
    return verdicts


def run_sources(job, layout, sources: list, timeout: float = 60, *args, forbidden=(), names: tuple = ()) -> list[dict]:
    """`run_cases` of ``job(comm, source, *args)`` for each of the learner's `sources`. A
    source that :func:`screen` rejects (it does not compile, uses the engine's own piece
    among `forbidden`, leaves a stub unwritten or one of `names` undefined) fails at once:
    no rank starts for it. One verdict per source."""
    verdicts: list = [None] * len(sources)
    cases = []
    for i, src in enumerate(sources):
        try:
            screen(src, names, forbidden)
            cases.append(i)
        except LabError as e:
            verdicts[i] = fail(str(e))
    if cases:
        for i, v in zip(cases, run_cases(job, layout, [(sources[i], *args) for i in cases], timeout)):
            verdicts[i] = v
    return verdicts


def train_swapped(comm, model, layout, train, watch: Tripwire | None = None, **injected) -> dict | None:
    """Train `model` on `layout` (`train.steps` steps) with the learner's pieces handed to
    the Trainer (`injected`: its keywords ``layers=``, ``schedule=``, ``data_parallel=``,
    ``optimizer=``; e.g. ``layers=tensor.layers(f=F, g=G)``; nothing is patched) and
    compare with the single-device model: rank 0 gets :func:`minitron.tools.verify.compare`'s
    dict, the other ranks None. `watch`: armed while the learner's run trains (not while
    the single-device model does, which uses the engine's own pieces)."""
    from ..train import Trainer

    with watch.armed() if watch is not None else nullcontext():
        tr = Trainer(model, layout, train, comm, **injected)
        losses = [tr.step(i) for i in range(train.steps)]
    return versus_one_device(comm, tr, losses, model, train)


def training_verdict(res: dict | None, name: str, success: str, tol: float = TOL) -> dict | None:
    """The one verdict rule of every lab that trains (None off rank 0): `res` is
    :func:`versus_one_device`'s comparison; ok when losses and parameters agree with the
    single-device model within `tol` (float64: config.TOLERANCE), with
    `success` as the message, else one line saying by how much training differs. The
    other keys of `res` (a lab's own numbers) are kept."""
    if res is None:
        return None
    ok = res["max_loss_abs_diff"] <= tol and res["max_param_rel_diff"] <= tol
    msg = success if ok else (
        f"your {name} passes the checks above but training differs from the single-device model (loss "
        f"by {res['max_loss_abs_diff']:.3g}, worst parameter {res['worst_param']} by "
        f"{res['max_param_rel_diff']:.3g})")
    return {"ok": ok, "message": msg, **res}


def verdict_over_runs(verdicts: list[tuple[str, dict]], passed: str) -> dict:
    """One verdict for a lab that trains on several layouts (rank 0's `training_verdict`s,
    each with its layout's flags): the first that failed, its message led by those flags;
    else the worst of them (the largest parameter difference) saying `passed`."""
    for flags, verdict in verdicts:
        if not verdict["ok"]:
            verdict["message"] = f"{flags}: {verdict['message']}"
            return verdict
    worst = max((v for _, v in verdicts), key=lambda v: v["max_param_rel_diff"])
    worst["message"] = passed
    return worst


def versus_one_device(comm, tr, losses, model, train) -> dict | None:
    """:func:`minitron.tools.verify.versus_one_device`: the trainer's run against the
    single-device model (rank 0 gets the comparison, the other ranks None)."""
    from ..tools.verify import versus_one_device as against_one_device

    return against_one_device(comm, tr, losses, model, train)


def agree(comm, key: str, problem: str, timeout: float) -> None:
    """Raise LabError on every rank when some rank found a problem (the lowest rank's):
    `problem` is this rank's ('' when none), `key` names the case and is the same on
    every rank. Through the rendezvous store, not a collective: a rank whose own code
    failed alone may have left the others inside one."""
    if comm.grid.world == 1:
        if problem:
            raise LabError(problem)
        return
    from torch.distributed.distributed_c10d import _get_default_store

    store, world = _get_default_store(), comm.grid.world
    key = f"minitron-lab/{key}/"
    store.set(key + str(comm.grid.rank), problem)
    if problem:
        raise LabError(problem)
    keys = [key + str(q) for q in range(world)]
    try:
        store.wait(keys, datetime.timedelta(seconds=max(3.0, timeout / 3) + 2))
    except Exception:  # a peer is stuck or failed on its own: its record explains the case
        raise RuntimeError("Timed out waiting for the other ranks' unit checks") from None
    problems = [store.get(k).decode() for k in keys]
    first = next((p for p in problems if p), "")
    if first:
        raise LabError(first)
