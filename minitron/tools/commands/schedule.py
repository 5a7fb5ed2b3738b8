"""`minitron schedule`: a pipeline schedule printed, checked and simulated, no rank started."""
from __future__ import annotations

import json
import sys

from ...config import SCHEDULES, ConfigError
from ..output_paths import PLOT_TYPES, check_output_file
from .options import given_or_default


# forward passes (pp * vpp * microbatches) a schedule is built, checked and simulated for
# within seconds; past it the closed forms answer (bubble (p-1)/(v*m))
SCHEDULE_LIMIT = 10_000


SCHEDULE_DEFAULTS = {"pp": 4, "vpp": 1, "microbatches": 8}


def add_parser(sub) -> None:
    """`schedule`: the schedule's name and its sizes (the defaults of SCHEDULE_DEFAULTS)."""
    sc = sub.add_parser("schedule", help="print, check and simulate a pipeline schedule")
    sc.add_argument("--schedule", default="1f1b", help=", ".join(SCHEDULES))
    sc.add_argument("--pp", type=int, default=None, help=f"pipeline ranks (default {SCHEDULE_DEFAULTS['pp']})")
    sc.add_argument("--vpp", type=int, default=None, help=f"chunks per rank (default {SCHEDULE_DEFAULTS['vpp']})")
    sc.add_argument("--microbatches", type=int, default=None,
                    help=f"microbatches (default {SCHEDULE_DEFAULTS['microbatches']})")
    sc.add_argument("--json", action="store_true")
    sc.add_argument("--plot", default="", help="write a timeline figure (png/svg/pdf)")
    sc.set_defaults(fn=cmd_schedule)


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
        terms = " x ".join(given_or_default(f"--{k}", v, given[k]) for k, v in sizes.items())
        raise ConfigError(f"{terms} = {pp * vpp * m} forward passes, more than the {SCHEDULE_LIMIT} simulated here "
                          f"in seconds: use a smaller --{culprit} (the bubble fraction is (p-1)/(v*m) = "
                          f"{(pp - 1) / (vpp * m):.3g})")
    return pp, vpp, m


def cmd_schedule(args) -> int:
    """`minitron schedule`: the schedule built, validated and simulated, printed or as JSON."""
    from ...analysis.pipeline_sim import describe, simulate, to_json
    from ...parallel.schedule_check import validate
    from ...parallel.schedules import make_schedule

    pp, vpp, m = _schedule_sizes(args)
    if args.plot:
        check_output_file("--plot", args.plot, [], extensions=PLOT_TYPES)
    try:
        s = make_schedule(args.schedule, pp, vpp, m)
        validate(s)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    sim = simulate(s)
    if args.json:
        print(json.dumps(to_json(s, sim)))
    else:
        print(describe(s, sim))
    if args.plot:
        from ...viz.pipeline import save_timeline_plot

        save_timeline_plot(sim, args.plot)
        print(f"timeline written to {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0
