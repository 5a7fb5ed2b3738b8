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

Nothing wrong is published or loaded without a word:

* every shard file's SHA-256 (and size) is in `meta.json`; :func:`check` verifies them, the
  shards' structure (regions inside their tensor, all of a tensor covered, optimizer state
  complete) and that every parameter is finite before anything is assembled
  (``minitron check-ckpt`` runs it on a folder without training);
* a save whose model is not finite, or that a rank could not write (a full disk, a file
  larger than the machine's file-size limit), is not published: its `.tmp` folder is
  removed and every rank raises the same one-line error naming the cause;
* `latest` must name a step folder inside the checkpoint folder;
* :class:`FolderLock` keeps a second run out of a folder that a run is writing; the lock is
  the kernel's (``flock``), so it dies with its process, and a lock file left by a killed run
  is recognised as stale and named.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import io
import json
import math
import os
import re
import resource
import shutil
import socket
from pathlib import Path

import torch

from . import data as data_mod
from . import dcp_format
from .config import ConfigError

STATE_KEYS = ("exp_avg", "exp_avg_sq")
FORMAT = 2  # meta.json with per-file checksums ("files") and the run's settings ("train")
STEP_DIR = re.compile(r"step_\d{7,}(\.tmp)?")  # the only folders the engine creates (and deletes)
SHARD_FILE = re.compile(r"rank_\d{5,}\.(pt|pt\.part|json)")
LOCK_FILE = "lock"


class NonFiniteModel(ConfigError):
    """A save found non-finite parameters: nothing is published (the run stops there)."""


def is_step_dir(path: Path) -> bool:
    """A folder the engine wrote: named step_NNNNNNN[.tmp] and holding only its own files
    (shards, their checksums, meta.json). Anything else is never deleted by the engine."""
    path = Path(path)
    if not (STEP_DIR.fullmatch(path.name) and path.is_dir() and not path.is_symlink()):
        return False
    return all(SHARD_FILE.fullmatch(f.name) or dcp_format.DCP_FILE.fullmatch(f.name) or f.name == "meta.json"
               for f in path.iterdir())


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
        problem = tiling_problem(name, list(slot["param"].shape), slot.pop("regions"))
        if problem:
            raise ConfigError(f"checkpoint {problem}: it is damaged, save it again or resume from another")
    return full


def _numel(region) -> int:
    n = 1
    for a, b in region:
        n *= b - a
    return n


def tiling_problem(name: str, shape, regions) -> str:
    """'' when the distinct `regions` of tensor `name` tile its `shape` exactly once (a
    replica writes the same region again, which is no overlap), else what is wrong: two
    regions that overlap, or the elements no region covers. Resume (:func:`assemble`) and
    :func:`check` (``minitron check-ckpt``) ask this one question, so they accept the same."""
    boxes = sorted({tuple(map(tuple, r)) for r in regions})
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if all(max(x0, y0) < min(x1, y1) for (x0, x1), (y0, y1) in zip(a, b)):
                return (f"has overlapping shards of '{name}' (regions {_box(a)} and {_box(b)} share elements; "
                        f"the shards must tile it exactly once)")
    n, total = sum(_numel(r) for r in boxes), math.prod(shape)
    if n < total:
        return f"is missing shards of '{name}' ({total - n:,} of its {total:,} elements in no shard)"
    return ""


def _box(region) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in region) + "]"


def import_state(params, opt, full: dict, fresh_ok: bool = False) -> None:
    """Load full tensors into this rank's shards (and into optimizer `opt`'s state,
    when the checkpoint has it and `opt` is not None). A parameter the checkpoint lacks, or
    holds in another shape, is refused; with `fresh_ok` (a model change the user allowed,
    named before the ranks started) it keeps its fresh initial value and fresh state."""
    missing = [p.shard.name for p in params if p.shard.name not in full]
    if missing and not fresh_ok:
        raise ConfigError(f"checkpoint does not match the model: it has no '{missing[0]}' "
                          f"({len(missing)} tensor(s) missing): use the model it was saved with")
    if opt is not None:
        opt.materialize()  # a pending gather would overwrite what is loaded
    opt_state = {}
    for p in params:
        info, rec = p.shard, full.get(p.shard.name)
        if rec is None:
            continue
        if list(rec["param"].shape) != list(info.full_shape):
            if fresh_ok:
                continue
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


