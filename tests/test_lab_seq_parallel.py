"""Lab 04c's checker (``minitron.labs.seq_parallel``): the reference and the engine's own
``_AllGatherLinear`` pass, the usual mistakes each get their one line.

A syntax error, the stub and the engine's own class are refused before any rank starts; everything else runs on 4 gloo ranks,
all the sources in one launch (``check_all_gather_linear_all``: the ranks agree on each
case's verdict through the rendezvous store, so they stay in step and go on to the next).
"""
import inspect

import pytest

from minitron.labs import check_all_gather_linear
from minitron.labs.seq_parallel import REDUCE_SCATTER, check_all_gather_linear_all
from minitron.parallel import tensor
from planted import broken_in

REFERENCE = '''
class AllGatherLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, comm):
        ctx.comm, ctx.has_bias = comm, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(comm.all_gather(x, "tp", dim=1), weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        comm = ctx.comm
        dx = comm.reduce_scatter(dy @ weight, "tp", dim=1)
        x_full = comm.all_gather(x, "tp", dim=1)
        dw = dy.flatten(0, 1).t() @ x_full.flatten(0, 1)
        db = dy.sum((0, 1)) if ctx.has_bias else None
        return dx, dw, db, None
'''


broken = broken_in(REFERENCE)


def test_syntax_error_stub_and_engine_copy_need_no_ranks():
    res = check_all_gather_linear(broken("def backward(ctx, dy):", "def backward(ctx, dy)"))
    assert res == {"ok": False, "message": "your code does not compile: expected ':' at line 10: "
                                           "`def backward(ctx, dy)`"}
    stub = broken("        x, weight = ctx.saved_tensors\n        comm = ctx.comm\n"
                  "        dx = comm.reduce_scatter(dy @ weight, \"tp\", dim=1)\n"
                  "        x_full = comm.all_gather(x, \"tp\", dim=1)\n"
                  "        dw = dy.flatten(0, 1).t() @ x_full.flatten(0, 1)\n"
                  "        db = dy.sum((0, 1)) if ctx.has_bias else None\n        return dx, dw, db, None\n",
                  "        raise NotImplementedError  # your code here\n")
    assert check_all_gather_linear(stub)["message"].startswith("AllGatherLinear.backward is not written yet")
    engine = "from minitron.parallel.tensor import _AllGatherLinear as AllGatherLinear\n"
    assert check_all_gather_linear(engine)["message"].startswith(
        "your code uses the engine's own minitron.parallel.tensor._AllGatherLinear (line 1)")


