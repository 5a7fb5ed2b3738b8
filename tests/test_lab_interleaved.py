"""Lab 02b's checker (minitron.labs.interleaved) fails each plausible mistake in the
interleaved 1F1B schedule with its own line, before any rank starts; the reference
passes every static check and, on 2 gloo ranks with 2 chunks each, trains like one device."""
import pytest

from minitron.labs import check_interleaved

INTERLEAVED = '''
def interleaved_1f1b(p, v, m, rank):
    rounds = max(m // p, 1)
    q, extra = divmod(m, rounds)
    groups = [q + 1] * extra + [q] * (rounds - extra)
    order, start = [], 0
    for g in groups:
        order += [(start + i, c) for c in range(v) for i in range(g)]
        start += g
    fwd = [Action("F", k, c) for k, c in order]
    bwd = [Action("B", k, v - 1 - c) for k, c in order]
    if v == 1:
        warmup = min(p - rank - 1, m)
    else:
        warmup = min((p - rank - 1) * 2 + (v - 1) * groups[0], m * v)
    n = len(fwd)
    acts = fwd[:warmup]
    for i in range(n - warmup):
        acts += [fwd[warmup + i], bwd[i]]
    return acts + bwd[n - warmup:]
'''

ZB_H1 = '''
def zb_h1(p, m, rank):
    warmup = min(p - rank - 1, m)
    acts, w = [Action("F", k) for k in range(warmup)], 0
    for k in range(m - warmup):
        acts += [Action("F", warmup + k), Action("B", k)]
        if k >= rank:
            acts.append(Action("W", k - rank))
            w += 1
    for k in range(m - warmup, m):
        acts.append(Action("B", k))
        if k >= rank:
            acts.append(Action("W", k - rank))
            w += 1
    return acts + [Action("W", k) for k in range(w, m)]
'''

V_STAGE = '''
def v_stage(p, rank, chunk):
    return rank if chunk == 0 else 2 * p - 1 - rank
'''

WARMUP = "* groups[0], m * v)"
V = "rank if chunk == 0 else 2 * p - 1 - rank"
MISTAKES = {  # name: (source, words the one-line message must contain)
    "warm-up one too many": (INTERLEAVED.replace(WARMUP, "* groups[0] + 1, m * v)"), "one forward too many"),
    "warm-up one too few": (INTERLEAVED.replace(WARMUP, "* groups[0] - 1, m * v)"), "one forward too few"),
    "backward chunks not mirrored": (INTERLEAVED.replace('Action("B", k, v - 1 - c)', 'Action("B", k, c)'),
                                     "mirrored order"),
    "forward chunks in the wrong order": (INTERLEAVED.replace("v - 1 - c)", "c)").replace(
        'Action("F", k, c)', 'Action("F", k, v - 1 - c)'), "forwards go up the chunks"),
    "a backward missing": (INTERLEAVED.replace("bwd[n - warmup:]", "bwd[n - warmup:-1]"), "never runs B"),
    "v = 1 logic for v = 2": (INTERLEAVED.replace("if v == 1:", "if True:"), "plain 1F1B's warm-up"),
    "microbatch by microbatch": (INTERLEAVED.replace("for c in range(v) for i in range(g)",
                                                     "for i in range(g) for c in range(v)"), "cannot run"),
    # what the old checker (p <= 4, v <= 3) let through
    "warm-up capped for small pipelines": (INTERLEAVED.replace(WARMUP, "* groups[0], m * v, 16)"),
                                           "p=8, v=2, m=16: rank 0 runs 17 forwards before its first backward, "
                                           "6 forwards too few"),
    "zb-h1 without deferred W": (INTERLEAVED + ZB_H1.replace("if k >= rank:", "if True:").replace(
        "k - rank", "k").replace("range(w, m)", "range(m, m)"), "your zb_h1"),
    # right on the run's m = 4 and the notebook's m = 8, multiples of p: caught where p does not divide m
    "warm-up right only when p divides m": (INTERLEAVED.replace(WARMUP, "* p, m * v)"),
                                            "right only when p divides m"),
    # the stretch: the V placement
    "loop placement where the V is wanted": (INTERLEAVED + V_STAGE.replace(V, "chunk * p + rank"),
                                             "the loop placement of interleaving"),
    "V chunks swapped": (INTERLEAVED + V_STAGE.replace(V, "2 * p - 1 - rank if chunk == 0 else rank"),
                         "chunks swapped"),
    "2p - r": (INTERLEAVED + V_STAGE.replace("2 * p - 1 - rank", "2 * p - rank"), "one too high (an off-by-one"),
    "2p - 2 - r": (INTERLEAVED + V_STAGE.replace("2 * p - 1 - rank", "2 * p - 2 - rank"),
                   "one too low (an off-by-one"),
    "V hard-wired to p = 2": (INTERLEAVED + V_STAGE.replace("2 * p - 1 - rank", "3 - rank"),
                              "chunk 1 holds 3 - r, the V of p = 2 hard-wired"),
    "V upside down": (INTERLEAVED + V_STAGE.replace(V, "p - 1 - rank if chunk == 0 else p + rank"), "upside down"),
    "V written for 2 ranks": (INTERLEAVED + V_STAGE.replace(V, "[[0, 3], [1, 2]][rank % 2][chunk]"),
                              "p=3: ranks hold [(0, 3), (1, 2), (0, 3)], stage 0 is held 2 times"),
}


