"""`minitron train | verify | schedule | memory | plan | bench | tokenize | sample | export | sweep | check-ckpt`:
the command line.

Every option is checked before any process group starts; bad input prints one line,
`minitron: error: <problem and fix>`, and exits with status 2 (an error inside a rank too,
as one line). A training run stopped by SIGTERM/SIGINT/SIGUSR1 after checkpointing exits
with status 75 (`preemption.EXIT_PREEMPTED`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import traceback
import zlib
from dataclasses import dataclass
from pathlib import Path

from ..config import (CKPT_FORMATS, CP_MODES, MODEL_CHOICES, ConfigError, ModelConfig, ParallelConfig, TrainConfig, PRESETS, SCHEDULES,
                     preset, validate, validate_model)
from .preflight import PLOT_TYPES, check_output_file, check_outputs, finite_positive, inputs_of


# --- arguments ---------------------------------------------------------------------------
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
    g = ap.add_argument_group("layout")
    g.add_argument("--nproc", type=int, default=0, help="ranks to start locally (default dp*tp*pp)")
    for k in ("dp", "tp", "pp", "vpp"):
        g.add_argument(f"--{k}", type=int, default=1)
    g.add_argument("--cp", type=int, default=1,
                   help="context parallel: the sequence split over cp ranks (ring attention)")
    g.add_argument("--cp-mode", default="ring", choices=CP_MODES,
                   help="attention under --cp: ring (keys and values passed around) or a2a (Ulysses all-to-all)")
    g.add_argument("--ep", type=int, default=1,
                   help="expert parallel: the experts of --experts split over ep ranks, which also split the batch")
    g.add_argument("--tp-mode", default="1d",
                   help="1d (Megatron), 2d (SUMMA, --tp q^2), 2.5d (Tesseract, --tp q^2*d) or 3d (cube, --tp q^3)")
    g.add_argument("--tp-depth", type=int, default=1, help="d of --tp-mode 2.5d: copies of the q x q grid")
    g.add_argument("--sp", action="store_true", help="sequence parallelism")
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
    g.add_argument("--timeout", type=float, default=300, help="collective timeout, seconds")


def add_train_args(ap, steps=200, global_batch=16, dtype="float32"):
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
    g.add_argument("--timeline", default="", help="write pipeline action timings here")
    g.add_argument("--init-from", default="", metavar="HF_DIR",
                   help="start from a GPT-2 or Llama checkpoint (config.json + model.safetensors, Hugging Face format); "
                        "it decides the model's shape")


def model_from(args) -> ModelConfig:
    if getattr(args, "init_from", ""):
        return model_from_hf(args)
    model = preset(args.model)
    over = {f.name: getattr(args, f.name) for f in dataclasses.fields(ModelConfig)
            if getattr(args, f.name, None) is not None and f.name != "name"}
    if getattr(args, "tied", False):
        over["tied_embeddings"] = True
    return model.replace(**over) if over else model


def model_from_hf(args) -> ModelConfig:
    """The model of --init-from's GPT-2, Llama or Mixtral directory, checked like the engine's
    own before any rank starts (``hf.model_config``, names, shapes and values of the files);
    --seq-len may shorten its context, the model flags that do not change the loaded model
    apply, any other that differs is refused (``hf.apply_flags``)."""
    from ..hf import apply_flags, check_values, check_weights, model_config

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
    try:
        stage = tuple(int(x) for x in args.stage_layers.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--stage-layers '{args.stage_layers}' must be comma-separated integers, e.g. 1,3") from None
    return ParallelConfig(nproc=args.nproc, dp=args.dp, tp=args.tp, pp=args.pp, vpp=args.vpp, cp=args.cp, ep=args.ep,
                          cp_mode=getattr(args, "cp_mode", "ring"),
                          tp_mode=args.tp_mode, tp_depth=args.tp_depth, sp=args.sp, schedule=args.schedule, zero1=args.zero1, zero=args.zero,
                          dp_impl=args.dp_impl, bucket_mb=args.bucket_mb, recompute=args.recompute,
                          scatter_gather=args.scatter_gather, stage_layers=stage, backend=args.backend,
                          device=args.device, compile=args.compile,
                          precision=args.precision, fp8_recipe=args.fp8_recipe, dropout_rng=args.dropout_rng or
                          ("global" if getattr(args, "cmd", "") == "verify" else "tensor"))


def train_from(args, **over) -> TrainConfig:
    kw = dict(steps=args.steps, global_batch=args.global_batch, microbatches=args.microbatches,
              seed=args.seed, data=args.data, dtype=args.dtype, trace=args.trace, timeline=args.timeline,
              init_from=getattr(args, "init_from", ""))
    if args.lr is not None:
        kw["lr"] = args.lr
    kw.update(over)
    return TrainConfig(**kw)


def check_data(model: ModelConfig, train: TrainConfig):
    """Load the corpus once up front, so a bad --data fails before any rank starts."""
    from ..data import check_corpus, load_corpus

    from .preflight import check_token_ids

    try:
        corpus = load_corpus(train.data)
    except (OSError, EOFError, zlib.error) as e:  # a corrupt .gz, an unreadable file
        raise ConfigError(f"--data {train.data} cannot be read ({type(e).__name__}: {e}): it is corrupt, truncated "
                          f"or not readable; give another file") from None
    check_corpus(corpus.split()[1], model.seq_len, model.vocab)
    check_token_ids(corpus, model.vocab)
    if train.init_from and corpus.vocab != model.vocab:  # ids must mean the tokens the weights learnt
        raise ConfigError(f"--data has a vocabulary of {corpus.vocab} but --init-from {train.init_from} has {model.vocab}: "
                          f"tokenize the text with the checkpoint's tokenizer (minitron tokenize --tokenizer FILE)")
    return corpus


# --- running on every rank ----------------------------------------------------------------
class Interrupted(Exception):
    """The launcher got SIGTERM/SIGINT while its ranks ran (they were told to stop too)."""

    def __init__(self, sig):
        super().__init__(sig.name)
        self.signal = sig


@dataclass
class RankFailed:
    """What a rank returns instead of raising: the launcher reports one line, not 80."""

    rank: int
    message: str
    config: bool  # a ConfigError (the cause) rather than a consequence (a peer that left)


def preflight(model, layout, train) -> None:
    """What the machine must offer before any rank starts: GPUs, a launcher, memory."""
    from .preflight import check_environment, check_memory

    check_environment(layout)
    check_memory(model, layout, train)


def run_ranks(job, model, layout, train, corpus, extra=None):
    """Run `job(comm, m, p, t, corpus, extra)` on every rank; return rank 0's result.
    A rank's error becomes one ConfigError here (the cause first: a refusal, then the
    lowest rank's failure); a signal to the launcher becomes :class:`Interrupted`."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from .. import launch
    from ..preemption import SignalLog, installed_log

    preflight(model, layout, train)
    world = layout.world
    if world == 1 or launch.under_launcher():
        if launch.under_launcher() and launch.env_world() != world:
            raise ConfigError(f"the launcher started {launch.env_world()} ranks but the layout has {world}: "
                              f"match --nproc-per-node/--ntasks to the layout")
        if job is _train_job and threading.current_thread() is threading.main_thread() and installed_log() is None:
            SignalLog().install()  # a preemption during start-up is noted, not fatal
        results = {0: _rank_main(job, model, layout, train, corpus, extra)}
    else:
        try:
            results = launch.launch_local(_rank_main, (job, model, layout, train, corpus, extra), world,
                                          stop_on_signal=job is _train_job, timeout_s=(extra or {}).get("timeout", 300))
        except SignalException as e:
            raise Interrupted(e.sigval) from None
        except launch.RankLost as e:  # the launcher's watchdog: a rank died or stopped answering
            raise ConfigError(f"{e.lost}; the other ranks were ended (MINITRON_DEBUG=1 shows their messages)") from None
        except ChildFailedError as e:
            rank, failure = e.get_first_failure()
            how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
            hint = ("its launcher died" if failure.exitcode == launch.EXIT_ORPHANED else
                    "out of memory?" if failure.exitcode in (-9, 137) else "see the messages above")
            raise ConfigError(f"rank {rank} died ({how}; {hint}): rerun with fewer ranks or a smaller model "
                              f"to narrow it down") from None
    failed = sorted((r for r in results.values() if isinstance(r, RankFailed)), key=lambda f: (not f.config, f.rank))
    if failed:
        raise ConfigError(failed[0].message)
    return results[0]


