"""The run report, --tensorboard, `minitron sample` and a token file made with a GPT-2
style tokenizer.json: one tp2 x pp2 training run on real ranks, then in-process checks."""
import json

import pytest
import torch

from minitron.tools import cli
from minitron.config import ParallelConfig, TrainConfig, preset
from minitron.tools.report import RunReport, format_report, plot_losses
from minitron.tools.testing import run_cli, run_on_ranks

LAYOUT = ParallelConfig(tp=2, pp=2)


def _train_with_report(comm, model, layout, train, tb_dir):
    from minitron.train import train as train_job

    return train_job(model, layout, train, comm, observer=RunReport(model, layout, train, tb_dir, peak_flops=1e9))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """tp2 x pp2, 6 steps, a checkpoint, metrics, a timeline and TensorBoard scalars."""
    d = tmp_path_factory.mktemp("run")
    m = preset("tiny")
    t = TrainConfig(steps=6, global_batch=8, microbatches=4, eval_every=3, progress=False, sample_tokens=0,
                    ckpt_dir=str(d / "ckpt"), metrics=str(d / "metrics.jsonl"), timeline=str(d / "timeline.jsonl"))
    summary = run_on_ranks(_train_with_report, LAYOUT, m, LAYOUT, t, str(d / "tb"))[0]
    return d, m, t, summary


@pytest.mark.multirank
def test_run_report_layout_bytes_bubble_memory(run):
    from minitron.analysis import bubble_fraction

    d, m, t, summary = run
    rep = summary["report"]
    ranks = sorted(rep["ranks"], key=lambda r: r["rank"])
    assert [(r["tp"], r["pp"]) for r in ranks] == [(0, 0), (1, 0), (0, 1), (1, 1)]  # tensor fastest
    assert all("embed" in r["chunks"][0] for r in ranks[:2]) and all("head" in r["chunks"][0] for r in ranks[2:])
    assert ranks[0]["shard"].startswith("fc.weight[0:64, 0:32] of [128, 32]")  # rows split over tp
    assert ranks[1]["shard"].startswith("fc.weight[64:128, 0:32]")
    # one traced step sends exactly what the formulas say, on every axis
    axes = {a for r in ranks for a in r["bytes_per_axis"]}
    assert axes == {"tp", "pp"}
    for a in axes:
        assert max(r["bytes_per_axis"][a] for r in ranks) == rep["predicted_bytes"][a], a
    assert rep["predicted_bubble"] == bubble_fraction("1f1b", 2, 4) == 0.25
    assert rep["bubble"]["steps"] >= 3 and rep["bubble"]["measured"] >= 0
    for r in ranks:
        assert r["memory"]["params_bytes"] > 0 and r["memory"]["total_bytes"] >= r["memory"]["params_bytes"]
        assert r["process_peak_bytes"] > r["memory"]["total_bytes"]
    for r in ranks:  # timed steps: tp's calls block (no --sp, no overlap), so none of their time is hidden
        e = r["exposure"]["tp"]
        assert e["steps"] == 3 and e["calls"] > 0 and e["exposed_s"] == e["in_flight_s"] > 0 and e["hidden"] == 0
    text = format_report(rep, summary["tokens_per_s"])
    assert "communication hidden under compute, by axis (3 timed steps" in text
    assert "pipeline bubble" in text
    # the timeline: the first pipeline's actions, and every rank's calls of every step, each issued, then
    # waited for, then done (the pipeline's own sends and receives unstamped, so not among them)
    from minitron.viz.pipeline import load_timeline

    actions, calls = load_timeline(d / "timeline.jsonl"), load_timeline(d / "timeline.jsonl", calls=True)
    assert {a["op"] for a in actions} == {"F", "B"} and {a["global_rank"] for a in actions} == {0, 2}
    assert {c["global_rank"] for c in calls} == {0, 1, 2, 3} and {c["step"] for c in calls} == set(range(6))
    assert {c["axis"] for c in calls} >= {"tp"} and all(c["start"] <= c["waited"] <= c["end"] for c in calls)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minitron.comm import read_trace
    from minitron.viz.comm import plot_spans

    ax = plot_spans(read_trace(d / "timeline.jsonl"))  # the last step: its calls beside its actions
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"rank {r}" for r in range(4)]
    assert len(ax.lines) == 2 * sum(c["step"] == 5 for c in calls) and len(ax.patches) == sum(
        a["step"] == 5 for a in actions)
    plt.close("all") and "tokens/s" in text and len(text.splitlines()) >= 10
    assert plot_losses(summary["losses"], summary["val_losses"], str(d / "loss.png"))
    assert (d / "loss.png").stat().st_size > 1000