@pytest.mark.parametrize("name", MISTAKES)
def test_each_mistake_gets_its_own_line_before_any_rank_starts(name):
    source, words = MISTAKES[name]
    res = check_interleaved(source)
    assert not res["ok"]
    assert "\n" not in res["message"] and words in res["message"], res["message"]
    others = [w for n, (_, w) in MISTAKES.items() if n != name and w != words]
    assert not any(w in res["message"] for w in others), res["message"]


def test_stub_and_syntax_error_name_the_problem():
    stub = 'def interleaved_1f1b(p, v, m, rank):\n    raise NotImplementedError  # your code here\n'
    res = check_interleaved(stub)
    assert res == {"ok": False, "message": "interleaved_1f1b is not written yet (still `raise NotImplementedError`): "
                                           "fill in the `# your code here` lines in SOURCE"}
    res = check_interleaved("def interleaved_1f1b(p, v, m, rank)\n    return []\n")
    assert not res["ok"] and "does not compile" in res["message"], res


def test_the_engines_own_schedule_is_refused():
    """By the screen when imported by name, and when it runs, whatever the route to it."""
    res = check_interleaved("from minitron.parallel.schedules import make_schedule\n" + INTERLEAVED)
    assert res["message"].startswith("your code uses the engine's own minitron.parallel.schedules.make_schedule "
                                     "(line 1)")
    body = ("def interleaved_1f1b(p, v, m, rank):\n    S = {module}\n"
            "    return [a for a in S.make_schedule('interleaved', p, v, m).actions[rank] if a.op in 'FB']\n")
    for how, module in (("importlib", "importlib.import_module('minitron.parallel' + '.schedules')"),
                        ("sys.modules", "sys.modules['minitron.parallel.' + 'schedules']"),
                        ("__import__", "__import__('minitron.parallel.' + 'schedules', fromlist=['x'])")):
        res = check_interleaved("import importlib, sys\n" + body.format(module=module))
        assert res["message"].startswith("your code runs the engine's own minitron.parallel.schedules.make_schedule "
                                         "(from line 4 of your code"), (how, res["message"])


def test_the_engines_own_placement_is_refused():
    """The V placement's stretch: the engine's Placement (and placement_for) by the screen, and
    when it runs, by three routes."""
    res = check_interleaved(INTERLEAVED + "from minitron.parallel.schedules import Placement\n" + V_STAGE)
    assert res["message"].startswith("your code uses the engine's own minitron.parallel.schedules.Placement"), res
    body = "def v_stage(p, rank, chunk):\n    return {module}.{call}.stage(rank, chunk)\n"
    for how, module in (("importlib", "importlib.import_module('minitron.parallel' + '.schedules')"),
                        ("sys.modules", "sys.modules['minitron.parallel.' + 'schedules']"),
                        ("__import__", "__import__('minitron.parallel.' + 'schedules', fromlist=['x'])")):
        for call, piece in (("Placement('v', p, 2)", "Placement"), ("placement_for('zb-v', p, 2)", "placement_for")):
            res = check_interleaved("import importlib, sys\n" + INTERLEAVED + body.format(module=module, call=call))
            assert res["message"].startswith(f"your code runs the engine's own minitron.parallel.schedules.{piece} "
                                             "(from line 23 of your code"), (how, res["message"])


@pytest.mark.multirank
def test_reference_passes_with_the_stretch_parts():
    """Both stretch parts graded; the V placement's ZB-V trains in the same launch of ranks."""
    res = check_interleaved(INTERLEAVED + ZB_H1 + V_STAGE)
    assert res["ok"], res["message"]
    assert res["bubble_fraction"] == pytest.approx(3 / 16) and res["zb_h1"] == "passed"
    assert res["messages"] > res["messages_1f1b"]
    assert res["v_placement"] == "passed" and "the V placement passed" in res["message"]
    # ZB-V on the learner's placement idles Qi et al.'s (p-1)*T_F/2 per rank, T_F = 2 (F = 1 a chunk)
    assert res["zb_v"]["idle"] == [3.0] * 4 and res["zb_v"]["idle_formula"] == 3.0


def test_zb_v_runs_on_the_learners_placement():
    """The run's ZB-V reads the learner's table (not the engine's Placement) and, being the V,
    places the engine's messages: none at the V's turn on rank p-1."""
    from minitron.labs.interleaved import YourPlacement, _v_check
    from minitron.parallel.schedules import make_schedule

    problem, numbers, run = _v_check(lambda p, rank, chunk: rank if chunk == 0 else 2 * p - 1 - rank)
    assert problem == "" and numbers["p"] == 4
    assert isinstance(run.placement, YourPlacement) and run.placement.table() == ((0, 3), (1, 2))
    assert run.actions == make_schedule("zb-v", 2, 2, 4).actions
