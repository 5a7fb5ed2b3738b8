"""Configuration: the model, the parallel layout and training, as plain dataclasses.

Every bad combination is caught by :func:`validate` *before* any process group starts,
and reported as a :class:`ConfigError` whose message is one line naming the problem
and the fix.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


class ConfigError(ValueError):
    """A bad configuration: the message is one line, naming the problem and the fix."""


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only GPT (pre-LayerNorm, learned positions, GELU MLP)."""

    layers: int = 2
    hidden: int = 32
    heads: int = 4
    seq_len: int = 32
    vocab: int = 256
    ffn: int = 0  # 0 means 4 * hidden
    tied_embeddings: bool = False
    dropout: float = 0.0
    activation: str = "gelu"  # "gelu" (exact, erf) or "gelu_tanh" (GPT-2's original gelu_new)
    name: str = "custom"

    @property
    def ffn_hidden(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


# Published sizes are for the analysis tools only; tiny/small train on a laptop CPU.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(layers=2, hidden=32, heads=4, seq_len=32, vocab=256, name="tiny"),
    "small": ModelConfig(layers=4, hidden=128, heads=4, seq_len=128, vocab=256, name="small"),
    "medium": ModelConfig(layers=8, hidden=256, heads=8, seq_len=256, vocab=256, name="medium"),
    # Megatron-LM 2019, Table 1 (GPT-2 8.3B: 72 layers, h=3072, 32 heads, s=1024).
    "megatron-8.3b": ModelConfig(layers=72, hidden=3072, heads=32, seq_len=1024,
                                 vocab=51200, name="megatron-8.3b"),
    # GPT-3 175B (Brown et al. 2020) as configured in the PTD-P paper, Table 1.
    "gpt3-175b": ModelConfig(layers=96, hidden=12288, heads=96, seq_len=2048,
                             vocab=51200, name="gpt3-175b"),
    # The 1T model of PTD-P (Narayanan et al. 2021), Table 1.
    "ptdp-1t": ModelConfig(layers=128, hidden=25600, heads=160, seq_len=2048,
                           vocab=51200, name="ptdp-1t"),
    # A ~1.3B GPT (GPT-3 XL shape) for single-GPU benchmarks.
    "gpt-1.3b": ModelConfig(layers=24, hidden=2048, heads=16, seq_len=2048,
                            vocab=51200, name="gpt-1.3b"),
}
TRAINABLE_PRESETS = ("tiny", "small", "medium")


