"""1-D tensor parallelism: parity with one device, the collectives per layer,
the activations a layer keeps, dropout streams and recomputation, bad input.

One launch per t (2, 4, 8 ranks) trains several layouts and checks each against the
single-device reference, its trace against the analysis, and (t = 2, 4) the measured
saved-activation bytes per layer; and one sequence-parallel column-parallel linear
keeping its input shard and all-gathering it again in the backward (Korthikanti §4.2.2).
"""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from minitron.analysis.comm import tp_layer_bytes
from minitron.analysis.memory import (activation_bytes_per_layer, engine_activation_bytes_on_rank,
                                      korthikanti_activation_bytes_per_layer)
from minitron.analysis.tensor_parallel import (activation_table, format_table, layer_call_bytes,
                                               saved_bytes_per_layer, tp_collectives, tp_scaling)
from minitron.config import ModelConfig, ParallelConfig, PRESETS, TrainConfig, validate
from minitron.context import Context
from minitron.model import GPT
from minitron.parallel.tensor import keep_mask
from minitron.tools.testing import run_cli, run_on_ranks

DT = {torch.float64: 8, torch.float32: 4}
# heads 8 so that t = 8 divides them; a vocabulary no t divides; tied; dropout (global masks)
MODEL = ModelConfig(layers=2, hidden=32, heads=8, seq_len=32, vocab=259, tied_embeddings=True,
                    dropout=0.1, name="tp-test")
TRAIN = TrainConfig(steps=3, global_batch=4, microbatches=2, lr=1e-2, warmup=1, eval_every=0,
                    dtype="float64", progress=False, sample_tokens=0)


