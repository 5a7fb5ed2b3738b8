"""The lab checkers fail the way a learner needs: one clear line, never a traceback or a hang.

Each test runs the real checker on deliberately broken code. Syntax errors, stubs left
unwritten, the engine's own piece handed back and wrong schedules are found before any
rank starts; the rest runs on real gloo ranks (4 for f and g and for ZeRO-1, so that code
hard-wired to 2 ranks fails), several broken versions per launch (``check_*_all``: the
ranks go on to the next case when every rank failed cleanly, and start afresh when a case
left them out of step). The passing side: the reference in each launch here, and the
solution notebooks (``tests/test_notebooks.py``).
"""
import pytest

from minitron.labs import check_f_and_g, check_one_f_one_b, check_zero1
from minitron.labs.f_and_g import check_f_and_g_all
from minitron.labs.pipeline import build_schedule
from minitron.labs.runner import LabError, refuse_engine_copy, screen
from minitron.labs.zero import check_zero1_all
from minitron.parallel.schedules import make_schedule

F_AND_G = '''
class F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, dy):
        return ctx.comm.all_reduce(dy.contiguous(), "tp"), None


class G(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        return comm.all_reduce(x.contiguous(), "tp")

    @staticmethod
    def backward(ctx, dy):
        return dy, None
'''
F_BODY = "ctx.comm = comm\n        return x"

ONE_F_ONE_B = '''
def one_f_one_b(p, m, rank):
    warmup = min(p - rank - 1, m)
    actions = [Action("F", k) for k in range(warmup)]
    for k in range(m - warmup):
        actions += [Action("F", warmup + k), Action("B", k)]
    return actions + [Action("B", k) for k in range(m - warmup, m)]
'''

ZERO1 = '''
def reduce_scatter_grads(comm, grad):
    d = comm.size("dp")
    shard = torch.empty(grad.numel() // d, dtype=grad.dtype)
    comm.reduce_scatter(grad, "dp", out=shard)
    return shard / d


def update_params(comm, grad_shard, param, state, lr):
    d, r = comm.size("dp"), comm.index("dp")
    k = param.numel() // d
    mine = param[r * k:(r + 1) * k].clone()
    adam(mine, grad_shard, state, lr)
    comm.all_gather(mine, "dp", out=param)
'''
RS_BODY = '''    shard = torch.empty(grad.numel() // d, dtype=grad.dtype)
    comm.reduce_scatter(grad, "dp", out=shard)
    return shard / d'''
GATHER = 'comm.all_gather(mine, "dp", out=param)'
# a reduce_scatter_grads that finds the engine's buckets and runs their reduce-scatter
ENGINE_ZERO1 = '''import gc, importlib, sys
def reduce_scatter_grads(comm, grad):
    D = {data}
    dp, b = next((o, b) for o in gc.get_objects() if isinstance(o, D.BucketedDataParallel) for b in o.buckets
                 if o.grad_buffer[b.start:b.end].data_ptr() == grad.data_ptr())
    D.BucketedDataParallel.start_bucket(dp, b)
    dp._handles.pop().wait()
    return dp.shard_grad[b.start // dp.d:b.end // dp.d].clone()
'''


# --- before any rank starts -------------------------------------------------------------------
def test_syntax_errors_name_the_line():
    broken = F_AND_G.replace("def forward(ctx, x, comm):", "def forward(ctx, x, comm)", 1)
    msg = check_f_and_g(broken)["message"]
    assert check_f_and_g(broken)["ok"] is False
    assert msg.startswith("your code does not compile") and "line 4" in msg and "def forward" in msg
    assert "does not compile" in check_one_f_one_b("def one_f_one_b(p, m, rank) return []")["message"]
    assert "does not compile" in check_zero1(ZERO1.replace("return shard / d", "return shard /"))["message"]


