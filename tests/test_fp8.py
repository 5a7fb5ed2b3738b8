"""FP8 training (``--precision fp8 --fp8-recipe R``): the formats and scales of each recipe,
torchao's emulated ``Float8Linear`` as the external oracle for tensorwise and rowwise,
delayed scaling's history (rolled, checkpointed, resumed exactly), the refusals, and every
layout equal to one device in float64 under every recipe (one launch of two ranks).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minitron.config import PRESETS, ConfigError, ParallelConfig, TrainConfig, validate
from minitron.parallel import fp8
from minitron.train import Trainer

TRAIN = TrainConfig(steps=2, global_batch=4, microbatches=2, dtype="float64", progress=False, eval_every=0,
                    sample_tokens=0)


# --- the numerics -------------------------------------------------------------------------
def test_scale_is_max_over_amax_and_values_saturate_on_the_grid():
    x = torch.tensor([0.5, -2.0, 1e-3, 0.0], dtype=torch.float64)
    q = fp8.quantize_scaled(x, x.abs().amax(), fp8.E4M3)
    assert q.scale == torch.tensor(448 / 2.0, dtype=torch.float32)
    assert q.data.float()[1] == -448  # the amax lands on E4M3's largest value
    assert torch.equal(q.data.to(torch.float64), q.data.float().double())  # on the grid
    big = fp8.to_fp8(torch.tensor([1e6, -1e6]), torch.tensor(1.0), fp8.E5M2)
    assert big.float().tolist() == [57344.0, -57344.0]  # saturated, never inf
    assert fp8.amax_to_scale(torch.tensor(0.0), fp8.E4M3) == torch.tensor(448 / 1e-12, dtype=torch.float32)
    assert fp8.amax_to_scale(torch.tensor(3.0), fp8.E4M3, pow2=True) == 128.0  # 149.3 floored to 2^7


def test_mx_blocks_share_a_power_of_two_scale_per_32():
    """OCP MX v1.0: X = 2^(floor(log2 amax) - 8) per block of 32 along the dim."""
    torch.manual_seed(0)
    x = torch.randn(4, 64, dtype=torch.float64)
    x[0, :32] *= 1000
    q = fp8.quantize_mx(x, 1)
    assert q.scale.dtype == torch.float8_e8m0fnu and q.scale.shape == (4, 2)
    amax = x.abs().unflatten(1, (2, 32)).amax(-1)
    assert torch.equal(q.scale.double(), 2.0 ** (torch.floor(torch.log2(amax)) - 8))
    per_element = q.scale.double().repeat_interleave(32, 1)
    err = (q.dequantize(torch.float64) - x).abs() / amax.repeat_interleave(32, 1)
    inside = x.abs() <= 448 * per_element  # the floored scale lets a block's top exceed 448: saturated
    assert err[inside].max() <= 2 ** -4 and err.max() <= 1 - 448 / 512  # E4M3's 3 bits; saturation's 1/8
    assert (~inside).any()  # this draw does saturate
    assert torch.equal(fp8.quantize_mx(x.t().contiguous(), 0).data, q.data.t())  # along any dim


# --- torchao as the oracle ----------------------------------------------------------------
# torchao lives beside the environment (`make env` installs it into .venv/oracle): where it is
# importable, transformers imports it with every model class and it logs that its CUDA kernels
# do not load. So torchao's side of each case runs in a process of its own, with it on the path.
ORACLE = Path(sys.prefix) / "oracle"
SHAPES = [(16, 32, 48), (3, 5, 64, 32), (128, 96, 64)]
ORACLE_SCRIPT = """
import dataclasses, sys, torch
import torchao.float8 as ao
out = []
for recipe, x, w, dy in torch.load(sys.argv[1]):
    config = dataclasses.replace(ao.Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    lin = ao.convert_to_float8_training(torch.nn.Sequential(torch.nn.Linear(w.shape[1], w.shape[0], bias=False)),
                                        config=config)[0]
    with torch.no_grad():
        lin.weight.copy_(w)
    x = x.clone().requires_grad_()
    y = lin(x)
    y.backward(dy)
    out.append((y.detach(), x.grad, lin.weight.grad))
torch.save(out, sys.argv[2])
"""


def _case(shape):
    *lead, k, n = shape
    torch.manual_seed(0)
    return torch.randn(*lead, k), torch.randn(n, k) * 0.05, torch.randn(*lead, n) * 1e-3


@pytest.fixture(scope="module")
def torchao_results(tmp_path_factory):
    """{(recipe, shape): (y, dx, dw)} from torchao's Float8Linear(emulate=True), one process."""
    assert (ORACLE / "torchao").is_dir(), f"torchao, the FP8 oracle, is not in {ORACLE}: run `make env`"
    keys = [(r, shape) for r in ("tensorwise", "rowwise") for shape in SHAPES]
    root = tmp_path_factory.mktemp("torchao")
    torch.save([(r, *_case(shape)) for r, shape in keys], root / "in.pt")
    env = {**os.environ, "PYTHONPATH": str(ORACLE), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", ORACLE_SCRIPT, str(root / "in.pt"), str(root / "out.pt")],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    return dict(zip(keys, torch.load(root / "out.pt")))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("shape", SHAPES)
def test_linears_equal_torchao_float8_linear(recipe, shape, torchao_results):
    """Forward and both gradients equal torchao's Float8Linear(emulate=True), float32."""
    x, w, dy = _case(shape)
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    state = fp8.Fp8State("lin.fp8", recipe, fp8.Shards(), _ctx(recipe))
    yb = fp8.fp8_linear(xb, wb, None, state)
    yb.backward(dy)
    for mine, theirs in zip((yb, xb.grad, wb.grad), torchao_results[(recipe, shape)]):
        torch.testing.assert_close(mine, theirs, rtol=1.3e-6, atol=1e-7 * theirs.abs().max().item())
    assert (yb - x @ w.t()).abs().max() > 1e-4  # and it is not the high-precision linear


def _ctx(recipe: str):
    from minitron.context import Context
    return Context(layout=ParallelConfig(precision="fp8", fp8_recipe=recipe))


# --- the recipes in a model -----------------------------------------------------------------
def test_each_recipe_changes_the_numbers_and_keeps_the_ends_in_high_precision():
    model = PRESETS["tiny"]
    losses = {}
    for prec, recipe in (("fp32", "tensorwise"), *(("fp8", r) for r in fp8.RECIPES)):
        tr = Trainer(model, ParallelConfig(precision=prec, fp8_recipe=recipe), TRAIN)
        losses[recipe if prec == "fp8" else "fp32"] = [tr.step(i) for i in range(2)]
        states = [m for m in tr.model.modules() if isinstance(m, fp8.Fp8State)]
        assert len(states) == (4 * model.layers if prec == "fp8" else 0)  # qkv, proj, fc, fc2 of each block
    assert len({tuple(v) for v in losses.values()}) == len(losses), losses  # five different runs
    assert all(abs(v[0] - losses["fp32"][0]) < 1e-2 for v in losses.values())  # and all close to fp32


def test_delayed_history_rolls_and_a_resume_is_exact(tmp_path):
    """Delayed scaling: scale 1 on an empty history, then the step's amax max; the history
    is in the checkpoint, so a run resumed at step 2 takes the same third step."""
    from minitron import checkpoint as ckpt

    lay = ParallelConfig(precision="fp8", fp8_recipe="delayed")
    a = Trainer(PRESETS["tiny"], lay, TRAIN)
    st = next(m for m in a.model.modules() if isinstance(m, fp8.Fp8State))
    assert st.amax_history.abs().max() == 0
    a.step(0)
    first = st.amax_history[:, 0].clone()
    assert (first > 0).all() and st.amax_history[:, 1:].abs().max() == 0 and st.step_amax.abs().max() == 0
    w_amax = dict(a.model.named_parameters())["blocks.0.attn.qkv.weight"].detach().abs().max()
    a.step(1)
    assert torch.equal(st.amax_history[:, 1], first) and st.amax_history.shape == (3, fp8.AMAX_HISTORY_LEN)
    assert st.amax_history[1, 0] == w_amax  # the weight's amax as step 1's forward saw it
    ckpt.save(str(tmp_path), 2, a)
    b = Trainer(PRESETS["tiny"], lay, TRAIN)
    assert ckpt.load_latest(str(tmp_path), b) == 2
    assert a.step(2) == b.step(2)


@pytest.mark.parametrize("layout, model, train, says", [
    (dict(precision="fp8", fp8_recipe="current"), "tiny", {}, "unknown --fp8-recipe 'current'"),
    (dict(precision="fp4"), "tiny", {}, "unknown --precision 'fp4'"),
    (dict(precision="fp8", fp8_recipe="mxfp8", tp=2), "tiny", {}, "is not a multiple of 32 (a block would straddle"),
    (dict(precision="fp8", fp8_recipe="mxfp8", cp=2), "tiny", {}, "context chunk (seq_len/(2*cp)) of 8 tokens"),
    (dict(precision="fp8", tp=4, tp_mode="2d"), "tiny", {}, "--precision fp8 runs the 1-D tensor-parallel"),
])
def test_bad_fp8_input_gets_one_line(layout, model, train, says):
    with pytest.raises(ConfigError) as e:
        validate(PRESETS[model], ParallelConfig(**layout), TRAIN.replace(**train))
    assert says in str(e.value) and "\n" not in str(e.value)


# --- every layout equals one device, every recipe: one launch of two ranks ------------------
MODEL = PRESETS["tiny"].replace(layers=4, hidden=64, ffn=256, seq_len=128)  # MX blocks whole on tp2 and cp2
LAYOUTS = {
    "tp2+sp": (ParallelConfig(tp=2, sp=True), MODEL),
    "cp2": (ParallelConfig(cp=2), MODEL),
    "pp2 interleaved": (ParallelConfig(pp=2, vpp=2, schedule="interleaved"), MODEL),
    "pp2 zb-v": (ParallelConfig(pp=2, vpp=2, schedule="zb-v"), MODEL),
    "dp2 zero3": (ParallelConfig(dp=2, zero=3), MODEL),
    "ep2 moe": (ParallelConfig(ep=2), PRESETS["moe-tiny"]),
}
TRACED = ("tp2+sp", "cp2", "dp2 zero3", "tp2 dp2 zero3")  # whose traced step is held against the analysis


# planted mistakes (each must fail the oracle): a trainer's FP8 scaling with a reduction taken out
def no_linear_amax_reduction(tr) -> None:
    """Every linear quantizes with the amax of its own shard only."""
    for m in (m for ch in tr.chunks for m in ch.modules() if isinstance(m, fp8.Fp8State)):
        m.shards = fp8.Shards()


def _fp8_gathers(tr):
    parts = getattr(tr.dp, "parts", [tr.dp])
    gathers = [g for part in parts for g in part.fp8_gathers.values()]
    assert gathers, "this layout gathers no weight in FP8"
    return gathers


def gather_without_data_amax(tr) -> None:
    """ZeRO-3's FP8 gather scales each shard by the amax of the data-parallel shard alone."""
    for g in _fp8_gathers(tr):
        g.axes = g.axes[1:]


def gather_without_tensor_amax(tr) -> None:
    """ZeRO-3's FP8 gather forgets that the tensor ranks split each weight."""
    for g in _fp8_gathers(tr):
        g.axes = g.axes[:1]


def _layouts_job(comm, plan, train):
    """Each (name, layout, model, plant) of `plan` on these ranks (its own grid): losses,
    rank 0's gathered weights and the traced step 0; `plant` (one of the functions above,
    or None) puts a mistake into the trainer first."""
    from minitron.checkpoint import gather_full
    from minitron.comm import Comm, CommTrace
    from minitron.grid import ProcessGrid

    out = {}
    for name, lay, model, plant in plan:
        grid = ProcessGrid.for_layout(lay, comm.grid.rank).build_groups()
        c = Comm(grid, CommTrace())
        tr = Trainer(model, lay, train, c)
        if plant:
            plant(tr)
        losses = [tr.step(i) for i in range(train.steps)]
        out[name] = {"losses": losses, "full": gather_full(tr), "pp": c.index("pp"),
                     "records": [r for r in c.trace.records if r["step"] == 0]}
    return out


def _one_device(model, lay, cache: dict):
    """The single-device run of `lay`'s recipe, one microbatch per replica's (cached)."""
    from minitron.tools.verify import numerics, reference_run
    train = TRAIN.replace(microbatches=TRAIN.microbatches * lay.data_replicas)
    key = (model, lay.fp8_recipe, train.microbatches)
    if key not in cache:
        torch.manual_seed(train.seed)
        cache[key] = reference_run(model, train, None, train.steps, numerics(lay))
    return cache[key]


def _traced_equals_analysis(name, lay, model, ranks):
    from minitron.analysis.comm import comm_bytes_per_step
    for rank, res in ranks.items():
        got: dict = {}
        for r in res[name]["records"]:
            if r["axis"] != "world":
                got.setdefault(r["axis"], {}).setdefault(r["op"], 0)
                got[r["axis"]][r["op"]] += r["bytes"]
        want = {a: {op: n for op, n in ops.items() if n}
                for a, ops in comm_bytes_per_step(model, lay, TRAIN, res[name]["pp"]).items()}
        assert got == {a: ops for a, ops in want.items() if ops}, (name, rank, got, want)


@pytest.mark.multirank
def test_every_layout_equals_one_device_under_every_recipe():
    """tp2+sp, cp2, pp2 (interleaved, zb-v), dp2 with ZeRO-3, ep2 with a MoE model, each
    under tensorwise, delayed, rowwise and MXFP8: one device's losses and weights in
    float64 (1e-9, the delayed histories among the weights); the traced steps of tp2+sp,
    cp2 and ZeRO-3 (amax all-reduces and delayed's history reduction included) equal the
    analysis per axis and op; without its amax reductions tp2 fails the oracle."""
    from minitron.tools.testing import run_on_ranks

    plan = [(f"{name} {r}", ParallelConfig(**{**vars(lay), "precision": "fp8", "fp8_recipe": r, "device": "cpu"}),
             model, None) for name, (lay, model) in LAYOUTS.items() for r in fp8.RECIPES]
    plan += [("tp2 without amax reduction", ParallelConfig(tp=2, precision="fp8", device="cpu"), MODEL,
              no_linear_amax_reduction),
             ("zero3 gather without the data amax", ParallelConfig(dp=2, zero=3, precision="fp8", device="cpu"),
              MODEL, gather_without_data_amax)]
    ranks = run_on_ranks(_layouts_job, ParallelConfig(dp=2, device="cpu"), plan, TRAIN)
    _hold_the_oracle(plan, ranks)
    # ZeRO-3 gathers tensorwise's FP8 weights in FP8, the other recipes' in the working dtype
    _fp8_gather_bytes(ranks[0], "dp2 zero3", MODEL, ParallelConfig(dp=2, zero=3))


def _hold_the_oracle(plan, ranks) -> None:
    """Every unplanted run of `plan` equals one device (1e-9) and every planted one does
    not; the runs of TRACED layouts are traced = analysis on every rank."""
    from minitron.tools.verify import compare

    for _, lay, model, _ in plan:
        validate(model, lay, TRAIN)
    cache: dict = {}
    for name, lay, model, plant in plan:
        run = ranks[0][name]
        v = compare(run["losses"], run["full"], *_one_device(model, lay, cache))
        ok = v["max_loss_abs_diff"] <= 1e-9 and v["max_param_rel_diff"] <= 1e-9
        assert ok != bool(plant), (name, v)
        if name.rsplit(" ", 1)[0] in TRACED:
            _traced_equals_analysis(name, lay, model, ranks)


def _fp8_gather_bytes(rank: dict, name: str, model, lay) -> None:
    """The data-parallel all-gathers of step 0 under tensorwise move each FP8-gathered
    weight in 1 byte an element (float64 training: 8 under rowwise): exactly the
    difference the unit sizes give."""
    from minitron.analysis.dry_run import block_params, fp8_gathered_weights

    def gathered(recipe):
        return sum(r["bytes"] for r in rank[f"{name} {recipe}"]["records"] if r["op"] == "all_gather")

    fp8_lay = ParallelConfig(**{**vars(lay), "precision": "fp8", "fp8_recipe": "tensorwise"})
    n8 = fp8_gathered_weights(model, fp8_lay, 0)[0]
    assert 0 < n8 < block_params(model, fp8_lay)
    m, d = TRAIN.microbatches, lay.dp
    gathers = 2 * m * model.layers  # each block before its forward and its backward, per microbatch
    assert gathered("rowwise") - gathered("tensorwise") == gathers * n8 // d * (8 - 1)


@pytest.mark.multirank
def test_zero3_gathers_fp8_weights_under_tensor_parallelism():
    """tp2 × dp2 with ZeRO-3 under tensorwise: the weights' amax spans the data-parallel
    shards and the tensor ranks; one device's numbers in float64 and the traced step =
    the analysis; without either reduction the oracle fails."""
    from minitron.tools.testing import run_on_ranks

    lay = ParallelConfig(tp=2, dp=2, zero=3, precision="fp8", fp8_recipe="tensorwise", device="cpu")
    plan = [("tp2 dp2 zero3 tensorwise", lay, MODEL, None),
            ("tp2 dp2 zero3 without the tensor amax", lay, MODEL, gather_without_tensor_amax),
            ("tp2 dp2 zero3 without the data amax", lay, MODEL, gather_without_data_amax)]
    ranks = run_on_ranks(_layouts_job, ParallelConfig(dp=4, device="cpu"), plan, TRAIN)
    _hold_the_oracle(plan, ranks)