# --------------------------------------------------------------------------------------
# measuring what a layer keeps
# --------------------------------------------------------------------------------------
def measure_layer_bytes(gpt: GPT, x: torch.Tensor, key=(0, 0)) -> int:
    """Bytes of the distinct storages one Block keeps for its backward: what saved-tensor
    hooks see (a recomputed region's inputs included: it saves them as saved tensors);
    parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in gpt.parameters()}
    kept: dict[int, int] = {}

    def keep(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            kept[st.data_ptr()] = st.nbytes()
        return t

    block = next(iter(gpt.blocks.values()))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        gpt.run_block(block, x, key)
    return sum(kept.values())


def _measure_all(comm, t: int, b: int = 2, dtype=torch.float64) -> list[dict]:
    """Measured vs analysed bytes of one layer for every (dropout, sp, recompute)."""
    rows = []
    for drop in (0.0, 0.1):
        for sp in ((False, True) if t > 1 else (False,)):
            for rc in ("none", "selective", "full"):
                m = MODEL.replace(dropout=drop)
                ctx = Context(comm, ParallelConfig(tp=t, sp=sp, recompute=rc), dtype)
                gpt = GPT(m, ctx, layer_ids=[0], first=False, last=False).train()
                g = torch.Generator().manual_seed(0)
                x = torch.randn(b, m.seq_len, m.hidden, generator=g, dtype=dtype)
                if sp:
                    x = x.chunk(t, dim=1)[ctx.tp_rank]
                got = measure_layer_bytes(gpt, x.contiguous().requires_grad_())
                want = sum(saved_bytes_per_layer(m, b, t, sp, rc, DT[dtype]).values())
                rows.append({"t": t, "dropout": drop, "sp": sp, "recompute": rc, "exact": got == want,
                             "measured": got, "analysis": want, "ratio": got / want})
    return rows


# --------------------------------------------------------------------------------------
# the multi-rank job: verify many layouts, check traces, measure activations
# --------------------------------------------------------------------------------------
def _cases(t: int):
    """(model, layout): dropout + vocab 259 + tied under every (sp, full recompute);
    for t < 8 also an untied model without dropout under sp + selective recomputation."""
    out = [(MODEL, ParallelConfig(tp=t, sp=sp, recompute=rc, dropout_rng="global"))
           for sp in (False, True) for rc in ("none", "full")]
    if t < 8:  # (8 ranks on a small machine are slow to step)
        out.append((MODEL.replace(tied_embeddings=False, dropout=0.0),
                    ParallelConfig(tp=t, sp=True, recompute="selective")))
    return out


def _trace_counts(records) -> Counter:
    """(phase, op, bytes) -> calls of the tensor axis in forward and backward."""
    return Counter((r["phase"], r["op"], int(r["bytes"])) for r in records
                   if r["axis"] == "tp" and r["phase"] in ("fwd", "bwd"))


def _expected_counts(m: ModelConfig, p: ParallelConfig, b: int, mbs: int, e: int) -> Counter:
    c = Counter()
    for it in tp_collectives(m, b, p.tp, p.sp, p.recompute, bytes_per_el=e):
        c[(it["phase"], it["op"], int(it["bytes"]))] += it["calls"] * mbs
    return c


def _all_gather_linear_job(comm, t: int) -> dict:
    """One sequence-parallel column-parallel linear (`_AllGatherLinear`) on this rank's
    shard: what it saves for the backward, its calls in the forward and in three kinds of
    backward (whole; the input gradient only, as zb-h1's B; the weight gradients only, as
    its W), and its gradients against F.linear on the whole input of every rank."""
    from minitron.parallel.tensor import all_gather_linear

    r, b, s, h, d = comm.index("tp"), 2, 8, 6, 4
    ctx = Context(comm, ParallelConfig(tp=t, sp=True), torch.float64)
    g = torch.Generator().manual_seed(0)
    x_full = torch.randn(b, s, h, generator=g, dtype=torch.float64)
    ws, bs, dys = ([torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(t)]
                   for shape in ((d, h), (d,), (b, s, d)))  # rank q's column shard and dL/dY
    w, bias = ws[r].clone().requires_grad_(), bs[r].clone().requires_grad_()
    x0 = x_full.chunk(t, dim=1)[r].clone().requires_grad_()
    saved = {}

    def pack(x):
        saved[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    calls = {}

    def run(label, phase, fn):
        comm.trace.records.clear()
        with comm.in_phase(phase):
            out = fn()
        calls[label] = [(rec["phase"], rec["op"], rec["bytes"], tuple(rec["shape"]))
                        for rec in comm.trace.records]
        return out

    x = x0 * 1.0  # a non-leaf input, as the output of a LayerNorm
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        y = run("forward", "fwd", lambda: all_gather_linear(x, w, bias, ctx))
    saved.pop(w.untyped_storage().data_ptr())  # (parameters are not activations)
    (dx_only,) = run("input gradient only (zb-h1 B)", "bwd",
                     lambda: torch.autograd.grad(y, x0, dys[r], retain_graph=True))
    run("weight gradients only (zb-h1 W)", "bwd",
        lambda: torch.autograd.backward(y, dys[r], inputs=[w, bias], retain_graph=True))
    dw_only = w.grad.clone()
    w.grad = bias.grad = None
    run("whole backward", "bwd", lambda: y.backward(dys[r]))
    want_dx = sum(dys[q] @ ws[q] for q in range(t)).chunk(t, dim=1)[r]  # f's sum over the column shards
    want_dw = dys[r].flatten(0, 1).t() @ x_full.flatten(0, 1)
    err = max(float((x0.grad - want_dx).abs().max()), float((dx_only - want_dx).abs().max()),
              float((w.grad - want_dw).abs().max()), float((dw_only - want_dw).abs().max()),
              float((bias.grad - dys[r].sum((0, 1))).abs().max()),
              float((y.detach() - F.linear(x_full, ws[r], bs[r])).abs().max()))
    return {"saved_bytes": sum(saved.values()), "shard_bytes": x0.numel() * 8, "calls": calls, "err": err}


def _tp_job(comm, t: int, measure: bool):
    from minitron.checkpoint import gather_full
    from minitron.data import load_corpus
    from minitron.train import Trainer
    from minitron.tools.verify import compare, reference_run

    corpus = load_corpus("")
    rank0 = comm.grid.rank == 0
    out = {"verify": [], "trace": [], "activations": [], "rng": None}
    refs = {}
    b = TRAIN.global_batch // TRAIN.microbatches
    for m, p in _cases(t):
        validate(m, p, TRAIN, world=t)
        tr = Trainer(m, p, TRAIN, comm, corpus)
        comm.trace.records.clear()
        losses = [tr.step(0)]
        got = _trace_counts(comm.trace.records)
        want = _expected_counts(m, p, b, TRAIN.microbatches, 8)
        out["trace"].append((p.describe(), comm.grid.rank, dict(got), dict(want)))
        losses += [tr.step(i) for i in range(1, TRAIN.steps)]
        full = gather_full(tr)
        if rank0:
            if m not in refs:
                refs[m] = reference_run(m, TRAIN, corpus, TRAIN.steps)
            res = compare(losses, full, *refs[m])
            out["verify"].append({"layout": p.describe(), "vocab": m.vocab, "tied": m.tied_embeddings,
                                  "dropout": m.dropout, **res})
    if measure:
        out["activations"] = _measure_all(comm, t)
    out["all_gather_linear"] = _all_gather_linear_job(comm, t)
    out["reduce_scatter"] = _reduce_scatter_job(comm, t)
    # dropout streams: the attention mask of this rank's heads, and a residual mask shard
    ctx_t = Context(comm, ParallelConfig(tp=t, sp=True, dropout_rng="tensor"))
    ctx_g = Context(comm, ParallelConfig(tp=t, sp=True, dropout_rng="global"))
    heads = (2, MODEL.heads // t, 8, 8)
    out["rng"] = {
        "tensor_probs": keep_mask(ctx_t, "blocks.0.attn.probs", (3, 1), heads, 0.5, "cpu", inside=True),
        "global_probs": keep_mask(ctx_g, "blocks.0.attn.probs", (3, 1), heads, 0.5, "cpu", inside=True),
        "tensor_resid": keep_mask(ctx_t, "blocks.0.mlp.out", (3, 1), (2, 32 // t, 8), 0.5, "cpu"),
    }
    return out


def _reduce_scatter_job(comm, t: int) -> dict:
    """The engine's reduce-scatter (on gloo an all-to-all and a local sum) against gloo's
    own: into a flat buffer, synchronous and asynchronous, and along dim 1 (float64)."""
    import torch.distributed as dist

    from minitron.comm import reduce_scatter_single

    torch.manual_seed(comm.grid.rank)
    group = comm.group("tp")
    x = torch.randn(4 * t, 3, dtype=torch.float64)
    want = torch.empty(4, 3, dtype=torch.float64)
    dist.reduce_scatter_single(want, x, group=group)
    got_sync = torch.full_like(want, float("nan"))
    reduce_scatter_single(got_sync, x, group)
    got_async = torch.full_like(want, float("nan"))
    pending = reduce_scatter_single(got_async, x, group, async_op=True)
    before = got_async.clone()  # nothing summed before the wait
    pending.wait()
    along = comm.reduce_scatter(x.t().contiguous(), "tp", dim=1)  # [3, 4t] -> [3, 4]
    flat = comm.reduce_scatter(x, "tp", out=torch.empty_like(want), async_op=True).wait()
    err = max((g - want).abs().max().item() for g in (got_sync, got_async, along.t(), flat))
    return {"err": err, "bitwise": bool(torch.equal(got_sync, want)), "pending_was_unsummed": bool(before.isnan().all())}


def _check_launch(t: int, measure: bool):
    results = run_on_ranks(_tp_job, ParallelConfig(tp=t), t, measure, trace=True)
    verdicts = results[0]["verify"]
    for v in verdicts:
        print(f"t={t} {v['layout']:<28} vocab {v['vocab']} tied {v['tied']!s:<5} dropout {v['dropout']}: "
              f"loss diff {v['max_loss_abs_diff']:.1e}, param rel diff {v['max_param_rel_diff']:.1e}")
        assert v["max_loss_abs_diff"] <= 1e-9 and v["max_param_rel_diff"] <= 1e-9, v
    assert len(verdicts) == len(_cases(t))
    for r in range(t):
        for layout, rank, got, want in results[r]["trace"]:
            assert want and got == want, (layout, rank, got, want)
    # streams: 'tensor' mode draws a different attention mask on every rank; 'global'
    # slices the single-device mask; residual masks are shards of one shared mask
    single = Context(layout=ParallelConfig())
    full_probs = keep_mask(single, "blocks.0.attn.probs", (3, 1), (2, MODEL.heads, 8, 8), 0.5, "cpu")
    full_resid = keep_mask(single, "blocks.0.mlp.out", (3, 1), (2, 32, 8), 0.5, "cpu")
    tensor = [results[r]["rng"]["tensor_probs"] for r in range(t)]
    assert all(not torch.equal(tensor[0], x) for x in tensor[1:])
    assert torch.equal(torch.cat([results[r]["rng"]["global_probs"] for r in range(t)], 1), full_probs)
    assert torch.equal(torch.cat([results[r]["rng"]["tensor_resid"] for r in range(t)], 1), full_resid)
    # the sequence-parallel column-parallel linear keeps the shard and gathers it again
    b, s, h = 2, 8, 6
    shard = ("all_gather", b * s // t * h * 8, (b, s // t, h))
    full = ("reduce_scatter", b * s * h * 8, (b, s, h))
    want = {"forward": [("fwd", *shard)], "input gradient only (zb-h1 B)": [("bwd", *full)],
            "weight gradients only (zb-h1 W)": [("bwd", *shard)],
            "whole backward": [("bwd", *shard), ("bwd", *full)]}
    for r in range(t):
        res = results[r]["all_gather_linear"]
        assert res["calls"] == want, (r, res["calls"])
        assert res["saved_bytes"] == res["shard_bytes"], res
        assert res["err"] < 1e-12, res
    for r in range(t):
        rs = results[r]["reduce_scatter"]
        # the same sums, added in another order beyond two ranks (two ranks: bitwise)
        assert rs["err"] < 1e-14 and rs["pending_was_unsummed"] and (rs["bitwise"] or t > 2), (r, rs)
    if measure:
        rows = [row for r in range(t) for row in results[r]["activations"] if r == 0]
        print(format_table(rows))
        for r in range(t):
            for row in results[r]["activations"]:
                assert abs(row["ratio"] - 1) <= 0.10, row
                # under --sp the column-parallel linears keep the input shard: to the byte
                assert row["exact"] or not row["sp"], row


@pytest.mark.multirank
@pytest.mark.parametrize("t,measure", [(2, True), (4, True), (8, False)])
def test_tensor_parallel_ranks(t, measure):
    """verify (float64, 1e-9) for t ranks with and without --sp and --recompute full,
    vocab 259, tied, dropout; trace = analysis; measured activations = analysis (to the
    byte under --sp); the --sp linear's saved shard and backward re-gather; the engine's
    reduce-scatter against gloo's own."""
    _check_launch(t, measure)


