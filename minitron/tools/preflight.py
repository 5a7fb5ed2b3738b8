"""Checks before any rank starts: what can be known from the command line and the
machine is refused here, in one line naming the problem and the fix, instead of after
minutes of training (a read-only checkpoint folder), never (a metrics file that
overwrites the corpus), or as a traceback from inside a rank.

The command line calls these after `config.validate`: the environment (GPUs, the
launcher's variables), the token ids of the corpus, the memory the run will need, the
output paths, and the checkpoint a `--resume` would continue.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

from ..config import ConfigError, ModelConfig, ParallelConfig, TrainConfig


# --- the machine and the launcher ----------------------------------------------------------
def check_environment(layout: ParallelConfig) -> None:
    """GPUs where the layout asks for them; a launcher environment that can start ranks."""
    import torch

    if (layout.device == "cuda" or layout.backend == "nccl") and not torch.cuda.is_available():
        flag = "--device cuda" if layout.device == "cuda" else "--backend nccl"
        raise ConfigError(f"{flag} needs a CUDA GPU and this machine has none: drop it (CPU ranks use gloo)")
    env = os.environ
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_STEP_ID" not in env \
            and "RANK" not in env:
        # the batch script itself (task 0 of the allocation): its peers would never come
        raise ConfigError(f"this looks like a Slurm batch script with {env['SLURM_NTASKS']} tasks, but not a task "
                          f"started by srun: run it as `srun minitron ...` (or unset SLURM_NTASKS for one process)")
    if "RANK" in env and "WORLD_SIZE" in env and int(env["WORLD_SIZE"]) > 1 and "TORCHELASTIC_RUN_ID" not in env:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
        if missing:
            raise ConfigError(f"RANK and WORLD_SIZE are set but {' and '.join(missing)} not: export them "
                              f"(the host and port of rank 0), or start the ranks with torchrun")


def available_memory_bytes() -> int | None:
    """Physical memory of this machine (None where unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(model: ModelConfig, layout: ParallelConfig, train: TrainConfig, ranks_here: int | None = None) -> None:
    """Refuse a run whose ranks on this machine would need more memory than it has
    (``analysis.memory_per_rank``: parameters, gradients, AdamW state, activations,
    buffers), before minutes of allocation end in the OOM killer. CPU runs only: on
    GPUs each rank has its own device memory, which the CUDA allocator reports itself."""
    from ..analysis import memory_per_rank

    if layout.backend == "nccl" or layout.device == "cuda":
        return
    have = available_memory_bytes()
    if not have:
        return
    here = ranks_here or int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or (1 if _started_by_launcher() else layout.world)
    try:
        need = memory_per_rank(model, layout, train)["total_bytes"] * here
    except Exception:  # noqa: BLE001 - a layout the estimate does not model yet: no estimate, no refusal
        return
    if need > 0.9 * have:
        raise ConfigError(f"{model.name} on {layout.describe()} needs about {_gb(need)} on this machine ({here} rank(s) "
                          f"x {_gb(need / here)}, `minitron memory`) but it has {_gb(have)}: use a smaller "
                          f"--model, or spread the ranks over more machines")


def _started_by_launcher() -> bool:
    from ..launch import under_launcher

    return under_launcher()


def _gb(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n < 2**40 else f"{n / 2**40:.1f} TiB"


# --- data --------------------------------------------------------------------------------
def check_token_ids(corpus, vocab: int, chunk: int = 1 << 24) -> None:
    """Every id of a token file is below --vocab. The sidecar's vocabulary can be wrong
    (a hand-made file): an id past the embedding is an IndexError on one rank, and with a
    vocabulary-parallel embedding (--tp) a silently wrong model, since each rank masks the
    ids outside its own slice. One pass over the memory-mapped file, in chunks."""
    tokens = getattr(corpus, "tokens", None)
    if tokens is None or not hasattr(tokens, "max"):
        return  # bytes: always below 256, checked by check_corpus
    for start in range(0, len(tokens), chunk):
        top = int(tokens[start:start + chunk].max())
        if top >= vocab:
            raise ConfigError(f"--data {corpus.path} holds token id {top} (near position {start}), but --vocab is "
                              f"{vocab}: use --vocab {top + 1} or more, or re-tokenize the text")


# --- output paths --------------------------------------------------------------------------
PLOT_TYPES = (".png", ".svg", ".pdf", ".jpg", ".jpeg")  # what matplotlib writes without extra packages

def _same(a: str, b: str) -> bool:
    try:
        return os.path.realpath(a) == os.path.realpath(b)
    except OSError:
        return False


def inputs_of(train: TrainConfig) -> list[str]:
    """The files a run reads: the corpus (and a token file's sidecars)."""
    if not train.data:
        return []
    out = [train.data]
    if train.data.endswith(".bin"):
        base = train.data[:-4]
        out += [base + ".json", base + ".tokenizer.json"]
    return out


def check_output_file(flag: str, path: str, inputs: list[str], extensions: tuple[str, ...] = ()) -> None:
    """`path` can be written by the run: not a folder, not one of its inputs, its parent
    folder created (a fresh clone has no runs/) and writable."""
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"{flag} {path} is a folder: name a file to write, e.g. {path.rstrip('/')}/out.jsonl")
    for src in filter(None, inputs):
        if _same(path, src):
            raise ConfigError(f"{flag} {path} is an input of this run and would be overwritten: "
                              f"write it somewhere else")
    if extensions and target.suffix.lower() not in extensions:
        raise ConfigError(f"{flag} {path}: unknown file type '{target.suffix or '(none)'}': "
                          f"use one of {', '.join(extensions)}")
    _writable_folder(flag, target.parent if str(target.parent) else Path("."), path)
    if target.exists() and not os.access(target, os.W_OK):
        raise ConfigError(f"{flag} {path} is not writable: fix its permissions or write elsewhere")


def _writable_folder(flag: str, folder: Path, path: str) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass  # a real write: os.access says yes to root on a read-only file system
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot write into {folder} ({e.strerror or type(e).__name__}): "
                          f"pick a writable place") from None


