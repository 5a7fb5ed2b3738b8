"""The Llama family's block (RMSNorm, SwiGLU, rotary positions, grouped-query attention, no
biases) on every layout: the oracle (float64, 1e-9) with kv_heads < heads, including
tensor parallelism wider than the key/value heads (each kv head replicated on the ranks
holding its queries), sequence and context parallelism (rotary angles of the tokens'
global positions), pipeline, ZeRO-3, the 2-D grid and the cube; the traced bytes of each
against the analysis; rotary positions against transformers' rotate-half convention."""
import pytest
import torch

from minitron.config import LLAMA, ConfigError, ModelConfig, ParallelConfig, TrainConfig, validate
from minitron.tools.testing import run_on_ranks

# 8 query heads, so that kv_heads 1, 2 and 4 are all grouped (kv < heads)
LLAMA_8 = ModelConfig(layers=2, hidden=64, heads=8, kv_heads=2, ffn=96, seq_len=16, vocab=256,
                      name="llama-8h", **LLAMA)


def _train(layout: ParallelConfig) -> TrainConfig:
    m = 2 if layout.pp > 1 else 1
    pieces = {"2d": layout.summa_q * layout.tp_depth, "2.5d": layout.summa_q * layout.tp_depth,
              "3d": layout.cube_q ** 2}.get(layout.tp_mode, 1)  # the grids split the batch
    return TrainConfig(steps=2, global_batch=2 * layout.dp * m * pieces, microbatches=m, dtype="float64",
                       lr=1e-2, warmup=1, eval_every=0, progress=False)


def _kv(n: int) -> ModelConfig:
    return LLAMA_8.replace(kv_heads=n)


# (model, layout) pairs run in one launch of 4 ranks; dp2 x tp2 x pp2 in one of 8
FOUR = ([(_kv(n), ParallelConfig(tp=4)) for n in (1, 2, 4)]  # t = 4 > kv for kv 1, 2
        + [(_kv(2), ParallelConfig(tp=4, sp=True))]
        + [(_kv(n), ParallelConfig(dp=2, tp=2)) for n in (1, 2, 4)]  # tp2: kv 1 replicated, 2 and 4 split
        + [(_kv(1), ParallelConfig(dp=2, tp=2, sp=True)),
           (_kv(1), ParallelConfig(tp=2, cp=2)),  # ring x tp, each kv head replicated on both tp ranks
           (_kv(2), ParallelConfig(dp=2, cp=2)),
           (_kv(1), ParallelConfig(dp=2, cp=2, cp_mode="a2a")),  # Ulysses, the kv head sent to both ranks
           (_kv(2), ParallelConfig(tp=2, cp=2, cp_mode="a2a")),  # Ulysses x tp: one kv head per rank each way
           (_kv(2).replace(layers=4), ParallelConfig(dp=2, pp=2, vpp=2, schedule="interleaved")),
           (_kv(2), ParallelConfig(dp=4, zero=3)),
           (_kv(2), ParallelConfig(tp=4, tp_mode="2d"))])
EIGHT = [(_kv(1), ParallelConfig(dp=2, tp=2, pp=2)),
         (_kv(2), ParallelConfig(tp=8, tp_mode="3d"))]  # the cube: kv heads split over q = 2


def _comm_for(layout: ParallelConfig, rank: int):
    """A traced communication door on `layout`'s grid over the ranks already started
    (collective: every rank builds the same groups in the same order)."""
    from minitron.comm import Comm, CommTrace
    from minitron.grid import ProcessGrid

    grid = ProcessGrid(tp=layout.tp, dp=layout.dp, pp=layout.pp, cp=layout.cp, rank=rank,
                       cube=layout.tp_mode == "3d",
                       summa_depth=layout.tp_depth if layout.tp_mode in ("2d", "2.5d") else 0)
    return Comm(grid.build_groups(), CommTrace())


def _by_axis(records, rank: int, step: int = 0) -> dict:
    out: dict = {}
    for r in records:
        if r["rank"] == rank and r["step"] == step and r["phase"] != "log":
            ops = out.setdefault(r["axis"], {})
            ops[r["op"]] = ops.get(r["op"], 0) + r["bytes"]
    return out


