"""The oracle can fail: a perturbed parameter or loss is caught."""
import pytest
import torch

from minitron.config import ParallelConfig, TrainConfig, PRESETS
from minitron.train import Trainer
from minitron.checkpoint import gather_full
from minitron.tools.verify import compare, reference_run


def test_compare_catches_a_perturbed_parameter():
    t = TrainConfig(steps=2, global_batch=4, dtype="float64")
    tr = Trainer(PRESETS["tiny"], ParallelConfig(), t)
    losses = [tr.step(i) for i in range(2)]
    full = gather_full(tr)
    ref_losses, ref = reference_run(PRESETS["tiny"], t, tr.corpus, 2)
    same = compare(losses, full, ref_losses, ref)
    assert same["max_loss_abs_diff"] == 0 and same["max_param_rel_diff"] == 0
    full["blocks.1.mlp.fc.weight"]["param"][3, 4] += 1e-6
    bad = compare([losses[0], losses[1] + 1e-7], full, ref_losses, ref)
    assert bad["worst_param"] == "blocks.1.mlp.fc.weight" and bad["max_param_rel_diff"] > 1e-6
    assert bad["max_loss_abs_diff"] > 9e-8


def test_float32_judges_a_tensor_off_its_values_by_its_effect():
    """float32: a tensor whose values differ beyond the tolerance is judged by what it does
    to the trained function. A shift of the key bias (softmax cannot see it) passes; the
    same shift of the query bias, and an MLP weight with its halves swapped, fail."""
    from minitron.tools.verify import TOLERANCE, blind_tensor_effects

    model = PRESETS["tiny"]
    t = TrainConfig(steps=2, global_batch=4, dtype="float32", eval_every=0, progress=False)
    tr = Trainer(model, ParallelConfig(), t)
    for i in range(2):
        tr.step(i)
    torch.manual_seed(t.seed)
    _, ref = reference_run(model, t, tr.corpus, 2)
    full, tol = gather_full(tr), TOLERANCE["float32"]
    d = model.hidden // model.heads
    part = torch.arange(3 * model.hidden).view(model.heads, 3, d)  # qkv's columns: (head, q|k|v, d)

    def shifted(which: int) -> dict:
        out = {k: dict(v) for k, v in full.items()}
        b = out["blocks.0.attn.qkv.bias"]["param"].clone()
        b[part[:, which].flatten()] += 0.05
        out["blocks.0.attn.qkv.bias"]["param"] = b
        return out

    key = blind_tensor_effects(model, t, "fp32", shifted(1), ref, tol)
    assert list(key) == ["blocks.0.attn.qkv.bias"] and key["blocks.0.attn.qkv.bias"] <= tol, key
    query = blind_tensor_effects(model, t, "fp32", shifted(0), ref, tol)
    assert query["blocks.0.attn.qkv.bias"] > 100 * tol, query
    swapped = {k: dict(v) for k, v in full.items()}
    w = swapped["blocks.0.mlp.fc.weight"]["param"]
    swapped["blocks.0.mlp.fc.weight"]["param"] = torch.cat(w.chunk(2)[::-1])
    assert blind_tensor_effects(model, t, "fp32", swapped, ref, tol)["blocks.0.mlp.fc.weight"] > 100 * tol


def _bf16_job(comm, model, layout, train):
    """The layout trained twice on real ranks: correctly, and with 1.5x the learning rate (a
    layout whose updates are off, as a wrong gradient or optimizer shard would make them);
    rank 0 returns each run's weights with the single-device bf16 reference's measures."""
    from minitron.tools.verify import bf16_measures, reference_run

    runs = {}
    for name, t in (("correct", train), ("lr x1.5", train.replace(lr=train.lr * 1.5))):
        tr = Trainer(model, layout, t, comm)
        runs[name] = ([tr.step(i) for i in range(t.steps)], gather_full(tr))
    if comm.grid.rank != 0:
        return None
    torch.manual_seed(train.seed)
    ref_losses, ref = reference_run(model, train, None, train.steps, layout.precision)
    losses, full = runs["correct"]
    # a mis-sliced parameter: the two tensor-parallel halves of an MLP weight swapped
    swapped = {k: dict(v) for k, v in full.items()}
    w = swapped["blocks.0.mlp.fc.weight"]["param"]
    swapped["blocks.0.mlp.fc.weight"]["param"] = torch.cat(w.chunk(2)[::-1])
    runs["mis-sliced"] = (losses, swapped)
    return {name: {**compare(l, f, ref_losses, ref),
                   **bf16_measures(model, train, layout.precision, l, f, ref_losses, ref)}
            for name, (l, f) in runs.items()}


