"""Qwen2-MoE and OLMoE checkpoints in and out (``hf_moe.MOE_FAMILIES``): for each, a random
model that transformers builds and saves (save_pretrained, safetensors; nothing downloaded)
loads with ``--init-from`` into one device with transformers' logits and greedy tokens;
minitron's export loads back into transformers with the same logits; ``verify --dtype
float64`` (1e-9) from the checkpoint on tp2 x ep2 (+sp) and dp2 x ep2, with each rank's
traced step equal to the analysis (one launch of 4 ranks); planted mistakes (renormalised
gates, no shared-expert gate, OLMoE's q/k norm per head, or per tensor rank) are caught;
bad input gets one line.
"""
import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from minitron import hf, hf_moe, model as model_module  # noqa: E402
from minitron.config import ConfigError, ParallelConfig, TrainConfig, validate  # noqa: E402
from minitron.tools import cli  # noqa: E402
from minitron.tools.sampling import load_model  # noqa: E402
from minitron.tools.testing import traced_step_bytes  # noqa: E402
from minitron.train import single_device_model  # noqa: E402

from hf_models import float64_norms, sharpened  # noqa: E402
from test_hf_families import _error  # noqa: E402

# transformers' RMSNorms and these routers' softmax compute in float32 whatever the model's
# dtype (bf16 guards); with them computing in float64 (the same formulas: float64_parts) the
# float64 logits agree to rounding, so the bar is the oracle's 1e-9. As transformers ships
# them they agree to float32's rounding only (HF_FLOOR, relative to the logits' scale).
TOL, HF_FLOOR = 1e-9, 1e-6
SEQ, PROMPT, NEW = 16, 8, 8
# each family's engine fields as its config.json must load them
CASES = {"qwen2_moe": {"qkv_bias": True, "shared_experts": 1, "shared_ffn": 24, "shared_gate": True, "moe_ffn": 16,
                       "ffn": 48, "dense_blocks": "1", "gate_norm": "never", "qk_norm": False},
         "olmoe": {"qk_norm": True, "qk_norm_span": "all", "gate_norm": "never", "ffn": 16, "shared_experts": 0}}


def _router_forward(self, hidden_states):
    """Qwen2MoeTopKRouter / OlmoeTopKRouter's forward with the softmax in the model's dtype."""
    logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    top, idx = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
    return logits, (top / top.sum(-1, keepdim=True) if self.norm_topk_prob else top), idx


def float64_parts(model):
    """`model`'s RMSNorms and top-k routers computing in its dtype (float64)."""
    for m in model.modules():
        if type(m).__name__.endswith("TopKRouter"):
            m.forward = _router_forward.__get__(m)
    return float64_norms(model)


def random_moe(kind, path, norm_topk_prob=False):
    """A random float64 Qwen2-MoE (3 layers, the middle one dense: mlp_only_layers; experts of
    16, a shared expert of 24, dense MLPs of 48) or OLMoE (2 layers, experts of 16), hidden
    32, 4 heads on 2 kv heads, 4 experts top-2, saved by transformers to `path`; norms and
    biases perturbed and q, k scaled up (sharp attention), so that a misplaced tensor shows."""
    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                  num_experts_per_tok=2, max_position_embeddings=32, rms_norm_eps=1e-5, norm_topk_prob=norm_topk_prob,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None, experts_implementation="eager")
    if kind == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16,
                                             shared_expert_intermediate_size=24, mlp_only_layers=[1], **common)
    else:
        config = transformers.OlmoeConfig(num_hidden_layers=2, intermediate_size=16, **common)
    model = transformers.AutoModelForCausalLM.from_config(config).double().eval()
    sharpened(model)
    model.save_pretrained(str(path))
    return model


def _logits(model, x):
    with torch.no_grad():
        out = model(x)
    return out.logits if hasattr(out, "logits") else out


def _inputs():
    return torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _rel(got, want) -> float:
    return float((got - want).abs().max()) / float(want.abs().max())


