"""Lab 11a's checker (``minitron.labs.dispatch``): the reference passes inside the engine
(--ep 2 --dp 2 and --ep 4 against one device, float64), the usual mistakes each get their own
line (among them counts exchanged with the wrong traffic or in the transposed shape, a size
right only at the notebook's --ep 4, gates applied before the experts), the engine's own
dispatch is refused by any route.

The stub, a syntax error and the engine's module named in the source are refused before any
rank starts; everything else runs on 4 gloo ranks, all the sources in one launch (the mistakes
are found by the unit checks, before any training)."""
import pytest

from minitron.labs.dispatch import check_dispatch, check_dispatch_all
from planted import broken_in

REFERENCE = '''
def permute(experts, keep, num_experts):
    choice = experts.flatten()
    kept = keep.flatten().nonzero().flatten()
    order = kept[torch.sort(choice[kept], stable=True).indices]
    return order, torch.bincount(choice[kept], minlength=num_experts)


def exchange_counts(counts, comm):
    n = comm.size("ep")
    return comm.all_to_all(counts, "ep").view(n, -1)


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, send, recv):
        ctx.comm, ctx.send, ctx.recv = comm, send, recv
        return comm.all_to_all(x, "ep", send, recv)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_to_all(grad.contiguous(), "ep", ctx.recv, ctx.send), None, None, None


def all_to_all(x, comm, send, recv):
    return AllToAll.apply(x, comm, send, recv)


def dispatch_tokens(tokens, experts, gates, keep, num_experts, comm, run_experts):
    k, n = experts.shape[1], comm.size("ep")
    order, counts = permute(experts, keep, num_experts)
    received = exchange_counts(counts, comm)
    send = counts.view(n, -1).sum(1).tolist()
    recv = received.sum(1).tolist()
    arrived = all_to_all(tokens[order // k], comm, send, recv)
    # arrival is (source, expert); the experts want (expert, source)
    starts = (torch.cumsum(received.flatten(), 0) - received.flatten()).view(received.shape)
    perm = torch.cat([torch.arange(int(starts[s, j]), int(starts[s, j] + received[s, j]))
                      for j in range(received.shape[1]) for s in range(n)])
    out = run_experts(arrived[perm], received.sum(0).tolist())
    back = all_to_all(out[torch.argsort(perm)], comm, recv, send)
    return torch.zeros_like(tokens).index_add(0, order // k, back * gates.flatten()[order, None])
'''

STUB = '''
def permute(experts, keep, num_experts):
    raise NotImplementedError  # your code here


def exchange_counts(counts, comm):
    raise NotImplementedError  # your code here


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, send, recv):
        raise NotImplementedError  # your code here

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError  # your code here


def all_to_all(x, comm, send, recv):
    return AllToAll.apply(x, comm, send, recv)


def dispatch_tokens(tokens, experts, gates, keep, num_experts, comm, run_experts):
    raise NotImplementedError  # your code here
'''


broken = broken_in(REFERENCE)


def test_syntax_error_stub_and_engine_copy_need_no_ranks():
    res = check_dispatch(broken("def permute(experts, keep, num_experts):", "def permute(experts, keep, num_experts)"))
    assert res["ok"] is False and res["message"].startswith("your code does not compile: expected ':'")
    assert check_dispatch(STUB)["message"] == (
        "permute, exchange_counts, AllToAll.forward, AllToAll.backward and dispatch_tokens are not written yet "
        "(still `raise NotImplementedError`): fill in the `# your code here` lines in SOURCE")
    msg = check_dispatch("from minitron.parallel.experts import token_dispatch\n" + REFERENCE)["message"]
    assert msg.startswith("your code uses the engine's own") and "minitron.parallel.experts" in msg, msg