def _layouts_job(comm, cases):
    """Every case on this launch's ranks: the oracle's verdict and step 0's traced bytes."""
    from minitron.data import load_corpus
    from minitron.tools.verify import verify_job

    corpus, rank, out = load_corpus(""), comm.grid.rank, []
    for model, layout in cases:
        c = _comm_for(layout, rank)
        res = verify_job(c, model, layout, _train(layout), corpus, None)
        out.append((res, c.index("pp"), _by_axis(c.trace.records, rank)))
    return out


def _launch(cases, world: int) -> dict:
    for model, layout in cases:
        validate(model, layout, _train(layout), world=world)
    return run_on_ranks(_layouts_job, ParallelConfig(dp=world), cases)


@pytest.fixture(scope="module")
def four():
    return _launch(FOUR, 4)


@pytest.fixture(scope="module")
def eight():
    return _launch(EIGHT, 8)


def _check_oracle(results, cases):
    for i, (model, layout) in enumerate(cases):
        res = results[0][i][0]
        name = f"{layout.describe()} kv{model.n_kv_heads}"
        print(f"{name:<40} loss diff {res['max_loss_abs_diff']:.1e}  param rel diff {res['max_param_rel_diff']:.1e}")
        assert res["ok"] and res["max_loss_abs_diff"] <= 1e-9 and res["max_param_rel_diff"] <= 1e-9, (name, res)


@pytest.mark.multirank
def test_llama_layouts_on_four_ranks_equal_one_device(four):
    """verify --dtype float64 (1e-9): tp4 with kv 1, 2, 4; tp4 + sp; tp2 with kv 1, 2, 4 (x dp2);
    tp2 + sp; ring cp2 x tp2 with a replicated kv head; cp2; all-to-all cp2 (and x tp2);
    pp2 interleaved; ZeRO-3; 2-D tp4."""
    _check_oracle(four, FOUR)


@pytest.mark.multirank
def test_llama_dp_tp_pp_and_the_cube_on_eight_ranks_equal_one_device(eight):
    _check_oracle(eight, EIGHT)


@pytest.mark.multirank
def test_context_parallel_bytes_equal_the_formulas(four):
    """The 'cp' axis of a traced step: the ring passes only the kv heads (2·b·(s/N)·kv_t·d per
    message) and Ulysses' all-to-alls move b·(s/N)·d·(2·nh_t + 2·kv_sent) per pass."""
    from minitron.analysis.calls import bytes_by_axis
    from minitron.analysis.context_parallel import cp_comm_items

    for i, (model, layout) in enumerate(FOUR):
        if layout.cp == 1:
            continue
        for rank, r in four.items():
            got = r[i][2].get("cp")
            want = bytes_by_axis(cp_comm_items(model, layout, _train(layout), r[i][1], 8))["cp"]
            assert got == want, (layout.describe(), layout.cp_mode, rank, got, want)


def _analysis_mismatches(results, cases) -> list:
    from minitron.analysis.comm import comm_bytes_per_step

    bad = []
    for i, (model, layout) in enumerate(cases):
        for rank, r in results.items():
            _, pp_rank, got = r[i]
            try:
                want = comm_bytes_per_step(model, layout, _train(layout), pp_rank=pp_rank)
            except Exception as e:  # a layout the analysis does not model yet
                want = repr(e)
            if got != want:
                bad.append((layout.describe(), model.n_kv_heads, rank, got, want))
    return bad


@pytest.mark.multirank
def test_llama_traced_bytes_equal_the_analysis(four, eight):
    """A traced step of each layout equals comm_bytes_per_step per axis and operation (the
    analysis reads the model: replicated kv heads, Ulysses, ZeRO-3, the 2-D grid, the cube)."""
    bad = _analysis_mismatches(four, FOUR) + _analysis_mismatches(eight, EIGHT)
    for b in bad[:6]:
        print(b)
    assert not bad, f"{len(bad)} rank-layouts differ"


