"""V-shaped pipelines: the placement (rank r holds stages r and 2p-1-r), ZB-V and DualPipe-V
as data (validated, simulated against the published formulas, drawn), their one-line
refusals, and on real ranks: equal to one device in float64 (pp4, dp2 x pp2, tp2 x pp2 in one
launch), checkpoints moving between the V and the loop placement, the measured timeline; and
in one launch of 16, on every tensor-parallel mode (1-D with sp, dp and ep, 2-D with dp,
2.5-D, the cube), a traced step equal to the analysis on every rank and to one device."""
import json

import pytest

from minitron import config as C
from minitron.analysis.bubble import bubble_fraction, stashed_on_rank, v_bubble
from minitron.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from minitron.analysis.pipeline_sim import simulate
from minitron.parallel.schedule_actions import KINDS, Action, ScheduleError
from minitron.parallel.schedule_check import validate
from minitron.parallel.schedules import make_schedule
from minitron import placement as P
from minitron.placement import Placement, placement_for
from minitron.tools.testing import routed_all_to_all_bytes, run_on_ranks

V = ("zb-v", "dualpipe-v")


def bubble(sim):
    """Idle time of the busiest rank (PTD-P's t_pb)."""
    return sim.makespan - max(sim.busy)


# --- placement ------------------------------------------------------------------------------
def test_placement_v_and_loop():
    v = Placement("v", 4, 2)
    assert v.table() == ((0, 7), (1, 6), (2, 5), (3, 4))
    loop = Placement("loop", 4, 2)
    assert loop.table() == ((0, 4), (1, 5), (2, 6), (3, 7))
    for pl in (v, loop, Placement("loop", 3, 3)):
        assert sorted(s for row in pl.table() for s in row) == list(range(pl.num_stages))
        for r in range(pl.p):
            for c in range(pl.v):
                assert pl.locate(pl.stage(r, c)) == (r, c)
                if pl.kind == "loop":  # Megatron's interleaving, PTD-P §2.2.2
                    assert pl.stage(r, c) == c * pl.p + r
                first, last = pl.chunk_ends(r, c)
                assert (first, last) == (pl.stage(r, c) == 0, pl.stage(r, c) == pl.num_stages - 1)
            assert pl.holds_ends(r) == (r == 0, r == (0 if pl.kind == "v" else pl.p - 1))
    assert (v.first_rank, v.last_rank, v.end_ranks()) == (0, 0, [0])
    assert (loop.first_rank, loop.last_rank, loop.end_ranks()) == (0, 3, [0, 3])
    assert placement_for("zb-v", 4, 2) == v and placement_for("interleaved", 4, 2) == loop
    assert placement_for("zb-v", 1, 2) == Placement("loop", 1, 2)  # one rank: its chunks in order
    assert Placement is P.Placement and P.placement_of(ParallelConfig(pp=4, vpp=2, schedule="zb-v")) == v
    with pytest.raises(ValueError, match="two chunks per rank"):
        Placement("v", 4, 3)


def test_v_schedules_have_no_message_at_the_turn_and_the_loss_on_rank_0():
    for kind in V:
        s = make_schedule(kind, 4, 2, 8)
        assert s.is_first(0, 0) and s.is_last(0, 1)
        # rank 3 hands stage 3's output to stage 4 in memory: it sends nothing to itself,
        # and nothing of chunk 0 forward (or chunk 1 backward) leaves it
        assert not [a for a in s.actions[3] if a.peer == 3]
        assert not [a for a in s.actions[3] if a.op in ("send_fwd", "recv_bwd") and a.chunk == 0]
        sends = [a for row in s.actions for a in row if a.op == "send_fwd"]
        assert len(sends) == s.m * (2 * s.p - 2)  # 2p - 1 boundaries, one of them local


