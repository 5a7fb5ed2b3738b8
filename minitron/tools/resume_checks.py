"""The checkpoint folder and what a `--resume` continues, checked before any rank starts:
--ckpt-dir holds no other run's checkpoints (or --overwrite deletes only what the engine
wrote), every run setting that differs from the checkpoint's is named and those breaking
the equality with an uninterrupted run refused (`check_resume`), the whole model compared
(`model_change_notes`); the folder's lock, and the metrics a resumed run writes again."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

from ..config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from .output_paths import checkpoint_folder_of, same_path, writable_folder


def _holds_checkpoints(folder: Path) -> bool:
    from ..checkpoint import STEP_DIR

    return (folder / "latest").exists() or any(STEP_DIR.fullmatch(d.name) for d in folder.glob("step_*"))


def prepare_ckpt_dir(ckpt_dir: str, resume: str, overwrite: bool, inputs: list[str], delete: bool = True) -> None:
    """--ckpt-dir is a writable folder; a new run refuses one holding checkpoints unless
    --resume continues them or --overwrite deletes them (a typo must not mix two runs).
    --overwrite deletes only what the engine wrote (`latest` and its step folders, see
    `checkpoint.is_step_dir`); a step-named folder holding anything else is refused.
    Under srun every rank checks; only the one with `delete` (rank 0) deletes."""
    from ..checkpoint import STEP_DIR, is_step_dir

    folder = Path(ckpt_dir)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"--ckpt-dir {ckpt_dir} is a file: name a folder")
    for src in inputs:
        if same_path(ckpt_dir, src) or os.path.realpath(src).startswith(os.path.realpath(ckpt_dir) + os.sep):
            raise ConfigError(f"--ckpt-dir {ckpt_dir} holds the training data {src}: use a folder of its own")
    outer = checkpoint_folder_of(str(folder.parent)) if str(folder.parent) else None
    if outer:
        raise ConfigError(f"--ckpt-dir {ckpt_dir} is inside the checkpoint folder {outer}: use a folder of its own")
    writable_folder("--ckpt-dir", folder, ckpt_dir)
    if _holds_checkpoints(folder) and not resume:
        if not overwrite:
            raise ConfigError(f"--ckpt-dir {ckpt_dir} already holds checkpoints: add --resume to continue them, "
                              f"--overwrite to delete them and start again, or pick another folder")
        steps = [d for d in folder.glob("step_*") if STEP_DIR.fullmatch(d.name)]
        foreign = next((d for d in steps if not is_step_dir(d)), None)
        if foreign is not None:
            raise ConfigError(f"--overwrite: {foreign} is not a checkpoint minitron wrote (it holds other files): "
                              f"move it out of --ckpt-dir {ckpt_dir} first; nothing was deleted")
        for old in [*steps, folder / "latest"] if delete else []:
            if old.is_dir():
                shutil.rmtree(old)
            elif old.exists():
                old.unlink()


class AlreadyDone(Exception):
    """--resume auto found a checkpoint that already reached the run's last step: the work
    is done (a requeued job that was preempted in its last step), and the command exits 0."""


def check_resume(ckpt_dir: str, resume: str, model: ModelConfig, train: TrainConfig, corpus=None,
                 allow_change: bool = False, log=None, layout: ParallelConfig | None = None) -> int:
    """The step a --resume continues from (0: start afresh, only with --resume auto).
    Refuses a missing checkpoint, a broken one, one of another model, or (plain --resume)
    one already at the last step; with --resume auto that last raises AlreadyDone. Every
    run setting that differs from the checkpoint's is named through `log`; those that break
    the equality with an uninterrupted run (`checkpoint.RESUME_EXACT`, and every field of the
    checkpoint's data position: :func:`data_position_changes`) are refused unless
    `allow_change` (--allow-resume-change)."""
    from ..checkpoint import check, latest
    from ..data import POSITION_FLAGS

    if not ckpt_dir:
        raise ConfigError("--resume needs --ckpt-dir: name the folder of the checkpoints to continue")
    newest = latest(ckpt_dir)
    if newest is None:
        if resume == "auto":
            return 0
        raise ConfigError(f"--resume: no checkpoint in --ckpt-dir {ckpt_dir} (no 'latest'): drop --resume to start "
                          f"a new run, use --resume auto to start one when there is none, or fix the folder")
    shapes = {}
    meta = check(newest, tensor_shapes=shapes)
    for line in model_change_notes(meta, shapes, model, ckpt_dir, train.allow_model_change):
        (log or _stderr)(f"minitron: note: {line}")
    end = min(train.steps, train.stop_at) if train.stop_at else train.steps
    if meta["step"] >= end:
        flag = '--stop-at' if train.stop_at and train.stop_at < train.steps else '--steps'
        if resume == "auto":
            raise AlreadyDone(f"the checkpoint in {ckpt_dir} is at step {meta['step']}, which already reached "
                              f"{flag} {end}: nothing left to train (exit code 0)")
        raise ConfigError(f"--resume: the checkpoint in {ckpt_dir} is at step {meta['step']}, already at "
                          f"{flag} {end}: raise it to train further")
    changed = resume_changes(meta, train, corpus)
    changed += [c for c in data_position_changes(meta, model, train, corpus) if c[0] not in {d[0] for d in changed}]
    if layout is not None and meta.get("layout") and meta["layout"] != layout.describe():
        changed.append(("the layout", f"{meta['layout']}; checkpoints are layout-independent", layout.describe()))
    breaking = [c for c in changed if c[0] in RESUME_EXACT_FLAGS or c[0] in POSITION_FLAGS.values()]
    if breaking and not allow_change:
        raise ConfigError(f"--resume: {'; '.join(_says(c) for c in breaking)}: the continued run would not equal "
                          f"an uninterrupted one; use the checkpoint's settings, or add --allow-resume-change")
    for c in changed:
        (log or _stderr)(f"minitron: note: resuming with {_says(c)}")
    return int(meta["step"])


def allowed_model_changes(spec: str, resume: bool) -> tuple[str, ...]:
    """The fields of --allow-model-change FIELD[,FIELD] (ModelConfig's names, dashes or
    underscores); one line naming an unknown field, or the flag without --resume."""
    names = tuple(dict.fromkeys(x.strip().replace("-", "_") for x in spec.split(",") if x.strip()))
    fields = [f.name for f in dataclasses.fields(ModelConfig)]
    unknown = [n for n in names if n not in fields]
    if unknown:
        raise ConfigError(f"--allow-model-change {spec}: no model field {', '.join(unknown)}; the fields are "
                          f"{', '.join(fields)}")
    if names and not resume:
        raise ConfigError("--allow-model-change changes the model a --resume continues: add --resume, or drop it")
    return names


def model_tensor_shapes(model: ModelConfig) -> dict[str, list[int]]:
    """{name: full shape} of every parameter of `model`, from the single-device model built
    on the meta device (shapes only: no memory, no values, whatever the model's size)."""
    import torch

    from ..context import Context
    from ..model import GPT

    gpt = GPT(model, Context(device=torch.device("meta")))
    return {p.shard.name: list(p.shard.full_shape) for p in gpt.parameters()}


def model_change_notes(meta: dict, shapes: dict, model: ModelConfig, ckpt_dir: str, allow=()) -> list[str]:
    """What a --resume into `model` changes of the checkpoint's model, as notes; ConfigError
    for a change not allowed (`checkpoint.check_model`), for an --allow-model-change that
    names a field that does not differ, and for parameters that would be dropped or
    initialised afresh without a field allowing it (a damaged checkpoint)."""
    from ..checkpoint import UNKNOWN, check_model, parameter_changes, says_changes

    where = f"--resume: the checkpoint in {ckpt_dir}"
    changes = check_model(meta, model, where, allow)
    stray = [k for k in allow if k not in {c[0] for c in changes}]
    if stray:
        raise ConfigError(f"--allow-model-change {','.join(stray)}: the checkpoint's model has the same "
                          f"{', '.join(stray)}; allow only the fields that differ ({says_changes(changes) or 'none'})")
    notes = [f"the checkpoint records no {k} (written by an older minitron): taken as its default "
             f"{getattr(ModelConfig, k)!r}" for k in ModelConfig.__dataclass_fields__ if k not in meta.get("model", {})]
    if changes:
        notes.append(f"resuming with another model: {says_changes(changes)}".replace(UNKNOWN, "(unknown here)"))
    params = parameter_changes(shapes, model_tensor_shapes(model))
    said = {"dropped": "dropped (the new model has no such parameter; the next checkpoint will not hold it)",
            "fresh": "initialised afresh (the checkpoint has none)",
            "reshaped": "initialised afresh (the checkpoint's has another shape)"}
    if any(params.values()) and not allow:
        what = "; ".join(f"{', '.join(v[:4])}{' ...' if len(v) > 4 else ''} {said[k]}" for k, v in params.items() if v)
        raise ConfigError(f"{where} does not match the model: {what}, although the model options agree; it was "
                          f"written by another minitron or edited: resume from another checkpoint")
    notes += [f"{len(v)} parameter(s) {said[k]}: {', '.join(v)}" for k, v in params.items() if v]
    return notes


# flag -> the checkpoint's "train" key (checkpoint.RESUME_EXACT), in the order they are named
RESUME_EXACT_FLAGS = {"--seed": "seed", "--global-batch": "global_batch", "--data": "data_tokens",
                      "--dtype": "dtype", "--lr": "lr", "--min-lr": "min_lr", "--warmup": "warmup",
                      "--weight-decay": "weight_decay", "--clip": "clip"}


def resume_changes(meta: dict, train: TrainConfig, corpus=None) -> list[tuple[str, object, object]]:
    """(flag, checkpoint's value, this run's) for every run setting that differs from the
    checkpoint's: those of RESUME_EXACT_FLAGS, then the harmless ones (--steps, the data
    file's path when its tokens are the same, --microbatches, the layout)."""
    saved = meta.get("train")
    if not isinstance(saved, dict):
        saved = {"seed": meta.get("seed")}
    mine = {k: getattr(train, k) for k in ("seed", "global_batch", "dtype", "lr", "min_lr", "warmup",
                                            "weight_decay", "clip", "steps", "microbatches", "data")}
    if corpus is not None:
        mine["data_tokens"] = len(corpus.split()[0])
    out = []
    for flag, key in [*RESUME_EXACT_FLAGS.items(), ("--steps", "steps"), ("--data path", "data"),
                      ("--microbatches", "microbatches")]:
        if key in saved and key in mine and saved[key] is not None and saved[key] != mine[key]:
            if key == "data_tokens":
                out.append(("--data", f"{saved.get('data') or 'Shakespeare'} ({saved[key]:,} training tokens)",
                            f"{mine['data'] or 'Shakespeare'} ({mine[key]:,})"))
            elif key != "data" or not any(c[0] == "--data" for c in out):
                out.append((flag, saved[key], mine[key]))
    return out


def data_position_changes(meta: dict, model: ModelConfig, train: TrainConfig, corpus=None) -> list[tuple]:
    """The checkpoint's data position (``data.position``: what every later step's sampler
    reads) against this run's, field by field, as (flag, checkpoint's, this run's); none for a
    checkpoint that states no position (an older minitron's: its --seed, --global-batch and
    --data are compared by :func:`resume_changes`)."""
    from ..data import position, position_changes

    saved = meta.get("data")
    if not isinstance(saved, dict):
        return []
    now = position(train, model.seq_len, len(corpus.split()[0]) if corpus is not None else None, meta["step"])
    return position_changes(saved, now)


def _says(change) -> str:
    flag, was, now = change
    return f"{flag} {now} (the checkpoint's is {was})"


def _stderr(line: str) -> None:
    import sys

    print(line, file=sys.stderr)


def lock_ckpt_dir(lock, log=None) -> None:
    """Take --ckpt-dir's lock (a checkpoint.FolderLock) for this run; a stale lock left by a
    killed run is taken over and named through `log`."""
    lock.acquire()
    if lock.stale:
        (log or _stderr)(f"minitron: note: {lock.stale}")


def trim_metrics(path: str, step: int) -> None:
    """Drop the metrics a resumed run will write again (steps after its checkpoint), so
    that a run stopped between checkpoints leaves each step once in the file."""
    if not path or not os.path.exists(path):
        return
    keep = []
    for line in Path(path).read_text().splitlines(keepends=True):
        try:
            if json.loads(line).get("step", 0) > step:
                continue
        except (json.JSONDecodeError, AttributeError):
            continue  # a line cut by a kill
        keep.append(line)
    Path(path).write_text("".join(keep))
