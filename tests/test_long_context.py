"""Long context and the families' knobs: rope scaling equal to transformers', sliding
windows (transformers' mask, a pattern of layers), bad input in one line, the windowed
ring's bytes equal to the formula (dry run on every context rank) and fewer than the
whole ring's, and on real ranks the oracle (float64 vs one device) for each knob on tp2
and cp2 (ring and a2a) and a window on cp4 ring, cp2 a2a and tp2+sp, traced bytes = analysis."""
from __future__ import annotations

import pytest
import torch

from minitron.analysis import comm_bytes_per_step
from minitron.analysis.comm import bytes_by_axis
from minitron.analysis.context_parallel import cp_comm_items, window_chunk_reach, window_ring_items
from minitron.analysis.dry_run import dry_trace
from minitron.config import PRESETS, ConfigError, ParallelConfig, TrainConfig, element_bytes, validate
from minitron.model import rotary_angles
from minitron.parallel.context_parallel import chunk_reach, window_mask
from minitron.rope import rope_frequencies
from minitron.tools.testing import run_cli, run_on_ranks, traced_step_bytes

LLAMA = PRESETS["llama-tiny"]
# every new attention knob at once: a head width apart from h/heads (12, not 8), biases on
# Q, K, V only, q/k RMSNorm, rope scaling of each kind (a short original context: scaled angles)
KNOBS = LLAMA.replace(head_width=12, qkv_bias=True, qk_norm=True, rope_scaling="yarn", rope_factor=4.0,
                      rope_original_context=16)
KNOBS_LLAMA3 = KNOBS.replace(rope_scaling="llama3", rope_original_context=16, rope_base=500000.0)
WINDOW = LLAMA.replace(window=5, window_layers="LG")  # Gemma 2's alternation: layer 0 local, layer 1 global


# --- rope scaling: transformers' own functions --------------------------------------------------
def _hf_config(cfg):
    from transformers import LlamaConfig

    kind = {"rope_type": cfg.rope_scaling, "rope_theta": cfg.rope_base, "factor": cfg.rope_factor,
            "original_max_position_embeddings": cfg.rope_original_context}
    kind.update({"low_freq_factor": cfg.rope_low_freq, "high_freq_factor": cfg.rope_high_freq}
                if cfg.rope_scaling == "llama3" else {"beta_fast": cfg.rope_beta_fast, "beta_slow": cfg.rope_beta_slow})
    return LlamaConfig(hidden_size=cfg.hidden, num_attention_heads=cfg.heads, head_dim=cfg.head_dim,
                       num_key_value_heads=cfg.n_kv_heads, max_position_embeddings=int(cfg.rope_original_context
                                                                                     * cfg.rope_factor),
                       rope_parameters=kind)


