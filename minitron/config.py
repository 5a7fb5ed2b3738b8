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
    """A decoder-only transformer, described once: every module, analysis and report
    reads its shape from here.

    The defaults are GPT-2's block (pre-LayerNorm with biases, learned positions, a GELU
    MLP of 4h, multi-head attention). The knobs give the Llama family's block (RMSNorm,
    SwiGLU with its own FFN size, rotary positions, grouped-query attention, no biases,
    untied head) and mixtures of experts (``experts > 0``: the MLP of every
    ``moe_every``-th block becomes a router and E experts of the same MLP kind).
    """

    layers: int = 2
    hidden: int = 32
    heads: int = 4
    seq_len: int = 32
    vocab: int = 256
    ffn: int = 0  # 0 means 4 * hidden
    tied_embeddings: bool = False
    dropout: float = 0.0
    activation: str = "gelu"  # "gelu" (erf), "gelu_tanh" (GPT-2's gelu_new) or "swiglu" (down(silu(gate x) * up x))
    name: str = "custom"
    norm: str = "layernorm"  # "layernorm" (GPT-2: weight and bias) or "rmsnorm" (Llama: weight only)
    norm_eps: float = 1e-5
    positions: str = "learned"  # "learned" (GPT-2's wpe table) or "rope" (rotary, Su et al. 2021)
    rope_base: float = 10000.0  # θ of the rotary angles: 10,000 in Llama 2, 500,000 in Llama 3
    kv_heads: int = 0  # key/value heads (grouped-query attention); 0 means heads (multi-head)
    bias: bool = True  # biases in the linears (and LayerNorm); Llama has none
    # --- mixture of experts (0 experts: every MLP dense) ---
    experts: int = 0  # E routed experts per MoE block
    top_k: int = 2  # experts each token is sent to
    moe_ffn: int = 0  # FFN size of one expert; 0 means the dense FFN size
    shared_experts: int = 0  # experts every token passes through (DeepSeek-MoE), beside the routed ones
    shared_ffn: int = 0  # the shared experts' one MLP width; 0 means shared_experts * moe_ffn (Qwen2-MoE sets it)
    shared_gate: bool = False  # the shared MLP's output times sigmoid(x·w), w [1, h] (Qwen2-MoE's shared_expert_gate)
    moe_every: int = 1  # block i is a MoE block when (i + 1) % moe_every == 0
    dense_blocks: str = ""  # comma-separated blocks that keep a dense MLP (Qwen2-MoE's mlp_only_layers)
    router: str = "softmax"  # scores: "softmax" (Switch, Mixtral) or "sigmoid" (DeepSeek-V3)
    aux_loss: float = 0.01  # α of the load-balancing loss α·E·Σ f_i·P_i (Switch Transformer); 0 off
    bias_update: float = 0.0  # γ of DeepSeek-V3's auxiliary-loss-free balancing; 0 off
    capacity_factor: float = 0.0  # 0: dropless; else ⌈k·tokens·cf/E⌉ tokens per expert, the rest dropped
    # --- long context and the Hugging Face families (Qwen2/3, Mistral, Llama 3.1) ---
    head_width: int = 0  # a head's width d; 0 means hidden/heads (Qwen3 and others set it apart)
    qkv_bias: bool = False  # biases on the Q, K, V projections even without --bias (Qwen2)
    qk_norm: bool = False  # RMSNorm of q and k before the rotation (Qwen3, OLMoE), over qk_norm_span
    qk_norm_span: str = "head"  # "head": each head's d (Qwen3); "all": the whole projection, heads·d and kv·d (OLMoE)
    window: int = 0  # sliding-window attention: a query sees its `window` latest keys (itself included); 0 off
    window_layers: str = ""  # pattern of L (windowed) and G (global) repeated over the layers; "" every layer
    rope_scaling: str = ""  # "" (none), "llama3" (Llama 3.1) or "yarn" (Peng et al. 2023), as transformers
    rope_factor: float = 8.0  # the context's scale factor of llama3 / yarn
    rope_original_context: int = 8192  # original_max_position_embeddings: the pre-training context
    rope_low_freq: float = 1.0  # llama3's low_freq_factor
    rope_high_freq: float = 4.0  # llama3's high_freq_factor
    rope_beta_fast: float = 32.0  # yarn's beta_fast (extrapolation boundary)
    rope_beta_slow: float = 1.0  # yarn's beta_slow (interpolation boundary)
    # the gates: "auto" renormalises the chosen scores when k > 1 or sigmoid (Switch's top-1 keeps its
    # softmax score); "always" whatever k (Mixtral as transformers computes it: a top-1 gate is 1);
    # "never": the chosen scores as they are (Qwen2-MoE and OLMoE with norm_topk_prob false, their default)
    gate_norm: str = "auto"
    # --- DeepSeek-V3's blocks (moe.py's group-limited routing, mla.py) ---
    expert_groups: int = 0  # n_group: the experts in equal groups (nodes); 0 or 1: no groups
    topk_groups: int = 0  # topk_group: the groups a token's experts may come from; 0: all
    routed_scaling: float = 1.0  # routed_scaling_factor: the routed experts' gates times this
    dense_layers: int = 0  # first_k_dense_replace: the first blocks keep a dense MLP
    attention: str = "standard"  # "standard" (multi-head / grouped-query) or "mla" (multi-head latent)
    q_lora_rank: int = 0  # MLA: the query latent's width (0: queries projected directly, DeepSeek-V2-Lite)
    kv_lora_rank: int = 0  # MLA: the key/value latent c_KV's width
    qk_nope_head_dim: int = 0  # MLA: a head's query/key dimensions without rotary positions
    qk_rope_head_dim: int = 0  # MLA: the decoupled rotary part (the shared key's width)
    v_head_dim: int = 0  # MLA: a head's value width
    mtp_depths: int = 0  # D multi-token prediction modules on the last stage (mtp.py); 0 off
    mtp_weight: float = 0.3  # λ of the MTP loss λ/D·Σ_k L_k (DeepSeek-V3 §4.2: 0.3, then 0.1)

    @property
    def ffn_hidden(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def head_dim(self) -> int:
        """A head's width d: ``head_width``, or hidden/heads."""
        return self.head_width or self.hidden // self.heads

    @property
    def q_width(self) -> int:
        """The queries' width heads·d (the attention output's, before the projection)."""
        return self.heads * self.head_dim

    def window_of(self, i: int) -> int:
        """The sliding window of block `i` (0: global attention): ``window`` where the
        repeated ``window_layers`` pattern reads L (every block without a pattern)."""
        pattern = self.window_layers or "L"
        return self.window if pattern[i % len(pattern)] == "L" else 0

    @property
    def n_kv_heads(self) -> int:
        """Key/value heads: ``kv_heads``, or every head (multi-head attention)."""
        return self.kv_heads or self.heads

    @property
    def moe_ffn_hidden(self) -> int:
        return self.moe_ffn or self.ffn_hidden

    @property
    def shared_ffn_hidden(self) -> int:
        """The shared experts' MLP width: ``shared_ffn``, or shared_experts·moe_ffn (0 without them)."""
        return (self.shared_ffn or self.shared_experts * self.moe_ffn_hidden) if self.shared_experts else 0

    @property
    def dense_block_ids(self) -> tuple[int, ...]:
        """The blocks ``dense_blocks`` keeps dense, as integers (validate_model checks the text)."""
        return tuple(int(i) for i in self.dense_blocks.split(",") if i.strip())

    def is_moe_block(self, i: int) -> bool:
        """Whether block `i` holds a mixture of experts instead of a dense MLP."""
        return (self.experts > 0 and (i + 1) % self.moe_every == 0 and i >= self.dense_layers
                and i not in self.dense_block_ids)

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def __repr__(self) -> str:
        """GPT-2's fields always, then only the knobs set away from GPT-2's block (a Llama
        block or a mixture of experts reads as what it changes)."""
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                 if f.name in _GPT2_FIELDS or getattr(self, f.name) != f.default]
        return f"ModelConfig({', '.join(shown)})"