@pytest.mark.parametrize("kind,norm_topk_prob", [("qwen2_moe", False), ("qwen2_moe", True), ("olmoe", False)])
def test_family_loads_generates_and_exports_as_transformers(tmp_path, kind, norm_topk_prob):
    """--init-from into one device: transformers' logits (1e-9 with float64 parts; HF_FLOOR as
    shipped) and greedy tokens; export: transformers' class loads it with the same logits and
    it reads back bit for bit."""
    theirs = random_moe(kind, tmp_path / "hf", norm_topk_prob)
    x = _inputs()
    shipped = _logits(theirs, x)
    theirs = float64_parts(theirs)
    want = _logits(theirs, x)
    mine, cfg = load_model(init_from=str(tmp_path / "hf"), dtype="float64")
    fields = {**CASES[kind], "gate_norm": "always" if norm_topk_prob else "never"}
    assert {k: getattr(cfg, k) for k in fields} == fields
    assert _rel(_logits(mine.eval(), x), want) < TOL and _rel(_logits(mine, x), shipped) < HF_FLOOR
    prompt = x[:1, :PROMPT]
    with torch.no_grad():
        ours = mine.generate(prompt, NEW, temperature=1.0, top_k=1)
        greedy = theirs.generate(prompt, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    assert torch.equal(ours, greedy), (ours, greedy)
    full = {p.shard.name: p.detach() for p in mine.parameters()}
    res = hf.save(str(tmp_path / "out"), full, cfg)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert res["class"] == type(theirs).__name__ and written["model_type"] == kind
    back = float64_parts(transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "out"), dtype=torch.float64, experts_implementation="eager").eval())
    assert type(back) is type(theirs) and _rel(_logits(back, x), want) < TOL
    again = hf.model_config(str(tmp_path / "out"))
    assert again.replace(name=cfg.name) == cfg
    loaded = hf.load_full(str(tmp_path / "out"), again)
    assert all(torch.equal(loaded[k]["param"], t) for k, t in full.items())


def test_planted_mistakes_are_caught(tmp_path, monkeypatch):
    """The checks can fail: renormalised gates (Mixtral's), the shared expert without its
    sigmoid gate, and OLMoE's q/k norm taken per head (Qwen3's) move the logits far past TOL."""
    x = _inputs()
    for kind in CASES:
        want = _logits(float64_parts(random_moe(kind, tmp_path / kind)), x)
        cfg = hf.model_config(str(tmp_path / kind))
        full = hf.load_full(str(tmp_path / kind), cfg)

        def rel(c=cfg, weights=full):
            return _rel(_logits(single_device_model(c, weights, TrainConfig(dtype="float64")).eval(), x), want)

        assert rel() < TOL
        assert rel(cfg.replace(gate_norm="always")) > 1e-3
        if kind == "qwen2_moe":
            ungated = {k: v for k, v in full.items() if "shared_gate" not in k}
            assert rel(cfg.replace(shared_gate=False), ungated) > 1e-3
        else:
            def per_head(self, t):  # Qwen3's norm of each head's d (the whole-width norm's likely mistake)
                return model_module.tp.rms_norm(t, self.weight.view(-1, 1, t.shape[-1]), self.eps)
            monkeypatch.setattr(model_module.ProjectionNorm, "forward", per_head)
            assert rel() > 1e-3
            monkeypatch.undo()


# --------------------------------------------------------------------------------------
# on real ranks: verify --dtype float64 from the checkpoints, the trace against the analysis
# --------------------------------------------------------------------------------------
# tp2 x ep2 for both (the experts over ep, each expert, attention and the dense MLP over tp), and
# plain ep2 x dp2 once (the suite's budget)
LAYOUTS = {"qwen2_moe": [ParallelConfig(tp=2, ep=2, sp=True)],
           "olmoe": [ParallelConfig(tp=2, ep=2), ParallelConfig(dp=2, ep=2)]}


