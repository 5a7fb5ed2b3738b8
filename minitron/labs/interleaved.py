"""Lab 02b: the interleaved 1F1B schedule (PTD-P §2.2.2) as data.

The learner writes ``interleaved_1f1b(p, v, m, rank)``: the ordered compute actions of
pipeline rank `rank` in one training step, ``Action("F", k, c)`` and ``Action("B", k, c)``
for microbatch k on the rank's local model chunk c (virtual stage ``c·p + rank``; the
engine's representation, :mod:`minitron.parallel.schedule_actions`). The checker adds the sends
and receives the engine's way and then

1. checks the actions (each F and B once per microbatch and chunk), the warm-up (the
   forwards before the first backward) and the chunk order on each rank (a microbatch
   enters chunk c+1 after chunk c; its gradient leaves chunk c+1 before chunk c);
2. ``validate``\\s the schedule for a grid of (p, v, m), m not divisible by p included,
   and deeper ones up to p = 8, v = 4: dependencies, matched messages, no deadlock (the
   engine's own generators watched while the learner's function runs);
3. ``simulate``\\s it (F = 1, B = 2, eager sends): the bubble must be (p−1)/(v·m) and the
   peak stash rank r's ``stashed_on_rank`` (:mod:`minitron.analysis.bubble`);
4. runs it in the pipeline runtime on 2 gloo ranks with v = 2 chunks each, float64,
   2 steps, and compares losses and parameters with the single-device model; the traced
   pipeline messages must be the analysis' count (about v times plain 1F1B's).

Optional (a stretch part, graded when defined): ``zb_h1(p, m, rank)``, ZB-H1 (Qi et al.
2024): the backward split into B (input gradient) and W (weight gradient); its bubble
must be the analysis' (p−1)(T_F+T_B−T_W)/(m(T_F+T_B+T_W)) with F = B = W = 1.

Optional (a second stretch part, graded when defined): ``v_stage(p, rank, chunk)``, the V
placement of ZB-V and DualPipe-V (rank r holds stages r and 2p−1−r): every (rank, chunk)
for p up to 8 against the engine's :class:`~minitron.parallel.schedules.Placement` (the
loop placement, swapped chunks, an off-by-one in 2p−1−r, a V upside down named); then the
engine's ZB-V is laid out on the learner's placement (its messages placed by it),
validated and simulated for several (p, m): its idle time per rank must be Qi et al.'s
(p−1)·T_F/2 (`analysis.bubble.v_bubble`, m ≥ 2p−1); and it trains on 2 ranks in the same
launch as the interleaved run, float64, against the single-device model.

    result = check_interleaved(SOURCE)   # {"ok", "message", "bubble_fraction", ...}
"""
from __future__ import annotations

from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass
from numbers import Integral

from ..analysis.bubble import bubble_fraction, first_group, stashed_on_rank, v_bubble
from ..analysis.comm import comm_items
from ..analysis.pipeline_sim import simulate
from ..config import ModelConfig, ParallelConfig, TrainConfig
from ..parallel.schedule_actions import Action, Schedule, ScheduleError
from ..parallel.schedule_check import validate
from ..parallel.schedule_comms import with_comms, with_timed_comms
from ..parallel.schedules import Placement, interleaved_groups, make_schedule, num_warmup
from .pipeline import FORMULA_TOL, GENERATORS
from .runner import TOL, LabError, Tripwire, deadline, describe, fail, load, run_cases, screen, versus_one_device

MODEL = ModelConfig(layers=4, hidden=16, heads=4, seq_len=16, vocab=256, name="lab")
TRAIN = TrainConfig(steps=2, global_batch=8, microbatches=4, dtype="float64", warmup=1, progress=False,
                    eval_every=0, sample_tokens=0)
RUN = ParallelConfig(pp=2, vpp=2, schedule="interleaved", device="cpu")
# a typical shape first, then the rest of the grid: v = 1 (plain 1F1B), m not divisible by p
SHAPES = [(4, 2, 8)] + [(p, v, m) for p in (2, 3, 4) for v in (1, 2, 3) for m in (p, p + 1, 2 * p, 2 * p + 1)
                        if (p, v, m) != (4, 2, 8)] + [(8, 2, 16), (5, 4, 7), (6, 3, 13), (8, 4, 9)]  # deeper, longer
