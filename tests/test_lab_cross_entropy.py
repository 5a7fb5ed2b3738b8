"""Lab 04b's checker (``minitron.labs.cross_entropy``): the reference passes, the usual
mistakes each get their one line.

A syntax error, the stub and the engine's own class are refused before any rank starts;
everything else runs on 4 gloo ranks (vocabularies of 15 and 13 ids in slices of 4: the
last rank holds one and three padded ids; targets at every slice's edges),
all the sources in one launch (``check_vocab_parallel_ce_all``: the ranks agree on each
case's verdict through the rendezvous store, so they stay in step and go on to the next).
"""
import inspect

import pytest

from minitron.labs import check_vocab_parallel_ce
from minitron.labs.cross_entropy import check_vocab_parallel_ce_all
from minitron.parallel import tensor
from planted import broken_in

REFERENCE = '''
class VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, start, vocab, comm, axis="tp"):
        n_local = logits.shape[-1]
        valid = torch.arange(start, start + n_local) < vocab
        logits = logits.masked_fill(~valid, float("-inf"))
        lmax = logits.max(dim=-1).values
        comm.all_reduce(lmax, axis, op="max")
        shifted = logits - lmax.unsqueeze(-1)
        local_t = target - start
        mine = (local_t >= 0) & (local_t < n_local)
        local_t = local_t.clamp(0, n_local - 1)
        rows = torch.arange(target.shape[0])
        tlogit = torch.where(mine, shifted[rows, local_t], 0.0)
        comm.all_reduce(tlogit, axis)
        exp = shifted.exp()
        sumexp = exp.sum(dim=-1)
        comm.all_reduce(sumexp, axis)
        ctx.save_for_backward(exp / sumexp.unsqueeze(-1), local_t, mine)
        return sumexp.log() - tlogit

    @staticmethod
    def backward(ctx, dloss):
        softmax, local_t, mine = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0])
        grad[rows, local_t] -= mine.to(grad.dtype)
        return grad * dloss.unsqueeze(-1), None, None, None, None, None
'''


ENGINE_HEAD = "ENGINE = '_Vocab' + 'ParallelCrossEntropy'\n"


broken = broken_in(REFERENCE)


def test_syntax_error_stub_and_engine_copy_need_no_ranks():
    res = check_vocab_parallel_ce(broken("def backward(ctx, dloss):", "def backward(ctx, dloss)"))
    assert res == {"ok": False, "message": "your code does not compile: expected ':' at line 24: "
                                           "`def backward(ctx, dloss)`"}
    stub = ("class VocabParallelCrossEntropy(torch.autograd.Function):\n    @staticmethod\n"
            "    def forward(ctx, logits, target, start, vocab, comm, axis='tp'):\n"
            "        raise NotImplementedError  # your code here\n\n    @staticmethod\n"
            "    def backward(ctx, dloss):\n        raise NotImplementedError  # your code here\n")
    assert check_vocab_parallel_ce(stub)["message"] == (
        "VocabParallelCrossEntropy.forward and VocabParallelCrossEntropy.backward are not written yet (still "
        "`raise NotImplementedError`): fill in the `# your code here` lines in SOURCE")
    engine = ("from minitron.parallel.tensor import _VocabParallelCrossEntropy\n\n"
              "class VocabParallelCrossEntropy(_VocabParallelCrossEntropy):\n    pass\n")
    assert check_vocab_parallel_ce(engine)["message"] == (
        "your code uses the engine's own minitron.parallel.tensor._VocabParallelCrossEntropy (line 1): the lab "
        "asks you to write it yourself, with what SOURCE is given")


