"""`minitron train`: the checks, the checkpoint folder and its lock, the ranks, the
summary; a run stopped by SIGTERM/SIGINT/SIGUSR1 after checkpointing exits with status 75
(`preemption.EXIT_PREEMPTED`)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from ...config import CKPT_FORMATS, TrainConfig, validate
from .options import add_run_args, check_data, layout_from, model_from, train_from
from .ranks import Interrupted, reporting, run_ranks


def add_parser(sub) -> None:
    """`train`: the model, layout and training flags, then the checkpoint and reporting ones."""
    tr = sub.add_parser("train", help="train the GPT (any layout)")
    add_run_args(tr)
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
    tr.add_argument("--ft-replicas", type=int, default=0, metavar="R",
                    help="fault-tolerant data parallelism on torchft: R replicas of the layout (each its own "
                         "ranks), a quorum per step, a lost replica restarted and recovered live from a peer")
    tr.add_argument("--ft-max-restarts", type=int, default=3, help="restarts of each lost replica (--ft-replicas)")
    tr.add_argument("--ft-timeout", type=float, default=15.0,
                    help="seconds a quorum, a replica all-reduce or a recovery may take (--ft-replicas)")
    tr.set_defaults(fn=cmd_train)


def cmd_train(args) -> int:
    """`minitron train`, holding --ckpt-dir's lock (checkpoint.FolderLock) from its checks to its end."""
    from ...checkpoint import FolderLock
    from ..preflight import check_rank_numbers

    check_rank_numbers(os.environ)  # reporting() reads them
    with FolderLock(args.ckpt_dir if reporting() else "") as lock:
        return _train_command(args, lock)


def _train_command(args, lock) -> int:
    """The checks, the checkpoint folder, the ranks, then what the run says on rank 0."""
    from ...preemption import installed_log
    from ...train import train_job
    from ..resume_checks import AlreadyDone

    model, layout = model_from(args), layout_from(args)
    train = _train_config(args)
    ft = _fault_tolerance(args, model, layout, train) if args.ft_replicas else None
    validate(model, layout, train)
    corpus = check_data(model, train)
    if ft is not None:
        return _train_fault_tolerant(args, lock, ft, model, layout, train, corpus)
    try:
        start = _prepare_folders(args, lock, model, layout, train, corpus)
    except AlreadyDone as done:  # a requeued job preempted in its last step: its work is done
        print(f"minitron: {done}", file=sys.stderr)
        return 0
    observer = _observer(args, model, layout, train)
    early = installed_log()
    if early is not None and early.signal:  # signalled while checking: start no rank
        return stopped_before_training(early.signal, train, start)
    try:
        summary = run_ranks(train_job, model, layout, train, corpus, {"timeout": args.timeout, "report": observer},
                            stop_on_signal=True)
    except Interrupted as e:  # the launcher was signalled; its ranks stopped at a step boundary
        return _interrupted(e, train, start)
    if summary.get("preempted"):
        return _preempted(summary["preempted"], train, start)
    if reporting():
        _summarise(args, summary, model, layout, train, corpus, start)
    return 0


def _fault_tolerance(args, model, layout, train):
    """--ft-replicas' settings, checked (one line) before the layout's own checks."""
    from ...config import ConfigError
    from ...fault_tolerance import FaultTolerance, check

    ft = FaultTolerance(replicas=args.ft_replicas, timeout_s=args.ft_timeout, quorum_timeout_s=args.ft_timeout,
                        max_restarts=args.ft_max_restarts)
    check(model, layout, train, ft)
    if args.nproc or any(k in os.environ for k in ("TORCHELASTIC_RUN_ID", "SLURM_PROCID")):
        raise ConfigError("--ft-replicas: the replicas are started here, each with the layout's ranks: drop --nproc "
                          "and run outside torchrun/srun")
    return ft


def _train_fault_tolerant(args, lock, ft, model, layout, train, corpus) -> int:
    """`--ft-replicas R`: the replicas on this machine (fault_tolerance.train_replicas), then
    what they did: steps with fewer replicas, restarts, how each replica ended."""
    from ...fault_tolerance import train_replicas

    _prepare_folders(args, lock, model, layout, train, corpus)
    out = train_replicas(model, layout, train, corpus, ft, log=print)
    fewer = out["fewer_replicas"]
    print(f"fault-tolerant: {ft.replicas} replicas, {len(out['taken'])} steps committed; "
          f"{len(fewer)} with fewer replicas{f' (steps {fewer[0]}..{fewer[-1]})' if fewer else ''}; "
          f"restarts {out['restarts']}")
    stopped = [f"replica {r}: {e.get('stopped') or e.get('lost')}" for r, e in out["replicas"].items()
               if e.get("stopped") or e.get("lost")]
    for line in stopped:
        print(f"minitron: {line}", file=sys.stderr)
    if train.metrics:
        print(f"metrics written to {train.metrics} (one line per replica and committed step)")
    if train.trace:
        print(f"calls written to {train.trace} (each replica's last life, each call with its replica)")
    return 1 if stopped else 0


