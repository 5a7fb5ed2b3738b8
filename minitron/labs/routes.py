"""The routes around a lab's checker, and which of them it refuses (labs/README.md lists them).

A learner's code runs in the checker's own process, beside the engine, the checker's reference
answers and (on disk) the solution notebooks: nothing is absent, so grading rests on what the
checker can see. Two looks, both in every lab:

* **the source** (:func:`refuse_routes`, part of ``runner.screen``, before any rank starts):
  a name written in SOURCE that switches or reaches the watch (``sys.setprofile``,
  ``settrace``, frames), starts a thread or a process (``threading``, ``multiprocessing``,
  ``subprocess``, ``os.fork``), builds code from text (``exec``, ``eval``, ``compile``,
  ``inspect``, ``types``, ``__code__``), reads files (``open``, ``pathlib``, ``io``, ``os``,
  ``nbformat``, ``__file__``) or uses the checker itself (``minitron.labs``);
* **what runs** (:func:`escape`, in the profile hook of ``runner.Tripwire`` and lab 03c's
  watch, while the learner's code is armed): a call of the built-in functions behind those
  routes, however its name was built (``getattr``, ``importlib``, ``sys.modules``), made
  while a frame of the learner's code is on the stack; and (:func:`snapshot`) a checker
  module's names changed by the learner's code while it ran (a patched checker or watch).

What neither sees is said in labs/README.md: a route whose every step is a built name and none
of whose calls is one of :data:`ESCAPE_CALLS` (the checker's objects found through ``gc`` and
changed in place, say).
"""
from __future__ import annotations

import ast
import sys

# the routes read in the source: (what it does, its remedy, the names that take it wherever they are
# written, the modules that take it when imported)
ROUTES = {
    "watch": ("reaches the checker's watch", "the checker watches what runs; leave its hook and the call stack alone",
              {"setprofile", "settrace", "getprofile", "gettrace", "_getframe", "f_back", "f_globals", "f_locals",
               "tb_frame", "gi_frame", "cr_frame", "Tripwire", "EngineWatch"}, set()),
    "thread": ("starts a thread or a process", "the checker watches the thread your code runs in; compute on it",
               {"threading", "multiprocessing", "subprocess", "fork", "forkpty", "Thread", "start_new_thread",
                "posix_spawn", "popen", "spawnv", "execv"}, {"_thread", "concurrent", "asyncio", "signal"}),
    "code": ("builds code at run time", "write the piece in SOURCE itself (a copy of the engine's source is the "
             "engine's piece)", {"exec", "eval", "compile", "__code__", "co_code", "getsource", "FunctionType",
                                 "CodeType", "__globals__", "__builtins__"},
             {"inspect", "dis", "marshal", "types", "runpy", "code", "codeop", "linecache", "builtins", "ast"}),
    "files": ("reads or writes files", "the lab grades what SOURCE computes, not the shipped solutions or the "
              "engine's files", {"open", "__file__", "__path__", "__loader__", "__spec__", "read_text", "read_bytes",
                                 "get_data", "nbformat"},
              {"io", "os", "pathlib", "glob", "shutil", "tempfile", "zipfile", "socket", "urllib", "json", "pickle"}),
}


def _words(node) -> list[tuple[str, bool]]:
    """(name, whether it is a module imported) for each name a node writes: a Name, an
    attribute, an import's modules and names."""
    if isinstance(node, ast.Name):
        return [(node.id, False)]
    if isinstance(node, ast.Attribute):
        return [(node.attr, False)]
    if isinstance(node, ast.Import):
        return [(p, True) for a in node.names for p in a.name.split(".")]
    if isinstance(node, ast.ImportFrom):
        return [(p, True) for p in (node.module or "").split(".")] + [(a.name, False) for a in node.names]
    return []


def route_in(tree: ast.AST) -> tuple[str, str, int] | None:
    """(route, the name, its line) of the first name in the source that takes a route, or None."""
    found = []
    for node in ast.walk(tree):
        for word, module in _words(node):
            for route, (_, _, names, modules) in ROUTES.items():
                if word in names or (module and word in modules):
                    found.append((node.lineno, route, word))
    if not found:
        return None
    line, route, word = min(found)
    return route, word, line


