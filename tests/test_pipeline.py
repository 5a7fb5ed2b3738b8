"""The pipeline runtime (minitron/parallel/pipeline.py): every schedule equals one device
(float64, tight), the p2p trace matches b·s·h per microbatch per boundary per direction
(b·s·h/t with --scatter-gather), the measured timeline follows the schedule, bad input is
one line. Multi-rank checks are grouped: one 2-rank and one 4-rank launch build many
Trainers (starting ranks is the expensive part on a small machine).
"""
import json
from collections import Counter

import pytest
import torch

from minitron import data as data_mod
from minitron.config import V_SCHEDULES, ModelConfig, ParallelConfig, TrainConfig, min_microbatches
from minitron.context import Context
from minitron.model import GPT
from minitron.parallel.schedule_actions import KINDS, Schedule
from minitron.parallel.schedule_check import execute
from minitron.parallel.schedules import make_schedule
from minitron.parallel.pipeline import backward_input, forward_only_actions
from minitron.placement import placement_for
from minitron.tools.testing import run_cli, run_on_ranks

TOL = 1e-9  # float64: losses absolute, parameters relative (never loosen: find the bug)


# --- pure parts --------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_forward_only_schedule_never_deadlocks(kind):
    """Evaluation runs the training schedule with the backward half removed: still matched
    FIFO messages and no deadlock, with blocking or eager sends."""
    for p in (2, 3, 4):
        least = min_microbatches(kind, p)
        for m in (1, p, 2 * p + 1) if least == 1 else (least, 2 * p, 3 * p):
            for v in ((2, 3) if kind == "interleaved" else (2,) if kind in V_SCHEDULES else (1,)):
                s = make_schedule(kind, p, v, m)
                fwd = Schedule(kind, p, v, m, forward_only_actions(s))
                for eager in (False, True):
                    timeline = execute(fwd, lambda r, a: 1.0, eager)
                    assert Counter(a.op for _, a, _, _ in timeline) == {"F": p * v * m}


def _stage_grads(stage, x, y, split: bool):
    for p in stage.parameters():
        p.grad = None
    fired = Counter()
    hooks = [p.register_post_accumulate_grad_hook(lambda p: fired.update([id(p)])) for p in stage.parameters()]
    x = x.detach().requires_grad_()
    loss = stage(x, y)
    if split:
        edge = torch.autograd.graph.get_gradient_edge(loss)
        dx, weight_grads = backward_input(edge, torch.ones_like(loss), x)
        assert all(p.grad is None for p in stage.parameters())  # B computed no weight gradient
        weight_grads()
    else:
        loss.backward()
        dx = x.grad
    for h in hooks:
        h.remove()
    return dx, {n: p.grad.clone() for n, p in stage.named_parameters()}, fired


@pytest.mark.parametrize("tied", [False, True])
def test_split_backward_equals_backward(tied):
    """zb-h1's B (input gradient only) then W (weight gradients) give exactly the gradients
    of one backward, and every parameter's accumulate hook fires once (data-parallel
    buckets count on it). `tied`: the last stage also holds the embedding and uses it twice."""
    torch.manual_seed(0)
    cfg = ModelConfig(layers=3, hidden=16, heads=2, seq_len=8, vocab=64, tied_embeddings=tied)
    stage = GPT(cfg, Context(dtype=torch.float64), [1, 2], first=False, last=True)
    if tied:  # use the head weight a second time on the input path: one group, two frontier nodes
        stage.blocks["1"].register_forward_pre_hook(
            lambda mod, args: (args[0] + 0.1 * stage.lm_head.weight[:8].unsqueeze(0),))
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    y = torch.randint(0, 64, (2, 8))
    dx_ref, ref, _ = _stage_grads(stage, x, y, split=False)
    dx, got, fired = _stage_grads(stage, x, y, split=True)
    assert torch.equal(dx, dx_ref)
    for n in ref:
        assert torch.allclose(got[n], ref[n], rtol=1e-12, atol=1e-15), n
    assert set(fired.values()) == {1} and len(fired) == len(ref)


