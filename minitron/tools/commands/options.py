"""The flags the commands share, read from the config dataclasses, and read back into them
(`model_from`, `layout_from`, `train_from`); the corpus checked once before any rank starts
(`check_data`); the names a command's answer gives a model and a flag's value."""
from __future__ import annotations

import argparse
import dataclasses
import zlib

from ...config import (CP_MODES, MODEL_CHOICES, PRESETS, RANK_TIMEOUT_S, SCHEDULES, ConfigError, ModelConfig,
                       ParallelConfig, TrainConfig, preset)


def add_model_args(ap):
    """One flag per field of ModelConfig (``--kv-heads``, ``--norm``, ...), its type and
    choices read from the dataclass: a new architecture knob needs no new flag here."""
    g = ap.add_argument_group("model")
    g.add_argument("--model", default="tiny", help=f"preset: {', '.join(PRESETS)}")
    for f in dataclasses.fields(ModelConfig):
        if f.name in ("name", "tied_embeddings"):
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            kind = {"int": int, "float": float, "str": str}.get(str(f.type), str)
            g.add_argument(flag, type=kind, default=None, choices=MODEL_CHOICES.get(f.name))
    g.add_argument("--tied", action="store_true", default=None, help="tie input and output embeddings")


def add_layout_args(ap):
    """The layout flags, one per ParallelConfig field a command line sets (`layout_from` reads them)."""
    g = ap.add_argument_group("layout")
    g.add_argument("--nproc", type=int, default=0, help="ranks to start locally (default dp*tp*pp)")
    for k in ("dp", "tp", "pp", "vpp"):
        g.add_argument(f"--{k}", type=int, default=1)
    g.add_argument("--cp", type=int, default=1,
                   help="context parallel: the sequence split over cp ranks (ring attention)")
    g.add_argument("--cp-mode", default="ring", choices=CP_MODES,
                   help="attention under --cp: ring (keys and values passed around), a2a (Ulysses all-to-all) "
                        "or usp (both, Fang & Zhao 2024: an all-to-all over --cp-a2a ranks, a ring over the rest)")
    g.add_argument("--cp-a2a", type=int, default=1,
                   help="with --cp-mode usp: U, the context ranks of one all-to-all (the ring runs over cp/U)")
    g.add_argument("--ep", type=int, default=1,
                   help="expert parallel: the experts of --experts split over ep ranks, which also split the batch")
    g.add_argument("--tp-mode", default="1d",
                   help="1d (Megatron), 2d (SUMMA, --tp q^2), 2.5d (Tesseract, --tp q^2*d) or 3d (cube, --tp q^3)")
    g.add_argument("--tp-depth", type=int, default=1, help="d of --tp-mode 2.5d: copies of the q x q grid")
    g.add_argument("--sp", action="store_true", help="sequence parallelism")
    g.add_argument("--tp-overlap", action="store_true",
                   help="with --sp on 1-D: each all-gather/reduce-scatter of the sequence decomposed into t chunks "
                        "on a ring, sent while the partial matmuls run (Wang et al. 2022, async TP); on 2-D and "
                        "2.5-D: each SUMMA step's broadcasts sent while the step before multiplies; on 3-D: a product's "
                        "two gathers at once, the weight's second half gathered while the first half multiplies, and "
                        "dX's reduce-scatter sent while dW is computed (Bian et al. 2021)")
    g.add_argument("--ep-overlap", action="store_true",
                   help="with --ep: each MoE call's all-to-alls in two halves (by local expert), one in flight while "
                        "the other's experts run (DeepSeek-V3 §3.2.1)")
    g.add_argument("--schedule", default="1f1b", help=", ".join(SCHEDULES))
    g.add_argument("--zero", type=int, default=0,
                   help="ZeRO stage over dp: 1 AdamW state, 2 + gradients (reduce-scattered in backward), "
                        "3 + parameters (gathered per block)")
    g.add_argument("--zero1", action="store_true", help="the same as --zero 1")
    g.add_argument("--dp-impl", default="bucketed",
                   help="naive (all-reduce per tensor after backward) or bucketed (overlapped with backward)")
    g.add_argument("--bucket-mb", type=float, default=4.0, help="gradient bucket size in MB (bucketed, zero1)")
    g.add_argument("--recompute", default="none", help="none, selective or full")
    g.add_argument("--scatter-gather", action="store_true")
    g.add_argument("--stage-layers", default="", help="uneven split, e.g. 1,3")
    g.add_argument("--backend", default="gloo", help="gloo or nccl")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda")
    g.add_argument("--precision", default="fp32",
                   help="fp32, bf16 (autocast, fp32 master weights) or fp8 (the linears' GEMMs in FP8)")
    g.add_argument("--fp8-recipe", default="tensorwise",
                   help="--precision fp8's scaling: tensorwise, delayed (amax history), rowwise or mxfp8")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer block (first steps pay the compilation)")
    g.add_argument("--dropout-rng", default=None,
                   help="tensor: per-rank streams (train default); global: single-device masks (verify default)")
    g.add_argument("--timeout", type=float, default=RANK_TIMEOUT_S, help="collective timeout, seconds")