def _train(layout: ParallelConfig, hf_dir: str, steps: int = 2) -> TrainConfig:
    return TrainConfig(steps=steps, global_batch=2 * layout.data_replicas, dtype="float64", lr=1e-2, warmup=1,
                       eval_every=0, progress=False, sample_tokens=0, init_from=hf_dir)


def _per_rank_norm(x, weight, bias, comm, axis, n, eps, rms):
    """The planted mistake: each tensor rank normalising only its own heads (no all-reduce)."""
    return model_module.tp.rms_norm(x, weight, eps)


def _verify_job(comm, cases):
    """Each (hf_dir, layout, planted) on this launch's ranks, as `minitron verify` runs it
    (tools.verify.versus_one_device: the layout's steps against one device's from the same
    checkpoint): rank 0's verdict, step 0's traced bytes by axis and op, the routing counts."""
    from contextlib import nullcontext
    from unittest import mock

    from minitron.comm import Comm, CommTrace
    from minitron.data import load_corpus
    from minitron.grid import ProcessGrid
    from minitron.tools.verify import versus_one_device
    from minitron.train import Trainer

    corpus, rank, out = load_corpus(""), comm.grid.rank, []
    for hf_dir, layout, planted in cases:
        grid = ProcessGrid.for_layout(layout, rank).build_groups()
        c, train, model = Comm(grid, CommTrace()), _train(layout, hf_dir, 1 if planted else 2), hf.model_config(hf_dir)
        with mock.patch.object(model_module, "sharded_norm", _per_rank_norm) if planted else nullcontext():
            tr = Trainer(model, layout, train, c, corpus)
            losses = [tr.step(0)]
            calls = [d[0] for m in tr.moe for d in m.dispatches]
            losses += [tr.step(i) for i in range(1, train.steps)]
        res = versus_one_device(c, tr, losses, model, train.replace(microbatches=layout.data_replicas))
        out.append(dict(res=res, coord=vars(grid.coord()), traced=traced_step_bytes(c.trace.records, rank),
                        calls=calls))
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    from minitron.tools.testing import run_on_ranks

    cases = []
    for kind, layouts in LAYOUTS.items():
        d = tmp_path_factory.mktemp(kind)
        random_moe(kind, d)
        cases += [(str(d), layout, False) for layout in layouts]
    cases.append((cases[-2][0], LAYOUTS["olmoe"][0], True))  # OLMoE on tp2 with the norm per rank
    for hf_dir, layout, _ in cases:
        validate(hf.model_config(hf_dir), layout, _train(layout, hf_dir), world=4)
    return cases, run_on_ranks(_verify_job, ParallelConfig(dp=4), cases)


@pytest.mark.multirank
def test_verify_float64_from_the_checkpoints(four):
    """verify --dtype float64 (1e-9) from each checkpoint on tp2 x ep2 (Qwen2-MoE with --sp:
    the shared-expert gate's gradient summed over tp; OLMoE's q/k norm over both ranks'
    heads) and OLMoE on dp2 x ep2; OLMoE on tp2 with each rank normalising its own heads
    (no all-reduce) fails it."""
    cases, ranks = four
    for i, (hf_dir, layout, planted) in enumerate(cases):
        res = ranks[0][i]["res"]
        print(f"{hf_dir.split('/')[-1]:<12} {layout.describe():<28} planted {planted!s:<5} "
              f"loss {res['max_loss_abs_diff']:.1e} param {res['max_param_rel_diff']:.1e}")
        within = res["max_loss_abs_diff"] <= TOL and res["max_param_rel_diff"] <= TOL
        assert within != planted, (hf_dir, layout.describe(), res)


