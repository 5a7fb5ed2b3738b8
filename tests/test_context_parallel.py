"""Context parallelism (--cp N): chunks, the online softmax, the grid, bad input, and on
real ranks the oracle (float64 vs one device), traced bytes = analysis and activation
memory per rank falling as 1/N."""
from __future__ import annotations

import pytest
import torch

from minitron.analysis import comm_bytes_per_step, memory_on_rank
from minitron.analysis.context_parallel import cp_activation_table, cp_comm_items, cp_message_elements
from minitron.comm import Comm
from minitron.config import ConfigError, ModelConfig, ParallelConfig, PRESETS, TrainConfig, validate
from minitron.grid import ProcessGrid
from minitron.parallel.context_parallel import (block_attention, chunk_ids, combine, local_positions,
                                                local_tokens)
from minitron.tools.testing import run_cli, run_on_ranks


def _comm(cp: int, r: int) -> Comm:
    """A Comm that knows its place on a context ring (rank arithmetic only, no processes)."""
    return Comm(ProcessGrid(cp=cp, rank=r))


# --- which tokens a rank holds -------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_chunks_cover_the_sequence_once_and_balance_causal_work(n):
    s = 8 * n
    seq = torch.arange(s).unsqueeze(0)  # a "batch" whose tokens are their positions
    held, work = [], []
    for r in range(n):
        comm = _comm(n, r)
        pos = local_positions(s // n, comm)
        pos = torch.arange(s)[pos] if isinstance(pos, slice) else pos
        assert torch.equal(local_tokens(seq, comm)[0], pos)  # tokens and positions agree
        if n > 1:
            a, b = chunk_ids(n, r)
            c = s // (2 * n)
            assert pos.tolist() == list(range(a * c, (a + 1) * c)) + list(range(b * c, (b + 1) * c))
        held += pos.tolist()
        work.append(int((pos + 1).sum()))  # causal (query, key) pairs of this rank's queries
    assert sorted(held) == list(range(s))
    assert len(set(work)) == 1, work  # chunks r and 2N-1-r: every rank the same attention work


def test_online_softmax_combination_equals_full_attention():
    """Blocks of keys in any order, combined by log-sum-exp rescaling, give softmax(QKᵀ)V."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64) * 3
    k = torch.randn(2, 3, 12, 4, generator=g, dtype=torch.float64) * 3
    v = torch.randn(2, 3, 12, 4, generator=g, dtype=torch.float64)
    scale = 0.5
    want = torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1) @ v
    blocks = [(7, 12), (0, 3), (3, 7)]
    out, lse = block_attention(q, k[..., 7:12, :], v[..., 7:12, :], scale, causal=False)
    for a, b in blocks[1:]:
        out, lse = combine(out, lse, *block_attention(q, k[..., a:b, :], v[..., a:b, :], scale, causal=False))
    assert torch.allclose(out, want, rtol=1e-12, atol=1e-12)
    assert torch.allclose(lse, torch.logsumexp(q @ k.transpose(-2, -1) * scale, dim=-1), rtol=1e-12)


# --- the grid ---------------------------------------------------------------------------------------------
def test_grid_places_cp_between_tp_and_dp():
    g = ProcessGrid(tp=2, cp=2, dp=2, pp=2)
    assert g.world == 16
    for r in range(16):
        c = g.coord(r)
        assert r == c.tp + 2 * c.cp + 4 * c.dp + 8 * c.pp == g.rank_of(c.tp, c.dp, c.pp, c.cp)
    assert g.all_groups("cp")[:2] == [[0, 2], [1, 3]]
    assert g.all_groups("dp")[:2] == [[0, 4], [1, 5]]
    assert g.all_groups("dp_cp")[:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]  # gradients averaged here
    assert "dp_cp" in g.axes() and "dp_cp" not in ProcessGrid(tp=2, dp=2).axes()


# --- bad input: one line, before any rank starts -----------------------------------------------------
@pytest.mark.parametrize("model, layout, words", [
    (PRESETS["tiny"].replace(seq_len=30), ParallelConfig(cp=2), "divisible by 4"),
    (PRESETS["tiny"].replace(seq_len=24), ParallelConfig(cp=2, tp=4, sp=True, nproc=8), "2*cp*tp = 16"),
    (PRESETS["tiny"].replace(hidden=64, heads=4, ffn=256), ParallelConfig(cp=2, tp=8, tp_mode="3d"), "--tp-mode 1d"),
    (PRESETS["tiny"].replace(dropout=0.1), ParallelConfig(cp=2), "--dropout 0"),
    (PRESETS["tiny"], ParallelConfig(cp=0), "--cp must be at least 1"),
    (PRESETS["tiny"], ParallelConfig(cp=2, dp=2, nproc=2), "dp*tp*pp*cp"),
])
def test_bad_input_is_one_line(model, layout, words):
    with pytest.raises(ConfigError) as e:
        validate(model, layout)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_bad_input_from_the_command_line_before_any_rank():
    code, out, err = run_cli(["verify", "--nproc", "2", "--cp", "2", "--seq-len", "30"], timeout=120)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "--seq-len 30 must be divisible by 4" in lines[0], err


# --- the analysis -------------------------------------------------------------------------------------------
def test_ring_bytes_follow_the_formula():
    """Per layer and microbatch: 3(N−1) messages of K, V (forward, backward, and the dK, dV
    accumulators), 4(N−1) with recomputation; each 2·b·(s/N)·(h/t) elements."""
    m = PRESETS["small"]
    t = TrainConfig(global_batch=8, microbatches=2)
    for n, tp, rc in ((2, 1, "none"), (4, 2, "none"), (4, 1, "selective"), (2, 2, "full")):
        p = ParallelConfig(cp=n, tp=tp, recompute=rc)
        b = t.global_batch // t.microbatches
        el = 2 * b * (m.seq_len // n) * (m.hidden // tp)
        assert cp_message_elements(m, b, tp, n) == el
        per = (4 if rc != "none" else 3) * (n - 1) * m.layers * t.microbatches * el * 4
        assert comm_bytes_per_step(m, p, t)["cp"] == {"send": per, "recv": per}
    assert cp_comm_items(m, ParallelConfig(), t) == []


def test_activation_memory_per_rank_falls_as_one_over_n_in_the_model():
    rows = cp_activation_table(PRESETS["tiny"], ParallelConfig(), TrainConfig(global_batch=2),
                               cps=(1, 2, 4), seq_lens=(256, 2048))
    for r in rows:
        assert abs(r["ratio"] / r["cp"] - 1) < 0.01, r


# --- on real ranks ----------------------------------------------------------------------------------------------
def _by_axis(records, rank, step=0) -> dict:
    out: dict = {}
    for r in records:
        if r["rank"] == rank and r["step"] == step and r["phase"] != "log":
            ops = out.setdefault(r["axis"], {})
            ops[r["op"]] = ops.get(r["op"], 0) + r["bytes"]
    return out


@pytest.mark.multirank
def test_cp2_verifies_and_its_traced_bytes_equal_the_analysis(tmp_path):
    """`minitron verify --cp 2 --dtype float64` on 2 ranks, traced: each rank's step-0 bytes
    per (axis, op) equal comm_bytes_per_step (the ring's K, V and dK, dV on 'cp', the
    gradient all-reduce on 'dp_cp')."""
    import json

    from minitron.comm import read_trace

    trace = tmp_path / "t.jsonl"
    code, out, err = run_cli(["verify", "--nproc", "2", "--cp", "2", "--dtype", "float64", "--json",
                              "--trace", str(trace)], timeout=300)
    assert code == 0, err[-2000:]
    res = json.loads(out.strip().splitlines()[-1])
    assert res["ok"] and res["max_param_rel_diff"] <= 1e-9, res
    want = comm_bytes_per_step(PRESETS["tiny"], ParallelConfig(cp=2, dropout_rng="global"),
                               TrainConfig(global_batch=2, dtype="float64"))
    records = read_trace(trace)
    assert {r["dtype"] for r in records if r["axis"] == "cp"} == {"float64"}
    for rank in (0, 1):
        assert _by_axis(records, rank) == want, rank


VERIFY_LAYOUTS = [
    ParallelConfig(cp=4),
    ParallelConfig(cp=2, dp=2),
    ParallelConfig(cp=2, dp=2, zero1=True),
    ParallelConfig(cp=2, tp=2, sp=True),
    ParallelConfig(cp=2, pp=2),
]
# one traced step: K and V on the wire in bf16, dK and dV in fp32, the ring run again by
# selective recomputation
TRACED_BF16 = ParallelConfig(cp=2, tp=2, recompute="selective", precision="bf16")
TRACED_TRAIN = TrainConfig(global_batch=4, microbatches=2, progress=False)
LONG = ModelConfig(layers=2, hidden=32, heads=4, seq_len=1024, vocab=256, name="long")
MEMORY_LAYOUTS = [ParallelConfig(dp=4), ParallelConfig(cp=2, dp=2), ParallelConfig(cp=4)]


def _comm_for(layout: ParallelConfig, rank: int, trace: bool):
    """A communication door with the grid of `layout`, on the ranks already started."""
    from minitron.comm import CommTrace

    grid = ProcessGrid(tp=layout.tp, dp=layout.dp, pp=layout.pp, cp=layout.cp, rank=rank).build_groups()
    return Comm(grid, CommTrace() if trace else None)


def _verify_train(layout: ParallelConfig) -> TrainConfig:
    m = 2 if layout.pp > 1 else 1
    return TrainConfig(steps=3, global_batch=2 * layout.dp * m, microbatches=m, dtype="float64", lr=1e-2,
                       warmup=1, eval_every=0, progress=False)


def _many_layouts(comm):
    """Every 4-rank check in one launch: the oracle with traced bytes per layout, then the
    activation memory of a long sequence at cp = 1, 2, 4 (same microbatch on every rank)."""
    from minitron.data import load_corpus
    from minitron.tools.measure import measure_step_memory
    from minitron.train import Trainer
    from minitron.tools.verify import verify_job

    corpus, rank = load_corpus(""), comm.grid.rank
    out = {"verify": {}, "memory": {}}
    for layout in VERIFY_LAYOUTS:
        c = _comm_for(layout, rank, trace=True)
        res = verify_job(c, PRESETS["tiny"], layout, _verify_train(layout), corpus, None)
        out["verify"][layout.describe()] = (res, c.index("pp"), _by_axis(c.trace.records, rank))
    c = _comm_for(TRACED_BF16, rank, trace=True)
    Trainer(PRESETS["tiny"], TRACED_BF16, TRACED_TRAIN, c, corpus).step(0)
    out["bf16"] = (c.index("pp"), _by_axis(c.trace.records, rank),
                   {r["dtype"] for r in c.trace.records if r["axis"] == "cp"})
    for layout in MEMORY_LAYOUTS:
        c = _comm_for(layout, rank, trace=False)
        tr = Trainer(LONG, layout, TrainConfig(global_batch=layout.dp, progress=False), c, corpus)
        out["memory"][layout.cp] = measure_step_memory(tr)["activations_bytes"]
        del tr
    return out


@pytest.mark.multirank
def test_cp_layouts_on_four_ranks_equal_one_device_and_the_analysis():
    for layout in VERIFY_LAYOUTS:
        validate(PRESETS["tiny"], layout, _verify_train(layout))
    results = run_on_ranks(_many_layouts, ParallelConfig(cp=4))
    for layout in VERIFY_LAYOUTS:
        name = layout.describe()
        res = results[0]["verify"][name][0]
        assert res["ok"] and res["max_param_rel_diff"] <= 1e-9 and res["max_loss_abs_diff"] <= 1e-9, (name, res)
        for rank, r in results.items():
            _, pp_rank, got = r["verify"][name]
            want = comm_bytes_per_step(PRESETS["tiny"], layout, _verify_train(layout), pp_rank=pp_rank)
            assert got == want, (name, rank, got, want)
    for rank, r in results.items():
        pp_rank, got, dtypes = r["bf16"]
        assert got == comm_bytes_per_step(PRESETS["tiny"], TRACED_BF16, TRACED_TRAIN, pp_rank=pp_rank), (rank, got)
        assert dtypes == {"bfloat16", "float32"}  # K, V in bf16; the dK, dV accumulators in fp32
    # activation memory per rank: measured 1/N of one rank's at cp = 1 (within 10 %), and
    # equal to the analysis (same microbatch of one sequence on every rank)
    base = results[0]["memory"][1]
    print(f"\nactivations per rank, s = {LONG.seq_len}: " + ", ".join(
        f"cp{n}: {results[0]['memory'][n] / 2**20:.2f} MiB" for n in (1, 2, 4)))
    for layout in MEMORY_LAYOUTS:
        n = layout.cp
        for rank, r in results.items():
            got = r["memory"][n]
            assert abs(base / got / n - 1) <= 0.10, (n, rank, base, got)
            want = memory_on_rank(LONG, layout, TrainConfig(global_batch=layout.dp))["activations_bytes"]
            assert abs(got / want - 1) <= 0.01, (n, rank, got, want)