@dataclass(frozen=True)
class ParallelConfig:
    """The layout: how many ranks, and how they split the work.

    Rank order follows Megatron: tensor fastest, then data, then pipeline.
    """

    nproc: int = 0  # 0: dp * tp * pp
    dp: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1  # context parallel: the sequence split over cp ranks, ring attention
    tp_mode: str = "1d"  # "1d" (Megatron), "2d" (SUMMA, q^2), "2.5d" (Tesseract, q^2*d) or "3d" (cube, q^3)
    tp_depth: int = 1  # d of --tp-mode 2.5d: copies of the q x q grid, each on 1/d of the batch
    sp: bool = False
    schedule: str = "1f1b"
    zero1: bool = False  # alias of zero=1 (kept for old call sites): True whenever zero >= 1
    zero: int = 0  # ZeRO stage: 1 optimizer state, 2 + gradients, 3 + parameters sharded over dp
    dp_impl: str = "bucketed"
    bucket_mb: float = 4.0
    recompute: str = "none"
    scatter_gather: bool = False
    stage_layers: tuple[int, ...] = ()  # explicit per-stage layer counts (uneven split)
    backend: str = "gloo"
    device: str = "auto"  # auto: the GPU with nccl or on one device when there is one, else the CPU
    precision: str = "fp32"  # fp32 | bf16 (autocast, fp32 master weights)
    dropout_rng: str = "tensor"  # "tensor" (Megatron streams) | "global" (single-device masks, sliced)
    compile: bool = False  # torch.compile each transformer block (collectives stay eager)

    def __post_init__(self):
        # --zero1 and --zero 1 are one setting: zero1 reads "optimizer state is sharded"
        zero = self.zero if self.zero else (1 if self.zero1 else 0)
        object.__setattr__(self, "zero", zero)
        object.__setattr__(self, "zero1", zero >= 1)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def cube_q(self) -> int:
        """Edge of the 3-D cube (q with q^3 = tp); 1 in 1-D mode."""
        return cube_edge(self.tp) if self.tp_mode == "3d" else 1

    @property
    def summa_q(self) -> int:
        """Edge of the 2-D / 2.5-D grid (q with q^2 * tp_depth = tp); 1 otherwise."""
        return square_edge(self.tp // max(1, self.tp_depth)) if self.tp_mode in ("2d", "2.5d") else 1

    def describe(self) -> str:
        s = f"dp{self.dp}.tp{self.tp}.pp{self.pp}"
        if self.tp_mode == "3d":
            s += ".cube"
        elif self.tp_mode == "2d":
            s += ".summa"
        elif self.tp_mode == "2.5d":
            s += f".tesseract-d{self.tp_depth}"
        if self.cp > 1:
            s += f".cp{self.cp}"
        if self.pp > 1:
            s += f".{self.schedule}"
            if self.vpp > 1:
                s += f".v{self.vpp}"
        for flag in ("sp", "zero1", "scatter_gather"):
            if getattr(self, flag):
                s += f".zero{self.zero}" if flag == "zero1" else f".{flag}"
        if self.recompute != "none":
            s += f".rc-{self.recompute}"
        return s


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    global_batch: int = 16  # sequences per optimizer step
    microbatches: int = 1  # microbatches per step on each data-parallel rank
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 20
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 1234
    data: str = ""  # "" = the built-in Shakespeare corpus
    dtype: str = "float32"
    ckpt_dir: str = ""
    ckpt_every: int = 0
    keep_last: int = 0  # keep only the newest K checkpoints (0: all)
    stop_at: int = 0  # stop after this step (a time-limited job), checkpointing first
    resume: bool = False
    metrics: str = ""
    trace: str = ""
    timeline: str = ""
    eval_every: int = 50
    eval_batches: int = 4
    sample_tokens: int = 200
    progress: bool = True
    log_every: int = 1  # read the loss back from the device every N steps (GPU: > 1 avoids syncs)
    init_from: str = ""  # a GPT-2 directory (Hugging Face format) whose weights start the run

    def replace(self, **kw) -> "TrainConfig":
        return dataclasses.replace(self, **kw)


# The pipeline schedules (parallel/schedules.py builds each; analysis/bubble.py prices it):
# GPipe, 1F1B (PipeDream-Flush), interleaved 1F1B (PTD-P §2.2.2), zero-bubble H1 (Qi et al. 2024).
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
RECOMPUTE = ("none", "selective", "full")
# The training dtypes (``--dtype``) and the bytes of one element of each: parameters,
# gradients and optimizer state are held in this dtype (mixed precision is ``--precision``).
DTYPE_BYTES: dict[str, int] = {"float32": 4, "float64": 8, "bfloat16": 2}
DTYPES = tuple(DTYPE_BYTES)


# Token ids, targets and position indices are int64 (torch.long).
INDEX_BYTES = 8


def statistics_bytes(dtype_bytes: int) -> int:
    """Bytes of one statistic (LayerNorm's mean and rstd, softmax's max and sum, the loss)
    computed from elements of `dtype_bytes`: float32 at least (16-bit inputs are upcast)."""
    return max(dtype_bytes, DTYPE_BYTES["float32"])


def element_bytes(dtype: str) -> int:
    """Bytes of one element of the training dtype `dtype` (a name of :data:`DTYPES`)."""
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"unknown --dtype '{dtype}': choose one of {', '.join(DTYPES)}")
    return DTYPE_BYTES[dtype]


def model_flops_per_step(model: ModelConfig, global_batch: int) -> float:
    """Model FLOPs of one training step of `global_batch` sequences, recomputation not
    counted (Korthikanti et al. 2022; PTD-P Eq. 3 with 72 and V/(12·l·h)):
    ``72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))``. A 4h MLP and the unpadded vocabulary, as
    the papers count. The engine logs model FLOPs/s with it; ``analysis.flops`` builds on it."""
    B, s, l, h, V = global_batch, model.seq_len, model.layers, model.hidden, model.vocab
    return 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))


