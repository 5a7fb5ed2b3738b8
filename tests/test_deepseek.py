"""DeepSeek-V3's blocks: group-limited routing against transformers' router and its fan-out
bound, multi-head latent attention read off the model by the analysis, the published
shapes' parameter counts, refusals in one line; and on real ranks (one launch of 4) the
tiny DeepSeek-V3 on every layout against one device in float64, with each rank's traced
step equal to the analysis per axis and operation (the all-to-all from the step's counts).
"""
from __future__ import annotations

import pytest
import torch

from minitron.analysis.experts import active_params, dispatch_fan_out, total_params
from minitron.config import PRESETS, ConfigError, ParallelConfig, TrainConfig, validate
from minitron.moe import route
from minitron.tools.testing import traced_step_bytes

TINY = PRESETS["deepseek-v3-tiny"]
TOL = 1e-9


# --------------------------------------------------------------------------------------
# group-limited routing
# --------------------------------------------------------------------------------------
def _hf_router(cfg, weight, bias):
    """transformers' DeepseekV3TopkRouter with our router's weight and selection bias, in float64."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf = DeepseekV3Config(hidden_size=cfg.hidden, n_routed_experts=cfg.experts, num_experts_per_tok=cfg.top_k,
                          n_group=cfg.expert_groups, topk_group=cfg.topk_groups, routed_scaling_factor=cfg.routed_scaling,
                          norm_topk_prob=True)
    r = DeepseekV3TopkRouter(hf).double()
    with torch.no_grad():
        r.weight.copy_(weight)
        r.e_score_correction_bias.copy_(bias)
    return r


def test_group_limited_routing_equals_transformers():
    """The experts and gates of transformers' DeepSeek-V3 router: the same experts, the gates
    to float32's rounding (transformers' router computes in float32 whatever the dtype; the
    inputs are float32 values, so only the products round differently)."""
    cfg = TINY.replace(experts=16, expert_groups=4, topk_groups=2, top_k=4)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, cfg.hidden, generator=g).double(), torch.randn(16, cfg.hidden, generator=g).double()
    bias = torch.randn(16, generator=g).double() * 0.1
    _, hf_gates, hf_experts = _hf_router(cfg, w, bias)(x)
    logits = x @ w.t()
    _, experts, gates = route(logits, cfg, bias)
    order = hf_experts.sort(-1)
    mine = experts.sort(-1)
    assert torch.equal(mine.values, order.values)
    assert torch.allclose(gates.gather(1, mine.indices), hf_gates.double().gather(1, order.indices), rtol=0, atol=1e-6)
    # the groups matter: unlimited routing picks other experts for some tokens
    _, free, _ = route(logits, cfg.replace(expert_groups=0, topk_groups=0), bias)
    assert not torch.equal(free.sort(-1).values, mine.values)


def test_dispatch_fan_out_is_bounded_by_the_groups():
    """Under --ep 4 with 4 groups of which 2 per token, a token's rows reach at most 2 ranks;
    unlimited, tokens reach 3 or 4."""
    cfg = TINY.replace(experts=16, expert_groups=4, topk_groups=2, top_k=4)
    logits = torch.randn(512, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def most_ranks(c):
        _, experts, _ = route(logits, c)
        return max(len(set((row // (16 // 4)).tolist())) for row in experts)

    assert dispatch_fan_out(cfg, 4) == 2 and most_ranks(cfg) == 2
    free = cfg.replace(expert_groups=0, topk_groups=0)
    assert dispatch_fan_out(free, 4) == 4 and most_ranks(free) > 2
    # each group on two ranks (ep 8, 4 groups): at most 2 groups x 2 ranks
    assert dispatch_fan_out(cfg, 8) == 4


# --------------------------------------------------------------------------------------
# the published shapes, the analysis reading the model
# --------------------------------------------------------------------------------------
def test_published_parameter_counts():
    """DeepSeek-V3: 671B total (the MTP module apart); DeepSeek-V2-Lite: 15.7B."""
    v3, lite = PRESETS["deepseek-v3"], PRESETS["deepseek-v2-lite"]
    assert abs(total_params(v3) / 671e9 - 1) < 0.005
    assert abs(total_params(lite) / 15.7e9 - 1) < 0.005
    # activated: 37.55B with both vocabulary tables; the paper's "37B" (two figures)
    assert abs(active_params(v3) / 37e9 - 1) < 0.02


def test_planner_plans_dualpipe_v_with_experts():
    """DeepSeek-V3's own layout family: 61 layers in a V over 16 pipeline ranks (chunks split
    as the engine splits them, one layer more in the first), 64-way expert parallelism on
    h800s; the planned layout is one the engine accepts."""
    from minitron.analysis.planner import plan

    v3 = PRESETS["deepseek-v3"]
    got = plan(v3, 2048, 15360, "h800", tp=2, pp=16, ep=64, software="minitron", schedules=("dualpipe-v",), top=1)
    assert got and got[0]["schedule"] == "dualpipe-v" and got[0]["vpp"] == 2 and got[0]["ep"] == 64
    e = got[0]
    validate(v3, ParallelConfig(tp=e["tp"], pp=e["pp"], vpp=2, dp=e["dp"] // e["ep"], ep=e["ep"], sp=e["sp"],
                                schedule="dualpipe-v"), world=2048)


def test_mla_params_read_off_the_model():
    """Each rank's parameters under tp2 (+sp): the dry run's count equals the built model's,
    and the up-projections and heads split while the latents' weights stay whole."""
    from minitron.analysis.dry_run import model_params
    from minitron.analysis.params import params_on_rank
    from minitron.model import GPT, num_params

    full = num_params(GPT(TINY))
    assert model_params(TINY) == full == total_params(TINY)
    for sp in (False, True):
        per_rank = params_on_rank(TINY, ParallelConfig(tp=2, sp=sp))
        assert full > per_rank > full // 2


