"""The lab checkers fail the way a learner needs: one clear line, never a traceback or a hang.

Each test runs the real checker on deliberately broken code. Syntax errors and wrong
schedules are found before any rank starts; the rest runs on 2 gloo ranks, several
broken versions per launch (``check_*_all``: the ranks go on to the next case when every
rank failed cleanly, and start afresh when a case left them out of step). The passing
side is the solution notebooks (``tests/test_notebooks.py``).
"""
import pytest

from minitron.labs import check_f_and_g, check_one_f_one_b, check_zero1
from minitron.labs.f_and_g import check_f_and_g_all
from minitron.labs.pipeline import build_schedule
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
    comm.reduce_scatter_flat(grad, shard, "dp")
    return shard / d


def update_params(comm, grad_shard, param, state, lr):
    d, r = comm.size("dp"), comm.index("dp")
    k = param.numel() // d
    mine = param[r * k:(r + 1) * k].clone()
    adam(mine, grad_shard, state, lr)
    comm.all_gather_flat(mine, param, "dp")
'''
RS_BODY = '''    shard = torch.empty(grad.numel() // d, dtype=grad.dtype)
    comm.reduce_scatter_flat(grad, shard, "dp")
    return shard / d'''
GATHER = 'comm.all_gather_flat(mine, param, "dp")'


# --- before any rank starts -------------------------------------------------------------------
def test_syntax_errors_name_the_line():
    broken = F_AND_G.replace("def forward(ctx, x, comm):", "def forward(ctx, x, comm)", 1)
    msg = check_f_and_g(broken)["message"]
    assert check_f_and_g(broken)["ok"] is False
    assert msg.startswith("your code does not compile") and "line 4" in msg and "def forward" in msg
    assert "does not compile" in check_one_f_one_b("def one_f_one_b(p, m, rank) return []")["message"]
    assert "does not compile" in check_zero1(ZERO1.replace("return shard / d", "return shard /"))["message"]


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
    raising = 'def one_f_one_b(p, m, rank):\n    raise NotImplementedError  # your code here\n'
    assert check_one_f_one_b(raising)["message"] == (
        "NotImplementedError in one_f_one_b, line 2 of your code: `raise NotImplementedError  # your code here`")
    strings = 'def one_f_one_b(p, m, rank):\n    return ["F0"]\n'
    assert "returned a list holding 'F0' (str)" in check_one_f_one_b(strings)["message"]
    looping = 'def one_f_one_b(p, m, rank):\n    while True:\n        pass\n'
    assert check_one_f_one_b(looping, timeout=1)["message"].startswith(
        "your code did not finish within 1 s (an endless loop?): it was at one_f_one_b, line ")


def test_build_schedule_is_the_engines_1f1b():
    for p, m in ((1, 3), (2, 4), (4, 3), (4, 8)):
        assert build_schedule(ONE_F_ONE_B, p, m).actions == make_schedule("1f1b", p, 1, m).actions


# --- on 2 ranks ---------------------------------------------------------------------------------
@pytest.mark.multirank
def test_f_and_g_failures_in_one_launch():
    swapped = F_AND_G.replace("class F(", "class T(").replace("class G(", "class F(").replace("class T(", "class G(")
    raising = F_AND_G.replace(F_BODY, "raise NotImplementedError  # your code here")
    shape = F_AND_G.replace(F_BODY, "return x.sum()")
    looping = F_AND_G.replace(F_BODY, "while True:\n            pass")
    wrong, raised, shaped, looped = check_f_and_g_all([swapped, raising, shape, looping], timeout=10)
    assert not wrong["ok"] and wrong["message"].startswith(
        "your F's forward returned 3.0 on tp rank 0 for an input of 1.0 (expected 1.0)")
    assert wrong["max_loss_abs_diff"] > 1e-3  # and it did train: the losses differ
    assert raised == {"ok": False, "message": "NotImplementedError in F.forward, line 5 of your code: "
                                              "`raise NotImplementedError  # your code here`"}
    assert shaped == {"ok": False, "message": "your F.forward returned a tensor of shape [] for an input of "
                                              "shape [3]: F must return a tensor of its input's shape"}
    assert not looped["ok"] and looped["message"].startswith(
        "your code did not finish within 10 s (an endless loop?): it was at F.forward, line ")


@pytest.mark.multirank
def test_zero1_failures_in_one_launch():
    """Sum instead of mean, an all-reduce instead of a reduce-scatter (right numbers, wrong
    traffic), an all-gather on rank 0 only (a collective its peer never posts: a timeout,
    and the next case starts on fresh ranks), an exception."""
    summed = ZERO1.replace("return shard / d", "return shard")
    all_reduce = ZERO1.replace(RS_BODY, '''    comm.all_reduce(grad, "dp")
    k, r = grad.numel() // d, comm.index("dp")
    return grad[r * k:(r + 1) * k] / d''')
    one_sided = ZERO1.replace(GATHER, "if r == 0: " + GATHER)
    raising = ZERO1.replace('    d = comm.size("dp")\n    shard', '    raise NotImplementedError\n    shard')
    res = check_zero1_all([summed, all_reduce, one_sided, raising], timeout=12)
    assert res[0] == {"ok": False, "message": "reduce_scatter_grads on dp rank 0, bucket 0 (n=4096): it is the "
                                              "sum over the ranks, not the mean: divide by d (before or after "
                                              "the reduce-scatter)"}
    assert res[1]["message"].startswith("your data-parallel calls in one step: all_reduce x4 in bwd (94080 B), "
                                        "all_gather x4 in optim (47040 B); ZeRO-1's (analysis.data_parallel."
                                        "dp_calls): reduce_scatter x4 in bwd (94080 B), all_gather x4")
    assert res[2]["message"].startswith("a rank waited past the timeout for a collective or a message its "
                                        "peers never posted")
    assert "update_params, line 14 of your code: `if r == 0: comm.all_gather_flat" in res[2]["message"]
    assert res[3] == {"ok": False, "message": "NotImplementedError in reduce_scatter_grads, line 3 of your code: "
                                              "`raise NotImplementedError`"}