def add_train_args(ap, steps=200, global_batch=16, dtype="float32"):
    """The training flags, with the command's own defaults for steps, batch and dtype."""
    g = ap.add_argument_group("training")
    g.add_argument("--steps", type=int, default=steps)
    g.add_argument("--global-batch", type=int, default=global_batch)
    g.add_argument("--microbatches", type=int, default=1)
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--data", default="", help="text file, folder of .txt, or a tokenized .bin "
                   "(from `minitron tokenize`; with --vocab N) (default: Shakespeare)")
    g.add_argument("--dtype", default=dtype, help="float32, float64 or bfloat16")
    g.add_argument("--trace", default="", help="write every collective as JSON lines here")
    g.add_argument("--timeline", default="", help="write a timeline here: each rank's calls (issued, waited for, done) and, with --pp, "
                        "the pipeline's actions")
    g.add_argument("--pack", action="store_true",
                   help="whole documents per sequence (ended by byte 0x1E, or the tokenizer's <|endoftext|>): "
                        "positions restart and attention stays inside each document")
    g.add_argument("--pack-balance", default="sequence", choices=("sequence", "document"),
                   help="with --pack and --cp: each rank holds chunks r and 2cp-1-r of the whole sequence, or of "
                        "every document, each padded to a multiple of 2cp (Megatron-Core's packed THD batches)")
    g.add_argument("--init-from", default="", metavar="HF_DIR",
                   help="start from a GPT-2, Llama, Qwen2, Qwen3, Mistral, Mixtral, Qwen2-MoE, OLMoE or "
                        "DeepSeek-V3 checkpoint (config.json + model.safetensors, Hugging Face format); "
                        "it decides the model's shape")


def add_run_args(ap, **train_defaults) -> None:
    """The model, layout and training flags, in that order, of a command that runs or sizes a
    training job (`train`, `verify`, `memory`, `bench`); `train_defaults` as add_train_args'."""
    add_model_args(ap)
    add_layout_args(ap)
    add_train_args(ap, **train_defaults)


def model_from(args) -> ModelConfig:
    """The ModelConfig of --model and the model flags (or of --init-from's directory)."""
    if getattr(args, "init_from", ""):
        return model_from_hf(args)
    model = preset(args.model)
    over = {f.name: getattr(args, f.name) for f in dataclasses.fields(ModelConfig)
            if getattr(args, f.name, None) is not None and f.name != "name"}
    if getattr(args, "tied", False):
        over["tied_embeddings"] = True
    return model.replace(**over) if over else model


def model_from_hf(args) -> ModelConfig:
    """The model of --init-from's Hugging Face directory (GPT-2, Llama, Qwen2, Qwen3, Mistral,
    Mixtral, Qwen2-MoE, OLMoE, DeepSeek-V3), checked like the engine's own before any rank
    starts (``hf.model_config``, names, shapes and values of the files); --seq-len may shorten
    its context, the model flags that do not change the loaded model apply, any other that
    differs is refused (``hf.apply_flags``)."""
    from ...hf import apply_flags, check_values, check_weights, model_config

    model = model_config(args.init_from, getattr(args, "seq_len", None), getattr(args, "dropout", None))
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(ModelConfig)
             if getattr(args, f.name, None) is not None and f.name not in ("name", "seq_len")}
    if getattr(args, "tied", False):
        given["tied_embeddings"] = True
    check_weights(args.init_from, model)  # names and shapes from the files' headers, before anything is built
    model = apply_flags(args.init_from, model, given)
    check_values(args.init_from, model)
    return model