def _load(path: Path, data: bytes | None = None) -> dict:
    try:
        src = io.BytesIO(data) if data is not None else path
        return torch.load(src, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, pickle garbage, ...
        raise ConfigError(f"checkpoint file {path} is corrupt or truncated ({type(e).__name__}): "
                          f"delete that step folder or resume from another") from None


def _point_latest(root: Path, name: str) -> None:
    (root / "latest.part").write_text(name)
    os.replace(root / "latest.part", root / "latest")


def _prune(root: Path, keep_last: int) -> None:
    """Remove stray `.tmp` folders of killed saves and, with `keep_last` > 0, all but the
    newest `keep_last` checkpoints (never the one `latest` names). Only the engine's own
    step folders (`is_step_dir`) are ever removed."""
    current = latest(str(root))
    mine = [d for d in root.iterdir() if is_step_dir(d) and d != current]
    for tmp in (d for d in mine if d.suffix == ".tmp"):
        shutil.rmtree(tmp, ignore_errors=True)
    done = sorted(d for d in mine if d.suffix == "")
    if keep_last > 0:
        for old in done[:max(0, len(done) - (keep_last - 1))]:
            shutil.rmtree(old, ignore_errors=True)


def _shard_summary(shards: dict) -> dict:
    """What a rank reports about the shards it wrote (merged into meta.json by rank 0)."""
    bad = next((n for n, r in shards.items() if not all(
        bool(torch.isfinite(r[k]).all()) for k in ("param",) + STATE_KEYS if k in r)), None)
    return {"records": len(shards), "with_state": sum(all(k in r for k in STATE_KEYS) for r in shards.values()),
            "nonfinite": bad}


def _free_space(path: Path) -> str:
    try:
        return f"{shutil.disk_usage(path).free / 2**20:,.1f} MiB free"
    except OSError:
        return "free space unknown"


def file_size_limit() -> int | None:
    """This process's file-size limit in bytes (RLIMIT_FSIZE, ``ulimit -f``), None when
    unlimited. Past it a write fails with EFBIG (Python ignores SIGXFSZ, which would kill it)."""
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def _write_shard(tmp: Path, rank: int, shards: dict) -> None:
    """Write this rank's shard file and its summary (checksum, size, finiteness), or, when
    the disk refuses, the reason (a summary with "error"), so that rank 0 can say which rank
    failed and why instead of a peer's "connection closed"."""
    part = tmp / f"rank_{rank:05d}.pt"
    side = tmp / f"rank_{rank:05d}.json"
    try:
        with open(str(part) + ".part", "wb") as f:  # a Python file: the OS error comes back with its reason
            torch.save(shards, f)
        os.replace(str(part) + ".part", part)
        info = {"file": part.name, "sha256": dcp_format.file_sha256(part), "bytes": part.stat().st_size,
                **_shard_summary(shards)}
    except (OSError, RuntimeError) as e:  # torch's writer wraps the file's OSError in a RuntimeError
        cause = e if isinstance(e, OSError) else e.__context__ if isinstance(e.__context__, OSError) else None
        if cause is None and not isinstance(e, OSError) and not any(w in str(e) for w in ("inline_container", "resize")):
            raise
        Path(str(part) + ".part").unlink(missing_ok=True)
        part.unlink(missing_ok=True)
        why = cause.strerror if cause is not None and cause.strerror else "a write failed"
        limit = file_size_limit()
        if limit is not None and (cause is not None and cause.errno == errno.EFBIG or "resize" in str(e)):
            info = {"error": f"rank {rank} could not write its shard into {tmp}: it is larger than this machine's "
                             f"file-size limit (ulimit -f: {limit:,} bytes)",
                    "fix": "raise the limit (ulimit -f unlimited) and resume from the last checkpoint"}
        else:
            info = {"error": f"rank {rank} could not write its shard into {tmp} ({why}; {_free_space(tmp)})"}
    try:
        side.write_text(json.dumps(info))
    except OSError:
        pass  # rank 0 finds no summary and reports this rank


def _write_dcp(tmp: Path, rank: int, shards: dict, fqns: dict, world: int) -> None:
    """`_write_shard` for the DCP format (``--ckpt-format dcp``): every rank takes part in
    DCP's collective save, then writes its summary (its files' checksums) or the reason the
    save failed."""
    side = tmp / f"rank_{rank:05d}.json"
    try:
        info = {**dcp_format.write(tmp, rank, shards, fqns, world), **_shard_summary(shards)}
    except Exception as e:  # DCP wraps a rank's OSError (a full disk) in a CheckpointException
        why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        info = {"error": f"rank {rank} could not write its part of the DCP checkpoint into {tmp} ({why}; "
                         f"{_free_space(tmp)})"}
    try:
        side.write_text(json.dumps(info))
    except OSError:
        pass


def _verdict(tmp: Path, world: int, step: int, lr: float) -> tuple[str, str] | dict:
    """Rank 0, after every rank has written: the files' summaries, or (kind, message) when
    the checkpoint must not be published (a rank that could not write, a non-finite model)."""
    infos = []
    for r in range(world):
        try:
            infos.append(json.loads((tmp / f"rank_{r:05d}.json").read_text()))
        except (OSError, json.JSONDecodeError):
            return "disk", (f"rank {r} could not write its shard into {tmp} ({_free_space(tmp)}): free some "
                            f"space (or point --ckpt-dir elsewhere) and resume from the last checkpoint")
    for info in infos:
        if "error" in info:
            return "disk", f"{info['error']}: " + info.get("fix", "free some space (or point --ckpt-dir elsewhere) "
                                                                  "and resume from the last checkpoint")
    for r, info in enumerate(infos):
        if info["nonfinite"]:
            return "nonfinite", (f"the parameters are not finite after step {step} ('{info['nonfinite']}' on rank "
                                 f"{r}): training diverged, so it was not saved; lower --lr (it is {lr:g}) "
                                 f"or resume from {_last_words(tmp.parent)}")
    return {"infos": infos}


def _last_words(root: Path) -> str:
    try:
        now = latest(str(root))
    except ConfigError:
        now = None
    return f"the last checkpoint, {now}" if now is not None else "an earlier checkpoint (this folder has none)"


def _agree(comm, root: Path, step: int, verdict) -> str:
    """Rank 0's verdict on every rank, through the process group's key-value store (the
    rendezvous' control channel, as preemption.py uses it: no byte of training traffic)."""
    if comm.grid.world == 1:
        return verdict
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    key = f"minitron/save/{os.path.realpath(root)}/{step}"
    if comm.grid.rank == 0:
        store.set(key, verdict)
    comm.barrier()
    return store.get(key).decode()


def save(ckpt_dir: str, step: int, tr, keep_last: int = 0) -> Path:
    """Write this rank's shards; rank 0 publishes the folder once all have written
    (and keeps only the newest `keep_last` checkpoints when it is positive). Nothing is
    published when a rank could not write or the model is not finite: every rank raises
    the same one-line error (NonFiniteModel for the latter) and the `.tmp` folder goes."""
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
    if tr.tcfg.ckpt_format == "dcp":
        _write_dcp(tmp, rank, export_state(tr.params, tr.optimizer), dcp_format.module_names(tr.chunks),
                   comm.grid.world)
    else:
        _write_shard(tmp, rank, export_state(tr.params, tr.optimizer))
    comm.barrier()
    verdict = "ok"
    if rank == 0:
        res = _verdict(tmp, comm.grid.world, step, tr.tcfg.lr)
        if isinstance(res, tuple):
            shutil.rmtree(tmp, ignore_errors=True)
            verdict = ":".join(res)
        else:
            try:
                _publish(root, tmp, final, step, tr, res["infos"])
                _prune(root, keep_last)
            except OSError as e:  # meta.json or `latest` refused by the disk: say so on every rank
                shutil.rmtree(tmp, ignore_errors=True)
                verdict = (f"disk:rank 0 could not publish the checkpoint in {root} ({e.strerror or type(e).__name__}; "
                           f"{_free_space(root)}): free some space and resume from the last checkpoint")
    verdict = _agree(comm, root, step, verdict)
    if verdict != "ok":
        kind, message = verdict.split(":", 1)
        raise (NonFiniteModel if kind == "nonfinite" else ConfigError)(message)
    comm.barrier()
    return final


def _publish(root: Path, tmp: Path, final: Path, step: int, tr, infos: list[dict]) -> None:
    """Rank 0: meta.json (checksums, the model, the run's settings), then the renames."""
    tc = tr.tcfg
    tokens = len(tr.train_data) if hasattr(tr, "train_data") else None
    meta = {"format": FORMAT, "step": step, "world": tr.comm.grid.world, "layout": tr.layout.describe(),
            "model": model_record(tr.mcfg), "seed": tc.seed,
            "train": {**{k: getattr(tc, k) for k in RESUME_EXACT if k != "data_tokens"},
                      "data_tokens": tokens, "steps": tc.steps, "microbatches": tc.microbatches},
            "data": data_mod.position(tc, tr.mcfg.seq_len, tokens, step),
            "optimizer_state": "all" if all(i["records"] == i["with_state"] for i in infos) else "partial",
            "ckpt_format": tc.ckpt_format, "files": _files(infos),
            **({"dcp_keys": infos[0]["dcp_keys"]} if "dcp_keys" in infos[0] else {})}
    for r in range(len(infos)):
        (tmp / f"rank_{r:05d}.json").unlink(missing_ok=True)
    (tmp / ".metadata.tmp").unlink(missing_ok=True)
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    if latest(str(root)) == final:  # saving the step `latest` names: never let it dangle
        _point_latest(root, tmp.name)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _point_latest(root, final.name)


def _files(infos: list[dict]) -> dict:
    """meta.json's {file: {sha256, bytes}} from the ranks' summaries (one shard file each,
    or a rank's DCP files)."""
    out = {}
    for i in infos:
        out.update(i["files"] if "files" in i else {i["file"]: {"sha256": i["sha256"], "bytes": i["bytes"]}})
    return out


# The run's settings that a resume must keep for the continued run to equal an uninterrupted
# one (the batches are a pure function of seed, step and the corpus; the update of the
# schedule, the clipping and the dtype). --steps may grow (that is what a resume is for),
# and the layout may change: checkpoints are layout-independent.
RESUME_EXACT = ("seed", "global_batch", "data", "data_tokens", "dtype", "lr", "min_lr", "warmup",
                "weight_decay", "clip")


def latest(ckpt_dir: str) -> Path | None:
    """The newest complete checkpoint folder, or None. `latest` must name a step folder
    inside `ckpt_dir` (a pointer edited to lead elsewhere is refused, not followed)."""
    ptr = Path(ckpt_dir) / "latest"
    if not ptr.exists():
        return None
    try:
        name = ptr.read_text().strip()
    except (OSError, UnicodeDecodeError):
        name = "?"
    path = Path(ckpt_dir) / name
    inside = os.path.realpath(path).startswith(os.path.realpath(ckpt_dir) + os.sep)
    if not (STEP_DIR.fullmatch(name) and inside):
        raise ConfigError(f"{ptr} names '{name[:80]}', not a step folder inside {ckpt_dir}: it was edited or "
                          f"damaged; write the name of one of its step_NNNNNNN folders into it")
    return path


def check(path, verify_data: bool = True, tensor_shapes: dict | None = None) -> dict:
    """Open every file of checkpoint folder `path`; raise ConfigError if any is bad.
    Returns its meta. Run before any process group starts. Verifies each shard file's
    SHA-256 and size against meta.json, and (`verify_data`) the shards' structure, that
    they tile every tensor exactly once (:func:`tiling_problem`) and that every tensor is
    finite, without assembling anything; `tensor_shapes` (a dict) receives {name: full shape}."""
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
    data = meta.get("data")  # the data position (data.position); absent in checkpoints of an older minitron
    if data is not None and not (isinstance(data, dict) and data.get("step") == meta["step"]
                                 and set(data_mod.POSITION_FLAGS) <= set(data)):
        raise ConfigError(f"checkpoint {meta_file} states a data position that is not its step {meta['step']}'s "
                          f"(or lacks its fields): it was edited or damaged; resume from another checkpoint")
    if meta.get("ckpt_format") == "dcp":
        _check_dcp(path, meta, verify_data, tensor_shapes)
        return meta
    files = sorted(path.glob("rank_*.pt"))
    if len(files) != meta.get("world"):
        raise ConfigError(f"checkpoint {path} has {len(files)} shard files, expected {meta.get('world')}: "
                          f"it is incomplete, resume from another")
    sums = meta.get("files")
    if not isinstance(sums, dict) or sorted(sums) != [f.name for f in files]:
        raise ConfigError(f"checkpoint {meta_file} has no checksums for its shard files (written by an older "
                          f"minitron, or edited): it cannot be verified; resume from another checkpoint")
    shapes, covered = {}, {}
    for f in files:
        data = f.read_bytes()
        want = sums[f.name]
        if not isinstance(want, dict) or len(data) != want.get("bytes") or \
                hashlib.sha256(data).hexdigest() != want.get("sha256"):
            raise ConfigError(f"checkpoint file {f} does not match its checksum in meta.json "
                              f"({len(data):,} bytes now, {_count(want)} written): it was damaged or replaced; "
                              f"resume from another checkpoint")
        shards = _load(f, data)
        if verify_data:
            _check_shards(f, shards, meta.get("optimizer_state") == "all", shapes, covered)
    for name, regions in covered.items():
        problem = tiling_problem(name, shapes[name], regions)
        if problem:
            raise ConfigError(f"checkpoint {path} {problem}: it is damaged or incomplete; resume from another "
                              f"checkpoint")
    if tensor_shapes is not None:
        tensor_shapes.update(shapes)
    return meta


def _check_dcp(path: Path, meta: dict, verify_data: bool, tensor_shapes: dict | None = None) -> None:
    """`check` for a DCP step folder: every DCP file present and equal to its checksum, the
    chunks of every tensor tiling it exactly once, optimizer state whole, values finite."""
    sums = meta.get("files")
    files = sorted(f.name for f in path.iterdir() if dcp_format.DCP_FILE.fullmatch(f.name))
    if not isinstance(sums, dict) or sorted(sums) != files or ".metadata" not in files:
        raise ConfigError(f"checkpoint {path} does not hold the DCP files its meta.json lists "
                          f"({len(files)} found, {len(sums) if isinstance(sums, dict) else 0} listed): it is "
                          f"incomplete or was edited; resume from another checkpoint")
    for name in files:
        f, want = path / name, sums[name]
        if (not isinstance(want, dict) or f.stat().st_size != want.get("bytes")
                or dcp_format.file_sha256(f) != want.get("sha256")):
            raise ConfigError(f"checkpoint file {f} does not match its checksum in meta.json: it was damaged or "
                              f"replaced; resume from another checkpoint")
    layout = dcp_format.check_tiling(path, dcp_format.read_metadata(path))
    if tensor_shapes is not None:
        names = _dcp_keys(path, meta)
        tensor_shapes.update({names[k]: list(size) for k, (size, _) in layout.items() if k in names})
    stored = sum(sums[n]["bytes"] for n in files)
    need = sum(math.prod(size) * torch.empty((), dtype=dt).element_size() for size, dt in layout.values())
    if need > stored:
        raise ConfigError(f"checkpoint {path} declares {need:,} bytes of tensors in {stored:,} bytes of files: "
                          f"it was edited or damaged; resume from another checkpoint")
    if verify_data:
        _check_full(path, dcp_format.load_full(path, _dcp_keys(path, meta)), meta.get("optimizer_state") == "all")


def _dcp_keys(path: Path, meta: dict | None = None) -> dict:
    """A DCP checkpoint's {FQN: engine name} from its meta.json."""
    if meta is None:
        try:
            meta = json.loads((path / "meta.json").read_text())
        except (OSError, ValueError):
            raise ConfigError(f"checkpoint {path} has no readable meta.json: resume from another") from None
    keys = meta.get("dcp_keys")
    if not isinstance(keys, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in keys.items()):
        raise ConfigError(f"checkpoint {path}/meta.json lacks the DCP key names (dcp_keys): it was edited; "
                          f"resume from another checkpoint")
    return keys


def _check_full(path: Path, full: dict, all_state: bool) -> None:
    """A DCP checkpoint's assembled tensors: optimizer state whole where the run had it, all finite."""
    for name, rec in full.items():
        has = [k for k in STATE_KEYS + ("step",) if k in rec]
        if has and len(has) != 3 or (all_state and not has):
            raise ConfigError(f"checkpoint {path}: '{name}' lacks optimizer state: it is incomplete, resume from "
                              f"another checkpoint")
        for k in ("param",) + STATE_KEYS:
            if k in rec and rec[k].is_floating_point() and not bool(torch.isfinite(rec[k]).all()):
                raise ConfigError(f"checkpoint {path} holds non-finite values in '{name}' ({k}): the model had "
                                  f"diverged when it was saved; resume from an earlier checkpoint")


def _count(want) -> str:
    n = want.get("bytes") if isinstance(want, dict) else None
    return f"{n:,}" if isinstance(n, int) else "?"


def _check_shards(f: Path, shards, all_state: bool, shapes: dict, covered: dict) -> None:
    """The structure of one shard file: every record's region inside its full shape and the
    shape of its tensors, optimizer state whole (both moments and the step, or none), the
    same full shape in every file, every value finite. `covered` collects the regions per
    name (their tiling is checked without allocating anything from a crafted full shape)."""
    def bad(why):
        return ConfigError(f"checkpoint file {f} does not hold valid minitron shards ({why}): it was "
                           f"replaced or damaged; resume from another checkpoint")

    if not isinstance(shards, dict) or not all(
            isinstance(r, dict) and "param" in r and "region" in r and "full_shape" in r for r in shards.values()):
        raise bad("no param, region or full shape")
    for name, rec in shards.items():
        full, region = rec["full_shape"], rec["region"]
        if not (isinstance(full, list) and all(isinstance(d, int) and d >= 0 for d in full)
                and isinstance(region, list) and len(region) == len(full)
                and all(isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) for x in r)
                        and 0 <= r[0] <= r[1] <= d for r, d in zip(region, full))):
            raise bad(f"'{name}' has a region outside its shape")
        if shapes.setdefault(name, full) != full:
            raise bad(f"'{name}' has shape {full} here and {shapes[name]} in another file")
        size = [b - a for a, b in region]
        has = [k for k in STATE_KEYS + ("step",) if k in rec]
        if has and len(has) != 3 or (all_state and not has):
            raise bad(f"'{name}' lacks optimizer state ({', '.join(k for k in STATE_KEYS + ('step',) if k not in rec)})")
        for k in ("param",) + STATE_KEYS:
            if k not in rec:
                continue
            t = rec[k]
            if not isinstance(t, torch.Tensor) or list(t.shape) != size:
                raise bad(f"'{name}' {k} is not a tensor of shape {size}")
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise ConfigError(f"checkpoint file {f} holds non-finite values in '{name}' ({k}): the model had "
                                  f"diverged when it was saved; resume from an earlier checkpoint")
        covered.setdefault(name, []).append(region)


