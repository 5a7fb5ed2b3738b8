"""Llama checkpoints in and out: a random `transformers.LlamaForCausalLM` (built locally, saved
with save_pretrained: nothing is downloaded) loads into minitron on any layout, minitron's
Llama exports what transformers loads, greedy decoding agrees token for token, and bad
directories get one line before any rank starts."""
import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from minitron import hf  # noqa: E402
from minitron.config import ParallelConfig, TrainConfig, preset, validate  # noqa: E402
from minitron.tools import cli  # noqa: E402
from minitron.tools.testing import run_on_ranks  # noqa: E402
from minitron.train import Trainer  # noqa: E402

from hf_models import random_family  # noqa: E402

TOL = 1e-9  # minitron against minitron, float64
# transformers' LlamaRMSNorm normalises in float32 even in a float64 model (and computes the
# rotary angles in float32, as minitron does): its logits carry float32 rounding, ~5e-8 here
HF_FLOOR = 1e-6


def random_llama(path, kv: int = 2, layers: int = 2, tied: bool = False, heads: int = 4, hidden: int = 32, **extra):
    """A random float64 LlamaForCausalLM saved by transformers; RMSNorm weights perturbed and
    queries and keys scaled up (sharp attention), so a misplaced tensor cannot go unseen."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=32,
                                   rms_norm_eps=1e-5, tie_word_embeddings=tied, bos_token_id=None,
                                   eos_token_id=None, pad_token_id=None, **extra)
    model = transformers.LlamaForCausalLM(cfg).double().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
            elif n.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(10.0)
    model.save_pretrained(str(path))
    return model


def greedy(step, idx, n: int):
    """n tokens after idx by argmax of `step(idx)`'s last logits."""
    for _ in range(n):
        idx = torch.cat([idx, step(idx)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx


@pytest.mark.parametrize("kv,tied", [(2, False), (1, True), (4, False)])
def test_llama_directory_loads_with_equal_logits_and_greedy_tokens(tmp_path, kv, tied):
    theirs = random_llama(tmp_path, kv, tied=tied)
    cfg = hf.model_config(str(tmp_path))
    assert (cfg.n_kv_heads, cfg.tied_embeddings, cfg.positions, cfg.norm) == (kv, tied, "rope", "rmsnorm")
    tr = Trainer(cfg, ParallelConfig(), TrainConfig(dtype="float64", init_from=str(tmp_path)))
    x, _ = tr.local_batch(0)
    mine = tr.model.eval()
    with torch.no_grad():
        assert (mine(x) - theirs(x).logits).abs().max() < HF_FLOOR
        prompt = x[:1, :8]
        ours = greedy(mine, prompt, 16)
        want = theirs.generate(prompt, max_new_tokens=16, do_sample=False, min_new_tokens=16)
    assert torch.equal(ours, want), (ours, want)


def test_minitron_llama_exports_what_transformers_loads(tmp_path):
    cfg = preset("llama-tiny")
    tr = Trainer(cfg, ParallelConfig(), TrainConfig(dtype="float64", lr=1e-2, warmup=1, eval_every=0, progress=False))
    for i in range(3):  # the RMSNorm weights move away from 1
        tr.step(i)
    res = hf.save(str(tmp_path), {p.shard.name: p.detach() for p in tr.params}, cfg)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["model_type"], config["num_key_value_heads"], res["class"]) == ("llama", 2, "LlamaForCausalLM")
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float64).eval()
    x, _ = tr.local_batch(7)
    with torch.no_grad():
        assert (tr.model.eval()(x) - theirs(x).logits).abs().max() < HF_FLOOR
    # and back: the exported directory loads into minitron bit for bit
    back = hf.load_full(str(tmp_path), hf.model_config(str(tmp_path)))
    assert all(torch.equal(back[p.shard.name]["param"], p.detach()) for p in tr.params)


LAYOUTS = [ParallelConfig(tp=2, pp=2), ParallelConfig(cp=2, tp=2)]
QWEN3_LAYOUT = ParallelConfig(tp=2, dp=2)  # its q/k norms copied on both tensor ranks, their gradients summed


def _init_job(comm, runs):
    """verify_job of each (model, directory, layout) of `runs`, in one launch of ranks."""
    from minitron.comm import Comm, CommTrace
    from minitron.data import load_corpus
    from minitron.grid import ProcessGrid
    from minitron.tools.verify import verify_job

    out = []
    for model, hf_dir, layout in runs:
        grid = ProcessGrid(tp=layout.tp, dp=layout.dp, pp=layout.pp, cp=layout.cp, rank=comm.grid.rank).build_groups()
        out.append(verify_job(Comm(grid, CommTrace()), model, layout, _train(layout, hf_dir), load_corpus(""), None))
    return out


