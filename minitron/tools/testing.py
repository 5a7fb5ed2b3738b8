"""Helpers for multi-rank tests and lab checkers: real gloo process groups, many checks
per launch (starting ranks is the expensive part on a small machine).

    def check(comm):             # runs on every rank, returns anything picklable
        return comm.grid.rank
    results = run_on_ranks(check, ParallelConfig(dp=2, tp=2))   # {rank: result}

    out = run_cli(["verify", "--nproc", "2", "--dp", "2", "--json"])  # (code, stdout, stderr)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from ..config import ParallelConfig


def _rank_entry(fn, layout, trace, args):
    from ..launch import rank_session

    with rank_session(layout, trace=trace) as comm:  # a test's error propagates, traceback and all
        return fn(comm, *args)


def run_on_ranks(fn, layout: ParallelConfig, *args, trace: bool = False) -> dict:
    """Run `fn(comm, *args)` on dp*tp*pp local gloo ranks; return {rank: result}."""
    from ..launch import launch_local

    if layout.world == 1:
        return {0: _rank_entry(fn, layout, trace, args)}
    return launch_local(_rank_entry, (fn, layout, trace, args), layout.world)


def trained_versus_one_device(comm, model, layout: ParallelConfig, train, corpus, within=None) -> dict:
    """On every rank of a launch: a Trainer on `layout`'s own grid (a traced Comm) trains
    `train.steps` steps inside `within` (a context manager: a planted mistake's patch; None:
    nothing), then the oracle (``tools.verify.versus_one_device``, one reference microbatch
    per replica's microbatch: rank 0's verdict) and this rank's traced bytes of step 0.
    Returns ``{"res", "traced"}``."""
    from contextlib import nullcontext

    from ..comm import Comm, CommTrace
    from ..grid import ProcessGrid
    from ..train import Trainer
    from .verify import versus_one_device

    grid = ProcessGrid.for_layout(layout, comm.grid.rank).build_groups()
    c = Comm(grid, CommTrace())
    with within if within is not None else nullcontext():
        tr = Trainer(model, layout, train, c, corpus)
        losses = [tr.step(i) for i in range(train.steps)]
    res = versus_one_device(c, tr, losses, model, train.replace(microbatches=train.microbatches * layout.data_replicas))
    return {"res": res, "traced": traced_step_bytes(c.trace.records, comm.grid.rank)}


def step_document_lengths(corpus, model, layout: ParallelConfig, train, replica: int, step: int = 0) -> list:
    """The document lengths of each row (``packing.Documents.lengths``) of each microbatch data
    replica `replica` trains on in `step` under --pack, as the Trainer draws them from the
    training split of `corpus`: what ``analysis.context_parallel`` prices a packed ring's
    bytes by (``window_ring_items`` / ``usp_comm_items``'s `documents`)."""
    from ..packing import PackedCorpus

    per = train.global_batch // layout.data_replicas
    packed = PackedCorpus(corpus.split()[0], model.seq_len, pad_to=train.pack_pad, balance=train.pack_balance)
    _, _, docs = packed.batch(train.global_batch, train.seed, step, slice(replica * per, (replica + 1) * per))
    return [d.lengths() for d in docs.chunk(train.microbatches)]


def assert_oracle_verdicts(results: dict, cases, tol: float) -> None:
    """Each case of `cases` ((name, ..., planted) tuples) within `tol` of one device in loss
    and parameters (``results[name]["res"]``) exactly when nothing was planted."""
    for name, *_, planted in cases:
        res = results[name]["res"]
        print(f"{name:<44} loss {res['max_loss_abs_diff']:.1e} param {res['max_param_rel_diff']:.1e}")
        ok = res["max_loss_abs_diff"] <= tol and res["max_param_rel_diff"] <= tol
        assert ok != bool(planted), (name, res)


def traced_step_bytes(records: list[dict], rank: int, step: int = 0) -> dict:
    """One rank's traced bytes in one step, per axis and op (``analysis.calls.bytes_by_axis``,
    what ``comm_bytes_per_step`` predicts): the 'log' phase (the logged loss's all-reduce,
    not training traffic) left out."""
    from ..analysis.calls import bytes_by_axis

    return bytes_by_axis([r for r in records if r["rank"] == rank and r["step"] == step and r["phase"] != "log"])


def routed_all_to_all_bytes(ranks: list[dict], r: dict, model, dtype_bytes: int) -> int:
    """What analysis.experts.step_all_to_all_bytes says rank result `r` moved over 'ep' in
    the step, from the routing counts of its whole expert-parallel group (routing is data:
    each rank's counts alone do not give its received rows). `ranks`: every rank's result,
    each with its grid coordinates `coord` ({axis: index}) and its `calls` (per MoE call, in
    order, the E counts it sent); the group's ranks differ from `r` in their ep index only."""
    from ..analysis.experts import step_all_to_all_bytes

    by_coord = {tuple(sorted(p["coord"].items())): p for p in ranks}
    ep = 1 + max(p["coord"]["ep"] for p in ranks)
    peers = [by_coord[tuple(sorted({**r["coord"], "ep": e}.items()))] for e in range(ep)]
    if any(len(p["calls"]) != len(r["calls"]) for p in peers):
        raise ValueError(f"the ep group of {r['coord']} ran {[len(p['calls']) for p in peers]} MoE calls (not alike)")
    counts = [[p["calls"][j] for p in peers] for j in range(len(r["calls"]))]
    return step_all_to_all_bytes(counts, r["coord"]["ep"], model, dtype_bytes)


def run_cli(argv: list[str], timeout: float = 600, env: dict | None = None):
    """Run `python -m minitron <argv>` in a subprocess: (returncode, stdout, stderr)."""
    e = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    p = subprocess.run([sys.executable, "-m", "minitron", *argv], capture_output=True, text=True,
                       timeout=timeout, env=e)
    return p.returncode, p.stdout, p.stderr


def last_json(stdout: str) -> dict:
    """The JSON object on the last non-empty line of a command's output."""
    return json.loads([ln for ln in stdout.splitlines() if ln.strip()][-1])


def reseal(step_dir) -> None:
    """Rewrite a checkpoint's checksums (meta.json) to match its files as they are now: a
    test that crafts a shard this way reaches the checks behind the checksum (structure,
    finite values), as a forger with write access to the folder would."""
    import hashlib
    from pathlib import Path

    step_dir = Path(step_dir)
    meta = json.loads((step_dir / "meta.json").read_text())
    meta["files"] = {f.name: {"sha256": hashlib.sha256(f.read_bytes()).hexdigest(), "bytes": f.stat().st_size}
                     for f in sorted(step_dir.glob("rank_*.pt"))}
    (step_dir / "meta.json").write_text(json.dumps(meta, indent=1))