@pytest.mark.multirank
def test_tensorboard_has_the_metrics_scalars(run):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    d, *_ = run
    recs = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert all(r["mfu"] == pytest.approx(r["model_flops_per_s"] / (1e9 * 4)) for r in recs)
    ea = EventAccumulator(str(d / "tb"))
    ea.Reload()
    for key, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm"),
                     ("tokens_per_s", "perf/tokens_per_s"), ("mfu", "perf/mfu"), ("val_loss", "val/loss")):
        want = {r["step"]: r[key] for r in recs if key in r}
        got = {e.step: e.value for e in ea.Scalars(tag)}
        assert got.keys() == want.keys() and all(got[s] == pytest.approx(want[s], rel=1e-6) for s in want), tag


@pytest.mark.multirank
def test_sample_from_a_tp2_pp2_checkpoint(run, capsys):
    transformers = pytest.importorskip("transformers")
    d, *_ = run
    ckpt, hf_dir = str(d / "ckpt"), str(d / "hf")

    def sample(*argv):
        assert cli.main(["sample", *argv]) == 0
        return capsys.readouterr().out.rstrip("\n")

    a = sample("--ckpt-dir", ckpt, "--tokens", "40", "--seed", "3", "--temperature", "1.0")
    assert a.startswith("ROMEO:") and len(a.encode()) >= 40
    assert sample("--ckpt-dir", ckpt, "--tokens", "40", "--seed", "3", "--temperature", "1.0") == a
    assert sample("--ckpt-dir", ckpt, "--tokens", "40", "--seed", "4", "--temperature", "1.0") != a
    assert cli.main(["export", "--ckpt-dir", ckpt, "--hf", hf_dir]) == 0
    capsys.readouterr()
    assert sample("--init-from", hf_dir, "--tokens", "40", "--seed", "3", "--temperature", "1.0") == a
    # top-k 1 is greedy decoding: the same tokens as transformers' own generate()
    greedy = sample("--ckpt-dir", ckpt, "--tokens", "20", "--top-k", "1", "--dtype", "float64", "--prompt", "KING")
    theirs = transformers.GPT2LMHeadModel.from_pretrained(hf_dir, dtype=torch.float64).eval()
    ids = theirs.generate(torch.tensor([list(b"KING")]), max_new_tokens=20, do_sample=False,
                          pad_token_id=0)[0].tolist()
    assert greedy == bytes(ids).decode("utf-8", errors="replace").rstrip("\n")


def test_sample_bad_input_one_line(tmp_path, capsys):
    for argv, words in ((["sample"], "give the weights"),
                        (["sample", "--ckpt-dir", str(tmp_path / "none")], "does not exist"),
                        (["sample", "--ckpt-dir", str(tmp_path)], "no checkpoint"),
                        (["sample", "--ckpt-dir", str(tmp_path), "--temperature", "0"], "--temperature")):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, err


def test_gpt2_tokenizer_token_file_trains_and_samples(tmp_path, capsys):
    """A token file encoded with an existing GPT-2 style tokenizer.json (byte-level BPE,
    built here: nothing downloads) trains from --init-from and samples through it."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from minitron.data import load_corpus
    from minitron.tokenizer import tokenize

    text = bytes(load_corpus("").tokens[:30_000].numpy()).decode("utf-8", errors="ignore")
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator([text], tokenizers.trainers.BpeTrainer(
        vocab_size=320, show_progress=False, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    tok.save(str(gpt2 / "tokenizer.json"))
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=tok.get_vocab_size(),
                                  activation_function="gelu_new", bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(str(gpt2))

    assert tokenize(str(tmp_path / "text.txt"), str(tmp_path / "t.bin"),
                    tokenizer=str(gpt2 / "tokenizer.json"))["vocab"] == cfg.vocab_size
    code, out, err = run_cli(["train", "--init-from", str(gpt2), "--data", str(tmp_path / "t.bin"), "--steps", "2",
                              "--eval-every", "0", "--no-progress", "--no-report", "--sample", "30",
                              "--ckpt-dir", str(tmp_path / "ckpt")])
    assert code == 0, err
    assert "ROMEO:" in out  # the end-of-run sample, decoded by the token file's tokenizer
    capsys.readouterr()
    assert cli.main(["sample", "--init-from", str(gpt2), "--prompt", "ROMEO:", "--tokens", "10"]) == 0
    assert capsys.readouterr().out.startswith("ROMEO:")  # through the directory's tokenizer.json


def test_the_report_only_observes_the_steps_the_loop_runs():
    """The training loop runs every step (``Trainer.step_async``); the run report neither
    calls a step nor assigns to the pipeline runtime: it observes through the hooks the
    Trainer offers (saved-tensor hooks, a trace installed for a scope, the pipeline's
    ``recording()``)."""
    import ast
    import inspect

    from minitron.tools import report

    tree = ast.parse(inspect.getsource(report))
    calls = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    assert not calls & {"step", "step_async"}, "the run report runs a training step itself"
    stores = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
              and not (isinstance(n.value, ast.Name) and n.value.id == "self")]
    assert not stores, f"the run report assigns to another object's attribute: {ast.unparse(stores[0])}"
