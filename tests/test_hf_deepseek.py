"""DeepSeek-V3 checkpoints in and out: a random `transformers.DeepseekV3ForCausalLM` (built
locally, saved with save_pretrained: nothing is downloaded; its experts written per index)
loads with `--init-from` into one device, tp2 x ep2 and pp2 x ep2 (one launch of 4 ranks)
with transformers' logits and greedy tokens; `minitron export` of a trained engine
DeepSeek-V3 writes what `AutoModelForCausalLM` loads with the engine's logits; a planted
mistake in the mapping is caught; what the format cannot hold is refused in one line."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from minitron import hf, hf_deepseek  # noqa: E402
from minitron.config import PRESETS, ParallelConfig, TrainConfig, validate  # noqa: E402
from minitron.tools import cli  # noqa: E402
from minitron.tools.testing import run_on_ranks  # noqa: E402
from minitron.train import Trainer  # noqa: E402

from test_deepseek import HF_FLOOR, _hf_deepseek  # noqa: E402
from test_hf_llama import greedy  # noqa: E402

SEQ, PROMPT, NEW = 16, 8, 8
LAYOUTS = [ParallelConfig(tp=2, ep=2), ParallelConfig(pp=2, ep=2)]


def _saved(path):
    """tests/test_deepseek.py's random DeepSeek-V3 (norms perturbed, selection bias, 4 groups
    of which 2 per token, a first dense layer), saved by transformers to `path`."""
    _, theirs = _hf_deepseek()
    theirs.save_pretrained(str(path))
    return theirs


def _inputs():
    return torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(3))


def _close(got, want) -> bool:
    """Within transformers' float32 norms and router (HF_FLOOR, relative to the logits' scale)."""
    return float((got - want).abs().max()) <= HF_FLOOR * float(want.abs().max())


def _train(layout=ParallelConfig(), init_from: str = "") -> TrainConfig:
    m = 2 if layout.pp > 1 else 1
    return TrainConfig(steps=2, global_batch=m * layout.data_replicas, microbatches=m, dtype="float64", lr=1e-2,
                       warmup=1, eval_every=0, progress=False, init_from=init_from)


def test_deepseek_directory_loads_on_one_device(tmp_path):
    """The files save_pretrained writes (experts per index) read into one device: the
    engine's logits are transformers', greedy decoding token for token; the loaded tensors
    are those of transformers' in-memory (fused) state dict."""
    theirs = _saved(tmp_path)
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in hf.shapes_in_files(str(tmp_path))
    cfg = hf.model_config(str(tmp_path), seq_len=SEQ)
    assert (cfg.attention, cfg.experts, cfg.expert_groups, cfg.topk_groups, cfg.dense_layers, cfg.mtp_depths) == (
        "mla", 8, 4, 2, 1, 0)
    tr = Trainer(cfg, ParallelConfig(), _train(init_from=str(tmp_path)))
    x, mine = _inputs(), tr.model.eval()
    with torch.no_grad():
        assert _close(mine(x), theirs(x).logits)
        want = theirs.generate(x[:1, :PROMPT], max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        assert torch.equal(greedy(mine, x[:1, :PROMPT], NEW), want)
    memory = hf_deepseek.from_hf(theirs.state_dict(), cfg)
    assert all(torch.equal(memory[p.shard.name], p.detach()) for p in tr.params)


def test_planted_mistakes_are_caught(tmp_path, monkeypatch):
    """The check can fail: gate and up rows concatenated instead of interleaved, or the
    rotary rows of q and k read in rotate-half order, move the logits far past HF_FLOOR."""
    theirs = _saved(tmp_path)
    cfg = hf.model_config(str(tmp_path), seq_len=SEQ)
    x = _inputs()
    with torch.no_grad():
        want = theirs(x).logits

    def logits():
        with torch.no_grad():
            return Trainer(cfg, ParallelConfig(), _train(init_from=str(tmp_path))).model.eval()(x)

    assert _close(logits(), want)
    monkeypatch.setattr(hf_deepseek, "_interleave", lambda gate, up: torch.cat([gate, up], dim=-2))
    assert not _close(logits(), want)
    monkeypatch.undo()
    r, nope = cfg.qk_rope_head_dim, cfg.qk_nope_head_dim
    half = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)])  # rotate-half's order of the pairs
    starts = [h * (nope + r) for h in range(cfg.heads)]  # each head's rows: [nope | rope]
    rows = torch.cat([torch.cat([torch.arange(s0, s0 + nope), s0 + nope + half]) for s0 in starts])
    kv_rows = torch.cat([torch.arange(cfg.kv_lora_rank), cfg.kv_lora_rank + half])
    real = hf_deepseek.from_hf

    def rotate_half(state, c):
        out = real(state, c)
        for i in range(c.layers):
            out[f"blocks.{i}.attn.q_b.weight"] = out[f"blocks.{i}.attn.q_b.weight"][rows]
            out[f"blocks.{i}.attn.kv_a.weight"] = out[f"blocks.{i}.attn.kv_a.weight"][kv_rows]
        return out

    monkeypatch.setattr(hf_deepseek, "from_hf", rotate_half)
    assert not _close(logits(), want)