# --- the property test: every schedule, p <= 8, m <= 24 ------------------------------------------
def test_every_schedule_validates_for_p_up_to_8_and_m_up_to_24():
    """validate proves dependencies, FIFO matching and no deadlock (blocking and eager), for
    every kind on every p <= 8, with m at the schedule's minimum and just above it, around
    2p (2p-1, 2p, 2p+1), 3p and 24 (test_schedules.py covers the older kinds in depth)."""
    count = 0
    for p in range(1, 9):
        for kind in KINDS:
            vs = (2,) if kind in V else (2, 3) if kind == "interleaved" else (1,)
            if kind in V + ("interleaved",) and p < 2:
                continue
            least = C.min_microbatches(kind, p)
            ms = sorted({m for m in (least, least + 1, 2 * p - 1, 2 * p, 2 * p + 1, 3 * p, 24) if least <= m <= 24})
            for v in vs:
                for m in ms:
                    validate(make_schedule(kind, p, v, m))
                    count += 1
    assert count > 200


# --- the published formulas (DeepSeek-V3's table; Qi et al.) -----------------------------------
@pytest.mark.parametrize("p", [4, 8, 16])
def test_simulator_reproduces_the_published_bubbles(p):
    """With chunk times F, B (input gradient), W: 1F1B (PP-1)(F+B) with B its full backward,
    ZB1P = zb-h1 (PP-1)(F+B-2W), DualPipe-V (PP/2-1)(F&B+B-3W) with PP = 2p stages and the
    F&B pair run one after the other (as the CPU runs it), under F = B = W."""
    for F, Bi, W in ((1, 1, 1), (0.5, 0.5, 0.5), (1, 2, 1), (2, 1.5, 1)):
        one = simulate(make_schedule("1f1b", p, m=2 * p), {"F": F, "B": Bi + W})
        assert bubble(one) == pytest.approx((p - 1) * (F + Bi + W), rel=1e-12)
        zb1p = simulate(make_schedule("zb-h1", p, m=2 * p), {"F": F, "B": Bi, "W": W})
        assert bubble(zb1p) == pytest.approx((p - 1) * (F + (Bi + W) - 2 * W), rel=1e-12)
    for c in (1.0, 0.7)[:2 if p < 16 else 1]:  # (p = 16: the fewest cases, for time)
        costs = {"F": c, "B": c, "W": c}
        for m in (2 * p, 2 * p + 1, 3 * p)[:3 if p < 16 else 1]:
            dual = simulate(make_schedule("dualpipe-v", p, 2, m), costs)
            published = (2 * p / 2 - 1) * ((c + 2 * c) + 2 * c - 3 * c)
            assert bubble(dual) == pytest.approx(published, rel=1e-12)
            assert dual.idle == pytest.approx((published,) * p, rel=1e-12)  # every rank
            assert bubble(dual) == pytest.approx(v_bubble("dualpipe-v", p, 2 * c, 2 * c, 2 * c), rel=1e-12)
            # an overlapped pair shorter than F + B + W: the simulator prices it, never
            # idling longer than the published bubble (equal when the pair is not shortened)
            for fb in (2 * c, 2.5 * c):
                over = simulate(make_schedule("dualpipe-v", p, 2, m), {**costs, "F&B": fb})
                assert bubble(over) <= (p - 1) * (fb + 2 * c - 3 * c) + 1e-9
                assert bubble(over) < bubble(dual)


@pytest.mark.parametrize("p", [4, 8, 16])
def test_zb_v_bubble_is_near_zero_with_1f1b_memory(p):
    """F = B = W: ZB-V idles only for the fill, p-1 chunk-forwards, on every rank: a sixth of
    1F1B's (p-1)(F+B) at the same per-rank layers, and holds 2p chunk-microbatches (p stages,
    1F1B's stash). The closed forms of analysis.bubble say the same."""
    for c in (1.0, 0.5)[:2 if p < 16 else 1]:
        for m in (2 * p - 1, 2 * p, 3 * p)[:3 if p < 16 else 2]:
            zbv = simulate(make_schedule("zb-v", p, 2, m), {"F": c, "B": c, "W": c})
            assert zbv.idle == pytest.approx(((p - 1) * c,) * p, rel=1e-12)
            one = simulate(make_schedule("1f1b", p, m=m), {"F": 2 * c, "B": 4 * c})  # a stage = 2 chunks
            assert bubble(zbv) == pytest.approx(bubble(one) / 6, rel=1e-12)
            assert bubble(zbv) == pytest.approx(v_bubble("zb-v", p, 2 * c, 2 * c, 2 * c), rel=1e-12)
            assert zbv.bubble_fraction == pytest.approx(
                bubble_fraction("zb-v", p, m, 2, 2 * c, 2 * c, 2 * c), rel=1e-12)
            assert max(zbv.peak_stashed) == 2 * p == 2 * max(one.peak_stashed)