# --------------------------------------------------------------------------------------
# Tensor-parallel grid edges
# --------------------------------------------------------------------------------------
def cube_edge(tp: int) -> int:
    """q of the 3-D cube, q³ = tp (Bian et al. 2021): the nearest integer cube root (a tp
    that is not a cube is refused by :func:`validate_parallel`)."""
    return round(tp ** (1 / 3))


def square_edge(ranks: int) -> int:
    """q of the 2-D (SUMMA) grid, q² = ranks: the integer square root."""
    return math.isqrt(ranks)


# --------------------------------------------------------------------------------------
# Pipeline stages: which layers each virtual stage holds, and where it lives
# --------------------------------------------------------------------------------------
def split_layers(layers: int, chunks: int) -> list[int]:
    """Layer counts of `chunks` contiguous chunks, as even as possible (the first
    ``layers % chunks`` chunks get one more layer)."""
    if chunks < 1 or chunks > layers:
        raise ValueError(f"cannot split {layers} layers into {chunks} pipeline chunks")
    base, extra = divmod(layers, chunks)
    return [base + (1 if c < extra else 0) for c in range(chunks)]


def stage_layer_counts(layers: int, pp: int = 1, vpp: int = 1, explicit: tuple[int, ...] = ()) -> list[int]:
    """Layers of each of the pp·vpp virtual stages, in model order: `explicit`
    (``--stage-layers``) when given, else :func:`split_layers`."""
    if explicit:
        if len(explicit) != pp * vpp or sum(explicit) != layers:
            raise ValueError(f"stage_layers {tuple(explicit)} must have pp*vpp = {pp * vpp} entries summing to {layers}")
        return list(explicit)
    return split_layers(layers, pp * vpp)


def stage_layers(model: ModelConfig, layout: ParallelConfig) -> list[list[int]]:
    """Global layer ids of each of the pp·vpp virtual stages (model chunks), in order."""
    out, start = [], 0
    for n in stage_layer_counts(model.layers, layout.pp, layout.vpp, tuple(layout.stage_layers)):
        out.append(list(range(start, start + n)))
        start += n
    return out


def virtual_stage(chunk: int, pp_rank: int, pp: int) -> int:
    """The virtual stage of local chunk `chunk` on pipeline rank `pp_rank`: Megatron's
    interleaved assignment (PTD-P §2.2.2) gives rank r the stages r, r+p, r+2p, ..."""
    return chunk * pp + pp_rank


def stage_placement(stage: int, pp: int) -> tuple[int, int]:
    """(pipeline rank, local chunk) of virtual stage `stage`: the inverse of
    :func:`virtual_stage`."""
    return stage % pp, stage // pp


def holds_ends(pp_rank: int, pp: int, vpp: int = 1) -> tuple[bool, bool]:
    """Whether pipeline rank `pp_rank` holds the first virtual stage (the embeddings)
    and the last one (the final LayerNorm, the output layer and the loss)."""
    return pp_rank == 0, pp_rank == stage_placement(pp * vpp - 1, pp)[0]


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset '{name}': choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def validate_model(m: ModelConfig) -> None:
    for k in ("layers", "hidden", "heads", "seq_len", "vocab"):
        _need(getattr(m, k) > 0, f"--{k.replace('_', '-')} must be positive (got {getattr(m, k)})")
    _need(m.hidden % m.heads == 0,
          f"hidden size {m.hidden} is not divisible by {m.heads} heads: pick --hidden a multiple of --heads")
    _need(0.0 <= m.dropout < 1.0, f"dropout must be in [0, 1) (got {m.dropout})")
    _need(m.ffn >= 0, f"--ffn must be positive, or 0 for 4*hidden (got {m.ffn})")
    for k in ("hidden", "seq_len", "vocab", "ffn"):  # beyond this an index or a tensor size overflows
        _need(getattr(m, k) < 2**31, f"--{k.replace('_', '-')} {getattr(m, k)} is too large: it must be below 2**31")
    _need(m.activation in ("gelu", "gelu_tanh"), f"unknown activation '{m.activation}': use gelu or gelu_tanh")


