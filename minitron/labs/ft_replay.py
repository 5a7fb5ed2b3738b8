"""Lab 08a: the replay of a fault-tolerant run (lesson 8, section 6; the engine's
``minitron.fault_tolerance.step_weights``, read by ``fault_tolerance.replay``).

A run of R torchft replicas (``train --ft-replicas R``) averages each step over the replicas
in that step's quorum: replica r reads its contiguous share ``data.dp_rows(B, R, r)`` of the
global batch of B rows, and the step's gradient is the mean over the rows of the replicas
that took part, a smaller global batch when one was lost. Every replica journals the steps it
committed (one record per replica and step, as in ``--metrics``: ``{"step": the steps done
once it committed, so step index + 1, "replica", "life", "replicas", ...}``). The learner writes

* ``step_weights(journal, step, global_batch, replicas) -> [global_batch]`` float64: each
  row's share of the mean gradient of step `step` (counted from 0, as ``Trainer.step`` counts):
  1/(the rows of the replicas that committed it) on those rows, 0 elsewhere.

Graded, with no rank of its own, on the journal of a real run: 2 replicas of the tiny GPT, 12
float64 steps, replica 0 killed by a planted SIGKILL (``fault_tolerance.KillAt``) and restarted
by the launcher, recovering live from replica 1 (so replica 1 took some steps alone). First on
journals of 3 and 4 replicas the run cannot show (quorums of every size, a replica's two lives,
records out of order), each against the engine's weights, with the usual mistakes named (every
replica every step, the wrong replica's rows, the mean over the whole batch instead of the
participants', the journal's step taken as the step index); then the learner's function is
handed to the engine's single-device replay (``fault_tolerance.replay(weights=...)``) and the
replayed parameters must equal the run's (each replica that finished) in float64. A profile
hook refuses the engine's fault-tolerance module while the learner's code runs.

    run = ft_run()                          # about half a minute: the run the checks share
    result = check_ft_replay(SOURCE, run)   # {"ok", "message", "max_param_rel_diff", "fewer_replicas", ...}
"""
from __future__ import annotations

import torch

from .. import fault_tolerance as ftm
from ..config import TOLERANCE, ConfigError, ParallelConfig, TrainConfig, preset
from .runner import LabError, LabTimeout, Tripwire, call, deadline, fail, load, screen

NAMES = ("step_weights",)
FORBIDDEN = ("minitron.fault_tolerance.step_weights", "minitron.fault_tolerance")
ENGINE = "minitron.fault_tolerance"
TOL = TOLERANCE["float64"]
MODEL = preset("tiny")
REPLICAS = 2
TRAIN = TrainConfig(steps=12, global_batch=4, dtype="float64", warmup=2, eval_every=0, sample_tokens=0,
                    progress=False)
# (replicas, global batch, {step: the replicas that committed it}, the lives of the replica that was lost)
HELD_OUT = ((3, 12, {0: [0, 1, 2], 1: [0, 2], 2: [2], 3: [1, 2], 4: [0, 1, 2]}, {0: [0, 0, 1], 1: [0, 1, 1]}),
            (4, 16, {0: [0, 1, 2, 3], 1: [1, 3], 2: [0, 1, 3], 3: [3], 4: [0, 2, 3], 5: [0, 1, 2, 3]}, {}))


# --- the run the checks share --------------------------------------------------------------------
def ft_run(timeout_s: float = 150.0) -> dict:
    """The real run the checks read: 2 replicas of the tiny GPT on local ranks, replica 0
    SIGKILLed at its fourth step or later and restarted after a second (it recovers live from
    replica 1). Returns the journal, the steps as taken and each finished replica's parameters;
    ConfigError, in one line, when torchft is missing or the run had no step with fewer replicas
    (the restarted replica was back before its peer had committed a step alone: run it again)."""
    cfg = ftm.FaultTolerance(replicas=REPLICAS, restart_after_s=1.0, timeout_s=10, quorum_timeout_s=20,
                             deadline_s=timeout_s)
    out = ftm.train_replicas(MODEL, ParallelConfig(), TRAIN, None, cfg, fault=ftm.KillAt(replica=0, step=3))
    params = {r: e["params"] for r, e in out["replicas"].items() if e.get("params") is not None}
    if not out["fewer_replicas"] or not params or sorted(out["taken"]) != list(range(TRAIN.steps)):
        raise ConfigError(f"the fault-tolerant run did not lose a replica for a step (steps with fewer replicas "
                          f"{out['fewer_replicas']}, restarts {out['restarts']}): run ft_run() again")
    return {"journal": out["journal"], "taken": out["taken"], "params": params, "restarts": out["restarts"],
            "fewer_replicas": out["fewer_replicas"]}