def reporting() -> bool:
    """Only global rank 0 reports (every rank runs this CLI under torchrun/srun)."""
    from .. import launch

    return not launch.under_launcher() or int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0))) == 0


def _rank_main(job, model, layout, train, corpus, extra):
    from .. import launch

    rank = int(os.environ.get("RANK", 0))
    try:
        comm = launch.setup_rank(layout, layout.backend, (extra or {}).get("timeout", 300), trace=bool(train.trace))
        try:
            return job(comm, model, layout, train, corpus, extra)
        finally:
            launch.teardown()
    except ConfigError as e:
        return RankFailed(rank, str(e), True)
    except Exception as e:  # noqa: BLE001 - a rank reports, the launcher prints one line
        if os.environ.get("MINITRON_DEBUG"):
            traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return RankFailed(rank, f"rank {rank} failed: {type(e).__name__}: {first} "
                                f"(MINITRON_DEBUG=1 prints the traceback)", False)


def _train_job(comm, model, layout, train, corpus, extra):
    from ..preemption import agree_before_start, process_group_store
    from ..train import train as run_training

    signalled = agree_before_start(process_group_store(), comm.grid.world, comm.grid.rank)
    if signalled:  # a rank was signalled while starting: no rank trains (preemption.py)
        return {"preempted": {"step": None, "signal": signalled, "checkpoint": False}}

    observer = (extra or {}).get("report")
    if observer is not None and comm.grid.rank == 0:  # MFU's denominator, measured on this machine
        from .bench import matmul_peak, probe_dtype

        observer.peak_flops = matmul_peak(probe_dtype(layout, train))
    return run_training(model, layout, train, comm, corpus=corpus, observer=observer)


# --- commands ------------------------------------------------------------------------------
def cmd_train(args) -> int:
    """`minitron train`, holding --ckpt-dir's lock (checkpoint.FolderLock) from its checks to its end."""
    from ..checkpoint import FolderLock
    from .preflight import check_rank_numbers

    check_rank_numbers(os.environ)  # reporting() reads them
    with FolderLock(args.ckpt_dir if reporting() else "") as lock:
        return _train_command(args, lock)


def _train_command(args, lock) -> int:
    model, layout = model_from(args), layout_from(args)
    from ..checkpoint import latest
    from ..preemption import EXIT_PREEMPTED, installed_log
    from .preflight import (AlreadyDone, allowed_model_changes, check_output_dir, check_outputs, check_resume,
                            inputs_of, lock_ckpt_dir, prepare_ckpt_dir, trim_metrics)

    train = train_from(args, ckpt_dir=args.ckpt_dir, ckpt_every=args.ckpt_every, resume=bool(args.resume),
                   stop_at=args.stop_at, metrics=args.metrics, eval_every=args.eval_every, progress=not args.no_progress,
                   sample_tokens=args.sample, log_every=args.log_every, keep_last=args.keep_last,
                   ckpt_format=args.ckpt_format,
                   allow_model_change=allowed_model_changes(args.allow_model_change, bool(args.resume)))
    validate(model, layout, train)
    corpus = check_data(model, train)
    if train.ckpt_dir:  # checked, then locked before anything reads or deletes it
        prepare_ckpt_dir(train.ckpt_dir, args.resume, args.overwrite, inputs_of(train), delete=False)
        lock_ckpt_dir(lock)
    try:
        start = check_resume(train.ckpt_dir, args.resume, model, train, corpus,
                             args.allow_resume_change, layout=layout) if train.resume else 0
    except AlreadyDone as done:  # a requeued job preempted in its last step: its work is done
        print(f"minitron: {done}", file=sys.stderr)
        return 0
    check_outputs({"--metrics": train.metrics, "--trace": train.trace, "--timeline": train.timeline}, inputs_of(train),
                  train.ckpt_dir)
    if getattr(args, "tensorboard", ""):
        check_output_dir("--tensorboard", args.tensorboard, inputs_of(train), train.ckpt_dir)
    if train.ckpt_dir:
        prepare_ckpt_dir(train.ckpt_dir, args.resume, args.overwrite, inputs_of(train), delete=reporting())
    for path in (train.trace, train.metrics, train.timeline) if reporting() else ():  # one writer under srun
        if path and not (path == train.metrics and start):  # a resumed run appends its metrics
            Path(path).unlink(missing_ok=True)
    if reporting():
        trim_metrics(train.metrics if start else "", start)  # steps after the checkpoint are trained again
    observer = None
    if not args.no_report or args.tensorboard:
        from .report import RunReport

        if args.tensorboard:
            from .tensorboard_log import check_available

            check_available()
        observer = RunReport(model, layout, train, tensorboard_dir=args.tensorboard)
    early = installed_log()
    if early is not None and early.signal:  # signalled while checking: start no rank
        return stopped_before_training(early.signal, train, start)
    try:
        summary = run_ranks(_train_job, model, layout, train, corpus, {"timeout": args.timeout, "report": observer})
    except Interrupted as e:  # the launcher was signalled; its ranks stopped at a step boundary
        now = latest(train.ckpt_dir) if train.ckpt_dir else None
        step = int(now.name.split("_")[1]) if now is not None else 0
        if now is None or step <= start:
            print(f"minitron: stopped by {e.signal.name} before a checkpoint was written", file=sys.stderr)
            return 128 + e.signal.value
        print(f"minitron: stopped by {e.signal.name} after step {step}; checkpoint {now}: "
              f"continue with --resume (exit code {EXIT_PREEMPTED})", file=sys.stderr)
        return EXIT_PREEMPTED
    if summary.get("preempted"):
        pre = summary["preempted"]
        if pre["step"] is None:
            return stopped_before_training(pre["signal"], train, start)
        if reporting():
            where = f"checkpoint {latest(train.ckpt_dir)}: continue with --resume" if pre["checkpoint"] else \
                "no --ckpt-dir, nothing saved"
            print(f"minitron: stopped by {pre['signal']} after step {pre['step']}; {where} "
                  f"(exit code {EXIT_PREEMPTED})", file=sys.stderr)
        return EXIT_PREEMPTED
    if not reporting():
        return 0
    if summary["val_losses"]:
        from ..viz.loss import loss_reference

        print(validation_summary(summary["val_losses"]))
        print(loss_reference(corpus, builtin=not train.data))
    if summary.get("sample"):
        print("--- sample ---")
        print(summary["sample"])
        print("--------------")
    if summary.get("report") and not args.no_report:
        from ..viz.loss import loss_unit
        from .report import format_report, plot_losses

        print(format_report(summary["report"], summary.get("tokens_per_s")))
        if train.metrics:
            fig = plot_losses(summary["losses"], summary["val_losses"], str(Path(train.metrics).with_suffix(".loss.png")),
                              f"{model.name} on {layout.describe()}", first_step=start + 1, unit=loss_unit(corpus))
            if fig:
                print(f"loss curve written to {fig}")
    if args.tensorboard:
        print(f"TensorBoard scalars written to {args.tensorboard} (tensorboard --logdir {args.tensorboard})")
    if train.metrics:
        print(f"metrics written to {train.metrics}")
    if train.trace:
        print(f"communication trace written to {train.trace}")
    if train.ckpt_dir:
        print(f"checkpoint written to {latest(train.ckpt_dir)}: try "
              f"`minitron sample --ckpt-dir {train.ckpt_dir}` (text from the trained model)")
    return 0


