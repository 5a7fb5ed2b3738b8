"""`minitron train | verify | schedule | memory | plan | bench` (DESIGN.md contracts).

Every option is checked before any process group starts; bad input prints one line,
`minitron: error: <problem and fix>`, and exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .config import (ConfigError, ModelConfig, ParallelConfig, TrainConfig, PRESETS, SCHEDULES,
                     preset, validate, validate_model)


# --- arguments ---------------------------------------------------------------------------
def add_model_args(ap):
    g = ap.add_argument_group("model")
    g.add_argument("--model", default="tiny", help=f"preset: {', '.join(PRESETS)}")
    for k in ("layers", "hidden", "heads", "seq-len", "vocab", "ffn"):
        g.add_argument(f"--{k}", type=int, default=None)
    g.add_argument("--tied", action="store_true", help="tie input and output embeddings")
    g.add_argument("--dropout", type=float, default=None)


def add_layout_args(ap):
    g = ap.add_argument_group("layout")
    g.add_argument("--nproc", type=int, default=0, help="ranks to start locally (default dp*tp*pp)")
    for k in ("dp", "tp", "pp", "vpp"):
        g.add_argument(f"--{k}", type=int, default=1)
    g.add_argument("--tp-mode", default="1d", help="1d (Megatron) or 3d (cube)")
    g.add_argument("--sp", action="store_true", help="sequence parallelism")
    g.add_argument("--schedule", default="1f1b", help=", ".join(SCHEDULES))
    g.add_argument("--zero1", action="store_true",
                   help="ZeRO-1: shard AdamW state over dp (reduce-scatter gradients, all-gather parameters)")
    g.add_argument("--dp-impl", default="bucketed",
                   help="naive (all-reduce per tensor after backward) or bucketed (overlapped with backward)")
    g.add_argument("--bucket-mb", type=float, default=4.0, help="gradient bucket size in MB (bucketed, zero1)")
    g.add_argument("--recompute", default="none", help="none, selective or full")
    g.add_argument("--scatter-gather", action="store_true")
    g.add_argument("--stage-layers", default="", help="uneven split, e.g. 1,3")
    g.add_argument("--backend", default="gloo", help="gloo or nccl")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda")
    g.add_argument("--precision", default="fp32", help="fp32 or bf16")
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


def model_from(args) -> ModelConfig:
    m = preset(args.model)
    over = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "seq_len", "vocab", "ffn", "dropout")
            if getattr(args, k, None) is not None}
    if getattr(args, "tied", False):
        over["tied_embeddings"] = True
    return m.replace(**over) if over else m


def layout_from(args) -> ParallelConfig:
    try:
        stage = tuple(int(x) for x in args.stage_layers.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--stage-layers '{args.stage_layers}' must be comma-separated integers, e.g. 1,3") from None
    return ParallelConfig(nproc=args.nproc, dp=args.dp, tp=args.tp, pp=args.pp, vpp=args.vpp,
                          tp_mode=args.tp_mode, sp=args.sp, schedule=args.schedule, zero1=args.zero1,
                          dp_impl=args.dp_impl, bucket_mb=args.bucket_mb, recompute=args.recompute,
                          scatter_gather=args.scatter_gather, stage_layers=stage, backend=args.backend,
                          device=args.device, compile=args.compile,
                          precision=args.precision, dropout_rng=args.dropout_rng or
                          ("global" if getattr(args, "cmd", "") == "verify" else "tensor"))


def train_from(args, **over) -> TrainConfig:
    kw = dict(steps=args.steps, global_batch=args.global_batch, microbatches=args.microbatches,
              seed=args.seed, data=args.data, dtype=args.dtype, trace=args.trace, timeline=args.timeline)
    if args.lr is not None:
        kw["lr"] = args.lr
    kw.update(over)
    return TrainConfig(**kw)


def check_data(m: ModelConfig, t: TrainConfig):
    """Load the corpus once up front, so a bad --data fails before any rank starts."""
    from .data import check_corpus, load_corpus

    corpus = load_corpus(t.data)
    check_corpus(corpus.split()[1], m.seq_len, m.vocab)
    return corpus


# --- running on every rank ----------------------------------------------------------------
def run_ranks(job, m, p, t, corpus, extra=None):
    """Run `job(comm, m, p, t, corpus, extra)` on every rank; return rank 0's result."""
    from . import launch

    world = p.world
    if world == 1 or launch.under_launcher():
        if launch.under_launcher() and launch.env_world() != world:
            raise ConfigError(f"the launcher started {launch.env_world()} ranks but dp*tp*pp = {world}: "
                              f"match --nproc-per-node/--ntasks to the layout")
        return _rank_main(job, m, p, t, corpus, extra)
    results = launch.launch_local(_rank_main, (job, m, p, t, corpus, extra), world)
    return results[0]


def reporting() -> bool:
    """Only global rank 0 reports (every rank runs this CLI under torchrun/srun)."""
    from . import launch

    return not launch.under_launcher() or int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0))) == 0