def check_output_dir(flag: str, path: str) -> None:
    """`path` is (or can be made) a writable folder, not a file."""
    if Path(path).exists() and not Path(path).is_dir():
        raise ConfigError(f"{flag} {path} is a file: name a folder")
    _writable_folder(flag, Path(path), path)


def check_outputs(outputs: dict[str, str], inputs: list[str]) -> None:
    """Every named output file (flag -> path) is writable, none is an input, no two coincide."""
    given = {flag: path for flag, path in outputs.items() if path}
    for flag, path in given.items():
        check_output_file(flag, path, inputs)
    flags = list(given)
    for i, a in enumerate(flags):
        for b in flags[i + 1:]:
            if _same(given[a], given[b]):
                raise ConfigError(f"{a} and {b} name the same file {given[a]}: give each its own")


# --- checkpoints ----------------------------------------------------------------------------
def _holds_checkpoints(folder: Path) -> bool:
    return (folder / "latest").exists() or any(folder.glob("step_*"))


def prepare_ckpt_dir(ckpt_dir: str, resume: str, overwrite: bool, inputs: list[str], delete: bool = True) -> None:
    """--ckpt-dir is a writable folder; a new run refuses one holding checkpoints unless
    --resume continues them or --overwrite deletes them (a typo must not mix two runs).
    Under srun every rank checks; only the one with `delete` (rank 0) deletes."""
    folder = Path(ckpt_dir)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"--ckpt-dir {ckpt_dir} is a file: name a folder")
    for src in inputs:
        if _same(ckpt_dir, src) or os.path.realpath(src).startswith(os.path.realpath(ckpt_dir) + os.sep):
            raise ConfigError(f"--ckpt-dir {ckpt_dir} holds the training data {src}: use a folder of its own")
    _writable_folder("--ckpt-dir", folder, ckpt_dir)
    if _holds_checkpoints(folder) and not resume:
        if not overwrite:
            raise ConfigError(f"--ckpt-dir {ckpt_dir} already holds checkpoints: add --resume to continue them, "
                              f"--overwrite to delete them and start again, or pick another folder")
        for old in [*folder.glob("step_*"), folder / "latest"] if delete else []:
            if old.is_dir():
                shutil.rmtree(old)
            elif old.exists():
                old.unlink()


def check_resume(ckpt_dir: str, resume: str, model: ModelConfig, train: TrainConfig) -> int:
    """The step a --resume continues from (0: start afresh, only with --resume auto).
    Refuses a missing checkpoint, a broken one, one of another model, or one already at
    the last step."""
    from ..checkpoint import check, check_model, latest

    if not ckpt_dir:
        raise ConfigError("--resume needs --ckpt-dir: name the folder of the checkpoints to continue")
    newest = latest(ckpt_dir)
    if newest is None:
        if resume == "auto":
            return 0
        raise ConfigError(f"--resume: no checkpoint in --ckpt-dir {ckpt_dir} (no 'latest'): drop --resume to start "
                          f"a new run, use --resume auto to start one when there is none, or fix the folder")
    meta = check(newest)
    check_model(meta, model, f"--resume: the checkpoint in {ckpt_dir}")
    end = min(train.steps, train.stop_at) if train.stop_at else train.steps
    if meta["step"] >= end:
        raise ConfigError(f"--resume: the checkpoint in {ckpt_dir} is at step {meta['step']}, already at "
                          f"{'--stop-at' if train.stop_at and train.stop_at < train.steps else '--steps'} {end}: "
                          f"raise it to train further")
    return int(meta["step"])


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


def finite_positive(flag: str, value: float, allow_zero: bool = False) -> None:
    """A float option that must be a (positive) finite number."""
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{flag} must be a {'non-negative' if allow_zero else 'positive'} finite number "
                          f"(got {value})")