# --- the model description (ModelConfig, every field) ----------------------------------
# Fields that change neither a parameter nor the function the parameters compute: a resume
# may change them freely (dropout regularises training; the name is a label).
MODEL_FREE = ("name", "dropout")
# Fields that mean nothing without experts (a dense model has no router), or without rotary
# positions; they are compared only where they act.
ONLY_WITH_EXPERTS = ("top_k", "moe_ffn", "shared_experts", "moe_every", "router", "aux_loss", "bias_update",
                     "capacity_factor", "gate_norm", "shared_ffn", "shared_gate", "dense_blocks")
ONLY_WITH_ROPE = ("rope_base",)
# 0 means "the default size": compared by the size it stands for
EFFECTIVE = {"ffn": "ffn_hidden", "kv_heads": "n_kv_heads", "moe_ffn": "moe_ffn_hidden",
             "shared_ffn": "shared_ffn_hidden"}
UNKNOWN = "(a field this minitron does not know)"


def _plain(v):
    """A value as meta.json holds it (tuples become lists), for comparisons after a round trip."""
    return [_plain(x) for x in v] if isinstance(v, (list, tuple)) else v


def model_record(m) -> dict:
    """The whole model description for meta.json: every field of ModelConfig."""
    return {f.name: _plain(getattr(m, f.name)) for f in dataclasses.fields(m)}