_GPT2_FIELDS = ("layers", "hidden", "heads", "seq_len", "vocab", "ffn", "tied_embeddings", "dropout", "activation",
                "name")

# The Llama family's block: RMSNorm, SwiGLU, rotary positions, no biases, untied head.
LLAMA = dict(norm="rmsnorm", activation="swiglu", positions="rope", bias=False, tied_embeddings=False)


# DeepSeek-V3's attention and router kinds (ANCHORS "Round 4"): multi-head latent attention; sigmoid
# scores with the auxiliary-loss-free bias (γ = 0.001, §4.2), no balancing loss
DEEPSEEK_MLA = dict(attention="mla")
DEEPSEEK_ROUTER = dict(router="sigmoid", aux_loss=0.0, bias_update=0.001)

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
    # --- the Llama family (ANCHORS "Round 3"); tiny and small train here ---
    "llama-tiny": ModelConfig(layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, seq_len=32, vocab=256,
                              name="llama-tiny", **LLAMA),
    "llama-small": ModelConfig(layers=4, hidden=128, heads=8, kv_heads=2, ffn=352, seq_len=128, vocab=256,
                               name="llama-small", **LLAMA),
    # TinyLlama 1.1B (Zhang et al. 2024): 22 layers, 32 heads, 4 kv heads, θ 10,000.
    "tinyllama-1.1b": ModelConfig(layers=22, hidden=2048, heads=32, kv_heads=4, ffn=5632, seq_len=2048,
                                  vocab=32000, name="tinyllama-1.1b", **LLAMA),
    # Llama 3 (Grattafiori et al. 2024, Table 3): θ 500,000, vocabulary 128,256, 8 kv heads.
    "llama3-8b": ModelConfig(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, seq_len=8192,
                             vocab=128256, rope_base=500000.0, name="llama3-8b", **LLAMA),
    "llama3-70b": ModelConfig(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, seq_len=8192,
                              vocab=128256, rope_base=500000.0, name="llama3-70b", **LLAMA),
    "llama3-405b": ModelConfig(layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, seq_len=8192,
                               vocab=128256, rope_base=500000.0, name="llama3-405b", **LLAMA),
    # --- mixtures of experts ---
    "moe-tiny": ModelConfig(layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, seq_len=32, vocab=256,
                            experts=4, top_k=2, name="moe-tiny", **LLAMA),
    # Mixtral 8x7B (Jiang et al. 2024): Llama-shaped blocks, 8 experts, top-2, θ 1,000,000.
    "mixtral-8x7b": ModelConfig(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, seq_len=4096,
                                vocab=32000, rope_base=1e6, experts=8, top_k=2, name="mixtral-8x7b", **LLAMA),
    # --- DeepSeek-V3's blocks (ANCHORS "Round 4"): MLA, group-limited sigmoid routing, shared experts ---
    "deepseek-v3-tiny": ModelConfig(layers=4, hidden=32, heads=4, seq_len=16, vocab=256, ffn=64, dense_layers=1,
                                    **DEEPSEEK_MLA, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                                    qk_rope_head_dim=4, v_head_dim=8, experts=8, top_k=2, moe_ffn=16,
                                    shared_experts=1, expert_groups=4, topk_groups=2, routed_scaling=2.5,
                                    mtp_depths=1, **DEEPSEEK_ROUTER, name="deepseek-v3-tiny", **LLAMA),
    # DeepSeek-V3 (arXiv 2412.19437 §4.2; config.json): 671B parameters, 37B active (the MTP module apart)
    "deepseek-v3": ModelConfig(layers=61, hidden=7168, heads=128, seq_len=4096, vocab=129280, ffn=18432,
                               dense_layers=3, **DEEPSEEK_MLA, q_lora_rank=1536, kv_lora_rank=512,
                               qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, experts=256, top_k=8,
                               moe_ffn=2048, shared_experts=1, expert_groups=8, topk_groups=4, routed_scaling=2.5,
                               norm_eps=1e-6, **DEEPSEEK_ROUTER, name="deepseek-v3", **LLAMA),
    # DeepSeek-V2-Lite (arXiv 2405.04434 App. B; config.json): 15.7B, 2.4B active; queries not compressed,
    # a softmax router over 64 experts, no groups (its gates unnormalized: only its shape is used here)
    "deepseek-v2-lite": ModelConfig(layers=27, hidden=2048, heads=16, seq_len=4096, vocab=102400, ffn=10944,
                                    dense_layers=1, **DEEPSEEK_MLA, kv_lora_rank=512, qk_nope_head_dim=128,
                                    qk_rope_head_dim=64, v_head_dim=128, experts=64, top_k=6, moe_ffn=1408,
                                    shared_experts=2, norm_eps=1e-6, name="deepseek-v2-lite", **LLAMA),
}
TRAINABLE_PRESETS = ("tiny", "small", "medium", "llama-tiny", "llama-small", "moe-tiny", "deepseek-v3-tiny")


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
    cp_mode: str = "ring"  # attention under --cp: "ring" (K, V passed around), "a2a" (Ulysses: heads over cp)
    # or "usp" (both: Fang & Zhao 2024, the cp ranks a cp_a2a x cp/cp_a2a grid)
    cp_a2a: int = 1  # --cp-mode usp: U, the cp ranks of one all-to-all (the ring runs over the other cp/U)
    ep: int = 1  # expert parallel: the experts split over ep ranks, which also split the batch (like dp)
    tp_mode: str = "1d"  # "1d" (Megatron), "2d" (SUMMA, q^2), "2.5d" (Tesseract, q^2*d) or "3d" (cube, q^3)
    tp_depth: int = 1  # d of --tp-mode 2.5d: copies of the q x q grid, each on 1/d of the batch
    sp: bool = False
    tp_overlap: bool = False  # communication under the products it feeds: --sp's rings (1-D), SUMMA's (2-D, 2.5-D), the cube's (3-D)
    ep_overlap: bool = False  # the experts' all-to-alls in two halves, each in flight under the other's experts
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
    precision: str = "fp32"  # fp32 | bf16 (autocast, fp32 master weights) | fp8 (the linears' GEMMs)
    fp8_recipe: str = "tensorwise"  # --precision fp8's scaling: FP8_RECIPES (parallel/fp8.py)
    dropout_rng: str = "tensor"  # "tensor" (Megatron streams) | "global" (single-device masks, sliced)
    compile: bool = False  # torch.compile each transformer block (collectives stay eager)

    def __post_init__(self):
        # --zero1 and --zero 1 are one setting: zero1 reads "optimizer state is sharded"
        zero = self.zero if self.zero else (1 if self.zero1 else 0)
        object.__setattr__(self, "zero", zero)
        object.__setattr__(self, "zero1", zero >= 1)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp * self.ep

    @property
    def data_replicas(self) -> int:
        """Replicas that read different rows of the global batch: ep × dp."""
        return self.ep * self.dp

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
            s += f".cp{self.cp}" + (f".usp{self.cp_a2a}x{self.cp // self.cp_a2a}" if self.cp_mode == "usp" else "")
        if self.ep > 1:
            s += f".ep{self.ep}"
        if self.pp > 1:
            s += f".{self.schedule}"
            if self.vpp > 1:
                s += f".v{self.vpp}"
        for flag in ("sp", "tp_overlap", "ep_overlap", "zero1", "scatter_gather"):
            if getattr(self, flag):
                s += f".zero{self.zero}" if flag == "zero1" else f".{flag}"
        if self.recompute != "none":
            s += f".rc-{self.recompute}"
        return s


