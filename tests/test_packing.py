"""Packed documents (``--pack``, minitron/packing.py): the documents of a row, a packed
sequence's logits equal to each document run alone (float64), the FLOPs formula per document
equal to FlopCounterMode, the ring's chunk reach under documents equal to the analysis'
formula, --pack-balance document (padding masked out of the loss, chunks r and 2cp−1−r of
every document, the attention work per rank even), bad input in one line before any rank
starts, and on real ranks the oracle (float64 vs one device) on dp2, tp2+sp, cp2 ring, cp2
a2a, pp2, cp4 ring (documents and a window on alternate layers) and balanced per document on
cp2 and cp4 (ring and a2a), each traced step's bytes equal to the analysis, and the ring's
bytes fewer than the whole ring's where the documents end early."""
from __future__ import annotations

import random

import pytest
import torch

from minitron.analysis import comm_bytes_per_step
from minitron.analysis.comm import bytes_by_axis
from minitron.analysis.context_parallel import chunk_reach_of, cp_comm_items, document_last_chunks, window_ring_items
from minitron.config import PRESETS, ConfigError, ParallelConfig, TrainConfig, element_bytes, validate
from minitron.context import Context
from minitron.data import ByteCorpus
from minitron.model import GPT
from minitron.packing import SEPARATOR_BYTE, Documents, PackedCorpus
from minitron.parallel.context_parallel import ChunkMask
from minitron.tools.testing import run_cli, run_on_ranks, step_document_lengths, traced_step_bytes

TINY, LLAMA = PRESETS["tiny"], PRESETS["llama-tiny"]
SEP = chr(SEPARATOR_BYTE)


def _documents_text(n: int = 2500, seed: int = 0) -> str:
    """Short documents of words (3 to ~25 bytes), each ended by the separator."""
    r = random.Random(seed)
    words = "the of and to in is was he for it with as his on be at by had".split()
    return "".join(" ".join(r.choice(words) for _ in range(r.randint(1, 4))) + "." + SEP for _ in range(n))


CORPUS = ByteCorpus(_documents_text().encode())


def test_documents_of_a_row_restart_positions_and_drop_the_separators_loss():
    x = torch.tensor([[5, 6, SEPARATOR_BYTE, 7, SEPARATOR_BYTE, 8, 9, 9]])
    d = Documents.of(x, SEPARATOR_BYTE, scale=2.0)
    assert d.segments.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
    assert d.positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert d.loss_weight.tolist() == [[2.0, 2.0, 0.0, 2.0, 0.0, 2.0, 2.0, 2.0]]
    assert d.lengths() == [[3, 2, 3]]
    # chunks of 2: [0 0] [0 1] [1 2] [2 2]
    assert [d.pair_kind(a, b, 2) for a, b in ((0, 0), (1, 0), (2, 1), (2, 0), (3, 2), (3, 1), (3, 3))] == \
        ["full", "masked", "masked", "none", "masked", "none", "full"]


def test_packed_rows_start_at_documents_and_weigh_the_global_batch():
    """Every row begins with a document's first token; the weights average the global
    batch's counted tokens (T/N each, 0 on separators), whichever rows a rank takes."""
    packed = PackedCorpus(CORPUS, 32)
    x, y, d = packed.batch(8, 1234, 0)
    starts = torch.as_tensor(packed.starts)
    assert starts[0] == 0 and (CORPUS.tokens[starts[1:] - 1] == SEPARATOR_BYTE).all()  # after a separator
    windows = torch.stack([CORPUS.window(int(s), 33) for s in starts])
    for row_x, row_y in zip(x, y):  # each row is the corpus from one of those starts on
        assert (windows == torch.cat([row_x, row_y[-1:]])).all(1).any()
    assert (d.positions[:, 0] == 0).all() and torch.equal(y[:, :-1], x[:, 1:])
    assert float(d.loss_weight.sum()) == pytest.approx(x.numel())  # sum of T/N over N tokens = T
    _, _, half = packed.batch(8, 1234, 0, slice(4, 8))
    assert torch.equal(half.loss_weight, d.loss_weight[4:])


def test_the_training_loop_counts_the_documents_each_step_trained_on():
    """The MFU a --pack run logs (model_flops_per_s, which the run report's MFU reads) counts
    the global batch's documents of that very step, each at its own length, not s²: the
    rows step_document_lengths draws as the Trainer does, for every data replica."""
    import types

    from minitron.model_flops import model_flops_per_step
    from minitron.train import _step_flops

    cfg, layout = LLAMA.replace(seq_len=32), ParallelConfig(dp=2)
    tc = TrainConfig(global_batch=8, seed=1234, microbatches=2)
    tr = types.SimpleNamespace(mcfg=cfg, packed={"train": PackedCorpus(CORPUS.split()[0], 32)})
    for step in (0, 3):
        rows = [row for r in range(2) for mb in step_document_lengths(CORPUS, cfg, layout, tc, r, step) for row in mb]
        assert _step_flops(tr, tc, step) == model_flops_per_step(cfg, 8, documents=rows) < model_flops_per_step(cfg, 8)


