"""Checks before any rank starts: what can be known from the command line and the
machine is refused here, in one line naming the problem and the fix, instead of after
minutes of training (a read-only checkpoint folder), never (a metrics file that
overwrites the corpus), or as a traceback from inside a rank.

The command line calls these after `config.validate`: the environment (GPUs, the
launcher's variables), the token ids of the corpus, the memory the run will need, the
output paths, and the checkpoint a `--resume` would continue.
"""
from __future__ import annotations

import dataclasses
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
    check_rank_numbers(env)
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


def check_rank_numbers(env) -> None:
    """The launcher's numbers are integers and a rank lies inside its world (a rank past
    the world size waits in the rendezvous, then ends in C++ stack frames)."""
    for rank_key, world_key in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"),
                                ("LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        given = {k: env[k] for k in (rank_key, world_key) if k in env}
        for k, v in given.items():
            if not v.strip().lstrip("-").isdigit():
                raise ConfigError(f"the launcher's {k}={v[:40]!r} is not a number: fix the environment "
                                  f"(or start the ranks with torchrun / srun)")
        if len(given) == 2:
            rank, world = int(given[rank_key]), int(given[world_key])
            if world < 1 or not 0 <= rank < world:
                raise ConfigError(f"the launcher's {rank_key}={rank} is outside {world_key}={world} (ranks are "
                                  f"0..{max(world, 1) - 1}): fix the environment (or start the ranks with torchrun / srun)")


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


def _not_in_checkpoint(flag: str, path: str, ckpt_dir: str = "") -> None:
    inside = ckpt_dir and (_same(path, ckpt_dir) or
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
        if _same(path, src):
            raise ConfigError(f"{flag} {path} is an input of this run and would be overwritten: "
                              f"write it somewhere else")
    _not_in_checkpoint(flag, path, ckpt_dir)
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


def check_output_dir(flag: str, path: str, inputs: list[str] = (), ckpt_dir: str = "") -> None:
    """`path` is (or can be made) a writable folder, not a file, holding no input and not
    inside a checkpoint folder."""
    if Path(path).exists() and not Path(path).is_dir():
        raise ConfigError(f"{flag} {path} is a file: name a folder")
    for src in filter(None, inputs):
        if _same(path, src) or os.path.realpath(src).startswith(os.path.realpath(path) + os.sep):
            raise ConfigError(f"{flag} {path} holds {src}, an input of this run: write it somewhere else")
    _not_in_checkpoint(flag, path, ckpt_dir)
    _writable_folder(flag, Path(path), path)


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
            if _same(given[a], given[b]):
                raise ConfigError(f"{a} and {b} name the same file {given[a]}: give each its own")


# --- checkpoints ----------------------------------------------------------------------------
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
        if _same(ckpt_dir, src) or os.path.realpath(src).startswith(os.path.realpath(ckpt_dir) + os.sep):
            raise ConfigError(f"--ckpt-dir {ckpt_dir} holds the training data {src}: use a folder of its own")
    outer = checkpoint_folder_of(str(folder.parent)) if str(folder.parent) else None
    if outer:
        raise ConfigError(f"--ckpt-dir {ckpt_dir} is inside the checkpoint folder {outer}: use a folder of its own")
    _writable_folder("--ckpt-dir", folder, ckpt_dir)
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
    the equality with an uninterrupted run (`checkpoint.RESUME_EXACT`) are refused unless
    `allow_change` (--allow-resume-change)."""
    from ..checkpoint import check, latest

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
    if layout is not None and meta.get("layout") and meta["layout"] != layout.describe():
        changed.append(("the layout", f"{meta['layout']}; checkpoints are layout-independent", layout.describe()))
    breaking = [c for c in changed if c[0] in RESUME_EXACT_FLAGS]
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


def check_export_dir(hf_dir: str, ckpt: str) -> None:
    """`minitron export --hf DIR`: DIR is not inside a checkpoint folder, and empty or holding
    only what an export writes (config.json, model.safetensors): a folder holding another
    model's other files (its tokenizer, other weights) would be left half replaced."""
    from ..hf import CONFIG, WEIGHTS

    target = Path(hf_dir)
    if target.exists() and not target.is_dir():
        raise ConfigError(f"--hf {hf_dir} is a file: name a folder")
    _not_in_checkpoint("--hf", hf_dir, ckpt)
    other = sorted(p.name for p in target.iterdir() if p.name not in (CONFIG, WEIGHTS)) if target.is_dir() else []
    if other:
        raise ConfigError(f"--hf {hf_dir} already holds other files ({', '.join(other[:3])}"
                          f"{', ...' if len(other) > 3 else ''}): export into an empty folder")
    _writable_folder("--hf", target, hf_dir)


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
