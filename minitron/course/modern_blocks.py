"""The rank job of the modern-blocks lesson (lesson 10): one launch of 4 ranks that

* trains one traced float64 step of a small Llama under ``--tp 4`` with 4, 2 and 1
  key/value heads (split, replicated on 2 ranks, replicated on all 4) and records each
  rank's key/value rows, its calls per axis and the loss;
* runs ring and all-to-all (Ulysses) context parallelism, ``--cp 4``, on the same model:
  the 'cp' calls of a traced step, the loss, and the time of a few more steps;
* records the global positions each context rank's rotary angles use;
* loads a Hugging Face Llama directory (``init_from``) into ``--tp 4`` and records the
  first loss and each rank's share of the key/value weight.

It lives in a module because every rank is a fresh process that imports it by name.
"""
from __future__ import annotations

import time

from ..comm import Comm, CommTrace
from ..config import ModelConfig, ParallelConfig, TrainConfig
from ..grid import ProcessGrid

# A small Llama: RMSNorm, SwiGLU, rotary positions, grouped-query attention, no biases.
LLAMA = ModelConfig(layers=2, hidden=64, heads=8, kv_heads=2, ffn=128, seq_len=64, vocab=256, name="llama-lesson",
                    norm="rmsnorm", activation="swiglu", positions="rope", bias=False, tied_embeddings=False)
KV_CASES = (4, 2, 1)  # under --tp 4: one kv head per rank, each on 2 ranks, one on all 4
CP_MODES = ("ring", "a2a")
TIMED_STEPS = 2


def train_config(**kw) -> TrainConfig:
    """One sequence per step, float64 (the single-device comparison is exact to rounding)."""
    return TrainConfig(global_batch=1, dtype="float64", progress=False, eval_every=0, **kw)


def _comm(layout: ParallelConfig, rank: int, trace: bool = True) -> Comm:
    grid = ProcessGrid(tp=layout.tp, dp=layout.dp, pp=layout.pp, cp=layout.cp, rank=rank).build_groups()
    return Comm(grid, CommTrace() if trace else None)


def _by_axis(records) -> dict:
    """{(axis, op): [calls, bytes]} of a trace."""
    out: dict = {}
    for r in records:
        acc = out.setdefault((r["axis"], r["op"]), [0, 0])
        acc[0] += 1
        acc[1] += r["bytes"]
    return out


def _kv_rows(trainer) -> dict:
    """This rank's rows of layer 0's key/value weight: (first, stop) of the full weight."""
    for p in trainer.params:
        if p.shard.name == "blocks.0.attn.kv.weight":
            rows = p.shard.slices[0]
            return {"rows": (rows.start, rows.stop), "shape": tuple(p.shape), "replicas": p.shard.replicas}
    return {}


def modern_blocks_job(comm, hf_dir: str) -> dict:
    """On each of 4 ranks: the lesson's runs (see the module docstring)."""
    from ..data import load_corpus
    from ..parallel.context_parallel import local_positions
    from ..train import Trainer

    corpus, rank = load_corpus(""), comm.grid.rank
    out: dict = {"rank": rank, "kv": {}, "cp": {}}
    for kv in KV_CASES:
        layout = ParallelConfig(tp=4)
        c = _comm(layout, rank)
        tr = Trainer(LLAMA.replace(kv_heads=kv), layout, train_config(), c, corpus)
        loss = tr.step(0)
        out["kv"][kv] = {"loss": loss, "calls": _by_axis(c.trace.records), **_kv_rows(tr)}
    for mode in CP_MODES:
        layout = ParallelConfig(cp=4, cp_mode=mode)
        c = _comm(layout, rank)
        tr = Trainer(LLAMA, layout, train_config(), c, corpus)
        loss = tr.step(0)
        calls = _by_axis(c.trace.records)
        comm.barrier()  # the ranks start the clock together
        t0 = time.perf_counter()
        for i in range(1, 1 + TIMED_STEPS):
            tr.step(i)
        out["cp"][mode] = {"loss": loss, "calls": calls, "seconds_per_step": (time.perf_counter() - t0) / TIMED_STEPS}
        if mode == "ring":
            out["positions"] = local_positions(LLAMA.seq_len // 4, c).tolist()
    from ..hf import model_config
    hf_model = model_config(hf_dir)
    layout = ParallelConfig(tp=4)
    c = _comm(layout, rank)
    tr = Trainer(hf_model, layout, train_config(init_from=hf_dir), c, corpus)
    out["hf"] = {"loss": tr.step(0), **_kv_rows(tr)}
    return out