@pytest.mark.multirank
def test_bf16_verdict_passes_a_correct_layout_and_fails_broken_ones():
    """bfloat16, tp 2: the correct run passes the bf16 criterion (its old max relative
    parameter difference is ~1, on the key bias), the bound lies above what reordered sums
    alone do on one device, and a layout with wrong updates or a mis-sliced weight fails."""
    from minitron.tools.testing import run_on_ranks
    from minitron.tools.verify import bf16_ok

    t = TrainConfig(steps=3, global_batch=4, lr=1e-2, warmup=1, eval_every=0, progress=False, dtype="bfloat16")
    layout = ParallelConfig(tp=2, dropout_rng="global")
    res = run_on_ranks(_bf16_job, layout, PRESETS["tiny"], layout, t)[0]
    ok = res["correct"]
    assert bf16_ok(ok), ok
    assert ok["max_param_rel_diff"] > 0.05  # the old criterion fails it (on the key bias)
    assert ok["rounding_fn_rel_diff"] < ok["fn_bound"] and ok["rounding_max_tensor_fn_rel_diff"] < 1
    assert ok["rounding_loss_abs_diff"] < ok["loss_bounds"][0]
    for name in ("lr x1.5", "mis-sliced"):
        assert not bf16_ok(res[name]), (name, res[name])
    assert res["lr x1.5"]["fn_rel_diff"] > 3 * ok["fn_bound"]
    assert res["mis-sliced"]["worst_tensor"] == "blocks.0.mlp.fc.weight"
    assert res["mis-sliced"]["max_tensor_fn_rel_diff"] > 1.2


@pytest.mark.multirank
def test_verify_command_in_bf16():
    """`minitron verify` at bf16 compute (fp32 weights) passes on tp 2 and reports the old
    measure beside the new one; a --tol below what the layout reaches fails it."""
    from minitron.tools.testing import last_json, run_cli

    argv = ["verify", "--nproc", "2", "--tp", "2", "--precision", "bf16", "--dtype", "float32", "--json"]
    code, out, err = run_cli(argv, timeout=300)
    res = last_json(out)
    assert code == 0 and res["ok"], err[-2000:]
    assert {"max_param_rel_diff", "fn_rel_diff", "max_tensor_fn_rel_diff", "loss_bounds", "rounding_fn_rel_diff"} <= res.keys()
    code, out, err = run_cli(argv + ["--tol", str(res["fn_rel_diff"] / 2)], timeout=300)
    assert code == 1 and not last_json(out)["ok"]


@pytest.mark.multirank
def test_verify_command_in_float32():
    """`minitron verify --tp 2` in float32 passes: the query-key-value bias, whose key part
    has an exactly-zero gradient (Adam steps on float32 noise there), differs beyond the
    tolerance and is judged by its effect on the function, far within it."""
    from minitron.tools.testing import last_json, run_cli

    code, out, err = run_cli(["verify", "--nproc", "2", "--tp", "2", "--dtype", "float32", "--json"], timeout=300)
    res = last_json(out)
    assert code == 0 and res["ok"], (err[-2000:], res)
    assert res["max_param_rel_diff"] > res["tolerance"] and res["worst_param"].endswith("qkv.bias"), res
    effects = res["judged_by_effect"]
    assert effects and all(k.endswith("qkv.bias") and v < res["tolerance"] / 10 for k, v in effects.items()), effects
