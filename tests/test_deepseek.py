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
])
def test_refused_with_one_line(change, layout, msg):
    with pytest.raises(ConfigError, match=msg.replace("*", r"\*")) as e:
        validate(TINY.replace(**change), layout)
    assert "\n" not in str(e.value)
