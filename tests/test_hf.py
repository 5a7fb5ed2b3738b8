"""GPT-2 checkpoints in and out: `minitron export --hf` and `--init-from`, against the real
`transformers.GPT2LMHeadModel` (built locally at random: nothing is downloaded)."""
import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from minitron import hf  # noqa: E402
from minitron.tools import cli  # noqa: E402
from minitron.config import ParallelConfig, TrainConfig, preset  # noqa: E402
from minitron.data import batch, load_corpus  # noqa: E402
from minitron.tools.testing import last_json, run_cli  # noqa: E402
from minitron.train import Trainer  # noqa: E402

TOL = 1e-9  # float64


def random_gpt2(path, tied=True, activation="gelu", vocab=256, positions=40, hidden=32, layers=2, heads=4):
    """A random GPT2LMHeadModel in float64, saved by transformers itself. LayerNorms and
    biases are perturbed too, so that a swapped or transposed tensor cannot go unseen."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, n_positions=positions,
                                  vocab_size=vocab, activation_function=activation, tie_word_embeddings=tied,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=None, eos_token_id=None)
    model = transformers.GPT2LMHeadModel(cfg).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(str(path))
    return model


def hf_logits(model, x):
    with torch.no_grad():
        return model(x).logits


@pytest.mark.parametrize("tied,activation", [(True, "gelu"), (False, "gelu_new")])
def test_gpt2_loads_into_minitron_with_equal_logits(tmp_path, tied, activation):
    theirs = random_gpt2(tmp_path, tied, activation)
    cfg = hf.model_config(str(tmp_path), seq_len=32)  # a shorter context than its 40 positions
    assert (cfg.tied_embeddings, cfg.activation) == (tied, "gelu" if activation == "gelu" else "gelu_tanh")
    tr = Trainer(cfg, ParallelConfig(), TrainConfig(dtype="float64", init_from=str(tmp_path)))
    x, _ = tr.local_batch(0)
    with torch.no_grad():
        mine = tr.model.eval()(x)
    assert (mine - hf_logits(theirs, x)).abs().max() < TOL


@pytest.mark.parametrize("tied", [True, False])
def test_minitron_exports_what_transformers_loads_with_equal_logits(tmp_path, tied):
    cfg = preset("tiny").replace(tied_embeddings=tied)
    tr = Trainer(cfg, ParallelConfig(), TrainConfig(dtype="float64", lr=1e-2, warmup=1, eval_every=0))
    for i in range(3):  # biases and LayerNorms move away from 0 and 1
        tr.step(i)
    full = {p.shard.name: p.detach() for p in tr.params}
    res = hf.save(str(tmp_path), full, cfg)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["activation_function"] == "gelu" and config["layer_norm_epsilon"] == 1e-5
    assert config["tie_word_embeddings"] is tied and res["dtype"] == "float64"
    theirs = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path), dtype=torch.float64).eval()
    x, _ = tr.local_batch(7)
    with torch.no_grad():
        mine = tr.model.eval()(x)
    assert (mine - hf_logits(theirs, x)).abs().max() < TOL


def _error(capsys, argv) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("minitron: error: "), err
    return err


def test_bad_gpt2_checkpoints_get_one_line(tmp_path, capsys):
    good = tmp_path / "good"
    random_gpt2(good, vocab=300)
    capsys.readouterr()  # transformers' own progress bars
    train = ["train", "--steps", "1", "--no-progress", "--init-from"]
    assert "is not a directory" in _error(capsys, train + [str(tmp_path / "missing")])
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((good / "config.json").read_text())
    assert "has no model.safetensors" in _error(capsys, train + [str(empty)])
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 32}))
    (other / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
    assert "'bert' model" in _error(capsys, train + [str(other)])
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    c = json.loads((good / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**c, "n_embd": 64}))
    (wrong / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
    assert "do not belong together" in _error(capsys, train + [str(wrong)])
    for i, (bad, says) in enumerate([({**c, "n_embd": "big"}, "n_embd = 'big': it must be a positive integer"),
                                     ({**c, "n_layer": -2}, "n_layer = -2: it must be a positive integer"),
                                     ({k: v for k, v in c.items() if k != "n_head"}, "has no 'n_head'"),
                                     ([1, 2], "is not a JSON object"),
                                     ({**c, "layer_norm_epsilon": "x"}, 'has layer_norm_epsilon = "x": it must be a number')]):
        malformed = tmp_path / f"malformed{i}"  # a config.json that must not surface as Python's own error
        malformed.mkdir()
        (malformed / "config.json").write_text(json.dumps(bad))
        (malformed / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
        assert says in _error(capsys, train + [str(malformed)])
    assert "vocabulary of 256" in _error(capsys, train + [str(good)])  # bytes vs its 300 tokens
    assert "hidden 32, not 64" in _error(capsys, train + [str(good), "--hidden", "64"])
    assert "exceeds the checkpoint's 40 positions" in _error(capsys, train + [str(good), "--seq-len", "64"])
    # (the output beside the checkpoint folder, not inside it: preflight refuses that first)
    assert "no 'latest'" in _error(capsys, ["export", "--ckpt-dir", str(tmp_path), "--hf", str(tmp_path.parent / "o")])


@pytest.mark.multirank
def test_gpt2_into_tp2_pp2_and_the_cube_equals_one_device_and_transformers(tmp_path):
    """A random GPT-2 saved by transformers, loaded with --init-from into tp2 x pp2 (and the
    2x2x2 cube): its first loss is transformers' loss on the same batch, and every step's
    loss and every parameter after training equal the single-device model's."""
    theirs = random_gpt2(tmp_path / "gpt2", positions=32)
    corpus = load_corpus("").split()[0]
    runs = {"tp2.pp2": ["--nproc", "4", "--tp", "2", "--pp", "2", "--microbatches", "2"],
            "cube": ["--nproc", "8", "--tp", "8", "--tp-mode", "3d", "--global-batch", "8"]}
    for name, layout in runs.items():
        code, out, err = run_cli(["verify", "--init-from", str(tmp_path / "gpt2"), "--steps", "3",
                                  "--dtype", "float64", "--json", *layout])
        assert code == 0, err[-2000:]
        res = last_json(out)
        assert res["ok"] and res["max_param_rel_diff"] <= TOL and res["max_loss_abs_diff"] <= TOL, res
        gb = 8 if name == "cube" else 2 * 2  # verify's default: dp * microbatches * max(2, q^2)
        x, y = batch(corpus, 32, gb, 1234, 0)
        ref = F.cross_entropy(hf_logits(theirs, x).flatten(0, 1), y.flatten())
        assert abs(res["losses"][0] - float(ref)) < TOL, (name, res["losses"][0], float(ref))
