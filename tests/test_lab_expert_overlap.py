"""Lab 11c's checker (``minitron.labs.expert_overlap``): the reference passes, trained in the
engine's place under --ep-overlap (--ep 2 --dp 2 and --ep 4 against one device, float64);
each planted mistake gets its own one line: waiting at once, half 2's dispatch posted late,
both dispatches waited before any expert, half 1's combine posted after half 2's experts or
waited before them, a half with no expert, a dispatch never waited, a blocking all-to-all, the wrong group,
a half's counts not padded to every local expert (its rows through the wrong experts), the
halves cut by token, a half's receive sizes disagreeing with its peers' send sizes, a half's
rows not its split sizes, the arrival not regrouped, the outputs sent back unpermuted, the
rows read off the Pending (no gradient path), the gates detached, the counts exchanged again
per half (the plain layout's bytes exceeded), and again only at the engine's sizes (its traced
step against the analysis); the engine's own
overlapped dispatch is refused by three routes (importlib, sys.modules, __import__ of a built
name).

The stub, a syntax error and the engine's module named in the source are refused before any
rank starts; everything else runs on 4 gloo ranks, all the sources in one launch (the
mistakes are found by the unit checks, before any training)."""
import pytest

from minitron.labs.expert_overlap import check_overlapped_dispatch, check_overlapped_dispatch_all
from planted import assert_each_named, broken_in

REFERENCE = '''
def overlapped_dispatch(tokens, experts, gates, keep, num_experts, comm, run_experts):
    k = experts.shape[1]
    order, counts = permute(experts, keep, num_experts)
    plan = Dispatch(counts, comm)  # the counts exchanged once: every half's sizes are in them
    e_local = plan.sent_counts.shape[1]
    local = experts.flatten()[order] % e_local  # each pair's expert among its destination's
    halves = []
    for lo, hi in ((0, e_local // 2), (e_local // 2, e_local)):
        received = plan.received_counts[:, lo:hi]
        perm, inverse = by_expert(received)  # the half's arrival (source, expert) -> (expert, source)
        counts_h = [0] * e_local
        counts_h[lo:hi] = received.sum(0).tolist()
        pairs = order[(local >= lo) & (local < hi)]
        halves.append((pairs, plan.sent_counts[:, lo:hi].sum(1).tolist(), received.sum(1).tolist(), perm, inverse,
                       counts_h))
    flights = [Flight(comm, "ep", send, recv) for _, send, recv, *_ in halves]
    posted = [Post.apply(tokens[h[0] // k], f) for h, f in zip(halves, flights)]  # both dispatches in flight
    combines = []
    for (pairs, send, recv, perm, inverse, counts_h), f, token in zip(halves, flights, posted):
        arrived = Wait.apply(token, f)
        out = run_experts(arrived[perm], counts_h)  # the other half's all-to-all travels meanwhile
        back = Flight(comm, "ep", recv, send)
        combines.append((back, Post.apply(out[inverse], back)))
    rows = torch.cat([Wait.apply(token, back) for back, token in combines])
    return unpermute(tokens, torch.cat([h[0] for h in halves]), k, gates, rows)
'''

STUB = '''
def overlapped_dispatch(tokens, experts, gates, keep, num_experts, comm, run_experts):
    raise NotImplementedError  # your code here
'''

LOOP = '''    flights = [Flight(comm, "ep", send, recv) for _, send, recv, *_ in halves]
    posted = [Post.apply(tokens[h[0] // k], f) for h, f in zip(halves, flights)]  # both dispatches in flight
    combines = []
    for (pairs, send, recv, perm, inverse, counts_h), f, token in zip(halves, flights, posted):
        arrived = Wait.apply(token, f)
'''


PER_HALF = '''    combines = []
    for pairs, send, recv, perm, inverse, counts_h in halves:  # each half's dispatch posted and waited in turn
        f = Flight(comm, "ep", send, recv)
        arrived = Wait.apply(Post.apply(tokens[pairs // k], f), f)
'''


