"""Mixtures of experts and expert parallelism: the router's rules, the balancing loss, the
capacity, the analysis against the built model, refusals; and on real ranks (one launch of
2 ranks, one of 4) every expert-parallel layout against the single-device model in float64,
the traced all-to-all bytes against the analysis from the step's own routing counts, and
dense and expert gradients reduced over exactly their data groups.
"""
from __future__ import annotations

import pytest
import torch

from minitron.analysis.experts import active_params, balanced_all_to_all_bytes, moe_layer_params, total_params
from minitron.comm import Comm, CommTrace
from minitron.config import ConfigError, ModelConfig, ParallelConfig, PRESETS, TrainConfig, validate
from minitron.model import GPT, num_params
from minitron.moe import MoE, balancing_loss, capacity, keep_mask, route
from minitron.tools.testing import routed_all_to_all_bytes, run_on_ranks

from hf_models import float64_mixtral

# GELU + LayerNorm (GPT-2's block) with 4 experts top-2, and the Llama-shaped preset (SwiGLU,
# RMSNorm, GQA) with 4 or 8
GELU_MOE = ModelConfig(layers=2, hidden=32, heads=4, seq_len=16, vocab=256, experts=4, top_k=2, ffn=64,
                       name="gelu-moe")
LLAMA_MOE = PRESETS["moe-tiny"].replace(seq_len=16)
TRAIN = TrainConfig(steps=3, global_batch=8, microbatches=1, lr=1e-2, warmup=1, eval_every=0,
                    dtype="float64", progress=False, sample_tokens=0)
TOL = 1e-9


# --------------------------------------------------------------------------------------
# the router, the loss, the capacity (pure)
# --------------------------------------------------------------------------------------
def test_top_k_ties_go_to_the_lower_index():
    cfg = GELU_MOE.replace(top_k=2)
    logits = torch.tensor([[0.0, 1.0, 1.0, 1.0], [2.0, 2.0, 0.0, 2.0]], dtype=torch.float64)
    _, experts, gates = route(logits, cfg)
    assert experts.tolist() == [[1, 2], [0, 1]]
    assert torch.allclose(gates.sum(-1), torch.ones(2, dtype=torch.float64))
    # the selection bias changes the choice, not the gates' values
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0], dtype=torch.float64)
    scores, experts_b, gates_b = route(logits, cfg, bias)
    assert experts_b.tolist() == [[3, 1], [3, 0]]
    assert torch.allclose(gates_b[0], scores[0, [3, 1]] / scores[0, [3, 1]].sum())


def test_capacity_keeps_first_choices_first():
    cfg = GELU_MOE.replace(top_k=2, capacity_factor=0.5)  # C = ceil(2*4*0.5/4) = 1
    experts = torch.tensor([[0, 1], [0, 2], [1, 0], [3, 0]])
    assert capacity(cfg, 4) == 1
    # expert 0: token 0's first choice wins; expert 1: token 2's first beats token 0's second
    assert keep_mask(experts, cfg).tolist() == [[True, False], [False, True], [True, False], [True, False]]
    assert keep_mask(experts, cfg.replace(capacity_factor=0.0)).all()


def test_balancing_loss_is_switch_formula():
    cfg = GELU_MOE.replace(aux_loss=0.1, top_k=1)
    scores = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.6, 0.2, 0.1, 0.1]], dtype=torch.float64)
    experts = torch.tensor([[0], [0]])
    # f = (1, 0, 0, 0), P = (0.65, 0.15, 0.1, 0.1): α·E·Σ f_i P_i = 0.1 * 4 * 0.65
    assert abs(float(balancing_loss(scores, experts, cfg)) - 0.26) < 1e-15


def test_analysis_counts_the_built_model():
    for cfg in (GELU_MOE, GELU_MOE.replace(layers=3, moe_every=2, shared_experts=1, top_k=1, experts=8), LLAMA_MOE):
        gpt = GPT(cfg)
        assert total_params(cfg) == num_params(gpt)
        moe = [m for m in gpt.modules() if isinstance(m, MoE)]
        assert sum(p.numel() for m in moe for p in m.parameters()) == len(moe) * sum(moe_layer_params(cfg).values())
        one_expert = (moe_layer_params(cfg)["experts"]) // cfg.experts
        assert active_params(cfg) == total_params(cfg) - len(moe) * ((cfg.experts - cfg.top_k) * one_expert + cfg.experts)
    # Mixtral 8x7B: the MoE part is 8 SwiGLU experts of 3·h·f and a router per layer
    mix = PRESETS["mixtral-8x7b"]
    assert moe_layer_params(mix)["experts"] == 8 * 3 * 4096 * 14336
    # Mixtral's paper: 46.7B parameters, 12.9B active per token
    assert round(total_params(mix) / 1e9, 1) == 46.7 and round(active_params(mix) / 1e9, 1) == 12.9
    assert balanced_all_to_all_bytes(GELU_MOE, 16, 8) == 4 * 8 + 2 * (32 + 32) * 32 * 8