@pytest.mark.parametrize("argv,words", [
    (["--schedule", "interleaved", "--vpp", "2", "--layers", "4", "--microbatches", "1"], "of at least --pp 2"),
    (["--schedule", "interleaved", "--vpp", "2", "--microbatches", "2"], "pp*vpp = 4 model chunks but only 2 layers"),
    (["--layers", "4", "--stage-layers", "1,2", "--microbatches", "2"], "must be positive and sum to 4"),
    (["--schedule", "zigzag"], "unknown schedule 'zigzag'"),
    (["--schedule", "zb-v", "--vpp", "3", "--layers", "6", "--microbatches", "2"], "use --vpp 2"),
    (["--schedule", "dualpipe-v", "--vpp", "2", "--layers", "4", "--microbatches", "2"], "at least 4"),
])
def test_bad_pipeline_input_is_one_line(argv, words):
    code, out, err = run_cli(["train", "--model", "tiny", "--nproc", "2", "--pp", "2", "--global-batch", "12",
                              "--no-progress", *argv])
    assert code == 2 and words in err and err.strip().count("\n") == 0 and "Traceback" not in err, err


# --- multi-rank: parity with one device, trace, timeline ----------------------------------------
def _cases_p2():
    tiny = ModelConfig(layers=2, hidden=16, heads=2, seq_len=16, vocab=256)
    four = tiny.replace(layers=4)
    out = [(tiny, ParallelConfig(pp=2, schedule=k), m) for k in ("gpipe", "1f1b", "zb-h1") for m in (2, 4, 6)]
    out += [(four, ParallelConfig(pp=2, vpp=2, schedule="interleaved"), m) for m in (2, 4, 6)]
    out += [(four, ParallelConfig(pp=2, schedule=k, stage_layers=(1, 3)), 4) for k in ("1f1b", "zb-h1")]
    out += [(four.replace(tied_embeddings=True), ParallelConfig(pp=2, schedule=k, vpp=v), 4)
            for k, v in (("1f1b", 1), ("zb-h1", 1), ("interleaved", 2))]
    return out


def _cases_p4():
    eight = ModelConfig(layers=8, hidden=16, heads=2, seq_len=16, vocab=256)
    out = [(eight, ParallelConfig(pp=4, schedule=k), m) for k in ("gpipe", "1f1b", "zb-h1") for m in (4, 8, 12)]
    out += [(eight, ParallelConfig(pp=4, vpp=2, schedule="interleaved"), m) for m in (4, 8, 12)]
    tied = eight.replace(layers=4, tied_embeddings=True)
    out += [(tied, ParallelConfig(dp=2, pp=2, schedule=k, vpp=v), 4)
            for k, v in (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2))]
    out += [(tied, ParallelConfig(tp=2, pp=2, schedule=k, vpp=v, scatter_gather=sg), 4)
            for k, v in (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)) for sg in (False, True)]
    return out


def _sub_comm(comm, layout):
    """A Comm on another grid over the same processes (one launch, several layouts)."""
    from minitron.comm import Comm, CommTrace
    from minitron.grid import ProcessGrid

    g = ProcessGrid(tp=layout.tp, dp=layout.dp, pp=layout.pp, rank=comm.grid.rank)
    key = (layout.tp, layout.dp, layout.pp)
    if key not in _GRIDS:
        _GRIDS[key] = g.build_groups()  # collective, in the same order on every rank
    return Comm(_GRIDS[key], CommTrace())


_GRIDS = {}


def _p2p_summary(comm, step):
    """{(op, phase): [bytes of each call]} of this rank's pipeline p2p in one step."""
    out = {}
    for r in comm.trace.select(axis="pp", step=step):
        if r["op"] in ("send", "recv"):
            out.setdefault(f"{r['op']}.{r['phase']}", []).append(r["bytes"])
    gathers = [r["bytes"] for r in comm.trace.select(axis="tp", op="all_gather", step=step)]
    return out, gathers