@pytest.mark.parametrize("cfg", [
    PRESETS["llama3-8b"].replace(rope_scaling="llama3"),  # Llama 3.1: factor 8 over 8,192
    KNOBS_LLAMA3,
    PRESETS["llama3-8b"].replace(rope_scaling="yarn", rope_factor=4.0, rope_original_context=32768),
    KNOBS,
])
def test_rope_scaling_equals_transformers(cfg):
    """inv_freq and the attention factor equal ROPE_INIT_FUNCTIONS', and cos, sin of every
    position equal LlamaRotaryEmbedding's (whose attention_scaling multiplies them)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = _hf_config(cfg)
    want, factor = ROPE_INIT_FUNCTIONS[cfg.rope_scaling](hf, "cpu")
    got, got_factor = rope_frequencies(cfg)
    assert torch.equal(got, want) and got_factor == factor
    assert not torch.equal(got, rope_frequencies(cfg.replace(rope_scaling=""))[0])  # it does scale
    pos = torch.arange(0, 3 * cfg.rope_original_context, 7)
    cos, sin = LlamaRotaryEmbedding(hf)(torch.zeros(1, dtype=torch.float32), pos[None])
    mine = rotary_angles(pos, cfg.head_dim, cfg.rope_base, "cpu", cfg)
    assert torch.allclose(mine[0], cos[0], rtol=0, atol=1e-6) and torch.allclose(mine[1], sin[0], rtol=0, atol=1e-6)


# --- sliding windows ------------------------------------------------------------------------------
def test_window_mask_is_transformers_sliding_window_and_the_pattern_repeats():
    from transformers.masking_utils import sliding_window_causal_mask_function

    sees = sliding_window_causal_mask_function(5)
    for q0, k0 in ((0, 0), (8, 4), (4, 8)):
        m = window_mask(4, 4, q0, k0, 5)
        assert [[not m[i, j].item() for j in range(4)] for i in range(4)] == \
            [[bool(sees(*map(torch.tensor, (0, 0, q0 + i, k0 + j)))) for j in range(4)] for i in range(4)]
    assert [WINDOW.replace(layers=5).window_of(i) for i in range(5)] == [5, 0, 5, 0, 5]
    assert [LLAMA.replace(window=7).window_of(i) for i in range(3)] == [7, 7, 7]


def test_windowed_model_masks_beyond_the_window_only():
    """A window as long as the sequence is global attention (same logits); a shorter one
    changes only the logits of positions with keys beyond it."""
    from minitron.model import GPT

    torch.manual_seed(0)
    x = torch.randint(0, 256, (2, 32))
    full = GPT(LLAMA).eval()(x)
    assert torch.allclose(GPT(LLAMA.replace(window=32)).eval()(x), full, rtol=0, atol=1e-6)
    short = GPT(LLAMA.replace(window=5)).eval()(x)
    assert torch.allclose(short[:, :5], full[:, :5], rtol=0, atol=1e-6)
    assert not torch.allclose(short[:, 5:], full[:, 5:], atol=1e-3)


@pytest.mark.parametrize("window, kv", [(5, 2), (8, 4), (3, 1), (32, 2)])
def test_flops_formula_equals_the_matmuls_a_windowed_step_runs(window, kv):
    """One device's windowed layers run only the blocks in reach (plain matmuls): PyTorch's
    FlopCounterMode over a training step's forward and backward equals model_flops_per_step
    exactly, below the global model's (a window as long as the sequence: one block, equal)."""
    from torch.utils.flop_counter import FlopCounterMode

    from minitron.model_flops import model_flops_per_step
    from minitron.model import GPT

    model = LLAMA.replace(window=window, kv_heads=kv)
    x, y = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))
    with FlopCounterMode(display=False) as counter:
        GPT(model).train()(x, y).backward()
    assert counter.get_total_flops() == model_flops_per_step(model, 2)
    glob = model_flops_per_step(model.replace(window=0), 2)
    assert model_flops_per_step(model, 2) < glob if window < model.seq_len else model_flops_per_step(model, 2) == glob


@pytest.mark.parametrize("model, layout, words", [
    (LLAMA.replace(window=33), ParallelConfig(), "--window 33 is larger than --seq-len 32"),
    (LLAMA.replace(rope_scaling="ntk"), ParallelConfig(), "unknown --rope-scaling 'ntk'"),
    (LLAMA.replace(window=4, window_layers="LX"), ParallelConfig(), "pattern of L (windowed) and G"),
    (LLAMA.replace(window_layers="LG"), ParallelConfig(), "--window-layers needs --window"),
    (PRESETS["deepseek-v3-tiny"].replace(window=6), ParallelConfig(), "--window masks the standard attention only"),
    (PRESETS["tiny"].replace(rope_scaling="yarn"), ParallelConfig(), "add --positions rope"),
    (LLAMA.replace(rope_scaling="yarn", rope_factor=0.5), ParallelConfig(), "--rope-factor must be at least 1"),
    (LLAMA.replace(head_width=12, kv_heads=0), ParallelConfig(tp=4, tp_mode="2d"), "1-D tensor parallelism only"),
])
def test_bad_input_is_one_line(model, layout, words):
    with pytest.raises(ConfigError) as e:
        validate(model, layout)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_export_refuses_the_knobs_no_family_can_write_in_one_line():
    """Each knob alone has its Hugging Face family (tests/test_hf_families.py); what none holds
    (two families' knobs at once, a window pattern, a GPT-2 with a window) is named."""
    from minitron.hf import export_problem

    for model in (LLAMA, LLAMA.replace(qkv_bias=True), LLAMA.replace(qk_norm=True, head_width=12),
                  LLAMA.replace(window=5), KNOBS_LLAMA3.replace(qkv_bias=False, qk_norm=False)):
        assert export_problem(model) == "", model
    for model, words in ((KNOBS, "qkv_bias, qk_norm together"), (WINDOW, "window_layers LG"),
                         (PRESETS["tiny"].replace(window=5), "window 5")):
        problem = export_problem(model)
        assert words in problem and "\n" not in problem, problem


def test_bad_rope_scaling_from_the_command_line_before_any_rank():
    code, out, err = run_cli(["verify", "--nproc", "2", "--tp", "2", "--model", "llama-tiny",
                              "--rope-scaling", "ntk"], timeout=120)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "unknown --rope-scaling 'ntk'" in lines[0], err


# --- the windowed ring's bytes: the formula, on every context rank --------------------------------
def _cp_bytes(records) -> dict:
    out: dict = {}
    for r in records:
        if r["axis"] == "cp":
            out[r["op"]] = out.get(r["op"], 0) + r["bytes"]
    return out