@pytest.mark.parametrize("cfg", [TINY, LLAMA, LLAMA.replace(window=6)])
def test_packed_sequence_logits_equal_each_document_alone(cfg):
    """Block-diagonal causal attention and positions per document: each document's logits
    inside the packed row are those of the document alone (float64), and differ from the
    unmasked row's (the mask does something)."""
    torch.manual_seed(0)
    gpt = GPT(cfg, Context(dtype=torch.float64)).eval()
    docs = [torch.randint(0, 200, (n,)) for n in (5, 9, 12, 6)]
    for doc in docs:
        doc[-1] = SEPARATOR_BYTE
    x = torch.cat(docs)[None]
    with torch.no_grad():
        packed = gpt(x, docs=Documents.of(x, SEPARATOR_BYTE))
        start = 0
        for doc in docs:
            alone = gpt(doc[None])
            assert torch.allclose(packed[0, start:start + len(doc)], alone[0], rtol=0, atol=1e-12)
            start += len(doc)
        assert not torch.allclose(packed, gpt(x), atol=1e-3)


@pytest.mark.parametrize("cfg", [LLAMA, LLAMA.replace(window=6, window_layers="LG")])
def test_packed_flops_formula_equals_the_matmuls_a_packed_step_runs(cfg):
    """One device attends each document alone (a varlen kernel's work): PyTorch's
    FlopCounterMode over a packed training step equals model_flops_per_step with the rows'
    document lengths (Σ sᵢ², not s², per layer), below the unpacked count."""
    from torch.utils.flop_counter import FlopCounterMode

    from minitron.model_flops import model_flops_per_step

    x, y, docs = PackedCorpus(CORPUS, 32).batch(3, 7, 1)
    with FlopCounterMode(display=False) as counter:
        GPT(cfg).train()(x, y, docs=docs).backward()
    lengths = docs.lengths()
    assert len({len(row) for row in lengths} | {0}) > 2  # unequal documents, several per row
    assert counter.get_total_flops() == model_flops_per_step(cfg, 3, documents=lengths)
    assert model_flops_per_step(cfg, 3, documents=lengths) < model_flops_per_step(cfg, 3)
    causal = model_flops_per_step(cfg.replace(window=0), 3, causal=True, documents=lengths)
    full = model_flops_per_step(cfg.replace(window=0), 3, causal=True)
    core = 4 * cfg.heads * cfg.head_dim * 0.5 * 3 * cfg.layers  # the causal core: 2·q per pair, 3 passes
    assert full - causal == pytest.approx(core * sum(32 ** 2 - sum(n * n for n in row) for row in lengths))


def _skewed_text(n: int = 400, seed: int = 1) -> str:
    """Documents of very unequal lengths (3 to ~60 bytes): what a sequence-level split balances badly."""
    r = random.Random(seed)
    return "".join("x" * r.choice((2, 3, 4, 40, 60)) + "." + SEP for _ in range(n))


SKEWED = ByteCorpus(_skewed_text().encode())


@pytest.mark.parametrize("cfg", [TINY, LLAMA])
def test_padding_documents_does_not_change_the_loss(cfg):
    """--pack-balance document pads each document to a multiple of 2·cp: the padding is
    masked (it follows its document's tokens) and weighs 0, so a padded row's loss equals
    the loss of the same documents without the padding (float64)."""
    torch.manual_seed(0)
    gpt = GPT(cfg, Context(dtype=torch.float64)).eval()
    packed = PackedCorpus(CORPUS, 32, pad_to=8, balance="document")
    for step in range(3):
        x, y, d = packed.batch(1, 7, step)
        assert all(n % 8 == 0 for n in d.lengths()[0][:-1])  # the last document is cut
        keep = torch.ones(32, dtype=torch.bool)  # drop the padding: a separator after a separator
        keep[1:] = ~((x[0, 1:] == SEPARATOR_BYTE) & (x[0, :-1] == SEPARATOR_BYTE))
        assert keep.sum() < 32
        xu, yu = x[:, keep], y[:, keep]
        du = Documents.of(xu, SEPARATOR_BYTE, xu.numel() / int((xu != SEPARATOR_BYTE).sum()))
        with torch.no_grad():
            assert abs(float(gpt(x, y, docs=d)) - float(gpt(xu, yu, docs=du))) < 1e-12


