"""`minitron bench`: step time, tokens/s and MFU of a layout beside plain PyTorch on one
device (tools/bench.py)."""
from __future__ import annotations

import json

from ...config import ConfigError, ParallelConfig, validate
from .options import add_run_args, check_data, layout_from, model_from, train_from
from .ranks import preflight, reporting, run_ranks


def add_parser(sub) -> None:
    """`bench`: the layout flags, the timed and warm-up steps, and the profiler."""
    be = sub.add_parser("bench", help="step time, tokens/s, MFU and overhead vs plain PyTorch")
    add_run_args(be, steps=10, global_batch=16)
    be.add_argument("--bench-steps", type=int, default=10, help="timed steps (after warm-up)")
    be.add_argument("--warmup-steps", type=int, default=3)
    be.add_argument("--threads", type=int, default=0, help="torch threads for the single-device run")
    be.add_argument("--profile", action="store_true", help="also profile minitron's step: top operators")
    be.add_argument("--json", action="store_true")
    be.set_defaults(fn=cmd_bench)


def cmd_bench(args) -> int:
    """`minitron bench`: one device beside the layout's ranks (bench.py), then the table or JSON."""
    import torch

    from ..bench import bench_job, bench_single

    model, layout = model_from(args), layout_from(args)
    train = train_from(args, eval_every=0, progress=False, warmup=2)
    validate(model, layout, train)
    if args.bench_steps < 1 or args.warmup_steps < 0 or args.threads < 0:
        raise ConfigError("--bench-steps must be at least 1, --warmup-steps and --threads at least 0 "
                          f"(got {args.bench_steps}, {args.warmup_steps}, {args.threads})")
    from ..bench import check_counts

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
