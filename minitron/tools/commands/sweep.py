"""`minitron sweep`: a scaling series measured on real ranks, the machine's throughput
model's prediction beside each point (tools/sweep.py)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ...config import RANK_TIMEOUT_S, ConfigError, TrainConfig, validate, validate_model
from ..output_paths import check_output_file
from .options import add_model_args, check_data, model_from
from .ranks import reporting, run_ranks


def add_parser(sub) -> None:
    """`sweep`: the layouts, the series, and the machine profile measured or read."""
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
    sw.add_argument("--timeout", type=float, default=RANK_TIMEOUT_S)
    sw.add_argument("--machine", default="", help="a machine profile (from --measure-machine): adds the prediction")
    sw.add_argument("--measure-machine", default="", metavar="FILE",
                    help="measure this machine (one-rank step rate, collectives' latency and bandwidth) into FILE")
    sw.add_argument("--out", default="", help="append one JSON line per point here")
    sw.set_defaults(fn=cmd_sweep)


def cmd_sweep(args) -> int:
    """A scaling series (minitron/tools/sweep.py): each layout measured on real ranks, one JSON line
    per point with the local throughput model's prediction beside it."""
    from .. import sweep

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
    """An output file checked before minutes of measuring (output_paths.check_output_file: writable,
    not an input, not inside a checkpoint folder); a folder where a file is meant refused."""
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"{flag} {path} is a folder: name a file, e.g. {target / 'sweep.jsonl'}")
    check_output_file(flag, path, list(inputs))
    return str(target)
