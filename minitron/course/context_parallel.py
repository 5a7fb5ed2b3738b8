"""The rank jobs of the context-parallelism lesson: one launch of 4 ranks that traces a
training step of ``--cp 4`` (the ring's messages) and measures the activation memory
per rank of long sequences at cp = 1, 2 and 4; one launch of 2 ranks that traces a
float64 step of a small Llama under ``--cp 2`` with and without a sliding window; and one
launch of 4 ranks that traces a float64 step of it under USP, ``--cp 4 --cp-mode usp
--cp-a2a 2``, on plain and on packed sequences. Beside them, the lesson's rule for USP's
all-to-all factor (:func:`largest_a2a`).

It lives in a module because every rank is a fresh process that imports it by name.
"""
from __future__ import annotations

from ..comm import Comm, CommTrace
from ..config import PRESETS, ModelConfig, ParallelConfig, TrainConfig
from ..grid import ProcessGrid

WINDOWED = PRESETS["llama-tiny"]  # 2 layers, s = 32: under cp = 2 four chunks of 8 tokens
# Mistral 7B's shape (Jiang et al. 2023): Llama 3 8B's block, a 32,000-token vocabulary, a window of 4,096
MISTRAL_7B = PRESETS["llama3-8b"].replace(vocab=32000, window=4096, name="mistral-7b")
RING = ModelConfig(layers=2, hidden=32, heads=4, seq_len=64, vocab=256, name="ring")
MEMORY_LAYOUTS = (ParallelConfig(dp=4), ParallelConfig(cp=2, dp=2), ParallelConfig(cp=4))
USP = ParallelConfig(cp=4, cp_mode="usp", cp_a2a=2)  # the cp ranks a 2 x 2 grid: all-to-all rows, ring columns


def long_model(seq_len: int) -> ModelConfig:
    """The 2-layer GPT whose activations the lesson measures, with sequence length `seq_len`."""
    return ModelConfig(layers=2, hidden=32, heads=4, seq_len=seq_len, vocab=256, name=f"s{seq_len}")


def _comm(layout: ParallelConfig, rank: int, trace: bool = False) -> Comm:
    grid = ProcessGrid(tp=layout.tp, dp=layout.dp, pp=layout.pp, cp=layout.cp, rank=rank).build_groups()
    return Comm(grid, CommTrace() if trace else None)


def context_job(comm, seq_lens) -> dict:
    """On each of 4 ranks: one traced step of `RING` under cp = 4 (this rank's 'cp'
    records), then for each sequence length the peak activation bytes of one training
    step under cp = 1 (dp = 4), 2 (× dp = 2) and 4, one sequence per rank."""
    from ..data import load_corpus
    from ..tools.measure import measure_step_memory
    from ..train import Trainer

    corpus, rank = load_corpus(""), comm.grid.rank
    layout, train = ParallelConfig(cp=4), TrainConfig(global_batch=1, progress=False)
    c = _comm(layout, rank, trace=True)
    Trainer(RING, layout, train, c, corpus).step(0)
    out = {"ring": [r for r in c.trace.records if r["axis"] == "cp"],
           "all_axes": sorted({r["axis"] for r in c.trace.records}), "memory": {}}
    for s in seq_lens:
        for lay in MEMORY_LAYOUTS:
            tr = Trainer(long_model(s), lay, TrainConfig(global_batch=lay.dp, progress=False),
                         _comm(lay, rank), corpus)
            out["memory"][(s, lay.cp)] = measure_step_memory(tr)["activations_bytes"]
            del tr
    return out


def window_job(comm, windows) -> dict:
    """On each of 2 ranks: for each window of `windows` (0: global attention), one traced
    float64 step of `WINDOWED` under cp = 2: the loss and this rank's 'cp' records."""
    from ..data import load_corpus
    from ..train import Trainer

    corpus, rank, layout = load_corpus(""), comm.grid.rank, ParallelConfig(cp=2)
    out = {}
    for w in windows:
        c = _comm(layout, rank, trace=True)
        loss = Trainer(WINDOWED.replace(window=w), layout, window_train(), c, corpus).step(0)
        out[w] = {"loss": loss, "cp": [r for r in c.trace.records if r["axis"] == "cp"]}
    return out


def window_train() -> TrainConfig:
    """The windowed runs' step: one sequence, float64 (the single-device comparison is exact to rounding)."""
    return TrainConfig(global_batch=1, dtype="float64", progress=False, eval_every=0)


def usp_job(comm, documents) -> dict:
    """On each of 4 ranks: one traced float64 step of `WINDOWED` (llama-tiny, no window) under
    `USP`, on plain sequences of the built-in corpus and on packed ones of `documents` (a corpus
    whose documents end with the separator): ``{False | True (packed): {"loss", "records"}}``,
    the records this rank's calls on the axes 'cp_a2a' and 'cp_ring'."""
    from ..data import load_corpus
    from ..train import Trainer

    out = {}
    for pack, corpus in ((False, load_corpus("")), (True, documents)):
        c = Comm(ProcessGrid.for_layout(USP, comm.grid.rank).build_groups(), CommTrace())
        loss = Trainer(WINDOWED, USP, usp_train(pack), c, corpus).step(0)
        out[pack] = {"loss": loss, "records": [r for r in c.trace.records if r["axis"] in ("cp_a2a", "cp_ring")]}
    return out


def usp_train(pack: bool = False) -> TrainConfig:
    """The USP runs' step: one microbatch of two sequences (every context rank holds its
    tokens of both), float64, of packed documents or not."""
    return TrainConfig(global_batch=2, dtype="float64", progress=False, eval_every=0, pack=pack)


def largest_a2a(model: ModelConfig, tp: int, cp: int, gpus_per_node: int) -> int:
    """USP's largest all-to-all factor U for `model` under `tp` and `cp` on nodes of
    `gpus_per_node`: U divides cp, ``config.validate_usp`` accepts it (U splits each tensor
    rank's query heads, and its key/value heads divide U or U divides them), and the
    all-to-all's t·U neighbouring ranks stay inside a node; 1 (the plain ring) if none does."""
    from ..config import ConfigError, validate_usp

    fits = []
    for u in range(2, cp):
        try:
            validate_usp(model, ParallelConfig(tp=tp, cp=cp, cp_mode="usp", cp_a2a=u))
        except ConfigError:
            continue
        if tp * u <= gpus_per_node:
            fits.append(u)
    return max(fits, default=1)