def test_memory_per_rank_matches_the_published_table():
    """DeepSeek-V3's table with PP stages: parameters per rank 1x (1F1B, ZB1P on PP ranks),
    2x (DualPipe-V on PP/2 ranks: two stages each); activations PP, PP, PP+1 (in stages of
    1/PP of the model). Parameters from the engine's own placement and stage split."""
    for p in (4, 8):
        PP = 2 * p
        model = ModelConfig(layers=4 * PP)
        layers_1f1b = P.stage_layers(model, ParallelConfig(pp=PP))
        layers_v = P.stage_layers(model, ParallelConfig(pp=p, vpp=2, schedule="dualpipe-v"))
        pl = placement_for("dualpipe-v", p, 2)
        per_rank_v = [sum(len(layers_v[s]) for s in pl.table()[r]) for r in range(p)]
        assert set(per_rank_v) == {2 * len(layers_1f1b[0])}  # 2x
        m = 2 * PP
        assert max(simulate(make_schedule("1f1b", PP, m=m)).peak_stashed) == PP
        assert max(simulate(make_schedule("zb-h1", PP, m=m)).peak_stashed) == PP
        dual = simulate(make_schedule("dualpipe-v", p, 2, m))
        assert dual.peak_stashed == (PP + 1,) * p  # on every rank


def test_closed_form_stash_equals_the_simulator():
    for p in range(2, 7):
        for kind in V:
            for m in range(C.min_microbatches(kind, p), 2 * p + 2):
                sim = simulate(make_schedule(kind, p, 2, m))
                assert tuple(stashed_on_rank(kind, p, m, 2, r) * 2 for r in range(p)) == sim.peak_stashed


def test_dualpipe_v_pairs_are_overlapped_units():
    s = make_schedule("dualpipe-v", 4, 2, 10)
    for r in range(4):
        row = s.actions[r]
        for f, b in s.overlapped[r]:
            i = row.index(f)  # F, then its partner's B and W, with no message in between
            assert row[i + 1] == b and row[i + 2] == Action("W", b.mb, b.chunk) and f.chunk != b.chunk
    assert sum(len(x) for x in s.overlapped) > 0
    # priced as one block of F&B
    sim = simulate(s, {"F": 1, "B": 1, "W": 1, "F&B": 2})
    f, b = s.overlapped[0][0]
    spans = {a: (t0, t1) for a, t0, t1 in sim.timeline[0]}
    assert spans[Action("W", b.mb, b.chunk)][1] - spans[f][0] == pytest.approx(2)


# --- refusals: one line, before any rank starts ----------------------------------------------------
@pytest.mark.parametrize("args, words", [
    (("zb-v", 4, 1, 8), "use v=2"), (("zb-v", 4, 3, 8), "use v=2"), (("dualpipe-v", 1, 2, 8), "p >= 2"),
    (("zb-v", 4, 2, 3), "at least 4 microbatches"), (("dualpipe-v", 4, 2, 7), "at least 8 microbatches"),
])
def test_bad_v_schedules_are_one_line(args, words):
    with pytest.raises(ValueError, match=words) as err:
        make_schedule(*args)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("layout, m, tied, words", [
    (dict(pp=2, vpp=3, schedule="zb-v"), 4, False, "use --vpp 2"),
    (dict(pp=2, vpp=1, schedule="dualpipe-v"), 4, False, "use --vpp 2"),
    (dict(pp=2, vpp=2, schedule="dualpipe-v"), 3, False, "at least 4"),
    (dict(pp=4, vpp=2, schedule="zb-v"), 3, False, "at least 4"),
    (dict(pp=2, vpp=2, schedule="zb-v"), 2, True, "drop --tied"),
    (dict(pp=2, vpp=2, schedule="zb-v", zero=3, dp=2), 2, False, "use 1f1b or --zero 2"),
])
def test_bad_v_layouts_are_one_config_error(layout, m, tied, words):
    model = ModelConfig(layers=12, hidden=16, heads=2, seq_len=16, vocab=256, tied_embeddings=tied)
    lay = ParallelConfig(**layout)
    with pytest.raises(ConfigError, match=words) as err:
        C.validate(model, lay, TrainConfig(microbatches=m, global_batch=m * lay.dp), world=lay.world)
        if lay.zero:
            C.validate_zero(model, lay)
    assert "\n" not in str(err.value)