ZB_SHAPES = [(4, 8)] + [(p, m) for p in (1, 2, 3, 4) for m in (p, p + 1, 2 * p) if (p, m) != (4, 8)] + [(6, 13),
                                                                                                          (8, 16)]
# the engine's own schedules (the microbatch groups, a helper the lesson shows, stay allowed)
# and its stage placements (the stretch's answer)
FORBIDDEN = tuple(f"minitron.parallel.schedules.{n}" for n in GENERATORS if n != "interleaved_groups") + (
    "minitron.parallel.schedules.Placement", "minitron.parallel.schedules.placement_for", "minitron.placement")
RUN_V = ParallelConfig(pp=2, vpp=2, schedule="zb-v", device="cpu")  # the stretch's run, on v_stage's placement
V_PS = (2, 3, 4, 5, 6, 8)  # every (rank, chunk) of these pipelines
V_SHAPES = [(4, 8), (2, 2), (2, 3), (3, 3), (3, 5), (4, 7), (5, 9), (6, 13), (8, 16)]  # (p, m), m >= p
ZB_COSTS = dict(t_f=1.0, t_b=1.0, t_w=1.0)  # simulate's default costs for zb-h1


# --- from the learner's compute order to the engine's Schedule ----------------------------------
def compute_order(fn, name: str, p: int, v: int, m: int, rank: int, ops: str,
                  watch: Tripwire | None = None) -> list[Action]:
    """`fn`'s compute actions for one rank, checked to be a list of F/B(/W) Actions of
    existing microbatches and chunks; LabError otherwise (also when `watch` saw the
    engine's own schedule run)."""
    call = f"{name}(p={p}, v={v}, m={m}, rank={rank})" if name != "zb_h1" else f"zb_h1(p={p}, m={m}, rank={rank})"
    try:
        with watch.armed() if watch is not None else nullcontext():
            acts = fn(p, v, m, rank) if name != "zb_h1" else fn(p, m, rank)
    except LabError:
        raise
    except Exception as e:
        raise LabError(describe(e)) from None
    if not isinstance(acts, (list, tuple)):
        raise LabError(f"{call} returned {type(acts).__name__} {acts!r:.60}: return a list of Actions")
    for a in acts:
        if not isinstance(a, Action):
            raise LabError(f"{call} returned a list holding {a!r:.40} ({type(a).__name__}): "
                           f"return Actions, e.g. Action('F', 0, 1)")
        if a.op not in ops or not 0 <= a.mb < m or not 0 <= a.chunk < v or a.peer is not None:
            raise LabError(f"{call} returned {a}: compute actions are {', '.join(ops)} of microbatches "
                           f"0..{m - 1} on chunks 0..{v - 1} (the messages are added for you)")
    return list(acts)


def _units(acts: list[Action], pair: bool) -> list[tuple]:
    """The rank's order as the engine's units: with `pair` (interleaving) every steady
    (F, B) shares its comm batches, as Megatron's send_forward_backward_recv_forward_backward."""
    warm = next((i for i, a in enumerate(acts) if a.op != "F"), len(acts))
    units, i = [(a,) for a in acts[:warm]], warm
    while i < len(acts):
        if pair and i + 1 < len(acts) and acts[i].op == "F" and acts[i + 1].op == "B":
            units.append((acts[i], acts[i + 1]))
            i += 2
        else:
            units.append((acts[i],))
            i += 1
    return units


def _complete(rows: list[list[Action]], v: int, m: int, ops: str) -> str:
    """'' when each rank runs every op once per (microbatch, chunk), else the first problem."""
    want = Counter((op, k, c) for op in ops for k in range(m) for c in range(v))
    for r, acts in enumerate(rows):
        have = Counter((a.op, a.mb, a.chunk) for a in acts)
        for problem, diff in (("runs twice", have - want), ("never runs", want - have)):
            if diff:
                op, k, c = min(diff)
                what = {"F": "forward", "B": "backward", "W": "weight-gradient pass"}[op]
                return f"rank {r} {problem} {op}{k}.c{c} (the {what} of microbatch {k} on chunk {c})"
    return ""