def model_from_record(saved: dict):
    """The ModelConfig a checkpoint's record describes. A field the record lacks (written
    before the field existed) is the field's default: a new field's default is the model
    minitron built before it had the field. Fields this minitron does not know are ignored
    here (:func:`model_changes` names them)."""
    from .config import ModelConfig

    known = {f.name: f for f in dataclasses.fields(ModelConfig)}
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in known}
    return ModelConfig(**kw)


def _effective(m, name: str):
    if name in ONLY_WITH_EXPERTS and not m.experts or name in ONLY_WITH_ROPE and m.positions != "rope":
        return None
    if name == "gate_norm" and m.gate_norm == "auto" and (m.top_k > 1 or m.router == "sigmoid"):
        return "always"  # "auto" renormalises there too: the same gates
    return _plain(getattr(m, EFFECTIVE.get(name, name)))


def model_changes(saved: dict, m) -> list[tuple[str, object, object]]:
    """(field, the checkpoint's value, model `m`'s) for every field of the description that
    differs, generic over ``dataclasses.fields(ModelConfig)`` (a new field is compared
    without a word here). Sizes compare by what they stand for (ffn 0 = 4·hidden); fields
    that do not act (a dense model's top-k, learned positions' rope base) are not compared;
    a field the record has and this minitron does not know is named as a change."""
    try:
        old = model_from_record(saved)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"the checkpoint's model description is not valid ({e}): it was edited; "
                          f"resume from another checkpoint") from None
    out = [(f.name, _effective(old, f.name), _effective(m, f.name)) for f in dataclasses.fields(m)]
    out = [c for c in out if c[1] != c[2] and None not in c[1:]]  # one side inactive: its cause is named
    known = {f.name for f in dataclasses.fields(m)}
    return out + [(k, v, UNKNOWN) for k, v in saved.items() if k not in known]


