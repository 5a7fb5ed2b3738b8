"""Lab 10a's checker (``minitron.labs.gqa``): the reference passes inside the engine, the usual
mistakes each get their own line, the engine's own pieces are refused by any route.

A syntax error, the stub and the engine's own functions named in the source are refused
before any rank starts; everything else runs on 4 gloo ranks, all the sources in one launch
(the mistakes are found by the checks on one tensor, before any training)."""
import pytest

from minitron.labs.gqa import check_gqa, check_gqa_all
from planted import assert_each_named, broken_in

REFERENCE = '''
def kv_rows(kv_heads, head_rows, t, r):
    if kv_heads >= t:
        n = kv_heads // t
        return r * n * head_rows, (r + 1) * n * head_rows
    head = r // (t // kv_heads)
    return head * head_rows, (head + 1) * head_rows


def sum_kv_grad(grad, comm, kv_heads, t):
    if kv_heads >= t:
        return grad
    share = t // kv_heads
    return comm.all_reduce(grad, "tp" if share == t else f"tp_kv{share}")
'''

STUB = '''
def kv_rows(kv_heads, head_rows, t, r):
    raise NotImplementedError  # your code here


def sum_kv_grad(grad, comm, kv_heads, t):
    raise NotImplementedError  # your code here
'''


broken = broken_in(REFERENCE)


def test_syntax_error_stub_and_engine_copy_need_no_ranks():
    res = check_gqa(broken("def kv_rows(kv_heads, head_rows, t, r):", "def kv_rows(kv_heads, head_rows, t, r)"))
    assert res["ok"] is False and res["message"].startswith("your code does not compile: expected ':' at line 2")
    assert check_gqa(STUB)["message"] == ("kv_rows and sum_kv_grad are not written yet (still `raise "
                                          "NotImplementedError`): fill in the `# your code here` lines in SOURCE")
    for engine, name in (("from minitron.parallel.tensor import block_rows\n" + REFERENCE, "block_rows"),
                         ("import minitron.optim as o\n" + broken("return comm.all_reduce", "return o.sync_replicated_grads"),
                          "sync_replicated_grads"),
                         ("from minitron.labs.gqa import _rows\n" + REFERENCE, "minitron.labs.gqa")):
        msg = check_gqa(engine)["message"]
        assert msg.startswith("your code uses the engine's own") and name in msg, msg


@pytest.mark.multirank
def test_reference_passes_and_mistakes_get_one_line():
    cases = {
        "reference": REFERENCE,
        "part of a head": broken("    head = r // (t // kv_heads)\n    return head * head_rows, (head + 1) * head_rows",
                                 "    n = kv_heads * head_rows // t\n    return r * n, (r + 1) * n"),
        "replicas interleaved": broken("head = r // (t // kv_heads)", "head = r % kv_heads"),
        "heads not rows": broken("return r * n * head_rows, (r + 1) * n * head_rows", "return r * n, (r + 1) * n"),
        "no sum": broken('    return comm.all_reduce(grad, "tp" if share == t else f"tp_kv{share}")', "    return grad"),
        "a mean": broken('return comm.all_reduce(grad, "tp" if share == t else f"tp_kv{share}")',
                         'return comm.all_reduce(grad, "tp" if share == t else f"tp_kv{share}") / share'),
        "whole tensor group": broken('"tp" if share == t else f"tp_kv{share}"', '"tp"'),
        "sums when split": broken("    if kv_heads >= t:\n        return grad\n",
                                  "    if kv_heads >= t:\n        return comm.all_reduce(grad, 'tp')\n"),
        "t hard-wired to the notebook's 4": broken("    if kv_heads >= t:\n        return grad\n    share = t // kv_heads",
                                                   "    if kv_heads >= 4:\n        return grad\n    share = 4 // kv_heads"),
        "copies grouped in the notebook's pairs": broken("share = t // kv_heads", "share = 2"),
        "malformed rows": broken("return head * head_rows, (head + 1) * head_rows", "return head * head_rows"),
        "raises": broken("share = t // kv_heads", "share = t // kv_heads // 0"),
        # the engine's own pieces reached past the screen
        "engine by importlib": "import importlib\n" + broken(
            "def sum_kv_grad(grad, comm, kv_heads, t):\n    if kv_heads >= t:",
            "def sum_kv_grad(grad, comm, kv_heads, t):\n    importlib.import_module('minitron.' + 'optim')"
            ".sync_replicated_grads([], comm)\n    if kv_heads >= t:"),
        "checker by sys.modules": "import sys\n" + broken(
            "def kv_rows(kv_heads, head_rows, t, r):\n",
            "def kv_rows(kv_heads, head_rows, t, r):\n    return vars(sys.modules['minitron.la' + 'bs.gqa'])['_ro' + "
            "'ws'](kv_heads, head_rows, t, r)\n"),
    }
    got = dict(zip(cases, check_gqa_all(list(cases.values()))))
    res = got["reference"]
    assert res["ok"] and res["max_param_rel_diff"] <= 1e-9 and res["max_loss_abs_diff"] <= 1e-9, res
    assert "--tp 4 with 1 and 2 kv heads" in res["message"]
    want = {
        "part of a head": "part of a kv head",
        "replicas interleaved": "the copies of a kv head sit on neighbouring ranks",
        "heads not rows": "that counts heads, not rows",
        "no sum": "leaves rank",
        "a mean": "averages the",
        "whole tensor group": "sums over all 4 tensor ranks",
        "sums when split": "each rank's kv heads are its own",
        "t hard-wired to the notebook's 4": broken("    if kv_heads >= t:\n        return grad\n    share = t // kv_heads",
                                                   "    if kv_heads >= 4:\n        return grad\n    share = 4 // kv_heads"),
        "copies grouped in the notebook's pairs": broken("share = t // kv_heads", "share = 2"),
        "t hard-wired to the notebook's 4": "(right at t = 4, wrong at t = 2: is t = 4 hard-wired?)",
        "copies grouped in the notebook's pairs": "sums over 'tp_kv2': the copies grouped by 2, the wrong factor",
        "malformed rows": "return the pair (start, stop)",
        "raises": "ZeroDivisionError",
        "engine by importlib": "runs the engine's own minitron.optim.sync_replicated_grads",
        "checker by sys.modules": "runs the engine's own minitron.labs.gqa",
    }
    assert_each_named(got, want)