# --- rotary positions and grouped-query attention against transformers ------------------------
def _hf_llama(kv: int, theta: float = 10000.0, seed: int = 0):
    """A random transformers LlamaForCausalLM (float64), its norms' weights not all ones and
    its queries and keys scaled up (sharp attention, where positions matter)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    c = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=kv, max_position_embeddings=32,
                                 rope_theta=theta, rms_norm_eps=1e-5)
    m = transformers.LlamaForCausalLM(c).double().eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
            elif n.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(10.0)
    return m


def _minitron_from(state: dict, cfg: ModelConfig):
    from minitron import hf
    from minitron.checkpoint import import_state
    from minitron.context import Context
    from minitron.model import GPT

    g = GPT(cfg, Context(dtype=torch.float64)).eval()
    import_state(list(g.parameters()), None, {k: {"param": v} for k, v in hf.from_hf(state, cfg).items()})
    return g


# transformers' RMSNorm normalises in float32 even for a float64 model (LlamaRMSNorm casts up
# to float32 and back), so its float64 logits carry float32 rounding: ~5e-8 here. A wrong
# rotary convention or head grouping moves them by orders of magnitude more.
HF_FLOOR = 1e-6


@pytest.mark.parametrize("kv", [1, 2, 4])
def test_rotary_and_grouped_heads_equal_transformers(kv):
    """minitron's single-device Llama, weights taken from transformers' state dict without any
    permutation, gives transformers' logits: rotate-half pairs (i, i + d/2), query head i on
    kv head i // G, SwiGLU, RMSNorm; a rotation by interleaved pairs (Meta's original layout)
    does not, nor does θ = 500,000 on a 10,000 model."""
    m = _hf_llama(kv)
    cfg = ModelConfig(layers=2, hidden=32, heads=4, kv_heads=0 if kv == 4 else kv, ffn=64, seq_len=32,
                      vocab=256, norm_eps=1e-5, **LLAMA)
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = m(idx).logits
        got = _minitron_from(m.state_dict(), cfg)(idx)
        assert (got - want).abs().max().item() < HF_FLOOR
        # q, k rows permuted to the interleaved convention: the same weights read as neighbour pairs
        d = cfg.head_dim
        perm = torch.arange(d).view(2, d // 2).t().flatten()  # (0, d/2, 1, d/2+1, ...)
        bad = {k: (v.view(-1, d, v.shape[-1])[:, perm].reshape(v.shape) if k.endswith(("q_proj.weight", "k_proj.weight"))
                   else v) for k, v in m.state_dict().items()}
        assert (_minitron_from(bad, cfg)(idx) - want).abs().max().item() > 1e3 * HF_FLOOR
        other = _minitron_from(m.state_dict(), cfg.replace(rope_base=500000.0))(idx)
        assert (other - want).abs().max().item() > 1e3 * HF_FLOOR


def test_rotary_angles_follow_global_positions():
    """The angles of context rank r are those of its chunks r and 2N-1-r."""
    from minitron.model import rotary_angles

    cos, sin = rotary_angles(slice(0, 16), 8, 10000.0, "cpu")
    pos = torch.cat([torch.arange(4, 8), torch.arange(8, 12)])  # rank 1 of N = 2: chunks 1 and 2
    c1, s1 = rotary_angles(pos, 8, 10000.0, "cpu")
    assert torch.equal(c1, cos[pos]) and torch.equal(s1, sin[pos])


@pytest.mark.parametrize("model,layout,words", [
    (LLAMA_8.replace(heads=12, kv_heads=6, hidden=96), ParallelConfig(tp=4), "neither split"),
    (_kv(2), ParallelConfig(tp=4, dp=2, zero=2), "--zero 2"),
    (_kv(1), ParallelConfig(tp=4, tp_mode="2d"), "--kv-heads 1 must be divisible by 2"),
])
def test_kv_heads_no_layout_can_split_are_refused_in_one_line(model, layout, words):
    with pytest.raises(ConfigError) as e:
        validate(model, layout, _train(layout))
    assert words in str(e.value) and "\n" not in str(e.value)