def test_balanced_chunks_are_every_documents_and_even_out_the_attention_work():
    """Rank r holds chunks r and 2cp−1−r of every document (Megatron-Core's THD split): the
    ranks' tokens partition each row; the (query, key) pairs of each rank's queries counted
    on the engine's own mask equal the analysis', and on unequal documents the per-document
    split's most loaded rank carries less than the sequence split's."""
    from minitron.analysis.context_parallel import packed_attention_flops, packed_attention_pairs
    from minitron.parallel.context_parallel import chunk_ids, document_index, sees

    for n in (2, 4):
        _, _, seq = PackedCorpus(SKEWED, 32).batch(4, 3, 0)
        _, _, doc = PackedCorpus(SKEWED, 32, pad_to=2 * n, balance="document").batch(4, 3, 0)
        idx = [document_index(doc, n, r) for r in range(n)]
        assert torch.equal(torch.sort(torch.cat(idx, 1), 1).values, torch.arange(32).expand(4, 32))
        c = doc.cp_chunks(n)
        for row, lengths in enumerate(doc.lengths()):  # chunk r of the document at o: o + r·L/2n ..
            o = 0
            for length in lengths:
                assert c[0, row, :].tolist().count(o) == 1
                o += length
        seen = sees(32, 0, doc, "cpu")[:, 0].sum(-1)  # keys each query sees, on the engine's mask
        engine = [int(seen.gather(1, i).sum()) for i in idx]
        assert engine == packed_attention_pairs(n, doc.lengths(), "document")
        seq_seen = sees(32, 0, seq, "cpu")[:, 0].sum(-1)
        rows = torch.arange(32).view(2 * n, -1)
        assert [int(seq_seen[:, torch.cat([rows[a] for a in chunk_ids(n, r)])].sum()) for r in range(n)] == \
            packed_attention_pairs(n, seq.lengths())
        by_doc = packed_attention_flops(LLAMA, ParallelConfig(cp=n), doc.lengths(), "document")
        by_seq = packed_attention_flops(LLAMA, ParallelConfig(cp=n), seq.lengths())
        assert max(by_doc) / min(by_doc) < max(by_seq) / min(by_seq)


@pytest.mark.parametrize("n, window", [(2, 0), (4, 0), (4, 5)])
def test_ring_reach_under_documents_equals_the_analysis(n, window):
    """The engine's reach (chunk pairs that the documents, and a window, leave non-empty)
    equals the analysis' (the chunk where the document of a chunk's last token ends)."""
    x, _, docs = PackedCorpus(CORPUS, 32).batch(3, 7, 1)
    c = 32 // (2 * n)
    rule = ChunkMask(n, c, window, docs)
    assert rule.reach == chunk_reach_of(n, document_last_chunks(n, c, docs.lengths(), window))
    # the documents shorten the travel of the ring with one document per row (a window may already)
    one = ChunkMask(n, c, window, Documents.of(torch.zeros_like(x), SEPARATOR_BYTE)).reach
    assert all(rule.reach[k] <= one[k] for k in one)
    assert window or sum(rule.reach.values()) < sum(one.values())