def validate_parallel(m: ModelConfig, p: ParallelConfig, world: int | None = None) -> None:
    """Check the layout against the model (and the world size, when known)."""
    for k in ("dp", "tp", "pp", "vpp"):
        _need(getattr(p, k) >= 1, f"--{k} must be at least 1 (got {getattr(p, k)})")
    _need(p.cp >= 1, f"--cp must be at least 1 (got {p.cp})")
    world = world if world is not None else (p.nproc or p.world)
    cp = f"*cp = {p.dp}*{p.tp}*{p.pp}*{p.cp}" if p.cp > 1 else f" = {p.dp}*{p.tp}*{p.pp}"
    _need(world == p.world,
          f"world size {world} != dp*tp*pp{cp} = {p.world}: "
          f"set --nproc {p.world} or change --dp/--tp/--pp{'/--cp' if p.cp > 1 else ''}")
    _need(p.tp_mode in ("1d", "2d", "2.5d", "3d"), f"unknown --tp-mode '{p.tp_mode}': use 1d, 2d, 2.5d or 3d")
    _need(p.tp_depth >= 1, f"--tp-depth must be at least 1 (got {p.tp_depth})")
    _need(p.tp_depth == 1 or p.tp_mode == "2.5d", "--tp-depth is the depth of --tp-mode 2.5d: add --tp-mode 2.5d or drop it")
    _need(p.schedule in SCHEDULES, f"unknown schedule '{p.schedule}': choose one of {', '.join(SCHEDULES)}")
    _need(p.recompute in RECOMPUTE, f"unknown --recompute '{p.recompute}': choose one of {', '.join(RECOMPUTE)}")
    _need(p.backend in ("gloo", "nccl"), f"unknown --backend '{p.backend}': use gloo or nccl")
    _need(p.device in ("auto", "cpu", "cuda"), f"unknown --device '{p.device}': use auto, cpu or cuda")
    _need(p.backend != "nccl" or p.device != "cpu", "--backend nccl needs GPUs: drop --device cpu or use gloo")
    _need(p.precision in ("fp32", "bf16"), f"unknown --precision '{p.precision}': use fp32 or bf16")
    _need(p.dropout_rng in ("tensor", "global"),
          f"unknown --dropout-rng '{p.dropout_rng}': use tensor (per-rank streams) or global (exact masks)")
    _need(p.dp_impl in ("naive", "bucketed"), f"unknown --dp-impl '{p.dp_impl}': use naive or bucketed")
    _need(p.bucket_mb > 0 and math.isfinite(p.bucket_mb), f"--bucket-mb must be a positive finite number (got {p.bucket_mb})")
    _need(p.zero in (0, 1, 2, 3), f"unknown --zero {p.zero}: use 0, 1, 2 or 3 (ZeRO stage)")
    sharded = {1: "optimizer state", 2: "optimizer state and gradients", 3: "optimizer state, gradients and parameters"}
    _need(not p.zero1 or p.dp > 1, f"{'--zero1' if p.zero == 1 else f'--zero {p.zero}'} shards "
          f"{sharded.get(p.zero, 'model states')} over data parallel ranks: it needs --dp 2 or more")
    if p.zero >= 2:
        validate_zero(m, p)
    if p.tp_mode == "3d":
        q = p.cube_q
        _need(q ** 3 == p.tp, f"--tp-mode 3d needs a cube number of tensor ranks (8, 27, 64...), got --tp {p.tp}")
        _need(m.hidden % (q * q) == 0, f"3-D tensor parallelism needs hidden {m.hidden} divisible by q^2 = {q * q}")
        _need(m.heads % q == 0, f"3-D tensor parallelism needs {m.heads} heads divisible by q = {q}")
        _need(m.ffn_hidden % (q * q) == 0, f"3-D tensor parallelism needs FFN size {m.ffn_hidden} divisible by q^2 = {q * q}")
        _need(not p.sp, "--sp is a 1-D tensor parallel feature: drop it with --tp-mode 3d")
    elif p.tp_mode in ("2d", "2.5d"):
        q, d = p.summa_q, p.tp_depth
        _need(p.tp_mode == "2.5d" or q * q == p.tp,
              f"--tp-mode 2d needs a square number of tensor ranks (4, 9, 16...), got --tp {p.tp}")
        _need(p.tp_mode == "2d" or (p.tp % d == 0 and q * q * d == p.tp),
              f"--tp-mode 2.5d needs --tp = q^2 * d with d = --tp-depth: --tp {p.tp} is not a square times {d}")
        _need(m.hidden % q == 0, f"2-D tensor parallelism needs hidden {m.hidden} divisible by q = {q}")
        _need(m.heads % q == 0, f"2-D tensor parallelism needs {m.heads} heads divisible by q = {q}")
        _need(m.ffn_hidden % q == 0, f"2-D tensor parallelism needs FFN size {m.ffn_hidden} divisible by q = {q}")
        _need(not p.sp, f"--sp is a 1-D tensor parallel feature: drop it with --tp-mode {p.tp_mode}")
    else:
        _need(m.heads % p.tp == 0, f"{m.heads} heads are not divisible by --tp {p.tp}: pick --heads a multiple of --tp")
        _need(m.hidden % p.tp == 0, f"hidden {m.hidden} is not divisible by --tp {p.tp}")
        _need(m.ffn_hidden % p.tp == 0, f"FFN size {m.ffn_hidden} is not divisible by --tp {p.tp}")
        _need(not p.sp or m.seq_len % p.tp == 0,
              f"--sp splits the sequence: --seq-len {m.seq_len} must be divisible by --tp {p.tp}")
    _need(not p.sp or p.tp > 1, "--sp needs tensor parallelism: add --tp 2 or more")
    if p.cp > 1:
        validate_context_parallel(m, p)
    if p.pp > 1 or p.vpp > 1:
        if p.schedule == "interleaved":  # with --vpp 1 it is 1F1B
            _need(p.pp >= 2, "the interleaved schedule needs --pp 2 or more pipeline ranks")
        else:
            _need(p.vpp == 1, f"--vpp {p.vpp} needs --schedule interleaved")
        chunks = p.pp * p.vpp
        _need(chunks <= m.layers, f"pp*vpp = {chunks} model chunks but only {m.layers} layers: lower --pp/--vpp or add layers")
        if p.stage_layers:
            _need(len(p.stage_layers) == chunks,
                  f"--stage-layers has {len(p.stage_layers)} entries but pp*vpp = {chunks}: give one count per stage")
            _need(sum(p.stage_layers) == m.layers and min(p.stage_layers) >= 1,
                  f"--stage-layers {','.join(map(str, p.stage_layers))} must be positive and sum to {m.layers} layers")
    else:
        _need(not p.stage_layers, "--stage-layers needs pipeline parallelism (--pp 2 or more)")