def _train_config(args) -> TrainConfig:
    """The TrainConfig of `train`'s flags (--allow-model-change checked against --resume)."""
    from ..resume_checks import allowed_model_changes

    return train_from(args, ckpt_dir=args.ckpt_dir, ckpt_every=args.ckpt_every, resume=bool(args.resume),
                      stop_at=args.stop_at, metrics=args.metrics, eval_every=args.eval_every,
                      progress=not args.no_progress, sample_tokens=args.sample, log_every=args.log_every,
                      keep_last=args.keep_last, ckpt_format=args.ckpt_format,
                      allow_model_change=allowed_model_changes(args.allow_model_change, bool(args.resume)))


def _prepare_folders(args, lock, model, layout, train, corpus) -> int:
    """--ckpt-dir checked, then locked before anything reads or deletes it; the step a
    --resume continues from (AlreadyDone when its work is done); the outputs checked, and
    the files a fresh run replaces removed by the one writer. Returns the start step."""
    from ..output_paths import check_output_dir, check_outputs, inputs_of
    from ..resume_checks import check_resume, lock_ckpt_dir, prepare_ckpt_dir, trim_metrics

    if train.ckpt_dir:
        prepare_ckpt_dir(train.ckpt_dir, args.resume, args.overwrite, inputs_of(train), delete=False)
        lock_ckpt_dir(lock)
    start = check_resume(train.ckpt_dir, args.resume, model, train, corpus,
                         args.allow_resume_change, layout=layout) if train.resume else 0
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
    return start


def _observer(args, model, layout, train):
    """The run report (and its TensorBoard writer) that watches the steps, or None."""
    if args.no_report and not args.tensorboard:
        return None
    from ..report import RunReport

    if args.tensorboard:
        from ..tensorboard_log import check_available

        check_available()
    return RunReport(model, layout, train, tensorboard_dir=args.tensorboard, measure_peak=True)


def _interrupted(e, train: TrainConfig, start: int) -> int:
    """The launcher was signalled: the checkpoint its ranks wrote, or that none was."""
    from ...checkpoint import latest
    from ...preemption import EXIT_PREEMPTED

    now = latest(train.ckpt_dir) if train.ckpt_dir else None
    step = int(now.name.split("_")[1]) if now is not None else 0
    if now is None or step <= start:
        print(f"minitron: stopped by {e.signal.name} before a checkpoint was written", file=sys.stderr)
        return 128 + e.signal.value
    print(f"minitron: stopped by {e.signal.name} after step {step}; checkpoint {now}: "
          f"continue with --resume (exit code {EXIT_PREEMPTED})", file=sys.stderr)
    return EXIT_PREEMPTED


def _preempted(pre: dict, train: TrainConfig, start: int) -> int:
    """The ranks were signalled (preemption.py) and stopped at a step boundary: where to go on."""
    from ...checkpoint import latest
    from ...preemption import EXIT_PREEMPTED

    if pre["step"] is None:
        return stopped_before_training(pre["signal"], train, start)
    if reporting():
        where = f"checkpoint {latest(train.ckpt_dir)}: continue with --resume" if pre["checkpoint"] else \
            "no --ckpt-dir, nothing saved"
        print(f"minitron: stopped by {pre['signal']} after step {pre['step']}; {where} "
              f"(exit code {EXIT_PREEMPTED})", file=sys.stderr)
    return EXIT_PREEMPTED


def _summarise(args, summary: dict, model, layout, train: TrainConfig, corpus, start: int) -> None:
    """What a finished run says: the validation loss, the sample, the report, the files written."""
    from ...checkpoint import latest

    if summary["val_losses"]:
        from ...viz.loss import loss_reference

        print(validation_summary(summary["val_losses"]))
        print(loss_reference(corpus, builtin=not train.data))
    if summary.get("sample"):
        print("--- sample ---")
        print(summary["sample"])
        print("--------------")
    if summary.get("report") and not args.no_report:
        from ...viz.loss import loss_unit
        from ..report import format_report, plot_losses

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


def stopped_before_training(sig: str, train: TrainConfig, start: int) -> int:
    """A signal before the first step: no step ran, nothing was saved or lost; say so and
    exit with EXIT_PREEMPTED, as a run stopped later does (preemption.py says why)."""
    from ...preemption import EXIT_PREEMPTED

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
