"""Lab 03c's checker (``minitron.labs.zero3``): the reference ZeRO-3 unit trains like one
device inside the engine's ZeRO-3 on 4 ranks, under ``--dp 4`` and ``--dp 2 --tp 2``; each
planted mistake gets its own line (a mean right only at the notebook's d = 4, or taken over
the wrong group, among them); the engine's own gathers and reduce-scatters are refused.

The stub, a syntax error and a plain import of the engine's ZeRO are refused before any rank
starts; everything else shares one launch of 4 gloo ranks (``check_zero3_all``).
"""
import pytest

from minitron.labs.zero3 import check_zero3, check_zero3_all
from planted import broken_in

REFERENCE = '''
class Unit:
    """One ZeRO-3 unit on this rank."""

    def __init__(self, comm, axis, shard, full):
        self.comm, self.axis, self.shard, self.full = comm, axis, shard, full

    def gather(self):
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        self.comm.all_gather(self.shard, self.axis, out=self.full)

    def free(self):
        self.full.untyped_storage().resize_(0)

    def before_forward(self):
        self.gather()

    def after_forward(self):
        self.free()

    def before_backward(self):
        self.gather()

    def after_backward(self, grad):
        d = self.comm.size(self.axis)
        shard = self.comm.reduce_scatter(grad / d, self.axis)
        self.free()
        return shard
'''

# the engine's own gather, reached without naming its module in a way the source screen reads
FIND_ENGINE = '''
import gc, functools, importlib, sys

def _engine(full):
    zero = {route}
    dp = next(o for o in gc.get_objects() if isinstance(o, zero.ShardedDataParallel) and any(f is full for f in o.full))
    return dp, next(i for i, f in enumerate(dp.full) if f is full)
'''


broken = broken_in(REFERENCE)


def engine_route(route: str, body: str) -> str:
    return FIND_ENGINE.format(route=route) + broken("    def before_forward(self):\n        self.gather()",
                                                    "    def before_forward(self):\n" + body)


def test_stub_syntax_error_and_plain_import_need_no_ranks():
    stub = broken('''    def gather(self):
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        self.comm.all_gather(self.shard, self.axis, out=self.full)''', '''    def gather(self):
        raise NotImplementedError  # your code here''')
    assert check_zero3(stub)["message"].startswith("Unit.gather is not written yet")
    assert check_zero3(broken("def free(self):", "def free(self)"))["message"].startswith("your code does not compile")
    engine = "from minitron.parallel.zero import ShardedDataParallel\n" + REFERENCE
    assert check_zero3(engine)["message"].startswith(
        "your code uses the engine's own minitron.parallel.zero (line 1)")