def validate_zero(m: ModelConfig, p: ParallelConfig) -> None:
    """ZeRO-2/3 reduce-scatter every unit's gradient as soon as its backward is done; a
    gradient that must first be summed over another axis (ShardInfo.grad_sync) cannot be,
    so those layouts stay with --zero 1 (whose reduce-scatter waits for the whole step)."""
    z = f"--zero {p.zero}"
    _need(p.dp_impl == "bucketed", f"{z} reduce-scatters unit by unit during backward: drop --dp-impl {p.dp_impl}")
    _need(not p.sp, f"{z} cannot shard --sp's LayerNorm gradients (summed over tensor ranks first): drop --sp or use --zero 1")
    _need(p.tp_mode == "1d" or p.tp == 1,
          f"{z} composes with 1-D tensor parallelism only (--tp-mode {p.tp_mode} sums replicated gradients first): use --zero 1")
    _need(not (m.tied_embeddings and p.pp * p.vpp > 1),
          f"{z} cannot shard the tied embedding shared by the first and last stage: drop --tied or use --zero 1")
    if p.zero == 3:
        _need(not p.compile, "--zero 3 gathers parameters in module hooks that --compile would trace: drop --compile")
        _need(p.recompute != "full",
              "--zero 3 frees a block's parameters after its forward, which --recompute full replays: use selective or --zero 2")
        _need(p.schedule != "zb-h1" or p.pp == 1,
              "--zero 3 frees a block after its backward, which zb-h1 splits in two (B and W): use 1f1b or --zero 2")