def test_stubs_and_the_engines_own_piece_need_no_ranks():
    """A notebook's untouched stub, and a source that hands the engine its own piece back,
    each get one line at once (these return before any rank could start)."""
    stub = F_AND_G.replace(F_BODY, "raise NotImplementedError  # your code here")
    assert check_f_and_g(stub)["message"] == ("F.forward is not written yet (still `raise NotImplementedError`): "
                                              "fill in the `# your code here` lines in SOURCE")
    engine_fg = "from minitron.parallel.tensor import _F as F, _G as G\n"
    assert check_f_and_g(engine_fg)["message"] == (
        "your code uses the engine's own minitron.parallel.tensor._F (line 1): the lab asks you to write it "
        "yourself, with what SOURCE is given")
    stub = 'def one_f_one_b(p, m, rank):\n    """doc"""\n    raise NotImplementedError  # your code here\n'
    assert check_one_f_one_b(stub)["message"].startswith("one_f_one_b is not written yet")
    engine_1f1b = ("from minitron.parallel import schedules as s\n"
                   "def one_f_one_b(p, m, rank):\n"
                   "    return [a for a in s.make_schedule('1f1b', p, 1, m).actions[rank] if a.op in 'FB']\n")
    assert "engine's own minitron.parallel.schedules.make_schedule (line 3)" in check_one_f_one_b(engine_1f1b)["message"]
    engine_zero = "from minitron.parallel.zero import ShardedDataParallel\n" + ZERO1
    assert "engine's own minitron.parallel.zero (line 1)" in check_zero1(engine_zero)["message"]
    rs_stub = ZERO1.replace('    d = comm.size("dp")\n' + RS_BODY, "    raise NotImplementedError  # your code here")
    assert check_zero1(rs_stub)["message"].startswith("reduce_scatter_grads is not written yet")


def test_refuse_engine_copy_follows_aliases():
    forbidden = ("minitron.parallel.tensor._F", "minitron.parallel.zero", "minitron.parallel.context_parallel.combine")
    for source in ("import minitron.parallel.tensor as T\nF = T._F\n", "import minitron\nF = minitron.parallel.tensor._F\n",
                   "from minitron.parallel.tensor import *\n", "import importlib\nz = importlib.import_module('minitron.parallel.zero')\n",
                   "from minitron.parallel import context_parallel\ncombine = context_parallel.combine\n"):
        with pytest.raises(LabError, match="^your code uses the engine's own minitron.parallel"):
            refuse_engine_copy(source, forbidden)
    refuse_engine_copy("from minitron.parallel.context_parallel import block_attention\n", forbidden)  # allowed
    with pytest.raises(LabError, match="^F.forward and G.backward are not written yet"):
        screen("class F:\n    def forward(ctx, x):\n        raise NotImplementedError\n"
               "class G:\n    def backward(ctx, x):\n        raise NotImplementedError()\n", ("F", "G"))


def test_missing_function_and_not_a_string():
    assert check_one_f_one_b("def other(p, m, rank):\n    return []\n")["message"] == \
        "your code defines no one_f_one_b: it must define one_f_one_b"
    assert "as a string" in check_one_f_one_b(lambda p, m, r: [])["message"]


