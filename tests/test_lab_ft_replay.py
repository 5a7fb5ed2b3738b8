"""Lab 08a's checker (``minitron.labs.ft_replay``): the reference replays a real fault-tolerant
run (2 replicas, replica 0 SIGKILLed and recovered live) exactly, float64; each usual mistake gets
its own line (every replica every step, the whole batch as the divisor, a replica's mean per row,
the first n replicas' rows, the absent replicas' rows, the journal's step taken as the index, a
replica count hard-wired); the engine's fault-tolerance module is refused in the source and at run
time. The stub, a syntax error and the engine named in the source are refused before any run;
every other case shares ONE run (a module fixture), as the lab's own checks do."""
import importlib.util

import pytest
import torch

from minitron.labs import ft_replay as lab
from minitron.labs.ft_replay import check_ft_replay
from planted import assert_each_named, broken_in

needs_torchft = pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="torchft is not installed")

REFERENCE = '''
def step_weights(journal, step, global_batch, replicas):
    took = sorted({rec["replica"] for rec in journal if rec["step"] == step + 1})
    share = global_batch // replicas
    w = torch.zeros(global_batch, dtype=torch.float64)
    for r in took:
        w[r * share:(r + 1) * share] = 1.0
    return w / w.sum()
'''

STUB = '''
def step_weights(journal, step, global_batch, replicas):
    raise NotImplementedError  # your code here
'''


broken = broken_in(REFERENCE)


def test_the_stub_a_syntax_error_and_the_engine_need_no_run():
    assert check_ft_replay(STUB)["message"] == (
        "step_weights is not written yet (still `raise NotImplementedError`): fill in the `# your code here` lines "
        "in SOURCE")
    res = check_ft_replay(broken("def step_weights(journal, step, global_batch, replicas):",
                                 "def step_weights(journal, step, global_batch, replicas)"))
    assert res["message"].startswith("your code does not compile: expected ':'"), res
    msg = check_ft_replay("from minitron.fault_tolerance import step_weights as sw\n" + REFERENCE)["message"]
    assert msg.startswith("your code uses the engine's own minitron.fault_tolerance.step_weights (line 1)"), msg


def test_the_held_out_journals_catch_what_the_run_cannot():
    """Cases found on the 3- and 4-replica journals before any run (no rank starts)."""
    res = {name: check_ft_replay(src) for name, src in {
        "replicas hard-wired": broken("    share = global_batch // replicas\n", "    share = global_batch // 2\n"),
        "engine by importlib": "import importlib\n" + broken(
            "    took = sorted(", "    return importlib.import_module('minitron.' + 'fault_tolerance').step_weights("
                                 "global_batch, replicas, {step: [0]})(step)\n    took = sorted("),
        "changes the journal": broken("    took = sorted(", "    journal.clear()\n    took = sorted("),
        "counts, not shares": broken("    return w / w.sum()", "    return w.long()"),
    }.items()}
    assert_each_named(res, {
        "replicas hard-wired": "journal of 3 replicas",
        "engine by importlib": "your code runs the engine's own minitron.fault_tolerance",
        "changes the journal": "your step_weights changes the journal it is given",
        "counts, not shares": "returned torch.int64 weights",
    })


def test_every_named_mistake_differs_from_the_answer_on_a_held_out_journal():
    """A mistake the checker names must be wrong on some step of its journals (else it could
    never be told apart), and the checker's replica rows are the engine's (data.dp_rows)."""
    from minitron import data, fault_tolerance as ftm

    differs: dict[str, bool] = {}
    for R, B, taken, _ in lab.HELD_OUT:
        want = ftm.step_weights(B, R, taken)
        for r in range(R):
            assert torch.equal(lab._rows(B, R, [r]).nonzero().flatten(), torch.arange(B)[data.dp_rows(B, R, r)])
        for s in taken:
            for w, said in lab._mistakes(B, R, taken, s):
                differs[said] = differs.get(said, False) or not torch.allclose(w, want(s))
    assert len(differs) == 7 and all(differs.values()), differs


@pytest.fixture(scope="module")
def run():
    return lab.ft_run()


@pytest.mark.multirank
@needs_torchft
def test_reference_replays_the_run_and_mistakes_get_one_line(run):
    took = '    took = sorted({rec["replica"] for rec in journal if rec["step"] == step + 1})\n'
    cases = {
        "reference": REFERENCE,
        "every replica every step": broken(took, "    took = range(replicas)\n"),
        "the whole batch as divisor": broken("    return w / w.sum()", "    return w / global_batch"),
        "a replica's mean per row": broken("    return w / w.sum()", "    return w / share"),
        "the first n replicas": broken(took, took + "    took = range(len(took))\n"),
        "the absent replicas": broken(took, took + "    took = [r for r in range(replicas) if r not in took] "
                                                   "or took\n"),
        "the journal's step as the index": broken("rec[\"step\"] == step + 1", "rec[\"step\"] == step"),
        "the next step's records": broken("rec[\"step\"] == step + 1", "rec[\"step\"] == step + 2"),
        "right only on the held-out sizes": broken("    share = global_batch // replicas\n",
                                                   "    share = global_batch // replicas\n    if replicas == 2:\n"
                                                   "        return torch.full((global_batch,), 1 / global_batch, "
                                                   "dtype=torch.float64)\n"),
    }
    res = {name: check_ft_replay(src, run) for name, src in cases.items()}
    ref = res.pop("reference")
    assert ref["ok"], ref["message"]
    assert ref["max_param_rel_diff"] <= lab.TOL and ref["fewer_replicas"] == run["fewer_replicas"]
    assert all(run["taken"][s - 1] == [1] for s in run["fewer_replicas"]), run["taken"]  # replica 1 went on alone
    assert_each_named(res, {
        "every replica every step": "averages every replica's rows at every step",
        "the whole batch as divisor": "divides by the whole global batch",
        "a replica's mean per row": "gives each row the weight of one replica's mean",
        "the first n replicas": "takes the rows of the first n replicas",
        "the absent replicas": "takes the rows of the replicas that were not in the step's quorum",
        "the journal's step as the index": "finds no replica for step 0",
        "the next step's records": "reads the records of the next step",
        "right only on the held-out sizes": "averages every replica's rows at every step",
    })
    assert "the real run's journal" in res["right only on the held-out sizes"]["message"]
    # the oracle can fail: the replay's own comparison, with the run's parameters moved
    moved = {r: {k: {**v, "param": v["param"] + 1e-6} for k, v in p.items()} for r, p in run["params"].items()}
    res = check_ft_replay(REFERENCE, {**run, "params": moved})
    assert not res["ok"] and "the replay differs from the run's parameters" in res["message"], res


def test_an_endless_loop_and_an_exception_each_end_in_one_line():
    res = check_ft_replay(broken("    share = global_batch // replicas\n", "    while True:\n        pass\n"), timeout=2)
    assert res["message"] == "your step_weights ran past 2 s: an endless loop?", res
    res = check_ft_replay(broken("    share = global_batch // replicas\n", "    share = global_batch // 0\n"))
    assert res["message"].startswith("ZeroDivisionError: integer division or modulo by zero in step_weights, line 4 "
                                     "of your code") and "\n" not in res["message"], res