def validate_context_parallel(m: ModelConfig, p: ParallelConfig) -> None:
    """Context parallelism cuts the sequence into 2·cp chunks (rank r holds chunks r and
    2·cp−1−r); it is written for 1-D tensor parallelism and exact (dropout-free) attention."""
    n = 2 * p.cp
    _need(m.seq_len % n == 0,
          f"--cp {p.cp} cuts the sequence into 2*cp = {n} chunks: --seq-len {m.seq_len} must be divisible by {n}")
    if p.sp:
        _need(m.seq_len % (n * p.tp) == 0,
              f"--cp {p.cp} with --sp splits each rank's {m.seq_len // p.cp} tokens over --tp {p.tp}: "
              f"--seq-len {m.seq_len} must be divisible by 2*cp*tp = {n * p.tp}")
    _need(p.tp_mode == "1d",
          f"--cp composes with 1-D tensor parallelism only: use --tp-mode 1d or drop --cp")
    _need(m.dropout == 0.0,
          f"--cp runs exact ring attention without dropout: set --dropout 0 or drop --cp")


def validate_train(t: TrainConfig, p: ParallelConfig) -> None:
    _need(t.steps > 0, f"--steps must be a positive number of steps (got {t.steps})")
    _need(t.microbatches >= 1, f"--microbatches must be at least 1 (got {t.microbatches})")
    _need(t.global_batch >= 1, f"--global-batch must be at least 1 (got {t.global_batch})")
    _need(t.global_batch % (p.dp * t.microbatches) == 0,
          f"--global-batch {t.global_batch} is not divisible by dp*microbatches = {p.dp}*{t.microbatches}: "
          f"use a multiple of {p.dp * t.microbatches}")
    _need(t.dtype in DTYPES, f"unknown --dtype '{t.dtype}': choose one of {', '.join(DTYPES)}")
    _need(t.lr > 0 and math.isfinite(t.lr), f"--lr must be a positive finite number (got {t.lr})")
    _need(t.log_every >= 1, f"--log-every must be at least 1 (got {t.log_every})")
    _need(0 <= t.seed < 2**32, f"--seed must be in 0..{2**32 - 1} (got {t.seed})")
    for flag, v in (("--stop-at", t.stop_at), ("--ckpt-every", t.ckpt_every), ("--eval-every", t.eval_every),
                    ("--sample", t.sample_tokens), ("--keep-last", t.keep_last)):
        _need(v >= 0, f"{flag} must be 0 (off) or a positive number (got {v})")
    _need(not t.stop_at or t.stop_at <= t.steps,
          f"--stop-at {t.stop_at} is past --steps {t.steps}: stop earlier or train more steps")
    _need(not t.resume or bool(t.ckpt_dir), "--resume needs --ckpt-dir: name the folder of the checkpoints to continue")
    _need(not (t.ckpt_every or t.keep_last) or bool(t.ckpt_dir),
          "--ckpt-every and --keep-last need --ckpt-dir: name the folder to write the checkpoints to")
    _need(not t.timeline or p.pp > 1,
          "--timeline records the pipeline's forward/backward actions: it needs --pp 2 or more (drop it otherwise)")
    if p.pp > 1 and p.vpp > 1 and p.schedule == "interleaved":  # any m >= p: microbatches go in groups
        _need(t.microbatches >= p.pp,
              f"interleaved schedule needs --microbatches ({t.microbatches}) of at least --pp {p.pp}")
    if p.tp_mode == "3d":
        q = p.cube_q
        mb = t.global_batch // (p.dp * t.microbatches)
        _need(mb % (q * q) == 0,
              f"3-D tensor parallelism splits the batch over q^2 = {q * q} ranks: microbatch size {mb} "
              f"(global batch / (dp*microbatches)) must be divisible by {q * q}")
    if p.tp_mode in ("2d", "2.5d"):
        pieces = p.summa_q * p.tp_depth
        mb = t.global_batch // (p.dp * t.microbatches)
        _need(mb % pieces == 0,
              f"--tp-mode {p.tp_mode} splits the batch over q*d = {pieces} ranks: microbatch size {mb} "
              f"(global batch / (dp*microbatches)) must be divisible by {pieces}")


def validate(m: ModelConfig, p: ParallelConfig, t: TrainConfig | None = None,
             world: int | None = None) -> None:
    """Raise ConfigError (one line: problem and fix) for any bad combination."""
    validate_model(m)
    validate_parallel(m, p, world)
    if t is not None:
        validate_train(t, p)


def pad_vocab(vocab: int, multiple: int) -> int:
    """Vocabulary padded up to a multiple of `multiple` (Megatron pads to 128*t)."""
    return int(math.ceil(vocab / multiple) * multiple)