@pytest.mark.parametrize("change,layout,msg", [
    (dict(expert_groups=3), ParallelConfig(), "--expert-groups 3 must divide --experts 8"),
    (dict(topk_groups=5), ParallelConfig(), "--topk-groups 5 is more than the 4 expert groups"),
    (dict(expert_groups=0, topk_groups=2), ParallelConfig(), "--topk-groups 2 needs --expert-groups"),
    (dict(expert_groups=2, topk_groups=1, top_k=6), ParallelConfig(), "--top-k 6 experts cannot come from 1 groups"),
    (dict(expert_groups=2, topk_groups=1, experts=12), ParallelConfig(ep=3), "cannot be laid on --ep 3"),
    (dict(kv_lora_rank=64), ParallelConfig(), "--kv-lora-rank 64 is larger than the width 32"),
    (dict(q_lora_rank=33), ParallelConfig(), "--q-lora-rank 33 is larger than the width 32"),
    (dict(qk_rope_head_dim=3), ParallelConfig(), "pick it even"),
    (dict(attention="latent"), ParallelConfig(), "unknown --attention 'latent'"),
    (dict(), ParallelConfig(tp=4, tp_mode="2d"), "1-D tensor parallelism"),
    (dict(), ParallelConfig(dp=2, pp=2, zero=3), "cannot shard the last stage's copy of the embedding"),
    (dict(mtp_depths=16), ParallelConfig(), "--mtp-depths 16 must be in 1..15"),
])
def test_refused_with_one_line(change, layout, msg):
    with pytest.raises(ConfigError, match=msg.replace("*", r"\*")) as e:
        validate(TINY.replace(**change), layout)
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------------------
# multi-token prediction (one device)
# --------------------------------------------------------------------------------------
def test_mtp_loss_is_the_papers_and_joins_the_backward_only():
    """λ·L_1 by hand (D = 1): the depth's norms, projection, block, norm and the shared
    head on t_{i+1}'s embedding, scored on t_{i+2}; the returned loss is the language
    model's, its gradient that of LM + MTP; evaluation ignores the module."""
    from minitron.model import GPT

    torch.manual_seed(0)
    model = GPT(TINY)
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    loss = model(x, y)
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    h = model.embed(x)
    for blk in model.blocks.values():
        h = blk(h)
    lm = torch.nn.functional.cross_entropy(model.head(h).flatten(0, 1), y.flatten())
    d = model.mtp.depths[0]
    h1 = d.block(d.proj(torch.cat([d.hnorm(h), d.enorm(model.wte(y))], -1)))
    mtp = torch.nn.functional.cross_entropy((d.norm(h1) @ model.lm_head.weight.t())[:, :15].flatten(0, 1), y[:, 1:].flatten())
    assert float(loss.detach()) == float(lm.detach())
    (lm + TINY.mtp_weight * mtp).backward()
    assert sorted(got) == sorted(n for n, p in model.named_parameters() if p.grad is not None)
    for n, p in model.named_parameters():
        if p.grad is not None:
            assert torch.allclose(got[n], p.grad, rtol=1e-5, atol=1e-7), n
    assert got["mtp.depths.0.proj.weight"].abs().sum() > 0 and model.wte.weight.grad.abs().sum() > 0
    model.eval()
    with torch.no_grad():
        assert float(model(x, y)) == float(lm)