@pytest.mark.parametrize("model,layout,msg", [
    (GELU_MOE.replace(experts=0), ParallelConfig(ep=2), "--ep 2 splits experts"),
    (GELU_MOE.replace(experts=6), ParallelConfig(ep=4), "cannot be split over --ep 4"),
    (GELU_MOE, ParallelConfig(cp=2), "drop --cp"),
    (GELU_MOE, ParallelConfig(tp=4, tp_mode="2d"), "1-D tensor parallelism only"),
    (GELU_MOE, ParallelConfig(tp=2, dp=2, zero=3), "router's gradient"),
    (GELU_MOE, ParallelConfig(nproc=2, ep=1), "world size 2 != dp*tp*pp"),
    (GELU_MOE, ParallelConfig(nproc=4, ep=2), "dp*tp*pp*ep = 1*1*1*2"),
])
def test_refused_with_one_line(model, layout, msg):
    with pytest.raises(ConfigError, match=msg.replace("*", r"\*")) as e:
        validate(model, layout)
    assert "\n" not in str(e.value)


def test_global_batch_counts_expert_replicas():
    with pytest.raises(ConfigError, match=r"ep\*dp\*microbatches = 4\*1"):
        validate(GELU_MOE, ParallelConfig(ep=2, dp=2), TRAIN.replace(global_batch=6))


def test_bias_update_moves_toward_balance():
    from minitron import Trainer

    cfg = GELU_MOE.replace(aux_loss=0.0, bias_update=0.01)
    tr = Trainer(cfg, ParallelConfig(), TRAIN.replace(steps=1))
    tr.step(0)
    for m in tr.moe:
        load = torch.tensor(tr.last_moe["tokens_per_expert"][tr.moe.index(m)], dtype=torch.float64)
        assert load.sum() == TRAIN.global_batch * GELU_MOE.seq_len * GELU_MOE.top_k
        expect = 0.01 * torch.sign(load.mean() - load)
        assert expect.abs().sum() > 0 and torch.equal(m.score_bias.detach(), expect)


# --------------------------------------------------------------------------------------
# on real ranks: every layout against one device, the trace against the analysis
# --------------------------------------------------------------------------------------
def _run_layout(comm, model, layout, train):
    """Train `layout` (a grid of the launch's world, built here) and the single-device
    reference; rank 0 returns the comparison, the routing per step of both, each rank's
    traced all-to-all bytes and its routing counts per call, and the data-group bytes."""
    from minitron.checkpoint import gather_full
    from minitron.grid import ProcessGrid
    from minitron.train import Trainer
    from minitron.tools.verify import compare

    grid = ProcessGrid(tp=layout.tp, dp=layout.dp, pp=layout.pp, ep=layout.ep, rank=comm.grid.rank).build_groups()
    c = Comm(grid, CommTrace())
    validate(model, layout, train, world=grid.world)
    tr = Trainer(model, layout, train, c)
    losses, routing, calls = [], [], []
    for i in range(train.steps):
        losses.append(tr.step(i))
        routing.append(tr.last_moe)
        calls += [d[0] for m in tr.moe for d in m.dispatches]  # this step's counts per call
    recs = c.trace.records
    a2a = sum(r["bytes"] for r in recs if r["op"] == "all_to_all" and r["axis"] == "ep")
    grads = {ax: sum(r["bytes"] for r in recs if r["op"] in ("all_reduce", "reduce_scatter")
                     and r["phase"] in ("bwd", "optim") and r["axis"] == ax) for ax in ("dp", "dp_ep")}
    expert = sum(p.numel() for p in tr.params if p.requires_grad and "ep" not in p.shard.data_axes)
    dense = sum(p.numel() for p in tr.params if p.requires_grad and "ep" in p.shard.data_axes)
    parts = [(d.axis, d.numel) for d in getattr(tr.dp, "parts", [tr.dp])] if layout.zero else None
    mine = dict(rank=grid.rank, coord=vars(grid.coord()), a2a=a2a, calls=calls, grads=grads,
                expert=expert, dense=dense, layers=[m.layer for m in tr.moe], zero_parts=parts)
    everyone = c.gather_object(mine)
    full = gather_full(tr)
    if grid.rank != 0:
        return None
    ref_train = train.replace(microbatches=train.microbatches * layout.data_replicas)
    ref = Trainer(model, ParallelConfig(), ref_train)
    ref_losses, ref_routing = [], []
    for i in range(train.steps):
        ref_losses.append(ref.step(i))
        ref_routing.append(ref.last_moe)
    return dict(compare(losses, full, ref_losses, ref), routing=routing, ref_routing=ref_routing, ranks=everyone)


