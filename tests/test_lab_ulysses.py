"""Lab 09b's checker (``minitron.labs.ulysses``): the reference re-layouts pass inside the engine
(Ulysses attention under --cp 4 and --cp 2 --tp 2 vs one device), the usual mistakes each get
their own line, the engine's own re-layouts are refused by any route. One 4-rank launch."""
import pytest

from minitron.labs.ulysses import check_ulysses, check_ulysses_all
from planted import assert_each_named, broken_in

REFERENCE = '''
def seq_to_heads(x, comm):
    n = comm.size("cp")
    b, h, s, d = x.shape
    blocks = x.reshape(b, n, h // n, s, d).transpose(0, 1).contiguous()
    got = comm.all_to_all(blocks, "cp")
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def heads_to_seq(y, comm):
    n = comm.size("cp")
    b, h, s, d = y.shape
    blocks = y.reshape(b, h, n, s // n, d).permute(2, 0, 1, 3, 4).contiguous()
    got = comm.all_to_all(blocks, "cp")
    return got.transpose(0, 1).reshape(b, n * h, s // n, d)
'''

STUB = '''
def seq_to_heads(x, comm):
    raise NotImplementedError  # your code here


def heads_to_seq(y, comm):
    raise NotImplementedError  # your code here
'''


broken = broken_in(REFERENCE)


def test_stub_and_engine_copy_need_no_ranks():
    assert check_ulysses(STUB)["message"] == ("seq_to_heads and heads_to_seq are not written yet (still `raise "
                                              "NotImplementedError`): fill in the `# your code here` lines in SOURCE")
    msg = check_ulysses("from minitron.parallel.context_parallel import _seq_to_heads\n" + REFERENCE)["message"]
    assert msg.startswith("your code uses the engine's own minitron.parallel.context_parallel._seq_to_heads"), msg


@pytest.mark.multirank
def test_reference_passes_and_mistakes_get_one_line():
    cases = {
        "reference": REFERENCE,
        "interleaved heads": broken("x.reshape(b, n, h // n, s, d).transpose(0, 1)",
                                    "x.reshape(b, h // n, n, s, d).permute(2, 0, 1, 3, 4)"),
        "tokens out of order": broken("got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)",
                                      "got.permute(1, 2, 3, 0, 4).reshape(b, h // n, n * s, d)"),
        "all-gather": broken('    got = comm.all_to_all(blocks, "cp")\n    return got.permute',
                             '    got = comm.all_to_all(blocks, "cp")\n    comm.all_reduce(x.clone(), "cp")\n'
                             '    return got.permute'),
        "not the inverse": broken("return got.transpose(0, 1).reshape(b, n * h, s // n, d)",
                                  "return got.transpose(0, 1).reshape(b, h, n, s // n, d).transpose(1, 2)"
                                  ".reshape(b, n * h, s // n, d)"),
        "wrong shape": broken("return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)",
                              "return got"),
        "engine by importlib": "import importlib\n" + broken(
            "def seq_to_heads(x, comm):\n",
            "def seq_to_heads(x, comm):\n    return vars(importlib.import_module('minitron.parallel.' + "
            "'context_parallel'))['_seq_to' + '_heads'](x, comm)\n"),
    }
    got = dict(zip(cases, check_ulysses_all(list(cases.values()))))
    res = got["reference"]
    assert res["ok"] and res["max_param_rel_diff"] <= 1e-9 and res["max_loss_abs_diff"] <= 1e-9, res
    want = {
        "interleaved heads": "every 4th head",
        "tokens out of order": "its tokens in another order",
        "all-gather": "exactly one all-to-all on 'cp'",
        "not the inverse": "is not x on rank",
        "wrong shape": "want [b, H/N, N·s_loc, d]",
        "engine by importlib": "runs the engine's own minitron.parallel.context_parallel._seq_to_heads",
    }
    assert_each_named(got, want)
