"""Data parallelism: naive and bucketed all-reduce, ZeRO-1.

Every variant must equal the single-device model (float64: losses 1e-9 absolute,
parameters 1e-9 relative); the trace must show exactly the calls the analysis predicts
(all-reduce payload = gradient bytes, nothing on the wire before the last microbatch,
ZeRO-1's reduce-scatter and all-gather); ZeRO-1 must hold 1/d of the optimizer state.
One launch per world size runs every variant, to keep start-up costs down.
"""
from __future__ import annotations

import dataclasses
import random
from collections import defaultdict

import pytest
import torch
import torch.distributed

from minitron.analysis.comm import dp_bytes_per_step
from minitron.analysis.data_parallel import NORM_BYTES, dp_calls, model_state_bytes, plan_buckets
from minitron.analysis.memory import memory_on_rank
from minitron.analysis.params import params_on_rank
from minitron.tools.cli import main
from minitron.config import ConfigError, ParallelConfig, TrainConfig, preset, validate

TOL = 1e-9
BUCKET_MB = 0.05  # the tiny model in float64 is ~0.35 MB: several buckets


# --- the bucket plan (pure) ---------------------------------------------------------------------
def _random_plans(n=300, seed=0):
    rng = random.Random(seed)
    for _ in range(n):
        yield ([rng.randint(1, 50) for _ in range(rng.randint(1, 20))], rng.randint(1, 120), rng.randint(1, 8))


@pytest.mark.parametrize("numels,cap,d", list(_random_plans()))
def test_plan_buckets_covers_the_buffer(numels, cap, d):
    offsets, buckets, total = plan_buckets(numels, cap, d)
    n = sum(numels)
    assert total % d == 0 and n <= total < n + d  # padding only to the next multiple of d
    assert buckets[0].start == 0 and buckets[-1].end == total
    for a, b in zip(buckets, buckets[1:]):
        assert a.end == b.start
    for b in buckets:
        assert b.numel > 0 and b.start % d == 0 and b.end % d == 0
    for b in buckets[:-1]:
        assert b.numel >= cap  # a bucket closes only once it is full
    for i, (o, k) in enumerate(zip(offsets, numels)):  # every tensor lies in the buckets that list it
        covered = sum(min(b.end, o + k) - max(b.start, o) for b in buckets if i in b.tensors)
        assert covered == k
    if d == 1:  # no rounding: buckets end where tensors end
        ends = {o + k for o, k in zip(offsets, numels)}
        assert all(b.end in ends for b in buckets)


@pytest.mark.parametrize("zero1", [False, True])
@pytest.mark.parametrize("impl", ["naive", "bucketed"])
@pytest.mark.parametrize("d", [2, 3, 8])
def test_dp_calls_agree_with_comm_analysis(d, impl, zero1):
    numels = [7, 300, 12, 4096, 5, 1000, 33]
    calls = dp_calls(numels, d, impl, zero1, bucket_mb=0.01, bytes_per_el=4)
    per_op = defaultdict(int)
    for c in calls:
        per_op[c["op"]] += c["bytes"]
    expect = dp_bytes_per_step(sum(numels), d, zero1, 4)
    if zero1:
        expect["all_reduce"] = NORM_BYTES
    assert dict(per_op) == expect