def _posting_errors(steps, seen) -> list:
    """On gloo (a handle per op) the runtime moves communication earlier, never out of
    order: after each compute action the sends posted must be the longest prefix of the
    schedule's sends whose tensors exist, and the receives posted those of every batch up
    to the next one (each batch's receives go with the batch before it). `seen`:
    [(action, [(op, phase, microbatch) of every p2p record so far])] per compute action."""
    batches = [i for i, x in enumerate(steps) if isinstance(x, tuple)]
    sends = [a for i in batches for a in steps[i] if a.op.startswith("send")]
    computes = [i for i, x in enumerate(steps) if not isinstance(x, tuple)]
    done, errors = set(), []
    for i, (action, recs) in zip(computes, seen):
        done.add((action.op, action.mb, action.chunk))
        n = 0
        while n < len(sends) and ("F" if sends[n].op == "send_fwd" else "B", sends[n].mb, sends[n].chunk) in done:
            n += 1
        upto = [b for b in batches if b < i]
        last = next((b for b in batches if b > i), None)
        posted = [b for b in batches if b < i or (upto and b == last)]
        want = {"send": [(a.op[-3:], a.mb) for a in sends[:n]],
                "recv": [(a.op[-3:], a.mb) for b in posted for a in steps[b] if a.op.startswith("recv")]}
        for op in ("send", "recv"):
            got = [(ph, mb) for o, ph, mb in recs if o == op]
            if got != want[op]:
                errors.append(f"after {action}: {op}s {got}, want {want[op]}")
    return errors


def _parity_job(comm, cases, steps, timeline_path):
    from minitron.checkpoint import gather_full
    from minitron.train import Trainer
    from minitron.tools.verify import compare, reference_run

    corpus = data_mod.load_corpus("")
    refs, results = {}, []
    for i, (model, layout, m) in enumerate(cases):
        c = _sub_comm(comm, layout)
        b = 1 if layout.tp == 1 else 2
        t = TrainConfig(steps=steps, global_batch=b * m * layout.dp, microbatches=m, dtype="float64", lr=1e-2,
                        warmup=1, eval_every=0, progress=False, timeline=timeline_path if i == 0 else "")
        tr = Trainer(model, layout, t, c, corpus)
        losses = [tr.step(s) for s in range(steps - 1)]
        seen = []
        with tr.pipeline.observing(lambda a, _: seen.append((a, [(r["op"], r["phase"], r["microbatch"])
                                                                 for r in c.trace.select(axis="pp", step=steps - 1)]))):
            losses.append(tr.step(steps - 1))
        posting = _posting_errors(tr.pipeline.steps, seen)
        p2p, gathers = _p2p_summary(c, steps - 1)
        val = tr.evaluate(1)
        if t.timeline:
            tr.pipeline.write_timeline(t.timeline)
        full = gather_full(tr)
        if comm.grid.rank != 0:
            results.append({"p2p": p2p, "gathers": gathers, "posting": posting})
            continue
        key = (model, m * layout.dp, b * m * layout.dp)
        if key not in refs:
            ref_losses, ref = reference_run(model, t.replace(microbatches=m * layout.dp, timeline=""), corpus, steps)
            refs[key] = ref_losses, ref, ref.evaluate(1)
        ref_losses, ref, ref_val = refs[key]
        res = compare(losses, full, ref_losses, ref)
        res.update(val_diff=abs(val - ref_val), case=f"{model.layers}L tied={model.tied_embeddings} "
                   f"{layout.describe()} m={m}", p2p=p2p, gathers=gathers, b=b, m=m,
                   hidden=model.hidden, seq=model.seq_len, chunks=layout.vpp,
                   p=layout.pp, t=layout.tp, sg=layout.scatter_gather, sp=layout.sp, kind=layout.schedule,
                   replicas=layout.dp * layout.tp, posting=posting)
        results.append(res)
    return results


