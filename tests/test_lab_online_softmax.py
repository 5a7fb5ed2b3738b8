"""Lab 09's checker (``minitron.labs.online_softmax``): the reference and the engine's own
``combine`` pass, the usual mistakes each get their one line.

A syntax error, the stub and the engine's own function are refused before any rank starts; everything else runs on 2 gloo ranks
(``--cp 2``), all the sources in one launch.
"""
import inspect

import pytest

from minitron.labs import check_online_softmax
from minitron.labs.online_softmax import RULE, check_online_softmax_all
from minitron.parallel import context_parallel
from planted import broken_in

REFERENCE = '''
def combine(out, lse, out_b, lse_b):
    new = torch.logaddexp(lse, lse_b)
    return (torch.exp(lse - new).unsqueeze(-1) * out + torch.exp(lse_b - new).unsqueeze(-1) * out_b), new
'''


broken = broken_in(REFERENCE)


def test_syntax_error_stub_and_engine_copy_need_no_ranks():
    res = check_online_softmax(broken("def combine(out, lse, out_b, lse_b):", "def combine(out, lse, out_b, lse_b)"))
    assert res["ok"] is False and res["message"].startswith("your code does not compile: expected ':' at line 2")
    stub = "def combine(out, lse, out_b, lse_b):\n    raise NotImplementedError  # your code here\n"
    assert check_online_softmax(stub)["message"] == ("combine is not written yet (still `raise NotImplementedError`): "
                                                     "fill in the `# your code here` lines in SOURCE")
    for engine in ("from minitron.parallel.context_parallel import combine\n",
                   "import minitron.parallel.context_parallel as cp\n\n"
                   "def combine(out, lse, out_b, lse_b):\n    return cp.combine(out, lse, out_b, lse_b)\n"):
        assert check_online_softmax(engine)["message"].startswith(
            "your code uses the engine's own minitron.parallel.context_parallel.combine (line ")


@pytest.mark.multirank
def test_reference_passes_and_mistakes_get_one_line():
    engine = inspect.getsource(context_parallel.combine)
    cases = {
        "reference": REFERENCE,
        "engine": engine,  # the engine's own combination passes its lab
        "outputs added": broken("return (torch.exp(lse - new).unsqueeze(-1) * out + torch.exp(lse_b - new)"
                                ".unsqueeze(-1) * out_b), new", "return out + out_b, new"),
        "outputs averaged": broken("return (torch.exp(lse - new).unsqueeze(-1) * out + torch.exp(lse_b - new)"
                                   ".unsqueeze(-1) * out_b), new", "return (out + out_b) / 2, new"),
        "lse summed": broken("), new", "), lse + lse_b"),
        "lse maxed": broken("), new", "), torch.maximum(lse, lse_b)"),
        "overflows": '''
def combine(out, lse, out_b, lse_b):
    e, e_b = lse.exp(), lse_b.exp()
    return (e / (e + e_b)).unsqueeze(-1) * out + (e_b / (e + e_b)).unsqueeze(-1) * out_b, (e + e_b).log()
''',
        # one maximum for all the queries: exact on the small blocks, -inf once scores spread over hundreds
        "one max for all queries": broken("new = torch.logaddexp(lse, lse_b)",
                                          "m = torch.maximum(lse.max(), lse_b.max())\n"
                                          "    new = m + torch.log(torch.exp(lse - m) + torch.exp(lse_b - m))"),
        # accepted by the checker's old cases (one attention layout, scores of one scale merged in one order):
        # rescaled relative to the block's L_b alone, exact until the running L is 709 above it
        "rescaled relative to L_b": broken("new = torch.logaddexp(lse, lse_b)",
                                           "new = lse_b + torch.log1p(torch.exp(lse - lse_b))"),
        # dimensions counted from the front: fits [b, h, s, d], not grouped-query [b, kv, G, s, d]
        "unsqueeze(3)": REFERENCE.replace(".unsqueeze(-1)", ".unsqueeze(3)"),
        # caught before too, but as e^L overflowing: rescaled relative to the running L alone
        "rescaled relative to L": broken("new = torch.logaddexp(lse, lse_b)",
                                         "new = lse + torch.log1p(torch.exp(lse_b - lse))"),
        "a tuple of one": broken("), new", "),"),
        "raises": broken("new = torch.logaddexp(lse, lse_b)", "new = torch.logaddexp(lse)"),
        # what the old checker called a wrong fold of three blocks
        "in place": broken("    return (torch.exp(lse - new).unsqueeze(-1) * out + torch.exp(lse_b - new)"
                           ".unsqueeze(-1) * out_b), new",
                           "    out.mul_(torch.exp(lse - new).unsqueeze(-1))\n"
                           "    return out.add_(torch.exp(lse_b - new).unsqueeze(-1) * out_b), new"),
        # the engine's own function reached past the screen
        "engine by importlib": "import importlib\ncombine = importlib.import_module('minitron.' + "
                               "'parallel.context_parallel').combine\n",
        "engine by sys.modules": "import sys\n\ndef combine(out, lse, out_b, lse_b):\n    return vars(sys.modules["
                                 "'minitron.parallel' + '.context_parallel'])['comb' + 'ine'](out, lse, out_b, lse_b)\n",
        "engine by __import__": "def combine(out, lse, out_b, lse_b):\n    m = __import__('minitron.parallel.'"
                                " + 'tensor', fromlist=['x'])\n    return m.online_softmax_combine(out, lse, out_b, "
                                "lse_b)\n",
    }
    got = dict(zip(cases, check_online_softmax_all(list(cases.values()))))
    for name in ("reference", "engine"):
        assert got[name]["ok"], (name, got[name])
        assert got[name]["max_param_rel_diff"] <= 1e-9 and got[name]["message"] == (
            "your combine trains exactly like the single-device model (--cp 2 --dp 2 and --cp 4: ring attention)")
    want = {
        "outputs added": "your out is O + O_b",
        "outputs averaged": "your out averages the two blocks equally",
        "lse summed": "your lse is the sum L + L_b",
        "lse maxed": "your lse is max(L, L_b), the larger block's alone",
        "overflows": "gives inf or nan: e^L overflows",
        "one max for all queries": "your lse is -inf for some queries: one maximum over all the queries (lse.max())",
        "rescaled relative to L_b": "gives inf or nan when L exceeds L_b by 835: you rescale relative to L_b alone",
        "unsqueeze(3)": "on grouped-query blocks out [b, kv, G, sq, d], lse [b, kv, G, sq] your combine fails: it "
                        "counts dimensions from the front",
        "rescaled relative to L": "gives inf or nan when L_b exceeds L by 835: you rescale relative to L alone",
        "a tuple of one": "returned tuple of 1: return the pair (out, lse)",
        "raises": "TypeError: logaddexp() missing 1 required positional arguments: \"other\" in combine, line 3 of your code",
        "in place": "your combine changed its input out in place: return new tensors",
        "engine by importlib": "your code runs the engine's own minitron.parallel.context_parallel.combine: ",
        "engine by sys.modules": "your code runs the engine's own minitron.parallel.context_parallel.combine (from "
                                 "line 4 of your code",
        "engine by __import__": "your code runs the engine's own minitron.parallel.context_parallel.combine (from "
                                "line 3 of your code",
    }
    for name, words in want.items():
        res = got[name]
        assert not res["ok"] and words in res["message"] and "\n" not in res["message"], (name, res)
    assert RULE in got["outputs added"]["message"]
    assert "e^L overflows" not in got["rescaled relative to L"]["message"]