@pytest.mark.multirank
def test_verify_cli_dropout_sp_recompute():
    """The command line itself: `minitron verify --dropout 0.1 --tp 2 --sp --recompute full`."""
    code, out, err = run_cli(["verify", "--nproc", "2", "--tp", "2", "--sp", "--recompute", "full",
                              "--dropout", "0.1", "--vocab", "259", "--tied"])
    assert code == 0, out + err
    assert "OK" in out


# --------------------------------------------------------------------------------------
# in-process (t = 1)
# --------------------------------------------------------------------------------------
def test_masks_are_pure_functions_of_their_key():
    ctx = Context()
    a = keep_mask(ctx, "blocks.0.mlp.out", (5, 1), (4, 32, 16), 0.25, "cpu")
    assert torch.equal(a, keep_mask(ctx, "blocks.0.mlp.out", (5, 1), (4, 32, 16), 0.25, "cpu"))
    for site, key in [("blocks.1.mlp.out", (5, 1)), ("blocks.0.mlp.out", (6, 1)), ("blocks.0.mlp.out", (5, 0))]:
        assert not torch.equal(a, keep_mask(ctx, site, key, (4, 32, 16), 0.25, "cpu"))
    assert abs(a.double().mean().item() - 0.75) < 0.03
    # with t = 1 both modes are the single-device model
    g = Context(layout=ParallelConfig(dropout_rng="global"))
    assert torch.equal(keep_mask(g, "x", (0, 0), (2, 3, 4), 0.5, "cpu", inside=True),
                       keep_mask(ctx, "x", (0, 0), (2, 3, 4), 0.5, "cpu", inside=True))


