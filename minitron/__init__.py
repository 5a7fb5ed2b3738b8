"""minitron: Megatron-style parallel GPT training, small enough to read.

    from minitron import PRESETS, ParallelConfig, TrainConfig, Trainer
    tr = Trainer(PRESETS["tiny"], ParallelConfig(), TrainConfig(steps=10))
    for i in range(10): print(tr.step(i))

The package's names are imported when first used (PEP 562), so that `minitron --help`
does not pay for importing torch.
"""
import importlib

# each public name and the module that is its home
_HOMES = {"ConfigError": "config", "ModelConfig": "config", "ParallelConfig": "config", "TrainConfig": "config",
          "PRESETS": "config", "preset": "config", "validate": "config", "ProcessGrid": "grid", "Comm": "comm",
          "CommTrace": "comm", "read_trace": "comm", "GPT": "model", "Trainer": "train"}

__all__ = list(_HOMES)
__version__ = "0.1.0"


def __getattr__(name):
    """Import a public name from its home module on first use."""
    if name not in _HOMES:
        raise AttributeError(f"module 'minitron' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_HOMES))