def _check(res, model, layout, train):
    what = layout.describe()
    assert res["max_loss_abs_diff"] <= TOL and res["max_param_rel_diff"] <= TOL, (what, res)
    assert res["routing"] == res["ref_routing"], what  # the same choices, the same drops
    ranks = res["ranks"]
    for r in ranks:
        # the all-to-all: exactly the analysis from the step's routing counts of the ep group
        assert all(p["layers"] == r["layers"] for p in ranks if p["coord"]["pp"] == r["coord"]["pp"])
        assert r["a2a"] == routed_all_to_all_bytes(ranks, r, model, 8) > 0, (what, r["rank"])
        # dense gradients over ep x dp ('dp_ep'), experts over dp only ('dp'), each exactly once per step
        dense_axis = "dp_ep" if layout.ep > 1 else "dp"
        want = {"dp": 0, "dp_ep": 0}
        if layout.zero:  # each group's padded flat buffer reduce-scattered, and its norm's one all-reduce
            size = {"dp": layout.dp, "dp_ep": layout.dp * layout.ep}
            for axis, numel in r["zero_parts"]:
                want[axis] += 8 * (numel + 1) * train.steps if size[axis] > 1 else 0
            assert len(r["zero_parts"]) == 2  # dense and experts: two groups
        else:
            want[dense_axis] += 8 * r["dense"] * train.steps
            if layout.dp > 1:
                want["dp"] += 8 * r["expert"] * train.steps
        assert r["grads"] == want, (what, r["rank"], r["grads"], want)


