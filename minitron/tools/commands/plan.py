"""`minitron plan`: a layout predicted on a cluster (`analysis.predict`), every layout
ranked (`analysis.plan`), a published run explained, or the layouts of a measured machine."""
from __future__ import annotations

import dataclasses
import json

from ...analysis.planned_layout import PLANNED_CP_MODES
from ...config import FP8_RECIPES, ConfigError, validate_model
from ..output_paths import PLOT_TYPES, check_output_file
from .options import add_model_args, given_or_default, model_from, model_label


def add_parser(sub) -> None:
    """`plan`: the model, the cluster and its software, and the degrees to fix or search."""
    pl = sub.add_parser("plan", help="predict a layout on a cluster, or rank all layouts")
    add_model_args(pl)
    pl.add_argument("--gpus", type=int, default=None, help="GPUs (ranks with --machine); needed unless --published")
    pl.add_argument("--global-batch", type=int, default=None, help="sequences per step; needed unless --published")
    pl.add_argument("--cluster", default="a100-dgx", help="v100-dgx2, a100-dgx, h100-dgx, h800 (DeepSeek-V3's: NVLink at 400 GB/s)")
    for k in ("tp", "pp", "vpp", "microbatch-size"):
        pl.add_argument(f"--{k}", type=int, default=0)
    pl.add_argument("--top", type=int, default=10)
    pl.add_argument("--cp", type=int, default=1, help="context-parallel ranks (1: searched for long sequences)")
    pl.add_argument("--recompute", default=None, choices=("none", "selective", "full"),
                    help="activation recomputation (default: the software's)")
    pl.add_argument("--cp-mode", default=None, choices=PLANNED_CP_MODES,
                    help="context parallelism: ring (overlapped with attention), allgather, a2a (Ulysses), "
                         "usp (an all-to-all over --cp-a2a ranks, a ring over the rest); "
                         "default: every kind the software runs is searched")
    pl.add_argument("--cp-a2a", type=int, default=0,
                    help="with --cp-mode usp: U, the context ranks of one all-to-all (0: searched)")
    pl.add_argument("--ep", type=int, default=0, help="expert-parallel ranks of a MoE model (0: search)")
    pl.add_argument("--zero", type=int, default=0, choices=(0, 1, 3),
                    help="1: distributed optimizer; 3: FSDP / ZeRO-3 (weights gathered per layer)")
    pl.add_argument("--fsdp-shard", type=int, default=0, help="with --zero 3: HSDP, weights sharded over this many ranks")
    pl.add_argument("--fp8", action="store_true", help="the linears' matmuls in FP8 (clusters with an FP8 peak)")
    pl.add_argument("--fp8-recipe", default=None, choices=FP8_RECIPES,
                    help="with --fp8: the scaling recipe priced, by the names train's --fp8-recipe runs "
                         "(default: the software's own, delayed in every preset)")
    pl.add_argument("--doc-len", type=int, default=None, metavar="L",
                    help="packed documents (train's --pack) of mean length L tokens: each document's attention "
                         "priced at L, not the sequence (default: whole sequences)")
    pl.add_argument("--published", default="", metavar="RUN",
                    help="predict and (with --explain) break down a published H100-era run by its id")
    from ...analysis.software import SOFTWARE  # light: the cluster model (and torch) stay unimported for --help

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


def cmd_plan(args) -> int:
    """`minitron plan`: a published run, a measured machine, one layout priced or all ranked."""
    if args.doc_len is not None and (args.published or args.machine):
        raise ConfigError("--doc-len prices packed documents on a cluster: drop it with --published or --machine")
    if args.published:
        return _published_run(args)
    if args.gpus is None or args.global_batch is None:  # given as 0 or less: refused below, by name
        raise ConfigError("plan needs --gpus and --global-batch (or --published RUN for a published run)")
    model = model_from(args)
    validate_model(model)
    model = model.replace(name=model_label(args, model))  # "custom (...)" where flags changed the preset
    if args.machine:
        return _plan_on_machine(args, model)
    _check_plan_flags(args, model)
    sw, out, lay, pred = _price(args, model)
    if args.plot:
        from ...viz.explain import save_explain_plot

        save_explain_plot({f"{model.name}, {sw.name}": pred}, args.plot,
                          f"{model.name} on {args.gpus} GPUs of {args.cluster}, t={lay['tp']} p={lay['pp']} "
                          f"d={lay['dp']} v={lay['vpp']} b={lay['microbatch_size']}")
    if args.json:
        label = model.name
        print(json.dumps({"model": "custom" if label.startswith("custom") else label, "model_description": label,
                          "model_config": dataclasses.asdict(model), "gpus": args.gpus, "cluster": args.cluster,
                          "software": sw.name, "software_default": args.software is None, **out}))
        return 0
    _print_plan(args, model, sw, out.get("candidates", [out]), pred)
    return 0


