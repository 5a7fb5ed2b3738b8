"""minitron: Megatron-style parallel GPT training, small enough to read.

    from minitron import PRESETS, ParallelConfig, TrainConfig, Trainer
    tr = Trainer(PRESETS["tiny"], ParallelConfig(), TrainConfig(steps=10))
    for i in range(10): print(tr.step(i))
"""
from .config import ConfigError, ModelConfig, ParallelConfig, TrainConfig, PRESETS, preset, validate
from .grid import ProcessGrid
from .comm import Comm, CommTrace, read_trace
from .model import GPT
from .train import Trainer, train

__all__ = ["ConfigError", "ModelConfig", "ParallelConfig", "TrainConfig", "PRESETS", "preset", "validate",
           "ProcessGrid", "Comm", "CommTrace", "read_trace", "GPT", "Trainer", "train"]
__version__ = "0.1.0"