def model_flag(name: str, value) -> str:
    """The command-line spelling of model field `name` = `value` (``--positions learned``)."""
    if name == "tied_embeddings":
        return "--tied" if value else "no --tied"
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else "--no-" + flag[2:]
    return f"{flag} {value}"


def says_changes(changes) -> str:
    """'positions learned -> rope, norm layernorm -> rmsnorm' (the checkpoint's first)."""
    return ", ".join(f"{k} {was} -> {now}" for k, was, now in changes)


def check_model(meta: dict, m, where: str = "the checkpoint", allow=()) -> list[tuple]:
    """The model in checkpoint `meta` is model `m`, field by field (:func:`model_changes`);
    else one ConfigError naming every field that differs with both values, and the flags
    that give the checkpoint's model. Fields in MODEL_FREE may differ; fields in `allow`
    (--allow-model-change) too. Returns the changes it let through (to be named)."""
    changes = model_changes(meta.get("model", {}), m)
    refused = [c for c in changes if c[0] not in MODEL_FREE and c[0] not in allow]
    if refused:
        fix = " ".join(model_flag(k, was) for k, was, now in refused if now != UNKNOWN and was is not None)
        raise ConfigError(f"{where} holds another model ({says_changes(refused)}): use its model flags"
                          f"{' (' + fix + ')' if fix else ''}, another --ckpt-dir, or --allow-model-change "
                          f"{','.join(k for k, _, _ in refused)} to change it (parameters it lacks are "
                          f"initialised afresh, those it no longer has are dropped)")
    return changes