def test_placement_and_v_timeline_draw():
    from matplotlib.figure import Figure

    from minitron.viz.pipeline import plot_placement, plot_timeline
    ax = plot_placement(Placement("v", 4, 2), ax=Figure().add_subplot())
    assert [t.get_text() for t in ax.texts] == [f"stage {s}" for row in ((0, 7), (1, 6), (2, 5), (3, 4)) for s in row]
    sim = simulate(make_schedule("dualpipe-v", 4, 2, 8))
    ax = plot_timeline(sim, ax=Figure().add_subplot())
    assert len(ax.patches) == sum(len(row) for row in sim.timeline)


# --- on real ranks: one launch of 4 -------------------------------------------------------------
def _cases():
    eight = ModelConfig(layers=8, hidden=16, heads=2, seq_len=16, vocab=256)
    four = eight.replace(layers=4)
    out = [(eight, ParallelConfig(pp=4, vpp=2, schedule=k), m)
           for k, ms in (("zb-v", (4, 8, 9)), ("dualpipe-v", (8, 9))) for m in ms]
    for comp in (dict(dp=2), dict(tp=2)):
        out += [(four, ParallelConfig(pp=2, vpp=2, schedule=k, **comp), m)
                for k, ms in (("zb-v", (2, 4, 5)), ("dualpipe-v", (4, 5))) for m in ms]
    return out


def _checkpoint_job(comm, ckpt_root):
    """A checkpoint written under the V resumes under the loop, and the reverse: the loss
    of the step after the resume equals an uninterrupted run under the resuming layout."""
    from test_pipeline import _sub_comm

    from minitron import checkpoint as ckpt
    from minitron import data as data_mod
    from minitron.train import Trainer

    model = ModelConfig(layers=4, hidden=16, heads=2, seq_len=16, vocab=256)
    corpus = data_mod.load_corpus("")
    t = TrainConfig(steps=3, global_batch=8, microbatches=4, dtype="float64", lr=1e-2, warmup=1,
                    eval_every=0, progress=False)
    v = ParallelConfig(dp=2, pp=2, vpp=2, schedule="zb-v")
    loop = ParallelConfig(dp=2, pp=2, vpp=2, schedule="interleaved")
    out = []
    for i, (first, then) in enumerate(((v, loop), (loop, v))):
        d = f"{ckpt_root}/{i}"
        a = Trainer(model, first, t, _sub_comm(comm, first), corpus)
        for s in range(2):
            a.step(s)
        ckpt.save(d, 2, a)
        b = Trainer(model, then, t, _sub_comm(comm, then), corpus)
        assert ckpt.load_latest(d, b) == 2
        resumed = float(b.step(2))
        ref = Trainer(model, then, t, _sub_comm(comm, then), corpus)
        uninterrupted = [float(ref.step(s)) for s in range(3)][-1]
        out.append((first.schedule, then.schedule, resumed, uninterrupted))
    return out


def _v_job(comm, cases, steps, timeline_path, ckpt_root):
    from test_pipeline import _parity_job
    return {"parity": _parity_job(comm, cases, steps, timeline_path),
            "ckpt": _checkpoint_job(comm, ckpt_root)}


