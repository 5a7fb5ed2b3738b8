"""Lab 11b: node-limited routing (DeepSeek-V3, arXiv 2412.19437 §2.1.2; the engine's
``minitron.moe.route`` with ``expert_groups`` and ``topk_groups``).

The E routed experts lie on G nodes (expert groups) of E/G *consecutive* experts. Each token
first scores every node by the sum of the two highest selection scores of its experts
(DeepSeek-V3's "highest K_r/M affinities", 8/4 = 2 in V3; its released code, transformers'
``DeepseekV3TopkRouter`` and the engine fix the 2 whatever k and M), keeps its M best nodes,
then takes its k best experts among theirs, ties to the lower index (a stable sort). Its gates
are the chosen experts' (unbiased) scores normalised over the k chosen, times
``routed_scaling``. The learner writes

* ``node_limited_topk(choice, k, nodes, M) -> experts`` [T, k]: `choice` [T, E] the selection
  scores (sigmoid scores plus the loss-free bias, no gradient);
* ``gates(scores, experts, scaling) -> gates`` [T, k]: gate j belongs to ``experts[:, j]``,
  with its gradient to `scores` (the router learns through it).

Graded on random selection scores with six (E, nodes, M, k), two of them full of exact ties,
which no hard-wired size passes, against the engine's own routing (the usual mistakes each
named: nodes scored by their best expert, by all their experts or by their top k/M, the limit
ignored, M hard-wired, experts interleaved over the nodes, ties to a higher index, gates
normalised over every expert, unscaled or detached); then the two functions are handed to the
engine in place of its routing (``Trainer(layers=...)`` with a layer namespace carrying
``route``; nothing patched) and a tiny DeepSeek-V3 (latent attention, shared expert, sigmoid
router with the loss-free bias) trains 3 float64 steps on 4 ranks in one launch: ``--ep 2
--dp 2`` with nodes of 2 experts (2 nodes per rank) and ``--ep 4`` with nodes of 8 experts
(a node over 2 ranks), each against the single-device model (1e-9). A profile hook refuses
the engine's routing (``group_mask``, ``route``, ``top``) and the checker's own answers,
whatever the route, while the learner's code runs.

    result = check_node_routing(SOURCE)   # {"ok", "message", "max_loss_abs_diff", ..., "max_nodes_per_token": {layout: n}}
"""
from __future__ import annotations

import datetime
import itertools
from types import SimpleNamespace

import torch

from ..config import PRESETS, ModelConfig, ParallelConfig, TrainConfig
from .runner import (TOL, LabError, Tripwire, call, engine_piece, loaded, on_each_layout, run_sources, training_verdict,
                     verdict_over_runs, versus_one_device)

NAMES = ("node_limited_topk", "gates")
FORBIDDEN = ("minitron.moe.group_mask", "minitron.moe", "minitron.labs.node_routing")
ENGINE = ("minitron.moe.group_mask", "minitron.moe.route", "minitron.moe.top")
WORLD = 4
TOKENS = 48
# (E, nodes, M, k, ties): k/M of 2, 1, 4, 2 and a fraction; M from 1 to 4; the last two full of ties
CASES = ((16, 4, 2, 4, False), (24, 6, 3, 3, False), (32, 8, 2, 8, False), (12, 3, 1, 2, False),
         (64, 8, 4, 8, True), (20, 4, 3, 5, True))
GATE_CASES = ((16, 4, 2.5), (12, 3, 1.5))  # (E, k, routed_scaling)
TINY = PRESETS["deepseek-v3-tiny"].replace(layers=3, mtp_depths=0, name="lab-node-routing")
LAYOUTS = (ParallelConfig(ep=2, dp=2, device="cpu"), ParallelConfig(ep=4, device="cpu"))
MODELS = (TINY.replace(experts=8, expert_groups=4, topk_groups=2, top_k=3),  # nodes of 2, 2 nodes per ep rank
          TINY.replace(experts=16, expert_groups=2, topk_groups=1, top_k=4))  # nodes of 8, a node on 2 ep ranks