@pytest.mark.multirank
def test_reference_passes_and_mistakes_get_one_line():
    cases = {
        "reference": REFERENCE,
        "counts not exchanged": broken('return comm.all_to_all(counts, "ep").view(n, -1)', "return counts.view(n, -1)"),
        "keep ignored": broken("kept = keep.flatten().nonzero().flatten()",
                               "kept = torch.arange(keep.numel())"),
        "not sorted by expert": broken("order = kept[torch.sort(choice[kept], stable=True).indices]", "order = kept"),
        "backward splits not swapped": broken('"ep", ctx.recv, ctx.send)', '"ep", ctx.send, ctx.recv)'),
        "arrival not regrouped (wrong split order)": broken("out = run_experts(arrived[perm]", "out = run_experts(arrived"),
        "combine without un-permute": broken(
            "return torch.zeros_like(tokens).index_add(0, order // k, back * gates.flatten()[order, None])",
            "return torch.zeros_like(tokens).index_add(0, torch.sort(order // k).values, back * gates.flatten()[order, None])"),
        "no gate weighting": broken("back * gates.flatten()[order, None]", "back"),
        # right values, wrong traffic or shape; right only at the notebook's --ep 4
        "counts gathered from every rank": broken('return comm.all_to_all(counts, "ep").view(n, -1)',
                                                  'return comm.all_gather(counts, "ep").view(n, n, -1)[:, comm.index("ep")]'),
        "counts in the transposed shape": broken('return comm.all_to_all(counts, "ep").view(n, -1)',
                                                 'return comm.all_to_all(counts, "ep").view(-1, n)'),
        "ep hard-wired to the notebook's 4": broken('n = comm.size("ep")\n    return', 'n = 4\n    return'),
        "gates applied before the experts": broken(
            "arrived = all_to_all(tokens[order // k], comm, send, recv)",
            "arrived = all_to_all(tokens[order // k] * gates.flatten()[order, None], comm, send, recv)",
            broken("back * gates.flatten()[order, None])", "back)")),
        # the engine's own dispatch reached past the screen
        "engine by importlib": "import importlib\n" + broken(
            "    k, n = experts.shape[1], comm.size(\"ep\")\n",
            "    return importlib.import_module('minitron.parallel.' + 'experts').token_dispatch(tokens, experts, gates,"
            " keep, num_experts, comm, run_experts)\n"),
        "checker by sys.modules": "import sys\n" + broken(
            "    k, n = experts.shape[1], comm.size(\"ep\")\n",
            "    vars(sys.modules['minitron.la' + 'bs.dispatch'])['_want' + '_y'](tokens, experts, gates, keep)\n"
            "    k, n = experts.shape[1], comm.size(\"ep\")\n"),
    }
    res = dict(zip(cases, check_dispatch_all(list(cases.values()), timeout=60)))
    ref = res.pop("reference")
    assert ref["ok"], ref["message"]
    assert ref["max_loss_abs_diff"] <= 1e-9 and ref["max_param_rel_diff"] <= 1e-9
    want = {
        "counts not exchanged": "the counts were not exchanged",
        "keep ignored": "also those dropped by the capacity",
        "not sorted by expert": "not grouped by expert",
        "backward splits not swapped": "split sizes swapped",
        "arrival not regrouped (wrong split order)": "regroup them by local expert",
        "combine without un-permute": "un-permute them",
        "no gate weighting": "multiply each by its gate",
        "counts gathered from every rank": "gathering every rank's counts moves ep times the bytes",
        "counts in the transposed shape": "returned shape [2, 4] on --ep 4: return [ep, E/ep] = [4, 2]",
        "ep hard-wired to the notebook's 4": "returned shape [4, 2] on --ep 2: return [ep, E/ep] = [2, 4], one row "
                                             "per source rank (transposed, or shaped for another ep?) (at --ep 2; right "
                                             "at --ep 4)",
        "gates applied before the experts": "the experts were given the tokens multiplied by their gates",
        "engine by importlib": "the engine's own minitron.parallel.experts",
        "checker by sys.modules": "the engine's own minitron.labs.dispatch",
    }
    for name, verdict in res.items():
        assert not verdict["ok"], name
        assert want[name] in verdict["message"] and "\n" not in verdict["message"], (name, verdict["message"])
    assert len({v["message"] for v in res.values()}) == len(res)  # each its own line