def parameter_changes(saved: dict, model: dict) -> dict:
    """{"dropped": [...], "fresh": [...], "reshaped": [...]}: the checkpoint's tensors
    (`saved`, name -> full shape) against a model's (`model`): those the model no longer
    has, those it has and the checkpoint lacks, those whose shape changed."""
    return {"dropped": sorted(set(saved) - set(model)), "fresh": sorted(set(model) - set(saved)),
            "reshaped": sorted(k for k in set(saved) & set(model) if list(saved[k]) != list(model[k]))}


def load_full(path) -> dict:
    """Assemble the full state of checkpoint folder `path` (either format)."""
    if dcp_format.is_dcp(Path(path)):
        return dcp_format.load_full(Path(path), _dcp_keys(Path(path)))
    return assemble(_load(f) for f in sorted(Path(path).glob("rank_*.pt")))


def load_latest(ckpt_dir: str, tr) -> int:
    """Load the newest checkpoint of `ckpt_dir` into trainer `tr`; returns its step (0 if none)."""
    path = latest(ckpt_dir)
    if path is None:
        return 0
    meta = check(path, verify_data=False)  # checksums: the structure was checked before the ranks started
    allow = tuple(getattr(tr.tcfg, "allow_model_change", ()))
    check_model(meta, tr.mcfg, f"checkpoint {path}", allow)  # preflight named what an allowed change drops
    import_state(tr.params, tr.optimizer, load_full(path), fresh_ok=bool(allow))
    tr.step_idx = meta["step"]
    return meta["step"]


