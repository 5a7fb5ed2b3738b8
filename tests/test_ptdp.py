"""PTD-P: layouts composed, checkpoints that move between layouts, mixed precision."""
import json
from collections import Counter

import pytest

from minitron.analysis.params import layers_on_rank
from minitron.analysis.tensor_parallel import tp_collectives
from minitron.config import ModelConfig, ParallelConfig, TrainConfig, PRESETS
from minitron.tools.testing import run_cli, run_on_ranks
from minitron.train import Trainer
from test_pipeline import _check_parity_and_trace, _parity_job

pytestmark = pytest.mark.multirank

COMMON = ["--model", "tiny", "--global-batch", "8", "--microbatches", "2", "--dtype", "float64",
          "--steps", "10", "--no-progress", "--sample", "0", "--eval-every", "0", "--lr", "1e-2"]

# (layout flags, stop after step): each resumes from the checkpoint the previous one left.
CHAIN = [
    (["--nproc", "4", "--dp", "2", "--tp", "2", "--sp"], 2),
    (["--nproc", "4", "--tp", "4"], 4),
    ([], 6),
    (["--nproc", "8", "--dp", "2", "--tp", "2", "--pp", "2", "--zero1"], 8),
    (["--nproc", "8", "--tp", "8", "--tp-mode", "3d"], 10),
]


def _ptdp_cases():
    tied = ModelConfig(layers=4, hidden=16, heads=2, seq_len=16, vocab=256, tied_embeddings=True)
    L = dict(dp=2, tp=2, pp=2)
    cases = [ParallelConfig(**L, schedule=k, vpp=v) for k, v in
             (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2))]
    cases += [ParallelConfig(**L, schedule=k, vpp=v, sp=True) for k, v in
              (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))]
    cases += [ParallelConfig(**L, schedule="1f1b", zero1=True),
              ParallelConfig(**L, schedule="interleaved", vpp=2, zero1=True, sp=True)]
    cases += [ParallelConfig(**L, schedule=k, scatter_gather=True) for k in ("1f1b", "zb-h1")]
    return [(tied, layout, 4) for layout in cases]


def _check_sp_gathers(results, cases) -> None:
    """Under --sp a rank's tensor-parallel all-gathers in a step are those of
    tp_collectives for the layers it holds: the forward's entries, the backward's exits
    and re-gathers of the column-parallel linears' saved input shards (zb-h1 too: its
    B and W split the backward of those linears without gathering twice)."""
    for i, (model, layout, m) in enumerate(cases):
        if not layout.sp:
            continue
        for rank, rank_results in results.items():
            pp_rank = rank // (layout.tp * layout.dp)
            want = Counter()
            for c in tp_collectives(model, 2, layout.tp, True, layout.recompute,
                                    layers_on_rank(model, layout, pp_rank), first=pp_rank == 0,
                                    last=pp_rank == (layout.pp * layout.vpp - 1) % layout.pp, bytes_per_el=8):
                if c["op"] == "all_gather":
                    want[int(c["bytes"])] += m * c["calls"]
            assert Counter(rank_results[i]["gathers"]) == want, (layout.describe(), rank)


def test_dp2_tp2_pp2_every_schedule_sp_zero1_scatter_gather(tmp_path):
    """8 ranks, data 2 x tensor 2 x pipeline 2, each schedule (v = 2 for interleaved), with
    --sp, --zero1 and --scatter-gather: losses, parameters and validation loss equal one
    device (float64, 1e-9), the pipeline p2p trace is b·s·h (or b·s·h/t) per boundary, and
    under --sp the tensor-parallel all-gathers are tp_collectives'."""
    cases = _ptdp_cases()
    results = run_on_ranks(_parity_job, ParallelConfig(dp=2, tp=2, pp=2), cases, 2,
                           str(tmp_path / "timeline.jsonl"))
    _check_parity_and_trace(results)
    _check_sp_gathers(results, cases)
    for res in results[0]:
        print(f"{res['case']:<60} loss {res['max_loss_abs_diff']:.1e}  params {res['max_param_rel_diff']:.1e}")


def test_checkpoint_moves_across_five_layouts(tmp_path):
    """dp2·tp2·sp -> tp4 -> one device -> dp2·tp2·pp2+ZeRO-1 -> 3-D cube: the losses of the
    relay equal an uninterrupted single-device run (float64, 1e-9)."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    for flags, stop in CHAIN:
        code, out, err = run_cli(["train", *COMMON, *flags, "--ckpt-dir", str(ckpt), "--resume", "auto",
                                  "--stop-at", str(stop), "--metrics", str(metrics)])
        assert code == 0, err[-3000:]
    relay = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    ref = Trainer(PRESETS["tiny"], ParallelConfig(),
                  TrainConfig(steps=10, global_batch=8, microbatches=2, dtype="float64", lr=1e-2))
    expect = [ref.step(i) for i in range(10)]
    assert len(relay) == 10
    assert max(abs(a - b) for a, b in zip(relay, expect)) < 1e-9, (relay, expect)


def test_bf16_tracks_fp32_over_50_steps(tmp_path):
    """--precision bf16 on dp2·tp2·pp2 stays within 2% of the fp32 single-device losses."""
    metrics = tmp_path / "bf16.jsonl"
    code, out, err = run_cli(["train", "--model", "tiny", "--global-batch", "8", "--microbatches", "2",
                              "--steps", "50", "--no-progress", "--sample", "0", "--eval-every", "0",
                              "--nproc", "8", "--dp", "2", "--tp", "2", "--pp", "2", "--precision", "bf16",
                              "--metrics", str(metrics)])
    assert code == 0, err[-3000:]
    bf16 = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    ref = Trainer(PRESETS["tiny"], ParallelConfig(), TrainConfig(steps=50, global_batch=8, microbatches=2))
    fp32 = [ref.step(i) for i in range(50)]
    worst = max(abs(a - b) / b for a, b in zip(bf16, fp32))
    print(f"bf16 vs fp32: worst relative loss difference over 50 steps {worst:.4f}")
    assert worst < 0.02