# --------------------------------------------------------------------------------------
# on real ranks: the oracle and the trace against the analysis
# --------------------------------------------------------------------------------------
FOUR = [
    (TINY, ParallelConfig(dp=2, tp=2, sp=True)),
    (TINY, ParallelConfig(tp=2, ep=2)),
    (TINY, ParallelConfig(dp=2, ep=2)),
    (TINY, ParallelConfig(pp=2, tp=2, sp=True)),  # MTP on the last stage, under tp + sp
    (TINY, ParallelConfig(pp=2, vpp=2, ep=2, schedule="interleaved")),
    (TINY, ParallelConfig(pp=2, vpp=2, dp=2, schedule="dualpipe-v")),  # MTP on rank 0's last chunk
    (TINY, ParallelConfig(cp=2, dp=2)),  # ring: MLA's heads pass around, MTP's tokens ahead from whole rows
    (TINY, ParallelConfig(cp=2, dp=2, cp_mode="a2a")),
    (TINY, ParallelConfig(dp=2, ep=2, zero=1)),
    (TINY, ParallelConfig(dp=2, ep=2, zero=3)),
]


def _train(layout: ParallelConfig) -> TrainConfig:
    m = 4 if layout.pp > 1 else 1
    return TrainConfig(steps=2, global_batch=2 * layout.data_replicas * m, microbatches=m, dtype="float64",
                       lr=1e-2, warmup=1, eval_every=0, progress=False, sample_tokens=0)



def _layouts_job(comm, cases):
    """Every case on this launch's ranks: the oracle's verdict (rank 0), step 0's traced
    bytes by axis and op, and step 0's routing counts per MoE call."""
    from minitron.comm import Comm, CommTrace
    from minitron.data import load_corpus
    from minitron.grid import ProcessGrid
    from minitron.train import Trainer
    from minitron.tools.verify import versus_one_device

    corpus, rank, out = load_corpus(""), comm.grid.rank, []
    for model, layout in cases:
        grid = ProcessGrid.for_layout(layout, rank).build_groups()
        c, train = Comm(grid, CommTrace()), _train(layout)
        tr = Trainer(model, layout, train, c, corpus)
        losses = [tr.step(0)]
        calls = [d[0] for m in tr.moe for d in m.dispatches]
        losses += [tr.step(i) for i in range(1, train.steps)]
        res = versus_one_device(c, tr, losses, model, train.replace(microbatches=train.microbatches
                                                                    * layout.data_replicas))
        out.append(dict(res=res, coord=vars(grid.coord()), traced=traced_step_bytes(c.trace.records, rank), calls=calls))
    return out


@pytest.fixture(scope="module")
def four():
    from minitron.tools.testing import run_on_ranks

    for model, layout in FOUR:
        validate(model, layout, _train(layout), world=4)
    return run_on_ranks(_layouts_job, ParallelConfig(dp=4), FOUR)


@pytest.mark.multirank
def test_deepseek_v3_tiny_on_every_layout_equals_one_device(four):
    """verify --dtype float64 (1e-9): MLA + group-limited MoE + MTP on tp2+sp, tp2 x ep2,
    ep2 x dp2, pp2 x tp2+sp (MTP on the last stage), interleaved pp2 x ep2, dualpipe-v x dp2
    (MTP on rank 0, reading its embedding), cp2 ring and cp2 a2a (x dp2), ZeRO-1 and ZeRO-3."""
    for i, (model, layout) in enumerate(FOUR):
        res = four[0][i]["res"]
        print(f"{layout.describe():<36} loss {res['max_loss_abs_diff']:.1e} param {res['max_param_rel_diff']:.1e}")
        assert res["max_loss_abs_diff"] <= TOL and res["max_param_rel_diff"] <= TOL, (layout.describe(), res)


@pytest.mark.multirank
def test_deepseek_v3_tiny_traced_step_equals_the_analysis(four):
    """Each rank's step 0 equals comm_bytes_per_step per axis and operation, the expert
    all-to-all from the step's own routing counts (analysis.experts.step_all_to_all_bytes),
    ZeRO-3 under --ep by data group (the dense weights sharded over dp·ep, the experts over
    dp apart: analysis.zero.zero_groups)."""
    from minitron.analysis.comm import comm_bytes_per_step
    from minitron.tools.testing import routed_all_to_all_bytes

    bad = []
    for i, (model, layout) in enumerate(FOUR):
        ranks = [four[r][i] for r in sorted(four)]
        for rank, r in enumerate(ranks):
            want = comm_bytes_per_step(model, layout, _train(layout), pp_rank=r["coord"]["pp"])
            if layout.ep > 1:
                want["ep"]["all_to_all"] = routed_all_to_all_bytes(ranks, r, model, 8)
            if r["traced"] != want:
                bad.append((layout.describe(), rank, r["traced"], want))
    for b in bad[:4]:
        print(b)
    assert not bad, f"{len(bad)} rank-layouts differ from the analysis"


