"""Lesson 5's tables on tensor-parallel schemes, built from the engine and its analysis.

* :func:`cube_placements` — one cube linear ``Y = X·W + bias`` placed two ways on the
  q×q×q cube: the *naive* 3-D matrix multiply (Agarwal et al. 1995, the starting point of
  Bian et al. 2021 §3.1) and the *balanced* one the engine runs (``parallel/cube.py``).
  Per rank: the bytes of input, weight, output and bias it holds, the bytes it sends per
  direction and the element-wise work (the bias add) it does. The balanced numbers come
  from the engine's own objects: the parameters of a real ``Linear3D`` built for each
  rank and the calls of :func:`minitron.analysis.cube.linear_calls`.
* :func:`scheme_rows` — 1-D, 2-D (SUMMA), 2.5-D and 3-D side by side on P devices
  (:func:`minitron.analysis.tp_schemes.compare_tp_schemes` and
  :func:`~minitron.analysis.tp_schemes.project_tp_schemes`).
* :func:`bian_64gpu_comparison` and :func:`scaling_series` — Bian et al.'s 64-GPU
  comparison with the cost model, beside the published speed-ups
  (:data:`minitron.analysis.published.BIAN_2021_SPEEDUPS`).
* :func:`read_tp_schemes_benchmark` — the figures measured on this machine by
  ``benchmarks/tp_schemes.py``, read from its results file.
"""
from __future__ import annotations

import re
from pathlib import Path

from ..config import ModelConfig

__all__ = ["cube_placements", "placement_imbalance", "scheme_rows", "BIAN_SHAPE", "bian_64gpu_comparison",
           "scaling_series", "TP_SCHEMES_RESULTS", "read_tp_schemes_benchmark"]

HELD = ("input", "weight", "output", "bias")