CKPT_FORMATS = ("minitron", "dcp")  # checkpoint.py's own shard files; DCP (dcp_format.py)


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
    ckpt_format: str = "minitron"  # "dcp": torch.distributed.checkpoint's files (dcp_format.py)
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
    allow_model_change: tuple = ()  # model fields a --resume may change (--allow-model-change)
    pack: bool = False  # whole documents per sequence, positions and attention per document (packing.py)
    pack_balance: str = "sequence"  # context-parallel chunks of the row, or of every document (packing.py)
    pack_pad: int = 0  # each document padded to a multiple of this (2*cp with --pack-balance document)

    def replace(self, **kw) -> "TrainConfig":
        return dataclasses.replace(self, **kw)


# The pipeline schedules (parallel/schedules.py builds each; analysis/bubble.py prices it):
# GPipe, 1F1B (PipeDream-Flush), interleaved 1F1B (PTD-P §2.2.2), zero-bubble H1 (Qi et al. 2024).
# V-shaped: two chunks per rank, rank r holding stages r and 2p-1-r (first and last on rank 0):
# ZB-V (Qi et al.) and DualPipe-V (DeepSeek-V3's DualPipe cut in half).
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe-v")
V_SCHEDULES = ("zb-v", "dualpipe-v")


def min_microbatches(schedule: str, pp: int) -> int:
    """The fewest microbatches a schedule runs with on `pp` ranks: interleaving needs a
    group of p; ZB-V fills both chunks with p (its chunk-1 warm-up is p forwards); DualPipe-V
    runs its steady F&B pairs only from 2p (as DeepSeek's DualPipeV requires); else 1."""
    return {"interleaved": pp, "zb-v": pp, "dualpipe-v": 2 * pp}.get(schedule, 1)
# The architecture knobs' choices (ModelConfig).
ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu")
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rope")
ROUTERS = ("softmax", "sigmoid")
GATE_NORMS = ("auto", "always", "never")  # ModelConfig.gate_norm
QK_NORM_SPANS = ("head", "all")  # ModelConfig.qk_norm_span
MODEL_CHOICES = {"activation": ACTIVATIONS, "norm": NORMS, "positions": POSITIONS, "router": ROUTERS,
                 "gate_norm": GATE_NORMS, "qk_norm_span": QK_NORM_SPANS}
RECOMPUTE = ("none", "selective", "full")
FP8_RECIPES = ("tensorwise", "delayed", "rowwise", "mxfp8")  # --fp8-recipe; their numerics: parallel/fp8.py
MX_BLOCK = 32  # OCP MX v1.0: the elements one MXFP8 scale covers (parallel/fp8.py reads it)
# context-parallel attention: ring (Liu et al. 2023), all-to-all (Ulysses) or both composed (USP, Fang & Zhao 2024)
CP_MODES = ("ring", "a2a", "usp")
# The training dtypes (``--dtype``) and the bytes of one element of each: parameters,
# gradients and optimizer state are held in this dtype (mixed precision is ``--precision``).
# The oracle's bar: a layout against the single-device model (minitron verify, the labs): float64
# agrees to rounding; float32 to its accumulated rounding over a few steps.
TOLERANCE: dict[str, float] = {"float64": 1e-9, "float32": 2e-4}
RANK_TIMEOUT_S = 300  # the ranks' collective timeout (--timeout's default): a peer silent this long has hung
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


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset '{name}': choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def validate_model(model: ModelConfig) -> None:
    for k in ("layers", "hidden", "heads", "seq_len", "vocab"):
        _need(getattr(model, k) > 0, f"--{k.replace('_', '-')} must be positive (got {getattr(model, k)})")
    _need(model.hidden % model.heads == 0 or model.head_width > 0,
          f"hidden size {model.hidden} is not divisible by {model.heads} heads: pick --hidden a multiple of --heads")
    _need(0.0 <= model.dropout < 1.0, f"dropout must be in [0, 1) (got {model.dropout})")
    _need(model.ffn >= 0, f"--ffn must be positive, or 0 for 4*hidden (got {model.ffn})")
    for k in ("hidden", "seq_len", "vocab", "ffn"):  # beyond this an index or a tensor size overflows
        _need(getattr(model, k) < 2**31,
              f"--{k.replace('_', '-')} {getattr(model, k)} is too large: it must be below 2**31")
    _need(model.activation in ACTIVATIONS,
          f"unknown activation '{model.activation}': choose one of {', '.join(ACTIVATIONS)}")
    _need(model.norm in NORMS, f"unknown --norm '{model.norm}': choose one of {', '.join(NORMS)}")
    _need(model.norm_eps > 0 and math.isfinite(model.norm_eps), f"--norm-eps must be positive (got {model.norm_eps})")
    _need(model.positions in POSITIONS, f"unknown --positions '{model.positions}': choose one of {', '.join(POSITIONS)}")
    _need(model.positions != "rope" or model.head_dim % 2 == 0,
          f"rotary positions turn pairs of a head's {model.head_dim} dimensions: pick hidden/heads even")
    validate_long_context(model)
    _need(model.rope_base > 1 and math.isfinite(model.rope_base), f"--rope-base must be above 1 (got {model.rope_base})")
    _need(model.kv_heads >= 0, f"--kv-heads must be positive, or 0 for every head (got {model.kv_heads})")
    _need(model.heads % model.n_kv_heads == 0,
          f"{model.heads} query heads cannot share {model.n_kv_heads} key/value heads evenly: "
          f"pick --kv-heads a divisor of --heads")
    if model.experts:
        _need(model.experts >= 2, f"--experts {model.experts}: a mixture needs 2 or more experts (or 0 for dense)")
        _need(1 <= model.top_k <= model.experts, f"--top-k {model.top_k} must be in 1..--experts {model.experts}")
        _need(model.moe_ffn >= 0 and model.shared_experts >= 0,
              "--moe-ffn and --shared-experts must be 0 or positive")
        _need(1 <= model.moe_every <= model.layers, f"--moe-every {model.moe_every} must be in 1..--layers {model.layers}")
        _need(model.router in ROUTERS, f"unknown --router '{model.router}': choose one of {', '.join(ROUTERS)}")
        _need(model.gate_norm in GATE_NORMS,
              f"unknown --gate-norm '{model.gate_norm}': choose one of {', '.join(GATE_NORMS)}")
        _need(model.aux_loss >= 0 and model.bias_update >= 0 and model.capacity_factor >= 0,
              "--aux-loss, --bias-update and --capacity-factor must be 0 (off) or positive")
    validate_shared_and_dense(model)
    _need(model.qk_norm_span in QK_NORM_SPANS,
          f"unknown --qk-norm-span '{model.qk_norm_span}': choose one of {', '.join(QK_NORM_SPANS)}")
    _need(model.qk_norm_span == "head" or model.qk_norm,
          f"--qk-norm-span {model.qk_norm_span} says what --qk-norm normalises: add --qk-norm")


