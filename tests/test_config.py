"""validate(): every bad combination is one line naming the problem and the fix."""
import pytest

from minitron.config import ConfigError, ParallelConfig, TrainConfig, PRESETS, preset, validate

TINY = PRESETS["tiny"]


@pytest.mark.parametrize("model,layout,train,words", [
    (TINY, ParallelConfig(nproc=3, dp=2), None, "world size 3"),
    (TINY.replace(hidden=30), ParallelConfig(), None, "not divisible by 4 heads"),
    (TINY, ParallelConfig(tp=3, nproc=3), None, "heads are not divisible by --tp 3"),
    (TINY, ParallelConfig(tp=2, sp=True), None, None),
    (TINY.replace(seq_len=33), ParallelConfig(tp=2, sp=True), None, "--seq-len 33"),
    (TINY, ParallelConfig(sp=True), None, "--sp needs tensor parallelism"),
    (TINY, ParallelConfig(tp=4, tp_mode="3d"), None, "cube number"),
    (TINY.replace(heads=3, hidden=24), ParallelConfig(tp=8, tp_mode="3d"), None, "heads divisible by q"),
    (TINY.replace(hidden=42, heads=6), ParallelConfig(tp=8, tp_mode="3d"), None, "divisible by q^2"),
    (TINY, ParallelConfig(pp=4, vpp=2, schedule="interleaved"), None, "model chunks"),
    (TINY.replace(layers=4), ParallelConfig(pp=2, schedule="interleaved", vpp=2),
     TrainConfig(microbatches=1, global_batch=6),
     "of at least --pp 2"),
    (TINY, ParallelConfig(pp=2, schedule="zz"), None, "unknown schedule 'zz'"),
    (TINY, ParallelConfig(pp=2, stage_layers=(1, 2)), None, "sum to 2 layers"),
    (TINY, ParallelConfig(zero1=True), None, "--zero1"),
    (TINY, ParallelConfig(bucket_mb=0), None, "--bucket-mb"),
    (TINY, ParallelConfig(dp=2), TrainConfig(global_batch=6, microbatches=2), "not divisible by dp*microbatches"),
    (TINY, ParallelConfig(), TrainConfig(steps=0), "--steps"),
    (TINY, ParallelConfig(), TrainConfig(steps=-3), "--steps"),
    (TINY, ParallelConfig(tp=8, tp_mode="3d"), TrainConfig(global_batch=2), "divisible by 4"),
])
def test_validate(model, layout, train, words):
    if words is None:
        validate(model, layout, train)
        return
    with pytest.raises(ConfigError) as e:
        validate(model, layout, train)
    msg = str(e.value)
    assert words in msg and "\n" not in msg


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown model preset 'gpt5'"):
        preset("gpt5")


def test_published_presets_exist():
    assert preset("gpt3-175b").layers == 96 and preset("ptdp-1t").hidden == 25600
    assert preset("megatron-8.3b").layers == 72