@pytest.mark.multirank
def test_traced_step_equals_the_analysis(four):
    """Each rank's step 0 equals comm_bytes_per_step per axis and op (OLMoE's all-reduces of
    the q/k sums of squares on 'tp' read off the model by the dry run), the expert all-to-all
    from the step's own routing counts."""
    from minitron.analysis.comm import comm_bytes_per_step
    from minitron.tools.testing import routed_all_to_all_bytes

    cases, ranks = four
    bad = []
    for i, (hf_dir, layout, planted) in enumerate(cases):
        if planted:
            continue
        per_rank = [ranks[r][i] for r in sorted(ranks)]
        for rank, r in enumerate(per_rank):
            want = comm_bytes_per_step(hf.model_config(hf_dir), layout, _train(layout, hf_dir),
                                       pp_rank=r["coord"]["pp"])
            want["ep"]["all_to_all"] = routed_all_to_all_bytes(per_rank, r, hf.model_config(hf_dir), 8)
            if r["traced"] != want:
                bad.append((hf_dir.split("/")[-1], layout.describe(), rank, r["traced"], want))
    for b in bad[:4]:
        print(b)
    assert not bad, f"{len(bad)} rank-layouts differ from the analysis"


# --------------------------------------------------------------------------------------
# bad input: one line
# --------------------------------------------------------------------------------------
QWEN = ("qwen2_moe", {"experts": 4, "shared_experts": 1, "shared_gate": True, "qkv_bias": True})


@pytest.mark.parametrize("change,layout,msg", [
    (dict(qk_norm=True, qk_norm_span="all"), ParallelConfig(tp=4), "--qk-norm-span all normalises k over all 2"),
    (dict(qk_norm_span="all"), ParallelConfig(), "--qk-norm-span all says what --qk-norm normalises"),
    (dict(qk_norm_span="heads"), ParallelConfig(), "unknown --qk-norm-span 'heads'"),
    (dict(shared_gate=True), ParallelConfig(), "--shared-ffn and --shared-gate act on the shared experts"),
    (dict(shared_experts=1, shared_ffn=-1), ParallelConfig(), "--shared-ffn must be positive"),
    (dict(dense_blocks="0,2"), ParallelConfig(), "--dense-blocks '0,2' must list distinct block indices in 0..1"),
    (dict(dense_blocks="1", experts=0), ParallelConfig(), "--dense-blocks keeps blocks of a mixture dense"),
    (dict(gate_norm="sometimes"), ParallelConfig(), "unknown --gate-norm 'sometimes'"),
])
def test_refused_with_one_line(change, layout, msg):
    from minitron.config import PRESETS

    with pytest.raises(ConfigError, match=msg.replace("*", r"\*")) as e:
        validate(PRESETS["moe-tiny"].replace(**change), layout)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("change,msg", [
    (dict(qk_norm=True, qk_norm_span="all", shared_experts=1, shared_gate=True),
     "no Hugging Face MoE family has shared_gate and qk_norm together (each holds one: qwen2_moe shared_gate, "
     "olmoe qk_norm)"),
    (dict(qk_norm=True), "OlmoeForCausalLM holds"),  # Qwen3's per-head norm with experts: no family
    (dict(qk_norm=True, qk_norm_span="all", qkv_bias=True), "not qkv_bias True"),
    (dict(shared_experts=1, shared_gate=True, capacity_factor=1.25), "Qwen2MoeForCausalLM holds"),
    (dict(gate_norm="never"), "not gate_norm never"),  # Mixtral renormalises
    (dict(shared_experts=1, shared_gate=True, top_k=1), "top-1 gate is 1 (norm_topk_prob) or the softmax score"),
])
def test_export_refused_with_one_line(change, msg):
    from minitron.config import PRESETS

    problem = hf.export_problem(PRESETS["moe-tiny"].replace(**change))
    assert msg in problem and "\n" not in problem, problem