def test_explicit_attention_core_equals_sdpa():
    """With dropout > 0 the core is written out; it is SDPA when nothing is dropped."""
    m = MODEL.replace(layers=1)
    attn = GPT(m, Context(dtype=torch.float64)).blocks["0"].attn.train()
    qkv = torch.randn(2, m.seq_len, 3 * m.hidden, dtype=torch.float64)
    attn.drop.p = 1e-300  # the explicit path, keeping (almost surely) every element
    explicit = attn.core(qkv, (0, 0))
    attn.drop.p = 0.0
    torch.testing.assert_close(explicit, attn.core(qkv, (0, 0)), rtol=1e-12, atol=1e-12)


def test_recomputation_replays_the_masks():
    """none / selective / full recomputation: the same loss and gradients with dropout."""
    x = torch.randint(0, 256, (2, MODEL.seq_len))
    y = torch.randint(0, 256, (2, MODEL.seq_len))
    grads = {}
    for rc in ("none", "selective", "full"):
        ctx = Context(layout=ParallelConfig(recompute=rc), dtype=torch.float64)
        gpt = GPT(MODEL, ctx).train()
        loss = gpt(x, y, (7, 3))
        loss.backward()
        grads[rc] = (loss.detach(), [p.grad for p in gpt.parameters()])
        assert not torch.equal(loss.detach(), GPT(MODEL, ctx).eval()(x, y).detach())  # dropout acts
    for rc in ("selective", "full"):
        assert torch.equal(grads[rc][0], grads["none"][0])
        for a, b in zip(grads[rc][1], grads["none"][1]):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_saved_activation_bytes_single_rank():
    from minitron.comm import Comm

    rows = [r for dtype in (torch.float64, torch.float32) for r in _measure_all(Comm(), 1, dtype=dtype)]
    print(format_table(rows))
    assert all(r["measured"] == r["analysis"] for r in rows), rows