def validate_shared_and_dense(model: ModelConfig) -> None:
    """The shared experts' own width and gate, and the blocks kept dense (Qwen2-MoE's knobs)."""
    _need(model.shared_ffn >= 0,
          f"--shared-ffn must be positive, or 0 for shared_experts*moe_ffn (got {model.shared_ffn})")
    _need(not (model.shared_ffn or model.shared_gate) or (model.experts and model.shared_experts),
          "--shared-ffn and --shared-gate act on the shared experts: add --experts and --shared-experts 1")
    ids = [i.strip() for i in model.dense_blocks.split(",") if i.strip()]
    _need(all(i.isdigit() and int(i) < model.layers for i in ids) and len(set(ids)) == len(ids),
          f"--dense-blocks '{model.dense_blocks}' must list distinct block indices in 0..{model.layers - 1}, "
          f"comma-separated (e.g. 0,3)")
    _need(not ids or model.experts, "--dense-blocks keeps blocks of a mixture dense: add --experts")


ROPE_SCALINGS = ("llama3", "yarn")  # transformers' ROPE_INIT_FUNCTIONS kinds minitron computes (rope.py)


def validate_long_context(model: ModelConfig) -> None:
    """The head width, the sliding window and its layer pattern, and rope scaling."""
    _need(model.head_width >= 0, f"--head-width must be positive, or 0 for hidden/heads (got {model.head_width})")
    _need(model.window >= 0, f"--window must be positive, or 0 for global attention (got {model.window})")
    _need(model.window <= model.seq_len,
          f"--window {model.window} is larger than --seq-len {model.seq_len}: pick a window of at most the sequence")
    _need(set(model.window_layers) <= {"L", "G"},
          f"--window-layers '{model.window_layers}' must be a pattern of L (windowed) and G (global), e.g. LG")
    _need(not model.window_layers or model.window > 0, "--window-layers needs --window: give the window's size")
    _need(not model.window or model.attention != "mla",
          "--window masks the standard attention only (MLA's attends to the whole sequence): drop --window or "
          "--attention mla")
    _need(model.rope_scaling in ("", *ROPE_SCALINGS),
          f"unknown --rope-scaling '{model.rope_scaling}': choose one of {', '.join(ROPE_SCALINGS)} (or none)")
    if model.rope_scaling:
        _need(model.positions == "rope", f"--rope-scaling {model.rope_scaling} scales rotary positions: add --positions rope")
        _need(model.rope_factor >= 1 and model.rope_original_context >= 1,
              f"--rope-factor must be at least 1 and --rope-original-context positive "
              f"(got {model.rope_factor}, {model.rope_original_context})")
        _need(model.rope_high_freq > model.rope_low_freq > 0 and model.rope_beta_fast > model.rope_beta_slow > 0,
              "--rope-high-freq must exceed --rope-low-freq and --rope-beta-fast --rope-beta-slow, all positive")


def validate_head_layout(model: ModelConfig, layout: ParallelConfig) -> None:
    """The head width apart from hidden/heads, the QKV biases and the q/k norms are written
    for 1-D tensor parallelism (the 2-D and 3-D grids split hidden and heads·d alike)."""
    custom = model.head_width or model.qkv_bias or model.qk_norm
    _need(not custom or layout.tp_mode == "1d" or layout.tp == 1,
          f"--head-width, --qkv-bias and --qk-norm compose with 1-D tensor parallelism only: "
          f"use --tp-mode 1d (got {layout.tp_mode})")
    # OLMoE's norm over all kv heads sums squares over the tensor group: a kv head copied on t/kv ranks
    # (t > kv, model.Attention) would be counted t/kv times
    _need(not model.qk_norm or model.qk_norm_span == "head" or layout.tp <= model.n_kv_heads,
          f"--qk-norm-span all normalises k over all {model.n_kv_heads} key/value heads, which --tp {layout.tp} "
          f"would replicate: use --tp {model.n_kv_heads} or less")


