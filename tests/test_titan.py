"""torchtitan's Llama 3 and minitron read each other's DCP checkpoints (``minitron/titan.py``).

torchtitan's own model (its ``debugmodel`` flavour of Llama 3: 6 layers, width 256, 16 heads,
Llama 3.1 rope scaling; and the same with grouped-query attention over 4 kv heads and tied
embeddings) is built at random and saved with ``torch.distributed.checkpoint`` as torchtitan's
checkpointer writes it (its ``ModelWrapper``'s flat keys, a train state beside them); minitron
loads the model's keys and its logits equal torchtitan's. A random minitron Llama of the same
shape saved by ``titan.save_dcp`` loads into torchtitan's model (through ``ModelWrapper``)
with equal logits. torchtitan's attention kernel is swapped for its
own ``ScaledDotProductAttention`` (its default, FlexAttention, needs ``torch.compile``).

torchtitan lives beside the environment (`make env` installs it into .venv/titan with
--no-deps): it brings triton and spmd_types onto the path, so its side runs in a process
of its own, as tests/test_fp8.py runs torchao's."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from minitron import titan
from minitron.config import LLAMA, ModelConfig
from minitron.model import GPT

TITAN = Path(os.environ.get("MINITRON_TITAN") or Path(sys.prefix) / "titan")  # where `make env` puts it
ROOT = Path(__file__).resolve().parents[1]
SEQ = 24
# torchtitan rotates queries and keys in float32 (complex64) even in a float64 model: its
# logits carry float32 rounding (~1e-7 here), as transformers' do (tests/test_hf_llama.py)
FLOOR = 1e-6
# queries, keys (and torchtitan's fused values) scaled up: attention sharp enough that a misplaced
# rotary pair shows (x4: ~1e-7 of rounding; x8 would lift torchtitan's float32 rounding to ~2e-6)
SHARP = 4.0
# torchtitan's debugmodel, as minitron describes it (titan.model_config must agree)
DEBUGMODEL = ModelConfig(layers=6, hidden=256, heads=16, ffn=768, seq_len=SEQ, vocab=2048, norm_eps=1e-5,
                         rope_base=500000.0, rope_scaling="llama3", rope_factor=8.0, rope_original_context=8192,
                         rope_low_freq=1.0, rope_high_freq=4.0, name="llama3-torchtitan", **LLAMA)
CASES = {"debugmodel": DEBUGMODEL, "gqa_tied": DEBUGMODEL.replace(kv_heads=4, tied_embeddings=True)}

TITAN_SCRIPT = """
import json, sys
from functools import partial
from pathlib import Path
import torch
import torch.distributed.checkpoint as dcp
from torchtitan.components.checkpointer.base import ModelWrapper
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.config_utils import make_gqa_config
from torchtitan.models.llama3 import model_registry
from minitron import checkpoint, titan

INIT = {"weight": partial(torch.nn.init.trunc_normal_, std=0.02), "bias": torch.nn.init.zeros_}

def config(kv, tied):
    cfg = model_registry("debugmodel").model
    cfg.enable_weight_tying = tied
    for layer in cfg.layers:
        a = layer.attention
        layer.attention = make_gqa_config(dim=cfg.dim, n_heads=a.n_heads, n_kv_heads=kv, rope=a.rope,
                                          wqkv_param_init=INIT, wo_param_init=INIT, fuse_qkv=True,
                                          inner_attention=ScaledDotProductAttention.Config())
    return cfg

def build(cfg, seed):
    torch.manual_seed(seed)
    model = cfg.build()
    model.init_states()
    return model.double().eval()

root, x = Path(sys.argv[1]), torch.load(sys.argv[1] + "/x.pt")
out = {}
for name, (kv, tied) in json.loads(sys.argv[2]).items():
    cfg = config(kv, tied)
    model = build(cfg, 0)
    with torch.no_grad():  # sharp attention and norms away from 1: a misplaced row cannot hide
        for key, p in model.named_parameters():
            if key.endswith("wqkv.weight"):
                p.mul_(float(sys.argv[3]))
            elif "norm" in key:
                p.add_(torch.randn_like(p) * 0.1)
    # as torchtitan's checkpointer writes: the model's keys flat, its other states beside them
    state = {**ModelWrapper(model).state_dict(), "train_state": {"step": 10, "ntokens_seen": 4096}}
    dcp.save(state, checkpoint_id=str(root / name / "titan"), no_dist=True)
    other = ModelWrapper(build(cfg, 1))
    state = other.state_dict()
    dcp.load(state, checkpoint_id=str(root / name / "minitron"), no_dist=True)
    other.load_state_dict(state)
    other = other.model[0]
    with torch.no_grad():
        out[name] = (checkpoint.model_record(titan.model_config(cfg, x.shape[1])), model(x), other(x))
