"""Lab 05's checker (minitron.labs.linear3d) on 8 gloo ranks (q = 2), one launch: the
reference passes (units and a GPT on the cube vs one device), and each plausible mistake
in the 3-D linear fails with its own line."""
import pytest

from minitron.labs.linear3d import check_linear3d_all

LINEAR3D = '''
class Linear3DFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, comm, a, c):
        xg = comm.all_gather(x, a, 0)
        wg = comm.all_gather(weight, I, 1)
        ctx.save_for_backward(xg, wg)
        ctx.comm, ctx.a, ctx.c = comm, a, c
        return comm.reduce_scatter(F.linear(xg, wg), c, 0)

    @staticmethod
    def backward(ctx, dy):
        xg, wg = ctx.saved_tensors
        comm, a, c = ctx.comm, ctx.a, ctx.c
        dyg = comm.all_gather(dy.contiguous(), c, 0)
        dx = comm.reduce_scatter(dyg @ wg, a, 0)
        dw = comm.reduce_scatter(dyg.flatten(0, -2).t() @ xg.flatten(0, -2), I, 1)
        return dx, dw, None, None, None
'''
DW = "dw = comm.reduce_scatter(dyg.flatten(0, -2).t() @ xg.flatten(0, -2), I, 1)"
MISTAKES = {  # name: (source, words the one-line message must contain)
    "input gathered along i, not a": (LINEAR3D.replace("comm.all_gather(x, a, 0)", "comm.all_gather(x, I, 0)"),
                                      "goes along cube_i instead of cube_j"),
    "weight gradient not summed": (LINEAR3D.replace(DW, "dw = (dyg.flatten(0, -2).t() @ xg.flatten(0, -2))"
                                                    ".chunk(comm.size(I), 1)[comm.index(I)]"),
                                   "weight-grad reduce-scatter (reduce_scatter along cube_i"),
    "a sum where the all-gather is needed": (LINEAR3D.replace(
        "wg = comm.all_gather(weight, I, 1)", "wg = comm.all_reduce(torch.cat([weight] * comm.size(I), 1), I)"),
        "is an all-reduce in your code"),
    "transposed weight block": (LINEAR3D.replace("F.linear(xg, wg)", "xg @ wg").replace("dyg @ wg", "dyg @ wg.t()")
                                .replace(DW, DW.replace("xg.flatten(0, -2), I", "xg.flatten(0, -2)).t(), I")
                                         .replace("reduce_scatter(", "reduce_scatter((")),
                                "not x @ w"),
    # a face of the cube for another: the weight gathered over c, the output's partial sums scattered over a
    "weight gathered along c, not i": (LINEAR3D.replace("comm.all_gather(weight, I, 1)",
                                                        "comm.all_gather(weight, c, 1)"),
                                       "the weight all-gather goes along cube_k instead of cube_i"),
    "output scattered along a, not c": (LINEAR3D.replace("comm.reduce_scatter(F.linear(xg, wg), c, 0)",
                                                         "comm.reduce_scatter(F.linear(xg, wg), a, 0)"),
                                        "the output reduce-scatter goes along cube_j instead of cube_k"),
    "weight gathered on dim 0": (LINEAR3D.replace("comm.all_gather(weight, I, 1)", "comm.all_gather(weight, I, 0)"),
                                 "gathered on the wrong dim? x [b/q², s, d_in/q] is gathered along a on dim 0"),
    # the weight gradient scattered over its rows: right calls and bytes, the block transposed
    "weight gradient scattered on dim 0": (LINEAR3D.replace(DW, DW.replace(", I, 1)", ", I, 0)")),
                                           "your backward returns a weight gradient of shape [2, 4], the weight "
                                           "block's is [4, 2] [d_out/q, d_in/q²]: reduce-scatter the gathered weight "
                                           "gradient along i on dim 1"),
    # the engine's own differentiable collectives, reached past the screen
    **{f"engine by {how}": ("import importlib, sys\nclass Linear3DFunction:\n    @staticmethod\n"
                            "    def apply(x, weight, comm, a, c):\n"
                            f"        T = {module}\n"
                            "        return T.reduce_scatter(F.linear(T.gather(x, comm, a, 0), T.gather(weight, comm, "
                            "I, 1, param=True)), comm, c, 0)\n",
                            "your code runs the engine's own minitron.parallel.tensor._AllGather (from line 6 of "
                            "your code")
       for how, module in (("importlib", "importlib.import_module('minitron.parallel.' + 'tensor')"),
                           ("sys.modules", "sys.modules['minitron.parallel' + '.tensor']"),
                           ("__import__", "__import__('minitron.parallel.' + 'tensor', fromlist=['x'])"))},
}


@pytest.mark.multirank
def test_reference_passes_and_each_mistake_gets_its_own_line():
    names = list(MISTAKES)
    verdicts = check_linear3d_all([LINEAR3D] + [MISTAKES[n][0] for n in names])
    assert verdicts[0]["ok"], verdicts[0]["message"]
    assert verdicts[0]["calls"] == {"forward": 3, "backward": 3}
    for name, res in zip(names, verdicts[1:]):
        words = MISTAKES[name][1]
        assert not res["ok"], name
        assert "\n" not in res["message"] and words in res["message"], (name, res["message"])
        assert not any(w in res["message"] for n, (_, w) in MISTAKES.items() if n != name and w != words), \
            (name, res["message"])