def refuse_routes(tree: ast.AST, error) -> None:
    """Raise `error` (the lab's LabError) naming the first route the source writes."""
    hit = route_in(tree)
    if hit:
        route, word, line = hit
        what, fix = ROUTES[route][:2]
        raise error(f"your code {what} (`{word}`, line {line}): {fix}")


# --- what runs ------------------------------------------------------------------------------------
def _escape_calls() -> dict:
    """id -> what it does, for the built-in functions behind the routes (a profile hook sees
    each call of one as a 'c_call' event whose argument is the function)."""
    import _thread
    import builtins
    import io
    import os

    calls = {sys.setprofile: "switches the checker's watch (sys.setprofile)",
             sys.settrace: "switches the checker's watch (sys.settrace)",
             _thread.start_new_thread: "starts a thread", builtins.exec: "builds code at run time (exec)",
             builtins.eval: "builds code at run time (eval)", builtins.compile: "builds code at run time (compile)",
             builtins.open: "reads or writes files (open)", io.open: "reads or writes files (open)",
             os.open: "reads or writes files (os.open)", os.listdir: "reads the file system (os.listdir)",
             os.scandir: "reads the file system (os.scandir)"}
    calls.update({getattr(os, n): f"starts a process (os.{n})" for n in ("fork", "system", "posix_spawn") if hasattr(os, n)})
    calls[io.open_code] = "reads or writes files (open_code)"
    try:  # subprocess and multiprocessing's spawn start their processes here
        import _posixsubprocess

        calls[_posixsubprocess.fork_exec] = "starts a process (fork_exec)"
    except ImportError:
        pass
    return {id(f): what for f, what in calls.items()}


ESCAPE_CALLS = _escape_calls()


def _trusted() -> tuple[str, ...]:
    """The files whose own calls of :data:`ESCAPE_CALLS` are not the learner's route: the import
    system (a module imported on first use reads and execs its file), the standard library's
    code generation (dataclasses, namedtuple, enum, typing) and torch's. The engine's piece
    reached through any of them still runs its own code, which the watch sees."""
    import collections
    import dataclasses
    import enum
    import os
    import typing

    import torch

    files = [m.__file__ for m in (collections, dataclasses, enum, typing)]
    return ("<frozen importlib", os.path.dirname(torch.__file__) + os.sep, *files)


TRUSTED = _trusted()


def escape(frame, event: str, arg, yours: str, watch_file: str) -> str:
    """For a profile hook: what the call does when it is one of :data:`ESCAPE_CALLS` made while
    a frame of the learner's code (file name `yours`) is on the stack, else '' (also for the
    watch's own calls, from `watch_file`: arming and disarming)."""
    if event != "c_call" or id(arg) not in ESCAPE_CALLS or frame.f_code.co_filename == watch_file:
        return ""
    if frame.f_code.co_filename.startswith(TRUSTED):  # an import, a dataclass, torch's own code generation
        return ""
    f = frame
    while f is not None:
        if f.f_code.co_filename == yours:
            return ESCAPE_CALLS[id(arg)] + f" at line {f.f_lineno} of your code"
        f = f.f_back
    return ""


def snapshot(modules) -> dict:
    """The names of the checker's `modules` (their names: the runner, this module, the lab's own)
    and of the classes defined there, each bound to the id of its value: taken when the watch
    is armed, compared (:func:`changed`) when it is left."""
    seen = {}
    for name in modules:
        mod = sys.modules.get(name)
        for key, value in (vars(mod).items() if mod is not None else ()):
            seen[(name, key)] = id(value)
            if isinstance(value, type) and value.__module__ == name:
                seen.update({(f"{name}.{key}", k): id(v) for k, v in vars(value).items()})
    return seen


def changed(modules, before: dict) -> str:
    """The first name of `modules` whose value differs from `before` (patched), or ''."""
    now = snapshot(modules)
    for key, ident in before.items():
        if now.get(key) != ident:
            return f"{key[0]}.{key[1]}"
    return ""