# --------------------------------------------------------------------------------------
# transformers' DeepseekV3ForCausalLM: the same function
# --------------------------------------------------------------------------------------
# transformers' DeepSeek-V3 computes its RMSNorms and its router in float32 whatever the
# model's dtype, so its float64 logits carry float32 rounding (~1e-7 here); a wrong rotary
# pairing, scale, group choice or gate scaling moves them by orders of magnitude more.
HF_FLOOR = 1e-6


def _hf_deepseek():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    c = DeepseekV3Config(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                         n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=16,
                         qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=8, n_group=4, topk_group=2,
                         num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=32,
                         num_mtp_layers=0, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                         experts_implementation="eager")
    m = DeepseekV3ForCausalLM(c).double().eval()
    with torch.no_grad():  # norms away from ones, a selection bias, sharp attention: every part matters
        for n, p in m.named_parameters():
            p.add_(torch.randn_like(p) * (0.1 if "norm" in n else 0.0))
            if n.endswith(("q_b_proj.weight", "kv_b_proj.weight")):
                p.mul_(8.0)
        for layer in m.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8, dtype=torch.float64) * 0.05)
    return c, m


def test_deepseek_v3_equals_transformers():
    """minitron's single-device DeepSeek-V3 (MLA with interleaved rotary pairs, group-limited
    sigmoid routing with the selection bias and routed scaling, shared experts, a first dense
    layer), weights from transformers' state dict: the same logits and the same greedy
    continuation."""
    from minitron.checkpoint import import_state
    from minitron.context import Context
    from minitron.hf_deepseek import from_hf, model_config
    from minitron.model import GPT

    c, hf = _hf_deepseek()
    cfg = model_config(c, seq_len=32)
    validate(cfg, ParallelConfig())
    g = GPT(cfg, Context(dtype=torch.float64)).eval()
    import_state(list(g.parameters()), None, {k: {"param": v} for k, v in from_hf(hf.state_dict(), cfg).items()})
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, got = hf(x).logits, g(x)
        assert float((got - want).abs().max()) <= HF_FLOOR * float(want.abs().max())
        ids = x[:1, :8]
        for _ in range(8):
            ids = torch.cat([ids, g(ids)[:, -1:].argmax(-1)], dim=1)
        greedy = hf.generate(x[:1, :8], max_new_tokens=8, do_sample=False)
    assert torch.equal(ids, greedy)


def test_mla_flops_read_the_built_projections():
    """The projections' FLOPs are 2 per weight of the built attention (norms aside), with or
    without the query latent; the core counts scores (nope + rope) and values (v)."""
    from minitron.model_flops import mla_flops_per_token
    from minitron.model import GPT

    for cfg in (TINY, TINY.replace(q_lora_rank=0)):
        attn = GPT(cfg).blocks["0"].attn
        weights = sum(p.numel() for n, p in attn.named_parameters() if "norm" not in n)
        proj, core = mla_flops_per_token(cfg)
        assert proj == 2 * weights and core == 2 * cfg.seq_len * cfg.heads * (8 + 4 + 8)


def test_kv_cache_read_off_the_model():
    """The analysis' KV cache per token and layer is what the built attention computes: MLA's
    down-projection width (the latent and the shared rotary key), a standard block's k and v."""
    from minitron.analysis.kv_cache import decompressed_kv_elements_per_token, kv_cache_bytes_per_token, kv_elements_per_token
    from minitron.model import GPT

    attn = GPT(TINY).blocks["0"].attn
    assert kv_elements_per_token(TINY) == attn.kv_a.weight.shape[0] == TINY.kv_lora_rank + TINY.qk_rope_head_dim
    assert decompressed_kv_elements_per_token(TINY) == attn.kv_b.weight.shape[0] + TINY.heads * TINY.qk_rope_head_dim
    llama = PRESETS["llama-tiny"]
    assert kv_elements_per_token(llama) == 2 * llama.n_kv_heads * llama.head_dim
    assert kv_cache_bytes_per_token(PRESETS["deepseek-v3"], 2) == 61 * (512 + 64) * 2  # DeepSeek-V3: 512 + 64 per layer
