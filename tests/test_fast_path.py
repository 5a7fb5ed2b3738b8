"""The fast path: torch.compile, no host synchronisation in the hot loop, and the
benchmark's arithmetic. Timings are never asserted; what is checked is that the fast
path computes the same thing and that the benchmark's figures are consistent."""
import json

import pytest
import torch

from minitron.tools.bench import MatmulProbe, StepTimer, bench_single
from minitron.tools.cli import main
from minitron.config import ParallelConfig, TrainConfig, preset
from minitron.optim import clip_
from minitron.tools.testing import last_json, run_cli
from minitron.model_flops import model_flops_per_step
from minitron.train import Trainer, train

TINY = preset("tiny")


def test_compiled_blocks_equal_eager_in_float64():
    """--compile fuses each block's elementwise work; in float64 the result is the eager
    model's to rounding, losses and every parameter after 3 steps."""
    t = TrainConfig(global_batch=4, dtype="float64", progress=False)
    compiled, eager = Trainer(TINY, ParallelConfig(compile=True), t), Trainer(TINY, ParallelConfig(), t)
    for i in range(3):
        a, b = compiled.step(i), eager.step(i)
        assert abs(a - b) <= 1e-12 * abs(b), (i, a, b)
    for p, q in zip(compiled.params, eager.params):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
    assert all(hasattr(b, "_compiled_call_impl") and b._compiled_call_impl is not None
               for b in compiled.model.blocks.values())
    assert [n for n, _ in compiled.model.named_parameters()] == [n for n, _ in eager.model.named_parameters()]


def test_step_async_leaves_the_loss_on_the_device():
    t = TrainConfig(global_batch=4, progress=False)
    a, b = Trainer(TINY, ParallelConfig(), t), Trainer(TINY, ParallelConfig(), t)
    loss = a.step_async(0)
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0
    assert float(loss) == b.step(0) and a.grad_norm == b.grad_norm


@pytest.mark.parametrize("max_norm", [1e-3, 1e9])
def test_clip_on_the_device_matches_torch(max_norm):
    """The norm and the scaled gradients equal torch.nn.utils.clip_grad_norm_ (which
    also scales by min(1, max_norm / (norm + 1e-6)))."""
    tr = Trainer(TINY, ParallelConfig(), TrainConfig(global_batch=4, dtype="float64", progress=False))
    x, y = tr.local_batch(0)
    tr.model(x, y).backward()
    ref = [p.grad.clone() for p in tr.params]
    want_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref]))
    scale = min(1.0, max_norm / (float(want_norm) + 1e-6))
    norm = clip_(tr.params, max_norm, tr.comm)
    assert isinstance(norm, torch.Tensor)
    torch.testing.assert_close(norm, want_norm.double(), rtol=1e-12, atol=0)
    for p, g in zip(tr.params, ref):
        torch.testing.assert_close(p.grad, g * scale, rtol=1e-12, atol=0)


def test_log_every_reads_back_the_same_metrics(tmp_path):
    """Reading the loss back every 4 steps gives the very records of reading it every step."""
    out = {}
    for n in (1, 4):
        t = TrainConfig(steps=6, global_batch=4, eval_every=3, sample_tokens=0, progress=False,
                        log_every=n, metrics=str(tmp_path / f"m{n}.jsonl"))
        summary = train(TINY, ParallelConfig(), t)
        recs = [json.loads(line) for line in open(t.metrics)]
        out[n] = (summary["losses"], summary["val_losses"],
                  [(r["step"], r["loss"], r["grad_norm"], r.get("val_loss")) for r in recs])
    assert out[1] == out[4]
    assert [s for s, *_ in out[4][2]] == [1, 2, 3, 4, 5, 6]


def test_bad_log_every_is_one_line(capsys):
    assert main(["train", "--model", "tiny", "--log-every", "0"]) == 2
    assert "--log-every must be at least 1" in capsys.readouterr().err


def test_step_timer_pairs_marks():
    timer = StepTimer(torch.device("cpu"))
    probe = MatmulProbe(n=64)
    for _ in range(3):
        timer.mark()
        probe()
        timer.mark()
    s = timer.seconds()
    assert len(s) == 3 and all(x > 0 for x in s)
    torch.testing.assert_close(probe.out, probe.a @ probe.b)