def _chunk_order(rows: list[list[Action]]) -> str:
    """'' when, on every rank, each microbatch goes up the chunks forward and down them
    backward, and its B follows its F; else the first violation."""
    for r, acts in enumerate(rows):
        pos = {(a.op, a.mb, a.chunk): i for i, a in enumerate(acts)}
        for (op, k, c), i in sorted(pos.items(), key=lambda t: t[1]):
            if op == "F" and c > 0 and pos.get(("F", k, c - 1), -1) > i:
                return (f"rank {r} runs F{k}.c{c} before F{k}.c{c - 1}: a microbatch reaches chunk {c} "
                        f"(stage {c}*p+{r}) only after it has left chunk {c - 1}: forwards go up the chunks")
            if op == "B" and pos.get(("B", k, c + 1), -1) > i:
                return (f"rank {r} runs B{k}.c{c} before B{k}.c{c + 1}: a microbatch's gradient comes back "
                        f"through the chunks in reverse (chunk v-1 first): backwards visit the chunks "
                        f"in the mirrored order, c -> v-1-c (PTD-P §2.2.2)")
            if op == "B" and pos.get(("F", k, c), -1) > i:
                return f"rank {r} runs B{k}.c{c} before its forward F{k}.c{c}"
    return ""


def _warmup(rows: list[list[Action]], kind: str, p: int, v: int, m: int) -> str:
    """'' when every rank runs the schedule's warm-up before its first backward: w warm-up
    forwards, then the first steady forward (so min(w + 1, v*m) forwards in all)."""
    for r, acts in enumerate(rows):
        got = next((i for i, a in enumerate(acts) if a.op != "F"), len(acts))
        w = num_warmup(kind, p, v, m, r)
        want = min(w + 1, v * m)
        if got == want:
            continue
        if kind == "zb-h1":
            return (f"rank {r} runs {got} forwards before its first B, ZB-H1 keeps 1F1B's: the warm-up "
                    f"min(p-r-1, m) = {w} and the first steady forward")
        g = first_group(p, m)
        need = (f"(p-r-1)*2 + (v-1)*g = {w} warm-up forwards (g = {g}, the first microbatch group)" if v > 1
                else f"plain 1F1B's min(p-r-1, m) = {w} warm-up forwards")
        if v > 1 and got == min(p - r, m * v):
            return (f"rank {r} runs {got} forwards before its first backward, plain 1F1B's warm-up p-r-1 and "
                    f"one: with v = {v} chunks the rank must first put the first group of {g} microbatches "
                    f"through its other chunks and wait for the round trip, {need}, then one forward and one "
                    f"backward at a time: else its backwards wait and the bubble grows (PTD-P §2.2.2)")
        if v > 1 and g != p and got == min((p - r - 1) * 2 + (v - 1) * p + 1, m * v):
            return (f"rank {r} runs {got} forwards before its first backward, not {want}: your warm-up counts "
                    f"the first group as p = {p} microbatches, right only when p divides m; here m = {m} runs "
                    f"in groups {interleaved_groups(p, m)}, so the first group holds g = {g} and the warm-up "
                    f"is {need}")
        how = "one forward too many" if got == want + 1 else "one forward too few" if got == want - 1 else \
            f"{abs(got - want)} forwards too {'many' if got > want else 'few'}"
        return (f"rank {r} runs {got} forwards before its first backward, {how}: it needs {need}, "
                f"then the first steady forward")
    return ""


def build_schedule(fn, p: int, v: int, m: int, kind: str = "interleaved", watch: Tripwire | None = None) -> Schedule:
    """The engine's Schedule of the learner's compute order (`fn` may be the source text),
    for every rank, with sends and receives placed the engine's way: next to the computes
    (steady (F, B) pairs sharing their batches), or by the dataflow timeline when p does
    not divide m. LabError when the actions, the warm-up or the chunk order is wrong."""
    name = "zb_h1" if kind == "zb-h1" else "interleaved_1f1b"
    if isinstance(fn, str):
        fn = load(fn, (name,), {"Action": Action})[name]
    ops = "FBW" if kind == "zb-h1" else "FB"
    rows = [compute_order(fn, name, p, v, m, r, ops, watch) for r in range(p)]
    problem = _complete(rows, v, m, ops) or _warmup(rows, kind, p, v, m) or _chunk_order(rows)
    if problem:
        raise LabError(f"p={p}, v={v}, m={m}: {problem}" if kind != "zb-h1" else f"p={p}, m={m}: {problem}")
    timed = (kind == "interleaved" and v > 1 and m % p) or kind == "zb-h1"
    try:
        if timed:
            actions = with_timed_comms(kind, p, v, [[(a,) for a in acts] for acts in rows])
        else:
            actions = tuple(with_comms(p, v, r, _units(acts, pair=v > 1)) for r, acts in enumerate(rows))
    except ScheduleError as e:
        raise LabError(f"p={p}, v={v}, m={m}: your schedule cannot run: {e}") from None
    return Schedule(kind, p, v, m, actions)