BY_TOKEN = '''
def overlapped_dispatch(tokens, experts, gates, keep, num_experts, comm, run_experts):
    k, T = experts.shape[1], tokens.shape[0]
    parts = []
    for lo, hi in ((0, T // 2), (T // 2, T)):  # the halves cut by token: each its own counts
        sub = torch.zeros_like(keep)
        sub[lo:hi] = keep[lo:hi]
        order, counts = permute(experts, sub, num_experts)
        plan = Dispatch(counts, comm)
        perm, inverse = by_expert(plan.received_counts)
        parts.append((order, plan, perm, inverse))
    flights = [Flight(comm, "ep", p.send, p.recv) for _, p, _, _ in parts]
    posted = [Post.apply(tokens[o // k], f) for (o, *_), f in zip(parts, flights)]
    combines = []
    for (order, plan, perm, inverse), f, token in zip(parts, flights, posted):
        arrived = Wait.apply(token, f)
        out = run_experts(arrived[perm], plan.local_counts.tolist())
        back = Flight(comm, "ep", plan.recv, plan.send)
        combines.append((back, Post.apply(out[inverse], back)))
    rows = torch.cat([Wait.apply(token, back) for back, token in combines])
    return unpermute(tokens, torch.cat([p[0] for p in parts]), k, gates, rows)
'''


broken = broken_in(REFERENCE)


def test_syntax_error_stub_and_engine_copy_need_no_ranks():
    res = check_overlapped_dispatch(broken("def overlapped_dispatch(tokens, experts, gates, keep, num_experts, comm, "
                                           "run_experts):", "def overlapped_dispatch(tokens)"))
    assert res["ok"] is False and res["message"].startswith("your code does not compile: expected ':'")
    assert check_overlapped_dispatch(STUB)["message"] == (
        "overlapped_dispatch is not written yet (still `raise NotImplementedError`): fill in the `# your code here` "
        "lines in SOURCE")
    msg = check_overlapped_dispatch("from minitron.parallel.expert_overlap import halves\n" + REFERENCE)["message"]
    assert msg.startswith("your code uses the engine's own minitron.parallel.expert_overlap (line 1)"), msg


