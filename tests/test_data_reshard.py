"""The data position reshards (minitron/data.py's docstring): a checkpoint saved at one
data-parallel size and resumed at another trains, from the resume step on, on the rows an
uninterrupted run at the new size trains on, per rank and step, and reaches its losses in
float64.

On real ranks (one launch of 4): llama-tiny saved after 2 of 4 steps at dp2 (x tp2) and
resumed at dp4, and saved at dp4 and resumed at dp2 x tp2; on Shakespeare's windows, on
packed documents (--pack) and on a token file (a memory-mapped .bin); every rank's token ids
of every step it trains (what its microbatches hold) equal the uninterrupted run's at the
resumed layout, each step's global batch (the data ranks' rows in order) is the single
device's, both sizes' checkpoints state the single device's data position, and the continued
losses equal the uninterrupted ones to 1e-9. Planted: a loader
whose position is not restored (its cursor starts again at 0 on resume) is caught by both. The checkpoint's meta and the resume's refusals are in
test_reliability.py; the recovering replica's position in test_fault_tolerance.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from minitron.config import PRESETS, ParallelConfig, TrainConfig, validate
from minitron.data import TokenFile
from test_packing import CORPUS as DOCUMENTS  # short documents, each ended by the separator

MODEL = PRESETS["llama-tiny"]
SMALL, LARGE = ParallelConfig(dp=2, tp=2), ParallelConfig(dp=4)  # data-parallel sizes 2 and 4 on 4 ranks
STEPS, SAVED_AT, TOL = 4, 2, 1e-9
# (name, corpus, --pack, planted)
CASES = [("windows", "shakespeare", False, False), ("packed documents", "documents", True, False),
         ("token file", "token file", False, False), ("planted: the cursor restarted on resume", "shakespeare", False, True)]


def _train(pack: bool) -> TrainConfig:
    return TrainConfig(steps=STEPS, global_batch=8, microbatches=2, dtype="float64", lr=1e-2, warmup=1,
                       eval_every=0, progress=False, sample_tokens=0, pack=pack)


def _token_file(folder) -> TokenFile:
    """A flat .bin of uint16 ids (no tokenizer: windows only), the TokenFile the Trainer maps."""
    path = folder / "ids.bin"
    np.random.default_rng(0).integers(0, MODEL.vocab, 40_000, dtype=np.uint16).tofile(path)
    return TokenFile(str(path), np.uint16, MODEL.vocab)


def _corpora(folder) -> dict:
    """{kind: corpus}; Shakespeare is read on each rank (None here)."""
    return {"shakespeare": None, "documents": DOCUMENTS, "token file": _token_file(folder)}


def _restarted_cursor(tr, first: int) -> None:
    """The planted loader: its position is not restored, so the resumed run draws step k's rows
    as if it were step k - `first` (a sampler whose cursor starts again at 0)."""
    rows = tr.rows
    tr.rows = lambda step, subset="train": rows(step - first, subset)


def _run(comm, layout, train, corpus, save_to: str = "", resume_from: str = "", planted: bool = False) -> dict:
    """Steps from 0 (saving after SAVED_AT to `save_to`) or from `resume_from`'s checkpoint to
    STEPS on `layout`: {"loss": {step: loss}, "ids": {step: the token ids this rank trained on}}."""
    from minitron.checkpoint import load_latest, save
    from minitron.comm import Comm
    from minitron.grid import ProcessGrid
    from minitron.train import Trainer

    c = Comm(ProcessGrid.for_layout(layout, comm.grid.rank).build_groups())
    tr = Trainer(MODEL, layout, train, c, corpus)
    ids, drawn = {}, tr.microbatches

    def trained(step):  # what the step's forward receives, microbatch by microbatch
        mbs = drawn(step)
        ids[step] = torch.cat([mb[0] for mb in mbs]).tolist()
        return mbs

    tr.microbatches = trained
    first = load_latest(resume_from, tr) if resume_from else 0
    if planted:
        _restarted_cursor(tr, first)
    loss = {}
    for k in range(first, STEPS):
        if save_to and k == SAVED_AT:
            save(save_to, k, tr)
        loss[k] = float(tr.step(k))
    return {"loss": loss, "ids": ids}


def _job(comm, cases, corpora, folder):
    """Every case: the uninterrupted runs at both sizes (each saving after SAVED_AT steps), then
    each checkpoint resumed at the other size."""
    from minitron.data import load_corpus

    out, shakespeare = {}, load_corpus("")
    for i, (name, kind, pack, planted) in enumerate(cases):
        corpus, train, ck = corpora[kind] or shakespeare, _train(pack), folder / f"case{i}"
        runs = {"small": _run(comm, SMALL, train, corpus, save_to=str(ck / "small")),
                "large": _run(comm, LARGE, train, corpus, save_to=str(ck / "large"))}
        runs["small->large"] = _run(comm, LARGE, train, corpus, resume_from=str(ck / "small"), planted=planted)
        if not planted:
            runs["large->small"] = _run(comm, SMALL, train, corpus, resume_from=str(ck / "large"))
        out[name] = runs
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    from minitron.tools.testing import run_on_ranks

    for layout in (SMALL, LARGE):
        for pack in (False, True):
            validate(MODEL, layout, _train(pack), world=4)
    folder = tmp_path_factory.mktemp("reshard")
    corpora = _corpora(folder)
    return run_on_ranks(_job, ParallelConfig(dp=4), CASES, corpora, folder), corpora, folder


def _resumes(name: str):
    return [("small->large", "large")] + ([("large->small", "small")] if not name.startswith("planted") else [])


def _same_rows(results: dict, name: str, resumed: str, uninterrupted: str) -> bool:
    return all(results[r][name][resumed]["ids"] == {k: v for k, v in results[r][name][uninterrupted]["ids"].items()
                                                     if k >= SAVED_AT} for r in results)


def _same_losses(results: dict, name: str, resumed: str, uninterrupted: str) -> float:
    a, b = results[0][name][resumed]["loss"], results[0][name][uninterrupted]["loss"]
    assert sorted(a) == list(range(SAVED_AT, STEPS))
    return max(abs(a[k] - b[k]) for k in a)


@pytest.mark.multirank
@pytest.mark.parametrize("name,kind,pack,planted", CASES)
def test_a_resume_at_another_data_parallel_size_trains_on_the_new_sizes_rows(four, name, kind, pack, planted):
    """Per rank and step, the token ids trained on from the resume step are the uninterrupted
    run's at the new size, and so are the losses (float64, 1e-9); the planted loader fails both."""
    results = four[0]
    small, large = (results[0][name][run]["loss"] for run in ("small", "large"))
    print(f"{name:<40} the two sizes' uninterrupted losses differ by {max(abs(small[k] - large[k]) for k in small):.1e}")
    for resumed, uninterrupted in _resumes(name):
        rows, diff = _same_rows(results, name, resumed, uninterrupted), _same_losses(results, name, resumed, uninterrupted)
        print(f"{name:<40} {resumed:<13} rows equal {rows}  loss {diff:.1e}")
        assert rows != planted and (diff <= TOL) != planted, (name, resumed, rows, diff)