torch.save(out, sys.argv[1] + "/out.pt")
"""


def _random_minitron(cfg):
    torch.manual_seed(2)
    model = GPT(cfg).double().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".attn.q" in n or ".attn.kv" in n:  # attn.q, attn.qkv and attn.kv
                p.mul_(SHARP)
            elif "ln" in n:  # ln1, ln2, ln_f
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="module")
def titan_side(tmp_path_factory):
    """{case: (model record, torchtitan's logits of its own save, of minitron's save)}, one process;
    minitron's random models are written first, and the case's folder holds both saves."""
    if not (TITAN / "torchtitan").is_dir():
        pytest.skip(f"torchtitan is not in {TITAN}: run `make env`")
    root = tmp_path_factory.mktemp("titan")
    torch.manual_seed(3)
    x = torch.randint(0, DEBUGMODEL.vocab, (2, SEQ))
    torch.save(x, root / "x.pt")
    mine = {}
    for name, cfg in CASES.items():
        mine[name] = _random_minitron(cfg)
        titan.save_dcp(root / name / "minitron", mine[name].state_dict(), cfg)
    cases = {name: (cfg.n_kv_heads, cfg.tied_embeddings) for name, cfg in CASES.items()}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TITAN)]), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", TITAN_SCRIPT, str(root), json.dumps(cases), str(SHARP)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return root, x, mine, torch.load(root / "out.pt")


@pytest.mark.parametrize("name", list(CASES))
def test_torchtitan_checkpoint_loads_into_minitron(titan_side, name):
    from minitron.checkpoint import model_record

    root, x, _, out = titan_side
    record, theirs, _ = out[name]
    cfg = CASES[name]
    assert record == model_record(cfg)  # titan.model_config reads torchtitan's config as written above
    full = titan.load_dcp(root / name / "titan", cfg)
    model = GPT(cfg).double().eval()
    missing, unexpected = model.load_state_dict({k: rec["param"] for k, rec in full.items()}, strict=False)
    assert (missing, unexpected) == (["lm_head.weight"] if cfg.tied_embeddings else [], [])  # tied: wte's alias
    with torch.no_grad():
        err = float((model(x) - theirs).abs().max())
    assert err < FLOOR * float(theirs.abs().max()), (name, err)


@pytest.mark.parametrize("name", list(CASES))
def test_minitron_checkpoint_loads_into_torchtitan(titan_side, name):
    _, x, mine, out = titan_side
    _, _, theirs = out[name]
    with torch.no_grad():
        want = mine[name](x)
    assert float((theirs - want).abs().max()) < FLOOR * float(want.abs().max()), name


def test_round_trip_and_refusals(tmp_path):
    """Without torchtitan: minitron -> torchtitan's keys -> minitron is exact, and a save of
    another size is refused naming the key (a missing block, a kv projection's shape)."""
    from minitron.config import ConfigError

    cfg = CASES["gqa_tied"]
    state = _random_minitron(cfg).state_dict()
    back = titan.from_titan(titan.to_titan(state, cfg), cfg)
    assert set(back) == set(state) - {"lm_head.weight"}  # tied: the embedding's alias is not a tensor of its own
    assert all(torch.equal(back[k], state[k]) for k in back)
    titan.save_dcp(tmp_path, _random_minitron(DEBUGMODEL).state_dict(), DEBUGMODEL)
    with pytest.raises(ConfigError, match="holds no 'layers.6.attention_norm.weight'"):
        titan.load_dcp(tmp_path, DEBUGMODEL.replace(layers=7))
    with pytest.raises(ConfigError, match=r"'layers.0.attention.qkv_linear.wk.weight' is \[256, 256\], the model "
                                          r"needs \[64, 256\]"):
        titan.load_dcp(tmp_path, cfg)
    rope = SimpleNamespace(scaling="none", theta=1e4)  # torchtitan's config read by attribute
    attn = SimpleNamespace(n_heads=16, n_kv_heads=None, head_dim=32, qk_norm=None, rope=rope)
    layer = SimpleNamespace(attention=attn, feed_forward=SimpleNamespace(w1=SimpleNamespace(out_features=768)))
    odd = SimpleNamespace(dim=256, vocab_size=2048, layers=[layer], norm=SimpleNamespace(eps=1e-5),
                          enable_weight_tying=False)
    with pytest.raises(ConfigError, match="a head_dim other than dim / n_heads"):
        titan.model_config(odd, SEQ)
    rope.scaling = "yarn"
    with pytest.raises(ConfigError, match="rope scaling 'yarn' is not read here"):
        titan.model_config(odd, SEQ)
    for field, value in (("qkv_bias", True), ("window", 8), ("rope_scaling", "yarn"), ("positions", "learned")):
        with pytest.raises(ConfigError, match="cannot be read or written as torchtitan's Llama 3"):
            titan.to_titan(state, cfg.replace(**{field: value}))
