"""Checkpoints in PyTorch's distributed checkpoint format (DCP), the format torchtitan and
Megatron-Core read and write (``torch.distributed.checkpoint``).

A step folder in this format holds DCP's own files (``.metadata`` and one ``__R_0.distcp``
per rank) beside minitron's ``meta.json``, which carries what DCP does not: the model's
description, the run's settings and the SHA-256 of every DCP file. Publishing, pruning,
`latest`, the lock and ``check-ckpt`` are the engine's, exactly as for its own format
(`checkpoint.py`): only what is inside the step folder differs.

The state dict's keys are the parameters' names in the single-device module (their
``state_dict`` keys, FQN below), with the full shapes, so ``dcp.load(model.state_dict(),
checkpoint_id=DIR)`` fills a plain single-device GPT, and any layout reads any other
layout's save (meta.json's ``dcp_keys`` maps each FQN to the engine's parameter name):

* ``FQN``                       the parameter,
* ``optimizer/FQN/exp_avg``     AdamW's first moment (same shape),
* ``optimizer/FQN/exp_avg_sq``  its second moment,
* ``optimizer/FQN/step``        its step count (a 0-d tensor).

A region held by several ranks (replicas over dp, tp's replicated norms, ...) is written
once, by the lowest rank holding it; a tensor split over ranks is a ``ShardedTensor``
whose shards are the ranks' regions, so DCP's metadata records how the chunks tile it.
"""
from __future__ import annotations

import hashlib
import math
import re
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .config import ConfigError

DCP_FILE = re.compile(r"__\d+_\d+\.distcp|\.metadata")
STATE_KEYS = ("exp_avg", "exp_avg_sq")
OPT = "optimizer/"


def state_key(fqn: str, what: str) -> str:
    """The DCP key of parameter `fqn`'s `what` ("param", "exp_avg", "exp_avg_sq", "step")."""
    return fqn if what == "param" else f"{OPT}{fqn}/{what}"


def module_names(chunks) -> dict:
    """{engine name: FQN} of the parameters of this rank's model chunks. A stage's chunk
    names its blocks by their global index, so FQNs are the single-device module's; a
    tensor that a stage holds under another attribute (the last stage's copy of a tied
    embedding) keeps the FQN equal to its engine name."""
    out = {}
    for chunk in chunks:
        for fqn, p in chunk.named_parameters():
            name = p.shard.name
            if out.get(name) != name:
                out[name] = fqn
    return out


def _all_regions(shards: dict, fqns: dict, world: int) -> list[dict]:
    """Every rank's {name: (region, full_shape, FQN)} (metadata only: names and bounds)."""
    mine = {n: (tuple(map(tuple, r["region"])), tuple(r["full_shape"]), fqns[n]) for n, r in shards.items()}
    if world == 1:
        return [mine]
    out = [None] * world
    dist.all_gather_object(out, mine)
    return out


def _keys(regions: list[dict]) -> dict:
    """{engine name: FQN}, the same on every rank (an FQN equal to the name preferred)."""
    out = {}
    for held in regions:
        for name, (_, _, fqn) in held.items():
            if out.get(name) != name:
                out[name] = fqn if name not in out or fqn == name else min(out[name], fqn)
    return out


def _owners(regions: list[dict]) -> dict:
    """{(name, region): lowest rank holding it}; a region that partly overlaps another of
    the same tensor is an engine bug (the layouts split tensors into equal or disjoint blocks)."""
    owner, by_name = {}, {}
    for rank, held in enumerate(regions):
        for name, (region, *_) in held.items():
            owner.setdefault((name, region), rank)
            by_name.setdefault(name, set()).add(region)
    for name, regs in by_name.items():
        regs = sorted(regs)
        for i, a in enumerate(regs):
            for b in regs[i + 1:]:
                if _overlap(a, b):
                    raise ConfigError(f"internal error: the shards of '{name}' overlap ({a} and {b})")
    return owner


def _overlap(a, b) -> bool:
    return all(x0 < y1 and y0 < x1 for (x0, x1), (y0, y1) in zip(a, b))