@pytest.mark.multirank
def test_reference_passes_and_each_planted_mistake_is_named():
    cases = {
        "reference": REFERENCE,
        "waiting at once": broken(LOOP, PER_HALF, broken(
            "        combines.append((back, Post.apply(out[inverse], back)))\n",
            "        combines.append((back, Wait.apply(Post.apply(out[inverse], back), back)))\n",
            broken("rows = torch.cat([Wait.apply(token, back) for back, token in combines])",
                   "rows = torch.cat([done for back, done in combines])"))),
        "half 2's dispatch posted late": broken(LOOP, PER_HALF),
        "both dispatches waited before any expert": broken(LOOP, '''    flights = [Flight(comm, "ep", send, recv) for _, send, recv, *_ in halves]
    posted = [Post.apply(tokens[h[0] // k], f) for h, f in zip(halves, flights)]
    arrivals = [Wait.apply(token, f) for token, f in zip(posted, flights)]  # both waited before any expert
    combines = []
    for (pairs, send, recv, perm, inverse, counts_h), f, arrived in zip(halves, flights, arrivals):
'''),
        "half 1's combine posted after half 2's experts": broken(
            "        back = Flight(comm, \"ep\", recv, send)\n        combines.append((back, Post.apply(out[inverse], back)))\n",
            "        combines.append((Flight(comm, \"ep\", recv, send), out[inverse]))\n"
            "    combines = [(back, Post.apply(rows_h, back)) for back, rows_h in combines]\n"),
        "a half with no expert": broken("for lo, hi in ((0, e_local // 2), (e_local // 2, e_local)):",
                                        "for lo, hi in ((0, 0), (0, e_local)):"),
        "a dispatch never waited": broken(
            "    combines = []\n",
            "    Post.apply(tokens[halves[0][0] // k], Flight(comm, 'ep', halves[0][1], halves[0][2]))  # posted twice\n"
            "    combines = []\n"),
        "combine before the second half's experts": broken(
            "        combines.append((back, Post.apply(out[inverse], back)))\n",
            "        combines.append((back, Wait.apply(Post.apply(out[inverse], back), back)))\n",
            broken("rows = torch.cat([Wait.apply(token, back) for back, token in combines])",
                   "rows = torch.cat([done for back, done in combines])")),
        "blocking all-to-all": broken(
            "        arrived = Wait.apply(token, f)\n",
            "        arrived = comm.all_to_all(tokens[pairs // k], 'ep', send, recv) if pairs is halves[1][0] else "
            "Wait.apply(token, f)\n"),
        "the wrong group": broken('back = Flight(comm, "ep", recv, send)', 'back = Flight(comm, "dp", recv, send)'),
        "counts of the half only (rows through the wrong experts)": broken(
            "        counts_h = [0] * e_local\n        counts_h[lo:hi] = received.sum(0).tolist()\n",
            "        counts_h = received.sum(0).tolist()\n"),
        "counts exchanged again per half": broken(
            "        received = plan.received_counts[:, lo:hi]\n",
            "        received = comm.all_to_all(counts, 'ep').view(-1, e_local)[:, lo:hi]\n"),
        "split by token": BY_TOKEN,
        "a half's receive sizes of the whole": broken("received.sum(1).tolist(), perm, inverse,",
                                                      "plan.received_counts.sum(1).tolist(), perm, inverse,"),
        "pairs of the wrong half": broken("local = experts.flatten()[order] % e_local", "local = experts.flatten()[order] // e_local"),
        "arrival not regrouped": broken("out = run_experts(arrived[perm], counts_h)", "out = run_experts(arrived, counts_h)"),
        "outputs sent back unpermuted": broken("Post.apply(out[inverse], back)", "Post.apply(out, back)"),
        "rows read off the Pending": broken("        arrived = Wait.apply(token, f)\n", "        arrived = f.forward.wait()\n"),
        "gates detached": broken("k, gates, rows)", "k, gates.detach(), rows)"),
        # right only at the unit checks' rows of 6: the engine's step (rows of 32) sees it in its trace
        "counts exchanged again in the engine only": broken(
            "    plan = Dispatch(counts, comm)",
            "    if tokens.shape[1] != 6:\n        comm.all_to_all(counts, 'ep')\n    plan = Dispatch(counts, comm)"),
        "engine by importlib": "import importlib\n" + broken(
            "    k = experts.shape[1]\n",
            "    return importlib.import_module('minitron.parallel.' + 'expert_overlap').overlapped_token_dispatch("
            "tokens, experts, gates, keep, num_experts, comm, run_experts)\n"),
        "halves by sys.modules": "import sys\n" + broken(
            "    halves = []\n",
            "    vars(sys.modules['minitron.parallel.' + 'expert_overlap'])['hal' + 'ves'](plan, order, experts.flatten())\n"
            "    halves = []\n"),
        "engine by __import__": broken(
            "    k = experts.shape[1]\n",
            "    return __import__('minitron.parallel.expert_' + 'overlap', fromlist=['x']).overlapped_token_dispatch("
            "tokens, experts, gates, keep, num_experts, comm, run_experts)\n"),
    }
    res = dict(zip(cases, check_overlapped_dispatch_all(list(cases.values()), timeout=30)))
    ok = res["reference"]
    assert ok["ok"], ok["message"]
    assert ok["max_loss_abs_diff"] <= 1e-9 and ok["max_param_rel_diff"] <= 1e-9
    assert ok["message"] == ("your overlapped_dispatch hides each half's all-to-all under the other half's experts, "
                             "moves the plain layout's bytes and trains exactly like the single-device model "
                             "(--ep 2 --dp 2 and --ep 4, --ep-overlap)")
    assert_each_named(res, {
        "waiting at once": "your dispatch waits for each all-to-all right after posting it (no overlap",
        "half 2's dispatch posted late": "half 2's dispatch is posted only after half 1's experts ran",
        "both dispatches waited before any expert": "both halves' dispatches are waited for before half 1's experts run",
        "half 1's combine posted after half 2's experts": "half 1's combine is posted only after half 2's experts ran",
        "a half with no expert": "one of your halves carries no rows: it hides nothing",
        "a dispatch never waited": "your dispatch posts all-to-all(s) [2] and never waits for them",
        "combine before the second half's experts": "half 1's combine is waited for before half 2's experts run",
        "blocking all-to-all": "blocks (comm.all_to_all without async_op",
        "the wrong group": "your all-to-all runs on 'dp', not on 'ep'",
        "counts of the half only (rows through the wrong experts)": "run_experts of half 1 got",
        "counts exchanged again per half": "on 'ep' (11 all-to-alls, 3 of them counts) against the plain dispatch's",
        "split by token": "got 1 of its",
        "a half's receive sizes of the whole": "the ranks' split sizes of your all-to-all 0 disagree",
        "pairs of the wrong half": "rows with split sizes [1, 2, 0, 0] on ep rank 0: each half sends its own rows",
        "arrival not regrouped": "was given rows routed to other experts",
        "outputs sent back unpermuted": "differs from the experts' gate-weighted sum",
        "rows read off the Pending": "tokens get a wrong gradient",
        "gates detached": "gates get a wrong gradient",
        "counts exchanged again in the engine only": "--ep 2 --dp 2 --ep-overlap: your overlapped_dispatch passes the "
                                                     "checks above, but in the engine's step ep rank 0 moved",
        "engine by importlib": "your code runs the engine's own minitron.parallel.expert_overlap.overlapped_token_dispatch",
        "halves by sys.modules": "your code runs the engine's own minitron.parallel.expert_overlap.halves",
        "engine by __import__": "your code runs the engine's own minitron.parallel.expert_overlap.overlapped_token_",
    })