def _check_parity_and_trace(results):
    verdicts = results[0]
    assert verdicts, "no cases ran"
    for i, res in enumerate(verdicts):
        case = res["case"]
        assert res["max_loss_abs_diff"] <= TOL, (case, res)
        assert res["max_param_rel_diff"] <= TOL, (case, res)
        assert res["val_diff"] <= TOL, (case, res)
        # trace: each of the p*v - 1 stage boundaries between two ranks (all of them in the loop;
        # the V's turn on rank p-1 is no message) carries one activation forward and one
        # gradient backward per microbatch, b*s*h float64 elements each (1/t with scatter/gather,
        # and with sequence parallelism, whose boundary activation is already a sequence shard)
        sg, t = res["sg"], res["t"]
        pl = placement_for(res["kind"], res["p"], res["chunks"])
        boundaries = sum(pl.locate(s)[0] != pl.locate(s + 1)[0] for s in range(pl.num_stages - 1))
        elems = res["b"] * res["seq"] * res["hidden"] // (t if sg or res.get("sp") else 1)
        sends = Counter()
        for rank, rank_results in results.items():
            summary = rank_results[i]["p2p"]
            for key, sizes in summary.items():
                assert set(sizes) == {8 * elems}, (case, rank, key, sizes)
                sends[key] += len(sizes)
            gathers = rank_results[i]["gathers"]
            if sg:  # the receiver reassembles each message with one all-gather over tp
                assert Counter(gathers)[8 * elems] == len(summary.get("recv.fwd", [])) + len(summary.get("recv.bwd", []))
        for key in ("send.fwd", "recv.fwd", "send.bwd", "recv.bwd"):  # dp*tp pipelines side by side
            assert sends[key] == res["replicas"] * res["m"] * boundaries, (case, key, sends)
        for rank, rank_results in results.items():  # gloo: sends when ready, receives a batch ahead
            assert not rank_results[i]["posting"], (case, rank, rank_results[i]["posting"][:3])


def _check_timeline(path, p, m, kind, v=1):
    recs = [json.loads(line) for line in open(path)]
    s = make_schedule(kind, p, v, m)
    for r in range(p):
        for step in (0, 1):
            mine = [x for x in recs if x["rank"] == r and x["step"] == step]
            assert [(x["op"], x["mb"], x["chunk"]) for x in mine] == \
                [(a.op, a.mb, a.chunk) for a in s.compute_actions(r)]
            assert all(x["end"] >= x["start"] for x in mine)
            assert all(a["end"] <= b["start"] + 1e-6 for a, b in zip(mine, mine[1:]))
    # dataflow across ranks: stage r+1 starts F of a microbatch after stage r ended it
    f = {(x["rank"], x["mb"], x["step"]): x for x in recs if x["op"] == "F"}
    for (r, mb, step), x in f.items():
        if r > 0:
            assert x["start"] >= f[(r - 1, mb, step)]["end"] - 1e-3


@pytest.mark.multirank
@pytest.mark.parametrize("p,cases", [(2, _cases_p2), (4, _cases_p4)], ids=["p2_every_schedule", "p4_dp_tp_sg"])
def test_pipeline_equals_one_device(tmp_path, p, cases):
    """One launch of 2 (4) ranks: every case of _cases_p2 (_cases_p4) against one device,
    its p2p trace, when each send and receive was posted (gloo: as early as allowed, in
    the schedule's order), and the measured timeline of the first case (GPipe, m = p)."""
    path = str(tmp_path / "timeline.jsonl")
    results = run_on_ranks(_parity_job, ParallelConfig(pp=p), cases(), 2, path)
    _check_parity_and_trace(results)
    _check_timeline(path, p=p, m=p, kind="gpipe")