def stopped_before_training(sig: str, train: TrainConfig, start: int) -> int:
    """A signal before the first step: no step ran, nothing was saved or lost; say so and
    exit with EXIT_PREEMPTED, as a run stopped later does (preemption.py says why)."""
    from ..preemption import EXIT_PREEMPTED

    if reporting():
        again = (f"the checkpoint of step {start} in {train.ckpt_dir} is unchanged: continue with --resume" if start else
                 "nothing was trained: run the same command again")
        print(f"minitron: stopped by {sig} before {f'step {start + 1}' if start else 'the first step'}; {again} "
              f"(exit code {EXIT_PREEMPTED})",
              file=sys.stderr)
    return EXIT_PREEMPTED


def validation_summary(val_losses: dict) -> str:
    """One line on {step: validation loss}: the change from the first evaluation to the last,
    or, when there was only one (--eval-every 0 evaluates before the first step alone), that one."""
    (s0, first), (s1, last) = min(val_losses.items()), max(val_losses.items())
    if s0 == s1:
        return f"validation loss {first:.3f} at step {s0} (the only evaluation; --eval-every N evaluates every N steps)"
    change = 100 * (1 - last / first)
    return (f"validation loss {first:.3f} (step {s0}) -> {last:.3f} (step {s1}): "
            f"{abs(change):.1f}% {'lower' if change >= 0 else 'higher'}")


def cmd_verify(args) -> int:
    from .verify import verify_job

    model, layout = model_from(args), layout_from(args)
    gb = args.global_batch or layout.data_replicas * args.microbatches * max(2, layout.cube_q ** 2, layout.summa_q * layout.tp_depth)
    train = train_from(args, global_batch=gb, lr=args.lr or 1e-2, warmup=1, eval_every=0, progress=False)
    validate(model, layout, train)
    if args.tol is not None:
        finite_positive("--tol", args.tol)
    corpus = check_data(model, train)
    check_outputs({"--trace": train.trace, "--timeline": train.timeline}, inputs_of(train))
    for path in (train.trace, train.timeline):
        if path:
            Path(path).unlink(missing_ok=True)
    if reporting():  # the ranks' start-up (each imports torch) is the first silent stretch
        print(f"verify: starting {layout.world} ranks, then {train.steps} steps of {layout.describe()} and the same "
              f"steps on one device", file=sys.stderr, flush=True)
    res = run_ranks(verify_job, model, layout, train, corpus, {"timeout": args.timeout, "tol": args.tol})
    if not reporting():
        return 0
    if not args.json:
        print(f"verify {res['layout']} vs single device, {res['steps']} steps, {train.dtype}"
              f"{' with bf16 compute' if layout.precision == 'bf16' else ''}:")
        print(f"  max |loss diff|        {res['max_loss_abs_diff']:.3e}")
        print(f"  max param rel diff     {res['max_param_rel_diff']:.3e}   (worst: {res['worst_param']})")
        if "fn_rel_diff" in res:  # bf16: the verdict is the function's (tools/verify.py, bf16_measures)
            within = all(d <= b for d, b in zip(res["loss_abs_diffs"], res["loss_bounds"]))
            print(f"  losses within bf16     {'yes' if within else 'NO'}   (step i: 4 x 2^-8 x i x |loss|)")
            print(f"  function rel diff      {res['fn_rel_diff']:.3e}   (held-out logits vs training's change; "
                  f"one device, another split: {res.get('rounding_fn_rel_diff', float('nan')):.1e})")
            print(f"  worst tensor's effect  {res['max_tensor_fn_rel_diff']:.3e}   ({res['worst_tensor']}; "
                  f"of its training's effect, bound 1)")
        for name, effect in res.get("judged_by_effect", {}).items():  # float32: tensors the loss cannot see
            print(f"  effect of {name:<12} {effect:.3e}   (its values differ beyond the tolerance: judged by what "
                  f"they do to the held-out logits, of its training's effect)")
        print(f"  tolerance              {res['tolerance']:.1e}  ->  {'OK' if res['ok'] else 'FAILED'}")
    else:
        print(json.dumps(res))
    return 0 if res["ok"] else 1


# forward passes (pp * vpp * microbatches) a schedule is built, checked and simulated for
# within seconds; past it the closed forms answer (bubble (p-1)/(v*m))
SCHEDULE_LIMIT = 10_000


SCHEDULE_DEFAULTS = {"pp": 4, "vpp": 1, "microbatches": 8}


def _schedule_sizes(args) -> tuple[int, int, int]:
    """(pp, vpp, microbatches): the flags given, else SCHEDULE_DEFAULTS; refused in one line
    naming each (and whether it is the default) when too small or too large to simulate."""
    given = {k: getattr(args, k) is not None for k in SCHEDULE_DEFAULTS}
    sizes = {k: v if getattr(args, k) is None else getattr(args, k) for k, v in SCHEDULE_DEFAULTS.items()}
    for k, v in sizes.items():
        if v < 1:
            raise ConfigError(f"--{k} must be at least 1 (got {v})")
    pp, vpp, m = sizes.values()
    if pp * vpp * m > SCHEDULE_LIMIT:
        # name the largest factor the user gave (else the largest default) as the one to lower
        culprit = max(sizes, key=lambda k: (given[k], sizes[k]))
        terms = " x ".join(_given_or_default(f"--{k}", v, given[k]) for k, v in sizes.items())
        raise ConfigError(f"{terms} = {pp * vpp * m} forward passes, more than the {SCHEDULE_LIMIT} simulated here "
                          f"in seconds: use a smaller --{culprit} (the bubble fraction is (p-1)/(v*m) = "
                          f"{(pp - 1) / (vpp * m):.3g})")
    return pp, vpp, m