def test_minitron_deepseek_exports_what_transformers_loads(tmp_path):
    """`minitron export` of a DeepSeek-V3 trained two steps (norms and selection bias moved,
    the bias by its loss-free update): DeepseekV3ForCausalLM loads it with the engine's
    logits, and the directory reads back into the engine bit for bit."""
    from minitron import checkpoint

    cfg = PRESETS["deepseek-v3-tiny"].replace(mtp_depths=0, norm_eps=hf_deepseek.LATENT_EPS)
    tr = Trainer(cfg, ParallelConfig(), _train())
    for i in range(2):
        tr.step(i)
    checkpoint.save(str(tmp_path / "ckpt"), 2, tr)
    assert cli.main(["export", "--ckpt-dir", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["model_type"], config["n_group"], config["first_k_dense_replace"]) == ("deepseek_v3", 4, 1)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float64,
                                                                  experts_implementation="eager").eval()
    assert type(theirs).__name__ == "DeepseekV3ForCausalLM"
    x, _ = tr.local_batch(5)
    with torch.no_grad():
        assert _close(tr.model.eval()(x), theirs(x).logits)
    back = hf.load_full(str(tmp_path / "hf"), hf.model_config(str(tmp_path / "hf")))
    assert all(torch.equal(back[p.shard.name]["param"], p.detach()) for p in tr.params)


@pytest.mark.parametrize("change,msg", [
    (dict(), "has no multi-token prediction modules: mtp_depths 1 would be lost"),
    (dict(mtp_depths=0, router="softmax"), "not router softmax"),
    (dict(mtp_depths=0, attention="standard"), "not attention standard"),
    (dict(mtp_depths=0, shared_experts=0), "shared_experts 0"),
    (dict(mtp_depths=0, norm_eps=1e-5), "norm_eps 1e-05 (its latent norms use 1e-06"),
])
def test_export_refused_with_one_line(change, msg):
    problem = hf.export_problem(PRESETS["deepseek-v3-tiny"].replace(**change))
    assert msg in problem and "\n" not in problem


@pytest.mark.parametrize("field,value,msg", [
    ("rope_interleave", False, "rope_interleave false"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}, "rope scaling of type 'yarn'"),
    ("norm_topk_prob", False, "norm_topk_prob false"),
    ("rms_norm_eps", 1e-5, "rms_norm_eps 1e-05: its latent norms"),
    ("n_shared_experts", 0, "must be a positive integer"),
    ("kv_lora_rank", None, "must be a positive integer"),
])
def test_bad_deepseek_config_refused_with_one_line(tmp_path, capsys, field, value, msg):
    from safetensors.torch import save_file

    c = hf_deepseek.config_fields(PRESETS["deepseek-v3-tiny"].replace(mtp_depths=0, norm_eps=1e-6), torch.float32)
    (tmp_path / "config.json").write_text(json.dumps({**c, field: value}))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    assert cli.main(["train", "--steps", "1", "--no-progress", "--init-from", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and msg in err, err


def _layout_logits(tr, comm, x):
    """The layout's full logits of `x` on every rank: the local logits gathered over tp; with
    two pipeline stages (LAYOUTS) the first stage's hidden states broadcast over pp to the
    second, whose logits are broadcast back."""
    vocab, chunk = tr.mcfg.vocab, tr.chunks[0]
    if comm.size("pp") == 1:
        return comm.all_gather(chunk(x), "tp", dim=-1)[..., :vocab]
    first = comm.index("pp") == 0
    h = chunk(x) if first else torch.empty(*x.shape, tr.mcfg.hidden, dtype=torch.float64)
    h = comm.broadcast(h.contiguous(), "pp", src_index=0)
    logits = torch.empty(*x.shape, vocab, dtype=torch.float64) if first else \
        comm.all_gather(chunk(h), "tp", dim=-1)[..., :vocab]
    return comm.broadcast(logits.contiguous(), "pp", src_index=1)


def _init_job(comm, hf_dir, layouts):
    """Each layout `--init-from` the directory: its logits of a fixed batch and its greedy
    tokens, rank 0's (every rank computes the same)."""
    from minitron.comm import Comm, CommTrace
    from minitron.grid import ProcessGrid

    out = []
    for layout in layouts:
        grid = ProcessGrid(tp=layout.tp, dp=layout.dp, pp=layout.pp, ep=layout.ep, rank=comm.grid.rank).build_groups()
        c = Comm(grid, CommTrace())
        tr = Trainer(hf.model_config(hf_dir, seq_len=SEQ), layout, _train(layout, hf_dir), c)
        for chunk in tr.chunks:
            chunk.eval()
        with torch.no_grad():
            x = _inputs()
            logits = _layout_logits(tr, c, x)
            tokens = greedy(lambda ids: _layout_logits(tr, c, ids), x[:1, :PROMPT], NEW)
        out.append((logits, tokens))
    return out


@pytest.mark.multirank
def test_deepseek_directory_loads_into_tp2_ep2_and_pp2_ep2(tmp_path):
    """--init-from into tp2 x ep2 (the up-projections, heads and vocabulary split, experts
    over two ranks) and pp2 x ep2 (the dense first block and a MoE block on stage 0), in one
    launch of 4 ranks: transformers' logits and its greedy tokens."""
    theirs = _saved(tmp_path)
    cfg = hf.model_config(str(tmp_path), seq_len=SEQ)
    for layout in LAYOUTS:
        validate(cfg, layout, _train(layout, str(tmp_path)), world=4)
    res = run_on_ranks(_init_job, ParallelConfig(dp=4), str(tmp_path), LAYOUTS)[0]
    x = _inputs()
    with torch.no_grad():
        want = theirs(x).logits
        tokens = theirs.generate(x[:1, :PROMPT], max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    for layout, (logits, ours) in zip(LAYOUTS, res):
        assert _close(logits, want), layout.describe()
        assert torch.equal(ours, tokens), (layout.describe(), ours, tokens)
