"""Lab 02a: the 1F1B schedule (PipeDream-Flush, PTD-P §2.2.1) as data.

The learner writes ``one_f_one_b(p, m, rank)``: the ordered actions of pipeline rank
`rank` in one training step, ``Action("F", k)`` and ``Action("B", k)`` (the engine's
representation, :mod:`minitron.parallel.schedule_actions`). Sends and receives may be left
out: the checker then adds them the engine's way (a receive right before the compute that
consumes it, a send right after the compute that produces it; consecutive ones form one
batch). The checker

1. builds the whole schedule for many shapes (p = 1..6 with m = 1..10, and deeper, longer
   ones up to p = 16, m = 40; in this process), the engine's own generators watched while
   the learner's function runs (:class:`~minitron.labs.runner.Tripwire`);
2. ``validate``: every F and B once per microbatch, each rank's order respects its
   dependencies, every send meets its receive, no deadlock (blocking or eager sends);
3. ``simulate`` (F = 1, B = 2): the bubble fraction must be (p−1)/m and rank r's peak
   stash min(p−r, m) (:mod:`minitron.analysis.bubble`);
4. runs it in the pipeline runtime (``PipelineRuntime(..., schedule=...)``) on `pp` gloo
   ranks, float64, 2 steps of m = 4 microbatches, and compares losses and parameters with
   the single-device model.

    result = check_one_f_one_b(SOURCE)   # {"ok", "message", "bubble_fraction", "peak_stashed", ...}
"""
from __future__ import annotations

from contextlib import nullcontext

from ..analysis.bubble import bubble_fraction, stashed_on_rank
from ..analysis.pipeline_sim import describe as describe_schedule
from ..analysis.pipeline_sim import simulate
from ..config import ModelConfig, ParallelConfig, TrainConfig
from ..parallel.schedule_actions import COMM_OPS, Action, Schedule, ScheduleError
from ..parallel.schedule_check import validate
from ..parallel.schedule_comms import with_comms
from .runner import TOL, LabError, Tripwire, deadline, describe, fail, load, run_cases, screen, training_verdict, versus_one_device

MODEL = ModelConfig(layers=4, hidden=16, heads=4, seq_len=16, vocab=256, name="lab")
TRAIN = TrainConfig(steps=2, global_batch=8, microbatches=4, dtype="float64", warmup=1, progress=False,
                    eval_every=0, sample_tokens=0)
# the engine's own 1F1B (and the schedule builder that makes it): not an answer to this lab
FORBIDDEN = ("minitron.parallel.schedules.make_schedule", "minitron.parallel.schedules._1f1b",
             "minitron.parallel.schedules._one_f_one_b", "minitron.parallel.schedules.num_warmup")
# a simulated bubble (or idle time) against its closed form: equal but for float rounding
FORMULA_TOL = 1e-9
# every p <= 6 with every m <= 10 (m < p among them), then deeper and longer pipelines than
# a table of small cases covers
LARGE = [(7, 3), (8, 16), (9, 20), (12, 13), (16, 40)]
SHAPES = ([(4, 8), (2, 4)] + [(p, m) for p in range(1, 7) for m in range(1, 11) if (p, m) not in ((4, 8), (2, 4))]
          + LARGE)
# the engine's schedule generators (whatever the route to them, none may run in a learner's)
GENERATORS = ("make_schedule", "_one_f_one_b", "num_warmup", "_gpipe", "_1f1b", "interleaved_groups",
              "interleaved_order", "_interleaved", "_zb_h1", "_zb_v", "_dualpipe_v")


def watch_schedules() -> Tripwire:
    """A tripwire on the engine's own schedule generators (:mod:`minitron.parallel.schedules`)."""
    from ..parallel import schedules

    return Tripwire({f"minitron.parallel.schedules.{n}": getattr(schedules, n)
                     for n in GENERATORS if hasattr(schedules, n)})


def build_schedule(fn, p: int, m: int, watch: Tripwire | None = None) -> Schedule:
    """The Schedule of `fn(p, m, rank)` for every rank (`fn` may also be the source text
    that defines `one_f_one_b`), with sends and receives added the engine's way when `fn`
    returns compute actions only. Raises LabError when `fn` raises, returns something
    other than a list of Actions, or runs one of the engine's generators (`watch`)."""
    if isinstance(fn, str):
        fn = load(fn, ("one_f_one_b",), {"Action": Action})["one_f_one_b"]
    rows = []
    for rank in range(p):
        try:
            with watch.armed() if watch is not None else nullcontext():
                acts = fn(p, m, rank)
        except LabError:
            raise
        except Exception as e:
            raise LabError(describe(e)) from None
        call = f"one_f_one_b(p={p}, m={m}, rank={rank})"
        if not isinstance(acts, (list, tuple)):
            raise LabError(f"{call} returned {type(acts).__name__} {acts!r:.60}: return a list of Actions")
        bad = next((a for a in acts if not isinstance(a, Action)), None)
        if bad is not None:
            raise LabError(f"{call} returned a list holding {bad!r:.40} ({type(bad).__name__}): "
                           f"return Actions, e.g. Action('F', 0)")
        if not any(a.op in COMM_OPS for a in acts):
            acts = with_comms(p, 1, rank, [(a,) for a in acts])
        rows.append(tuple(acts))
    return Schedule("1f1b", p, 1, m, tuple(rows))