@pytest.mark.multirank
@pytest.mark.parametrize("name,kind,pack,planted", [c for c in CASES if not c[3]])
def test_each_steps_global_batch_is_the_single_devices_at_both_sizes(four, name, kind, pack, planted):
    """The data ranks' rows of a step, in data-rank order, are the single device's global batch
    of that step: the rule that makes the position layout-free; both sizes' checkpoints state
    the same position, the single device's after SAVED_AT steps."""
    import json

    from minitron.checkpoint import latest
    from minitron.comm import Comm
    from minitron.data import load_corpus, position
    from minitron.grid import ProcessGrid
    from minitron.train import Trainer

    results, corpora, folder = four
    one = Trainer(MODEL, ParallelConfig(), _train(pack), Comm(ProcessGrid()), corpora[kind] or load_corpus(""))
    ck = folder / f"case{[c[0] for c in CASES].index(name)}"
    for size in ("small", "large"):
        meta = json.loads((latest(str(ck / size)) / "meta.json").read_text())
        assert meta["data"] == position(_train(pack), MODEL.seq_len, len(one.train_data), SAVED_AT), (size, meta)
    for layout, run in ((SMALL, "small"), (LARGE, "large")):
        first = {ProcessGrid.for_layout(layout, r).data_index(): r for r in sorted(results, reverse=True)}
        for k in range(STEPS):
            rows = [row for d in sorted(first) for row in results[first[d]][name][run]["ids"][k]]
            assert rows == one.rows(k)[0].tolist(), (name, run, k)