def _journal(taken: dict, lives: dict) -> list[dict]:
    """A journal as replicas write it (records out of step order: each replica its own file),
    for `taken`; `lives`: {replica: the life of each of its steps, in order}, else life 0."""
    records, seen = [], {}
    for r in sorted({r for rs in taken.values() for r in rs}, reverse=True):
        for s in sorted(taken):
            if r in taken[s]:
                i = seen.setdefault(r, 0)
                seen[r] += 1
                life = lives.get(r, [])[i] if i < len(lives.get(r, [])) else 0
                records.append({"step": s + 1, "loss": 0.0, "grad_norm": 0.0, "replica": r, "life": life,
                                "replicas": len(taken[s]), "of": max(len(rs) for rs in taken.values()),
                                "fewer_replicas": False, "time": 0.0})
    return records


# --- the checker's answers and the usual mistakes ------------------------------------------------
def _rows(B: int, R: int, replicas) -> torch.Tensor:
    w = torch.zeros(B, dtype=torch.float64)
    for r in replicas:
        w[r * (B // R):(r + 1) * (B // R)] = 1.0
    return w


def _mistakes(B: int, R: int, taken: dict, step: int) -> list[tuple[torch.Tensor, str]]:
    """The weights each usual mistake gives `step`, and what to say of it."""
    who = taken[step]
    present = _rows(B, R, who)
    out = [(torch.full((B,), 1.0 / B, dtype=torch.float64),
            "averages every replica's rows at every step: a step taken by fewer replicas averaged only the rows of "
            "the replicas that committed it (the journal's records of that step)"),
           (present / B, "divides by the whole global batch: the replicas' all-reduce is the mean of the participants' "
                         "means, 1/(their rows) on each of their rows (the step's weights sum to 1)"),
           (present * (R / B), "gives each row the weight of one replica's mean, R/B: the step is the mean over the "
                               "participants' rows (their weights sum to 1)")]
    first = _rows(B, R, range(len(who)))
    if not torch.equal(first, present):
        out.append((first / first.sum(), "takes the rows of the first n replicas: a step's rows are those of the "
                                         "replicas that committed it, replica r's share dp_rows(B, R, r)"))
    absent = _rows(B, R, [r for r in range(R) if r not in who])
    if absent.sum() > 0:
        out.append((absent / absent.sum(), "takes the rows of the replicas that were not in the step's quorum"))
    for other, said in ((step - 1, "the journal's step is the count of steps done once the step committed (index + 1): "
                                   "step s is the records with \"step\" == s + 1"),
                        (step + 1, "reads the records of the next step: step s is the records with \"step\" == s + 1")):
        if other in taken and taken[other] != who:
            out.append((_rows(B, R, taken[other]) / _rows(B, R, taken[other]).sum(), said))
    return out


# --- the checks ------------------------------------------------------------------------------------
def _malformed(w, B: int, step: int) -> str:
    if not isinstance(w, torch.Tensor) or tuple(w.shape) != (B,):
        shape = list(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        return (f"your step_weights returned {shape} for step {step}: return one weight per row of the global "
                f"batch, [{B}]")
    if not w.dtype.is_floating_point:
        return f"your step_weights returned {w.dtype} weights: return float64 shares (1/n, not counts or a mask)"
    if not torch.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        return (f"your step_weights returned a negative or non-finite weight, or none, for step {step}: a step's "
                f"shares are 0 or positive and sum to 1")
    return ""


def _judge(fn, journal: list[dict], B: int, R: int, taken: dict, watch: Tripwire, where: str) -> str:
    """Every step of `taken`: the learner's weights against the engine's, a usual mistake named."""
    want = ftm.step_weights(B, R, taken)
    for step in sorted(taken):
        records = [dict(rec) for rec in journal]
        with watch.armed():
            got = call("your step_weights", fn, records, step, B, R)
        if records != journal:
            return "your step_weights changes the journal it is given: the replay reads it for every step"
        if (isinstance(got, torch.Tensor) and got.numel() and not (torch.isfinite(got).all() and got.sum() > 0)
                and not any(rec["step"] == step for rec in journal)):
            return (f"your step_weights finds no replica for step {step}: the journal's \"step\" is the count of steps "
                    f"done once the step committed (index + 1), so step s is the records with \"step\" == s + 1{where}")
        problem = _malformed(got, B, step)
        if problem:
            return problem + where
        got = got.detach().to(torch.float64)
        if torch.allclose(got, want(step), rtol=1e-12, atol=1e-15):
            continue
        said = next((s for w, s in _mistakes(B, R, taken, step) if torch.allclose(got, w, rtol=1e-12, atol=1e-15)), "")
        if said:
            return f"your step_weights {said} (step {step}, committed by replicas {taken[step]} of {R}{where})"
        return (f"your step_weights gives step {step} the weights {[round(x, 4) for x in got.tolist()]}; it was "
                f"committed by replicas {taken[step]} of {R}, whose rows each weigh "
                f"{want(step).max().item():.4g}{where}")
    return ""


def _rel_diff(full: dict, ref: dict) -> float:
    return max(((full[k]["param"] - ref[k]["param"]).abs().max() / ref[k]["param"].abs().max().clamp_min(1e-30)).item()
               for k in ref)


def _replayed(fn, run: dict, watch: Tripwire) -> dict:
    """The engine's single-device replay of the run's steps, its weights the learner's."""
    def weights(step: int):
        records = [dict(rec) for rec in run["journal"]]
        with watch.armed():
            return call("your step_weights", fn, records, step, TRAIN.global_batch, REPLICAS)
    try:
        return ftm.replay(MODEL, TRAIN, run["taken"], REPLICAS, weights=weights)
    except ValueError as e:
        raise LabError(f"the replay cannot take your weights: {e}") from None


def check_ft_replay(source: str, run: dict | None = None, timeout: float = 60) -> dict:
    """Lab 08a: check `step_weights` defined in `source` on held-out journals of 3 and 4
    replicas and on the journal of `run` (:func:`ft_run`'s; made here when None: about half a
    minute), then replay the run's steps on one device with it and compare the parameters with
    the run's, float64. Returns {"ok", "message", "max_param_rel_diff", "fewer_replicas"}, or
    {"ok": False, "message"} naming the first problem (also when the code does not compile, is
    the stub, uses the engine's fault-tolerance module, raises or runs past `timeout`)."""
    try:
        screen(source, NAMES, FORBIDDEN)
        watch = Tripwire({ENGINE: ftm})
        with deadline(timeout):
            with watch.armed():
                fn = load(source, NAMES, {"torch": torch})[NAMES[0]]
            for R, B, taken, lives in HELD_OUT:
                where = f"; a journal of {R} replicas, B = {B}"
                problem = _judge(fn, _journal(taken, lives), B, R, taken, watch, where)
                if problem:
                    return fail(problem)
        run = run or ft_run()  # ranks of its own: outside the learner's deadline
        with deadline(timeout):
            problem = _judge(fn, run["journal"], TRAIN.global_batch, REPLICAS, run["taken"], watch,
                             "; the real run's journal")
        if problem:
            return fail(problem)
        replayed = _replayed(fn, run, watch)  # the same calls as the line above: they end
    except (LabError, ConfigError) as e:
        return fail(str(e))
    except LabTimeout:
        return fail(f"your step_weights ran past {timeout:.0f} s: an endless loop?")
    diff = max(_rel_diff(p, replayed) for p in run["params"].values())
    ok = diff <= TOL
    message = (f"your step_weights replays the fault-tolerant run exactly: every replica's parameters equal the "
               f"single-device replay of the steps as taken (steps {run['fewer_replicas']} with fewer replicas)" if ok
               else f"your step_weights passes the checks above but the replay differs from the run's parameters "
                    f"by {diff:.3g} (relative)")
    return {"ok": ok, "message": message, "max_param_rel_diff": diff, "fewer_replicas": run["fewer_replicas"]}