def gather_full(tr) -> dict | None:
    """Every rank's shards assembled into full tensors on rank 0 (None elsewhere)."""
    shards = tr.comm.gather_object(export_state(tr.params, tr.optimizer))
    return assemble(shards) if shards is not None else None


class FolderLock:
    """The lock of a checkpoint folder while a run writes it: the file `lock` inside it,
    held with the kernel's ``flock`` (released when its process ends, however it ends:
    the lock never outlives a killed run) and naming its holder (pid, host, start).

    A second run is refused in one line naming the holder. A lock file that nobody holds
    was left by a run that did not end cleanly (killed): it is taken over, and `stale`
    names it. Use ``acquire()`` then ``release()``, or as a context manager (a lock on
    "" does nothing: no --ckpt-dir, or not the rank that writes)."""

    def __init__(self, ckpt_dir: str):
        self.folder = Path(ckpt_dir) if ckpt_dir else None
        self.fd: int | None = None
        self.stale: str | None = None

    def acquire(self) -> "FolderLock":
        if self.folder is None or self.fd is not None:
            return self
        path = self.folder / LOCK_FILE
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(f"--ckpt-dir {self.folder}: cannot create its lock ({e.strerror}): "
                              f"pick a writable folder") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read_lock(fd)
            os.close(fd)
            raise ConfigError(f"--ckpt-dir {self.folder} is in use by another run ({holder or 'holder unknown'}): "
                              f"wait for it to end, or use another folder") from None
        try:
            current = os.stat(path).st_ino == os.fstat(fd).st_ino
        except OSError:
            current = False
        if not current:  # its holder released (and removed) it between our open and flock: again
            os.close(fd)
            return self.acquire()
        left = _read_lock(fd)
        if left:
            self.stale = (f"{path} was left by a run that did not end cleanly ({left}, no longer holding it: "
                          f"killed?); taken over")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            (self.folder / LOCK_FILE).unlink(missing_ok=True)  # still ours: we hold the flock
        finally:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "FolderLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read_lock(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        return ""


def lock_holder(ckpt_dir: str) -> str | None:
    """Who holds `ckpt_dir`'s lock now ("pid N on HOST"), "stale: ..." for a lock file that
    nobody holds, or None when there is no lock file."""
    path = Path(ckpt_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        text = _read_lock(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return text or "held"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return f"stale: {text or 'empty'}"
    finally:
        os.close(fd)
