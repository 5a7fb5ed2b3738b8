"""The oracle can fail: a perturbed parameter or loss is caught."""
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