def _rank_main(job, m, p, t, corpus, extra):
    from . import launch

    comm = launch.setup_rank(p, p.backend, (extra or {}).get("timeout", 300), trace=bool(t.trace))
    try:
        return job(comm, m, p, t, corpus, extra)
    finally:
        launch.teardown()


def _train_job(comm, m, p, t, corpus, extra):
    from .train import train

    return train(m, p, t, comm, corpus=corpus)


# --- commands ------------------------------------------------------------------------------
def cmd_train(args) -> int:
    m, p = model_from(args), layout_from(args)
    t = train_from(args, ckpt_dir=args.ckpt_dir, ckpt_every=args.ckpt_every, resume=args.resume,
                   stop_at=args.stop_at, metrics=args.metrics, eval_every=args.eval_every, progress=not args.no_progress,
                   sample_tokens=args.sample, log_every=args.log_every)
    validate(m, p, t)
    corpus = check_data(m, t)
    if t.resume and t.ckpt_dir:
        from .checkpoint import check, latest

        newest = latest(t.ckpt_dir)
        if newest is not None:
            check(newest)
    for path in (t.trace, t.metrics, t.timeline):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            if not (path == t.metrics and t.resume):  # a resumed run appends its metrics
                Path(path).unlink(missing_ok=True)
    summary = run_ranks(_train_job, m, p, t, corpus, {"timeout": args.timeout})
    if not reporting():
        return 0
    vl = summary["val_losses"]
    if vl:
        first, last = vl[min(vl)], vl[max(vl)]
        print(f"validation loss {first:.3f} -> {last:.3f} ({100 * (1 - last / first):.0f}% lower)")
    if summary.get("sample"):
        print("--- sample ---")
        print(summary["sample"])
        print("--------------")
    if t.metrics:
        print(f"metrics written to {t.metrics}")
    if t.trace:
        print(f"communication trace written to {t.trace}")
    return 0


def cmd_verify(args) -> int:
    from .verify import verify_job

    m, p = model_from(args), layout_from(args)
    gb = args.global_batch or p.dp * args.microbatches * max(2, p.cube_q ** 2)
    t = train_from(args, global_batch=gb, lr=args.lr or 1e-2, warmup=1, eval_every=0, progress=False)
    validate(m, p, t)
    corpus = check_data(m, t)
    for path in (t.trace, t.timeline):
        if path:
            Path(path).unlink(missing_ok=True)
    res = run_ranks(verify_job, m, p, t, corpus, {"timeout": args.timeout, "tol": args.tol})
    if not reporting():
        return 0
    if not args.json:
        print(f"verify {res['layout']} vs single device, {res['steps']} steps, {t.dtype}:")
        print(f"  max |loss diff|        {res['max_loss_abs_diff']:.3e}")
        print(f"  max param rel diff     {res['max_param_rel_diff']:.3e}   (worst: {res['worst_param']})")
        print(f"  tolerance              {res['tolerance']:.1e}  ->  {'OK' if res['ok'] else 'FAILED'}")
    else:
        print(json.dumps(res))
    return 0 if res["ok"] else 1


