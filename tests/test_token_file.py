"""TokenFile: `minitron tokenize` writes it, load_corpus reads it, the Trainer and the CLI train on it."""
import json
import math
import pickle
import sys

import numpy as np
import pytest
import torch

from minitron.config import ConfigError, ParallelConfig, TrainConfig, preset
from minitron.data import ByteCorpus, TokenFile, batch, check_corpus, load_corpus
from minitron.tools.testing import last_json, run_cli

VOCAB = 384
N_BYTES = 24_000  # a few KB of Shakespeare: enough windows for the tiny model (seq_len 32)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    text = bytes(load_corpus("").tokens[:N_BYTES].numpy()).decode("utf-8", errors="ignore")
    p = tmp_path_factory.mktemp("text") / "sample.txt"
    p.write_text(text, encoding="utf-8")
    return p


@pytest.fixture(scope="module")
def token_file(text_file, tmp_path_factory):
    pytest.importorskip("tokenizers")
    from minitron.tokenizer import tokenize

    out = tmp_path_factory.mktemp("tok") / "sample.bin"
    return out, tokenize(str(text_file), str(out), VOCAB)


def test_tokenize_round_trips(text_file, token_file):
    out, summary = token_file
    text = text_file.read_text(encoding="utf-8")
    assert summary["vocab"] == VOCAB and summary["dtype"] == "uint16"
    assert 1.5 < summary["bytes_per_token"] < 3  # merges compress: fewer tokens than bytes
    side = json.loads(out.with_suffix(".json").read_text())
    assert side["dtype"] == "uint16" and side["vocab"] == VOCAB and side["tokenizer"] == "sample.tokenizer.json"
    assert out.stat().st_size == 2 * summary["tokens"]
    c = load_corpus(str(out))
    assert isinstance(c, TokenFile) and len(c) == summary["tokens"] and c.vocab == VOCAB
    assert c.decode(c.tokens.tolist()) == text  # byte-level BPE: exact
    assert c.decode(c.encode("ROMEO: hello")) == "ROMEO: hello"


def test_split_window_and_batches(token_file):
    out, _ = token_file
    c = load_corpus(str(out))
    train, val = c.split()
    assert isinstance(train, TokenFile) and len(train) + len(val) == len(c)
    assert len(val) == len(c) - int(len(c) * 0.9)
    assert torch.equal(val.window(3, 10), c.window(len(train) + 3, 10))  # views of one file
    assert np.shares_memory(train.tokens, train.tokens[:5])
    x, y = batch(train, 32, 8, seed=1, step=2)
    assert x.shape == y.shape == (8, 32) and x.dtype == torch.long
    assert int(x.min()) >= 0 and int(torch.maximum(x, y).max()) < c.vocab
    assert torch.equal(x[:, 1:], y[:, :-1])
    again = pickle.loads(pickle.dumps(val))  # what a rank receives: the path and the range
    assert len(pickle.dumps(val)) < 1000 and torch.equal(again.window(0, 50), val.window(0, 50))
    check_corpus(val, 32, VOCAB)


def _side(path, **meta):
    path.with_suffix(".json").write_text(json.dumps({"dtype": "uint16", "vocab": 300, "tokenizer": None, **meta}))


def test_bad_token_files(tmp_path, token_file):
    bin_ = tmp_path / "d.bin"
    with pytest.raises(ConfigError, match="does not exist"):
        load_corpus(str(bin_))
    bin_.write_bytes(b"\x01\x00" * 10)
    with pytest.raises(ConfigError, match="no sidecar d.json .*minitron tokenize"):
        load_corpus(str(bin_))
    _side(bin_, dtype="int8")
    with pytest.raises(ConfigError, match="dtype 'int8': use uint16 or uint32"):
        load_corpus(str(bin_))
    _side(bin_)
    bin_.write_bytes(b"\x01\x00\x02")
    with pytest.raises(ConfigError, match="3 bytes, not a multiple of 2"):
        load_corpus(str(bin_))
    bin_.write_bytes(b"")
    with pytest.raises(ConfigError, match="is empty"):
        load_corpus(str(bin_))
    c = load_corpus(str(token_file[0]))
    with pytest.raises(ConfigError, match=f"--vocab 256 is smaller than the corpus' {VOCAB} token ids: use {VOCAB}"):
        check_corpus(c, 32, 256)