@pytest.mark.multirank
def test_v_schedules_equal_one_device_and_move_checkpoints(tmp_path):
    """One launch of 4 ranks: ZB-V and DualPipe-V on pp4, dp2 x pp2 and tp2 x pp2 with
    m in {p, 2p, 2p+1} where allowed, each against one device in float64 (1e-9), with its
    p2p trace (2p-2 boundaries between ranks) and posting order; the measured timeline of
    the first case follows the schedule; checkpoints move between the V and the loop."""
    from test_pipeline import _check_parity_and_trace
    path = str(tmp_path / "timeline.jsonl")
    out = run_on_ranks(_v_job, ParallelConfig(pp=4), _cases(), 2, path, str(tmp_path / "ckpt"))
    _check_parity_and_trace({r: res["parity"] for r, res in out.items()})
    assert len(out[0]["parity"]) == len(_cases())
    _check_timeline_v(path, p=4, m=4, kind="zb-v")
    for first, then, resumed, uninterrupted in out[0]["ckpt"]:
        assert abs(resumed - uninterrupted) <= 1e-9, (first, then, resumed, uninterrupted)


def _check_timeline_v(path, p, m, kind):
    """Every rank's measured F/B/W order is the schedule's, and a forward starts after the
    forward of the previous stage (wherever the placement puts it) ended."""
    recs = [json.loads(line) for line in open(path)]
    s = make_schedule(kind, p, 2, m)
    for r in range(p):
        for step in (0, 1):
            mine = [x for x in recs if x["rank"] == r and x["step"] == step]
            assert [(x["op"], x["mb"], x["chunk"]) for x in mine] == \
                [(a.op, a.mb, a.chunk) for a in s.compute_actions(r)]
    f = {(s.stage(x["rank"], x["chunk"]), x["mb"], x["step"]): x for x in recs if x["op"] == "F"}
    for (stage, mb, step), x in f.items():
        if stage > 0:
            assert x["start"] >= f[(stage - 1, mb, step)]["end"] - 1e-3


def _plain_pp2_job(comm, cases, steps):
    from test_pipeline import _parity_job
    return _parity_job(comm, cases, steps, "")


@pytest.mark.multirank
def test_v_schedules_on_plain_pp2_equal_one_device():
    """ZB-V and DualPipe-V on two ranks with nothing else (no dp, no tp), m in {p, 2p, 2p+1}
    where allowed: each against one device in float64 (1e-9), with its p2p trace and posting
    order (one launch of 2 ranks)."""
    from test_pipeline import _check_parity_and_trace
    four = ModelConfig(layers=4, hidden=16, heads=2, seq_len=16, vocab=256)
    cases = [(four, ParallelConfig(pp=2, vpp=2, schedule=k), m)
             for k, ms in (("zb-v", (2, 4, 5)), ("dualpipe-v", (4, 5))) for m in ms]
    out = run_on_ranks(_plain_pp2_job, ParallelConfig(pp=2), cases, 2)
    _check_parity_and_trace(out)
    assert len(out[0]) == len(cases)



# --- the V on every tensor-parallel mode: traced = analysis, and one device ----------------------
V_MODEL = ModelConfig(layers=4, hidden=16, heads=2, seq_len=16, vocab=256)
# every other block a mixture of experts: under the V rank 0 holds layers 0 and 3, rank 1
# layers 1 and 2 (one MoE block each), where the loop would put both on rank 1
V_MOE = V_MODEL.replace(experts=4, top_k=2, moe_every=2)
V_MODES = {"1d.sp.dp2.ep2": dict(tp=2, sp=True, dp=2, ep=2), "2d.dp2": dict(tp=4, tp_mode="2d", dp=2),
           "2.5d": dict(tp=8, tp_mode="2.5d", tp_depth=2), "cube": dict(tp=8, tp_mode="3d")}


def _v_train(layout: ParallelConfig) -> TrainConfig:
    """One float64 step of the schedule's fewest microbatches (zb-v 2, dualpipe-v 4 on pp2)
    of 4 sequences on each data replica (the 2.5-D grid and the cube split a microbatch over
    q*d = q^2 = 4 ranks)."""
    m = C.min_microbatches(layout.schedule, layout.pp)
    return TrainConfig(steps=1, global_batch=4 * m * layout.data_replicas, microbatches=m, dtype="float64", lr=1e-2,
                       warmup=1, eval_every=0, progress=False)