@pytest.mark.multirank
def test_reference_passes_and_mistakes_get_one_line():
    engine = inspect.getsource(tensor._VocabParallelCrossEntropy).replace(
        "class _VocabParallelCrossEntropy(", "class VocabParallelCrossEntropy(")
    cases = {
        "reference": REFERENCE,
        "engine": engine,  # the engine's own operator passes its lab
        "no mask": broken('        logits = logits.masked_fill(~valid, float("-inf"))\n', ""),
        "no max": broken("shifted = logits - lmax.unsqueeze(-1)", "shifted = logits"),
        "no one-hot": broken("        grad[rows, local_t] -= mine.to(grad.dtype)\n", ""),
        "no dloss": broken("return grad * dloss.unsqueeze(-1),", "return grad,"),
        "max not reduced": broken('        comm.all_reduce(lmax, axis, op="max")\n', ""),
        "sum not reduced": broken("        comm.all_reduce(sumexp, axis)\n", ""),
        "target not reduced": broken("        comm.all_reduce(tlogit, axis)\n", ""),
        "gathers": broken("        n_local = logits.shape[-1]\n",
                          "        n_local = logits.shape[-1]\n        comm.all_gather(logits, axis, dim=1)\n"),
        "raises": broken("        n_local = logits.shape[-1]\n",
                         "        raise NotImplementedError  # your code here\n"),
        "no class": REFERENCE.replace("class VocabParallelCrossEntropy(", "class CrossEntropy("),
        "one-hot everywhere": broken("-= mine.to(grad.dtype)", "-= 1"),
        "mask times -inf": broken("torch.where(mine, shifted[rows, local_t], 0.0)",
                                  "(shifted * torch.nn.functional.one_hot(local_t, n_local)).sum(-1) * mine"),
        "mean": broken("return sumexp.log() - tlogit", "return (sumexp.log() - tlogit).mean()"),
        "axis ignored": broken("comm.all_reduce(sumexp, axis)", 'comm.all_reduce(sumexp, "tp")'),
        "backward communicates": broken("        grad = softmax.clone()\n",
                                        "        grad = ctx.comm.all_reduce(softmax.clone(), 'tp')\n").replace(
            "        ctx.save_for_backward", "        ctx.comm = comm\n        ctx.save_for_backward"),
        # what the old checker (one padded id, targets away from the slices' edges) let through
        "one padded id masked": broken("valid = torch.arange(start, start + n_local) < vocab",
                                       "valid = torch.arange(start, start + n_local) != vocab"),
        "boundary off-by-one": broken("mine = (local_t >= 0) & (local_t < n_local)",
                                      "mine = (local_t >= 0) & (local_t <= n_local)"),
        # right in value on the notebook's 4 ranks (the launch is the tensor group), not in traffic
        "reduces over the world": broken('comm.all_reduce(lmax, axis, op="max")', 'comm.all_reduce(lmax, "world", op="max")')
        .replace("comm.all_reduce(tlogit, axis)", 'comm.all_reduce(tlogit, "world")')
        .replace("comm.all_reduce(sumexp, axis)", 'comm.all_reduce(sumexp, "world")'),
        # the engine's own class reached past the screen
        "engine by importlib": ENGINE_HEAD + "import importlib\nVocabParallelCrossEntropy = getattr("
                               "importlib.import_module('minitron.' + 'parallel.tensor'), ENGINE)\n",
        "engine by sys.modules": ENGINE_HEAD + "import sys\nVocabParallelCrossEntropy = vars(sys.modules["
                                 "'minitron.parallel' + '.tensor'])[ENGINE]\n",
        "engine by __import__": REFERENCE.replace("        n_local = logits.shape[-1]\n",
                                                  "        T = __import__('minitron.parallel' + '.tensor', "
                                                  "fromlist=['x'])\n        return getattr(T, ENGINE).apply("
                                                  "logits, target, start, vocab, comm, axis)\n") + ENGINE_HEAD,
    }
    res = dict(zip(cases, check_vocab_parallel_ce_all(list(cases.values()), timeout=30)))
    for name in ("reference", "engine"):
        assert res[name]["ok"], (name, res[name]["message"])
        assert res[name]["max_loss_abs_diff"] <= 1e-9 and res[name]["max_param_rel_diff"] <= 1e-9
        assert res[name]["message"].startswith("your VocabParallelCrossEntropy trains exactly like the "
                                               "single-device model (vocabulary 257, padded to 260")
    msg = {name: r["message"] for name, r in res.items() if not r["ok"]}
    assert len(msg) == len(cases) - 2
    assert msg["reduces over the world"] == ("your forward communicates all_reduce of [12] on 'world', all_reduce of [12] "
                                             "on 'world', all_reduce of [12] on 'world': reduce over "
                                             "the `axis` it is given ('tp' here, the ranks that share the vocabulary), "
                                             "not over other ranks")
    assert msg["no mask"].startswith("your loss counts the padded vocabulary ids (those >= vocab: id 15 on the "
                                     "last rank for vocab 15): set their logits to -inf")
    assert msg["no max"] == ("with logits around 1000 your loss is inf (exp overflows float64 past ~709): "
                             "subtract the all-reduced max from the logits before exponentiating")
    assert msg["no one-hot"].startswith("your gradient is softmax * dloss: subtract the one-hot of the target")
    assert msg["no dloss"].startswith("your gradient ignores dloss")
    assert msg["max not reduced"].startswith("the ranks shifted the logits by different maxima: all-reduce "
                                             "the max (op='max')")
    assert msg["sum not reduced"].startswith("your loss on tp rank 0 uses only this rank's sum of "
                                             "exponentials: all-reduce (sum)")
    assert msg["target not reduced"].startswith("your loss on tp rank 0 is right only for the tokens whose "
                                                "target id this rank holds: all-reduce (sum) the target logit")
    assert msg["gathers"].startswith("your forward communicates all_gather of [12, 4] on 'tp', all_reduce of [12]")
    assert "the logits are never gathered" in msg["gathers"]
    assert msg["raises"] == ("NotImplementedError in VocabParallelCrossEntropy.forward, line 5 of your code: "
                             "`raise NotImplementedError  # your code here`")
    assert msg["no class"] == ("your code defines no VocabParallelCrossEntropy: it must define "
                               "VocabParallelCrossEntropy")
    assert msg["one-hot everywhere"].startswith("your gradient subtracts the one-hot on ranks that do not hold "
                                                "the target")
    assert msg["mask times -inf"].startswith("your per-token loss is nan on tp rank 0 (token 0) for logits of "
                                             "order 1: is a masked -inf multiplied by 0 somewhere?")
    assert msg["mean"] == ("your VocabParallelCrossEntropy.forward returned a tensor of shape [] for N=12 tokens: "
                           "return the per-token loss, a tensor of shape [12] (the engine takes the mean itself)")
    assert msg["axis ignored"].startswith("called with axis='world' your forward communicates all_reduce of [12] "
                                          "on 'world', all_reduce of [12] on 'world', all_reduce of [12] on 'tp': "
                                          "use the `axis` argument")
    assert msg["backward communicates"].startswith("your backward communicates all_reduce of [12, 4] on 'tp': "
                                                   "it needs nothing from the other ranks")
    assert msg["one padded id masked"] == ("your loss counts the padded ids 14..15 (vocab 13, padded to 16: ids "
                                           "13..15 are padding): mask every id >= vocab, however many there are")
    assert msg["boundary off-by-one"] == (
        "your loss is wrong only for tokens whose target is the first or last id of a rank's slice (target ids 4, "
        "8, 12; 4 ids per rank): an off-by-one in which rank holds the target: rank r holds ids start <= id < "
        "start + V/t, and exactly one rank does")
    for name in ("engine by importlib", "engine by sys.modules", "engine by __import__"):
        assert msg[name].startswith("your code runs the engine's own minitron.parallel.tensor."
                                    "_VocabParallelCrossEntropy"), msg[name]
    assert all("\n" not in m and "Traceback" not in m for m in msg.values())