def validate_parallel(model: ModelConfig, layout: ParallelConfig, world: int | None = None) -> None:
    """Check the layout against the model (and the world size, when known)."""
    for k in ("dp", "tp", "pp", "vpp"):
        _need(getattr(layout, k) >= 1, f"--{k} must be at least 1 (got {getattr(layout, k)})")
    _need(layout.cp >= 1, f"--cp must be at least 1 (got {layout.cp})")
    _need(layout.ep >= 1, f"--ep must be at least 1 (got {layout.ep})")
    _need(layout.cp_a2a == 1 or layout.cp_mode == "usp",
          f"--cp-a2a {layout.cp_a2a} sizes USP's all-to-all: add --cp-mode usp or drop --cp-a2a")
    _need(layout.cp > 1 or layout.cp_mode != "usp",
          "--cp-mode usp splits the context ranks into all-to-all rows and rings: add --cp N (and --cp-a2a U) "
          "or drop --cp-mode usp")
    world = world if world is not None else (layout.nproc or layout.world)
    names = "dp*tp*pp" + ("*cp" if layout.cp > 1 else "") + ("*ep" if layout.ep > 1 else "")
    degrees = "*".join(str(getattr(layout, a)) for a in names.split("*"))
    _need(world == layout.world,
          f"world size {world} != {names} = {degrees} = {layout.world}: "
          f"set --nproc {layout.world} or change --{'/--'.join(names.split('*'))}")
    _need(layout.tp_mode in ("1d", "2d", "2.5d", "3d"), f"unknown --tp-mode '{layout.tp_mode}': use 1d, 2d, 2.5d or 3d")
    _need(layout.tp_depth >= 1, f"--tp-depth must be at least 1 (got {layout.tp_depth})")
    _need(layout.tp_depth == 1 or layout.tp_mode == "2.5d",
          "--tp-depth is the depth of --tp-mode 2.5d: add --tp-mode 2.5d or drop it")
    _need(layout.schedule in SCHEDULES, f"unknown schedule '{layout.schedule}': choose one of {', '.join(SCHEDULES)}")
    _need(layout.recompute in RECOMPUTE,
          f"unknown --recompute '{layout.recompute}': choose one of {', '.join(RECOMPUTE)}")
    _need(layout.backend in ("gloo", "nccl"), f"unknown --backend '{layout.backend}': use gloo or nccl")
    _need(layout.device in ("auto", "cpu", "cuda"), f"unknown --device '{layout.device}': use auto, cpu or cuda")
    _need(layout.backend != "nccl" or layout.device != "cpu", "--backend nccl needs GPUs: drop --device cpu or use gloo")
    _need(layout.precision in ("fp32", "bf16", "fp8"), f"unknown --precision '{layout.precision}': use fp32, bf16 or fp8")
    if layout.precision == "fp8":
        validate_fp8(model, layout)
    _need(layout.dropout_rng in ("tensor", "global"),
          f"unknown --dropout-rng '{layout.dropout_rng}': use tensor (per-rank streams) or global (exact masks)")
    _need(layout.dp_impl in ("naive", "bucketed"), f"unknown --dp-impl '{layout.dp_impl}': use naive or bucketed")
    _need(layout.bucket_mb > 0 and math.isfinite(layout.bucket_mb),
          f"--bucket-mb must be a positive finite number (got {layout.bucket_mb})")
    _need(layout.zero in (0, 1, 2, 3), f"unknown --zero {layout.zero}: use 0, 1, 2 or 3 (ZeRO stage)")
    sharded = {1: "optimizer state", 2: "optimizer state and gradients", 3: "optimizer state, gradients and parameters"}
    _need(not layout.zero1 or layout.data_replicas > 1,
          f"{'--zero1' if layout.zero == 1 else f'--zero {layout.zero}'} shards "
          f"{sharded.get(layout.zero, 'model states')} over data parallel ranks: it needs --dp 2 or more")
    if layout.zero >= 2:
        validate_zero(model, layout)
    if layout.tp_mode == "3d":
        q = layout.cube_q
        _need(q ** 3 == layout.tp,
              f"--tp-mode 3d needs a cube number of tensor ranks (8, 27, 64...), got --tp {layout.tp}")
        _need(model.hidden % (q * q) == 0, f"3-D tensor parallelism needs hidden {model.hidden} divisible by q^2 = {q * q}")
        _need(model.heads % q == 0, f"3-D tensor parallelism needs {model.heads} heads divisible by q = {q}")
        _need(model.ffn_hidden % (q * q) == 0,
              f"3-D tensor parallelism needs FFN size {model.ffn_hidden} divisible by q^2 = {q * q}")
        _need(not layout.sp, "--sp is a 1-D tensor parallel feature: drop it with --tp-mode 3d")
    elif layout.tp_mode in ("2d", "2.5d"):
        q, d = layout.summa_q, layout.tp_depth
        _need(layout.tp_mode == "2.5d" or q * q == layout.tp,
              f"--tp-mode 2d needs a square number of tensor ranks (4, 9, 16...), got --tp {layout.tp}")
        _need(layout.tp_mode == "2d" or (layout.tp % d == 0 and q * q * d == layout.tp),
              f"--tp-mode 2.5d needs --tp = q^2 * d with d = --tp-depth: --tp {layout.tp} is not a square times {d}")
        _need(model.hidden % q == 0, f"2-D tensor parallelism needs hidden {model.hidden} divisible by q = {q}")
        _need(model.heads % q == 0, f"2-D tensor parallelism needs {model.heads} heads divisible by q = {q}")
        _need(model.ffn_hidden % q == 0, f"2-D tensor parallelism needs FFN size {model.ffn_hidden} divisible by q = {q}")
        _need(not layout.sp, f"--sp is a 1-D tensor parallel feature: drop it with --tp-mode {layout.tp_mode}")
    else:
        _need(model.heads % layout.tp == 0,
              f"{model.heads} heads are not divisible by --tp {layout.tp}: pick --heads a multiple of --tp")
        _need(model.hidden % layout.tp == 0, f"hidden {model.hidden} is not divisible by --tp {layout.tp}")
        _need(model.ffn_hidden % layout.tp == 0, f"FFN size {model.ffn_hidden} is not divisible by --tp {layout.tp}")
        _need(not layout.sp or model.seq_len % layout.tp == 0,
              f"--sp splits the sequence: --seq-len {model.seq_len} must be divisible by --tp {layout.tp}")
    _need(not layout.sp or layout.tp > 1, "--sp needs tensor parallelism: add --tp 2 or more")
    if layout.tp_overlap:
        validate_tp_overlap(layout)
    validate_kv_heads(model, layout)
    validate_head_layout(model, layout)
    if layout.cp > 1:
        validate_context_parallel(model, layout)
    if model.experts or layout.ep > 1:
        validate_experts(model, layout)
    if layout.pp > 1 or layout.vpp > 1:
        if layout.schedule == "interleaved":  # with --vpp 1 it is 1F1B
            _need(layout.pp >= 2, "the interleaved schedule needs --pp 2 or more pipeline ranks")
        elif layout.schedule in V_SCHEDULES:  # rank r holds stages r and 2p-1-r
            _need(layout.vpp == 2, f"--schedule {layout.schedule} places two chunks per rank in a V "
                                   f"(stages r and 2p-1-r): use --vpp 2 (got --vpp {layout.vpp})")
            _need(layout.pp >= 2, f"--schedule {layout.schedule} needs --pp 2 or more pipeline ranks")
            _need(not model.tied_embeddings, f"--schedule {layout.schedule} puts the first and last stage in two "
                                              "chunks of rank 0, which the tied embedding does not support: drop --tied")
        else:
            _need(layout.vpp == 1, f"--vpp {layout.vpp} needs --schedule interleaved")
        chunks = layout.pp * layout.vpp
        _need(chunks <= model.layers,
              f"pp*vpp = {chunks} model chunks but only {model.layers} layers: lower --pp/--vpp or add layers")
        if layout.stage_layers:
            _need(len(layout.stage_layers) == chunks,
                  f"--stage-layers has {len(layout.stage_layers)} entries but pp*vpp = {chunks}: give one count per stage")
            _need(sum(layout.stage_layers) == model.layers and min(layout.stage_layers) >= 1,
                  f"--stage-layers {','.join(map(str, layout.stage_layers))} must be positive and sum to {model.layers} layers")
    else:
        _need(not layout.stage_layers, "--stage-layers needs pipeline parallelism (--pp 2 or more)")


def validate_tp_overlap(layout: ParallelConfig) -> None:
    """--tp-overlap hides tensor-parallel communication under the products it feeds. 1-D
    with --sp: the all-gathers and reduce-scatters decomposed into t chunks on a ring
    (parallel/collective_matmul.py), the chunks the t sequence shards --sp already requires,
    so no chunk count of its own can fail to divide the sequence. 2-D and 2.5-D (SUMMA on
    each of the d grids): each step's broadcasts prefetched under the step before's product
    (parallel/summa.py). 3-D (the cube): the two gathers of a product at once, the second
    half of the weight's gather under the first half's product, dX's reduce-scatter under
    dW's product (parallel/cube.py). Both move the plain bytes."""
    _need(layout.tp > 1, "--tp-overlap with --tp 1: nothing to overlap (no tensor-parallel collective): "
                         "add --tp 2 or more with --sp, or drop --tp-overlap")
    _need(layout.sp or layout.tp_mode != "1d", "--tp-overlap decomposes --sp's all-gathers and reduce-scatters: "
                                               "only 1-D with sequence parallelism for now, add --sp")
    _need(layout.precision != "fp8", "--tp-overlap decomposes the fp32/bf16 linears; the FP8 linears gather "
                                     "their input whole: use --precision fp32 or bf16, or drop --tp-overlap")
    split = layout.schedule in ("zb-h1", *V_SCHEDULES) and layout.pp > 1
    _need(not split or layout.tp_mode != "1d",
          f"--tp-overlap with --schedule {layout.schedule}: the split backward would all-gather a row-parallel "
          "linear's output gradient twice (in B and in W); use --schedule 1f1b, gpipe or interleaved")
    _need(not split, f"--tp-overlap on --tp-mode {layout.tp_mode} is not checked under --schedule "
                     f"{layout.schedule}'s split backward: use --schedule 1f1b, gpipe or interleaved")