def show_schedule(source, p: int, m: int):
    """The lab's preview: print the schedule that `source`'s ``one_f_one_b`` gives for `p`
    stages and `m` microbatches and draw its timeline (returns the axes); when it cannot
    be built or run, print why in one line (returns None), and leave the verdict to
    :func:`check_one_f_one_b`."""
    from ..viz.pipeline import plot_timeline

    try:
        screen(source, ("one_f_one_b",), FORBIDDEN)
        schedule = build_schedule(source, p, m)
        sim = simulate(schedule)
    except (LabError, ScheduleError) as e:
        print(f"nothing to show yet: {e}")
        return None
    print(describe_schedule(schedule))
    return plot_timeline(sim)


def _static_check(fn) -> tuple[str, dict]:
    """('', the numbers of p=4, m=8) when every shape validates and has 1F1B's bubble and
    stash; else (the first problem, {}). Shapes go from a typical one to the corner cases."""
    built, watch = {}, watch_schedules()
    for p, m in SHAPES:
        built[p, m] = s = build_schedule(fn, p, m, watch)
        try:
            validate(s)
        except ScheduleError as e:
            return f"p={p}, m={m}: your schedule cannot run: {e}", {}
    numbers = {}
    for (p, m), s in built.items():
        sim = simulate(s)
        want = bubble_fraction("1f1b", p, m)
        if abs(sim.bubble_fraction - want) > FORMULA_TOL:
            hint = ("a rank idles waiting for work it could have had: begin with p-r-1 warm-up forwards, "
                    "then alternate one forward and one backward" if sim.bubble_fraction > want else
                    "is that a schedule that flushes the pipeline?")
            return (f"p={p}, m={m}: your bubble fraction is {sim.bubble_fraction:.4f}, 1F1B's is "
                    f"(p-1)/m = {want:.4f}: {hint}"), {}
        for r in range(p):
            want_r = stashed_on_rank("1f1b", p, m, 1, r)
            got = sim.peak_stashed[r]
            if got != want_r:
                hint = ("that is GPipe's memory: start the backwards before all the forwards are done"
                        if got == m else f"rank r needs only p-r-1 = {p - r - 1} forwards in flight before its "
                        "first backward, then one forward per backward")
                return (f"p={p}, m={m}: rank {r} stashes up to {got} microbatches of activations, "
                        f"1F1B min(p-r, m) = {want_r:g}: {hint}"), {}
        if not numbers:
            numbers = {"p": p, "m": m, "bubble_fraction": sim.bubble_fraction,
                       "peak_stashed": list(sim.peak_stashed)}
    return "", numbers


def _pipeline_job(comm, schedule: Schedule) -> dict | None:
    from ..train import Trainer

    layout = ParallelConfig(pp=comm.size("pp"), schedule="1f1b", device="cpu")
    tr = Trainer(MODEL, layout, TRAIN, comm, schedule=schedule)
    ran = []  # what the runtime computed in step 0, in order
    with tr.pipeline.observing(lambda action, _: ran.append((action.op, action.mb))):
        losses = [tr.step(0)]
    losses += [tr.step(i) for i in range(1, TRAIN.steps)]
    planned = [(a.op, a.mb) for a in schedule.compute_actions(comm.index("pp"))]
    if ran != planned:  # the runtime executes the schedule as data: this would be an engine bug
        raise LabError(f"pipeline rank {comm.index('pp')} ran {ran} instead of the schedule's {planned}")
    res = versus_one_device(comm, tr, losses, MODEL, TRAIN)
    return training_verdict(res, "1F1B schedule", f"your 1F1B is valid for every p <= 6, m <= 10 and up to "
                            f"p = 16, m = 40, has 1F1B's "
                            f"bubble and stash, and trains on {comm.size('pp')} pipeline ranks exactly like the "
                            f"single-device model", TOL)


def check_one_f_one_b(source: str, pp: int = 2, timeout: float = 60) -> dict:
    """Lab 02a: the 1F1B schedule `one_f_one_b(p, m, rank)` defined in `source`: validated
    for p = 1..6 and m = 1..10 (dependencies, matched messages, no deadlock), its bubble
    and peak stash compared with the closed forms, then run by the pipeline runtime on
    `pp` gloo ranks (float64, 2 steps, 4 microbatches) against the single-device model.
    Returns {"ok", "message", "bubble_fraction", "peak_stashed", "max_loss_abs_diff",
    "max_param_rel_diff"}, or {"ok": False, "message"} naming the first problem."""
    try:
        with deadline(timeout):
            screen(source, ("one_f_one_b",), FORBIDDEN)
            with watch_schedules().armed():  # the source's top level runs watched too
                ns = load(source, ("one_f_one_b",), {"Action": Action})
            problem, numbers = _static_check(ns["one_f_one_b"])
            if problem:
                return fail(problem)
            schedule = build_schedule(ns["one_f_one_b"], pp, TRAIN.microbatches)
    except Exception as e:  # LabError, LabTimeout, or a surprise in the checker itself
        return fail(describe(e))
    res = run_cases(_pipeline_job, ParallelConfig(pp=pp, device="cpu"), [(schedule,)], timeout)[0]
    return {**res, **numbers} if "max_loss_abs_diff" in res else res