def test_wrong_schedules_get_one_clear_line():
    """A deadlock, GPipe's memory, a missing warm-up, a misordered cool-down, an exception,
    a wrong return type: each named, with the shape where it shows."""
    deadlock = '''
def one_f_one_b(p, m, rank):
    if rank == p - 1 > 0:
        return [Action("F", k) for k in range(m)] + [Action("B", k) for k in range(m)]
    return [a for k in range(m) for a in (Action("F", k), Action("B", k))]
'''
    res = check_one_f_one_b(deadlock)
    assert res == {"ok": False, "message": res["message"]}
    assert res["message"].startswith("p=4, m=8: your schedule cannot run: deadlock with blocking sends: rank 0 at")
    gpipe = 'def one_f_one_b(p, m, rank):\n    return [Action(o, k) for o in "FB" for k in range(m)]\n'
    assert "rank 0 stashes up to 8 microbatches" in check_one_f_one_b(gpipe)["message"]
    assert "GPipe's memory" in check_one_f_one_b(gpipe)["message"]
    no_warmup = ONE_F_ONE_B.replace("warmup = min(p - rank - 1, m)", "warmup = 0")
    assert "your bubble fraction is 3.0000, 1F1B's is (p-1)/m = 0.3750" in check_one_f_one_b(no_warmup)["message"]
    too_many = ONE_F_ONE_B.replace("warmup = min(p - rank - 1, m)", "warmup = min(p - rank, m)")
    assert "rank 0 stashes up to 5" in check_one_f_one_b(too_many)["message"]
    reversed_cooldown = ONE_F_ONE_B.replace("for k in range(m - warmup, m)]", "for k in reversed(range(m - warmup, m))]")
    msg = check_one_f_one_b(reversed_cooldown)["message"]
    assert "cannot run" in msg and "meets recv_bwd" in msg
    raising = 'def one_f_one_b(p, m, rank):\n    return [Action("F", k) for k in range(m)][m]\n'
    assert check_one_f_one_b(raising)["message"] == (
        "IndexError: list index out of range in one_f_one_b, line 2 of your code: "
        "`return [Action(\"F\", k) for k in range(m)][m]`")
    strings = 'def one_f_one_b(p, m, rank):\n    return ["F0"]\n'
    assert "returned a list holding 'F0' (str)" in check_one_f_one_b(strings)["message"]
    looping = 'def one_f_one_b(p, m, rank):\n    while True:\n        pass\n'
    assert check_one_f_one_b(looping, timeout=1)["message"].startswith(
        "your code did not finish within 1 s (an endless loop?): it was at one_f_one_b, line ")


def test_1f1b_larger_shapes_and_the_engines_generators():
    """What the old checker (p <= 6, m <= 10, and a screen of names) let through: a warm-up
    capped at what small pipelines need, a steady phase capped at 10 microbatches, and the
    engine's own 1F1B reached through importlib, sys.modules or a built __import__."""
    capped = ONE_F_ONE_B.replace("warmup = min(p - rank - 1, m)", "warmup = min(p - rank - 1, m, 5)")
    assert check_one_f_one_b(capped)["message"] == (
        "p=8, m=16: your bubble fraction is 1.6875, 1F1B's is (p-1)/m = 0.4375: a rank idles waiting for work it "
        "could have had: begin with p-r-1 warm-up forwards, then alternate one forward and one backward")
    short = ONE_F_ONE_B.replace("for k in range(m - warmup):", "for k in range(min(m - warmup, 10)):")
    assert check_one_f_one_b(short)["message"].startswith("p=8, m=16: your schedule cannot run: ")
    body = "    return [a for a in S.make_schedule('1f1b', p, 1, m).actions[rank] if a.op in 'FB']\n"
    for how, module in (("importlib", "importlib.import_module('minitron.parallel' + '.schedules')"),
                        ("sys.modules", "sys.modules['minitron.parallel.' + 'schedules']"),
                        ("__import__", "__import__('minitron.parallel.' + 'schedules', fromlist=['x'])")):
        source = f"import importlib, sys\ndef one_f_one_b(p, m, rank):\n    S = {module}\n" + body
        assert check_one_f_one_b(source)["message"].startswith(
            "your code runs the engine's own minitron.parallel.schedules.make_schedule (from line 4 of your "
            "code: `return [a for a in S.make_schedule("), how


def test_build_schedule_is_the_engines_1f1b():
    for p, m in ((1, 3), (2, 4), (4, 3), (4, 8)):
        assert build_schedule(ONE_F_ONE_B, p, m).actions == make_schedule("1f1b", p, 1, m).actions


# the engine's own f and g reached past the screen (which reads the source): each is seen
# when its code runs
ENGINE_F_AND_G = {
    "engine by importlib": "import importlib\nT = importlib.import_module('minitron' + '.parallel.tensor')\n"
                           "F, G = T._F, T._G\n",
    "engine by sys.modules": "import sys\nF = sys.modules['minitron.parallel' + '.tensor']._F\n"
                             "G = getattr(sys.modules['.'.join(['minitron', 'parallel', 'tensor'])], '_' + 'G')\n",
    "engine by __import__": F_AND_G.replace("class F(torch.autograd.Function):", "T = __import__('minitron'.strip() + "
                                            "'.parallel.tensor', fromlist=['x'])\nclass F(torch.autograd.Function):")
                                   .replace(F_BODY, "return T._F.apply(x, comm)"),
    "engine as a subclass": "[E] = [c for c in torch.autograd.Function.__subclasses__() if c.__name__ == '_G']\n"
                            + F_AND_G.split("class G(")[0] + "class G(E):\n    pass\n",
}