def _watch() -> Tripwire:
    """The engine's own schedule generators, watched while the learner's function runs."""
    from ..parallel import schedules

    return Tripwire({name: getattr(schedules, name.rsplit(".", 1)[1]) for name in FORBIDDEN
                     if hasattr(schedules, name.rsplit(".", 1)[1])})


# --- the static checks --------------------------------------------------------------------------
def _static_check(fn) -> tuple[str, dict]:
    """('', the numbers of the first shape) when every shape validates with interleaving's
    bubble and stash; else (the first problem, {})."""
    numbers, watch = {}, _watch()
    for p, v, m in SHAPES:
        try:
            s = validate(build_schedule(fn, p, v, m, watch=watch))
        except ScheduleError as e:
            return f"p={p}, v={v}, m={m}: your schedule cannot run: {e}", {}
        sim = simulate(s, eager=True)  # PTD-P's bubble: eager sends (any m >= p)
        want = bubble_fraction("interleaved", p, m, v)
        if abs(sim.bubble_fraction - want) > FORMULA_TOL:
            hint = ("the forwards of a group of microbatches go through chunk 0, then chunk 1, ...: "
                    "a rank that runs one microbatch through all its chunks first waits for it to "
                    "come round the pipeline" if sim.bubble_fraction > want else "does it flush the pipeline?")
            return (f"p={p}, v={v}, m={m}: your bubble fraction is {sim.bubble_fraction:.4f}, interleaved "
                    f"1F1B's is (p-1)/(v*m) = {want:.4f}: {hint}"), {}
        for r in range(p):
            want_r = stashed_on_rank("interleaved", p, m, v, r) * v  # the analysis counts whole stages
            if sim.peak_stashed[r] != want_r:
                return (f"p={p}, v={v}, m={m}: rank {r} stashes up to {sim.peak_stashed[r]} microbatch-chunks "
                        f"of activations, interleaved 1F1B {want_r:g}: start each backward as soon as "
                        f"the warm-up is done"), {}
        if not numbers:
            numbers = {"p": p, "v": v, "m": m, "bubble_fraction": sim.bubble_fraction,
                       "peak_stashed": list(sim.peak_stashed)}
    return "", numbers


def _zb_check(fn) -> str:
    """'' when `zb_h1` validates with ZB-H1's bubble and 1F1B's stash for every shape."""
    watch = _watch()
    for p, m in ZB_SHAPES:
        try:
            s = validate(build_schedule(fn, p, 1, m, kind="zb-h1", watch=watch))
        except LabError as e:
            return f"your zb_h1: {e}"
        except ScheduleError as e:
            return f"your zb_h1: p={p}, m={m}: the schedule cannot run: {e}"
        sim = simulate(s, eager=True)
        want = bubble_fraction("zb-h1", p, m, **ZB_COSTS)
        if abs(sim.bubble_fraction - want) > FORMULA_TOL:
            hint = ("defer W: rank r keeps r weight-gradient passes back and runs them in the cool-down, "
                    "where it would wait" if sim.bubble_fraction > want else "does it flush the pipeline?")
            return (f"your zb_h1: p={p}, m={m}: bubble fraction {sim.bubble_fraction:.4f}, ZB-H1's "
                    f"(p-1)(T_F+T_B-T_W)/(m(T_F+T_B+T_W)) = {want:.4f} with F = B = W = 1: {hint}")
        for r in range(p):
            want_r = stashed_on_rank("zb-h1", p, m, 1, r)
            if sim.peak_stashed[r] != want_r:
                return (f"your zb_h1: p={p}, m={m}: rank {r} stashes up to {sim.peak_stashed[r]} microbatches "
                        f"before their B, ZB-H1 keeps 1F1B's min(p-r, m) = {want_r:g}")
    return ""