def test_no_tokenizer_decodes_ids(tmp_path):
    bin_ = tmp_path / "ids.bin"
    np.arange(5000, dtype=np.uint32).tofile(bin_)
    _side(bin_, dtype="uint32", vocab=5000)
    c = load_corpus(str(bin_))
    assert c.decode([1, 2, 3]) == "1 2 3" and c.encode("ROMEO:") is None
    from minitron.train import sample
    from minitron.model import GPT
    from minitron.context import Context
    assert sample(GPT(preset("tiny").replace(vocab=5000), Context(dtype=torch.float32)), n=3, corpus=c) is None


def test_trainer_checks_vocab_on_bytes():
    from minitron.train import Trainer

    with pytest.raises(ConfigError, match="--vocab 200 is smaller than the corpus' 256 token ids: use 256"):
        Trainer(preset("tiny").replace(vocab=200), ParallelConfig(), TrainConfig(steps=1, global_batch=2),
                corpus=ByteCorpus(b"to be or not to be " * 500))


def test_trainer_on_token_file(token_file):
    from minitron.train import Trainer, sample, single_device_model
    from minitron.checkpoint import gather_full

    m = preset("tiny").replace(vocab=VOCAB)
    t = TrainConfig(steps=3, global_batch=8, dtype="float32", lr=3e-3, warmup=1)
    tr = Trainer(m, ParallelConfig(), t, corpus=load_corpus(str(token_file[0])))
    losses = [tr.step(i) for i in range(3)]
    assert all(math.isfinite(v) for v in losses) and abs(losses[0] - math.log(VOCAB)) < 1.0
    text = sample(single_device_model(m, gather_full(tr), t), n=10, corpus=tr.corpus)
    assert text.startswith("ROMEO:")


def test_missing_tokenizers_package(monkeypatch, tmp_path):
    from minitron.tokenizer import tokenize

    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match="needs the tokenizers package: pip install"):
        tokenize("", str(tmp_path / "x.bin"), 300)


def test_cli_tokenize_then_train(text_file, tmp_path):
    pytest.importorskip("tokenizers")
    out = tmp_path / "corpus.bin"
    code, stdout, err = run_cli(["tokenize", "--data", str(text_file), "--vocab", "300", "--out", str(out), "--json"])
    assert code == 0, err
    res = last_json(stdout)
    assert res["vocab"] == 300 and out.exists() and out.with_suffix(".tokenizer.json").exists()
    base = ["train", "--model", "tiny", "--data", str(out), "--steps", "2", "--global-batch", "4",
            "--no-progress", "--eval-every", "0", "--sample", "8"]
    code, stdout, err = run_cli(base + ["--vocab", "300"])
    assert code == 0, err
    assert "--- sample ---" in stdout and "ROMEO:" in stdout
    code, _, err = run_cli(base)  # the tiny preset's vocab 256 < 300
    assert code == 2 and "use 300 or more" in err and err.strip().count("\n") == 0


@pytest.mark.multirank
def test_a_layout_on_a_token_file_equals_one_device(token_file):
    """The oracle on real (subword) data: dp2 × tp2 on 4 ranks reading the memory-mapped
    .bin (each rank opens it by path) equals the single-device model in float64."""
    out, _ = token_file
    code, stdout, err = run_cli(["verify", "--model", "tiny", "--vocab", str(VOCAB), "--data", str(out),
                                 "--nproc", "4", "--dp", "2", "--tp", "2", "--steps", "3", "--global-batch", "4",
                                 "--dtype", "float64", "--json"])
    assert code == 0, err[-2000:]
    res = last_json(stdout)
    assert res["ok"] and res["max_loss_abs_diff"] <= 1e-9 and res["max_param_rel_diff"] <= 1e-9
