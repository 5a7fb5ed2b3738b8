"""Imported checkpoints are checked like the engine's own, and each family's semantics are
matched: random `transformers` models built and saved locally
(nothing is downloaded), then planted with what a careful user or an unlucky disk brings.

* model flags given with --init-from are applied where they leave the loaded model as it is
  (dropout, the balancing loss' weight) and refused in one line otherwise, naming each;
* non-finite weights, invalid or mistyped config values, declared sizes beyond the files
  (refused from the names alone, before any list of tensors is made), tensors the config
  does not account for and a tied config beside a distinct output matrix: one line each;
  a sharded save_pretrained directory (index + shards) loads with transformers' logits;
* Mixtral's gate (transformers renormalises the top-k scores, a top-1 gate is 1) for every
  expert count and top-k tried; export refuses what a family cannot express, naming it.
"""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors.torch import load_file, save_file  # noqa: E402

from minitron import hf  # noqa: E402
from minitron.config import ModelConfig, TrainConfig, preset  # noqa: E402
from minitron.tools import cli  # noqa: E402
from minitron.tools.commands.options import model_from  # noqa: E402
from minitron.train import single_device_model  # noqa: E402

from hf_models import float64_mixtral  # noqa: E402

TOL = 1e-9  # float64, transformers' float32 modules swapped for float64 ones (see _mixtral)


def _error(capsys, argv) -> str:
    capsys.readouterr()  # transformers' own progress bars
    assert cli.main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("minitron: error: ") and "Traceback" not in err, err
    return err


def _llama(path, tied=False, layers=2):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   rms_norm_eps=1e-5, tie_word_embeddings=tied, bos_token_id=None, eos_token_id=None,
                                   pad_token_id=None)
    model = transformers.LlamaForCausalLM(cfg).double().eval()
    return model


def _gpt2(path):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=256,
                                  bos_token_id=None, eos_token_id=None)
    model = transformers.GPT2LMHeadModel(cfg).double().eval()
    model.save_pretrained(str(path))
    return model


def _mixtral(path, experts=4, top_k=2, float32_parts=False):
    return float64_mixtral(path, experts, top_k, float32_parts, seed=experts * 10 + top_k)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    _llama(d / "llama").save_pretrained(str(d / "llama"))
    _gpt2(d / "gpt2")
    _mixtral(d / "mixtral")
    return d


def _variant(src, dst, config=None, tensors=None):
    """A copy of directory `src` with its config.json updated by `config` and its tensors by
    `tensors` ({name: tensor, or None to drop it})."""
    dst.mkdir()
    c = {**json.loads((src / "config.json").read_text()), **(config or {})}
    (dst / "config.json").write_text(json.dumps(c))
    state = load_file(str(src / "model.safetensors"))
    for k, v in (tensors or {}).items():
        if v is None:
            state.pop(k)
        else:
            state[k] = v
    save_file(state, str(dst / "model.safetensors"))
    return dst


# --- class 2: model flags with --init-from ---------------------------------------------------
@pytest.mark.parametrize("family,flags,words", [
    ("llama", ["--rope-base", "500000"], "rope_base 10000.0, not 500000.0"),
    ("llama", ["--norm-eps", "1e-6"], "norm_eps 1e-05, not 1e-06"),
    ("llama", ["--positions", "learned"], "positions rope, not learned"),
    ("llama", ["--norm", "layernorm", "--bias"], "norm rmsnorm, not layernorm, bias False, not True"),
    ("llama", ["--tied"], "tied_embeddings False, not True"),
    ("llama", ["--experts", "4"], "experts 0, not 4"),
    ("mixtral", ["--router", "sigmoid"], "router softmax, not sigmoid"),
    ("mixtral", ["--top-k", "1"], "top_k 2, not 1"),
    ("mixtral", ["--capacity-factor", "1.25"], "capacity_factor 0.0, not 1.25"),
    ("mixtral", ["--experts", "8", "--moe-every", "2"], "experts 4, not 8, moe_every 1, not 2"),
    ("gpt2", ["--positions", "rope"], "positions learned, not rope"),
    ("gpt2", ["--hidden", "64"], "hidden 32, not 64"),
])
def test_init_from_refuses_model_flags_it_cannot_apply(dirs, capsys, family, flags, words):
    err = _error(capsys, ["train", "--steps", "1", "--no-progress", "--init-from", dirs / family] + flags)
    assert words in err and "the directory decides these; drop " + flags[0] in err, err


def test_init_from_applies_the_flags_that_leave_the_model_as_loaded(dirs):
    def model(family, *flags):
        return model_from(cli.build_parser().parse_args(["train", "--init-from", str(dirs / family), *flags]))

    assert model("llama", "--dropout", "0.1").dropout == 0.1
    assert model("mixtral", "--aux-loss", "0.1", "--seq-len", "16").replace(aux_loss=0.01, seq_len=32) == \
        model("mixtral").replace(aux_loss=0.01)
    same = model("llama", "--rope-base", "10000", "--norm-eps", "1e-5", "--kv-heads", "2", "--positions", "rope")
    assert same == model("llama")  # flags that agree with the directory are no change