# --- the stretch: the V placement ---------------------------------------------------------------
@dataclass(frozen=True)
class YourPlacement(Placement):
    """The V placement as the learner's ``v_stage`` gave it, tabulated: the engine's
    schedule machinery (messages, validation, the runtime) reads it through
    :meth:`stage` and :meth:`locate` as it reads its own."""
    stages: tuple = ()

    def stage(self, rank: int, chunk: int) -> int:
        return self.stages[rank][chunk]

    def locate(self, stage: int) -> tuple[int, int]:
        return next((r, c) for r, row in enumerate(self.stages) for c, s in enumerate(row) if s == stage)


@dataclass(frozen=True)
class PlacedSchedule(Schedule):
    """A Schedule that runs on a given placement (the learner's) instead of its kind's."""
    placed: Placement | None = None

    @property
    def placement(self) -> Placement:
        return self.placed


def v_table(fn, p: int, watch: Tripwire | None = None) -> tuple[tuple[int, int], ...]:
    """((fn(p, r, 0), fn(p, r, 1)) for every rank r), each an int; LabError otherwise
    (also when `watch` saw the engine's own placement run)."""
    rows = []
    for r in range(p):
        row = []
        for c in (0, 1):
            try:
                with watch.armed() if watch is not None else nullcontext():
                    got = fn(p, r, c)
            except LabError:
                raise
            except Exception as e:
                raise LabError(f"your v_stage: {describe(e)}") from None
            if not isinstance(got, Integral) or isinstance(got, bool):
                raise LabError(f"your v_stage(p={p}, rank={r}, chunk={c}) returned {type(got).__name__} "
                               f"{got!r:.40}: return the global stage, an int in 0..{2 * p - 1}")
            row.append(int(got))
        rows.append(tuple(row))
    return tuple(rows)


def _v_diagnose(p: int, got: tuple) -> str:
    """'' when `got` is the V placement of p ranks, else the mistake, named."""
    want = Placement("v", p, 2).table()
    if got == want:
        return ""
    head = f"your v_stage: p={p}: ranks hold {list(got)}, "
    if got == Placement("loop", p, 2).table():
        return (head + f"the loop placement of interleaving (stage chunk*p + rank): in the V the model goes "
                f"down the ranks through chunk 0 and comes back up through chunk 1, so rank r holds stages r "
                f"and 2p-1-r: {list(want)}")
    if got == tuple((b, a) for a, b in want):
        return (head + "chunks swapped: chunk 0 is the way down (stage r), chunk 1 the way back up "
                "(stage 2p-1-r); the runtime runs a microbatch through chunk 0 first")
    if all(g[0] == r for r, g in enumerate(got)):
        off = {g[1] - w[1] for g, w in zip(got, want)}
        if len(off) == 1 and 0 not in off:
            d, last = off.pop(), got[0][1]
            if abs(d) > 1 and last % 2 == 1:  # 2q-1-r for another q: the V of q ranks written out
                return (head + f"chunk 1 holds {last} - r, the V of p = {(last + 1) // 2} hard-wired: the last "
                        f"stage is 2p-1, so write chunk 1's stage as 2p-1-r with the p given ({2 * p - 1} - r here)")
            return (head + f"chunk 1 {'one too high' if d == 1 else 'one too low' if d == -1 else f'{d:+d} off'} "
                    f"(an off-by-one in 2p-1-r): the stages are 0..2p-1 = 0..{2 * p - 1}, chunk 1 of rank 0 "
                    f"holds the last one, {2 * p - 1}, and rank p-1 the two middle ones, {p - 1} and {p}")
    if got == tuple((p - 1 - r, p + r) for r in range(p)):
        return (head + "the V upside down: the first stage (the embedding) and the last (the loss) share "
                "rank 0, at the top of the V, and rank p-1 holds the two middle stages p-1 and p")
    held = Counter(s for row in got for s in row)
    missing = [s for s in range(2 * p) if held[s] != 1]
    if missing:
        s = missing[0]
        return head + (f"stage {s} is held {held[s]} times: each of the 2p = {2 * p} stages sits on exactly "
                       f"one (rank, chunk)")
    r, c = next((r, c) for r in range(p) for c in (0, 1) if got[r][c] != want[r][c])
    return head + f"rank {r} chunk {c} holds stage {got[r][c]}, the V gives it {want[r][c]} (2p-1-r for chunk 1)"