# --- on real ranks ------------------------------------------------------------------------------
G_FWD = 'return comm.all_reduce(x.contiguous(), "tp")'
F_BWD = 'return ctx.comm.all_reduce(dy.contiguous(), "tp"), None'


@pytest.mark.multirank
def test_f_and_g_on_4_ranks_in_one_launch():
    """The reference trains like one device on 4 ranks; F and G swapped, an all-reduce in an
    identity direction (divided by t: the value is right, the trace is not), a gradient
    hard-wired to 2 ranks, an exception, a wrong shape and an endless loop each get their line."""
    cases = {
        "reference": F_AND_G,
        "swapped": F_AND_G.replace("class F(", "class T(").replace("class G(", "class F(").replace("class T(", "class G("),
        "f forward reduces": F_AND_G.replace(F_BODY, 'return comm.all_reduce(x.clone(), "tp") / comm.size("tp")'),
        "g backward reduces": F_AND_G.replace(G_FWD, "ctx.comm = comm\n        " + G_FWD).replace(
            "return dy, None", 'return ctx.comm.all_reduce(dy.contiguous(), "tp") / ctx.comm.size("tp"), None'),
        "two ranks hard-wired": F_AND_G.replace(F_BWD, "return dy * 2, None"),
        "no comm": F_AND_G.replace(F_BWD, "return dy * 4, None"),
        "raises": F_AND_G.replace(F_BODY, "return x.view(5)"),
        "shape": F_AND_G.replace(F_BODY, "return x.sum()"),
        "looping": F_AND_G.replace(F_BODY, "while True:\n            pass"),
        "ignores dy": F_AND_G.replace(F_BWD, 'return ctx.comm.all_reduce(torch.ones_like(dy), "tp"), None'),
        "first element only": F_AND_G.replace(G_FWD, 'y = x.clone()\n        y[:1] = comm.all_reduce(x[:1].clone(), '
                                              '"tp")\n        return y'),
        "mean": F_AND_G.replace(G_FWD, 'return comm.all_reduce(x.clone(), "tp") / comm.size("tp")'),
        # right at the notebook's 4 ranks only: found on --tp 2 --dp 2
        "four hard-wired": F_AND_G.replace(G_FWD, 'return comm.all_reduce(x.clone(), "tp") * 4 / comm.size("tp")'),
        **ENGINE_F_AND_G,
    }
    res = dict(zip(cases, check_f_and_g_all(list(cases.values()), timeout=20)))
    assert res["reference"]["ok"], res["reference"]
    assert res["reference"]["message"] == ("your F and G train exactly like the single-device model (--tp 4 and "
                                           "--tp 2 --dp 2)")
    assert res["reference"]["max_loss_abs_diff"] <= 1e-9 and res["reference"]["max_param_rel_diff"] <= 1e-9
    msg = {name: r["message"] for name, r in res.items() if not r["ok"]}
    assert len(msg) == len(cases) - 1
    identity_f = ("your F's forward communicates all_reduce of [3] on 'tp': it is the identity, every rank already "
                  "holds X (F is identity forward, all-reduce backward)")
    assert msg["swapped"] == identity_f
    assert msg["f forward reduces"] == identity_f
    assert msg["g backward reduces"] == ("your G's backward communicates all_reduce of [3] on 'tp': it is the "
                                         "identity, every rank already holds the whole gradient (G is all-reduce "
                                         "forward, identity backward)")
    assert msg["two ranks hard-wired"] == msg["no comm"] == ("your F's backward communicates nothing: it is one all-reduce on 'tp' (F is identity "
                              "forward, all-reduce backward)")
    # what the old checker (a constant input, a gradient of ones, element 0 read) let through
    assert msg["ignores dy"] == ("your F's backward ignores the incoming gradient: on tp rank 0 of 4 it returned what "
                                 "a gradient of ones gives ([4.0, 4.0, 4.0]), not what dy = [6.0, 10.0, 14.0] gives "
                                 "(F is identity forward, all-reduce backward)")
    assert msg["first element only"] == ("your G's forward returned [10.0, 10.0, 100.0] on tp rank 0 of 4 (expected "
                                         "[10.0, 100.0, 1000.0]; elements 1, 2 wrong): G is all-reduce forward, "
                                         "identity backward")
    assert msg["mean"] == ("your G's forward returned the mean over the 4 ranks, not the sum ([2.5, 25.0, 250.0] on "
                           "tp rank 0, expected [10.0, 100.0, 1000.0]): G is all-reduce forward, identity backward")
    assert msg["four hard-wired"] == ("--tp 2 --dp 2: your G's forward returned [6.0, 60.0, 600.0] on tp rank 0 of 2 "
                                      "(expected [3.0, 30.0, 300.0]; elements 0, 1, 2 wrong): G is all-reduce forward, "
                                      "identity backward")
    assert msg["raises"] == ("RuntimeError: shape '[5]' is invalid for input of size 3 in F.forward, line 5 of "
                             "your code: `return x.view(5)`")
    assert msg["shape"] == ("your F.forward returned a tensor of shape [] for an input of shape [3]: F must return "
                            "a tensor of its input's shape")
    assert msg["looping"].startswith("your code did not finish within 20 s (an endless loop?): it was at F.forward, "
                                     "line ")
    for name in ENGINE_F_AND_G:
        assert msg[name].startswith("your code runs the engine's own minitron.parallel.tensor._"), (name, msg[name])
    assert "(from line 6 of your code: `return T._F.apply(x, comm)`)" in msg["engine by __import__"]
    assert all("\n" not in m and "Traceback" not in m for m in msg.values())


