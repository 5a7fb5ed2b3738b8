"""Lesson 12's comparisons (``minitron.course.native``): PyTorch's own FSDP2, tensor-parallel
plans and 1F1B pipeline, started from minitron's weights, train exactly like minitron's
ZeRO-3, ``--tp 2`` and ``--pp 2 --schedule 1f1b`` on the same ranks (float64, 1e-9), and
what each side put on the wire differs only where the lesson says why. One launch of 2
gloo ranks (about 15 s).
"""
import pytest

from minitron.config import ParallelConfig
from minitron.course.native import MODEL, RANKS, TRAIN, loss_diffs, native_job
from minitron.tools.testing import run_on_ranks

TOL = 1e-9  # float64: minitron.tools.verify.TOLERANCE


@pytest.mark.multirank
def test_native_apis_train_like_minitron_and_their_calls_differ_as_explained():
    ranks = run_on_ranks(native_job, ParallelConfig(dp=RANKS))
    out, m, layers = ranks[0], TRAIN.microbatches, MODEL.layers
    diffs = loss_diffs(out)
    assert set(diffs) == {"fsdp", "tp", "pp"}
    for name, diff in diffs.items():
        assert len(out[name]["native"]) == TRAIN.steps
        assert diff <= TOL, f"{name}: native and minitron losses differ by {diff:.3g}"
        assert out[name]["max_param_rel_diff"] <= TOL, f"{name}: parameters differ by {out[name]['max_param_rel_diff']:.3g}"
    assert out["fsdp"]["native"][0] != out["fsdp"]["native"][-1]  # it trains

    # FSDP2 vs ZeRO-3: the same reduce-scatters (a unit per block and the root, every
    # microbatch); FSDP2 gathers the root again in each microbatch, minitron once a step
    fsdp = out["fsdp"]
    n, theirs = fsdp["native_calls"], fsdp["minitron_calls"]
    assert n["reduce_scatter"] == theirs["reduce_scatter"] and n["reduce_scatter"][0] == (layers + 1) * m
    assert theirs["all_gather"][0] == 1 + 2 * layers * m
    assert n["all_gather"] == (theirs["all_gather"][0] + m - 1, theirs["all_gather"][1] + (m - 1) * fsdp["root_gather_bytes"])
    assert set(n) == {"all_gather", "reduce_scatter"} and theirs["all_reduce"] == (1, 8)  # minitron's gradient norm

    # parallelize_module vs --tp: f and g of every block (2 forward, 2 backward all-reduces
    # of [b, s, h]) on both; minitron's vocabulary-parallel embedding and head add one
    # forward and one backward all-reduce of [b, s, h] per microbatch, and the cross-entropy three of [b, s]
    tp = out["tp"]
    act = tp["activation_bytes"]
    assert tp["native_calls"] == {"all_reduce": (4 * layers * m, 4 * layers * m * act)}
    assert tp["minitron_activation_all_reduces"] == 4 * layers * m + 2 * m
    b = TRAIN.global_batch // m
    assert tp["minitron_calls"]["all_reduce"] == (4 * layers * m + 2 * m + 3 * m + 1,
                                                  (4 * layers * m + 2 * m) * act + 3 * m * b * MODEL.seq_len * 8 + 8)

    # Schedule1F1B vs minitron's 1F1B: the same sends and receives once the shapes are known;
    # the native schedule's first step also exchanges the stage shapes
    for rank in (0, 1):
        pp = ranks[rank]["pp"]
        steady = {k: v for k, v in pp["minitron_calls"].items() if k in ("send", "recv")}
        assert pp["native_calls"] == steady == {"send": (m, m * act), "recv": (m, m * act)}
        assert pp["native_calls_first_step"]["send"][0] > m
