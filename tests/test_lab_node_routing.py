"""Lab 11b's checker (``minitron.labs.node_routing``): the reference passes inside the engine
(--ep 2 --dp 2 with nodes of 2 experts and --ep 4 with nodes of 8, against one device, float64),
each usual mistake gets its own line (nodes scored by their best expert, by all their experts or
by their top k/M, the node limit ignored, M hard-wired, experts interleaved over the nodes, ties
to a higher index (torch.topk), gates normalised over every expert, unscaled, detached), and the
engine's own routing is refused in the source and at run time.

The stub, a syntax error and the engine's module named in the source are refused before any rank
starts; everything else runs on 4 gloo ranks, all the sources in one launch (the mistakes are
found by the unit checks, before any training). The checker's own mistakes are checked against
the engine too (a diagnosis of a variant the engine does not differ from would name nothing)."""
import pytest
import torch

from minitron.labs import node_routing as lab
from minitron.labs.node_routing import check_node_routing, check_node_routing_all
from planted import assert_each_named, broken_in

REFERENCE = '''
def node_limited_topk(choice, k, nodes, M):
    T, E = choice.shape
    grouped = choice.view(T, nodes, E // nodes)
    score = grouped.topk(min(2, E // nodes), dim=-1).values.sum(-1)
    best = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :M]
    keep = torch.zeros(T, nodes, dtype=torch.bool).scatter(1, best, True).repeat_interleave(E // nodes, dim=1)
    masked = choice.masked_fill(~keep, float("-inf"))
    return torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :k]


def gates(scores, experts, scaling):
    chosen = scores.gather(1, experts)
    return chosen / chosen.sum(-1, keepdim=True) * scaling
'''

STUB = '''
def node_limited_topk(choice, k, nodes, M):
    raise NotImplementedError  # your code here


def gates(scores, experts, scaling):
    raise NotImplementedError  # your code here
'''


broken = broken_in(REFERENCE)


def test_the_checkers_variants_are_the_engine_and_each_differs():
    """The checker's mistake-free variant is the engine's routing on every case, and every
    mistake it names changes some case's choice (else it could not be told apart)."""
    answers = lab._answers()
    for a in answers:
        assert torch.equal(lab._variant(a["choice"], a["k"], a["nodes"], a["M"]), a["want"])
    plain = [a for a in answers if not a["ties"]]
    for j, (_, said) in enumerate(lab._mistakes()):
        assert any(not lab._same(a["mistakes"][j], a["want"]) for a in plain), said


def test_syntax_error_stub_and_engine_copy_need_no_ranks():
    res = check_node_routing(broken("def gates(scores, experts, scaling):", "def gates(scores, experts, scaling)"))
    assert res["ok"] is False and res["message"].startswith("your code does not compile: expected ':'")
    assert check_node_routing(STUB)["message"] == (
        "node_limited_topk and gates are not written yet (still `raise NotImplementedError`): fill in the "
        "`# your code here` lines in SOURCE")
    msg = check_node_routing("from minitron.moe import group_mask\n" + REFERENCE)["message"]
    assert msg.startswith("your code uses the engine's own minitron.moe.group_mask (line 1)"), msg


@pytest.mark.multirank
def test_reference_passes_and_mistakes_get_one_line():
    score = "score = grouped.topk(min(2, E // nodes), dim=-1).values.sum(-1)"
    cases = {
        "reference": REFERENCE,
        "nodes by their best expert": broken(score, "score = grouped.max(-1).values"),
        "nodes by all their experts": broken(score, "score = grouped.sum(-1)"),
        "nodes by their top k/M": broken(score, "score = grouped.topk(max(1, k // M), dim=-1).values.sum(-1)"),
        "limit ignored": broken('masked = choice.masked_fill(~keep, float("-inf"))', "masked = choice"),
        "M hard-wired": broken("def node_limited_topk(choice, k, nodes, M):\n",
                               "def node_limited_topk(choice, k, nodes, M):\n    M = 2\n"),
        "experts interleaved over the nodes": broken(
            "grouped = choice.view(T, nodes, E // nodes)", "grouped = choice.view(T, E // nodes, nodes).transpose(1, 2)",
            broken(".repeat_interleave(E // nodes, dim=1)", ".repeat(1, E // nodes)")),
        "torch.topk's ties": broken("return torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :k]",
                                    "return masked.topk(k, dim=-1).indices"),
        "gates over every expert": broken("return chosen / chosen.sum(-1, keepdim=True) * scaling",
                                          "return chosen / scores.sum(-1, keepdim=True) * scaling"),
        "gates unscaled": broken("return chosen / chosen.sum(-1, keepdim=True) * scaling",
                                 "return chosen / chosen.sum(-1, keepdim=True)"),
        "gates detached": broken("chosen = scores.gather(1, experts)", "chosen = scores.detach().gather(1, experts)"),
        # right on the unit checks' sizes only: the engine's run (8 experts) finds it
        "right only on the unit checks' sizes": broken("    T, E = choice.shape\n",
                                                       "    T, E = choice.shape\n    if E == 8:\n"
                                                       "        return torch.sort(choice, dim=-1, descending=True, "
                                                       "stable=True).indices[:, :k]\n"),
        # the engine's own routing reached past the screen
        "engine by importlib": "import importlib\n" + broken(
            "    T, E = choice.shape\n",
            "    return importlib.import_module('minitron.' + 'moe').top(choice, k)\n"),
        "checker by sys.modules": "import sys\n" + broken(
            "    T, E = choice.shape\n",
            "    return vars(sys.modules['minitron.la' + 'bs.node_routing'])['_var' + 'iant'](choice, k, nodes, M)\n"),
    }
    res = dict(zip(cases, check_node_routing_all(list(cases.values()), timeout=60)))
    ref = res.pop("reference")
    assert ref["ok"], ref["message"]
    assert ref["max_loss_abs_diff"] <= 1e-9 and ref["max_param_rel_diff"] <= 1e-9
    # k = 3 experts on M = 2 nodes of 2 need both nodes; M = 1 of 2 nodes of 8: one
    assert ref["max_nodes_per_token"] == {"--ep 2 --dp 2": 2, "--ep 4": 1}
    assert_each_named(res, {
        "nodes by their best expert": "scores each node by its single best expert",
        "nodes by all their experts": "scores each node by the sum of all its experts' affinities",
        "nodes by their top k/M": "scores each node by the sum of its top k/M affinities",
        "limit ignored": "chooses the experts from all nodes (the node limit ignored)",
        "M hard-wired": "keeps 2 nodes whatever M is",
        "experts interleaved over the nodes": "puts experts n, n + G, n + 2G, ... on node n",
        "torch.topk's ties": "ties go to the lower index",
        "gates over every expert": "divide by the sum of all E experts' scores",
        "gates unscaled": "sum to 1: DeepSeek-V3 scales the normalised gates by routed_scaling",
        "gates detached": "your gates carry no gradient to the scores",
        "right only on the unit checks' sizes": "--ep 2 --dp 2: your node-limited routing passes the checks above "
                                                "but training differs from the single-device model",
        "engine by importlib": "your code runs the engine's own minitron.moe.top",
        "checker by sys.modules": "your code runs the engine's own minitron.labs.node_routing",
    })