def _train(layout, hf_dir) -> TrainConfig:
    m = 2 if layout.pp > 1 else 1
    return TrainConfig(steps=2, global_batch=2 * m * layout.dp, microbatches=m, dtype="float64", lr=1e-2, warmup=1,
                       eval_every=0, progress=False, init_from=str(hf_dir))


@pytest.mark.multirank
def test_llama_directory_loads_into_tp2_pp2_and_cp2(tmp_path):
    """--init-from into tp2 x pp2 and cp2 x tp2 (kv 1: its head replicated on both tensor
    ranks), and a Qwen3 (q/k norms, head width 12 apart from hidden/heads; tests/
    test_hf_families.py) into tp2 x dp2, in one launch: the layouts' losses and parameters
    equal the single device's (1e-9), and the first loss equals transformers' on the same
    batch (Llama's float32 norms: HF_FLOOR; Qwen3's computing in float64: 1e-9)."""
    theirs = random_llama(tmp_path / "llama", kv=1)
    qwen3 = random_family("qwen3", tmp_path / "qwen3")
    model, q3 = hf.model_config(str(tmp_path / "llama")), hf.model_config(str(tmp_path / "qwen3"), seq_len=32)
    runs = [(model, str(tmp_path / "llama"), layout) for layout in LAYOUTS] + [
        (q3, str(tmp_path / "qwen3"), QWEN3_LAYOUT)]
    for m, d, layout in runs:
        validate(m, layout, _train(layout, d), world=4)
    verdicts = run_on_ranks(_init_job, ParallelConfig(dp=4), runs)[0]
    for (m, d, layout), res, (hf_model, floor) in zip(runs, verdicts, [(theirs, HF_FLOOR)] * 2 + [(qwen3, TOL)]):
        assert res["ok"] and res["max_loss_abs_diff"] <= TOL and res["max_param_rel_diff"] <= TOL, (layout, res)
        x, y = Trainer(m, ParallelConfig(), _train(layout, d)).local_batch(0)  # the whole global batch
        with torch.no_grad():
            want = F.cross_entropy(hf_model(x).logits.flatten(0, 1), y.flatten()).item()
        assert abs(res["reference_losses"][0] - want) < floor, (layout.describe(), res["reference_losses"][0], want)


def _error(capsys, argv) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("minitron: error: "), err
    return err


def test_bad_llama_directories_get_one_line(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    good = tmp_path / "good"
    random_llama(good)
    capsys.readouterr()
    train = ["train", "--steps", "1", "--no-progress", "--tp", "2", "--nproc", "2", "--init-from"]
    state = load_file(str(good / "model.safetensors"))
    config = json.loads((good / "config.json").read_text())

    def variant(name, cfg=None, tensors=None):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg or config))
        save_file(tensors if tensors is not None else state, str(d / "model.safetensors"))
        return str(d)

    missing = {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
    assert "no tensor 'model.layers.1.mlp.up_proj.weight'" in _error(capsys, train + [variant("missing", tensors=missing)])
    wrong = {**state, "model.layers.0.self_attn.k_proj.weight": state["model.layers.0.self_attn.q_proj.weight"].clone()}
    assert "do not belong together" in _error(capsys, train + [variant("wrong", tensors=wrong)])
    scaled = {**config, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 500000.0, "factor": 8.0}}
    assert "rope scaling of type 'dynamic'" in _error(capsys, train + [variant("scaled", scaled)])
    odd = {**config, "num_key_value_heads": 3}
    assert "no layout can group them" in _error(capsys, train + [variant("odd", odd)])
    incomplete = {"model_type": "llama", "hidden_size": 32}
    assert "no 'num_attention_heads'" in _error(capsys, train + [variant("incomplete", incomplete)])
    # a kv_heads this layout cannot split: --tp 4 on 3 kv heads of 6 query heads
    six = tmp_path / "six"
    random_llama(six, kv=3, heads=6, hidden=36)
    capsys.readouterr()
    assert "can be neither split" in _error(capsys, ["train", "--steps", "1", "--tp", "2", "--nproc", "2",
                                                     "--init-from", str(six)])