def test_bench_figures_are_consistent():
    """The JSON keys of the run summary, and the figures derived from each other as defined."""
    t = TrainConfig(global_batch=4, progress=False, eval_every=0)
    from minitron.data import load_corpus

    r = bench_single(TINY, ParallelConfig(), t, load_corpus(""), steps=2, warmup=1)
    for k in ("tokens_per_s", "model_flops_per_s", "device_peak_flops_per_s", "mfu",
              "minitron_step_s", "reference_step_s", "overhead_ratio"):
        assert r[k] > 0, k
    assert r["overhead_ratio"] == pytest.approx(r["minitron_step_s"] / r["reference_step_s"])
    assert r["tokens_per_s"] == pytest.approx(4 * TINY.seq_len / r["minitron_step_s"])
    assert r["model_flops_per_s"] == pytest.approx(model_flops_per_step(TINY, 4) / r["minitron_step_s"])
    assert r["mfu"] == pytest.approx(r["model_flops_per_s"] / r["device_peak_flops_per_s"])
    assert r["hfu"] == pytest.approx(r["mfu"])  # nothing recomputed: hardware = model FLOPs
    from minitron.analysis.flops import hardware_flops_per_iteration

    full = bench_single(TINY, ParallelConfig(recompute="full"), t, steps=1, warmup=1)  # built-in corpus
    assert full["layout"].endswith("rc-full")
    assert full["hfu"] / full["mfu"] == pytest.approx(
        hardware_flops_per_iteration(TINY, 4, "full") / model_flops_per_step(TINY, 4))


def test_datasheet_peak_prefers_the_specific_name():
    from minitron.tools.bench import peak_for_name

    assert peak_for_name("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_for_name("NVIDIA H100 PCIe") == 756e12
    assert peak_for_name("NVIDIA H200") == 989e12
    assert peak_for_name("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_for_name("Tesla T4") is None


def test_bench_profile_sorts_the_step_by_kind():
    """--profile: operator shares and kinds add up, matmuls are found, and the ceiling
    is the MFU divided by the matmul and attention share."""
    from minitron.tools.bench import mfu_ceiling, op_kind
    from minitron.data import load_corpus

    assert [op_kind(n) for n in ("aten::mm", "aten::addmm", "aten::mm_backward_fake",
                                 "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
                                 "aten::_fused_adamw_", "c10d::allreduce_", "aten::gelu")] == \
        ["matmul", "matmul", "other", "attention", "optimizer", "communication", "other"]
    t = TrainConfig(global_batch=4, progress=False, eval_every=0)
    r = bench_single(TINY, ParallelConfig(), t, load_corpus(""), steps=1, warmup=1, profile=True)
    kinds = r["profile_kinds"]
    assert sum(kinds.values()) == pytest.approx(1.0)
    assert kinds["matmul"] > 0.05 and kinds["attention"] > 0 and kinds["optimizer"] > 0
    assert all(p["kind"] == op_kind(p["op"]) for p in r["profile"])
    assert sum(p["share"] for p in r["profile"]) <= 1.0 + 1e-9
    assert r["mfu_ceiling"] == pytest.approx(r["mfu"] / (kinds["matmul"] + kinds["attention"]))
    assert mfu_ceiling(0.5, {"matmul": 0.5, "attention": 0.0}) == pytest.approx(1.0)


@pytest.mark.multirank
def test_bench_two_ranks_from_the_command_line():
    code, out, err = run_cli(["bench", "--model", "tiny", "--nproc", "2", "--dp", "2", "--global-batch", "4",
                              "--bench-steps", "2", "--warmup-steps", "1", "--json"])
    assert code == 0, err[-2000:]
    r = last_json(out)
    assert r["layout"] == "dp2.tp1.pp1" and r["world"] == 2
    assert r["speedup_vs_one_rank"] == pytest.approx(r["single_device_step_s"] / r["minitron_step_s"])
    assert r["mfu"] == pytest.approx(r["model_flops_per_s"] / (2 * r["device_peak_flops_per_s"]))
    assert r["efficiency_vs_one_rank"] == pytest.approx(r["mfu"] / r["single_device_mfu"])
