"""The analysis reads the model itself (analysis/dry_run.py): for every combination of the
architecture knobs its parameter counts and saved-activation bytes equal what the built
model holds in a real step; for GPT-2 shapes the papers' closed forms and the item tables
equal the derived figures."""
import itertools

import pytest
import torch

from minitron.analysis import dry_run, memory, params
from minitron.comm import Comm
from minitron.config import PRESETS, ModelConfig, ParallelConfig, validate_model
from minitron.context import Context
from minitron.grid import ProcessGrid
from minitron.model import GPT

KNOBS = list(itertools.product(("gelu", "swiglu"), ("layernorm", "rmsnorm"), (4, 2, 1), (True, False)))


def _model(act, norm, kv, bias) -> ModelConfig:
    m = ModelConfig(layers=2, hidden=32, heads=4, kv_heads=kv, ffn=48, seq_len=16, vocab=70,
                    activation=act, norm=norm, bias=bias)
    validate_model(m)
    return m


def _built(m: ModelConfig, t: int, rank: int, **layout) -> GPT:
    lay = ParallelConfig(tp=t, **layout)
    return GPT(m, Context(Comm(ProcessGrid(tp=t, rank=rank)), lay, torch.float64))


@pytest.mark.parametrize("act,norm,kv,bias", KNOBS)
def test_params_read_off_the_model(act, norm, kv, bias):
    m = _model(act, norm, kv, bias)
    for t in (1, 2, 4):
        for r in sorted({0, t - 1}):
            g = _built(m, t, r)
            assert params.params_on_rank(m, ParallelConfig(tp=t)) == sum(p.numel() for p in g.parameters())
            assert params.local_layer_params(m, t, "1d") == sum(p.numel() for p in g.blocks["0"].parameters())


def _saved_in_a_real_step(m: ModelConfig, b: int, **layout) -> int:
    """What one real block keeps for its backward (distinct storages, parameters excluded)."""
    lay = ParallelConfig(**layout)
    stage = GPT(m, Context(Comm(ProcessGrid()), lay, torch.float32), layer_ids=[0], first=False, last=False)
    stage.train()
    exclude = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in exclude:
            seen[st.data_ptr()] = st.nbytes()
        return t

    x = torch.randn(stage.boundary_shape(b), requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stage(x, None, (0, 0))
    return sum(seen.values())


@pytest.mark.parametrize("act,norm,kv,bias", KNOBS)
def test_saved_bytes_read_off_the_model(act, norm, kv, bias):
    m = _model(act, norm, kv, bias)
    for rc in ("none", "selective"):
        assert dry_run.block_saved_bytes(m, ParallelConfig(recompute=rc), 3, 4) == _saved_in_a_real_step(m, 3, recompute=rc)


def test_gpt2_closed_forms_equal_the_derived_figures():
    """PTD-P Eq. 2's layer (12h² + 13h with f = 4h; 4h² + 2hf + 9h + f in general) and the
    saved-bytes table of memory.saved_bytes_per_layer (Korthikanti Table 2, item by item)."""
    for name in ("tiny", "small", "megatron-8.3b", "gpt3-175b"):
        m = PRESETS[name]
        h = m.hidden
        assert params.layer_param_count(m) == dry_run.block_params(m, ParallelConfig()) == 12 * h * h + 13 * h
        assert params.param_count(m) == dry_run.ends_params(m, ParallelConfig(), True, True) + m.layers * params.layer_param_count(m)
    m = PRESETS["small"]
    for (t, sp, rc), drop in itertools.product(((1, False, "none"), (2, False, "none"), (2, True, "none"),
                                                (2, True, "selective"), (2, False, "full")), (0.0, 0.1)):
        md = m.replace(dropout=drop)
        for b in (1, 4):  # (b = 1: a copy of K and V made for nothing once showed here, 8·s·b·h bytes)
            table = sum(memory.saved_bytes_per_layer(md, b, t, sp, rc, 4).values())
            assert dry_run.block_saved_bytes(md, ParallelConfig(tp=t, sp=sp, recompute=rc), b, 4) == table, (t, sp, rc, b)
        for first, last in ((True, False), (False, True)):
            ends = sum(memory.stage_activation_bytes(md, 4, t, sp, first, last, 4).values())
            got = dry_run.ends_saved_bytes(md, ParallelConfig(tp=t, sp=sp), 4, 4, first, last)
            # (one tensor rank: F.cross_entropy keeps its 4-byte total weight beside the table's items)
            assert got == ends + (4 if last and t == 1 else 0), (t, sp, first, last)


def test_published_shapes_cost_nothing():
    """A 405B model's block is read off in fake tensors: no memory, no FLOP."""
    m = PRESETS["llama3-405b"]
    h, kvd, f = m.hidden, m.n_kv_heads * m.head_dim, m.ffn_hidden
    assert dry_run.block_params(m, ParallelConfig(tp=8)) == (2 * h * h + 2 * h * kvd + 3 * h * f) // 8 + 2 * h


def test_expert_parallel_params_read_off_the_model():
    """A mixture of experts on ep ranks: each rank holds E/ep experts of every MoE block."""
    m = PRESETS["moe-tiny"]
    for ep in (1, 2, 4):
        for r in sorted({0, ep - 1}):
            lay = ParallelConfig(ep=ep, nproc=ep)
            g = GPT(m, Context(Comm(ProcessGrid(ep=ep, rank=r)), lay, torch.float64))
            assert params.params_on_rank(m, lay) == sum(p.numel() for p in {id(p): p for p in g.parameters()}.values())