def cmd_schedule(args) -> int:
    from ..parallel import schedules

    pp, vpp, m = _schedule_sizes(args)
    if args.plot:
        check_output_file("--plot", args.plot, [], extensions=PLOT_TYPES)
    try:
        s = schedules.make_schedule(args.schedule, pp, vpp, m)
        schedules.validate(s)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    sim = schedules.simulate(s)
    if args.json:
        print(json.dumps(schedules.to_json(s, sim)))
    else:
        print(schedules.describe(s, sim))
    if args.plot:
        from ..viz.pipeline import save_timeline_plot

        save_timeline_plot(sim, args.plot)
        print(f"timeline written to {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


def cmd_bench(args) -> int:
    import torch

    from .bench import bench_job, bench_single

    model, layout = model_from(args), layout_from(args)
    train = train_from(args, eval_every=0, progress=False, warmup=2)
    validate(model, layout, train)
    if args.bench_steps < 1 or args.warmup_steps < 0 or args.threads < 0:
        raise ConfigError("--bench-steps must be at least 1, --warmup-steps and --threads at least 0 "
                          f"(got {args.bench_steps}, {args.warmup_steps}, {args.threads})")
    from .bench import check_counts

    check_counts(args.bench_steps, args.warmup_steps)
    corpus = check_data(model, train)
    preflight(model, layout, train)
    if args.threads:
        torch.set_num_threads(args.threads)
    one = bench_single(model, ParallelConfig(precision=layout.precision, fp8_recipe=layout.fp8_recipe,
                                         backend=layout.backend, device=layout.device,
                                         compile=layout.compile, recompute=layout.recompute), train, corpus,
                       args.bench_steps, args.warmup_steps, profile=args.profile)
    res = dict(one)
    if layout.world > 1:
        multi = run_ranks(bench_job, model, layout, train, corpus,
                          {"timeout": args.timeout, "steps": args.bench_steps, "warmup": args.warmup_steps})
        if not reporting():
            return 0
        # speedup: raw step times from two launches (noisy on a shared machine); efficiency:
        # MFU over MFU, each against a peak measured alongside it, so machine load cancels
        res.update(multi, single_device_step_s=one["minitron_step_s"], single_device_mfu=one["mfu"],
                   speedup_vs_one_rank=one["minitron_step_s"] / multi["minitron_step_s"],
                   efficiency_vs_one_rank=multi["mfu"] / one["mfu"])
    if args.json:
        print(json.dumps(res))
        return 0
    for k, v in res.items():
        if k not in ("profile", "profile_kinds"):
            print(f"{k:>26}  {v:.4g}" if isinstance(v, float) else f"{k:>26}  {v}")
    if res.get("profile"):
        print("\nwhere minitron's step goes (self time per operator):")
        for r in res["profile"]:
            print(f"  {r['share']:6.1%}  {r['ms_per_step']:9.2f} ms/step  {r['calls_per_step']:6.0f}x  {r['kind']:>13}  {r['op'][:60]}")
        print("by kind: " + ", ".join(f"{k} {v:.1%}" for k, v in res["profile_kinds"].items()))
        print(f"MFU if only matmuls and attention took time: {res['mfu_ceiling']:.2f}")
    return 0


def cmd_memory(args) -> int:
    from ..analysis import memory_per_rank

    model, layout = model_from(args), layout_from(args)
    train = train_from(args)
    validate(model, layout, train)
    if args.cluster:
        from ..analysis.cluster import get_cluster

        try:
            get_cluster(args.cluster)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    mem = memory_per_rank(model, layout, train)
    traffic = dp_traffic(model, layout, train)
    warning, fits = memory_warning(mem["total_bytes"], args.cluster)
    if args.json:
        print(json.dumps({"model": model_label(args, model), "layout": layout.describe(), **mem, **traffic,
                          "fits": fits, "warning": warning}))
    else:
        print(f"memory per rank, {model.name} on {layout.describe()} ({train.dtype}, global batch {train.global_batch}, "
              f"{train.microbatches} microbatches):")
        for k, v in mem.items():
            print(f"  {k:<18} {v / 2**20:12.3f} MiB")
        if traffic["dp_call_bytes"]:
            calls = ", ".join(f"{op} {b / 2**20:.3f}" for op, b in traffic["dp_call_bytes"].items())
            print(f"data-parallel traffic per step (ZeRO stage {layout.zero}): calls {calls} MiB; on the wire "
                  f"{traffic['dp_wire_over_all_reduce']:.2f}x one ring all-reduce of the gradients")
        if warning:
            print(warning)
    return 0


def memory_warning(total_bytes: float, cluster: str = "") -> tuple[str, dict]:
    """(A warning line, or "" when the rank fits; {GPU: fits}) for a rank of `total_bytes`
    against the GPU of `cluster`, or, with none named, the common training GPUs
    (analysis.cluster.GPU_MEMORY_BYTES)."""
    from ..analysis.cluster import GPU_MEMORY_BYTES, get_cluster

    gpus = {get_cluster(cluster).gpu: get_cluster(cluster).memory_bytes} if cluster else GPU_MEMORY_BYTES
    fits = {g: total_bytes <= cap for g, cap in gpus.items()}
    size = f"{total_bytes / 2**20:,.0f} MiB ({total_bytes / 1e9:.1f} GB) per rank"
    fix = "split the model further (--tp, --pp), recompute activations (--recompute) or shard states (--zero)"
    if all(fits.values()):
        return "", fits
    if not any(fits.values()):
        names = ", ".join(f"{g} {cap / 1e9:.0f} GB" for g, cap in gpus.items())
        return f"warning: {size} fits no GPU of {names}: {fix}", fits
    small = ", ".join(f"{g} {gpus[g] / 1e9:.0f} GB" for g, ok in fits.items() if not ok)
    return f"warning: {size} does not fit {small} (only {', '.join(g for g, ok in fits.items() if ok)}): {fix}", fits


def dp_traffic(model, layout, train) -> dict:
    """Data-parallel call bytes per step (the largest stage) and the wire bytes of the ZeRO
    stage over one all-reduce's (1 for stages 0-2, 1.5 for stage 3, one microbatch)."""
    from ..analysis.comm import comm_bytes_per_step
    from ..analysis.zero import zero_wire_bytes

    d = layout.dp * layout.cp
    calls = comm_bytes_per_step(model, layout, train).get("dp_cp" if layout.cp > 1 else "dp", {})
    ratio = zero_wire_bytes(1, d, layout.zero) / zero_wire_bytes(1, d, 0) if d > 1 else 0.0
    return {"dp_call_bytes": calls, "dp_wire_over_all_reduce": ratio}


def _plan_on_machine(args, model) -> int:
    """`plan --machine FILE`: the layouts of --gpus ranks on a measured machine (minitron/tools/sweep.py)."""
    from . import sweep

    if args.gpus < 1 or args.top < 1 or args.global_batch < 1:
        raise ConfigError("--gpus, --global-batch and --top must be at least 1")
    machine = sweep.MachineProfile.load(args.machine)
    if args.global_batch % args.gpus:
        raise ConfigError(f"--global-batch {args.global_batch} must be a multiple of --gpus {args.gpus} "
                          f"(the weak-scaling series gives every rank the same sequences)")
    rows = sweep.plan_on_machine(model, args.gpus, args.global_batch // args.gpus, machine)[:args.top]
    if args.json:
        print(json.dumps({"model": model.name, "ranks": args.gpus, "machine": machine.name, "candidates": rows}))
        return 0
    print(f"{model.name} on {args.gpus} ranks of {machine.name} ({machine.cores} cores), global batch {args.global_batch}:")
    print(f"{'layout':>16} {'step ms':>9} {'compute':>8} {'comm':>8} {'bubble':>7} {'tokens/s':>9}")
    for r in rows:
        print(f"{r['layout']:>16} {r['step_s'] * 1e3:9.1f} {r['compute_s'] * 1e3:8.1f} {r['comm_s'] * 1e3:8.1f} "
              f"{r['bubble_s'] * 1e3:7.1f} {r['tokens_per_s']:9.0f}")
    return 0


def _published_run(args) -> int:
    """`plan --published RUN`: one published H100-era run, predicted and explained
    (minitron.analysis.published.H100_RUNS and H100_FITTING_RUNS)."""
    from ..analysis import format_explain
    from ..analysis import published as P

    try:
        run = P.h100_run(args.published)
    except KeyError as e:
        raise ConfigError(e.args[0]) from None
    layout, pred, value = P.h100_run_prediction(run)
    if args.json:
        print(json.dumps({"run": run[0], "published": run[14], "unit": run[15], "predicted": value,
                          "source": run[16], "software": {"preset": P.H100_SOFTWARE,
                                                          **P.H100_RUN_SOFTWARE.get(run[0], {})},
                          "breakdown": pred.breakdown}))
        return 0
    print(f"{run[0]}: {run[1]}, sequence {run[2]}, {run[3]} GPUs of h100-dgx, global batch {run[4]}, "
          f"t={layout.tp} p={layout.pp} cp={layout.cp} v={layout.vpp} ep={layout.ep} d={layout.dp} "
          f"b={layout.microbatch_size}{' FSDP' if layout.zero == 3 else ''}{' FP8' if run[13] else ''}")
    print(f"published {run[14]} {run[15]} per GPU, predicted {value:.1f} ({value / run[14] - 1:+.1%}); "
          f"source: {run[16]}")
    options = P.H100_RUN_SOFTWARE.get(run[0], {})
    print(f"software: {P.H100_SOFTWARE}" + "".join(f", {k}={v}" for k, v in options.items())
          + " (beyond the preset, as the run's recipe and table state)" * bool(options))
    if args.explain:
        print(f"\none iteration, part by part:\n{format_explain(pred, kernels=True)}")
    return 0


def model_label(args, model) -> str:
    """The name a planner answer gives the model: the preset's when the model is exactly
    it, else ``custom (PRESET with field=value, ...)`` (model flags changed it)."""
    if getattr(args, "init_from", "") or args.model not in PRESETS:
        return model.name
    base = PRESETS[args.model]
    changed = [f"{f.name}={getattr(model, f.name)}" for f in dataclasses.fields(ModelConfig)
               if getattr(model, f.name) != getattr(base, f.name)]
    return f"custom ({args.model} with {', '.join(changed)})" if changed else model.name


def _given_or_default(flag: str, value, given: bool) -> str:
    return f"{flag} {value}" + ("" if given else " (the default)")


def _check_fixed_layout(args, model, sw) -> None:
    """`plan --tp T --pp P`: the GPU count, batch and expert-parallel degree refused by the
    flags the user gave (or the defaults they came from), before the model prices it."""
    b = args.microbatch_size or 1
    mb = _given_or_default("--microbatch-size", b, bool(args.microbatch_size))
    fixed = args.tp * args.pp * args.cp
    if args.gpus % fixed:
        raise ConfigError(f"--tp {args.tp} x --pp {args.pp} x --cp {args.cp} = {fixed} does not divide --gpus "
                          f"{args.gpus}: pick degrees whose product divides the GPU count")
    d = args.gpus // fixed
    if args.global_batch % (d * b):
        raise ConfigError(f"--global-batch {args.global_batch} does not split over dp = --gpus {args.gpus} / "
                          f"(tp*pp*cp = {fixed}) = {d} data-parallel ranks x {mb}: pick a --global-batch "
                          f"that is a multiple of {d * b}, or fewer --gpus")
    if args.ep > 1 and (args.tp * args.cp * d) % args.ep:
        raise ConfigError(f"--ep {args.ep} does not divide the tp*cp*dp = {args.tp * args.cp * d} ranks "
                          f"(--gpus {args.gpus} over --pp {args.pp}) that hold the experts: pick a divisor")


def cmd_plan(args) -> int:
    from ..analysis import format_explain, plan, predict
    from ..analysis.planner import check_request, cluster_software

    if args.published:
        return _published_run(args)
    if args.gpus is None or args.global_batch is None:  # given as 0 or less: refused below, by name
        raise ConfigError("plan needs --gpus and --global-batch (or --published RUN for a published run)")
    model = model_from(args)
    validate_model(model)
    model = model.replace(name=model_label(args, model))  # "custom (...)" where flags changed the preset
    if args.machine:
        return _plan_on_machine(args, model)
    for flag, v, low in (("--gpus", args.gpus, 1), ("--global-batch", args.global_batch, 1), ("--top", args.top, 1),
                         ("--tp", args.tp, 0), ("--pp", args.pp, 0), ("--vpp", args.vpp, 0),
                         ("--microbatch-size", args.microbatch_size, 0), ("--cp", args.cp, 1), ("--ep", args.ep, 0)):
        if v < low:
            raise ConfigError(f"{flag} must be at least {low}{' (0: search)' if low == 0 else ''} (got {v})")
    if args.vpp > 1 and args.pp == 1:
        raise ConfigError(f"--vpp {args.vpp} interleaves pipeline stages: it needs --pp 2 or more (or leave --pp to the search)")
    if args.explain and not (args.tp and args.pp):
        raise ConfigError("--explain breaks down one layout: give it with --tp and --pp "
                          "(and optionally --vpp, --microbatch-size)")
    if args.plot:
        if not args.explain:
            raise ConfigError("--plot draws the --explain breakdown: add --explain")
        check_output_file("--plot", args.plot, [], extensions=PLOT_TYPES)
    fixed = {"tp": args.tp, "pp": args.pp, "vpp": args.vpp, "microbatch_size": args.microbatch_size}
    try:
        sw = cluster_software(args.software, args.cluster)
        sw = sw.replace(fp8=True) if args.fp8 else sw
        cp_kinds = (args.cp_kind,) if args.cp_kind else None
        check_request(model, args.cluster, sw, ep=args.ep, cp=args.cp, cp_kinds=cp_kinds, zero=args.zero)
        if all(fixed[k] for k in ("tp", "pp")):
            _check_fixed_layout(args, model, sw)
            lay = {"tp": args.tp, "pp": args.pp, "dp": args.gpus // (args.tp * args.pp * args.cp),
                   "vpp": args.vpp or 1, "microbatch_size": args.microbatch_size or 1,
                   "sp": sw.sequence_parallel and args.tp > 1,  # as the planner does
                   "cp": args.cp, "cp_kind": args.cp_kind or (sw.context_parallel or ("ring",))[0],
                   "ep": args.ep or 1, "zero": args.zero, "fsdp_shard": args.fsdp_shard}
            pred = predict(model, lay, args.global_batch, args.cluster, software=sw, recompute=args.recompute)
            out = {**lay, "tflops_per_gpu": pred.tflops_per_gpu, "iteration_s": pred.iteration_s,
                   "memory_gb_per_gpu": pred.memory_gb_per_gpu, "bubble_fraction": pred.bubble_fraction,
                   "breakdown": pred.breakdown}
        else:
            out = {"candidates": plan(model, args.gpus, args.global_batch, args.cluster, top=args.top,
                                      software=sw, zero=args.zero, ep=args.ep or None, recompute=args.recompute,
                                      cp=args.cp if args.cp > 1 else None, cp_kinds=cp_kinds,
                                      **{k: v for k, v in fixed.items() if v})}
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args.plot:
        from ..viz.explain import save_explain_plot

        save_explain_plot({f"{model.name}, {sw.name}": pred}, args.plot,
                          f"{model.name} on {args.gpus} GPUs of {args.cluster}, t={lay['tp']} p={lay['pp']} "
                          f"d={lay['dp']} v={lay['vpp']} b={lay['microbatch_size']}")
    if args.json:
        label = model.name
        print(json.dumps({"model": "custom" if label.startswith("custom") else label, "model_description": label,
                          "model_config": dataclasses.asdict(model), "gpus": args.gpus, "cluster": args.cluster,
                          "software": sw.name, "software_default": args.software is None, **out}))
        return 0
    rows = out.get("candidates", [out])
    print(f"{model.name} on {args.gpus} GPUs of {args.cluster}, global batch {args.global_batch}, "
          f"software {sw.name}" + (f" (the {args.cluster} era's default; --software to change)"
                                   if args.software is None else "") + ":")
    print(f"{'t':>3} {'p':>4} {'d':>5} {'v':>3} {'b':>3} {'ep':>3} {'TFLOP/s/GPU':>12} {'iter s':>9} {'GB/GPU':>8} "
          f"{'bubble':>7} {'cp':>3} {'schedule':>11} {'zero':>4}")
    for r in rows:
        print(f"{r['tp']:>3} {r['pp']:>4} {r['dp']:>5} {r['vpp']:>3} {r['microbatch_size']:>3} {r.get('ep', 1):>3} "
              f"{r['tflops_per_gpu']:>12.1f} {r['iteration_s']:>9.2f} {r['memory_gb_per_gpu']:>8.1f} "
              f"{r['bubble_fraction']:>7.3f} {r.get('cp', 1):>3} "
              f"{r.get('schedule') or ('interleaved' if r['vpp'] > 1 else '1f1b'):>11} {r.get('zero', 0):>4}")
    for axis, why in rows[0].get("reasons", {}).items():  # why the best layout's schedule, cp, sharding
        print(f"why {axis}: {why}")
    if args.explain:
        print(f"\none iteration, part by part:\n{format_explain(pred, kernels=True)}")
    if args.plot:
        print(f"figure written to {args.plot}")
    return 0


def cmd_tokenize(args) -> int:
    from ..tokenizer import tokenize

    check_output_file("--out", args.out, [args.data, args.tokenizer], extensions=(".bin",))
    res = tokenize(args.data, args.out, args.vocab, args.tokenizer)
    if args.json:
        print(json.dumps(res))
    else:
        print(f"{res['bytes']} bytes of text -> {res['tokens']} tokens ({res['bytes_per_token']:.2f} bytes/token), "
              f"vocabulary {res['vocab']}, {res['dtype']}")
        print(f"wrote {res['out']}, {res['sidecar']}, {res['tokenizer']}")
        print(f"train on it: minitron train --data {res['out']} --vocab {res['vocab']}")
    return 0


def cmd_sample(args) -> int:
    from .sampling import sample_text

    print(sample_text(args))
    return 0


def check_exportable(cfg: ModelConfig) -> None:
    """The long-context and family knobs (head width, QKV biases, q/k norms, windows, rope
    scaling) have no Hugging Face family in ``hf.py`` yet: a checkpoint using them is
    refused in one line rather than written as a GPT-2 or Llama that computes otherwise."""
    knobs = [f"--{k.replace('_', '-')}" for k in ("head_width", "qkv_bias", "qk_norm", "window", "rope_scaling")
             if getattr(cfg, k)]
    if knobs:
        raise ConfigError(f"this checkpoint's model uses {', '.join(knobs)}, which export cannot write as GPT-2 or "
                          f"Llama yet: export a model without them")


def cmd_export(args) -> int:
    from ..hf import export_problem, save
    from .sampling import model_from_checkpoint

    from .preflight import check_export_dir

    check_export_dir(args.hf, args.ckpt_dir)
    cfg, full, _ = model_from_checkpoint(args.ckpt_dir)
    check_exportable(cfg)
    problem = export_problem(cfg)
    if problem:
        raise ConfigError(f"cannot export {args.ckpt_dir} to Hugging Face: {problem}")
    try:
        res = save(args.hf, {k: v["param"] for k, v in full.items()}, cfg)
    except KeyError as e:  # checksums fine, a tensor missing: written incomplete or forged
        raise ConfigError(f"checkpoint {args.ckpt_dir} does not match the model its meta.json describes: no {e}; "
                          f"export another checkpoint") from None
    print(f"wrote {res['dir']}/config.json and model.safetensors ({res['tensors']} tensors, "
          f"{res['params']:,} parameters, {res['dtype']}): "
          f"transformers.{res['class']}.from_pretrained('{res['dir']}') loads it")
    return 0


def cmd_sweep(args) -> int:
    """A scaling series (minitron/tools/sweep.py): each layout measured on real ranks, one JSON line
    per point with the local throughput model's prediction beside it."""
    from . import sweep

    model = model_from(args)
    validate_model(model)
    if args.measure_machine:
        _output_path(args.measure_machine, "--measure-machine", (args.machine,))
        prof = sweep.measure_machine(model, args.base_batch)
        prof.save(args.measure_machine)
        print(f"wrote {args.measure_machine}: {prof.cores} cores, one-rank step {prof.step_flops_per_s / 1e9:.2f} "
              f"GFLOP/s ({model.name}), collectives fitted on groups of {', '.join(map(str, sorted(prof.links['all_reduce'])))}")
        return 0
    if args.steps < 1 or args.warmup < 0:
        raise ConfigError("--steps must be >= 1 and --warmup >= 0")
    points = []
    for spec in args.layouts.split():
        layout = sweep.parse_layout(spec)
        layout = dataclasses.replace(layout, backend=args.backend)
        train = sweep.point_config(model, layout, args.series, args.base_batch, args.steps + args.warmup + 1, args.microbatches)
        try:
            validate(model, layout, train)
        except ConfigError as e:  # a sweep sets the global batch from --base-batch: name that flag
            batch = (f"the series' global batch {train.global_batch} (--base-batch {args.base_batch}"
                     + (f" × {layout.world} ranks)" if args.series == "weak" else ")"))
            raise ConfigError(f"layout {spec}: " + str(e).replace(f"--global-batch {train.global_batch}", batch)) from None
        points.append((layout, train))
    machine = sweep.MachineProfile.load(args.machine) if args.machine else None
    out = _output_path(args.out, "--out", (args.data, args.machine)) if args.out else None
    corpus = check_data(model, TrainConfig(data=args.data))
    one_rank = None
    for layout, train in points:
        row = run_ranks(sweep.sweep_job, model, layout, train, corpus, {"timeout": args.timeout, "steps": args.steps,
                                                          "warmup": args.warmup})
        if not reporting():
            continue
        if layout.world == 1:
            one_rank = row["step_s"]
        row = sweep.finish_row(row, model, layout, train, args.series, machine, one_rank)
        line = f"{row['layout']:>16} {row['world']:>3} ranks  batch {row['global_batch']:>3}  step {row['step_s'] * 1e3:8.1f} ms"
        if "efficiency" in row:
            line += f"  efficiency {row['efficiency']:5.2f}"
        if "predicted_step_s" in row:
            line += f"  predicted {row['predicted_step_s'] * 1e3:8.1f} ms ({row['prediction_error']:+.0%})"
        print(line, flush=True)
        if out:
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")
    if out and reporting():
        print(f"wrote {out}")
    return 0


def _output_path(path: str, flag: str = "--out", inputs: tuple = ()) -> str:
    """An output file checked before minutes of measuring (preflight.check_output_file: writable,
    not an input, not inside a checkpoint folder); a folder where a file is meant refused."""
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"{flag} {path} is a folder: name a file, e.g. {target / 'sweep.jsonl'}")
    check_output_file(flag, path, list(inputs))
    return str(target)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="minitron", description="Megatron-style parallel GPT training, small.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    tr = sub.add_parser("train", help="train the GPT (any layout)")
    add_model_args(tr)
    add_layout_args(tr)
    add_train_args(tr)
    tr.add_argument("--ckpt-dir", default="")
    tr.add_argument("--ckpt-every", type=int, default=0)
    tr.add_argument("--resume", nargs="?", const="yes", default="", choices=("yes", "auto"),
                    help="continue from the newest checkpoint of --ckpt-dir; `--resume auto`: if there is one "
                         "(a requeued batch job)")
    tr.add_argument("--overwrite", action="store_true", help="delete the checkpoints of --ckpt-dir and start again")
    tr.add_argument("--allow-resume-change", action="store_true",
                    help="resume although a setting that the continued run's equality with an uninterrupted "
                         "one depends on (--seed, --global-batch, --data, --dtype, --lr) differs from the checkpoint's")
    tr.add_argument("--allow-model-change", default="", metavar="FIELD[,FIELD]",
                    help="resume into a model whose FIELDs (e.g. positions,norm) differ from the checkpoint's: "
                         "parameters it lacks are initialised afresh, those it no longer has are dropped (both named)")
    tr.add_argument("--keep-last", type=int, default=0, help="keep only the newest K checkpoints (0: all)")
    tr.add_argument("--ckpt-format", default="minitron", choices=CKPT_FORMATS,
                    help="the files of each checkpoint: minitron's own shards, or dcp "
                         "(torch.distributed.checkpoint, read by torchtitan and by dcp.load into a plain module); "
                         "--resume reads either")
    tr.add_argument("--stop-at", type=int, default=0, help="stop after this step (and checkpoint), as a "
                    "time-limited job would; resume later with --resume")
    tr.add_argument("--metrics", default="", help="JSON lines of step metrics")
    tr.add_argument("--eval-every", type=int, default=50)
    tr.add_argument("--sample", type=int, default=200, help="tokens of text to generate at the end")
    tr.add_argument("--no-progress", action="store_true")
    tr.add_argument("--no-report", action="store_true",
                    help="skip the run report (layout, bytes per axis, bubble, memory per rank, loss figure)")
    tr.add_argument("--tensorboard", default="", metavar="DIR",
                    help="also write the metrics' scalars (loss, lr, grad norm, tokens/s, MFU) for TensorBoard")
    tr.add_argument("--log-every", type=int, default=1,
                    help="read the loss back from the device every N steps (on a GPU, N > 1 avoids "
                         "a host synchronisation per step)")
    tr.set_defaults(fn=cmd_train)

    ve = sub.add_parser("verify", help="prove a layout equals the single-device model")
    add_model_args(ve)
    add_layout_args(ve)
    add_train_args(ve, steps=3, global_batch=0, dtype="float64")
    ve.add_argument("--json", action="store_true")
    ve.add_argument("--tol", type=float, default=None, help="tolerance (default by dtype)")
    ve.set_defaults(fn=cmd_verify)

    sc = sub.add_parser("schedule", help="print, check and simulate a pipeline schedule")
    sc.add_argument("--schedule", default="1f1b", help=", ".join(SCHEDULES))
    sc.add_argument("--pp", type=int, default=None, help=f"pipeline ranks (default {SCHEDULE_DEFAULTS['pp']})")
    sc.add_argument("--vpp", type=int, default=None, help=f"chunks per rank (default {SCHEDULE_DEFAULTS['vpp']})")
    sc.add_argument("--microbatches", type=int, default=None,
                    help=f"microbatches (default {SCHEDULE_DEFAULTS['microbatches']})")
    sc.add_argument("--json", action="store_true")
    sc.add_argument("--plot", default="", help="write a timeline figure (png/svg/pdf)")
    sc.set_defaults(fn=cmd_schedule)
    me = sub.add_parser("memory", help="predicted bytes per rank for a layout")
    add_model_args(me)
    add_layout_args(me)
    add_train_args(me)
    me.add_argument("--json", action="store_true")
    me.add_argument("--cluster", default="", help="warn against this cluster's GPU memory (v100-dgx2, a100-dgx, "
                    "h100-dgx; default: against the common training GPUs)")
    me.set_defaults(fn=cmd_memory)

    pl = sub.add_parser("plan", help="predict a layout on a cluster, or rank all layouts")
    add_model_args(pl)
    pl.add_argument("--gpus", type=int, default=None, help="GPUs (ranks with --machine); needed unless --published")
    pl.add_argument("--global-batch", type=int, default=None, help="sequences per step; needed unless --published")
    pl.add_argument("--cluster", default="a100-dgx", help="v100-dgx2, a100-dgx, h100-dgx")
    for k in ("tp", "pp", "vpp", "microbatch-size"):
        pl.add_argument(f"--{k}", type=int, default=0)
    pl.add_argument("--top", type=int, default=10)
    pl.add_argument("--cp", type=int, default=1, help="context-parallel ranks (1: searched for long sequences)")
    pl.add_argument("--recompute", default=None, choices=("none", "selective", "full"),
                    help="activation recomputation (default: the software's)")
    pl.add_argument("--cp-kind", default=None, choices=("ring", "allgather", "a2a"),
                    help="context parallelism: ring (overlapped with attention), allgather, a2a (Ulysses); "
                         "default: every kind the software runs is searched")
    pl.add_argument("--ep", type=int, default=0, help="expert-parallel ranks of a MoE model (0: search)")
    pl.add_argument("--zero", type=int, default=0, choices=(0, 1, 3),
                    help="1: distributed optimizer; 3: FSDP / ZeRO-3 (weights gathered per layer)")
    pl.add_argument("--fsdp-shard", type=int, default=0, help="with --zero 3: HSDP, weights sharded over this many ranks")
    pl.add_argument("--fp8", action="store_true", help="the linears' matmuls in FP8 (clusters with an FP8 peak)")
    pl.add_argument("--published", default="", metavar="RUN",
                    help="predict and (with --explain) break down a published H100-era run by its id")
    from ..analysis.software import SOFTWARE  # light: the cluster model (and torch) stay unimported for --help

    pl.add_argument("--software", default=None,
                    help="the software stack: " + ", ".join(SOFTWARE) + " (default: the stack of the "
                         "cluster's era, named in the plan's first line)")
    pl.add_argument("--explain", action="store_true",
                    help="break one layout's iteration into its parts (needs --tp and --pp)")
    pl.add_argument("--plot", default="", help="with --explain: write the breakdown as a figure (png/svg/pdf)")
    pl.add_argument("--machine", default="", metavar="FILE",
                    help="plan on a measured machine (a profile from `minitron sweep --measure-machine`) "
                         "instead of a datasheet cluster: --gpus is the number of ranks")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(fn=cmd_plan)

    be = sub.add_parser("bench", help="step time, tokens/s, MFU and overhead vs plain PyTorch")
    add_model_args(be)
    add_layout_args(be)
    add_train_args(be, steps=10, global_batch=16)
    be.add_argument("--bench-steps", type=int, default=10, help="timed steps (after warm-up)")
    be.add_argument("--warmup-steps", type=int, default=3)
    be.add_argument("--threads", type=int, default=0, help="torch threads for the single-device run")
    be.add_argument("--profile", action="store_true", help="also profile minitron's step: top operators")
    be.add_argument("--json", action="store_true")
    be.set_defaults(fn=cmd_bench)

    tk = sub.add_parser("tokenize", help="train a byte-level BPE on text and write a token file (.bin)")
    tk.add_argument("--data", default="", help="text file or folder of .txt (default: Shakespeare)")
    tk.add_argument("--vocab", type=int, default=4096, help="vocabulary size (256 byte values + merges)")
    tk.add_argument("--out", required=True, help="the .bin to write (with .json and .tokenizer.json beside it)")
    tk.add_argument("--tokenizer", default="", help="encode with this tokenizer.json (e.g. GPT-2's) "
                    "instead of training one (--vocab is then the tokenizer's)")
    tk.add_argument("--json", action="store_true")
    tk.set_defaults(fn=cmd_tokenize)

    sa = sub.add_parser("sample", help="text from a checkpoint (any layout) or a GPT-2 directory")
    sa.add_argument("--ckpt-dir", default="", help="a minitron checkpoint folder (or a --ckpt-dir: its newest)")
    sa.add_argument("--init-from", default="", metavar="HF_DIR", help="a GPT-2 or Llama directory (Hugging Face format)")
    sa.add_argument("--prompt", default="ROMEO:")
    sa.add_argument("--tokens", type=int, default=200, help="tokens to generate")
    sa.add_argument("--temperature", type=float, default=0.8)
    sa.add_argument("--top-k", type=int, default=40)
    sa.add_argument("--seed", type=int, default=0)
    sa.add_argument("--tokenizer", default="", help="a tokenizer.json (default: --data's, the GPT-2 "
                    "directory's, else bytes)")
    sa.add_argument("--data", default="", help="a token file (.bin) whose tokenizer to use")
    sa.add_argument("--dtype", default="float32", help="float32 or float64")
    sa.set_defaults(fn=cmd_sample)

    ex = sub.add_parser("export", help="write a checkpoint as a GPT-2 or Llama directory (Hugging Face format)")
    ex.add_argument("--ckpt-dir", required=True, help="a minitron checkpoint folder (or a --ckpt-dir: its newest)")
    ex.add_argument("--hf", required=True, metavar="DIR", help="where to write config.json and model.safetensors")
    ex.set_defaults(fn=cmd_export)

    sw = sub.add_parser("sweep", help="a scaling series: layouts measured on real ranks, the model's prediction beside each")
    add_model_args(sw)
    sw.add_argument("--layouts", default="dp1 dp2 tp2 pp2 dp4 dp2.tp2.pp2",
                    help="space-separated layouts, e.g. 'dp1 dp2 dp2.tp2.pp2' (.vN interleaved, .sp, .3d); "
                         "under srun: one layout whose ranks are the job's tasks")
    sw.add_argument("--series", default="weak", help="weak (work per rank fixed) or strong (global batch fixed)")
    sw.add_argument("--base-batch", type=int, default=4, help="sequences per rank (weak) or in all (strong)")
    sw.add_argument("--microbatches", type=int, default=2, help="at least this many with a pipeline")
    sw.add_argument("--steps", type=int, default=5, help="timed steps per point (after --warmup)")
    sw.add_argument("--warmup", type=int, default=2)
    sw.add_argument("--data", default="")
    sw.add_argument("--backend", default="gloo")
    sw.add_argument("--timeout", type=float, default=300)
    sw.add_argument("--machine", default="", help="a machine profile (from --measure-machine): adds the prediction")
    sw.add_argument("--measure-machine", default="", metavar="FILE",
                    help="measure this machine (one-rank step rate, collectives' latency and bandwidth) into FILE")
    sw.add_argument("--out", default="", help="append one JSON line per point here")
    sw.set_defaults(fn=cmd_sweep)

    from .check_ckpt import add_parser as add_check_ckpt
    add_check_ckpt(sub)
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    from ..preemption import SignalLog

    # train: a signal from here on is noted (and ends the run cleanly), not fatal
    log = SignalLog().install() if args.cmd == "train" and threading.current_thread() is threading.main_thread() else None
    try:
        if hasattr(args, "timeout"):
            finite_positive("--timeout", args.timeout)
        return args.fn(args)
    except ConfigError as e:
        print(f"minitron: error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        print(f"minitron: stopped by {e.signal.name}", file=sys.stderr)
        return 128 + e.signal.value
    except KeyboardInterrupt:
        print("minitron: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one line for the user; the traceback on request
        if os.environ.get("MINITRON_DEBUG"):
            raise
        first = (str(e).strip().splitlines() or [""])[0][:300]
        print(f"minitron: error: {type(e).__name__}: {first} (MINITRON_DEBUG=1 prints the traceback)", file=sys.stderr)
        return 1
    finally:
        if log is not None and argv is not None:  # called from Python: give the caller its handlers back
            log.restore()
        elif log is not None:  # the program: its exit code is said; a second Ctrl-C must not change it
            log.ignore_from_now()


def entry() -> None:
    """The `minitron` program (also `python -m minitron`): run main() and exit with its code.

    A rank that torchrun or srun started ends with os._exit once main() has returned (its
    process group already destroyed): the interpreter's finalisation is skipped, where a C++
    thread of the process group that is still joinable calls std::terminate and turns a
    finished run's exit 0 into 134 (seen under srun, task 1, after the report was written)."""
    code = main()
    # only a command that started ranks imported the launcher (and made a process group);
    # `--help` and the analyses must not pay for importing torch to ask
    launch = sys.modules.get("minitron.launch")
    if launch is not None and launch.under_launcher():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)
    sys.exit(code)


if __name__ == "__main__":
    entry()