@pytest.mark.parametrize("model, layout, words", [
    (PRESETS["deepseek-v3-tiny"], ParallelConfig(), "drop --attention mla or --pack"),
    (LLAMA.replace(mtp_depths=1), ParallelConfig(), "drop --mtp-depths or --pack"),
    (LLAMA, ParallelConfig(tp=4, tp_mode="2d"), "use --tp-mode 1d"),
])
def test_unsupported_combinations_are_one_line(model, layout, words):
    with pytest.raises(ConfigError) as e:
        validate(model, layout, TrainConfig(pack=True, global_batch=4))
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("model, train, words", [
    (LLAMA, TrainConfig(pack_balance="document"), "--pack-balance document needs --pack"),
    (LLAMA, TrainConfig(pack=True, pack_balance="row"), "unknown --pack-balance 'row'"),
    (LLAMA.replace(window=6), TrainConfig(pack=True, pack_balance="document", pack_pad=4), "drop --window"),
    (LLAMA, TrainConfig(pack=True, pack_balance="document", pack_pad=2), "set pack_pad to a multiple of 4"),
    (LLAMA.replace(seq_len=36), TrainConfig(pack=True, pack_balance="document", pack_pad=8), "not a multiple of"),
])
def test_document_balance_refusals_are_one_line(model, train, words):
    with pytest.raises(ConfigError) as e:
        validate(model, ParallelConfig(cp=2), train.replace(global_batch=4))
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_corpus_without_separators_is_refused_before_any_rank(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text(_documents_text().replace(SEP, "\n"))
    code, out, err = run_cli(["verify", "--nproc", "2", "--dp", "2", "--pack", "--data", str(plain)], timeout=120)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "no document separator (byte 0x1E" in lines[0], err
    assert "verify: starting" not in err


# --- on real ranks: the oracle and the traced bytes ----------------------------------------------------
VERIFY = [  # (name, model, layout, --pack-balance)
    ("dp2 tp2", TINY, ParallelConfig(dp=2, tp=2), "sequence"),
    ("tp2 sp", LLAMA, ParallelConfig(tp=2, sp=True, dp=2), "sequence"),
    ("cp2 ring", LLAMA, ParallelConfig(cp=2, dp=2), "sequence"),
    ("cp2 a2a", LLAMA.replace(kv_heads=4), ParallelConfig(cp=2, dp=2, cp_mode="a2a"), "sequence"),
    ("pp2", LLAMA, ParallelConfig(pp=2, dp=2), "sequence"),
    ("cp4 ring window", LLAMA.replace(window=9, window_layers="LG"), ParallelConfig(cp=4), "sequence"),
    ("cp2 ring per document", LLAMA, ParallelConfig(cp=2, dp=2), "document"),
    ("cp2 a2a per document", LLAMA.replace(kv_heads=4), ParallelConfig(cp=2, dp=2, cp_mode="a2a"), "document"),
    ("cp4 ring per document", LLAMA, ParallelConfig(cp=4), "document"),
    ("cp4 a2a per document", LLAMA, ParallelConfig(cp=4, cp_mode="a2a"), "document"),
]


def _train(layout: ParallelConfig, balance: str = "sequence") -> TrainConfig:
    m = 2 if layout.pp > 1 else 1
    return TrainConfig(steps=2, global_batch=2 * layout.dp * m, microbatches=m, dtype="float64", lr=1e-2, warmup=1,
                       eval_every=0, progress=False, pack=True, pack_balance=balance,
                       pack_pad=2 * layout.cp if balance == "document" else 0)


def _all_layouts(comm, corpus):
    from minitron.comm import Comm, CommTrace
    from minitron.grid import ProcessGrid
    from minitron.tools.verify import verify_job

    rank, out = comm.grid.rank, {}
    for name, model, layout, balance in VERIFY:
        grid = ProcessGrid(tp=layout.tp, dp=layout.dp, pp=layout.pp, cp=layout.cp, rank=rank).build_groups()
        c = Comm(grid, CommTrace())
        res = verify_job(c, model, layout, _train(layout, balance), corpus, None)
        out[name] = (res, (c.index("cp"), c.grid.data_index(), c.index("pp")), traced_step_bytes(c.trace.records, rank))
    return out


def _ring_formula(model, layout, train, cp_rank, dp_rank) -> dict:
    """The packed ring's bytes of one context rank in step 0: its microbatches' documents."""
    items = window_ring_items(model, layout, train, cp_rank, act_bytes=element_bytes(train.dtype),
                              documents=step_document_lengths(CORPUS, model, layout, train, dp_rank),
                              balance=train.pack_balance)
    return {op: b for op, b in bytes_by_axis(items).get("cp", {}).items() if b}


@pytest.mark.multirank
def test_packed_layouts_equal_one_device_and_the_analysis_on_four_ranks():
    for _, model, layout, balance in VERIFY:
        validate(model, layout, _train(layout, balance))
    results = run_on_ranks(_all_layouts, ParallelConfig(dp=4), CORPUS)
    fewer = False
    for name, model, layout, balance in VERIFY:
        res = results[0][name][0]
        assert res["ok"] and res["max_param_rel_diff"] <= 1e-9 and res["max_loss_abs_diff"] <= 1e-9, (name, res)
        train = _train(layout, balance)
        for rank, by_name in results.items():
            _, (cp_rank, dp_rank, pp_rank), got = by_name[name]
            want = comm_bytes_per_step(model, layout, train, pp_rank=pp_rank)
            if layout.cp > 1 and layout.cp_mode == "ring":  # the documents decide each rank's bytes
                ring = got.pop("cp")
                assert ring == _ring_formula(model, layout, train, cp_rank, dp_rank), (name, rank)
                whole = bytes_by_axis(cp_comm_items(LLAMA, layout, train, act_bytes=8))["cp"]
                assert ring["send"] <= whole["send"], (name, rank)
                fewer |= ring["send"] < whole["send"]
                want = {a: ops for a, ops in want.items() if a != "cp"}
            assert got == want, (name, rank, got, want)
    assert fewer  # some chunk went fewer hops than the whole ring's
