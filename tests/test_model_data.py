"""The single-device GPT, its initialisation and the data: pure, in-process."""
import pytest
import torch

from minitron.config import ConfigError, ParallelConfig, TrainConfig, PRESETS
from minitron.context import Context
from minitron.data import ByteCorpus, batch, dp_rows, load_corpus
from minitron.model import GPT, num_params
from minitron.train import Trainer

TINY = PRESETS["tiny"]


def named(model):
    return {p.shard.name: p.detach() for p in model.parameters()}


def test_weights_do_not_depend_on_the_layout_of_stages():
    full = named(GPT(TINY, Context(seed=7)))
    stage = named(GPT(TINY, Context(seed=7), layer_ids=[1], first=False, last=True))
    assert set(stage) < set(full)
    for k, v in stage.items():
        assert torch.equal(v, full[k]), k
    other = named(GPT(TINY, Context(seed=8)))
    assert not torch.equal(other["blocks.0.attn.qkv.weight"], full["blocks.0.attn.qkv.weight"])


def test_param_count_and_tied():
    m = GPT(TINY)
    h, l, v, s, f = TINY.hidden, TINY.layers, TINY.vocab, TINY.seq_len, TINY.ffn_hidden
    per_layer = 4 * h + 3 * h * h + 3 * h + h * h + h + 2 * h * f + f + h
    assert num_params(m) == 2 * v * h + s * h + l * per_layer + 2 * h
    tied = GPT(TINY.replace(tied_embeddings=True))
    assert num_params(tied) == num_params(m) - v * h


def test_forward_shapes_and_initial_loss():
    torch.manual_seed(0)
    m = GPT(TINY)
    x = torch.randint(0, 256, (2, TINY.seq_len))
    assert m(x).shape == (2, TINY.seq_len, 256)
    loss = m(x, x)
    assert abs(float(loss.detach()) - torch.log(torch.tensor(256.0))) < 0.1  # near ln 256 at init


def test_batches_are_a_pure_function_of_seed_and_step():
    c = ByteCorpus(bytes(range(256)) * 40)
    x1, y1 = batch(c, 16, 8, seed=1, step=3)
    x2, _ = batch(c, 16, 8, seed=1, step=3)
    x3, _ = batch(c, 16, 8, seed=1, step=4)
    assert torch.equal(x1, x2) and not torch.equal(x1, x3)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the next tokens
    parts = [batch(c, 16, 8, 1, 3, dp_rows(8, 4, r))[0] for r in range(4)]
    assert torch.equal(torch.cat(parts), x1)


def test_builtin_corpus():
    c = load_corpus()
    assert len(c) == 5_057_282 and c.vocab == 256
    train, val = c.split()
    assert len(train) + len(val) == len(c)
    assert "HAMLET" in ByteCorpus.decode(c.tokens[:1_000_000].tolist())


@pytest.mark.parametrize("content,words", [(None, "does not exist"), (b"", "is empty"),
                                           (b"\x00\x01\x02binary", "looks binary"),
                                           (b"\xff\xfe bad utf8", "not UTF-8")])
def test_bad_data_paths(tmp_path, content, words):
    p = tmp_path / "data.txt"
    if content is not None:
        p.write_bytes(content)
    with pytest.raises(ConfigError, match=words):
        load_corpus(str(p))


def test_folder_of_text(tmp_path):
    (tmp_path / "a.txt").write_text("hello " * 100)
    (tmp_path / "b.txt").write_text("world " * 100)
    assert len(load_corpus(str(tmp_path))) == 1200 + 2
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no .txt files"):
        load_corpus(str(tmp_path / "empty"))


def test_training_reduces_loss():
    tr = Trainer(TINY, ParallelConfig(), TrainConfig(steps=30, global_batch=8, lr=1e-2, warmup=2))
    losses = [tr.step(i) for i in range(30)]
    assert losses[-1] < losses[0] - 1.0


def test_shard_init_mode_draws_local_shards():
    a = named(GPT(TINY, Context(seed=3, init="shard")))
    b = named(GPT(TINY, Context(seed=3)))
    assert a["blocks.0.mlp.fc.weight"].shape == b["blocks.0.mlp.fc.weight"].shape
    assert not torch.equal(a["blocks.0.mlp.fc.weight"], b["blocks.0.mlp.fc.weight"])