def test_bad_directory_gets_one_line(tmp_path, capsys):
    """OLMoE's clip_qkv, a malformed mlp_only_layers and Qwen2-MoE's sliding window are refused
    in one line; an unsupported family's refusal names the new families."""
    from safetensors.torch import save_file

    train = ["train", "--steps", "1", "--no-progress", "--init-from"]
    for kind, changes, msg in (("olmoe", {"clip_qkv": 8.0}, "clip_qkv 8.0: minitron does not clip"),
                               ("qwen2_moe", {"mlp_only_layers": ["1"]}, "mlp_only_layers ['1']: it must be a list"),
                               ("qwen2_moe", {"use_sliding_window": True}, "use_sliding_window"),
                               ("olmoe", {"model_type": "jamba"}, "'jamba' model")):
        d = tmp_path / f"{kind}-{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        base = {"model_type": kind, "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2,
                "intermediate_size": 16, "vocab_size": 256, "num_experts": 4, "moe_intermediate_size": 16,
                "shared_expert_intermediate_size": 24, "decoder_sparse_step": 1}
        (d / "config.json").write_text(json.dumps({**base, **changes}))
        save_file({"x": torch.zeros(1)}, str(d / "model.safetensors"))
        err = _error(capsys, train + [d])
        assert msg in err, err
    assert all(t in err for t in ("mixtral", "qwen2_moe", "olmoe", "deepseek_v3")), err


# engine models of each family's knobs (as `minitron train` flags would set them)
ENGINE = {"qwen2_moe": dict(layers=3, shared_experts=1, shared_ffn=24, shared_gate=True, dense_blocks="1",
                            qkv_bias=True, moe_ffn=16, gate_norm="never"),
          "olmoe": dict(qk_norm=True, qk_norm_span="all", gate_norm="never")}


@pytest.mark.parametrize("kind", list(ENGINE))
def test_minitron_export_writes_what_transformers_loads(tmp_path, kind):
    """`minitron export --hf` of an engine model of the family's knobs trained two steps (the
    shared gate, the norms and the experts moved): transformers' class loads it with the
    engine's logits (1e-9, float64 parts), and it reads back into the engine bit for bit."""
    from minitron import checkpoint
    from minitron.config import PRESETS
    from minitron.train import Trainer

    cfg = PRESETS["moe-tiny"].replace(**ENGINE[kind])
    tr = Trainer(cfg, ParallelConfig(), TrainConfig(steps=2, global_batch=2, dtype="float64", lr=1e-2, warmup=1,
                                                    eval_every=0, progress=False))
    for i in range(2):
        tr.step(i)
    checkpoint.save(str(tmp_path / "ckpt"), 2, tr)
    assert cli.main(["export", "--ckpt-dir", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf")]) == 0
    theirs = float64_parts(transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf"), dtype=torch.float64, experts_implementation="eager").eval())
    assert type(theirs).__name__ == hf_moe.MOE_FAMILIES[kind].architecture
    x, _ = tr.local_batch(5)
    assert _rel(_logits(tr.model.eval(), x), _logits(theirs, x)) < TOL
    back = hf.load_full(str(tmp_path / "hf"), hf.model_config(str(tmp_path / "hf")))
    assert all(torch.equal(back[p.shard.name]["param"], p.detach()) for p in tr.params)


@pytest.mark.parametrize("kind", list(ENGINE))
def test_analysis_counts_the_families_knobs(kind):
    """analysis.experts counts a MoE block as built (the shared expert's own width and its
    gate); the model-FLOPs formula adds the gate's 2h per token and MoE block."""
    from minitron.analysis.experts import moe_layer_params, total_params
    from minitron.config import PRESETS
    from minitron.model import GPT, num_params
    from minitron.model_flops import model_flops_per_step
    from minitron.moe import moe_layers

    cfg = PRESETS["moe-tiny"].replace(**ENGINE[kind])
    gpt = GPT(cfg)
    moe = moe_layers([gpt])
    assert [m.layer for m in moe] == ([0, 2] if kind == "qwen2_moe" else [0, 1])  # Qwen2-MoE's block 1 dense
    assert all(sum(p.numel() for p in m.parameters()) == sum(moe_layer_params(cfg).values()) for m in moe)
    assert total_params(cfg) == num_params(gpt)
    ungated = model_flops_per_step(cfg.replace(shared_gate=False), 1) if cfg.shared_gate else None
    if ungated is not None:
        assert model_flops_per_step(cfg, 1) - ungated == 3 * cfg.seq_len * len(moe) * 2 * cfg.hidden
