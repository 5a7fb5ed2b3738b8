"""A Llama-shaped block (SwiGLU, RMSNorm, grouped-query attention, rotary positions, no
biases) on five layouts: each equals one device in float64, and the bytes its traced step
sent equal the analysis per axis and operation, exactly. The analysis was not told the
architecture: it reads the model (analysis/dry_run.py)."""
import json

import pytest

from minitron.analysis import comm as C
from minitron.comm import read_trace
from minitron.config import ModelConfig, ParallelConfig, TrainConfig
from minitron.tools.testing import last_json, run_cli

MODEL = dict(layers=2, hidden=32, heads=4, kv_heads=2, ffn=48, seq_len=16, vocab=258,
             norm="rmsnorm", activation="swiglu", positions="rope", bias=False)
FLAGS = ["--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--ffn", "48", "--seq-len", "16",
         "--vocab", "258", "--norm", "rmsnorm", "--activation", "swiglu", "--positions", "rope", "--no-bias"]
LAYOUTS = {  # name: (layout, flags)
    "tp2.sp": (dict(tp=2, sp=True), ["--tp", "2", "--sp"]),
    "cp2": (dict(cp=2), ["--cp", "2"]),
    "pp2": (dict(pp=2), ["--pp", "2"]),
    "2d.tp4": (dict(tp=4, tp_mode="2d"), ["--tp", "4", "--tp-mode", "2d"]),
    "cube.tp8": (dict(tp=8, tp_mode="3d"), ["--tp", "8", "--tp-mode", "3d"]),
}
GLOBAL_BATCH, MICROBATCHES = 8, 2


def _by_axis(records) -> dict:
    out: dict = {}
    for r in records:
        out.setdefault(r["axis"], {}).setdefault(r["op"], 0)
        out[r["axis"]][r["op"]] += r["bytes"]
    return out


def _analysis(layout: ParallelConfig, rank_pp: int) -> dict:
    model, train = ModelConfig(**MODEL), TrainConfig(global_batch=GLOBAL_BATCH, microbatches=MICROBATCHES,
                                                      dtype="float64")
    return C.comm_bytes_per_step(model, layout, train, rank_pp)


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_llama_block_traced_equals_analysis(name, tmp_path):
    kw, flags = LAYOUTS[name]
    layout = ParallelConfig(**kw)
    trace = tmp_path / "trace.jsonl"
    code, out, err = run_cli(["verify", "--nproc", str(layout.world), *flags, *FLAGS, "--steps", "1",
                              "--global-batch", str(GLOBAL_BATCH), "--microbatches", str(MICROBATCHES),
                              "--dtype", "float64", "--json", "--trace", str(trace)])
    assert code == 0, (out[-2000:], err[-2000:])
    verdict = last_json(out)
    assert verdict["max_loss_abs_diff"] <= 1e-9 and verdict["max_param_rel_diff"] <= 1e-9, verdict
    records = read_trace(str(trace))
    for rank in range(layout.world):
        mine = [r for r in records if r["rank"] == rank and r["step"] == 0]
        pp_rank = rank // (layout.world // layout.pp)
        got = {a: ops for a, ops in _by_axis(mine).items() if a != "world"}
        want = {a: {op: nb for op, nb in ops.items() if nb} for a, ops in _analysis(layout, pp_rank).items()}
        assert got == {a: ops for a, ops in want.items() if ops}, (name, rank, json.dumps(got), json.dumps(want))