def v_placement(fn, p: int) -> YourPlacement:
    """The placement `fn(p, rank, chunk)` gives p ranks (`fn` may be the source text defining
    ``v_stage``), the engine's own placement watched while it runs; LabError naming the
    mistake when it is not the V."""
    if isinstance(fn, str):
        fn = load(fn, ("v_stage",), {"Action": Action})["v_stage"]
    table = v_table(fn, p, _watch())
    problem = _v_diagnose(p, table)
    if problem:
        raise LabError(problem)
    return YourPlacement("v", p, 2, stages=table)


def v_schedule(pl: Placement, m: int) -> Schedule:
    """The engine's ZB-V on placement `pl`: its compute orders (which do not depend on the
    placement), with every message placed by `pl` (who sends to whom, and where no message
    is needed because the next stage is on the same rank)."""
    p = pl.p
    engine = make_schedule("zb-v", p, 2, m)
    orders = [[(a,) for a in engine.compute_actions(r)] for r in range(p)]
    return PlacedSchedule("zb-v", p, 2, m, with_timed_comms("zb-v", p, 2, orders, pl), placed=pl)


def _v_check(fn) -> tuple[str, dict, Schedule | None]:
    """('', the numbers, ZB-V on the learner's placement for the run) when `fn` is the V
    placement for every p of V_PS and the engine's ZB-V laid out on it validates with
    Qi et al.'s idle time; else (the first problem, {}, None)."""
    watch, tables = _watch(), {}
    for p in V_PS:
        tables[p] = v_table(fn, p, watch)
        problem = _v_diagnose(p, tables[p])
        if problem:
            return problem, {}, None
    numbers = {}
    for p, m in V_SHAPES:
        pl = YourPlacement("v", p, 2, stages=tables[p] if p in tables else v_table(fn, p, watch))
        try:
            sim = simulate(validate(v_schedule(pl, m)))  # F = B = W = 1 a chunk: a stage's T_F = 2
        except ScheduleError as e:
            return f"your v_stage: ZB-V on your placement, p={p}, m={m}, cannot run: {e}", {}, None
        want = v_bubble("zb-v", p, t_f=2.0)
        if m >= 2 * p - 1 and any(abs(i - want) > FORMULA_TOL for i in sim.idle):
            return (f"your v_stage: ZB-V on your placement, p={p}, m={m}: ranks idle {list(sim.idle)}, "
                    f"Qi et al.'s (p-1)*T_F/2 = {want:g}"), {}, None
        if not numbers:
            numbers = {"p": p, "m": m, "idle": list(sim.idle), "idle_formula": want,
                       "bubble_fraction": sim.bubble_fraction}
    return "", numbers, v_schedule(YourPlacement("v", RUN_V.pp, 2, stages=tables[RUN_V.pp]), TRAIN.microbatches)


# --- the run on real ranks ----------------------------------------------------------------------
def _messages(layout: ParallelConfig, rank: int) -> int:
    """Pipeline sends per step of pipeline rank `rank` (minitron.analysis.comm)."""
    items = comm_items(MODEL, layout, TRAIN, pp_rank=rank)
    return sum(i["calls"] for i in items if i["axis"] == "pp" and i["op"] == "send")


def _pipeline_job(comm, schedule: Schedule) -> dict | None:
    from ..train import Trainer

    layout = RUN_V if schedule.kind == "zb-v" else RUN  # the stretch's ZB-V on the learner's V placement
    tr = Trainer(MODEL, layout, TRAIN, comm, schedule=schedule)
    losses = [tr.step(i) for i in range(TRAIN.steps)]
    rank = comm.index("pp")
    sends = len(comm.trace.select(axis="pp", op="send", step=0))
    if sends != _messages(layout, rank):
        raise LabError(f"{schedule.kind}: pipeline rank {rank} sent {sends} messages in a step, the analysis "
                       f"says {_messages(layout, rank)}")
    res = versus_one_device(comm, tr, losses, MODEL, TRAIN)
    if res is not None:
        res["messages"] = sends
    return res


