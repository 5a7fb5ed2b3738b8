"""The routes around a lab's checker (labs/README.md, "What the checkers
refuse"): each route a learner used to get past the run-time watch, planted against every lab.

* Written plainly in SOURCE, each is refused by every lab's screen, before any rank starts
  (so these cases cost no launch): the profile hook switched off and on, another thread, the
  engine's source copied and exec'd, the watch patched, the checker's reference called, the
  shipped solution notebook read and run, the checker's functions patched, the answer built
  at import time with the engine's piece.
* With every name built at run time (past the screen), the run-time watch refuses them: the
  same :class:`minitron.labs.runner.Tripwire` every lab arms around loading SOURCE and calling
  it (and lab 03c's ZeRO-3 watch), planted here in one process.
* The routes the README says are not refused are not refused (a claim the checker keeps)."""
import importlib
import pathlib

import pytest

from minitron.labs import routes, zero3
from minitron.labs.runner import LabError, Tripwire, load

ROOT = pathlib.Path(__file__).resolve().parent.parent
LABS = {  # lab -> (module, its check function)
    "00": ("ring_allreduce", "check_ring_allreduce"), "01": ("memory_estimator", "check_memory_estimator"),
    "02a": ("pipeline", "check_one_f_one_b"), "02b": ("interleaved", "check_interleaved"),
    "03a": ("bucketed_dp", "check_bucketed_dp"), "03b": ("zero", "check_zero1"), "03c": ("zero3", "check_zero3"),
    "04a": ("f_and_g", "check_f_and_g"), "04b": ("cross_entropy", "check_vocab_parallel_ce"),
    "04c": ("seq_parallel", "check_all_gather_linear"), "04d": ("collective_matmul", "check_all_gather_matmul"),
    "05": ("linear3d", "check_linear3d"),
    "06": ("trillion_layout", "check_trillion_layout"), "07a": ("fp8_scaling", "check_fp8_scaling"),
    "08a": ("ft_replay", "check_ft_replay"),
    "09": ("online_softmax", "check_online_softmax"),
    "09b": ("ulysses", "check_ulysses"), "09c": ("packed_documents", "check_packed_documents"), "10a": ("gqa", "check_gqa"), "10b": ("rope_cp", "check_rope_cp"),
    "11a": ("dispatch", "check_dispatch"), "11b": ("node_routing", "check_node_routing"),
    "11c": ("expert_overlap", "check_overlapped_dispatch"),
}
# the routes written plainly: (the source, what the refusal says)
PLAIN = {
    "profile hook off and on": ("import sys\nsys.setprofile(None)\nsys.setprofile(print)\n",
                                "your code reaches the checker's watch (`setprofile`, line 2)"),
    "another thread": ("import threading\nthreading.Thread(target=print).start()\n",
                       "your code starts a thread or a process (`threading`, line 1)"),
    "source copied and exec'd": ("import inspect\nimport importlib\n"
                                 "exec(inspect.getsource(importlib.import_module('minitron.' + 'comm')))\n",
                                 "your code builds code at run time (`inspect`, line 1)"),
    "the watch patched": ("from minitron.labs.runner import Tripwire\nTripwire.armed = None\n",
                          "own minitron.labs.runner"),
    "the checker's reference called": ("import minitron.labs.gqa as reference\nrows = reference.share(2, 4)\n",
                                       "own minitron.labs.gqa"),
    "the solution notebook run": ("SOLUTION = open('labs/solutions/00_ring_allreduce.ipynb').read()\n",
                                  "your code reads or writes files (`open`, line 1)"),
    "the checker's functions patched": ("import sys\nsys.modules['minitron.labs.runner'].agree = print\n",
                                        "own minitron.labs.runner"),
}


def _check(lab: str):
    module, name = LABS[lab]
    return getattr(importlib.import_module(f"minitron.labs.{module}"), name)


def _forbidden(lab: str) -> str:
    return importlib.import_module(f"minitron.labs.{LABS[lab][0]}").FORBIDDEN[0]


def test_every_lab_is_listed():
    shipped = {p.name.split("_")[0] for p in (ROOT / "labs").glob("*.ipynb")}
    assert shipped == set(LABS)


@pytest.mark.parametrize("lab", LABS)
def test_each_plain_route_is_refused_by_every_lab_before_any_rank(lab):
    check = _check(lab)
    for route, (source, said) in PLAIN.items():
        msg = check(source)["message"]
        assert said in msg, (lab, route, msg)
    # the answer built at import time with the engine's piece (the lab's own forbidden name)
    engine = _forbidden(lab)
    module, _, name = engine.rpartition(".")
    source = f"from {module} import {name}\nANSWER = {name}\n" if module.startswith("minitron.") else \
        f"import {engine}\nANSWER = 1\n"
    msg = check(source)["message"]
    assert msg.startswith("your code uses the engine's own") and "(line 1)" in msg, (lab, msg)


# --- past the screen: every name built at run time --------------------------------------------------
def piece(x):
    """Stands for the engine's piece a lab watches."""
    return x + 1