def validate_zero(model: ModelConfig, layout: ParallelConfig) -> None:
    """ZeRO-2/3 reduce-scatter every unit's gradient as soon as its backward is done; a
    gradient that must first be summed over another axis (ShardInfo.grad_sync) cannot be,
    so those layouts stay with --zero 1 (whose reduce-scatter waits for the whole step)."""
    z = f"--zero {layout.zero}"
    _need(layout.dp_impl == "bucketed", f"{z} reduce-scatters unit by unit during backward: drop --dp-impl {layout.dp_impl}")
    _need(not layout.sp,
          f"{z} cannot shard --sp's LayerNorm gradients (summed over tensor ranks first): drop --sp or use --zero 1")
    _need(layout.tp_mode == "1d" or layout.tp == 1,
          f"{z} composes with 1-D tensor parallelism only (--tp-mode {layout.tp_mode} sums replicated gradients first): use --zero 1")
    _need(not (model.tied_embeddings and layout.pp * layout.vpp > 1),
          f"{z} cannot shard the tied embedding shared by the first and last stage: drop --tied or use --zero 1")
    if layout.zero == 3:
        _need(not layout.compile, "--zero 3 gathers parameters in module hooks that --compile would trace: drop --compile")
        _need(layout.recompute != "full",
              "--zero 3 frees a block's parameters after its forward, which --recompute full replays: use selective or --zero 2")
        _need(layout.schedule not in ("zb-h1", *V_SCHEDULES) or layout.pp == 1,
              f"--zero 3 frees a block after its backward, which {layout.schedule} splits in two (B and W): "
              "use 1f1b or --zero 2")


def validate_experts(model: ModelConfig, layout: ParallelConfig) -> None:
    """Mixture-of-experts blocks and expert parallelism (``--ep``): the experts split over
    ep ranks (each also reads its own rows of the batch), composed with data, 1-D tensor
    (each expert split over the tensor group like a dense MLP), sequence and pipeline
    parallelism, and context parallelism where routing is per token. What is not written
    is refused here."""
    _need(layout.ep == 1 or model.experts > 0, f"--ep {layout.ep} splits experts: add --experts (a multiple of {layout.ep})")
    _need(model.experts % layout.ep == 0,
          f"--experts {model.experts} cannot be split over --ep {layout.ep}: pick --experts a multiple of --ep")
    _need(layout.tp_mode == "1d" or layout.tp == 1,
          f"mixture-of-experts blocks compose with 1-D tensor parallelism only: use --tp-mode 1d (got {layout.tp_mode})")
    _need(model.moe_ffn_hidden % layout.tp == 0,
          f"expert FFN size {model.moe_ffn_hidden} is not divisible by --tp {layout.tp}: pick --moe-ffn a multiple of it")
    # each token is routed alone (DeepSeek-V3's bias-balanced, dropless router): nothing to see beyond
    # this context rank's tokens; a balancing loss or a capacity is taken over a microbatch's tokens
    _need(layout.cp == 1 or not (model.aux_loss or model.capacity_factor),
          "mixture-of-experts blocks with a balancing loss or a capacity take them over whole sequences, which "
          "--cp splits: set --aux-loss 0 --capacity-factor 0 (e.g. --bias-update) or drop --cp")
    _need(layout.cp == 1 or layout.ep == 1, "--ep is not written to compose with --cp: drop --cp or --ep")
    _need(layout.zero < 2 or layout.tp == 1,
          f"--zero {layout.zero} cannot shard the router's gradient (summed over tensor ranks first): use --zero 1 or --tp 1")
    if layout.ep_overlap:
        validate_ep_overlap(model, layout)


def validate_ep_overlap(model: ModelConfig, layout: ParallelConfig) -> None:
    """--ep-overlap splits each MoE call's rows in two halves by local expert
    (parallel/expert_overlap.py): it needs an all-to-all and two experts on every ep rank."""
    _need(layout.ep > 1, "--ep-overlap with --ep 1: nothing to overlap (no expert all-to-all): add --ep 2 or more, "
                         "or drop --ep-overlap")
    _need(model.experts // layout.ep >= 2,
          f"--ep-overlap splits each ep rank's experts in two halves, but --experts {model.experts} over --ep "
          f"{layout.ep} leaves {model.experts // layout.ep} per rank: use --experts {2 * layout.ep} or more, or a "
          f"smaller --ep")


def validate_context_parallel(model: ModelConfig, layout: ParallelConfig) -> None:
    """Context parallelism cuts the sequence into 2·cp chunks (rank r holds chunks r and
    2·cp−1−r); it is written for 1-D tensor parallelism and exact (dropout-free) attention."""
    n = 2 * layout.cp
    _need(model.seq_len % n == 0,
          f"--cp {layout.cp} cuts the sequence into 2*cp = {n} chunks: --seq-len {model.seq_len} must be divisible by {n}")
    if layout.sp:
        _need(model.seq_len % (n * layout.tp) == 0,
              f"--cp {layout.cp} with --sp splits each rank's {model.seq_len // layout.cp} tokens over --tp {layout.tp}: "
              f"--seq-len {model.seq_len} must be divisible by 2*cp*tp = {n * layout.tp}")
    _need(layout.tp_mode == "1d",
          "--cp composes with 1-D tensor parallelism only: use --tp-mode 1d or drop --cp")
    _need(model.dropout == 0.0,
          "--cp runs exact ring attention without dropout: set --dropout 0 or drop --cp")
    _need(layout.cp_mode in CP_MODES, f"unknown --cp-mode '{layout.cp_mode}': use {' or '.join(CP_MODES)}")
    if layout.cp_mode == "a2a":
        validate_a2a_heads(model, layout.tp, layout.cp)
    if layout.cp_mode == "usp":
        validate_usp(model, layout)


def validate_usp(model: ModelConfig, layout: ParallelConfig) -> None:
    """USP (Fang & Zhao 2024): the cp ranks a U x R grid, U = --cp-a2a ranks of one
    all-to-all (each tensor rank's heads split over them), R = cp/U ranks of one ring."""
    u, n = layout.cp_a2a, layout.cp
    _need(1 < u < n and n % u == 0,
          f"--cp-mode usp needs --cp-a2a U with 1 < U < --cp {n} and U dividing it (got {u}; "
          f"U = 1 is --cp-mode ring, U = cp is --cp-mode a2a)")
    validate_a2a_heads(model, layout.tp, u, mode="usp", over="--cp-a2a")


def validate_a2a_heads(model: ModelConfig, tp: int, cp: int, flag: str = "--cp-mode", mode: str = "a2a",
                       over: str = "--cp") -> None:
    """All-to-all (Ulysses) context parallelism splits each tensor rank's heads over the cp
    ranks (`over`: USP's --cp-a2a, those of its all-to-all): the query heads must divide,
    the key/value heads divide or be divided. The one rule `train` and the planner (`flag`:
    the option that chose `mode`) both apply."""
    heads, kv = model.heads // tp, max(1, model.n_kv_heads // tp)
    _need(heads % cp == 0,
          f"{flag} {mode} splits each tensor rank's {heads} heads over {over} {cp}: "
          f"pick --heads a multiple of tp*{over[2:]} = {tp * cp} or use {flag} ring")
    _need(kv % cp == 0 or cp % kv == 0,
          f"{flag} {mode} cannot split or replicate {kv} key/value heads per tensor rank over {over} {cp}: "
          f"pick --kv-heads so that it divides or is divided by {over}, or use {flag} ring")