def _check_plan_flags(args, model) -> None:
    """The sizes at least 1 (or 0: search), --doc-len within the sequence, --vpp with a
    pipeline, --explain with a layout to break down, --plot with --explain and a figure type."""
    for flag, v, low in (("--gpus", args.gpus, 1), ("--global-batch", args.global_batch, 1), ("--top", args.top, 1),
                         ("--tp", args.tp, 0), ("--pp", args.pp, 0), ("--vpp", args.vpp, 0),
                         ("--microbatch-size", args.microbatch_size, 0), ("--cp", args.cp, 1), ("--ep", args.ep, 0)):
        if v < low:
            raise ConfigError(f"{flag} must be at least {low}{' (0: search)' if low == 0 else ''} (got {v})")
    if args.doc_len is not None and not 0 < args.doc_len <= model.seq_len:
        raise ConfigError(f"--doc-len {args.doc_len} must be between 1 and --seq-len {model.seq_len}: "
                          f"give the packed documents' mean length in tokens")
    if args.vpp > 1 and args.pp == 1:
        raise ConfigError(f"--vpp {args.vpp} interleaves pipeline stages: it needs --pp 2 or more (or leave --pp to the search)")
    if args.explain and not (args.tp and args.pp):
        raise ConfigError("--explain breaks down one layout: give it with --tp and --pp "
                          "(and optionally --vpp, --microbatch-size)")
    if args.plot:
        if not args.explain:
            raise ConfigError("--plot draws the --explain breakdown: add --explain")
        check_output_file("--plot", args.plot, [], extensions=PLOT_TYPES)


def _price(args, model):
    """(software, answer, layout, prediction): the layout --tp and --pp fix, predicted, or
    the best --top layouts the planner finds (then no one layout nor prediction)."""
    from ...analysis import plan, predict
    from ...analysis.planner import check_request, cluster_software

    fixed = {"tp": args.tp, "pp": args.pp, "vpp": args.vpp, "microbatch_size": args.microbatch_size}
    try:
        sw = cluster_software(args.software, args.cluster)
        if args.fp8_recipe and not args.fp8:
            raise ConfigError(f"--fp8-recipe {args.fp8_recipe} prices FP8's scaling: add --fp8")
        sw = sw.replace(fp8=True, fp8_recipe=args.fp8_recipe or sw.fp8_recipe) if args.fp8 else sw
        cp_modes = (args.cp_mode,) if args.cp_mode else None
        check_request(model, args.cluster, sw, ep=args.ep, cp=args.cp, cp_modes=cp_modes, zero=args.zero)
        if not all(fixed[k] for k in ("tp", "pp")):
            return sw, {"candidates": plan(model, args.gpus, args.global_batch, args.cluster, top=args.top,
                                           software=sw, zero=args.zero, ep=args.ep or None, recompute=args.recompute,
                                           cp=args.cp if args.cp > 1 else None, cp_modes=cp_modes,
                                           cp_a2a=args.cp_a2a or None, doc_len=args.doc_len,
                                           **{k: v for k, v in fixed.items() if v})}, None, None
        _check_fixed_layout(args, model, sw)
        lay = {"tp": args.tp, "pp": args.pp, "dp": args.gpus // (args.tp * args.pp * args.cp),
               "vpp": args.vpp or 1, "microbatch_size": args.microbatch_size or 1,
               "sp": sw.sequence_parallel and args.tp > 1,  # as the planner does
               "cp": args.cp, "cp_mode": args.cp_mode or (sw.context_parallel or ("ring",))[0],
               "cp_a2a": args.cp_a2a or 1,
               "ep": args.ep or 1, "zero": args.zero, "fsdp_shard": args.fsdp_shard}
        pred = predict(model, lay, args.global_batch, args.cluster, software=sw, recompute=args.recompute,
                       doc_len=args.doc_len)
        out = {**lay, "tflops_per_gpu": pred.tflops_per_gpu, "iteration_s": pred.iteration_s,
               "memory_gb_per_gpu": pred.memory_gb_per_gpu, "bubble_fraction": pred.bubble_fraction,
               "breakdown": pred.breakdown}
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return sw, out, lay, pred


def _print_plan(args, model, sw, rows: list, pred) -> None:
    """The table of layouts (one with --tp and --pp), why the best was chosen, the breakdown."""
    from ...analysis import format_explain

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


def _check_fixed_layout(args, model, sw) -> None:
    """`plan --tp T --pp P`: the GPU count, batch and expert-parallel degree refused by the
    flags the user gave (or the defaults they came from), before the model prices it."""
    b = args.microbatch_size or 1
    mb = given_or_default("--microbatch-size", b, bool(args.microbatch_size))
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


def _plan_on_machine(args, model) -> int:
    """`plan --machine FILE`: the layouts of --gpus ranks on a measured machine (minitron/tools/sweep.py)."""
    from .. import sweep

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
    from ...analysis import format_explain
    from ...analysis import published as P

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