def _formula(model, layout, train, cp_rank) -> dict:
    """The windowed ring's bytes of context rank `cp_rank` (activations in the training dtype)."""
    items = window_ring_items(model, layout, train, cp_rank, act_bytes=element_bytes(train.dtype))
    return {op: b for op, b in bytes_by_axis(items).get("cp", {}).items() if b}


@pytest.mark.parametrize("n, window, pattern", [(2, 5, ""), (4, 9, "LG")])
def test_windowed_ring_passes_the_chunks_the_window_reaches(n, window, pattern):
    """The engine's reach (chunk pairs in reach, from the query-key distances) equals the
    analysis' (⌈(W−1)/c⌉ chunks ahead); the step the model runs (dry, on fake tensors, on
    each context rank) moves the formula's bytes, fewer than the whole ring's."""
    model = LLAMA.replace(window=window, window_layers=pattern)
    c = model.seq_len // (2 * n)
    assert {(o, k): chunk_reach(n, o, k, c, window) for o in range(n) for k in (0, 1)} == \
        window_chunk_reach(n, c, window)
    layout, train = ParallelConfig(cp=n), TrainConfig(global_batch=2)
    whole = bytes_by_axis(cp_comm_items(LLAMA, layout, train))["cp"]
    for r in range(n):
        got = _cp_bytes(dry_trace(model, layout, 2, rank=r).records)
        assert got == _formula(model, layout, train, r), r
        assert got["send"] < whole["send"] and got["recv"] < whole["recv"], (r, got, whole)
    assert comm_bytes_per_step(model, layout, train)["cp"] == _formula(model, layout, train, 0)


# --- on real ranks: the oracle and the traced bytes ----------------------------------------------------
VERIFY = [  # (name, model, layout): each new knob on tp2 and cp2 (ring and a2a), a window on cp4 and tp2+sp
    ("knobs tp2", KNOBS, ParallelConfig(tp=2, dp=2)),
    ("knobs cp2 ring", KNOBS_LLAMA3, ParallelConfig(cp=2, dp=2)),
    ("knobs cp2 a2a", KNOBS.replace(kv_heads=4), ParallelConfig(cp=2, dp=2, cp_mode="a2a")),
    ("window cp4 ring", WINDOW, ParallelConfig(cp=4)),
    ("window cp2 a2a", WINDOW.replace(kv_heads=4), ParallelConfig(cp=2, dp=2, cp_mode="a2a")),
    ("window cp2 tp2 sp", WINDOW.replace(window_layers=""), ParallelConfig(cp=2, tp=2, sp=True)),
    ("window tp2 sp", WINDOW, ParallelConfig(tp=2, sp=True, dp=2)),
]


def _verify_train(layout: ParallelConfig) -> TrainConfig:
    return TrainConfig(steps=3, global_batch=2 * layout.dp, dtype="float64", lr=1e-2, warmup=1, eval_every=0,
                       progress=False)


def _all_layouts(comm):
    from minitron.comm import Comm, CommTrace
    from minitron.data import load_corpus
    from minitron.grid import ProcessGrid
    from minitron.tools.verify import verify_job

    corpus, rank, out = load_corpus(""), comm.grid.rank, {}
    for name, model, layout in VERIFY:
        grid = ProcessGrid(tp=layout.tp, dp=layout.dp, pp=layout.pp, cp=layout.cp, rank=rank).build_groups()
        c = Comm(grid, CommTrace())
        res = verify_job(c, model, layout, _verify_train(layout), corpus, None)
        out[name] = (res, c.index("cp"), traced_step_bytes(c.trace.records, rank))
    return out


@pytest.mark.multirank
def test_knobs_and_windows_equal_one_device_and_the_analysis_on_four_ranks():
    for _, model, layout in VERIFY:
        validate(model, layout, _verify_train(layout))
    results = run_on_ranks(_all_layouts, ParallelConfig(dp=4))
    for name, model, layout in VERIFY:
        res = results[0][name][0]
        assert res["ok"] and res["max_param_rel_diff"] <= 1e-9 and res["max_loss_abs_diff"] <= 1e-9, (name, res)
        want = comm_bytes_per_step(model, layout, _verify_train(layout))
        for rank, r in results.items():
            _, cp_rank, got = r[name]
            if model.window and layout.cp > 1 and layout.cp_mode == "ring":  # the ranks differ: the formula of each
                assert got.pop("cp") == _formula(model, layout, _verify_train(layout), cp_rank), (name, rank)
                assert got == {a: ops for a, ops in want.items() if a != "cp"}, (name, rank, got, want)
            else:
                assert got == want, (name, rank, got, want)
