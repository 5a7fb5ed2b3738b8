"""Output paths checked before any rank starts: a file or folder a run writes is writable,
never one of its inputs, never a FIFO or device, and never inside a checkpoint folder
(`checkpoint_folder_of`: a metrics file named `latest`, a trace over a shard or another
run's meta.json would destroy a checkpoint without a word); `export --hf`'s folder."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..config import ConfigError, TrainConfig


PLOT_TYPES = (".png", ".svg", ".pdf", ".jpg", ".jpeg")  # what matplotlib writes without extra packages


def same_path(a: str, b: str) -> bool:
    """`a` and `b` name the same file (after links)."""
    try:
        return os.path.realpath(a) == os.path.realpath(b)
    except OSError:
        return False


def inputs_of(train: TrainConfig) -> list[str]:
    """The files a run reads: the corpus (and a token file's sidecars), the GPT-2 directory's."""
    out = []
    if train.data:
        out.append(train.data)
        if train.data.endswith(".bin"):
            base = train.data[:-4]
            out += [base + ".json", base + ".tokenizer.json"]
    if train.init_from:
        out += [os.path.join(train.init_from, f) for f in ("config.json", "model.safetensors",
                                                           "model.safetensors.index.json", "tokenizer.json")]
    return out


def checkpoint_folder_of(path: str) -> str | None:
    """The checkpoint folder that `path` is (or lies inside), or None. A checkpoint folder
    holds a `latest` pointer or one of the engine's step folders; a step folder holds
    meta.json or shards. Outputs never go there: a metrics file named `latest`, a trace
    over a shard or another run's meta.json would destroy a checkpoint without a word."""
    from ..checkpoint import STEP_DIR

    here = Path(os.path.realpath(path))
    for folder in [here, *here.parents]:
        try:
            if STEP_DIR.fullmatch(folder.name) and folder.is_dir() and \
                    ((folder / "meta.json").exists() or any(folder.glob("rank_*.pt*"))):
                return str(folder.parent)
            if folder.is_dir() and (_names_a_step(folder / "latest")
                                    or any(STEP_DIR.fullmatch(d.name) and d.is_dir() for d in folder.glob("step_*"))):
                return str(folder)
        except OSError:
            continue
    return None


def _names_a_step(pointer: Path) -> bool:
    """`pointer` is a checkpoint folder's `latest` (a file naming a step folder)."""
    from ..checkpoint import STEP_DIR

    try:
        return pointer.is_file() and bool(STEP_DIR.fullmatch(pointer.read_text(errors="replace")[:64].strip()))
    except OSError:
        return False


def not_in_checkpoint(flag: str, path: str, ckpt_dir: str = "") -> None:
    """`path` lies in no checkpoint folder (this run's `ckpt_dir` or another)."""
    inside = ckpt_dir and (same_path(path, ckpt_dir) or
                           os.path.realpath(path).startswith(os.path.realpath(ckpt_dir) + os.sep))
    folder = ckpt_dir if inside else checkpoint_folder_of(path)
    if folder:
        raise ConfigError(f"{flag} {path} is inside the checkpoint folder {folder}: outputs never go there "
                          f"(they could overwrite a checkpoint); write it somewhere else")


def check_output_file(flag: str, path: str, inputs: list[str], extensions: tuple[str, ...] = (),
                      ckpt_dir: str = "") -> None:
    """`path` can be written by the run: not a folder, not one of its inputs, not inside a
    checkpoint folder (this run's `ckpt_dir` or any other), not a FIFO or device, its
    parent folder created (a fresh clone has no runs/) and writable."""
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"{flag} {path} is a folder: name a file to write, e.g. {path.rstrip('/')}/out.jsonl")
    if target.exists() and not target.is_file():
        raise ConfigError(f"{flag} {path} is not a regular file (a FIFO, socket or device): name a file to write")
    for src in filter(None, inputs):
        if same_path(path, src):
            raise ConfigError(f"{flag} {path} is an input of this run and would be overwritten: "
                              f"write it somewhere else")
    not_in_checkpoint(flag, path, ckpt_dir)
    if extensions and target.suffix.lower() not in extensions:
        raise ConfigError(f"{flag} {path}: unknown file type '{target.suffix or '(none)'}': "
                          f"use one of {', '.join(extensions)}")
    writable_folder(flag, target.parent if str(target.parent) else Path("."), path)
    if target.exists() and not os.access(target, os.W_OK):
        raise ConfigError(f"{flag} {path} is not writable: fix its permissions or write elsewhere")


def writable_folder(flag: str, folder: Path, path: str) -> None:
    """`folder` exists (created) and a file can really be written in it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass  # a real write: os.access says yes to root on a read-only file system
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot write into {folder} ({e.strerror or type(e).__name__}): "
                          f"pick a writable place") from None


def check_output_dir(flag: str, path: str, inputs: list[str] = (), ckpt_dir: str = "") -> None:
    """`path` is (or can be made) a writable folder, not a file, holding no input and not
    inside a checkpoint folder."""
    if Path(path).exists() and not Path(path).is_dir():
        raise ConfigError(f"{flag} {path} is a file: name a folder")
    for src in filter(None, inputs):
        if same_path(path, src) or os.path.realpath(src).startswith(os.path.realpath(path) + os.sep):
            raise ConfigError(f"{flag} {path} holds {src}, an input of this run: write it somewhere else")
    not_in_checkpoint(flag, path, ckpt_dir)
    writable_folder(flag, Path(path), path)


def check_outputs(outputs: dict[str, str], inputs: list[str], ckpt_dir: str = "") -> None:
    """Every named output file (flag -> path) is writable, none is an input or inside a
    checkpoint folder, no two coincide. --metrics brings its loss figure (.loss.png)."""
    given = {flag: path for flag, path in outputs.items() if path}
    if given.get("--metrics"):
        given["--metrics' loss figure"] = str(Path(given["--metrics"]).with_suffix(".loss.png"))
    for flag, path in given.items():
        check_output_file(flag, path, inputs, ckpt_dir=ckpt_dir)
    flags = list(given)
    for i, a in enumerate(flags):
        for b in flags[i + 1:]:
            if same_path(given[a], given[b]):
                raise ConfigError(f"{a} and {b} name the same file {given[a]}: give each its own")


def check_export_dir(hf_dir: str, ckpt: str) -> None:
    """`minitron export --hf DIR`: DIR is not inside a checkpoint folder, and empty or holding
    only what an export writes (config.json, model.safetensors): a folder holding another
    model's other files (its tokenizer, other weights) would be left half replaced."""
    from ..hf import CONFIG, WEIGHTS

    target = Path(hf_dir)
    if target.exists() and not target.is_dir():
        raise ConfigError(f"--hf {hf_dir} is a file: name a folder")
    not_in_checkpoint("--hf", hf_dir, ckpt)
    other = sorted(p.name for p in target.iterdir() if p.name not in (CONFIG, WEIGHTS)) if target.is_dir() else []
    if other:
        raise ConfigError(f"--hf {hf_dir} already holds other files ({', '.join(other[:3])}"
                          f"{', ...' if len(other) > 3 else ''}): export into an empty folder")
    writable_folder("--hf", target, hf_dir)
