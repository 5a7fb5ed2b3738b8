"""`minitron train --tensorboard DIR`: the metrics file's scalars, for TensorBoard.

Each step record of the metrics file (loss, learning rate, gradient norm, tokens/s,
model FLOP/s, MFU, and the validation loss where there is one) becomes one scalar per
key at that step, through PyTorch's own `torch.utils.tensorboard` writer (it needs the
`tensorboard` package; `pip install tensorboard`). Then `tensorboard --logdir DIR`.
"""
from __future__ import annotations

from ..config import ConfigError

# metrics-file key -> TensorBoard tag
TAGS = {"loss": "train/loss", "val_loss": "val/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
        "tokens_per_s": "perf/tokens_per_s", "model_flops_per_s": "perf/model_flops_per_s", "mfu": "perf/mfu"}


def check_available() -> None:
    """Raise ConfigError (one line) when the tensorboard package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        raise ConfigError("--tensorboard needs the tensorboard package: pip install tensorboard "
                          "(or pip install -e .[test])") from None


class ScalarWriter:
    """Writes step records as TensorBoard scalars under `log_dir`."""

    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=log_dir)

    def write(self, records: list[dict]) -> None:
        for r in records:
            for key, tag in TAGS.items():
                if key in r:
                    self.writer.add_scalar(tag, r[key], r["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