def validate_kv_heads(model: ModelConfig, layout: ParallelConfig) -> None:
    """Grouped-query attention's key/value heads over the head-splitting axis: under 1-D
    tensor parallelism kv/t heads per rank (t ≤ kv), or each kv head replicated on the
    t/kv ranks holding its queries (t > kv; model.Attention); the 2-D and 3-D grids split
    them over q without copies."""
    kv, t = model.n_kv_heads, layout.tp
    if kv == model.heads or t == 1:
        return
    if layout.tp_mode == "1d":
        _need(kv % t == 0 or t % kv == 0,
              f"{kv} key/value heads can be neither split over --tp {t} nor replicated evenly on it: "
              f"pick --kv-heads a multiple or a divisor of --tp")
        _need(layout.zero < 2 or kv >= t,
              f"--zero {layout.zero} cannot shard the gradients of key/value heads replicated on --tp {t} > "
              f"--kv-heads {kv} (summed over their copies first): use --zero 1 or --kv-heads {t}")
    else:
        q = layout.cube_q if layout.tp_mode == "3d" else layout.summa_q
        _need(kv % q == 0, f"--tp-mode {layout.tp_mode} splits heads over q = {q} without copies: "
                           f"--kv-heads {kv} must be divisible by {q} (replicated kv heads are 1-D only)")


