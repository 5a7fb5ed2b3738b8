"""The Llama-shaped Hugging Face families (issue 45, item 5): Qwen2 (QKV biases), Qwen3 (q/k
RMSNorm, a head width apart from hidden/heads), Mistral (sliding window) and Llama with
``llama3`` and ``yarn`` rope scaling. For each, a random model that transformers builds and
saves (nothing downloaded) loads with minitron's loader and gives transformers' logits (1e-9,
float64) over a sequence beyond the window and the original rope context; greedy generation
from a prompt longer than both equals transformers' ``generate``; minitron's export loads
back into transformers with the same logits; bad input gets one line.
"""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from minitron import hf  # noqa: E402
from minitron.tools import cli  # noqa: E402
from minitron.tools.sampling import load_model  # noqa: E402
from minitron.train import single_device_model  # noqa: E402
from minitron.config import TrainConfig  # noqa: E402

from hf_models import (FAMILIES, LLAMA3, ORIGINAL, SEQ, WINDOW, YARN, float64_norms,  # noqa: E402
                       random_family)

TOL = 1e-9  # float64, transformers' float32 RMSNorms swapped for float64 ones (hf_models.float64_norms)
# the engine fields each family of hf_models.FAMILIES must load as
CASES = {"llama3": {"rope_scaling": "llama3", "rope_factor": 4.0, "rope_original_context": ORIGINAL},
         "yarn": {"rope_scaling": "yarn", "rope_original_context": ORIGINAL},
         "qwen2": {"qkv_bias": True},
         "qwen3": {"qk_norm": True, "head_width": 12},
         "mistral": {"window": WINDOW}}
# what each family's knob does: without it the same weights compute something else
WITHOUT = {"llama3": {"rope_scaling": ""}, "yarn": {"rope_scaling": ""}, "qwen2": None, "qwen3": None,
           "mistral": {"window": 0}}


def _logits(model, x):
    with torch.no_grad():
        out = model(x)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("name", list(CASES))
def test_family_loads_generates_and_exports_as_transformers(tmp_path, name):
    theirs = random_family(name, tmp_path / "hf")
    mine, cfg = load_model(init_from=str(tmp_path / "hf"), dtype="float64")
    assert {k: getattr(cfg, k) for k in CASES[name]} == CASES[name] and set(CASES) == set(FAMILIES)
    x = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))
    want = _logits(theirs, x)
    assert (_logits(mine.eval(), x) - want).abs().max() < TOL
    if WITHOUT[name] is not None:  # the knob is read, not ignored: without it the logits differ
        plain = single_device_model(cfg.replace(**WITHOUT[name]), hf.load_full(str(tmp_path / "hf"), cfg),
                                    TrainConfig(dtype="float64"))
        assert (_logits(plain.eval(), x) - want).abs().max() > 1e-3
    # greedy decoding from a prompt longer than the window and the original rope context
    prompt = x[:1, :40]
    with torch.no_grad():
        ours = mine.generate(prompt, 8, temperature=1.0, top_k=1)
        greedy = theirs.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert torch.equal(ours, greedy), (ours, greedy)
    # export: transformers loads what minitron writes, with the same logits; and back bit for bit
    full = {p.shard.name: p.detach() for p in mine.parameters()}
    res = hf.save(str(tmp_path / "out"), full, cfg)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert res["class"] == type(theirs).__name__ and written["model_type"] == theirs.config.model_type
    back = float64_norms(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"),
                                                                            dtype=torch.float64).eval())
    assert type(back) is type(theirs) and (_logits(back, x) - want).abs().max() < TOL
    again = hf.load_full(str(tmp_path / "out"), hf.model_config(str(tmp_path / "out")))
    assert hf.model_config(str(tmp_path / "out")).replace(name=cfg.name) == cfg
    assert all(torch.equal(again[k]["param"], t) for k, t in full.items())