def _sharded(full_shape, pieces: list):
    """A ShardedTensor of `what` from this rank's `pieces` [(region, tensor)] (collective)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    rank = dist.get_rank()
    local = [Shard(t.contiguous(), ShardMetadata([a for a, _ in region], [b - a for a, b in region],
                                                  f"rank:{rank}/{t.device}")) for region, t in pieces]
    return init_from_local_shards(local, list(full_shape))


def state_dict_of(shards: dict, fqns: dict, world: int) -> tuple[dict, dict]:
    """The DCP state dict of this rank's `shards` (``checkpoint.export_state``'s records,
    `fqns` from :func:`module_names`) and {FQN: engine name}. Collective when `world` > 1:
    every rank calls it."""
    regions = _all_regions(shards, fqns, world)
    owner, key = _owners(regions), _keys(regions)
    rank = dist.get_rank() if world > 1 else 0
    state = {}
    split = sorted({n for held in regions for n, (reg, full, _) in held.items()
                    if reg != tuple((0, d) for d in full)})
    for name, rec in shards.items():  # whole tensors: plain; DCP writes a replicated key once
        if name in split:
            continue
        for what in ("param",) + STATE_KEYS:
            if what in rec:
                state[state_key(key[name], what)] = rec[what]
        if "step" in rec:
            state[state_key(key[name], "step")] = torch.tensor(rec["step"], dtype=torch.float64)
    full_of = {n: full for held in regions for n, (_, full, _) in held.items()}
    whats = [w for w in ("param",) + STATE_KEYS if any(w in r for r in shards.values())] if shards else ["param"]
    whats = _agree_whats(whats, world)
    for name in split:  # the same order on every rank: each ShardedTensor is a collective
        rec = shards.get(name)
        mine = rec is not None and owner[(name, tuple(map(tuple, rec["region"])))] == rank
        for what in whats:
            pieces = [(tuple(map(tuple, rec["region"])), rec[what])] if mine and what in rec else []
            state[state_key(key[name], what)] = _sharded(full_of[name], pieces)
        if rec is not None and "step" in rec:
            state[state_key(key[name], "step")] = torch.tensor(rec["step"], dtype=torch.float64)
    return state, {fqn: name for name, fqn in key.items()}


def _agree_whats(whats: list, world: int) -> list:
    """The tensors per parameter every rank writes (optimizer state or not), agreed."""
    if world == 1:
        return whats
    out = [None] * world
    dist.all_gather_object(out, whats)
    return max(out, key=len)


def write(tmp: Path, rank: int, shards: dict, fqns: dict, world: int) -> dict:
    """Save this rank's `shards` into folder `tmp` with DCP (collective); returns this rank's
    summary for meta.json: its DCP files' checksums and sizes (rank 0 adds ``.metadata``
    and the {FQN: engine name} map, ``dcp_keys``)."""
    state, names = state_dict_of(shards, fqns, world)
    with warnings.catch_warnings():  # one process: DCP warns that no process group is used
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp), single_file_per_rank=True),
                 no_dist=world == 1)
    if world > 1:
        dist.barrier()
    files = [f"__{rank}_0.distcp"] + ([".metadata"] if rank == 0 else [])
    return {"files": {n: {"sha256": file_sha256(tmp / n), "bytes": (tmp / n).stat().st_size}
                      for n in files if (tmp / n).exists()}, **({"dcp_keys": names} if rank == 0 else {})}


def file_sha256(path: Path) -> str:
    """The file's SHA-256, read in 4 MiB blocks (a shard can be larger than memory allows twice)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def is_dcp(path: Path) -> bool:
    """Whether step folder `path` was written in DCP."""
    return (Path(path) / ".metadata").exists()


def read_metadata(path: Path):
    """DCP's metadata of step folder `path` ({key: tensor size and chunks}), or ConfigError."""
    try:
        return dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # truncated or replaced .metadata
        raise ConfigError(f"checkpoint {path}/.metadata is corrupt ({type(e).__name__}): it was damaged; "
                          f"resume from another checkpoint") from None


def check_tiling(path: Path, md) -> dict:
    """Every tensor's chunks tile it exactly once (no gap, no overlap); returns
    {key: (size, dtype)}. A crafted size larger than the files is refused before anything
    is allocated (the chunks' elements must add up to the tensor's)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = {}
    for key, m in md.state_dict_metadata.items():
        if not isinstance(m, TensorStorageMetadata):
            raise ConfigError(f"checkpoint {path} holds '{key}', which is not a tensor: not a minitron "
                              f"checkpoint; resume from another")
        size = list(m.size)
        chunks = [(list(c.offsets), list(c.sizes)) for c in m.chunks]
        for off, sz in chunks:
            if len(off) != len(size) or any(o < 0 or s < 0 or o + s > d for o, s, d in zip(off, sz, size)):
                raise ConfigError(f"checkpoint {path}: a chunk of '{key}' lies outside its shape {size}: it was "
                                  f"edited or damaged; resume from another checkpoint")
        regions = [tuple((o, o + s) for o, s in zip(off, sz)) for off, sz in chunks]
        for i, a in enumerate(regions):
            if any(_overlap(a, b) for b in regions[i + 1:]):
                raise ConfigError(f"checkpoint {path}: two chunks of '{key}' overlap: it was edited or "
                                  f"damaged; resume from another checkpoint")
        if sum(math.prod(s) for _, s in chunks) != math.prod(size):
            raise ConfigError(f"checkpoint {path} is missing chunks of '{key}': it is incomplete, resume "
                              f"from another checkpoint")
        out[key] = (size, m.properties.dtype)
    return out


def load_full(path: Path, names: dict) -> dict:
    """The full state of DCP step folder `path` in ``checkpoint.assemble``'s form:
    {name: {"param": T, "exp_avg": T, "exp_avg_sq": T, "step": float}}, `names` mapping
    its FQNs to engine names (meta.json's ``dcp_keys``). Reads without a process group
    (every rank reads what it needs itself)."""
    layout = check_tiling(path, read_metadata(path))
    state = {k: torch.zeros(size, dtype=dtype) for k, (size, dtype) in layout.items()}
    with warnings.catch_warnings():  # DCP warns that no process group is used: that is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    full = {}
    for key, t in state.items():
        fqn, what = key[len(OPT):].rsplit("/", 1) if key.startswith(OPT) else (key, "param")
        if fqn not in names:
            raise ConfigError(f"checkpoint {path} holds '{fqn}', which its meta.json does not name: it was "
                              f"edited; resume from another checkpoint")
        full.setdefault(names[fqn], {})[what] = float(t) if what == "step" else t
    for name, rec in full.items():
        if "param" not in rec:
            raise ConfigError(f"checkpoint {path} has optimizer state of '{name}' but not the parameter: it "
                              f"is incomplete, resume from another checkpoint")
    return full