def check_interleaved(source: str, timeout: float = 60) -> dict:
    """Lab 02b: the interleaved 1F1B schedule `interleaved_1f1b(p, v, m, rank)` defined in
    `source` (and, optionally, ZB-H1's `zb_h1(p, m, rank)`): validated for a grid of
    (p, v, m), its bubble and peak stash compared with the analysis, then run by the
    pipeline runtime on 2 gloo ranks with 2 chunks each (float64, 2 steps, 4 microbatches)
    against the single-device model. Returns {"ok", "message", "bubble_fraction",
    "peak_stashed", "messages", "messages_1f1b", "zb_h1", "v_placement", "zb_v",
    "max_loss_abs_diff", "max_param_rel_diff"}, or {"ok": False, "message"} naming the first
    problem. Optionally `v_stage(p, rank, chunk)`, the V placement: the engine's ZB-V laid out
    on it, validated, simulated (idle vs Qi et al.'s) and run in the same launch of ranks."""
    try:
        with deadline(timeout):
            screen(source, ("interleaved_1f1b",), FORBIDDEN)
            with _watch().armed():  # the source's top level runs watched too
                ns = load(source, ("interleaved_1f1b",), {"Action": Action})
            problem, numbers = _static_check(ns["interleaved_1f1b"])
            if problem:
                return fail(problem)
            zb = "not attempted (optional)"
            if callable(ns.get("zb_h1")):
                problem = _zb_check(ns["zb_h1"])
                if problem:
                    return fail(problem)
                zb = "passed"
            vee, v_numbers, v_run = "not attempted (optional)", {}, None
            if callable(ns.get("v_stage")):
                problem, v_numbers, v_run = _v_check(ns["v_stage"])
                if problem:
                    return fail(problem)
            schedule = validate(build_schedule(ns["interleaved_1f1b"], RUN.pp, RUN.vpp, TRAIN.microbatches))
    except Exception as e:  # LabError, LabTimeout, ScheduleError, or a surprise in the checker itself
        return fail(describe(e))
    cases = [(schedule,)] + ([(v_run,)] if v_run is not None else [])  # one launch of ranks for both
    runs = run_cases(_pipeline_job, ParallelConfig(pp=RUN.pp, device="cpu"), cases, timeout)
    for res, what in zip(runs, ("", "your v_stage: ZB-V on your placement: ")):
        if "message" in res:  # a failure of the run
            return {**res, "message": what + res["message"]}
    res = runs[0]
    exact = [r["max_loss_abs_diff"] <= TOL and r["max_param_rel_diff"] <= TOL for r in runs]
    if v_run is not None and exact[1]:
        vee = "passed"
    plain = _messages(ParallelConfig(pp=RUN.pp, device="cpu"), 0)
    stretch = " and ".join(n for n, done in (("ZB-H1", zb), ("the V placement", vee)) if done == "passed")
    bad = next((i for i, e in enumerate(exact) if not e), None)
    msg = (f"your interleaved 1F1B is valid for {len(SHAPES)} shapes (p, v, m), has (p-1)/(v*m) bubble and the "
           f"analysis' stash, and trains on {RUN.pp} ranks x {RUN.vpp} chunks exactly like the single-device "
           f"model" + (f"; {stretch} passed too" if stretch else "") if bad is None else
           f"{('your schedule', 'ZB-V on your v_stage placement')[bad]} validates but training on {RUN.pp} ranks "
           f"differs from the single-device model (loss by {runs[bad]['max_loss_abs_diff']:.3g}, "
           f"{runs[bad]['worst_param']} by {runs[bad]['max_param_rel_diff']:.3g})")
    return {"ok": bad is None, "message": msg, **numbers, "messages": res["messages"], "messages_1f1b": plain,
            "zb_h1": zb, "v_placement": vee, "zb_v": v_numbers, "max_loss_abs_diff": res["max_loss_abs_diff"],
            "max_param_rel_diff": res["max_param_rel_diff"]}