def cube_placements(q: int, micro_batch: int, seq_len: int, d_in: int, d_out: int,
                    bytes_per_el: int = 4) -> dict:
    """Per-rank bytes of one cube linear on layout (a, c) = (j, k), both placements.

    Naive (Agarwal's 3-D matmul): the input block X[i, c] (B/q tokens × d_in/q) lives on the
    rank with index(a) = 0 and is *broadcast* along the a-line; the weight block W[c, a]
    (d_in/q × d_out/q) lives on the rank with index(i) = 0 and is broadcast along the
    i-line; the partial products are *reduced* along the c-line onto index(c) = 0, where
    the output block Y[i, a] (B/q × d_out/q) and the bias piece it needs stay.
    Balanced (Bian et al., the engine): each of those blocks is cut once more into q
    pieces along the third axis, so broadcasts become all-gathers and the reduce a
    reduce-scatter, and every rank holds 1/q³ of X, W and Y.

    Returns ``{"naive": {rank: row}, "balanced": {rank: row}}``; a row has the bytes held
    (``input, weight, output, bias``), ``sent`` (bytes sent per direction: ring
    collectives and pipelined broadcasts/reduces, (q−1)/q of a block per rank on
    average) and ``bias_adds`` (element-wise additions of the bias).
    """
    import torch

    from ..analysis import cube as C
    from ..comm import Comm
    from ..config import ParallelConfig
    from ..context import Context
    from ..grid import ProcessGrid
    from ..parallel.cube import FIRST, Linear3D

    e, P = bytes_per_el, q ** 3
    calls = {c["what"].split(": ")[1]: c for c in C.linear_calls(micro_batch, seq_len, d_in, d_out, q, e)}
    x_local = calls["input all-gather"]["bytes"]            # this rank's piece of the input
    w_local = calls["weight all-gather"]["bytes"]           # this rank's piece of the weight
    y_local = calls["output reduce-scatter"]["bytes"] // q  # its piece of the summed output
    sent_balanced = sum(C.wire_bytes(c, q) for c in calls.values() if c["phase"] == "fwd")
    dtype = {4: torch.float32, 8: torch.float64, 2: torch.bfloat16}[e]
    parallel = ParallelConfig(tp=P, tp_mode="3d")
    naive, balanced = {}, {}
    for r in range(P):
        comm = Comm(ProcessGrid(tp=P, cube=True, rank=r))   # rank r's view; no process group
        layer = Linear3D("linear", d_in, d_out, Context(comm, parallel, dtype), FIRST)
        assert e * layer.weight.numel() == w_local  # the engine's shard is what the analysis gathers
        balanced[r] = {"input": x_local, "weight": w_local, "output": y_local,
                       "bias": e * layer.bias.numel(), "sent": sent_balanced,
                       "bias_adds": y_local // e}
        on = {axis: comm.index(axis) == 0 for axis in (C.I, FIRST.a, FIRST.c)}
        block = {"input": q * x_local, "weight": q * w_local, "output": q * y_local}
        naive[r] = {"input": block["input"] if on[FIRST.a] else 0,
                    "weight": block["weight"] if on[C.I] else 0,
                    "output": block["output"] if on[FIRST.c] else 0,
                    "bias": e * d_out // q if on[FIRST.c] else 0,
                    # each rank takes part in one broadcast of X, one of W and one reduce of Y
                    "sent": (q - 1) / q * sum(block.values()),
                    "bias_adds": block["output"] // e if on[FIRST.c] else 0}
    return {"naive": naive, "balanced": balanced}


def placement_imbalance(per_rank: dict) -> dict:
    """For each quantity of :func:`cube_placements`' rows: the largest rank's share over
    the mean (1.0: perfectly balanced; q: all of it on one plane of the cube)."""
    keys = next(iter(per_rank.values())).keys()
    out = {}
    for k in keys:
        values = [row[k] for row in per_rank.values()]
        mean = sum(values) / len(values)
        out[k] = max(values) / mean if mean else 1.0
    return out


def scheme_rows(model: ModelConfig, micro_batch: int, devices: int, cluster=None,
                bytes_per_el: int = 2) -> list[dict]:
    """The four schemes on `devices` devices, one row each: the bytes of
    :func:`~minitron.analysis.tp_schemes.compare_tp_schemes` (per device, one layer, one
    microbatch) joined with the seconds of
    :func:`~minitron.analysis.tp_schemes.project_tp_schemes` on `cluster` (default: TACC
    Longhorn, where Bian et al. measured)."""
    from ..analysis import tp_schemes as T

    cluster = T.LONGHORN if cluster is None else cluster
    sizes = {r["scheme"]: r for r in T.compare_tp_schemes(model, micro_batch, devices, bytes_per_el)}
    times = {r["scheme"]: r for r in T.project_tp_schemes(model, micro_batch, devices, cluster, bytes_per_el)}
    return [{**sizes[s], **{k: v for k, v in times[s].items() if k not in sizes[s]}} for s in T.SCHEMES]


# One GPT layer for the 64-GPU comparison. The paper's summary gives the machine and the
# speed-ups, not the layer's shape: this one is ours (hidden 4096, 64 heads, sequences of
# 512 tokens, 64 per step), the same as benchmarks/tp_schemes.py projects.
BIAN_SHAPE = (ModelConfig(layers=24, hidden=4096, heads=64, seq_len=512, vocab=51200, name="h4096"), 64)


def bian_64gpu_comparison(cluster=None, shape=BIAN_SHAPE) -> list[dict]:
    """3-D's speed-up over 1-D and 2-D on 64 GPUs: the cost model's
    (:func:`~minitron.analysis.tp_schemes.project_tp_schemes`) beside Bian et al.'s
    published one, with the relative error. ``[{over, published, predicted, error}]``."""
    from ..analysis import tp_schemes as T
    from ..analysis.published import BIAN_2021_SPEEDUPS

    model, batch = shape
    rows = {r["scheme"]: r for r in T.project_tp_schemes(model, batch, 64, T.LONGHORN if cluster is None
                                                         else cluster)}
    out = []
    for other, published in BIAN_2021_SPEEDUPS.items():
        predicted = rows["3d"]["speedup_vs"][other]
        out.append({"over": other, "published": published, "predicted": predicted,
                    "error": predicted / published - 1})
    return out


def scaling_series(model: ModelConfig, devices, batch_for=None, cluster=None) -> dict:
    """Step time of one layer for each scheme on each device count where it fits:
    ``{scheme: [(P, seconds)]}``. `batch_for(P)` gives the sequences per step (default:
    the same for every P, strong scaling; grow it with P for weak scaling)."""
    from ..analysis import tp_schemes as T

    cluster = T.LONGHORN if cluster is None else cluster
    out: dict = {s: [] for s in T.SCHEMES}
    for P in devices:
        b = batch_for(P) if batch_for else BIAN_SHAPE[1]
        for r in T.project_tp_schemes(model, b, P, cluster):
            if r["feasible"]:
                out[r["scheme"]].append((P, r["layer_s"]))
    return out


# where benchmarks/tp_schemes.py writes its results, in a checkout of the repository
TP_SCHEMES_RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "tp_schemes.md"


def read_tp_schemes_benchmark(path: str | Path = TP_SCHEMES_RESULTS) -> dict:
    """The per-device table of ``benchmarks/tp_schemes.py``'s results file (markdown):
    ``{(model, scheme): {"wire_measured", "wire_predicted" (bytes), "step_s"}}``.
    Raises ValueError naming the file when it holds no such table."""
    rows = {}
    kib = r"([\d,.]+) KiB \\?\| ([\d,.]+) KiB(?: ✗)?"  # (✗: the benchmark flags a mismatch)
    pattern = re.compile(r"^\| (\w+) \| ([\d.]+d) \| `[^`]+` \| " + kib + r" \| " + kib
                         + r" \| .*? \| ([\d.]+) ms \|$")
    for line in Path(path).read_text().splitlines():
        m = pattern.match(line)
        if m:
            model, scheme, _, _, wire_m, wire_p, ms = m.groups()
            rows[model, scheme] = {"wire_measured": 1024 * float(wire_m.replace(",", "")),
                                   "wire_predicted": 1024 * float(wire_p.replace(",", "")),
                                   "step_s": float(ms) / 1e3}
    if not rows:
        raise ValueError(f"{path}: no per-device table of benchmarks/tp_schemes.py found; run "
                         f"'python benchmarks/tp_schemes.py' to write it")
    return rows
