"""`minitron check-ckpt DIR`: verify checkpoints without training.

DIR is one checkpoint (a step folder holding meta.json) or a --ckpt-dir. Every checkpoint
gets what a resume would check (`checkpoint.check`): each shard file's SHA-256 and size
against meta.json, the shards' structure (regions that tile every tensor exactly once: no
gap, no overlap, as a resume requires; optimizer state) and finite values. For a --ckpt-dir also the `latest` pointer, unfinished saves (`.tmp`) and
the folder's lock. One line per item; exit 0 when every checkpoint is sound, 1 otherwise.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..config import ConfigError


def inspect(folder: str) -> dict:
    """{"checkpoints": [{"path", "ok", "step", "message"}], "latest", "notes"} for a step
    folder or a --ckpt-dir; ConfigError when `folder` holds no checkpoint at all."""
    from ..checkpoint import check, is_step_dir, latest, lock_holder

    root = Path(folder)
    if (root / "meta.json").exists():
        paths, pointer, notes = [root], None, []
    elif root.is_dir():
        paths = sorted(d for d in root.iterdir() if is_step_dir(d) and d.suffix == "")
        notes = [f"{d.name}: an unfinished save (the next save removes it)"
                 for d in sorted(root.iterdir()) if is_step_dir(d) and d.suffix == ".tmp"]
        try:
            pointer = latest(folder)
            if pointer is None and paths:
                notes.append("no 'latest' pointer: --resume would not find these checkpoints")
            elif pointer is not None and pointer not in paths:
                notes.append(f"'latest' names {pointer.name}, which is not a complete checkpoint here")
        except ConfigError as e:
            pointer, notes = None, notes + [str(e)]
        holder = lock_holder(folder)
        if holder:
            notes.append(f"lock: {holder}" + ("" if holder.startswith("stale") else " (a run is writing this folder)"))
        if not paths and pointer is None:
            raise ConfigError(f"{folder} holds no checkpoint (no step_NNNNNNN folder, no meta.json): give a "
                              f"--ckpt-dir or one of its step folders")
    else:
        raise ConfigError(f"{folder} does not exist: give a --ckpt-dir or one of its step folders")
    rows = []
    for p in paths:
        try:
            meta = check(p)
            n = _param_count(meta)
            rows.append({"path": str(p), "ok": True, "step": meta["step"],
                         "message": f"step {meta['step']}, {meta['world']} shard file(s) from {meta.get('layout', '?')}, "
                                    f"checksums and values verified{f', {n:,} parameters' if n else ''}"})
        except ConfigError as e:
            rows.append({"path": str(p), "ok": False, "step": None, "message": str(e)})
    return {"checkpoints": rows, "latest": str(pointer) if pointer else None, "notes": notes}


def _param_count(meta: dict) -> int:
    try:
        from ..analysis import param_count
        from ..checkpoint import model_from_record

        return param_count(model_from_record(meta["model"]))
    except Exception:  # noqa: BLE001 - the count is a courtesy; the verdict does not depend on it
        return 0


def cmd_check_ckpt(args) -> int:
    res = inspect(args.dir)
    ok = all(r["ok"] for r in res["checkpoints"]) and bool(res["checkpoints"])
    if args.json:
        print(json.dumps({**res, "ok": ok}))
        return 0 if ok else 1
    for r in res["checkpoints"]:
        mark = "ok " if r["ok"] else "BAD"
        latest = "  <- latest" if res["latest"] == r["path"] else ""
        print(f"{mark} {Path(r['path']).name}: {r['message']}{latest}")
    for note in res["notes"]:
        print(f"    {note}")
    bad = sum(not r["ok"] for r in res["checkpoints"])
    print(f"{len(res['checkpoints']) - bad} of {len(res['checkpoints'])} checkpoint(s) sound"
          + (f"; {bad} damaged: resume from a sound one (write its name into latest)" if bad else ""))
    return 0 if ok else 1


def add_parser(sub) -> None:
    """Register `minitron check-ckpt` on the command line's subparsers."""
    ck = sub.add_parser("check-ckpt", help="verify checkpoints (checksums, structure, finite values) without training")
    ck.add_argument("dir", help="a --ckpt-dir, or one of its step folders")
    ck.add_argument("--json", action="store_true")
    ck.set_defaults(fn=cmd_check_ckpt)