def cmd_schedule(args) -> int:
    from .parallel import schedules

    try:
        s = schedules.make_schedule(args.schedule, args.pp, args.vpp, args.microbatches)
        schedules.validate(s)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    sim = schedules.simulate(s)
    if args.json:
        print(json.dumps(schedules.to_json(s, sim)))
    else:
        print(schedules.describe(s, sim))
    if args.plot:
        from .viz import save_timeline_plot

        save_timeline_plot(sim, args.plot)
        print(f"timeline written to {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


def cmd_bench(args) -> int:
    import torch

    from .bench import bench_job, bench_single

    m, p = model_from(args), layout_from(args)
    t = train_from(args, eval_every=0, progress=False, warmup=2)
    validate(m, p, t)
    corpus = check_data(m, t)
    if args.threads:
        torch.set_num_threads(args.threads)
    one = bench_single(m, ParallelConfig(precision=p.precision, backend=p.backend, device=p.device,
                                         compile=p.compile, recompute=p.recompute), t, corpus,
                       args.bench_steps, args.warmup_steps, profile=args.profile)
    res = dict(one)
    if p.world > 1:
        multi = run_ranks(bench_job, m, p, t, corpus,
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
    from .analysis import memory_per_rank

    m, p = model_from(args), layout_from(args)
    t = train_from(args)
    validate(m, p, t)
    mem = memory_per_rank(m, p, t)
    if args.json:
        print(json.dumps({"model": m.name, "layout": p.describe(), **mem}))
    else:
        print(f"memory per rank, {m.name} on {p.describe()} ({t.dtype}, global batch {t.global_batch}, "
              f"{t.microbatches} microbatches):")
        for k, v in mem.items():
            print(f"  {k:<18} {v / 2**20:12.3f} MiB")
    return 0


def cmd_plan(args) -> int:
    from .analysis import plan, predict

    m = model_from(args)
    validate_model(m)
    fixed = {"tp": args.tp, "pp": args.pp, "vpp": args.vpp, "microbatch_size": args.microbatch_size}
    try:
        if all(fixed[k] for k in ("tp", "pp")):
            if args.gpus % (args.tp * args.pp):
                raise ValueError(f"tp*pp = {args.tp * args.pp} does not divide {args.gpus} GPUs: "
                                 f"pick degrees whose product divides the GPU count")
            lay = {"tp": args.tp, "pp": args.pp, "dp": args.gpus // (args.tp * args.pp),
                   "vpp": args.vpp or 1, "microbatch_size": args.microbatch_size or 1}
            pred = predict(m, lay, args.global_batch, args.cluster)
            out = {**lay, "tflops_per_gpu": pred.tflops_per_gpu, "iteration_s": pred.iteration_s,
                   "memory_gb_per_gpu": pred.memory_gb_per_gpu, "bubble_fraction": pred.bubble_fraction,
                   "breakdown": pred.breakdown}
        else:
            out = {"candidates": plan(m, args.gpus, args.global_batch, args.cluster, top=args.top,
                                      **{k: v for k, v in fixed.items() if v})}
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args.json:
        print(json.dumps({"model": m.name, "gpus": args.gpus, "cluster": args.cluster, **out}))
        return 0
    rows = out.get("candidates", [out])
    print(f"{m.name} on {args.gpus} GPUs of {args.cluster}, global batch {args.global_batch}:")
    print(f"{'t':>3} {'p':>4} {'d':>5} {'v':>3} {'b':>3} {'TFLOP/s/GPU':>12} {'iter s':>9} {'GB/GPU':>8} {'bubble':>7}")
    for r in rows:
        print(f"{r['tp']:>3} {r['pp']:>4} {r['dp']:>5} {r['vpp']:>3} {r['microbatch_size']:>3} "
              f"{r['tflops_per_gpu']:>12.1f} {r['iteration_s']:>9.2f} {r['memory_gb_per_gpu']:>8.1f} "
              f"{r['bubble_fraction']:>7.3f}")
    return 0


def cmd_tokenize(args) -> int:
    from .tokenizer import tokenize

    res = tokenize(args.data, args.out, args.vocab)
    if args.json:
        print(json.dumps(res))
    else:
        print(f"{res['bytes']} bytes of text -> {res['tokens']} tokens ({res['bytes_per_token']:.2f} bytes/token), "
              f"vocabulary {res['vocab']}, {res['dtype']}")
        print(f"wrote {res['out']}, {res['sidecar']}, {res['tokenizer']}")
        print(f"train on it: minitron train --data {res['out']} --vocab {res['vocab']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="minitron", description="Megatron-style parallel GPT training, small.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    tr = sub.add_parser("train", help="train the GPT (any layout)")
    add_model_args(tr)
    add_layout_args(tr)
    add_train_args(tr)
    tr.add_argument("--ckpt-dir", default="")
    tr.add_argument("--ckpt-every", type=int, default=0)
    tr.add_argument("--resume", action="store_true")
    tr.add_argument("--stop-at", type=int, default=0, help="stop after this step (and checkpoint), as a "
                    "time-limited job would; resume later with --resume")
    tr.add_argument("--metrics", default="", help="JSON lines of step metrics")
    tr.add_argument("--eval-every", type=int, default=50)
    tr.add_argument("--sample", type=int, default=200, help="tokens of text to generate at the end")
    tr.add_argument("--no-progress", action="store_true")
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
    sc.add_argument("--pp", type=int, default=4)
    sc.add_argument("--vpp", type=int, default=1)
    sc.add_argument("--microbatches", type=int, default=8)
    sc.add_argument("--json", action="store_true")
    sc.add_argument("--plot", default="", help="write a timeline figure (png/svg/pdf)")
    sc.set_defaults(fn=cmd_schedule)
    me = sub.add_parser("memory", help="predicted bytes per rank for a layout")
    add_model_args(me)
    add_layout_args(me)
    add_train_args(me)
    me.add_argument("--json", action="store_true")
    me.set_defaults(fn=cmd_memory)

    pl = sub.add_parser("plan", help="predict a layout on a cluster, or rank all layouts")
    add_model_args(pl)
    pl.add_argument("--gpus", type=int, required=True)
    pl.add_argument("--global-batch", type=int, required=True)
    pl.add_argument("--cluster", default="a100-dgx", help="v100-dgx2, a100-dgx, h100-dgx")
    for k in ("tp", "pp", "vpp", "microbatch-size"):
        pl.add_argument(f"--{k}", type=int, default=0)
    pl.add_argument("--top", type=int, default=10)
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
    tk.add_argument("--json", action="store_true")
    tk.set_defaults(fn=cmd_tokenize)
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"minitron: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