# --- class 3: imported checkpoints checked like the engine's -----------------------------------
def _nan_at(src, name):
    t = load_file(str(src / "model.safetensors"))[name].clone()
    t.view(-1)[3] = float("nan")
    return {name: t}


PLANTS = [
    ("llama", "nan", lambda d: {"tensors": _nan_at(d, "model.layers.1.mlp.down_proj.weight")},
     "non-finite values in 'model.layers.1.mlp.down_proj.weight'"),
    ("gpt2", "inf", lambda d: {"tensors": {"transformer.wte.weight": torch.full((256, 32), float("inf"),
                                                                                dtype=torch.float64)}},
     "non-finite values in 'transformer.wte.weight'"),
    ("llama", "theta0", lambda d: {"config": {"rope_theta": 0, "rope_parameters": None}}, "rope_theta = 0: it must be positive"),
    ("llama", "theta-", lambda d: {"config": {"rope_parameters": {"rope_type": "default", "rope_theta": -5.0}}},
     "rope_parameters.rope_theta = -5.0: it must be positive"),
    ("llama", "eps-", lambda d: {"config": {"rms_norm_eps": -1e-6}}, "rms_norm_eps = -1e-06: it must be positive"),
    ("gpt2", "eps0", lambda d: {"config": {"layer_norm_epsilon": 0}}, "layer_norm_epsilon = 0: it must be positive"),
    ("llama", "layers1e9", lambda d: {"config": {"num_hidden_layers": 10**9}},
     "declares 1000000000 layers but the weights hold 2"),
    ("gpt2", "layers3", lambda d: {"config": {"n_layer": 3}}, "declares 3 layers but the weights hold 2"),
    ("mixtral", "experts1e9", lambda d: {"config": {"num_local_experts": 10**9}},
     "declares 1000000000 experts but the weights hold 4"),
    ("mixtral", "fifth", lambda d: {"tensors": {f"model.layers.0.block_sparse_moe.experts.4.{w}.weight":
                                                torch.zeros(64 if w != "w2" else 32, 32 if w != "w2" else 64,
                                                            dtype=torch.float64) for w in ("w1", "w2", "w3")}},
     "declares 4 experts but the weights hold 5 (numbered up to 4)"),
    ("llama", "tiedstr", lambda d: {"config": {"tie_word_embeddings": "false"}},
     'tie_word_embeddings = "false": it must be true or false'),
    ("llama", "epsstr", lambda d: {"config": {"rms_norm_eps": "1e-5"}}, 'rms_norm_eps = "1e-5": it must be a number'),
    ("mixtral", "expertsfloat", lambda d: {"config": {"num_local_experts": 4.0}},
     "num_local_experts = 4.0: it must be an integer"),
    ("llama", "ropelist", lambda d: {"config": {"rope_parameters": [10000]}}, "rope_parameters = [10000]: it must be an object"),
    ("llama", "extrabias", lambda d: {"tensors": {"model.layers.0.self_attn.q_proj.bias": torch.zeros(32, dtype=torch.float64)}},
     "1 tensor(s) its config.json does not account for (model.layers.0.self_attn.q_proj.bias)"),
    ("gpt2", "extra", lambda d: {"tensors": {"transformer.h.1.mlp.c_gate.weight": torch.zeros(3, dtype=torch.float64)}},
     "does not account for (transformer.h.1.mlp.c_gate.weight)"),
    ("llama", "tieddistinct", lambda d: {"config": {"tie_word_embeddings": True}},
     "ties the output to the embedding (tie_word_embeddings) but the weights hold a distinct lm_head.weight"),
]


@pytest.mark.parametrize("family,name,plant,words", PLANTS, ids=[p[1] for p in PLANTS])
def test_imported_checkpoints_are_checked_like_the_engines(dirs, tmp_path, capsys, family, name, plant, words):
    """One line before any rank starts, for train and for sample."""
    d = _variant(dirs / family, tmp_path / name, **plant(dirs / family))
    assert words in _error(capsys, ["train", "--steps", "1", "--no-progress", "--vocab", "256", "--init-from", d])
    assert words in _error(capsys, ["sample", "--init-from", d, "--tokens", "2"])


def test_a_tied_config_with_the_embedding_as_output_loads(dirs, tmp_path):
    emb = load_file(str(dirs / "llama" / "model.safetensors"))["model.embed_tokens.weight"]
    d = _variant(dirs / "llama", tmp_path / "tied", {"tie_word_embeddings": True}, {"lm_head.weight": emb.clone()})
    cfg = hf.model_config(str(d))
    hf.check_weights(str(d), cfg)
    hf.check_values(str(d), cfg)
    assert cfg.tied_embeddings