def _v_model(layout: ParallelConfig) -> ModelConfig:
    return V_MOE if layout.ep > 1 else V_MODEL


def _v_modes_job(comm, cases):
    """On each of 16 ranks, per layout: one float64 step traced, this rank's bytes per axis
    and op outside the 'log' phase (the loss and the routing statistics), its coordinates
    and routing counts per MoE call, and (rank 0) the run against one device."""
    from minitron.analysis.calls import bytes_by_axis
    from minitron.comm import Comm, CommTrace
    from minitron.data import load_corpus
    from minitron.grid import ProcessGrid
    from minitron.tools.verify import versus_one_device
    from minitron.train import Trainer

    corpus, out = load_corpus(""), []
    for layout in cases:
        grid = ProcessGrid.for_layout(layout, comm.grid.rank).build_groups()
        c, model, train = Comm(grid, CommTrace()), _v_model(layout), _v_train(layout)
        tr = Trainer(model, layout, train, c, corpus)
        losses = [tr.step(0)]
        got = bytes_by_axis([r for r in c.trace.select(step=0) if r["phase"] != "log"])
        one = train.replace(microbatches=train.microbatches * layout.data_replicas)  # the whole batch on one device
        res = versus_one_device(c, tr, losses, model, one)
        out.append({"layout": layout.describe(), "got": got, "coord": vars(grid.coord()), "one_device": res,
                    "calls": [d[0] for m in tr.moe for d in m.dispatches]})
    return out


def _v_want(layout: ParallelConfig, ranks: list, r: dict) -> dict:
    """The analysis's bytes for rank `r` of `ranks` (its pipeline rank's, zeros dropped); the
    expert all-to-all from the step's own routing counts of its ep group (routing is data)."""
    from minitron.analysis.comm import comm_bytes_per_step

    model = _v_model(layout)
    want = comm_bytes_per_step(model, layout, _v_train(layout), r["coord"]["pp"])
    if layout.ep > 1:
        want["ep"]["all_to_all"] = routed_all_to_all_bytes(ranks, r, model, 8)
    want = {a: {op: nb for op, nb in ops.items() if nb} for a, ops in want.items()}
    return {a: ops for a, ops in want.items() if ops}


@pytest.mark.multirank
def test_v_on_every_tensor_mode_traced_equals_analysis():
    """ZB-V and DualPipe-V (pp2, the head on rank 0 beside the embedding) on 1-D tensor
    parallelism with sp, dp and ep (a mixture of experts), on the 2-D grid with dp, the
    2.5-D grid (q = 2, d = 2) and the cube (q = 2), in one launch of 16 ranks: on every
    rank the traced step's bytes per axis and operation equal the analysis's exactly (the
    expert all-to-all from its routing counts), and the run equals one device in float64
    (1e-9), as ``minitron verify --dtype float64`` judges it."""
    cases = [ParallelConfig(pp=2, vpp=2, schedule=k, **kw) for kw in V_MODES.values() for k in V]
    for c in cases:
        C.validate(_v_model(c), c, _v_train(c), world=16)
    out = run_on_ranks(_v_modes_job, ParallelConfig(pp=2, tp=8), cases)
    bad = []
    for i, layout in enumerate(cases):
        ranks = [out[r][i] for r in sorted(out)]
        assert layout.ep == 1 or all(r["calls"] for r in ranks)  # every rank routed (one MoE block each)
        bad += [(r["layout"], rank, json.dumps(r["got"]), json.dumps(want)) for rank, r in enumerate(ranks)
                if r["got"] != (want := _v_want(layout, ranks, r))]
        one = out[0][i]["one_device"]
        assert one["max_loss_abs_diff"] <= 1e-9 and one["max_param_rel_diff"] <= 1e-9, (layout.describe(), one)
    assert not bad, (len(bad), bad[:2])