def test_zero1_state_is_a_dth_of_replicated():
    m = preset("small")
    for d in (2, 4, 8):
        layout = ParallelConfig(dp=d, zero1=True)
        s = model_state_bytes(m, layout, TrainConfig(global_batch=8 * d))
        n = params_on_rank(m, layout)
        assert s["optimizer_bytes_replicated"] == 2 * n * 4
        assert s["optimizer_bytes"] == s["optimizer_bytes_zero1"] == 2 * -(-n // d) * 4
        assert abs(s["zero1_fraction"] - 1 / d) < d / n


# --- bad input: one clear line, before any process group ----------------------------------------
@pytest.mark.parametrize("argv,words", [
    (["--nproc", "2", "--dp", "2", "--bucket-mb", "0"], "--bucket-mb must be a positive finite number"),
    (["--nproc", "2", "--dp", "2", "--bucket-mb", "-1"], "--bucket-mb must be a positive finite number"),
    (["--zero1"], "--zero1 shards optimizer state"),
    (["--nproc", "4", "--dp", "4", "--global-batch", "6"], "not divisible by dp*microbatches"),
    (["--nproc", "2", "--dp", "2", "--global-batch", "4", "--microbatches", "3"], "not divisible by dp*microbatches"),
    (["--nproc", "2", "--dp", "2", "--dp-impl", "ddp"], "unknown --dp-impl 'ddp'"),
])
def test_bad_input_is_one_line(capsys, argv, words):
    assert main(["verify", "--model", "tiny", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("minitron: error:") and words in err and "\n" not in err, err


def test_validate_rejects_directly():
    m = preset("tiny")
    with pytest.raises(ConfigError, match="bucket-mb"):
        validate(m, ParallelConfig(dp=2, bucket_mb=0.0))
    with pytest.raises(ConfigError, match="zero1"):
        validate(m, ParallelConfig(dp=1, zero1=True))
    with pytest.raises(ConfigError, match="dp\\*microbatches"):
        validate(m, ParallelConfig(dp=4), TrainConfig(global_batch=12, microbatches=2))


# --- multi-rank: parity, trace, memory, state export -------------------------------------------
VARIANTS = [("naive", False), ("bucketed", False), ("naive", True), ("bucketed", True)]


def _dp_records(records, steps):
    """{step: {(op, phase): [calls, bytes]}} of the data-parallel records."""
    out = {s: defaultdict(lambda: [0, 0]) for s in range(steps)}
    for r in records:
        if r["axis"] == "dp":
            slot = out[r["step"]][(r["op"], r["phase"])]
            slot[0] += 1
            slot[1] += r["bytes"]
    return out


def _check_trace(tr, records, problems, tag):
    """The trace of one variant against the analysis, on this rank."""
    m, layout, t = tr.mcfg, tr.layout, tr.tcfg
    e = tr.params[0].element_size()
    d, M = layout.dp, t.microbatches
    n = sum(p.numel() for p in tr.params)
    if n != params_on_rank(m, layout):
        problems.append(f"{tag}: {n} local elements, analysis says {params_on_rank(m, layout)}")
    late = sum(1 for p in tr.params if p.shard.grad_sync) if layout.zero1 else 0
    order = [p for p in reversed(tr.params) if not (late and p.shard.grad_sync)] + \
            [p for p in reversed(tr.params) if late and p.shard.grad_sync]
    calls = dp_calls([p.numel() for p in order], d, layout.dp_impl, layout.zero1, layout.bucket_mb, e, late)
    want = {(c["op"], c["phase"]): [c["calls"], c["bytes"]] for c in calls}
    totals = dp_bytes_per_step(n, d, layout.zero1, e)
    for step, got in _dp_records(records, t.steps).items():
        if dict(got) != want:
            problems.append(f"{tag}: step {step} dp calls {dict(got)} != analysis {want}")
        per_op = defaultdict(int)
        for (op, _), (_, b) in got.items():
            per_op[op] += b
        if layout.zero1:
            ok = (per_op["reduce_scatter"] == totals["reduce_scatter"] and per_op["all_gather"] == totals["all_gather"]
                  and per_op["all_reduce"] == NORM_BYTES)
        else:
            ok = dict(per_op) == {"all_reduce": n * e} == totals
        if not ok:
            problems.append(f"{tag}: step {step} dp bytes {dict(per_op)} != {totals}")
    for r in records:
        if r["axis"] == "dp" and r["microbatch"] is not None and r["microbatch"] != M - 1:
            problems.append(f"{tag}: dp traffic during microbatch {r['microbatch']} of {M}: {r}")
        if r["axis"] == "dp" and r["phase"] == "bwd" and r["microbatch"] != M - 1:
            problems.append(f"{tag}: backward dp record outside the last microbatch: {r}")
    if layout.dp_impl == "bucketed" and sum(v[0] for k, v in want.items() if k[1] == "bwd") < 2:
        problems.append(f"{tag}: expected several buckets started during backward")


def _check_memory(tr, problems, tag):
    """Measured optimizer-state bytes against the analysis (ZeRO-1: 1/d up to padding)."""
    if tr.layout.zero1:
        got = tr.optimizer.state_bytes()
    else:
        got = sum(s[k].numel() * s[k].element_size() for s in tr.optimizer.state.values()
                  for k in ("exp_avg", "exp_avg_sq"))
    mem = memory_on_rank(tr.mcfg, tr.layout, tr.tcfg)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in tr.params)
    if got != mem["optimizer_bytes"] or grads != mem["grads_bytes"]:
        problems.append(f"{tag}: optimizer {got} / grads {grads} bytes, analysis {mem['optimizer_bytes']} / "
                        f"{mem['grads_bytes']}")
    if tr.layout.zero1:
        rep = model_state_bytes(tr.mcfg, tr.layout, tr.tcfg)["optimizer_bytes_replicated"]
        if not rep / tr.layout.dp <= got < rep / tr.layout.dp + 2 * tr.layout.dp * 8:
            problems.append(f"{tag}: ZeRO-1 state {got} is not 1/{tr.layout.dp} of {rep}")


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _check_state_export(rep_tr, zero_tr, comm, corpus, problems, tag):
    """ZeRO-1's exported AdamW state equals the replicated optimizer's; imported into a fresh
    ZeRO-1 trainer, training continues exactly like the replicated one."""
    from minitron.checkpoint import assemble, export_state, import_state
    from minitron.train import Trainer

    a = export_state(rep_tr.params, rep_tr.optimizer)
    b = export_state(zero_tr.params, zero_tr.optimizer)  # collective over dp
    for name, ra in a.items():
        for k in ("param", "exp_avg", "exp_avg_sq"):
            if _rel(b[name][k], ra[k]) > TOL:
                problems.append(f"{tag}: exported {k} of {name} differs by {_rel(b[name][k], ra[k]):.2e}")
        if b[name]["step"] != ra["step"]:
            problems.append(f"{tag}: exported step {b[name]['step']} != {ra['step']}")
    fresh = Trainer(rep_tr.mcfg, dataclasses.replace(rep_tr.layout, zero1=True), rep_tr.tcfg, comm, corpus)
    shards = [None] * comm.grid.world  # every rank's shards (tensor-parallel pieces too)
    torch.distributed.all_gather_object(shards, a)
    import_state(fresh.params, fresh.optimizer, assemble(shards))
    s = rep_tr.tcfg.steps
    la, lb = rep_tr.step(s), fresh.step(s)
    if abs(la - lb) > TOL:
        problems.append(f"{tag}: loss after import {lb} != {la}")
    for p, q in zip(rep_tr.params, fresh.params):
        if _rel(q.detach(), p.detach()) > TOL:
            problems.append(f"{tag}: {p.shard.name} after import differs by {_rel(q.detach(), p.detach()):.2e}")


def _check_overlapped_gather(comm, corpus, m, t, problems, tag):
    """ZeRO-1's parameter all-gather overlaps the next forward: after ``step_async`` every
    bucket's gather is still pending, each block's forward waits for exactly its own buckets
    (later ones stay pending while the first blocks run), and the result is bit for bit the
    blocking gather's; evaluation and checkpoint export right after a step see fresh values."""
    from minitron.checkpoint import export_state
    from minitron.train import Trainer

    layout = ParallelConfig(dp=comm.size("dp"), zero1=True, bucket_mb=BUCKET_MB)
    lazy, eager = Trainer(m, layout, t, comm, corpus), Trainer(m, layout, t, comm, corpus)
    dp, gather, seen = lazy.dp, lazy.optimizer.gather, []

    def probe(block):
        def hook(module, args):  # registered after dp's own hook: runs once it has waited
            mine = {k for p in block.parameters() for k in dp.bucket_of[p]}
            seen.append((mine & set(gather.pending_gathers), set(gather.pending_gathers) - mine))
        return hook

    for block in lazy.model.blocks.values():
        block.register_forward_pre_hook(probe(block))
    for i in range(t.steps):
        lazy.step_async(i)
        eager.step_async(i)
        eager.optimizer.wait_params()  # the blocking gather
        if gather.pending_gathers != list(range(len(dp.buckets))):
            problems.append(f"{tag}: after step {i} pending gathers {gather.pending_gathers}, want every bucket")
    a, b = export_state(lazy.params, lazy.optimizer), export_state(eager.params, eager.optimizer)
    for name, ra in a.items():  # checkpoint export right after a step
        for k in ("param", "exp_avg", "exp_avg_sq"):
            if not torch.equal(ra[k], b[name][k]):
                problems.append(f"{tag}: exported {k} of {name} differs from the blocking gather")
    lazy.step_async(t.steps)
    eager.step_async(t.steps)
    eager.optimizer.wait_params()
    if lazy.evaluate(1) != eager.evaluate(1):  # evaluation right after a step
        problems.append(f"{tag}: evaluate after an overlapped step differs from the blocking one")
    for p, q in zip(lazy.params, eager.params):
        if not torch.equal(p, q):
            problems.append(f"{tag}: {p.shard.name} differs from the blocking gather")
    lazy.step_async(t.steps + 1)
    seen.clear()
    lazy.step(t.steps + 2)  # its forward consumes the gathers launched by the step before
    if not seen or any(stale for stale, _ in seen):
        problems.append(f"{tag}: a block ran before its bucket's gather was waited for: {seen}")
    if not seen[0][1]:
        problems.append(f"{tag}: nothing left pending when the first block ran (no overlap)")


def _dp_job(comm, M, corpus, extra_layout):
    """Every variant on this world; rank 0 also runs the single-device reference."""
    from minitron.checkpoint import gather_full
    from minitron.train import Trainer
    from minitron.tools.verify import compare, reference_run

    D, extra_layout = comm.size("dp"), dict(extra_layout)
    m = preset("tiny").replace(**extra_layout.pop("model", {}))
    t = TrainConfig(steps=3, global_batch=D * M * 2, microbatches=M, dtype="float64", lr=1e-2, warmup=1,
                    eval_every=0, progress=False, sample_tokens=0)
    problems, verdicts, trainers = [], {}, {}
    variants = extra_layout.pop("variants", VARIANTS)
    for impl, zero1 in variants:
        layout = ParallelConfig(dp=D, dp_impl=impl, zero1=zero1, bucket_mb=BUCKET_MB, **extra_layout)
        tag = f"rank {comm.grid.rank} {layout.describe()} {impl}"
        comm.trace.records.clear()
        tr = Trainer(m, layout, t, comm, corpus)
        losses = [tr.step(i) for i in range(t.steps)]
        _check_trace(tr, list(comm.trace.records), problems, tag)
        _check_memory(tr, problems, tag)
        full = gather_full(tr)
        if comm.grid.rank == 0:
            verdicts[(impl, zero1)] = (losses, full, tr.grad_norm)
        trainers[(impl, zero1)] = tr
    if ("bucketed", False) in trainers and ("bucketed", True) in trainers:
        _check_state_export(trainers[("bucketed", False)], trainers[("bucketed", True)], comm, corpus, problems,
                            f"rank {comm.grid.rank}")
    if comm.grid.world == 2:
        _check_overlapped_gather(comm, corpus, m, t, problems, f"rank {comm.grid.rank} overlap")
    if comm.grid.rank == 0:
        ref_losses, ref = reference_run(m, t.replace(microbatches=M * D), corpus, t.steps)
        for key, (losses, full, norm) in verdicts.items():
            res = compare(losses, full, ref_losses, ref)
            if res["max_loss_abs_diff"] > TOL or res["max_param_rel_diff"] > TOL:
                problems.append(f"{key}: {res}")
            if abs(norm - ref.grad_norm) > TOL * ref.grad_norm:  # Adam hides a gradient scale error
                problems.append(f"{key}: gradient norm {norm!r} != single device {ref.grad_norm!r}")
    return problems


@pytest.fixture(scope="module")
def corpus():
    from minitron.data import load_corpus

    return load_corpus("")


@pytest.mark.multirank
@pytest.mark.parametrize("D,M", [(2, 3), (4, 2), (8, 2)])
def test_data_parallel_equals_single_device(D, M, corpus):
    from minitron.tools.testing import run_on_ranks

    out = run_on_ranks(_dp_job, ParallelConfig(dp=D), M, corpus, {}, trace=True)
    problems = [p for r in sorted(out) for p in out[r]]
    assert not problems, "\n".join(problems[:20])


@pytest.mark.multirank
def test_data_parallel_with_tensor_parallel_and_grad_sync(corpus):
    """dp2 × tp2 with sequence parallelism (LayerNorm gradients summed over tp: ZeRO-1 must
    do that before its reduce-scatter) and tied embeddings (the norm counts one copy)."""
    from minitron.tools.testing import run_on_ranks

    extra = {"tp": 2, "sp": True, "model": {"tied_embeddings": True},
             "variants": [("bucketed", False), ("bucketed", True), ("naive", True)]}
    out = run_on_ranks(_dp_job, ParallelConfig(dp=2, tp=2), 2, corpus, extra, trace=True)
    problems = [p for r in sorted(out) for p in out[r]]
    assert not problems, "\n".join(problems[:20])