BUILT = {  # each route with no name the screen reads; what the watch says
    "profile hook off and on": ("import sys\ndef f(x):\n    off = getattr(sys, 'setpro' + 'file')\n    off(None)\n"
                                "    y = PIECE(x)\n    off(HOOK)\n    return y\n", "switches the checker's watch"),
    "another thread": ("import importlib\ndef f(x):\n    t = importlib.import_module('thr' + 'eading')\n"
                       "    out = []\n    th = getattr(t, 'Thr' + 'ead')(target=lambda: out.append(PIECE(x)))\n"
                       "    th.start()\n    th.join()\n    return out[0]\n", "starts a thread"),
    "source copied and exec'd": ("import importlib\ndef f(x):\n    b = importlib.import_module('built' + 'ins')\n"
                                 "    ns = {}\n    vars(b)['ex' + 'ec']('def g(x):\\n    return x + 1', ns)\n"
                                 "    return ns['g'](x)\n", "builds code at run time (exec)"),
    "the solution notebook run": ("import importlib\ndef f(x):\n    b = importlib.import_module('built' + 'ins')\n"
                                  "    vars(b)['op' + 'en']('/dev/null').close()\n    return x + 1\n",
                                  "reads or writes files (open)"),
    "the watch patched": ("import sys\ndef f(x):\n    m = sys.modules['minitron.la' + 'bs.runner']\n"
                          "    m.describe_calls = m.describe\n    return PIECE(x)\n",
                          "changed the checker's own minitron.labs.runner.describe_calls"),
    "the checker's functions patched": ("import sys\ndef f(x):\n    m = sys.modules['minitron.la' + 'bs.zero3']\n"
                                        "    m.close = lambda a, b: True\n    return x + 1\n",
                                        "changed the checker's own minitron.labs.zero3.close"),
    "the answer built at import time": ("ANSWER = PIECE(1)\ndef f(x):\n    return ANSWER + x - 1\n",
                                        "runs the engine's own piece"),
}


def _run_watched(source: str, watch_factory):
    """Load `source` and call its f(1) the way a lab does: both armed."""
    import sys

    namespace = {"PIECE": piece, "HOOK": None}
    saved = {name: dict(vars(sys.modules[name])) for name in ("minitron.labs.runner", "minitron.labs.zero3")}
    try:
        with watch_factory():
            ns = load(source, ("f",), namespace)
            ns["HOOK"] = sys.getprofile()
            ns["f"](1)
    finally:  # the planted patches undone
        for name, attrs in saved.items():
            vars(sys.modules[name]).update(attrs)


class _Tripwire:
    def __init__(self):
        self.watch = Tripwire({"piece": piece})
        self.watch.guarded += ("minitron.labs.zero3",)  # as lab 03c's own module would be, had it made it

    def __enter__(self):
        self.cm = self.watch.armed()
        return self.cm.__enter__()

    def __exit__(self, *exc):
        return self.cm.__exit__(*exc)


@pytest.mark.parametrize("route", BUILT)
def test_each_built_route_is_refused_by_the_run_time_watch(route):
    source, said = BUILT[route]
    assert routes.route_in(__import__("ast").parse(source)) is None, "the screen would read this one"
    with pytest.raises(LabError) as e:
        _run_watched(source, _Tripwire)
    assert said in str(e.value), (route, str(e.value))


@pytest.mark.parametrize("route", [r for r in BUILT if r not in ("the answer built at import time",)])
def test_lab_03c_watch_refuses_the_built_routes_too(route):
    source, said = BUILT[route]
    watch = zero3.EngineWatch()
    _run_watched(source.replace("PIECE(x)", "x + 1").replace("PIECE(1)", "2"), lambda: watch)
    assert said.split(" (")[0] in watch.problem() and watch.problem().startswith("your code"), (route, watch.problem())


def test_what_the_readme_says_is_not_refused_is_not():
    """The README's one route left open: the checker's objects found through gc and changed in
    place (no name of a module changes, no escape call is made)."""
    readme = (ROOT / "labs" / "README.md").read_text()
    assert "found through `gc` and changed in place" in readme
    source = ("import gc\ndef f(x):\n    for o in gc.get_objects():\n        if type(o).__name__ == 'Tripwire':\n"
              "            o.codes.clear()\n    return PIECE(x)\n")
    _run_watched(source, _Tripwire)  # not refused: the README says so
    assert "reached by built names in the\nlabs other than 10a, 11a and 11b" in readme
    reference = ("import sys\ndef f(x):\n    return sys.modules['minitron.la' + 'bs.zero3'].divisor\n")
    _run_watched(reference, _Tripwire)  # a lab that does not watch its own answers: not refused either


def test_what_a_learner_may_do_is_not_refused():
    """An import on first use, a dataclass, torch's own work: not routes (the trusted files)."""
    source = ("import dataclasses\nimport collections\ndef f(x):\n    import fractions\n"
              "    P = collections.namedtuple('P', 'a b')\n    D = dataclasses.make_dataclass('D', ['a'])\n"
              "    return P(D(x).a, 1).a + 1\n")
    _run_watched(source, _Tripwire)