def test_mistral_window_is_transformers_on_the_boundary(tmp_path):
    """A query sees exactly W keys, itself included, in both: with the window one shorter
    or longer the engine's logits leave transformers' (the off-by-one a mapping can make)."""
    theirs = random_family("mistral", tmp_path)
    cfg = hf.model_config(str(tmp_path))
    full = hf.load_full(str(tmp_path), cfg)
    x = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(2))
    want = _logits(theirs, x)
    for w, equal in ((WINDOW - 1, False), (WINDOW, True), (WINDOW + 1, False)):
        got = _logits(single_device_model(cfg.replace(window=w), full, TrainConfig(dtype="float64")).eval(), x)
        assert ((got - want).abs().max() < TOL) == equal, w


def _error(capsys, argv) -> str:
    capsys.readouterr()
    assert cli.main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("minitron: error: ") and "Traceback" not in err, err
    return err


def test_bad_family_input_gets_one_line(tmp_path, capsys):
    """An unsupported family names the supported ones; an unknown rope-scaling kind names the
    kinds; an engine model with two families' knobs is refused at export, naming each family's."""
    random_family("qwen2", tmp_path / "good")
    config = json.loads((tmp_path / "good" / "config.json").read_text())
    weights = (tmp_path / "good" / "model.safetensors").read_bytes()

    def variant(name, **changes):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**config, **changes}))
        (d / "model.safetensors").write_bytes(weights)
        return d

    train = ["train", "--steps", "1", "--no-progress", "--init-from"]
    err = _error(capsys, train + [variant("gemma", model_type="gemma")])
    assert "'gemma' model" in err and all(t in err for t in ("gpt2", "llama", "qwen2", "qwen3", "mistral", "mixtral"))
    err = _error(capsys, train + [variant("dynamic", rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4,
                                                                      "factor": 2.0})])
    assert "rope scaling of type 'dynamic'" in err and "llama3, yarn" in err
    typed = {**LLAMA3, "factor": "four"}
    assert 'rope_parameters.factor = "four": it must be a number' in _error(
        capsys, train + [variant("typed", rope_parameters=typed)])
    lacking = {k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}
    assert "llama3 rope scaling without low_freq_factor" in _error(
        capsys, train + [variant("lacking", rope_scaling=lacking)])
    assert "yarn's attention_factor 2.0" in _error(
        capsys, train + [variant("attention", rope_parameters={**YARN, "attention_factor": 2.0})])
    err = _error(capsys, train + [variant("sliding", use_sliding_window=True, sliding_window=8)])
    assert "use_sliding_window" in err
    cfg = hf.model_config(str(tmp_path / "good")).replace(qk_norm=True)
    problem = hf.export_problem(cfg)
    assert "qkv_bias, qk_norm together" in problem and "qwen2 qkv_bias, qwen3 qk_norm, mistral window" in problem


@pytest.mark.parametrize("knobs,cls", [({"qk_norm": True, "head_width": 12}, "Qwen3ForCausalLM"),
                                       ({"window": 5, "rope_scaling": "yarn", "rope_factor": 4.0,
                                         "rope_original_context": 8}, "MistralForCausalLM")])
def test_minitron_export_writes_the_family_transformers_loads(tmp_path, capsys, knobs, cls):
    """`minitron export --hf` of a trained engine model with a family's knob (and rope scaling)
    writes that family's directory: transformers' class loads it with the engine's logits."""
    from minitron import checkpoint
    from minitron.config import ParallelConfig, preset
    from minitron.train import Trainer

    cfg = preset("llama-tiny").replace(**knobs)
    tr = Trainer(cfg, ParallelConfig(), TrainConfig(dtype="float64", lr=1e-2, warmup=1, eval_every=0, progress=False))
    for i in range(2):  # the norms move away from 1
        tr.step(i)
    checkpoint.save(str(tmp_path / "ckpt"), 2, tr)
    assert cli.main(["export", "--ckpt-dir", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf")]) == 0
    theirs = float64_norms(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"),
                                                                             dtype=torch.float64).eval())
    assert type(theirs).__name__ == cls
    x, _ = tr.local_batch(5)
    assert (_logits(tr.model.eval(), x) - _logits(theirs, x)).abs().max() < TOL