def layout_from(args) -> ParallelConfig:
    """The ParallelConfig of the layout flags (verify's dropout default: global masks)."""
    try:
        stage = tuple(int(x) for x in args.stage_layers.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--stage-layers '{args.stage_layers}' must be comma-separated integers, e.g. 1,3") from None
    return ParallelConfig(nproc=args.nproc, dp=args.dp, tp=args.tp, pp=args.pp, vpp=args.vpp, cp=args.cp, ep=args.ep,
                          cp_mode=getattr(args, "cp_mode", "ring"), cp_a2a=getattr(args, "cp_a2a", 1),
                          tp_mode=args.tp_mode, tp_depth=args.tp_depth, sp=args.sp,
                          tp_overlap=getattr(args, "tp_overlap", False),
                          ep_overlap=getattr(args, "ep_overlap", False), schedule=args.schedule, zero1=args.zero1, zero=args.zero,
                          dp_impl=args.dp_impl, bucket_mb=args.bucket_mb, recompute=args.recompute,
                          scatter_gather=args.scatter_gather, stage_layers=stage, backend=args.backend,
                          device=args.device, compile=args.compile,
                          precision=args.precision, fp8_recipe=args.fp8_recipe, dropout_rng=args.dropout_rng or
                          ("global" if getattr(args, "cmd", "") == "verify" else "tensor"))


def train_from(args, **over) -> TrainConfig:
    """The TrainConfig of the training flags, `over` setting the command's own fields."""
    kw = dict(steps=args.steps, global_batch=args.global_batch, microbatches=args.microbatches,
              seed=args.seed, data=args.data, dtype=args.dtype, trace=args.trace, timeline=args.timeline,
              init_from=getattr(args, "init_from", ""), pack=getattr(args, "pack", False),
              pack_balance=getattr(args, "pack_balance", "sequence"))
    if kw["pack_balance"] == "document":  # the padding is the data's: the single-device reference reads it too
        kw["pack_pad"] = 2 * getattr(args, "cp", 1)
    if args.lr is not None:
        kw["lr"] = args.lr
    kw.update(over)
    return TrainConfig(**kw)


def check_data(model: ModelConfig, train: TrainConfig):
    """Load the corpus once up front, so a bad --data fails before any rank starts."""
    from ...data import check_corpus, load_corpus

    from ..preflight import check_token_ids

    try:
        corpus = load_corpus(train.data)
    except (OSError, EOFError, zlib.error) as e:  # a corrupt .gz, an unreadable file
        raise ConfigError(f"--data {train.data} cannot be read ({type(e).__name__}: {e}): it is corrupt, truncated "
                          f"or not readable; give another file") from None
    check_corpus(corpus.split()[1], model.seq_len, model.vocab)
    check_token_ids(corpus, model.vocab)
    if train.pack:  # documents in both splits, or one line now (the ranks would each refuse)
        from ...packing import PackedCorpus

        for part, what in zip(corpus.split(), ("the training split of --data", "the held-out tenth of --data")):
            PackedCorpus(part, model.seq_len, what)
    if train.init_from and corpus.vocab != model.vocab:  # ids must mean the tokens the weights learnt
        raise ConfigError(f"--data has a vocabulary of {corpus.vocab} but --init-from {train.init_from} has {model.vocab}: "
                          f"tokenize the text with the checkpoint's tokenizer (minitron tokenize --tokenizer FILE)")
    return corpus


def model_label(args, model) -> str:
    """The name a planner answer gives the model: the preset's when the model is exactly
    it, else ``custom (PRESET with field=value, ...)`` (model flags changed it)."""
    if getattr(args, "init_from", "") or args.model not in PRESETS:
        return model.name
    base = PRESETS[args.model]
    changed = [f"{f.name}={getattr(model, f.name)}" for f in dataclasses.fields(ModelConfig)
               if getattr(model, f.name) != getattr(base, f.name)]
    return f"custom ({args.model} with {', '.join(changed)})" if changed else model.name


def given_or_default(flag: str, value, given: bool) -> str:
    """`--flag value`, marked `(the default)` when the user did not give it."""
    return f"{flag} {value}" + ("" if given else " (the default)")