@pytest.mark.multirank
def test_reference_passes_and_each_mistake_gets_its_own_line():
    cases = {
        "reference": REFERENCE,
        "no gather before backward": broken("    def before_backward(self):\n        self.gather()",
                                            "    def before_backward(self):\n        pass"),
        "no free after forward": broken("    def after_forward(self):\n        self.free()",
                                        "    def after_forward(self):\n        pass"),
        "no free after backward": broken("        self.free()\n        return shard", "        return shard"),
        "all-reduce": broken("        shard = self.comm.reduce_scatter(grad / d, self.axis)",
                             "        r, k = self.comm.index(self.axis), grad.numel() // d\n"
                             "        shard = self.comm.all_reduce(grad / d, self.axis)[r * k:(r + 1) * k].clone()"),
        "no 1/d": broken("reduce_scatter(grad / d, self.axis)", "reduce_scatter(grad, self.axis)"),
        "1/d twice": broken("reduce_scatter(grad / d, self.axis)", "reduce_scatter(grad / d, self.axis) / d"),
        "shards rotated": broken("        self.comm.all_gather(self.shard, self.axis, out=self.full)",
                                 "        k, d = self.shard.numel(), self.comm.size(self.axis)\n"
                                 "        parts = self.comm.all_gather(self.shard, self.axis).split(k)\n"
                                 "        self.full.copy_(torch.cat(parts[1:] + parts[:1]))"),
        "d hard-wired to the notebook's 4": broken("d = self.comm.size(self.axis)", "d = 4"),
        "d of the world": broken("d = self.comm.size(self.axis)", "d = torch.distributed.get_world_size()"),
        "reduce-scatter over the world": broken("reduce_scatter(grad / d, self.axis)", "reduce_scatter(grad / d, 'world')"),
        "another rank's gradient slice": broken("reduce_scatter(grad / d, self.axis)",  # offsets shifted by k
                                                "reduce_scatter((grad / d).roll(-(grad.numel() // d)), self.axis)"),
        "engine by importlib": engine_route('importlib.import_module("minitron.parallel." + "zero")',
                                            "        dp, u = _engine(self.full)\n        dp._gather(u, wait=True)"),
        "engine by sys.modules, no frame of yours": engine_route(
            'sys.modules["minitron.parallel." + "ze" + "ro"]',
            "        dp, u = _engine(self.full)\n        self.before_forward = functools.partial(dp._gather, u, True)\n"
            "        self.before_forward()"),
    }
    res = dict(zip(cases, check_zero3_all(list(cases.values()), timeout=60)))
    msg = {k: v["message"] for k, v in res.items()}
    assert res["reference"]["ok"], msg["reference"]
    assert res["reference"]["max_loss_abs_diff"] <= 1e-9 and res["reference"]["max_param_rel_diff"] <= 1e-9
    assert [u["n"] % 4 for u in res["reference"]["units"]] == [0, 0, 0]  # padded units ...
    assert all(u["k"] % 4 for u in res["reference"]["units"][1:])  # ... whose shards are not multiples of d
    assert not any(v["ok"] for k, v in res.items() if k != "reference"), msg
    assert msg["no gather before backward"].startswith("--dp 4: Unit.before_backward left unit"), msg
    assert "gather it again before the backward" in msg["no gather before backward"]
    assert msg["no free after forward"].startswith("--dp 4: Unit.after_forward kept unit"), msg
    assert msg["no free after backward"].startswith("--dp 4: Unit.after_backward left unit"), msg
    assert msg["all-reduce"].startswith("--dp 4: Unit.after_backward all-reduces the gradient"), msg
    assert "it is the sum over the ranks, not the mean" in msg["no 1/d"], msg
    assert "it is the mean divided by d a second time" in msg["1/d twice"], msg
    assert res["reference"]["message"].startswith("your ZeRO-3 unit trains exactly like the single-device model on 4 ")
    assert [v["max_param_rel_diff"] <= 1e-9 for v in res["reference"]["layouts"]] == [True, True]
    for k in ("d hard-wired to the notebook's 4", "d of the world"):  # right at d = 4, wrong at d = 2
        assert msg[k].startswith("--dp 2 --tp 2: Unit.after_backward on rank"), msg[k]
        assert "it is the sum divided by 4, not by d = 2" in msg[k], msg[k]
    assert msg["reduce-scatter over the world"].startswith(  # refused by its traffic where its values are right
        "--dp 4: Unit.after_backward reduce-scatters over 'world' (4 ranks): the wrong group"), msg
    assert "rank 0's shard is at elements [3924, 5232) of `full`" in msg["shards rotated"], msg  # k = 1308
    print("\n".join(f"{k}: {v}" for k, v in msg.items()))
    assert "slice of the mean: rank r owns elements" in msg["another rank's gradient slice"], msg
    for k in ("engine by importlib", "engine by sys.modules, no frame of yours"):
        assert msg[k].startswith("your code runs the engine's own ZeRO-3, ShardedDataParallel._gather"), msg[k]
    same = ("engine by sys.modules, no frame of yours", "d of the world")  # the same finding as another case
    mistakes = [v for k, v in msg.items() if k not in same]
    assert len(set(mistakes)) == len(mistakes), "two mistakes share a message"
