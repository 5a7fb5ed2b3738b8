"""Checks before any rank starts: what can be known from the command line and the
machine is refused here, in one line naming the problem and the fix, instead of after
minutes of training, or as a traceback from inside a rank.

The command line calls these after `config.validate`: the environment (GPUs, the
launcher's variables), the token ids of the corpus and the memory the run will need here;
the output paths in `output_paths.py`, the checkpoint a `--resume` would continue in
`resume_checks.py`.
"""
from __future__ import annotations

import math
import os

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


# --- options ------------------------------------------------------------------------------
def finite_positive(flag: str, value: float, allow_zero: bool = False) -> None:
    """A float option that must be a (positive) finite number."""
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{flag} must be a {'non-negative' if allow_zero else 'positive'} finite number "
                          f"(got {value})")