@pytest.mark.multirank
def test_zero1_on_4_ranks_in_one_launch():
    """The reference passes on 4 ranks; sum instead of mean, no reduction at all, another
    rank's slice (an off-by-one in the owner), an all-reduce instead of a reduce-scatter
    (right numbers, wrong traffic), an all-gather on rank 0 only (a collective its peers
    never post: a timeout, and the next case starts on fresh ranks), an exception."""
    cases = {
        "reference": ZERO1,
        "summed": ZERO1.replace("return shard / d", "return shard"),
        "not reduced": ZERO1.replace(RS_BODY, '''    k, r = grad.numel() // d, comm.index("dp")
    return grad[r * k:(r + 1) * k] / d'''),
        "next rank's slice": ZERO1.replace(RS_BODY, '''    comm.all_reduce(grad, "dp")
    k, r = grad.numel() // d, (comm.index("dp") + 1) % d
    return grad[r * k:(r + 1) * k] / d'''),
        "all-reduce": ZERO1.replace(RS_BODY, '''    comm.all_reduce(grad, "dp")
    k, r = grad.numel() // d, comm.index("dp")
    return grad[r * k:(r + 1) * k] / d'''),
        "one-sided": ZERO1.replace(GATHER, "if r == 0: " + GATHER),
        "raises": ZERO1.replace('    d = comm.size("dp")\n    shard', '    d = comm.size("dp")\n    d.shard\n    shard'),
        # what the old checker did not name
        "double 1/d": ZERO1.replace("    comm.reduce_scatter(grad,", "    grad.div_(d)\n    comm.reduce_scatter(grad,"),
        "twice the mean": ZERO1.replace("return shard / d", "return shard * 2 / d"),
        # right at the notebook's 4 ranks only: found on --dp 2 --tp 2
        "d hard-wired": ZERO1.replace("return shard / d", "return shard / 4"),
        "the launch's size": ZERO1.replace('    d = comm.size("dp")\n    shard', '    d = comm.size("world")\n    shard'),
        # the engine's own bucket reduce-scatter reached past the screen
        **{f"engine by {how}": ENGINE_ZERO1.format(data=data) + ZERO1.split("def update_params")[0].replace(
            "def reduce_scatter_grads", "def unused") + "def update_params" + ZERO1.split("def update_params")[1]
           for how, data in (("importlib", "importlib.import_module('minitron.parallel.' + 'data')"),
                             ("sys.modules", "sys.modules['minitron.parallel' + '.data']"),
                             ("__import__", "__import__('minitron.parallel.' + 'data', fromlist=['x'])"))},
    }
    res = dict(zip(cases, check_zero1_all(list(cases.values()), timeout=15)))
    assert res["reference"]["ok"], res["reference"]
    assert res["reference"]["message"] == ("your ZeRO-1 trains exactly like the single-device model on 4 data-parallel "
                                           "ranks and on 2 (x 2 tensor ranks), moving what dp_calls predicts and "
                                           "keeping 1/d of Adam's state")
    msg = {name: r["message"] for name, r in res.items() if not r["ok"]}
    assert len(msg) == len(cases) - 1, msg
    where = "reduce_scatter_grads on dp rank 0, bucket 0 (n="
    assert msg["summed"].startswith(where) and msg["summed"].endswith(
        "it is the sum over the ranks, not the mean: divide by d (before or after the reduce-scatter)")
    assert msg["not reduced"].startswith(where) and msg["not reduced"].endswith(
        "it holds only this rank's own gradient: reduce (sum) over the data-parallel ranks")
    assert msg["next rank's slice"].startswith(where) and msg["next rank's slice"].endswith(
        "it is rank 1's slice of the mean: rank r owns elements [r*n/d, (r+1)*n/d) of the bucket")
    assert msg["all-reduce"].startswith("your data-parallel calls in step 0: all_reduce x")
    assert "ZeRO-1's (analysis.data_parallel.dp_calls): reduce_scatter x" in msg["all-reduce"]
    assert msg["all-reduce"].endswith("an all-reduce of the gradients moves twice a reduce-scatter's bytes on the "
                                      "wire, and each rank needs only its shard")
    # a timeout on the waiting rank, or (on a loaded machine, when its peers gave up first) a lost peer
    assert msg["one-sided"].startswith(("a rank waited past the timeout for a collective or a message its "
                                        "peers never posted", "a rank lost its peers")), msg["one-sided"]
    assert "update_params, line 14 of your code: `if r == 0: comm.all_gather" in msg["one-sided"]
    assert msg["raises"] == ("AttributeError: 'int' object has no attribute 'shard' in reduce_scatter_grads, line 4 "
                             "of your code: `d.shard`")
    assert msg["double 1/d"].startswith(where) and msg["double 1/d"].endswith(
        "it is the mean divided by d = 4 once more (1/d²): divide the sum by d once, before or after the "
        "reduce-scatter, not both")
    assert msg["twice the mean"].startswith(where) and msg["twice the mean"].endswith(
        "it is the sum divided by 2, not by d = 4 (2× the mean): the mean divides by the size of the data-parallel "
        "group, comm.size('dp') (a d hard-wired to 2, or another group's size?)")
    assert msg["d hard-wired"].startswith("--tp 2 --dp 2: " + where) and msg["d hard-wired"].endswith(
        "it is the sum divided by 4, not by d = 2 (0.5× the mean): the mean divides by the size of the data-parallel "
        "group, comm.size('dp') (a d hard-wired to 4, or another group's size?)")
    assert msg["the launch's size"] == (
        "--tp 2 --dp 2: ValueError: reduce_scatter over 'dp' (2 ranks): out holds 660 elements, 1/2 of 2640 is "
        "1320: size it by comm.size('dp') in reduce_scatter_grads, line 5 of your code: "
        "`comm.reduce_scatter(grad, \"dp\", out=shard)`")
    for how in ("importlib", "sys.modules", "__import__"):
        assert msg[f"engine by {how}"].startswith("your code runs the engine's own minitron.parallel.data."
                                                  "BucketedDataParallel.start_bucket (from line 6 of your code"), \
            msg[f"engine by {how}"]
    assert all("\n" not in m and "Traceback" not in m for m in msg.values())
