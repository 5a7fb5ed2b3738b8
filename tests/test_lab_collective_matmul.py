"""Lab 04d's checker (``minitron.labs.collective_matmul``): the reference passes, trained in
the engine's place under --tp-overlap; each planted mistake gets its own one line.

A syntax error, the stub and the engine's own decomposition are refused before any rank
starts; everything else runs on 4 gloo ranks, all the sources in one launch
(``check_all_gather_matmul_all``: the ranks agree on each case's verdict through the
rendezvous store and go on to the next).
"""
import pytest

from minitron.labs.collective_matmul import check_all_gather_matmul, check_all_gather_matmul_all
from planted import assert_each_named, broken_in

REFERENCE = '''class AllGatherMatmul(torch.autograd.Function):
    """Y = [X_0 … X_{t−1}]·Wᵀ + b, each shard multiplied while the next one travels round the ring."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm):
        ctx.comm, ctx.has_bias = comm, bias is not None
        ctx.save_for_backward(x, weight)  # the shard only, as the all-gather linear
        t, r = comm.size("tp"), comm.index("tp")
        out, held = [None] * t, x
        for k in range(t):
            coming = comm.shift(held, "tp") if k < t - 1 else None  # bring shard r−k−1, pass this one on
            out[(r - k) % t] = F.linear(held, weight, bias)  # multiply shard r−k while it travels
            if coming is not None:
                held = coming.wait()
        return torch.cat(out, 1)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        comm = ctx.comm
        t, r = comm.size("tp"), comm.index("tp")
        dys = dy.chunk(t, 1)
        held, dw, total, arriving = x, None, None, None
        for k in range(t):
            coming = comm.shift(held, "tp", 1, tag=0) if k < t - 1 else None  # X re-gathered for dW
            c = (r - k) % t
            part = dys[c].flatten(0, 1).t() @ held.flatten(0, 1)  # dW += dY_cᵀ·X_c
            dw = part if dw is None else dw + part
            j = (r + k + 1) % t  # dX: chunk j's running sum, own chunk last
            total = dys[j] @ weight if arriving is None else dys[j] @ weight + arriving.wait()
            arriving = comm.shift(total, "tp", -1, tag=1) if k < t - 1 else None
            if coming is not None:
                held = coming.wait()
        db = dy.sum((0, 1)) if ctx.has_bias else None
        return total, dw, db, None
'''


broken = broken_in(REFERENCE)


FORWARD_LOOP = """        for k in range(t):
            coming = comm.shift(held, "tp") if k < t - 1 else None  # bring shard r−k−1, pass this one on
            out[(r - k) % t] = F.linear(held, weight, bias)  # multiply shard r−k while it travels
            if coming is not None:
                held = coming.wait()
"""


STUB = """
class AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, comm):
        raise NotImplementedError  # your code here

    @staticmethod
    def backward(ctx, dy):
        raise NotImplementedError  # your code here
"""


def test_syntax_error_stub_and_engine_copy_need_no_ranks():
    res = check_all_gather_matmul(broken("def backward(ctx, dy):", "def backward(ctx, dy)"))
    assert res["ok"] is False and res["message"].startswith("your code does not compile: expected ':'")
    assert check_all_gather_matmul(STUB)["message"] == (
        "AllGatherMatmul.forward and AllGatherMatmul.backward are not written yet (still `raise NotImplementedError`): "
        "fill in the `# your code here` lines in SOURCE")
    engine = "from minitron.parallel.collective_matmul import AllGatherMatmul\n"
    assert check_all_gather_matmul(engine)["message"].startswith(
        "your code uses the engine's own minitron.parallel.collective_matmul (line 1)")
    helper = broken("        out, held = [None] * t, x\n",
                    "        from minitron.parallel.collective_matmul import ring_gather\n        out, held = [None] * t, x\n")
    assert check_all_gather_matmul(helper)["message"].startswith(
        "your code uses the engine's own minitron.parallel.collective_matmul (line ")


@pytest.mark.multirank
def test_reference_passes_and_each_planted_mistake_is_named():
    cases = {
        "reference": REFERENCE,
        "chunk order": broken("out[(r - k) % t] = F.linear(held, weight, bias)", "out[k] = F.linear(held, weight, bias)"),
        "wrong shard first": broken(FORWARD_LOOP, """        for k in range(t - 1):  # the neighbours' shards first, the own one last
            held = comm.shift(held, "tp").wait()
            out[(r - k - 1) % t] = F.linear(held, weight, bias)
        out[r] = F.linear(x, weight, bias)
"""),
        "last chunk never waited": broken("                held = coming.wait()\n",
                                          "                held = coming.wait() if k < t - 2 else coming.result\n"),
        "backward not decomposed": broken("        held, dw, total, arriving = x, None, None, None\n",
                                          """        x_full = comm.all_gather(x, "tp", dim=1)
        dx = comm.reduce_scatter(dy @ weight, "tp", dim=1)
        dw = dy.flatten(0, 1).t() @ x_full.flatten(0, 1)
        return dx, dw, dy.sum((0, 1)) if ctx.has_bias else None, None
"""),
        "forward not decomposed": broken(FORWARD_LOOP, "        return F.linear(comm.all_gather(x, 'tp', dim=1), weight, bias)\n"),
        "serial ring": broken(FORWARD_LOOP, """        shards = [x]
        for k in range(t - 1):  # every shard fetched, then every product: nothing overlaps
            held = comm.shift(held, "tp").wait()
            shards.append(held)
        for k, xs in enumerate(shards):
            out[(r - k) % t] = F.linear(xs, weight, bias)
"""),
        # right at the unit checks' shard of 3 tokens only: the engine's run (4 tokens a shard) sees it
        "right only at the checked shape": broken("        return torch.cat(out, 1)\n",
                                                  "        return torch.cat(out, 1) * (1 if x.shape[1] == 3 else 1.001)\n"),
        "engine by importlib": "import importlib\nAllGatherMatmul = importlib.import_module('minitron.parallel.' + "
                               "'collective_matmul').AllGatherMatmul\n",
    }
    res = dict(zip(cases, check_all_gather_matmul_all(list(cases.values()), timeout=30)))
    ok = res["reference"]
    assert ok["ok"], ok["message"]
    assert ok["max_loss_abs_diff"] <= 1e-9 and ok["max_param_rel_diff"] <= 1e-9
    assert ok["message"] == ("your AllGatherMatmul trains exactly like the single-device model (--tp 4 --sp "
                             "--tp-overlap and --tp 2 --dp 2 --sp --tp-overlap)")
    assert_each_named(res, {
        "chunk order": "chunk order wrong: on tp rank 0 rows 3..5 of your output hold the product of rank 3's shard",
        "wrong shard first": "the wrong shard multiplied first: tp rank 0 first multiplies rank 3's shard",
        "last chunk never waited": "the last chunk is never waited for",
        "backward not decomposed": "the backward is not decomposed: it communicates all_gather of [2, 3, 5] on 'tp'",
        "forward not decomposed": "your forward communicates all_gather of [2, 3, 5] on 'tp': the decomposed",
        "serial ring": "your forward's chunks do not overlap: shift 0 is waited for before any partial product",
        "right only at the checked shape": "--tp 4 --sp --tp-overlap: your AllGatherMatmul passes the checks above "
                                           "but training differs from the single-device model",
        "engine by importlib": "your code runs the engine's own minitron.parallel.collective_matmul.AllGatherMatmul",
    })