def mx_dims(model: ModelConfig, layout: ParallelConfig) -> dict[str, int]:
    """The reduction dims of the FP8 GEMMs on one tensor rank (forward: input features;
    input gradient: output features), by name: MXFP8 needs each a multiple of 32."""
    t, d, h, kv = layout.tp, model.head_dim, model.hidden, model.n_kv_heads
    width = (2 if model.activation == "swiglu" else 1) * model.ffn_hidden
    dims = {"hidden": h, "attention heads/tp (heads*head_dim/tp)": model.heads * d // t,
            "FFN/tp": model.ffn_hidden // t, "MLP fc rows/tp": width // t}
    if kv < model.heads:
        dims["key/value rows per tensor rank"] = 2 * d * max(1, kv // t)
    if model.shared_experts:
        dims["shared-expert FFN/tp"] = model.shared_experts * model.moe_ffn_hidden // t
    return dims


def validate_fp8(model: ModelConfig, layout: ParallelConfig) -> None:
    """--precision fp8: a known recipe, the 1-D linears, MX blocks inside every shard."""
    _need(layout.fp8_recipe in FP8_RECIPES,
          f"unknown --fp8-recipe '{layout.fp8_recipe}': choose one of {', '.join(FP8_RECIPES)}")
    _need(layout.tp_mode == "1d",
          f"--precision fp8 runs the 1-D tensor-parallel linears; --tp-mode {layout.tp_mode}'s blocked products "
          "would need an amax reduction per broadcast block (not built): use --tp-mode 1d or --precision fp32/bf16")
    if layout.fp8_recipe == "mxfp8":
        for what, n in mx_dims(model, layout).items():
            _need(n % MX_BLOCK == 0,
                  f"--fp8-recipe mxfp8 scales blocks of {MX_BLOCK} along each GEMM's reduction dim: {what} = {n} "
                  f"is not a multiple of {MX_BLOCK} (a block would {'straddle a shard' if layout.tp > 1 else 'be cut'}): "
                  f"resize the model or use --fp8-recipe tensorwise")


def validate_fp8_tokens(model: ModelConfig, layout: ParallelConfig, train: TrainConfig) -> None:
    """MXFP8's weight gradient reduces over a microbatch's tokens in blocks of 32 that must
    lie inside one rank's part of a sequence (its two chunks under --cp)."""
    piece = model.seq_len // (2 * layout.cp) if layout.cp > 1 else model.seq_len
    _need(piece % MX_BLOCK == 0,
          f"--fp8-recipe mxfp8 scales the weight gradient in blocks of {MX_BLOCK} tokens: a rank's "
          f"{'context chunk (seq_len/(2*cp))' if layout.cp > 1 else 'sequence'} of {piece} tokens is not a multiple "
          f"of {MX_BLOCK}: use a --seq-len multiple of {MX_BLOCK * (2 * layout.cp if layout.cp > 1 else 1)}")


def validate_train(train: TrainConfig, layout: ParallelConfig) -> None:
    _need(train.steps > 0, f"--steps must be a positive number of steps (got {train.steps})")
    _need(train.microbatches >= 1, f"--microbatches must be at least 1 (got {train.microbatches})")
    _need(train.global_batch >= 1, f"--global-batch must be at least 1 (got {train.global_batch})")
    d, dn = layout.data_replicas, ("ep*dp" if layout.ep > 1 else "dp")
    _need(train.global_batch % (d * train.microbatches) == 0,
          f"--global-batch {train.global_batch} is not divisible by {dn}*microbatches = {d}*{train.microbatches}: "
          f"use a multiple of {d * train.microbatches}")
    _need(train.dtype in DTYPES, f"unknown --dtype '{train.dtype}': choose one of {', '.join(DTYPES)}")
    _need(train.lr > 0 and math.isfinite(train.lr), f"--lr must be a positive finite number (got {train.lr})")
    _need(train.log_every >= 1, f"--log-every must be at least 1 (got {train.log_every})")
    _need(0 <= train.seed < 2**32, f"--seed must be in 0..{2**32 - 1} (got {train.seed})")
    for flag, v in (("--stop-at", train.stop_at), ("--ckpt-every", train.ckpt_every),
                    ("--eval-every", train.eval_every),
                    ("--sample", train.sample_tokens), ("--keep-last", train.keep_last)):
        _need(v >= 0, f"{flag} must be 0 (off) or a positive number (got {v})")
    _need(not train.stop_at or train.stop_at <= train.steps,
          f"--stop-at {train.stop_at} is past --steps {train.steps}: stop earlier or train more steps")
    _need(not train.resume or bool(train.ckpt_dir),
          "--resume needs --ckpt-dir: name the folder of the checkpoints to continue")
    _need(train.ckpt_format in CKPT_FORMATS,
          f"unknown --ckpt-format '{train.ckpt_format}': choose one of {', '.join(CKPT_FORMATS)}")
    _need(not (train.ckpt_every or train.keep_last) or bool(train.ckpt_dir),
          "--ckpt-every and --keep-last need --ckpt-dir: name the folder to write the checkpoints to")
    if layout.pp > 1 and layout.vpp > 1 and layout.schedule == "interleaved":  # any m >= p: microbatches go in groups
        _need(train.microbatches >= layout.pp,
              f"interleaved schedule needs --microbatches ({train.microbatches}) of at least --pp {layout.pp}")
    if layout.pp > 1 and layout.schedule in V_SCHEDULES:
        least = min_microbatches(layout.schedule, layout.pp)
        _need(train.microbatches >= least,
              f"--schedule {layout.schedule} on --pp {layout.pp} needs --microbatches of at least {least} "
              f"(got {train.microbatches}): raise --microbatches")
    if layout.tp_mode == "3d":
        q = layout.cube_q
        mb = train.global_batch // (layout.dp * train.microbatches)
        _need(mb % (q * q) == 0,
              f"3-D tensor parallelism splits the batch over q^2 = {q * q} ranks: microbatch size {mb} "
              f"(global batch / (dp*microbatches)) must be divisible by {q * q}")
    if layout.tp_mode in ("2d", "2.5d"):
        pieces = layout.summa_q * layout.tp_depth
        mb = train.global_batch // (layout.dp * train.microbatches)
        _need(mb % pieces == 0,
              f"--tp-mode {layout.tp_mode} splits the batch over q*d = {pieces} ranks: microbatch size {mb} "
              f"(global batch / (dp*microbatches)) must be divisible by {pieces}")


def validate(model: ModelConfig, layout: ParallelConfig, train: TrainConfig | None = None,
             world: int | None = None) -> None:
    """Raise ConfigError (one line: problem and fix) for any bad combination."""
    validate_model(model)
    validate_deepseek(model, layout)
    validate_parallel(model, layout, world)
    if train is not None:
        validate_train(train, layout)
        if train.pack or train.pack_balance != "sequence":
            validate_pack(model, layout, train)
        if layout.precision == "fp8" and layout.fp8_recipe == "mxfp8":
            validate_fp8_tokens(model, layout, train)


PACK_BALANCES = ("sequence", "document")


def validate_pack(model: ModelConfig, layout: ParallelConfig, train: TrainConfig | None = None) -> None:
    """--pack (packing.py): the document mask reaches the standard attention on one device,
    1-D tensor parallelism, the ring, the all-to-all and USP's both, and every pipeline stage;
    --pack-balance document pads each document to a multiple of 2*cp (``pack_pad``)."""
    if train is not None:
        _need(train.pack_balance in PACK_BALANCES,
              f"unknown --pack-balance '{train.pack_balance}': choose one of {', '.join(PACK_BALANCES)}")
        _need(train.pack or train.pack_balance == "sequence", "--pack-balance document needs --pack: add it")
        pad = train.pack_pad
        _need(pad >= 0 and (not pad or model.seq_len % pad == 0),
              f"--seq-len {model.seq_len} is not a multiple of the padding {pad} (2*cp): choose a multiple of it")
        if train.pack_balance == "document" and layout.cp > 1:
            _need(pad > 0 and pad % (2 * layout.cp) == 0,
                  f"--pack-balance document pads documents to 2*cp = {2 * layout.cp} (pack_pad {pad} given): "
                  f"set pack_pad to a multiple of {2 * layout.cp}, as the command line does")
            _need(layout.cp_mode != "usp", "--pack-balance document splits each document for the ring or the "
                                           "all-to-all, not USP's grid: use --pack-balance sequence with --cp-mode usp")
            _need(not model.window, "--pack-balance document splits documents, not windows: drop --window "
                                    "or use --pack-balance sequence")
    _need(model.attention != "mla", "--pack masks the standard attention only: drop --attention mla or --pack")
    _need(not model.mtp_depths, "--pack does not mask multi-token prediction's extra depths: drop --mtp-depths or --pack")
    _need(layout.tp_mode == "1d",
          f"--pack composes with 1-D tensor parallelism only (--tp-mode {layout.tp_mode} given): use --tp-mode 1d")


def pad_vocab(vocab: int, multiple: int) -> int:
    """Vocabulary padded up to a multiple of `multiple` (Megatron pads to 128*t)."""
    return int(math.ceil(vocab / multiple) * multiple)


def validate_deepseek(model: ModelConfig, layout: ParallelConfig) -> None:
    """DeepSeek-V3's knobs: group-limited routing and multi-head latent attention."""
    validate_expert_groups(model, layout)
    if model.attention != "standard":
        validate_mla(model, layout)
    if model.mtp_depths:
        validate_mtp(model, layout)


def validate_expert_groups(model: ModelConfig, layout: ParallelConfig) -> None:
    """Group-limited routing (moe.group_mask): G equal groups of consecutive experts, a
    token's experts from its best `topk_groups` of them; under --ep the groups lie on the
    ranks whole (G a multiple of ep) or each group on ep/G ranks, so a token's rows reach
    a bounded number of ranks (analysis.experts.dispatch_fan_out)."""
    G, k, E = model.expert_groups, model.topk_groups, model.experts
    _need(G >= 0 and k >= 0 and model.dense_layers >= 0, "--expert-groups, --topk-groups and --dense-layers "
          "must be 0 or positive")
    _need(model.routed_scaling > 0 and math.isfinite(model.routed_scaling),
          f"--routed-scaling must be positive (got {model.routed_scaling})")
    if G <= 1:
        _need(k <= 1, f"--topk-groups {k} needs --expert-groups: add --expert-groups (a divisor of --experts)")
        return
    _need(E > 0 and E % G == 0,
          f"--expert-groups {G} must divide --experts {E}: pick a divisor of the experts")
    _need(k <= G, f"--topk-groups {k} is more than the {G} expert groups: pick --topk-groups in 1..{G}")
    _need((k or G) * (E // G) >= model.top_k,
          f"--top-k {model.top_k} experts cannot come from {k or G} groups of {E // G}: raise --topk-groups")
    ep = layout.ep
    _need(ep == 1 or G % ep == 0 or ep % G == 0,
          f"--expert-groups {G} cannot be laid on --ep {ep} ranks: pick groups a multiple or a divisor of --ep")


def validate_mla(model: ModelConfig, layout: ParallelConfig) -> None:
    """Multi-head latent attention (mla.py): its shapes, and the layouts it is written for."""
    _need(model.attention == "mla", f"unknown --attention '{model.attention}': use standard or mla")
    h = model.hidden
    _need(model.kv_lora_rank > 0 and model.qk_nope_head_dim > 0 and model.v_head_dim > 0,
          "--attention mla needs --kv-lora-rank, --qk-nope-head-dim and --v-head-dim (positive)")
    _need(model.qk_rope_head_dim > 0 and model.qk_rope_head_dim % 2 == 0,
          f"--qk-rope-head-dim {model.qk_rope_head_dim}: the decoupled rotary key turns pairs: pick it even")
    for k in ("q_lora_rank", "kv_lora_rank"):
        rank = getattr(model, k)
        _need(0 <= rank <= h, f"--{k.replace('_', '-')} {rank} is larger than the width {h}: a latent compresses, "
                              f"pick it at most --hidden")
    _need(model.positions == "rope", "--attention mla rotates its decoupled key: set --positions rope")
    _need(layout.tp_mode == "1d" or layout.tp == 1, "--attention mla is written for 1-D tensor parallelism: "
                                                      "use --tp-mode 1d")
    _need(model.dropout == 0.0, "--attention mla has no attention dropout: set --dropout 0")


def validate_mtp(model: ModelConfig, layout: ParallelConfig) -> None:
    """Multi-token prediction (mtp.py): D depths on the last stage, reading the embedding
    there (a copy summed with the first stage's, as a tied embedding; in a V the first
    stage's own, on the same rank) and the tokens ahead of each position (taken from whole
    rows before --cp cuts them)."""
    d = model.mtp_depths
    _need(0 < d < model.seq_len, f"--mtp-depths {d} must be in 1..{model.seq_len - 1} (tokens ahead within a sequence)")
    _need(model.mtp_weight >= 0 and math.isfinite(model.mtp_weight), f"--mtp-weight must be 0 or positive (got {model.mtp_weight})")
    _need(layout.tp_mode == "1d" or layout.tp == 1, "--mtp-depths is written for 1-D tensor parallelism: use --tp-mode 1d")
    shared = ("the embedding that the V's first and last stage share on rank 0" if layout.schedule in V_SCHEDULES
              else "the last stage's copy of the embedding (summed with the first stage's first)")
    _need(layout.zero < 2 or layout.pp * layout.vpp == 1, f"--zero {layout.zero} cannot shard {shared}: use --zero 1")