def _hf_logits(comm, hf_dir, layout):
    """`--init-from` a Mixtral directory into `layout`; each data replica runs its own row of
    a fixed batch; rank 0 returns {row: logits} (the vocabulary gathered over tp)."""
    from minitron.grid import ProcessGrid
    from minitron.hf import model_config
    from minitron.train import Trainer

    grid = ProcessGrid(tp=layout.tp, dp=layout.dp, pp=layout.pp, ep=layout.ep, rank=comm.grid.rank).build_groups()
    c = Comm(grid)
    model = model_config(hf_dir, seq_len=16)
    tr = Trainer(model, layout, TRAIN.replace(init_from=hf_dir, global_batch=layout.data_replicas), c)
    row = grid.data_index()
    x = torch.randint(0, model.vocab, (layout.data_replicas, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = c.all_gather(tr.model.eval()(x[row:row + 1]), "tp", dim=-1)[..., :model.vocab]
    got = c.gather_object((row, logits) if grid.coord().tp == 0 else None)
    return None if got is None else dict(g for g in got if g is not None)


def _job(comm, cases, hf_dir=None, hf_layouts=()):
    return ([_run_layout(comm, m, lay, tr) for m, lay, tr in cases],
            [_hf_logits(comm, hf_dir, lay) for lay in hf_layouts])


CASES_2 = [
    (GELU_MOE, ParallelConfig(ep=2), TRAIN),
    (LLAMA_MOE.replace(experts=8), ParallelConfig(ep=2), TRAIN.replace(microbatches=2)),
    (GELU_MOE.replace(capacity_factor=1.0, router="sigmoid"), ParallelConfig(ep=2), TRAIN),
    (LLAMA_MOE.replace(aux_loss=0.0, bias_update=0.01, shared_experts=1), ParallelConfig(ep=2), TRAIN),
    (GELU_MOE, ParallelConfig(ep=2, zero=3), TRAIN),
]
CASES_4 = [
    (LLAMA_MOE, ParallelConfig(ep=4), TRAIN),
    (LLAMA_MOE.replace(experts=8), ParallelConfig(ep=2, dp=2), TRAIN),
    (LLAMA_MOE, ParallelConfig(ep=2, tp=2, sp=True), TRAIN),
    (GELU_MOE.replace(capacity_factor=1.0), ParallelConfig(ep=2, tp=2), TRAIN),
    (LLAMA_MOE, ParallelConfig(ep=2, pp=2), TRAIN.replace(microbatches=2)),
    (LLAMA_MOE, ParallelConfig(ep=2, dp=2, zero=1), TRAIN),
    (GELU_MOE, ParallelConfig(ep=2, dp=2, zero=3), TRAIN),
]


HF_LAYOUTS = {2: [ParallelConfig(ep=2)], 4: [ParallelConfig(ep=2, tp=2)]}


@pytest.mark.multirank
@pytest.mark.parametrize("world,cases", [(2, CASES_2), (4, CASES_4)], ids=["2ranks", "4ranks"])
def test_expert_parallel_layouts_equal_one_device(world, cases, tmp_path):
    hf_model = float64_mixtral(tmp_path / "mixtral")
    res, hf = run_on_ranks(_job, ParallelConfig(dp=world), cases, str(tmp_path / "mixtral"), HF_LAYOUTS[world])[0]
    assert len(res) == len(cases) and len(hf) == len(HF_LAYOUTS[world])
    for r, (m, lay, tr) in zip(res, cases):
        _check(r, m, lay, tr)
    # --init-from a transformers Mixtral: the logits of every row, in ep2 and ep2 x tp2
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = hf_model(x).logits
    for rows in hf:
        assert sorted(rows) == [0, 1]
        for r, logits in rows.items():
            assert float((logits[0] - want[r]).abs().max()) <= TOL * float(want.abs().max())
    capped = [r for r, (m, _, _) in zip(res, cases) if m.capacity_factor]
    assert capped and all(any(s["dropped"] > 0 for s in r["routing"]) for r in capped)  # tokens were dropped


# --------------------------------------------------------------------------------------
# the run report: the load balance, and a planted routing collapse
# --------------------------------------------------------------------------------------
def _report_of(model, plant: bool):
    from minitron import Trainer
    from minitron.tools.report import RunReport, format_report

    train = TRAIN.replace(steps=2)
    tr = Trainer(model, ParallelConfig(), train)
    if plant:  # every normalized token ≈ v (LayerNorm's bias), and the router's row 0 is v
        v = torch.zeros(model.hidden, dtype=torch.float64)
        v[0] = 5.0
        with torch.no_grad():
            for m in tr.moe:
                blk = tr.model.blocks[str(m.layer)]
                blk.ln2.weight.fill_(1e-3)
                blk.ln2.bias.copy_(v)
                m.router.zero_()
                m.router[0] = v
    rep = RunReport(model, ParallelConfig(), train)
    for i in range(train.steps):
        with rep.watching(tr, i) as hooks:
            tr.step_async(i, saved_tensors=hooks)
        rep.records(tr, [{"step": i + 1, "model_flops_per_s": 0.0, **tr.last_moe}])
    out = rep.finish(tr)
    return out, format_report(out)


def test_report_shows_load_balance_and_a_planted_collapse():
    model = GELU_MOE.replace(top_k=1, aux_loss=0.0)
    rep, text = _report_of(model, plant=True)
    assert all(lay["collapsed"] and lay["busiest"] == 0 for lay in rep["routing"]["layers"])
    tokens = TRAIN.global_batch * model.seq_len * 2
    assert rep["routing"]["layers"][0]["total"] == [tokens, 0, 0, 0]
    assert "ROUTING COLLAPSE: expert 0" in text and "load balance of the experts" in text
    rep, text = _report_of(GELU_MOE, plant=False)  # the same model trained as it starts: no collapse
    assert not any(lay["collapsed"] for lay in rep["routing"]["layers"]) and "COLLAPSE" not in text


# --------------------------------------------------------------------------------------
# Hugging Face: a transformers Mixtral in and out
# --------------------------------------------------------------------------------------


def test_mixtral_in_and_out(tmp_path):
    from safetensors.torch import load_file
    from transformers import MixtralForCausalLM

    from minitron import Trainer
    from minitron.checkpoint import gather_full
    from minitron.hf import load_full, model_config, save

    hf_model = float64_mixtral(tmp_path / "in")
    model = model_config(str(tmp_path / "in"), seq_len=16)
    assert (model.experts, model.top_k, model.n_kv_heads, model.activation) == (4, 2, 2, "swiglu")
    tr = Trainer(model, ParallelConfig(), TRAIN.replace(init_from=str(tmp_path / "in")))
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want, got = hf_model(x).logits, tr.model.eval()(x)
    assert float((got - want).abs().max()) <= TOL * float(want.abs().max())
    with torch.no_grad():  # transformers' own float32 router and norms: agreement to float32's rounding
        own = float64_mixtral(tmp_path / "own", float32_parts=True)(x).logits
    assert float((got - own).abs().max()) <= 1e-6 * float(own.abs().max())
    # export: the same tensors, loadable by transformers, and back into minitron unchanged
    full = {k: v["param"] for k, v in gather_full(tr).items()}
    info = save(str(tmp_path / "out"), full, model)
    assert info["class"] == "MixtralForCausalLM"
    a, b = load_file(str(tmp_path / "in" / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    again = load_full(str(tmp_path / "out"), model)
    assert all(torch.equal(again[k]["param"], full[k]) for k in full)
    back = MixtralForCausalLM.from_pretrained(str(tmp_path / "out"), experts_implementation="eager").double().eval()
    with torch.no_grad():
        assert torch.equal(back(x).logits, own)