TRAIN = TrainConfig(steps=3, global_batch=4, dtype="float64", lr=1e-2, warmup=1, progress=False, eval_every=0,
                    sample_tokens=0)
_CASE = itertools.count()  # the case number in this launch: the same on every rank


# --- the checker's answers ---------------------------------------------------------------------
def _top(x: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest of each row, ties to the lower index."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]


def _variant(choice, k: int, nodes: int, M: int, score: str = "top2", grouping: str = "contiguous",
             limit: bool = True) -> torch.Tensor:
    """Node-limited top-k as written with one mistake (or none: the defaults): nodes scored by
    `score` (the sum of the top 2, the best one 'max', all 'sum', the top k/M 'kM'), experts
    grouped `grouping` ('interleaved': node n holds n, n + G, ...), the `limit` kept."""
    T, E = choice.shape
    size = E // nodes
    grouped = choice.view(T, nodes, size) if grouping == "contiguous" else choice.view(T, size, nodes).transpose(1, 2)
    take = {"top2": 2, "max": 1, "sum": size, "kM": max(1, k // M)}[score]
    node_score = grouped.topk(min(take, size), dim=-1).values.sum(-1)  # values only: ties do not matter
    node_of = torch.arange(E) // size if grouping == "contiguous" else torch.arange(E) % nodes
    mask = torch.zeros(T, nodes, dtype=torch.bool).scatter_(1, _top(node_score, min(M, nodes)), True)[:, node_of]
    return _top(choice if not limit else choice.masked_fill(~mask, float("-inf")), k)


def _engine_topk(choice, k: int, nodes: int, M: int) -> torch.Tensor:
    """The engine's own choice (``minitron.moe``'s group mask and stable top-k): the oracle."""
    cfg = ModelConfig(experts=choice.shape[1], expert_groups=nodes, topk_groups=M, top_k=k)
    mask = engine_piece("minitron.moe.group_mask")(choice, cfg)
    return engine_piece("minitron.moe.top")(choice.masked_fill(~mask, float("-inf")), k)


def _choice(i: int, E: int, ties: bool) -> torch.Tensor:
    """Case i's selection scores [T, E]: sigmoid-like scores and a bias, or quarters 0..1 (ties)."""
    g = torch.Generator().manual_seed(1100 + i)
    if ties:
        return torch.randint(0, 5, (TOKENS, E), generator=g).double() / 4
    return torch.rand(TOKENS, E, generator=g, dtype=torch.float64) + 0.1 * torch.randn(E, generator=g).double()


def _mistakes() -> list[tuple[dict, str]]:
    """The usual mistakes: the `_variant` that writes each, and what to say."""
    named = [(dict(limit=False), "chooses the experts from all nodes (the node limit ignored): keep each token's M "
                                 "best nodes first, then take its k experts among theirs"),
             (dict(score="max"), "scores each node by its single best expert: a node's score is the sum of its two "
                                 "highest affinities (DeepSeek-V3 §2.1.2)"),
             (dict(score="sum"), "scores each node by the sum of all its experts' affinities: a node's score is the "
                                 "sum of its two highest (DeepSeek-V3 §2.1.2)"),
             (dict(score="kM"), "scores each node by the sum of its top k/M affinities: the engine, like DeepSeek-V3's "
                                "released code and transformers' DeepseekV3TopkRouter, sums the top 2 whatever k and M "
                                "(V3's k/M is 8/4 = 2)"),
             (dict(grouping="interleaved"), "puts experts n, n + G, n + 2G, ... on node n: a node holds consecutive "
                                            "experts, node n the E/G from n·E/G on")]
    return named + [(dict(M=m), f"keeps {m} node{'s' if m > 1 else ''} whatever M is: M is the argument (the cases "
                                f"ask M = 1 to 4), not a constant") for m in range(1, 9)]


def _answers() -> list[dict]:
    """For each case (computed before the learner's code is armed): its scores, the engine's
    experts and each mistake's."""
    out = []
    for i, (E, nodes, M, k, ties) in enumerate(CASES):
        choice = _choice(i, E, ties)
        want = _engine_topk(choice, k, nodes, M)
        kinds = []
        for kw, _ in _mistakes():
            kw = dict(kw)
            kinds.append(_variant(choice, k, nodes, kw.pop("M", M), **kw))
        out.append(dict(E=E, nodes=nodes, M=M, k=k, ties=ties, choice=choice, want=want, mistakes=kinds))
    return out


# --- the unit checks ---------------------------------------------------------------------------
def _malformed(got, T: int, k: int, E: int) -> str:
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != (T, k):
        shape = list(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        return f"your node_limited_topk returned {shape}: return the [T, k] = [{T}, {k}] chosen experts' indices"
    if got.dtype.is_floating_point or got.dtype == torch.bool:
        return f"your node_limited_topk returned {got.dtype} values: return expert indices (torch.long)"
    if got.min() < 0 or got.max() >= E:
        return f"your node_limited_topk returned expert {int(got.max())} (or a negative one) of E = {E}: indices 0..E-1"
    if (got.sort(-1).values.diff(dim=-1) == 0).any():
        t = int((got.sort(-1).values.diff(dim=-1) == 0).any(1).nonzero()[0])
        return f"your node_limited_topk picks one expert twice for token {t} ({got[t].tolist()}): k different experts"
    return ""


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same experts for every token, in any order (gates follow their experts)."""
    return torch.equal(a.long().sort(-1).values, b.long().sort(-1).values)


def _check_topk(fn, answers: list[dict]) -> str:
    got = []
    for a in answers:
        choice = a["choice"].clone()
        out = call("your node_limited_topk", fn, choice, a["k"], a["nodes"], a["M"])
        if not torch.equal(choice, a["choice"]):
            return "your node_limited_topk changes `choice` in place: the engine still reads it; work on a copy"
        problem = _malformed(out, TOKENS, a["k"], a["E"])
        if problem:
            return problem + f" (E = {a['E']}, nodes = {a['nodes']}, M = {a['M']}, k = {a['k']})"
        got.append(out)
    wrong = [i for i, (g, a) in enumerate(zip(got, answers)) if not _same(g, a["want"])]
    if not wrong:
        return ""
    plain = [i for i, a in enumerate(answers) if not a["ties"]]
    for j, (_, said) in enumerate(_mistakes()):
        if any(i in wrong for i in plain) and all(_same(got[i], answers[i]["mistakes"][j]) for i in plain):
            return f"your node_limited_topk {said}"
    i = wrong[0]
    a = answers[i]
    t = int(next(t for t in range(TOKENS) if not _same(got[i][t:t + 1], a["want"][t:t + 1])))
    case = f"E = {a['E']}, nodes = {a['nodes']}, M = {a['M']}, k = {a['k']}"
    if a["ties"] and not any(j in wrong for j in plain):
        return (f"with tied scores ({case}) your node_limited_topk picks experts {sorted(got[i][t].tolist())} for token "
                f"{t}, the engine {sorted(a['want'][t].tolist())}: ties go to the lower index, nodes and experts alike "
                f"(a stable sort, torch.sort(..., descending=True, stable=True); torch.topk does not promise it), so "
                f"that every layout picks the same experts")
    return (f"your node_limited_topk ({case}) picks experts {sorted(got[i][t].tolist())} for token {t}, the engine "
            f"{sorted(a['want'][t].tolist())}")


def _check_gates(fn) -> str:
    for i, (E, k, scaling) in enumerate(GATE_CASES):
        g = torch.Generator().manual_seed(1200 + i)
        base = torch.rand(TOKENS, E, generator=g, dtype=torch.float64)
        experts = _top(base + 0.1 * torch.randn(E, generator=g).double(), k)
        scores = base.clone().requires_grad_(True)
        got = call("your gates", fn, scores, experts.clone(), scaling)
        where = f" (E = {E}, k = {k}, routed_scaling {scaling})"
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != (TOKENS, k):
            shape = list(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            return f"your gates returned {shape}: return [T, k] = [{TOKENS}, {k}], gate j of experts[:, j]" + where
        chosen = base.gather(1, experts)
        want = chosen / chosen.sum(-1, keepdim=True) * scaling
        value = got.detach().double()
        if not torch.allclose(value, want, rtol=1e-12, atol=0):
            named = ((chosen / base.sum(-1, keepdim=True) * scaling, "divide by the sum of all E experts' scores: "
                      "normalise over the token's k chosen experts (the gates then sum to routed_scaling)"),
                     (chosen / chosen.sum(-1, keepdim=True), "sum to 1: DeepSeek-V3 scales the normalised gates by "
                      "routed_scaling"),
                     (chosen * scaling, "are the chosen scores scaled but not normalised: divide by their sum over "
                      "the k chosen (sigmoid scores do not sum to 1)"),
                     (chosen.softmax(-1) * scaling, "are a softmax of the chosen sigmoid scores: normalise by their sum"))
            said = next((s for w, s in named if torch.allclose(value, w, rtol=1e-12, atol=0)), "")
            return (f"your gates {said}" if said else
                    f"your gates for token 0 are {[round(v, 6) for v in value[0].tolist()]}, want "
                    f"{[round(v, 6) for v in want[0].tolist()]} (the chosen scores over their sum, times the scaling)") + where
        if not got.requires_grad:
            return "your gates carry no gradient to the scores: compute them from `scores` inside autograd (the router learns through them)"
        weight = torch.arange(TOKENS * k, dtype=torch.float64).reshape(TOKENS, k) / (TOKENS * k)
        (mine,) = torch.autograd.grad((got * weight).sum(), scores)
        ref = base.clone().requires_grad_(True)
        c = ref.gather(1, experts)
        (theirs,) = torch.autograd.grad((c / c.sum(-1, keepdim=True) * scaling * weight).sum(), ref)
        if not torch.allclose(mine, theirs, rtol=1e-10, atol=1e-14):
            return "your gates' gradient to the scores is wrong: the normalisation's sum is part of the graph (do not detach it)"
    return ""


# --- the engine run ----------------------------------------------------------------------------
def _route(ns: dict, watch: Tripwire, seen: dict):
    """``minitron.moe.route``'s contract built from the learner's two functions: the router's
    sigmoid scores, the selection bias added for the choice only (DeepSeek-V3's loss-free
    balancing), then theirs. It notes the most nodes a token's experts were on."""
    def route(logits, cfg, bias=None):
        scores = logits.sigmoid()
        choice = (scores if bias is None else scores + bias).detach()
        with watch.armed():
            experts = call("your node_limited_topk", ns["node_limited_topk"], choice, cfg.top_k, cfg.expert_groups,
                           cfg.topk_groups)
            gates = call("your gates", ns["gates"], scores, experts, cfg.routed_scaling)
        nodes = experts // (cfg.experts // cfg.expert_groups)
        most = max(len(set(row)) for row in nodes.tolist()) if nodes.numel() else 0
        seen["max_nodes_per_token"] = max(seen.get("max_nodes_per_token", 0), most)
        return scores, experts, gates
    return route


def _train(c, layout, ns, watch, comm) -> dict | None:
    from ..parallel import tensor
    from ..train import Trainer

    model = MODELS[LAYOUTS.index(layout)]
    seen: dict = {}
    layers = SimpleNamespace(**{**vars(tensor.layers()), "route": _route(ns, watch, seen)})
    tr = Trainer(model, layout, TRAIN, c, layers=layers)
    losses = [tr.step(i) for i in range(TRAIN.steps)]
    res = versus_one_device(comm, tr, losses, model, TRAIN)
    verdict = training_verdict(res, "node-limited routing", "", TOL)
    if verdict is not None:
        verdict["max_nodes_per_token"] = seen.get("max_nodes_per_token", 0)
        if verdict["ok"] and verdict["max_nodes_per_token"] > model.topk_groups:
            verdict.update(ok=False, message=f"a token's experts were on {verdict['max_nodes_per_token']} nodes, "
                                             f"more than M = {model.topk_groups}")
    return verdict


def _watch() -> Tripwire:
    """Armed only while the learner's code runs: the engine's routing, the checker's answers."""
    pieces = {name: engine_piece(name) for name in ENGINE}
    pieces.update({"minitron.labs.node_routing": _variant, "minitron.labs.node_routing.answers": _answers})
    return Tripwire(pieces)


def _job(comm, source: str, timeout: float) -> dict | None:
    case = next(_CASE)
    watch, answers = _watch(), _answers()  # the answers before anything of the learner's runs
    model_b = MODELS[1]
    g = torch.Generator().manual_seed(1300)
    choice_b = torch.rand(TOKENS, model_b.experts, generator=g, dtype=torch.float64)
    want_b = _engine_topk(choice_b, model_b.top_k, model_b.expert_groups, model_b.topk_groups)
    shape_b = dict(E=model_b.experts, nodes=model_b.expert_groups, M=model_b.topk_groups, k=model_b.top_k, ties=False,
                   choice=choice_b, want=want_b, mistakes=[])
    topk, gates = loaded(comm, source, NAMES, {"torch": torch}, watch, f"node-routing/{case}", timeout)
    ns = {"node_limited_topk": topk, "gates": gates}

    def unit_check(c):
        if c is comm:  # the launch's own layout: the whole battery
            return _check_topk(topk, answers) or _check_gates(gates)
        return _check_topk(topk, [shape_b])  # the second layout's sizes

    runs = on_each_layout(comm, LAYOUTS, f"node-routing/{case}", timeout, watch, unit_check,
                          lambda c, layout: _train(c, layout, ns, watch, comm))
    if comm.grid.rank != 0:
        return None
    most = {flags: v["max_nodes_per_token"] for flags, v in runs}  # each layout's, before one verdict is kept
    verdict = verdict_over_runs(runs, "your node-limited routing trains exactly like the single-device model (--ep 2 "
                                      "--dp 2 with nodes of 2 experts, --ep 4 with nodes of 8 experts on 2 ranks each), "
                                      "no token's experts on more than M nodes")
    return {**verdict, "max_nodes_per_token": most}


def check_node_routing_all(sources: list[str], timeout: float = 90) -> list[dict]:
    """`check_node_routing` for several sources, in as few launches as their outcomes allow."""
    return run_sources(_job, LAYOUTS[0], sources, timeout, timeout, forbidden=FORBIDDEN, names=NAMES)


def check_node_routing(source: str, timeout: float = 90) -> dict:
    """Lab 11b: check `node_limited_topk` and `gates` defined in `source` on random selection
    scores (six (E, nodes, M, k), ties among them) against the engine's routing, then train a
    tiny DeepSeek-V3 with them in the engine's place on 4 gloo ranks (--ep 2 --dp 2 and --ep 4,
    nodes of 2 and of 8 experts; float64, 3 steps) against the single-device model. Returns
    {"ok", "message", "max_loss_abs_diff", "max_param_rel_diff", "max_nodes_per_token" (per layout), ...},
    or {"ok": False, "message"} naming the first problem (also when the code does not compile,
    is a stub, uses the engine's own routing, raises or runs past `timeout`)."""
    return check_node_routing_all([source], timeout)[0]