def test_a_sharded_save_pretrained_directory_loads(tmp_path, capsys):
    """save_pretrained with a small max_shard_size writes model.safetensors.index.json and
    shards: the same logits as transformers; a shard missing is named."""
    theirs = _llama(tmp_path / "sharded", tied=False, layers=3)
    theirs.save_pretrained(str(tmp_path / "sharded"), max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    cfg = hf.model_config(str(tmp_path / "sharded"))
    gpt = single_device_model(cfg, hf.load_full(str(tmp_path / "sharded"), cfg), TrainConfig(dtype="float64"))
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, got = theirs(x).logits, gpt.eval()(x)
    assert float((got - want).abs().max()) <= 1e-6 * float(want.abs().max())  # transformers' float32 RMSNorm
    next(iter(sorted((tmp_path / "sharded").glob("model-*.safetensors")))).unlink()
    assert "does not exist (its index names it)" in _error(capsys, ["sample", "--init-from", tmp_path / "sharded"])


# --- class 4: a family's semantics -------------------------------------------------------------
GATES = [(2, 1), (2, 2), (3, 1), (3, 2), (3, 3), (4, 1), (4, 3), (4, 4), (8, 1), (8, 2), (8, 8)]


@pytest.mark.parametrize("experts,top_k", GATES)
def test_mixtral_gate_matches_transformers_for_every_top_k(tmp_path, experts, top_k):
    """minitron's logits equal transformers' Mixtral to 1e-9 (float64) for E experts, top-k
    (top-1 included: transformers' gate is then 1); the export loads back into transformers
    with the same logits; the engine's own top-1 (the softmax score as gate) is refused."""
    from transformers import MixtralForCausalLM

    theirs = _mixtral(tmp_path / "in", experts, top_k)
    cfg = hf.model_config(str(tmp_path / "in"))
    assert (cfg.experts, cfg.top_k, cfg.gate_norm) == (experts, top_k, "always")
    gpt = single_device_model(cfg, hf.load_full(str(tmp_path / "in"), cfg), TrainConfig(dtype="float64"))
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(experts + top_k))
    with torch.no_grad():
        want, got = theirs(x).logits, gpt.eval()(x)
    assert float((got - want).abs().max()) <= TOL * float(want.abs().max())
    full = {n: p.detach() for n, p in ((p.shard.name, p) for p in gpt.parameters())}
    hf.save(str(tmp_path / "out"), full, cfg)
    back = MixtralForCausalLM.from_pretrained(str(tmp_path / "out"), experts_implementation="eager").double().eval()
    own = _mixtral(tmp_path / "own", experts, top_k, float32_parts=True)
    with torch.no_grad():
        assert torch.equal(back(x).logits, own(x).logits)
    if top_k == 1:
        with pytest.raises(Exception, match="top-1 gate is 1"):
            hf.save(str(tmp_path / "auto"), full, cfg.replace(gate_norm="auto"))


@pytest.mark.parametrize("change,words", [
    ({"top_k": 1}, "its top-1 gate is 1, and this model's is the softmax score (gate_norm auto)"),
    ({"capacity_factor": 1.25}, "capacity_factor 1.25"),
    ({"router": "sigmoid"}, "router sigmoid"),
    ({"moe_every": 2}, "moe_every 2"),
    ({"shared_experts": 1}, "shared_experts 1"),
    ({"bias_update": 0.001}, "bias_update 0.001"),
    ({"moe_ffn": 32}, "moe_ffn 32"),
    ({"norm": "layernorm"}, "norm layernorm"),
    ({"positions": "learned", "experts": 0, "kv_heads": 2}, "kv_heads 2"),
])
def test_export_refuses_what_the_family_cannot_express(change, words):
    cfg = preset("moe-tiny").replace(**change)
    problem = hf.export_problem(cfg)
    assert words in problem, problem
    with pytest.raises(Exception, match="cannot export this model to Hugging Face"):
        hf.save("/nonexistent/never-written", {}, cfg)


def test_export_writes_what_it_can_express_generically():
    """Every field round-trips through the family's config.json (nothing is refused that a
    family holds): GPT-2 with its own epsilon, a Llama with its rotary base, Mixtral top-2."""
    for cfg in (ModelConfig(norm_eps=1e-6), preset("llama-tiny").replace(rope_base=5e5, norm_eps=1e-6),
                preset("moe-tiny"), preset("moe-tiny").replace(top_k=1, gate_norm="always", aux_loss=0.1)):
        assert hf.export_problem(cfg) == "", cfg
    assert hf.hf_config(ModelConfig(norm_eps=1e-6), torch.float32)["layer_norm_epsilon"] == 1e-6