# --------------------------------------------------------------------------------------
# the analysis
# --------------------------------------------------------------------------------------
def test_layer_collectives_match_comm_analysis():
    for t in (2, 4, 8):
        for sp in (False, True):
            for rc in ("none", "selective", "full"):
                assert layer_call_bytes(MODEL, 2, t, sp, rc, 4) == tp_layer_bytes(MODEL, 2, t, sp, rc, 4)
    # 2 all-reduces of b·s·h forward and 2 backward; with --sp the same ring wire bytes
    x = 2 * MODEL.seq_len * MODEL.hidden * 4
    per = {(c["phase"], c["op"]): (c["calls"], c["bytes"])
           for c in tp_collectives(MODEL, 2, 4, layers=1, first=False, last=False)}
    assert per == {("fwd", "all_reduce"): (2, x), ("bwd", "all_reduce"): (2, x)}
    # --sp: the same ring wire bytes, plus the backward's re-gathers of the QKV and fc
    # input shards, (t − 1)/t · b·s·h each
    sp = tp_collectives(MODEL, 2, 4, sp=True, layers=1, first=False, last=False)
    wire = sum(c["calls"] * (c["bytes"] * 4 if c["op"] == "all_gather" else c["bytes"]) * 3 / 4 for c in sp)
    assert wire == 4 * 2 * 3 / 4 * x + 2 * 3 / 4 * x


def test_activation_analysis_against_table2():
    """With and without --sp minitron's layer is Table 2 per element plus the LayerNorm
    statistics (under --sp the QKV and fc linears keep their input's sequence shard)."""
    m = PRESETS["megatron-8.3b"].replace(dropout=0.1)
    b, e = 1, 2
    T, h = b * m.seq_len, m.hidden
    for t in (1, 2, 8):
        for row in activation_table(m, b, t, e):
            ts = t if row["sp"] else 1
            stats = 0 if row["recompute"] == "full" else 2 * 2 * 4 * T / ts
            assert math.isclose(row["minitron_bytes"], row["table2_bytes"] + stats, rel_tol=1e-12), row
    # Table 2 literally (34 + 5as/h at 16 bits), for one layer of the 8.3B model on one device
    assert activation_bytes_per_layer(m, 1) == T * h * (34 + 5 * m.heads * m.seq_len / h)


