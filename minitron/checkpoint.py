"""Layout-independent, atomic checkpoints.

Every rank writes the shards it holds — parameter and AdamW state — each tagged with
its layout-independent name and the region of the full tensor it covers (ShardInfo).
Loading assembles full tensors from *all* shard files, whatever layout wrote them, and
slices what the new layout needs: a checkpoint from dp2·tp2·pp2 loads into tp4, one
device or a cube. Replicated copies are simply written more than once.

Atomicity: shards go into `step_N.tmp/`, which rank 0 renames to `step_N/` only after
every rank has finished; then `latest` is replaced (write aside, then rename). A crash
leaves at worst a stray `.tmp` folder (the next save removes it); `latest` always names a
complete checkpoint, also while the very step it names is saved again. `keep_last`
prunes all but the newest checkpoints.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from .config import ConfigError

STATE_KEYS = ("exp_avg", "exp_avg_sq")


def _region(p):
    return tuple((s.start, s.stop) for s in p.shard.slices)


def export_state(params, opt=None) -> dict:
    """This rank's shards: {name: {"full_shape", "region", "param", "exp_avg", "exp_avg_sq", "step"}}.
    `opt`: the optimizer (``optim.Optimizer``) whose state goes with them, or None.
    ZeRO-1/2 leave their parameter all-gather in flight after a step (it overlaps the next
    forward) and ZeRO-3 keeps parameters sharded: ``opt.materialize()`` makes them whole
    and current first (ZeRO-3 writes them back into its shard at the next step)."""
    per_param = {}
    if opt is not None:
        opt.materialize()
        per_param = opt.export_param_state()
    out = {}
    for p in params:
        info = p.shard
        rec = {"full_shape": list(info.full_shape), "region": [list(r) for r in _region(p)],
               "param": p.detach()[info.local_region].clone()}
        st = per_param.get(p, {})
        for k in STATE_KEYS:
            if k in st:
                rec[k] = st[k].detach()[info.local_region].clone()
        if "step" in st:
            rec["step"] = float(st["step"])
        out[info.name] = rec
    return out


def assemble(shard_dicts) -> dict:
    """Full tensors from shard dicts of any layout: {name: {"param": T, "exp_avg": T, ...}}."""
    full = {}
    for shards in shard_dicts:
        for name, rec in shards.items():
            slot = full.setdefault(name, {})
            region = tuple(slice(a, b) for a, b in rec["region"])
            for k in ("param",) + STATE_KEYS:
                if k in rec:
                    t = slot.setdefault(k, torch.zeros(rec["full_shape"], dtype=rec[k].dtype))
                    t[region] = rec[k]
            if "step" in rec:
                slot["step"] = rec["step"]
            slot.setdefault("regions", set()).add(tuple(map(tuple, rec["region"])))
    for name, slot in full.items():
        n = sum(_numel(r) for r in slot.pop("regions"))
        if n < slot["param"].numel():
            raise ConfigError(f"checkpoint is missing shards of '{name}': it is incomplete, save it again")
    return full


def _numel(region) -> int:
    n = 1
    for a, b in region:
        n *= b - a
    return n


def import_state(params, opt, full: dict) -> None:
    """Load full tensors into this rank's shards (and into optimizer `opt`'s state,
    when the checkpoint has it and `opt` is not None)."""
    missing = [p.shard.name for p in params if p.shard.name not in full]
    if missing:
        raise ConfigError(f"checkpoint does not match the model: no '{missing[0]}' "
                          f"(was it saved with other --layers/--hidden/--tied?)")
    if opt is not None:
        opt.materialize()  # a pending gather would overwrite what is loaded
    opt_state = {}
    for p in params:
        info, rec = p.shard, full[p.shard.name]
        if list(rec["param"].shape) != list(info.full_shape):
            raise ConfigError(f"checkpoint shape of '{info.name}' is {list(rec['param'].shape)}, the model's "
                              f"is {list(info.full_shape)}: use the model options it was saved with")
        with torch.no_grad():
            p.zero_()
            p[info.local_region] = rec["param"][info.slices].to(p.dtype)
        if opt is not None and "exp_avg" in rec:
            st = {"step": torch.tensor(rec["step"], dtype=torch.float32)}
            for k in STATE_KEYS:
                t = torch.zeros_like(p)
                t[info.local_region] = rec[k][info.slices].to(p.dtype)
                st[k] = t
            opt_state[p] = st
    if opt_state:
        opt.import_param_state(opt_state)


def _load(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, pickle garbage, ...
        raise ConfigError(f"checkpoint file {path} is corrupt or truncated ({type(e).__name__}): "
                          f"delete that step folder or resume from another") from None


def _point_latest(root: Path, name: str) -> None:
    (root / "latest.part").write_text(name)
    os.replace(root / "latest.part", root / "latest")


def _prune(root: Path, keep_last: int) -> None:
    """Remove stray `.tmp` folders of killed saves and, with `keep_last` > 0, all but the
    newest `keep_last` checkpoints (never the one `latest` names)."""
    current = root / (root / "latest").read_text().strip()
    for tmp in root.glob("step_*.tmp"):
        if tmp != current:
            shutil.rmtree(tmp, ignore_errors=True)
    done = sorted(d for d in root.glob("step_*") if d.is_dir() and d.suffix == "" and d != current)
    if keep_last > 0:
        for old in done[:max(0, len(done) - (keep_last - 1))]:
            shutil.rmtree(old, ignore_errors=True)


def save(ckpt_dir: str, step: int, tr, keep_last: int = 0) -> Path:
    """Write this rank's shards; rank 0 publishes the folder once all have written
    (and keeps only the newest `keep_last` checkpoints when it is positive)."""
    comm, rank = tr.comm, tr.comm.grid.rank
    root = Path(ckpt_dir)
    tmp, final = root / f"step_{step:07d}.tmp", root / f"step_{step:07d}"
    if rank == 0:
        if latest(ckpt_dir) == tmp:  # a crash while re-saving left `latest` on this complete .tmp
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _point_latest(root, final.name)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True, exist_ok=True)
    comm.barrier()
    part = tmp / f"rank_{rank:05d}.pt"
    torch.save(export_state(tr.params, tr.optimizer), str(part) + ".part")
    os.replace(str(part) + ".part", part)
    comm.barrier()
    if rank == 0:
        meta = {"step": step, "world": comm.grid.world, "layout": tr.layout.describe(),
                "model": tr.mcfg.__dict__, "seed": tr.tcfg.seed}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if latest(ckpt_dir) == final:  # saving the step `latest` names: never let it dangle
            _point_latest(root, tmp.name)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _point_latest(root, final.name)
        _prune(root, keep_last)
    comm.barrier()
    return final


def latest(ckpt_dir: str) -> Path | None:
    """The newest complete checkpoint folder, or None."""
    ptr = Path(ckpt_dir) / "latest"
    return Path(ckpt_dir) / ptr.read_text().strip() if ptr.exists() else None


def check(path) -> dict:
    """Open every file of checkpoint folder `path`; raise ConfigError if any is bad.
    Returns its meta. Run before any process group starts."""
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.exists():
        raise ConfigError(f"checkpoint {path} has no meta.json: it is incomplete, resume from another")
    try:
        meta = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConfigError(f"checkpoint {meta_file} is corrupt: resume from another checkpoint") from None
    if not (isinstance(meta, dict) and isinstance(meta.get("step"), int) and isinstance(meta.get("world"), int)
            and isinstance(meta.get("model"), dict) and meta["step"] >= 0 and meta["world"] >= 1):
        raise ConfigError(f"checkpoint {meta_file} lacks a valid step, world or model: it was edited or "
                          f"damaged; resume from another checkpoint")
    files = sorted(path.glob("rank_*.pt"))
    if len(files) != meta.get("world"):
        raise ConfigError(f"checkpoint {path} has {len(files)} shard files, expected {meta.get('world')}: "
                          f"it is incomplete, resume from another")
    for f in files:
        shards = _load(f)
        if not isinstance(shards, dict) or not all(
                isinstance(r, dict) and "param" in r and "region" in r and "full_shape" in r for r in shards.values()):
            raise ConfigError(f"checkpoint file {f} does not hold minitron shards: it was replaced or damaged; "
                              f"resume from another checkpoint")
    return meta


def check_model(meta: dict, m, where: str = "the checkpoint") -> None:
    """The model in checkpoint `meta` has the shape of `m`; else a ConfigError naming
    the options that differ (a checkpoint of another model must not load, then be
    overwritten, without a word). Dropout may change between runs."""
    saved = meta.get("model", {})
    mine = dict(m.__dict__)
    saved = {**saved, "ffn": saved.get("ffn") or 4 * saved.get("hidden", 0)}
    mine["ffn"] = mine.get("ffn") or 4 * mine["hidden"]
    keys = ("layers", "hidden", "heads", "seq_len", "vocab", "ffn", "tied_embeddings", "activation")
    diff = [k for k in keys if k in saved and k in mine and saved[k] != mine[k]
            and not (k == "ffn" and not meta["model"].get("ffn") and not m.ffn)]  # both 4*hidden
    if diff:
        def opts(d):
            return " ".join(f"--{k.replace('_', '-')} {d[k]}" if k != "tied_embeddings" else
                            ("--tied" if d[k] else "(untied)") for k in diff)
        raise ConfigError(f"{where} holds a model with {opts(saved)}, this run has {opts(mine)}: "
                          f"use the model options it was saved with, or another --ckpt-dir")


def load_full(path) -> dict:
    """Assemble the full state of checkpoint folder `path`."""
    return assemble(_load(f) for f in sorted(Path(path).glob("rank_*.pt")))


def load_latest(ckpt_dir: str, tr) -> int:
    """Load the newest checkpoint of `ckpt_dir` into trainer `tr`; returns its step (0 if none)."""
    path = latest(ckpt_dir)
    if path is None:
        return 0
    meta = check(path)
    check_model(meta, tr.mcfg, f"checkpoint {path}")
    import_state(tr.params, tr.optimizer, load_full(path))
    tr.step_idx = meta["step"]
    return meta["step"]


def gather_full(tr) -> dict | None:
    """Every rank's shards assembled into full tensors on rank 0 (None elsewhere)."""
    shards = tr.comm.gather_object(export_state(tr.params, tr.optimizer))
    return assemble(shards) if shards is not None else None
