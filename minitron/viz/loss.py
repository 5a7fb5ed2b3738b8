"""The loss as a learner reads it: its unit, the points to judge it by, and its figure.

The loss is the mean cross-entropy in nats of one predicted id: a byte of a text corpus
(the built-in Shakespeare; nats per byte = nats per character for ASCII text), or a token of a
token file (`minitron tokenize`). A model that knows nothing spreads its guess evenly over
the ``vocab`` ids and scores ln(vocab) (ln 256 = 5.55 for bytes), where a fresh model starts.
"""
from __future__ import annotations

import math
from pathlib import Path

# nanoGPT's CPU recipe trained beside minitron on the built-in corpus (benchmarks/RESULTS.md,
# "The first run": plain PyTorch, nanoGPT's model, 2,000 steps of 12 x 64 bytes)
NANOGPT_CPU_RECIPE = 1.864


def loss_unit(corpus) -> str:
    """'nats per byte' or 'nats per token': what the corpus' ids are (``corpus.unit``)."""
    return f"nats per {corpus.unit}"


def loss_reference(corpus, builtin: bool) -> str:
    """One line: the loss's unit and the points to judge it by (a uniform guess, and on the
    built-in corpus nanoGPT's CPU recipe)."""
    line = (f"  (in {loss_unit(corpus)}; a uniform guess over the {corpus.vocab:,} {corpus.unit} values "
            f"scores ln {corpus.vocab:,} = {math.log(corpus.vocab):.2f}")
    if builtin:
        line += (f"; nanoGPT's CPU recipe reaches {NANOGPT_CPU_RECIPE:.2f} on this text in 2,000 steps "
                 f"(benchmarks/RESULTS.md, \"The first run\")")
    return line + ")"


def loss_figure(losses: list[float], val_losses: dict, title: str = "", first_step: int = 1,
                unit: str = "nats per byte"):
    """The figure of the training loss per step (the first is step `first_step`) and of the
    validation loss at its evaluations, as points only (nothing was measured between two
    evaluations); the y axis in `unit`. Needs matplotlib."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    ax.plot(range(first_step, first_step + len(losses)), losses, lw=1, label="train (per step)")
    if val_losses:
        steps = sorted(val_losses)
        ax.plot(steps, [val_losses[s] for s in steps], "o", ls="none", label="validation (each evaluation)")
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss ({unit})")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def plot_losses(losses: list[float], val_losses: dict, path: str, title: str = "",
                first_step: int = 1, unit: str = "nats per byte") -> str | None:
    """Write :func:`loss_figure` to `path` and return it; None when matplotlib is missing."""
    try:
        fig = loss_figure(losses, val_losses, title, first_step, unit)
    except ImportError:
        return None
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