def test_sp_layer_keeps_what_table2_counts():
    """Korthikanti Table 2 under sequence parallelism, sbh·(34/t + 5as/(ht)) (2-byte
    activations, 1-byte masks), is what the engine's model keeps per layer, LayerNorm's
    statistics aside, per item and in engine_activation_bytes_on_rank: the QKV and fc
    linears keep their input's sequence shard, e·sbh/t each. (An all-gather followed by
    F.linear kept it whole: 2·e·sbh·(1 − 1/t) above Table 2 per layer.)"""
    m = PRESETS["gpt3-175b"].replace(dropout=0.1)
    s, h, a, b, e = m.seq_len, m.hidden, m.heads, 1, 2
    sbh = s * b * h
    for t in (2, 4, 8):
        stats = 2 * 2 * 4 * s * b / t  # ln1 and ln2: float32 mean and rstd of the shard's tokens
        items = saved_bytes_per_layer(m, b, t, True, "none", e)
        assert items["qkv input"] == items["fc input"] == e * sbh / t
        for rc in ("none", "selective"):
            table2 = korthikanti_activation_bytes_per_layer(s, b, h, a, t, True, rc)
            layer = sum(saved_bytes_per_layer(m, b, t, True, rc, e).values())
            assert math.isclose(layer - stats, table2, rel_tol=1e-12), (t, rc, layer - stats, table2)
            # the engine's per-rank model: one more layer on the stage holds exactly that
            lay = ParallelConfig(tp=t, sp=True, recompute=rc)
            one, two = (engine_activation_bytes_on_rank(m.replace(layers=n), lay, b, 1, 0, e) for n in (1, 2))
            assert math.isclose(two - one - stats, table2, rel_tol=1e-12), (t, rc, two - one - stats, table2)


def test_tp_stays_inside_a_node():
    rows = tp_scaling("megatron-8.3b")
    print(format_table(rows))
    assert [r["t"] for r in rows] == [2, 4, 8, 16]
    by_t = {r["t"]: r for r in rows}
    assert all(by_t[t]["link"] == "NVLink" and by_t[t]["comm_ms"] < by_t[t]["compute_ms"] for t in (2, 4, 8))
    assert by_t[16]["link"] == "InfiniBand" and by_t[16]["comm_ms"] > 5 * by_t[16]["compute_ms"]
    assert by_t[16]["speedup"] < by_t[8]["speedup"]
    # with a 16-GPU node (DGX-2) t = 16 stays on NVSwitch and keeps scaling
    wide = {r["t"]: r for r in tp_scaling("megatron-8.3b", cluster="v100-dgx2")}
    assert wide[16]["link"] == "NVLink" and wide[16]["speedup"] > wide[8]["speedup"]


# --------------------------------------------------------------------------------------
# bad input: one clear line, exit status 2, before any rank starts
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,words", [
    (["--tp", "3", "--nproc", "3", "--heads", "4"], "heads are not divisible by --tp 3"),
    # hidden % heads == 0 and heads % t == 0 imply hidden % t == 0: the heads line names it
    (["--tp", "4", "--nproc", "4", "--hidden", "30", "--heads", "6"], "6 heads are not divisible by --tp 4"),
    (["--tp", "2", "--nproc", "2", "--ffn", "67"], "FFN size 67 is not divisible by --tp 2"),
    (["--tp", "2", "--nproc", "2", "--sp", "--seq-len", "31"], "--seq-len 31 must be divisible by --tp 2"),
])
def test_bad_input(args, words):
    code, out, err = run_cli(["verify", *args])
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and words in lines[0], (code, out, err)


def test_bad_dropout_rng_mode():
    from minitron.config import ConfigError

    with pytest.raises(ConfigError, match="unknown --dropout-rng 'philox'") as e:
        validate(MODEL, ParallelConfig(dropout_rng="philox"))
    assert "\n" not in str(e.value)