@pytest.mark.multirank
def test_reference_passes_and_mistakes_get_one_line():
    engine = ("from minitron.parallel.tensor import SEQ, wants_grad\n"
              + inspect.getsource(tensor._AllGatherLinear).replace("class _AllGatherLinear(",
                                                                   "class AllGatherLinear("))
    saves_gathered = broken("        ctx.save_for_backward(x, weight)\n        return F.linear(comm.all_gather(x, "
                            "\"tp\", dim=1), weight, bias)",
                            "        x = comm.all_gather(x, \"tp\", dim=1)\n        ctx.save_for_backward(x, weight)\n"
                            "        return F.linear(x, weight, bias)")
    saves_gathered = broken("        x_full = comm.all_gather(x, \"tp\", dim=1)\n", "        x_full = x\n", saves_gathered)
    cases = {
        "reference": REFERENCE,
        "engine": engine,  # the engine's own operator passes its lab
        "saves gathered": saves_gathered,
        "keeps gathered on ctx": broken('        return F.linear(comm.all_gather(x, "tp", dim=1), weight, bias)',
                                        '        ctx.x_full = comm.all_gather(x, "tp", dim=1)\n'
                                        '        return F.linear(ctx.x_full, weight, bias)'),
        "all-reduce": broken('dx = comm.reduce_scatter(dy @ weight, "tp", dim=1)',
                             'dx = comm.all_reduce(dy @ weight, "tp").chunk(comm.size("tp"), dim=1)[comm.index("tp")]'),
        "all-reduce whole": broken('dx = comm.reduce_scatter(dy @ weight, "tp", dim=1)',
                                   'dx = comm.all_reduce(dy @ weight, "tp")'),
        "not reduced": broken('dx = comm.reduce_scatter(dy @ weight, "tp", dim=1)', "dx = dy @ weight"),
        "not reduced, sliced": broken('dx = comm.reduce_scatter(dy @ weight, "tp", dim=1)',
                                      'dx = (dy @ weight).chunk(comm.size("tp"), dim=1)[comm.index("tp")]'),
        "no re-gather": broken('x_full = comm.all_gather(x, "tp", dim=1)', "x_full = x"),
        "dW from own tokens": broken("dw = dy.flatten(0, 1).t() @ x_full.flatten(0, 1)",
                                     'dw = dy.chunk(comm.size("tp"), dim=1)[comm.index("tp")].flatten(0, 1).t() @ x.flatten(0, 1)'),
        # a mean where autograd sums: what a batch of one (b = 1) lets through
        "dW averaged over the batch": broken("dw = dy.flatten(0, 1).t() @ x_full.flatten(0, 1)",
                                             "dw = (dy.transpose(1, 2) @ x_full).mean(0)"),
        "no bias grad": broken("db = dy.sum((0, 1)) if ctx.has_bias else None", "db = None"),
        "bias grad always": broken("db = dy.sum((0, 1)) if ctx.has_bias else None", "db = dy.sum((0, 1))"),
        "gathers batch": broken('F.linear(comm.all_gather(x, "tp", dim=1)', 'F.linear(comm.all_gather(x, "tp")'),
        "raises": broken("        ctx.comm, ctx.has_bias = comm, bias is not None\n",
                         "        raise NotImplementedError  # your code here\n"),
        "no class": REFERENCE.replace("class AllGatherLinear(", "class Linear("),
        # what the old checker (2 ranks) let through
        "two ranks hard-wired": broken('dx = comm.reduce_scatter(dy @ weight, "tp", dim=1)',
                                       'dx = comm.reduce_scatter(dy @ weight, "tp", dim=1)\n'
                                       '        dx = torch.cat([dx, dx], 1)[:, :dy.shape[1] // 2]'),
        # the engine's own class reached past the screen
        "engine by importlib": "import importlib\nAllGatherLinear = importlib.import_module('minitron.' + "
                               "'parallel.tensor')._AllGatherLinear\n",
        "engine by sys.modules": "import sys\nT = sys.modules['minitron.parallel' + '.tensor']\n"
                                 "AllGatherLinear = vars(T)['_AllGather' + 'Linear']\n",
        "engine by __import__": broken('return F.linear(comm.all_gather(x, "tp", dim=1), weight, bias)',
                                       "return __import__('minitron.parallel' + '.tensor', fromlist=['x'])"
                                       ".all_gather_linear(x, weight, bias, __import__('types').SimpleNamespace("
                                       "comm=comm))"),
    }
    res = dict(zip(cases, check_all_gather_linear_all(list(cases.values()), timeout=30)))
    for name in ("reference", "engine"):
        assert res[name]["ok"], (name, res[name]["message"])
        assert res[name]["max_loss_abs_diff"] <= 1e-9 and res[name]["max_param_rel_diff"] <= 1e-9
        assert res[name]["message"] == ("your AllGatherLinear trains exactly like the single-device model (--tp 4 --sp "
                                        "and --tp 2 --dp 2 --sp)")
    msg = {name: r["message"] for name, r in res.items() if not r["ok"]}
    assert len(msg) == len(cases) - 2, msg
    assert msg["saves gathered"] == ("your forward saves the gathered input [b, s, h] (4× the shard): save the shard "
                                     "and all-gather it again in backward — that is what makes Table 2's 34/t hold")
    assert msg["keeps gathered on ctx"] == msg["saves gathered"]
    assert msg["all-reduce"] == ("your backward communicates all_reduce of [2, 12, 5] on 'tp', all_gather of [2, 3, 5] "
                                 f"on 'tp': {REDUCE_SCATTER} (an all-reduce moves twice the bytes and leaves every "
                                 "rank the whole sequence)")
    whole = ("your backward returns dX of shape [2, 12, 5], the whole sequence, for the shard x [2, 3, 5]: "
             + REDUCE_SCATTER)
    assert msg["all-reduce whole"] == whole
    assert msg["not reduced"] == whole
    assert msg["not reduced, sliced"] == ("your dX on tp rank 0 is this rank's dY·W alone, not summed over the "
                                          f"tensor ranks: {REDUCE_SCATTER}")
    assert msg["no re-gather"] == (
        "RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x24 and 6x5) in AllGatherLinear.backward, line 15 "
        "of your code: `dw = dy.flatten(0, 1).t() @ x_full.flatten(0, 1)` — dW = dYᵀ·X needs X for the whole "
        "sequence: all-gather the saved shard again (comm.all_gather(x, 'tp', dim=1))")
    assert msg["dW from own tokens"].startswith("your weight gradient uses only this rank's sequence shard of X")
    assert msg["dW averaged over the batch"] == (
        "your weight gradient is autograd's divided by 2, a mean over the batch (b = 2): the loss already averages, "
        "so dW = dYᵀ·X sums over every token of the gathered X")
    assert msg["no bias grad"] == ("your backward returns None for the bias gradient: return dY summed over the "
                                   "batch and the sequence, dY.sum((0, 1)) (None only when bias is None)")
    assert msg["bias grad always"] == ("called with bias=None (as the output layer calls it) your backward returns "
                                       "a bias gradient: return None for db then")
    assert msg["gathers batch"].startswith("your AllGatherLinear.forward returned a tensor of shape [8, 3, 4] for a "
                                           "shard x [2, 3, 5]")
    assert msg["gathers batch"].endswith("gather along the sequence, dim 1 (comm.all_gather(x, 'tp', dim=1))")
    assert msg["raises"] == ("NotImplementedError in AllGatherLinear.forward, line 5 of your code: "
                             "`raise NotImplementedError  # your code here`")
    assert msg["no class"] == "your code defines no AllGatherLinear: it must define AllGatherLinear"
    assert msg["two ranks hard-wired"] == (
        "your backward returns dX of shape [2, 6, 5], half the sequence, on 4 ranks: as if there were 2 ranks; each "
        f"of the t = comm.size('tp') = 4 ranks keeps s/t = 3 tokens: {REDUCE_SCATTER}")
    for name in ("engine by importlib", "engine by sys.modules", "engine by __import__"):
        assert msg[name].startswith("your code runs the engine's own minitron.parallel.tensor._AllGatherLinear"), \
            msg[name]
    assert all("\n" not in m and "Traceback" not in m for m in msg.values())
