"""Fault-tolerant data parallelism: training that survives a lost replica without stopping.

At scale a rank is lost every few hours: the Llama 3 paper (Grattafiori et al. 2024, §3.3.4)
counts 419 unexpected interruptions in 54 days of pre-training on 16,384 H100s. A job that
any lost rank ends pays, each time, the steps since its last checkpoint and a restart of
every rank. torchft (PyTorch, https://github.com/pytorch/torchft; the library is used here,
not copied) keeps the healthy replicas training instead:

* each data-parallel *replica* (its own world of tensor and pipeline ranks) is a torchft
  replica group;
* before every step a **quorum** (torchft's ``Manager.start_quorum``, decided by the
  *Lighthouse*, a small server the job starts) fixes which replicas take part;
* the gradient average over the replicas goes through torchft (``Manager.allreduce`` on its
  reconfigurable gloo group, reached as ``Comm``'s ``'replica'`` axis): it is the mean over
  the replicas *in the quorum* (each rank with its peers at the same place in the other
  replicas: per tensor shard, per pipeline stage; one flat buffer per rank and step, which
  ``analysis.comm.replica_items`` counts and ``--trace`` records), and a replica lost during
  it makes the step uncommitted (``Manager.should_commit`` is False: the optimizer does not
  step, and the step is taken again by the replicas that are left);
* a replica that died is restarted by the launcher here and **recovers live** from a
  healthy one: the quorum finds it behind, and torchft's checkpoint transport (HTTP) sends it
  the healthy replica's parameters, optimizer state, step (its data position: a batch is a
  pure function of (seed, step)) and RNG state, through the state-dict functions this
  module registers. No file is written and no other replica stops.
* a replica stopped or hung (SIGSTOP, a wedged device) drops out of the quorum once its
  heartbeat stops (torchft's Lighthouse), and the others go on without it; the launcher
  sees it commit nothing for ``FaultTolerance.stalled_s`` while another replica commits,
  ends it (SIGKILL) and restarts it like a lost one. A replica lost while it recovers (its
  peer's state received, not loaded) is restarted again; when its restarts
  (``--ft-max-restarts``) run out, the run says so and the others finish.

The oracle still holds: every replica records the steps it committed, so the steps that
were really taken are known with the replicas each averaged; :func:`replay` runs them on one
device, each step's batch being only those replicas' rows (:func:`step_weights`: each row's
share of the step's mean), and ends with the same parameters (float64, to rounding). A step
with fewer replicas is said in the metrics.

What this does not do (yet): replicas with ZeRO shards, experts, context or data ranks
inside, --timeline (refused in one line); evaluation, the text sample and periodic
checkpoints during the run (a checkpoint is written only when the Lighthouse is lost); two
nodes (the launcher starts the replicas on this machine). A replica stopped before its
life's first commit (while it starts or recovers) is ended only once the others have
finished.
"""
from __future__ import annotations

import datetime
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import data as data_mod
from .comm import REPLICA_AXIS, Comm
from .config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from .launch import _start_fork_server, die_with, rank_main, RankFailed
from .optim import AdamW
from .train import Trainer, default_data_parallel

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own variable: where a replica finds the Lighthouse
LIGHTHOUSE_PID_ENV = "MINITRON_LIGHTHOUSE_PID"  # for a planted fault (tests kill the Lighthouse)


@dataclass(frozen=True)
class FaultTolerance:
    """How many replicas, and every wait's bound (seconds unless named in ms)."""

    replicas: int = 2
    timeout_s: float = 10.0  # a collective over the replicas, should_commit, the recovery transfer
    quorum_timeout_s: float = 15.0  # one quorum (also: how long a lost Lighthouse takes to be noticed)
    heartbeat_timeout_ms: int = 1000  # the Lighthouse's: a replica silent this long is out of the quorum
    join_timeout_ms: int = 500  # the Lighthouse waits this long for heartbeating stragglers
    max_restarts: int = 3  # per replica
    restart_after_s: float = 0.0  # a lost replica is restarted this long after its loss was seen
    deadline_s: float = 600.0  # the whole run

    @property
    def stalled_s(self) -> float:
        """The longest a live replica can go without committing while another commits: a
        failed all-reduce (timeout), a quorum, a recovery from a peer (timeout) and its step.
        A replica silent longer is stopped or hung (SIGSTOP, a wedged device): it is ended
        and restarted like a lost one."""
        return self.quorum_timeout_s + 2 * self.timeout_s


# --- the refusals ----------------------------------------------------------------------------------
def check(model: ModelConfig, layout: ParallelConfig, train: TrainConfig, ft: FaultTolerance) -> None:
    """One line for what fault-tolerant replicas do not support, before any rank starts."""
    def no(what: str, fix: str):
        raise ConfigError(f"--ft-replicas: {what} is not supported with fault-tolerant replicas; {fix}")

    if ft.replicas < 1:
        no(f"{ft.replicas} replicas", "give --ft-replicas 1 or more")
    if layout.dp > 1 or layout.cp > 1 or layout.ep > 1:
        no("--dp/--cp/--ep inside a replica", "the replicas are the data-parallel axis: drop --dp, --cp and --ep")
    if layout.zero1 or layout.zero > 0:
        no("ZeRO (--zero/--zero1)", "drop it: each replica keeps the whole optimizer state")
    if model.experts or (layout.precision == "fp8" and layout.fp8_recipe == "delayed"):
        no("a state beyond parameters and AdamW (experts' bias, FP8 amax history)", "train a dense model")
    if train.global_batch % (ft.replicas * train.microbatches):
        no(f"--global-batch {train.global_batch} over {ft.replicas} replicas x {train.microbatches} microbatches",
           f"make it a multiple of {ft.replicas * train.microbatches}")
    if train.resume:
        no("--resume", "start afresh (a replica recovers from its peers, not from disk)")
    if train.timeline:
        no("--timeline", "drop it (the replicas' steps are in --metrics, their calls in --trace)")


def replica_rows(global_batch: int, replicas: int, replica: int):
    """Replica `replica`'s rows of every step's global batch (its 1/replicas share)."""
    rows = data_mod.dp_rows(global_batch, replicas, replica)
    return lambda step: rows


def step_weights(global_batch: int, replicas: int, taken: dict):
    """Each row's share of a committed step's mean gradient, for the single-device replay:
    ``weights(step)`` -> [global_batch] float64, 1/(rows of the quorum) on the rows of the
    replicas in the step's quorum (`taken`: {step: [replica, ...]}), 0 elsewhere. The
    replicas' all-reduce averages their own means, so a step with n of R replicas is the
    plain mean over n·B/R rows: a smaller global batch, not a batch with missing rows."""
    def weights(step: int) -> torch.Tensor:
        w = torch.zeros(global_batch, dtype=torch.float64)
        for r in taken[step]:
            w[data_mod.dp_rows(global_batch, replicas, r)] = 1.0
        return w / w.sum()
    return weights


def rows_and_scale(w: torch.Tensor) -> tuple[list[int], float]:
    """A step's row weights as the Trainer takes them: the rows it reads (the mean over them)
    and the factor on that mean (1 when the weights sum to 1). ValueError, in one line, for
    weights the Trainer cannot take (not one value over the rows they cover, negative, none)."""
    w = torch.as_tensor(w, dtype=torch.float64).reshape(-1)
    rows = w.nonzero().reshape(-1)
    if rows.numel() == 0 or (w < 0).any() or not torch.allclose(w[rows], w[rows][0].expand(rows.numel()),
                                                                rtol=1e-12, atol=0):
        raise ValueError("a step's weights must be one non-negative value on the rows it averaged and 0 elsewhere "
                         f"(got {[round(x, 6) for x in w.tolist()]})")
    return rows.tolist(), float(w.sum())


class AfterTheLayout:
    """A gradient synchroniser that runs the layout's own (`inner`) and adds a step of its own
    after it, in ``finish``: the Trainer's ``data_parallel`` seam, which both the replicas'
    mean and the replay's scaling take."""

    def __init__(self, inner):
        self.inner, self.comm, self.params = inner, inner.comm, inner.params

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def microbatch(self, last: bool):
        return self.inner.microbatch(last)


class ScaledGradients(AfterTheLayout):
    """The replay's gradient synchroniser: the layout's (one device: the mean over the
    step's rows), then that mean times the step's scale, `scales` giving one per step in the
    order the steps run (``rows_and_scale``: exactly 1 for the engine's own weights)."""

    def __init__(self, inner, scales):
        super().__init__(inner)
        self.scales = iter(scales)

    def finish(self) -> None:
        self.inner.finish()
        scale = next(self.scales)
        if scale != 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(scale)


# --- the gradient average over the replicas and the committed step --------------------------------
class ReplicaAverage(AfterTheLayout):
    """The replica's own gradient synchroniser (the layout's, inside the replica), then the mean
    over the replicas of the quorum: one flat all-reduce on the 'replica' axis (torchft)."""

    def __init__(self, inner, comm: Comm):
        super().__init__(inner)
        self.comm = comm

    def finish(self) -> None:
        """Gradients whole inside the replica, then averaged over the quorum's replicas."""
        self.inner.finish()
        grads = [p.grad for p in self.inner.params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.comm.all_reduce(flat, REPLICA_AXIS, op="avg")
        for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g))


def replica_data_parallel(params, comm: Comm, layout: ParallelConfig, chunks) -> ReplicaAverage:
    """The ``Trainer(data_parallel=...)`` factory of a fault-tolerant replica."""
    return ReplicaAverage(default_data_parallel(params, comm, layout, chunks), comm)


class CommittedStep:
    """Replicated AdamW that steps only when torchft commits the step (every replica of the
    quorum averaged its gradient without error); otherwise the step's gradient is dropped and
    the norm returned is NaN (the loop takes the step again)."""

    def __init__(self, inner: AdamW, manager):
        self.inner, self.manager = inner, manager
        self.params = inner.params

    def step(self, lr: float, max_norm: float = 0.0) -> torch.Tensor:
        if self.manager.should_commit(timeout=None):
            return self.inner.step(lr, max_norm)
        return torch.full((), float("nan"))

    def wait_params(self) -> None:
        self.inner.wait_params()

    materialize = wait_params

    def export_param_state(self) -> dict:
        return self.inner.export_param_state()

    def import_param_state(self, states: dict) -> None:
        self.inner.import_param_state(states)

    def state_tensors(self) -> list[torch.Tensor]:
        return self.inner.state_tensors()


def committed_optimizer(manager):
    """The ``Trainer(optimizer=...)`` factory of a fault-tolerant replica."""
    return lambda params, dp, layout, train: CommittedStep(AdamW(params, train, dp.comm), manager)


# --- what a recovering replica receives -----------------------------------------------------------
def trainer_state(tr: Trainer, step: int | None = None) -> dict:
    """This rank's part of its replica: parameters and AdamW state by name, the torch RNG
    state and the data position (``data.position``, what a checkpoint states: the engine's
    dropout keys are pure functions of (seed, step, microbatch), so the step is the data and
    dropout position) at `step`, the steps committed (torchft's, which it sends alongside;
    default the Trainer's own count). Copies: the transport serves them while this replica
    goes on."""
    adam, step = tr.optimizer.export_param_state(), tr.step_idx if step is None else step
    return {"params": {p.shard.name: p.detach().clone() for p in tr.params},
            "adam": {p.shard.name: {k: v.clone() if torch.is_tensor(v) else v for k, v in adam.get(p, {}).items()}
                     for p in tr.params},
            "rng": torch.get_rng_state(), "step": step, "data": _data_position(tr, step)}


def _data_position(tr: Trainer, step: int) -> dict:
    return data_mod.position(tr.tcfg, tr.mcfg.seq_len, len(tr.train_data), step)


@torch.no_grad()
def load_trainer_state(tr: Trainer, state: dict) -> None:
    """Take a healthy replica's :func:`trainer_state` (the same layout, the same rank in it),
    whose data position must be this replica's sampler's (every field but the step)."""
    changed = data_mod.position_changes(state["data"], _data_position(tr, state["step"]))
    if changed:
        raise ConfigError("the healthy replica's data position differs from this one's (" + ", ".join(
            f"{flag} {was} there, {now} here" for flag, was, now in changed) + "): start every replica alike")
    by_name = {p.shard.name: p for p in tr.params}
    for name, t in state["params"].items():
        by_name[name].copy_(t)
    tr.optimizer.import_param_state({by_name[n]: st for n, st in state["adam"].items() if st})
    torch.set_rng_state(state["rng"])
    tr.step_idx = state["step"]


# --- one replica's rank ---------------------------------------------------------------------------
def _replica_store(comm: Comm):
    """The TCP store of this replica group that torchft's Manager joins: the process group's
    (MASTER_ADDR:MASTER_PORT) with several ranks, else one of its own. (host, port, keep-alive)."""
    from torch.distributed import TCPStore

    if comm.grid.world > 1:
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return "127.0.0.1", store.port, store


def make_manager(comm: Comm, ft: FaultTolerance, replica: int):
    """torchft's Manager for this rank of replica `replica`: synchronous quorum (a replica
    behind heals before the step's forward, so every replica of a quorum contributes its
    own gradient), at least one replica per step, every wait bounded by `ft`."""
    from torchft import Manager, ProcessGroupGloo

    host, port, keep = _replica_store(comm)
    td = lambda s: datetime.timedelta(seconds=s)  # noqa: E731
    manager = Manager(pg=ProcessGroupGloo(timeout=td(ft.timeout_s)), load_state_dict=None, state_dict=None,
                      min_replica_size=1, use_async_quorum=False, timeout=td(ft.timeout_s),
                      quorum_timeout=td(ft.quorum_timeout_s), connect_timeout=td(ft.timeout_s),
                      rank=comm.grid.rank, world_size=comm.grid.world, store_addr=host, store_port=port,
                      lighthouse_addr=os.environ[LIGHTHOUSE_ENV], replica_id=f"replica{replica}",
                      init_sync=True, heartbeat_interval=datetime.timedelta(milliseconds=100))
    return manager, keep


def replica_job(comm: Comm, model: ModelConfig, layout: ParallelConfig, train: TrainConfig, corpus,
                ft: FaultTolerance, replica: int, life: int, journal: str, must_reach: int = 0, fault=None) -> dict:
    """One rank of replica `replica` (its `life`-th start): build the Trainer on the replica
    axis, register its state with torchft, train until the run's last step; its rank 0
    appends each committed step to `journal` (the launcher's record of who took part). A
    restarted replica (`life` > 0) must be brought to the run's step `must_reach` by a peer."""
    manager, keep = make_manager(comm, ft, replica)
    try:
        tr = Trainer(model, layout, train, comm.with_replicas(manager), corpus,
                     rows_of=replica_rows(train.global_batch, ft.replicas, replica),
                     data_parallel=replica_data_parallel, optimizer=committed_optimizer(manager))
        manager.register_state_dict_fn("trainer", lambda st: _recover(tr, st, fault, replica, life),
                                       lambda: trainer_state(tr, manager.current_step()))
        return _replica_steps(tr, manager, train, ft, (replica, life, journal, must_reach), fault)
    finally:
        manager.shutdown(wait=False)
        del keep


def _recover(tr: Trainer, state: dict, fault, replica: int, life: int) -> None:
    """A peer's state has arrived (torchft calls this in `start_quorum`): a planted fault
    that has a ``recovering(replica, life)`` method sees the recovery, then the state is
    loaded."""
    seen = getattr(fault, "recovering", None)
    if seen is not None:
        seen(replica, life)
    load_trainer_state(tr, state)


def _replica_steps(tr: Trainer, manager, train: TrainConfig, ft: FaultTolerance, who: tuple, fault) -> dict:
    """The loop: a quorum, then the step the quorum is at (a recovering replica was brought
    to it); the committed steps recorded (and written to the metrics by the replica's rank 0).
    A quorum that cannot be had (the Lighthouse is gone) stops the replica cleanly, with a
    checkpoint in ``<ckpt-dir>/replica<r>`` when there is a --ckpt-dir."""
    from .checkpoint import gather_full

    (replica, life, journal, must_reach), rank0 = who, tr.comm.grid.rank == 0
    out = {"replica": replica, "life": life, "stopped": None, "checkpoint": None}
    files = [open(f, "a") for f in (train.metrics, journal) if f and rank0]
    try:
        while True:
            try:
                manager.start_quorum()  # bounded by ft.quorum_timeout_s
            except Exception as e:  # noqa: BLE001 - torchft raises what the Lighthouse client raised
                out["stopped"] = _lighthouse_lost(e)
                out["checkpoint"] = _checkpoint(tr, train, replica, manager.current_step())
                break
            step = manager.current_step()
            if life > 0 and step < must_reach:  # no healthy peer brought it to the run's step
                out["stopped"] = (f"replica {replica} restarted but found no healthy replica to recover from "
                                  f"(the run was at step {must_reach}); it does not train alone from step 0")
                break
            if step >= train.steps:
                break
            if fault is not None:
                fault(replica, life, step)
            loss = tr.step(step)
            if manager.current_step() == step + 1:  # committed
                rec = _record(step, loss, tr, replica, life, tr.comm.size(REPLICA_AXIS), ft.replicas)
                for f in files:
                    f.write(json.dumps(rec) + "\n")
                    f.flush()
    finally:
        for f in files:
            f.close()
    out["params"] = gather_full(tr) if out["stopped"] is None else None
    out["trace"] = tr.comm.trace.records if tr.comm.trace is not None else None  # --trace: this life's calls
    return out


def _record(step: int, loss: float, tr: Trainer, replica: int, life: int, n: int, of: int) -> dict:
    """A committed step as the metrics say it: which replica, how many took part, of how many."""
    return {"step": step + 1, "loss": loss, "grad_norm": float(tr.last_grad_norm), "replica": replica,
            "life": life, "replicas": n, "of": of, "fewer_replicas": n < of, "time": time.time()}


def _lighthouse_lost(e: Exception) -> str:
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    return f"no quorum: the Lighthouse at {os.environ.get(LIGHTHOUSE_ENV)} did not answer ({first})"


def _checkpoint(tr: Trainer, train: TrainConfig, replica: int, step: int) -> str | None:
    """The replica's state at its last committed step, through the engine's checkpoints."""
    if not train.ckpt_dir or step == 0:
        return None
    from . import checkpoint as ckpt

    return str(ckpt.save(str(Path(train.ckpt_dir) / f"replica{replica}"), step, tr))


# --- the launcher: the Lighthouse, the replica groups, restarts -----------------------------------
def _torchft_extension() -> str:
    """The file of torchft's native extension (found without importing torchft)."""
    import importlib.util

    spec = importlib.util.find_spec("torchft")
    found = sorted(Path(spec.submodule_search_locations[0]).glob("_torchft*.so")) if spec else []
    if not found:
        raise ConfigError("--ft-replicas needs torchft (pip install torchft==0.2.0; `make env` installs it)")
    return str(found[0])


class Lighthouse:
    """torchft's Lighthouse in a process of its own, on a free port, for the job's lifetime:
    it prints its address, then lives until its stdin closes (the launcher stopped or died)."""

    # torchft's native extension alone (it needs no torch: the process is up in a fraction of a second)
    CODE = ("import sys, importlib.util as u; spec = u.spec_from_file_location('torchft._torchft', sys.argv[1]); "
            "m = u.module_from_spec(spec); spec.loader.exec_module(m); "
            "s = m.LighthouseServer(bind='[::]:0', min_replicas=1, join_timeout_ms=int(sys.argv[2]), "
            "heartbeat_timeout_ms=int(sys.argv[3])); print(s.address(), flush=True); sys.stdin.read(); s.shutdown()")

    def __init__(self, ft: FaultTolerance, start_timeout_s: float = 30.0):
        env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "error")}
        self.proc = subprocess.Popen([sys.executable, "-c", self.CODE, _torchft_extension(), str(ft.join_timeout_ms),
                                      str(ft.heartbeat_timeout_ms)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        ready, _, _ = select.select([self.proc.stdout], [], [], start_timeout_s)
        line = self.proc.stdout.readline().decode().strip() if ready else ""
        if not line.startswith("http"):
            self.stop()
            raise ConfigError(f"torchft's Lighthouse did not start within {start_timeout_s:.0f} s "
                              f"(is torchft installed? `make env` installs it)")
        self.address = line

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()


def _replica_rank(launcher: int, result: str, env: dict, layout, args: tuple, timeout_s: float,
                  trace: bool) -> None:
    """A replica's rank process: its group's environment, dies with the launcher, runs
    :func:`replica_job` and leaves its result for the launcher."""
    os.environ.update(env)
    die_with(launcher)
    if not os.environ.get("MINITRON_DEBUG"):  # torchft's and its HTTP server's log lines: into the scratch folder
        log = os.open(result + ".log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(log, 1)
        os.dup2(log, 2)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    out = rank_main(replica_job, layout, args, timeout_s, trace=trace)
    torch.save(out, result + ".tmp")
    os.replace(result + ".tmp", result)


@dataclass
class ReplicaGroup:
    """One start (`life`) of a replica: its rank processes and where their results go."""

    replica: int
    life: int
    procs: list
    results: list
    journal: Path

    def last_commit(self) -> float:
        """When this life last committed a step (its journal's time; 0 before its first)."""
        try:
            return self.journal.stat().st_mtime
        except FileNotFoundError:
            return 0.0

    def stalled(self, others: list, bound_s: float) -> bool:
        """Stopped or hung: this life has committed, then nothing for `bound_s` while
        another replica committed since (a whole run stalled, e.g. without its Lighthouse, is
        not one replica's fault)."""
        mine = self.last_commit()
        return 0 < mine < time.time() - bound_s and any(o.last_commit() > mine for o in others)

    def ended(self) -> bool:
        return all(p.exitcode is not None for p in self.procs)

    def lost(self) -> bool:
        """A rank ended without leaving a result (killed, crashed)."""
        return any(p.exitcode is not None and not Path(r).exists() for p, r in zip(self.procs, self.results))

    def kill(self) -> None:
        for p in self.procs:
            if p.exitcode is None:
                p.kill()
        for p in self.procs:
            p.join(timeout=10)

    def outcome(self) -> list:
        return [torch.load(r, weights_only=False) for r in self.results]


def journal_of(scratch: Path, replica: int, life: int) -> Path:
    """Where a replica's life records its committed steps (rank 0 writes, the launcher reads)."""
    return scratch / f"replica{replica}.life{life}.steps.jsonl"


def _run_step(scratch: Path) -> int:
    """The last step any replica has committed so far (from the journals)."""
    last = 0
    for f in scratch.glob("*.steps.jsonl"):
        for line in f.read_text().splitlines():
            try:
                last = max(last, json.loads(line)["step"])
            except ValueError:  # the line being written
                pass
    return last


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_group(ctx, scratch: Path, lighthouse: Lighthouse, replica: int, life: int, job_args: tuple,
                 layout: ParallelConfig, ft: FaultTolerance, fault) -> ReplicaGroup:
    """Start the ranks of one replica group: its own world (RANK, WORLD_SIZE, a free port)."""
    world, port, procs, results = layout.world, _free_port(), [], []
    traced = bool(job_args[2].trace)  # (model, layout, train, corpus): --trace
    for k in range(world):
        env = {"RANK": str(k), "WORLD_SIZE": str(world), "LOCAL_RANK": str(k), "LOCAL_WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), LIGHTHOUSE_ENV: lighthouse.address,
               LIGHTHOUSE_PID_ENV: str(lighthouse.proc.pid), "RUST_LOG": os.environ.get("RUST_LOG", "error")}
        result = str(scratch / f"replica{replica}.life{life}.rank{k}.pt")
        args = (*job_args, ft, replica, life, str(journal_of(scratch, replica, life)), _run_step(scratch), fault)
        p = ctx.Process(target=_replica_rank, daemon=True,
                        args=(os.getpid(), result, env, layout, args, ft.timeout_s * 3, traced))
        p.start()
        procs.append(p)
        results.append(result)
    return ReplicaGroup(replica, life, procs, results, journal_of(scratch, replica, life))


def train_replicas(model: ModelConfig, layout: ParallelConfig, train: TrainConfig, corpus,
                   ft: FaultTolerance, fault=None, log=None) -> dict:
    """Train on `ft.replicas` fault-tolerant replicas of `layout` on this machine: the
    Lighthouse started on a free port, each replica group started, a replica whose rank died
    or that stalled ended and restarted (up to `ft.max_restarts` times, while no replica has
    finished and the Lighthouse lives), everything stopped on the way out.
    `fault(replica, life, step)`: called on every rank before each step, and its
    ``recovering(replica, life)``, where it has one, when a peer's state has arrived (a
    test's planted fault). Returns :func:`summary`."""
    import multiprocessing as mp

    check(model, layout, train, ft)
    mp.set_forkserver_preload(["torch", "torch.distributed", "minitron.train"])
    _start_fork_server()
    ctx = mp.get_context("forkserver")
    scratch = Path(tempfile.mkdtemp(prefix="minitron_ranks_"))
    lighthouse, groups = None, {}
    try:
        lighthouse = Lighthouse(ft)
        start = lambda r, life: _start_group(ctx, scratch, lighthouse, r, life, (model, layout, train, corpus),  # noqa: E731
                                             layout, ft, fault)
        groups = {r: start(r, 0) for r in range(ft.replicas)}
        outcomes, restarts = _supervise(groups, start, lighthouse, ft, log)
        journals = [json.loads(line) for f in sorted(scratch.glob("*.steps.jsonl"))
                    for line in f.read_text().splitlines() if line.strip()]
    finally:
        for g in groups.values():
            g.kill()
        if lighthouse is not None:
            lighthouse.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    out = summary(outcomes, restarts, journals, ft)
    if train.trace:
        write_trace(train.trace, out["replicas"])
    return out


def write_trace(path: str, ends: dict) -> None:
    """--trace: the calls of every rank of each replica's last life, one JSON line each,
    labelled with its replica and life (``rank`` is the rank inside the replica; a step
    that was not committed and its retake carry the same ``step``)."""
    with open(path, "w") as f:
        for r, end in sorted(ends.items()):
            for rec in end.get("trace") or []:
                f.write(json.dumps({**rec, "replica": r, "life": end["life"]}) + "\n")


def _supervise(groups: dict, start, lighthouse: Lighthouse, ft: FaultTolerance, log) -> tuple[dict, dict]:
    """Watch the replica groups until each has ended: a lost one (a rank died) or a stalled
    one (stopped or hung past `ft.stalled_s`) is ended and, after `ft.restart_after_s`,
    started again, while no replica has finished, the Lighthouse lives and it has restarts
    left; returns ({replica: its ranks' results or why it ended}, {replica: restarts})."""
    outcomes, restarts, due, deadline = {}, {r: 0 for r in groups}, {}, time.monotonic() + ft.deadline_s
    grace, first_end = ft.quorum_timeout_s + ft.timeout_s, []  # how long the rest may take after one finished

    def restart(r: int, why: str) -> None:
        groups[r].kill()
        if restarts[r] >= ft.max_restarts:
            outcomes[r] = [f"replica {r} {why} after {restarts[r]} restarts; not restarted (--ft-max-restarts)"]
            return
        restarts[r] += 1
        due[r] = time.monotonic() + ft.restart_after_s
        if log:
            log(f"minitron: replica {r} {why}; restarting it in {ft.restart_after_s:g} s (restart {restarts[r]})")

    while len(outcomes) < len(groups):
        if time.monotonic() > deadline:
            raise ConfigError(f"the fault-tolerant run did not end within {ft.deadline_s:.0f} s")
        time.sleep(0.05)
        for r, g in groups.items():
            if r in outcomes:
                continue
            others = [o for q, o in groups.items() if q != r and q not in outcomes]
            if first_end and r not in due and time.monotonic() - first_end[0] > grace:  # stopped or hung
                g.kill()
                outcomes[r] = [f"replica {r} did not end within {grace:.0f} s of the others (stopped or hung): ended"]
            elif r in due:  # lost, waiting to be restarted
                if first_end or not lighthouse.alive():
                    outcomes[r] = [f"replica {r} lost after {restarts[r] - 1} restarts; not restarted "
                                   f"({'another replica finished' if first_end else 'the Lighthouse is gone'})"]
                elif time.monotonic() >= due[r]:
                    del due[r]
                    groups[r] = start(r, restarts[r])
            elif g.lost():
                restart(r, "lost a rank")
            elif g.ended():
                outcomes[r] = g.outcome()
                first_end.append(time.monotonic())
            elif g.stalled(others, ft.stalled_s):
                restart(r, f"committed no step for {ft.stalled_s:.0f} s while another replica did (stopped or hung)")
    return outcomes, restarts


def summary(outcomes: dict, restarts: dict, journals: list, ft: FaultTolerance) -> dict:
    """What the run did: per step the replicas that committed it (`taken`, from every life's
    journal: a killed life's steps included), the steps with fewer replicas, the restarts,
    each replica's end (its final parameters, or why it stopped or was lost), and the
    journal itself (every committed step's record, as in the metrics, by step and replica)."""
    failed = [x for ranks in outcomes.values() for x in ranks if isinstance(x, RankFailed)]
    if any(f.config for f in failed):
        raise ConfigError(next(f.message for f in failed if f.config))
    ends = {}
    for r, ranks in sorted(outcomes.items()):
        first = ranks[0]
        if isinstance(first, (str, RankFailed)):
            ends[r] = {"lost": first if isinstance(first, str) else first.message}
        else:
            ends[r] = {k: first[k] for k in ("stopped", "checkpoint", "params", "life")}
            ends[r]["trace"] = [rec for rank in ranks if isinstance(rank, dict) for rec in rank["trace"] or []]
    taken, said = {}, {}
    for rec in journals:
        taken.setdefault(rec["step"] - 1, set()).add(rec["replica"])
        said.setdefault(rec["step"] - 1, set()).add(rec["replicas"])
    taken = {s: sorted(rs) for s, rs in sorted(taken.items())}
    agree = all(said[s] == {len(rs)} for s, rs in taken.items())  # each replica's quorum size = who committed
    return {"taken": taken, "quorum_sizes_agree": agree, "restarts": restarts, "replicas": ends,
            "fewer_replicas": [s + 1 for s, rs in taken.items() if len(rs) < ft.replicas],
            "journal": sorted(journals, key=lambda rec: (rec["step"], rec["replica"]))}


# --- a planted fault ----------------------------------------------------------------------------
class KillAt:
    """A planted fault for ``train_replicas(fault=...)`` (the lesson's and lab 08a's run): every
    step takes at least `pace_s` on every rank (so that a restarted replica, a new process,
    is back before a short run ends), and rank `rank` of replica `replica` SIGKILLs itself at
    the first step from `step` on of its first life at which it has begun two steps (a
    replica that started late and healed is killed only once it has trained). Each rank
    process holds its own copy (the fault is pickled into it), so the count is its own."""

    def __init__(self, replica: int, step: int, rank: int = 0, pace_s: float = 0.1):
        self.replica, self.step, self.rank, self.pace_s = replica, step, rank, pace_s
        self.begun = 0

    def __call__(self, replica: int, life: int, step: int) -> None:
        if (life == 0 and replica == self.replica and int(os.environ["RANK"]) == self.rank and step >= self.step
                and self.begun >= 2):
            os.kill(os.getpid(), signal.SIGKILL)
        self.begun += 1
        time.sleep(self.pace_s)


# --- the oracle -------------------------------------------------------------------------------------
def replay(model: ModelConfig, train: TrainConfig, taken: dict, replicas: int, corpus=None,
           weights=None) -> dict:
    """The steps as they were taken, on one device: step s's batch is the rows of the
    replicas in its quorum (`taken`: {step: [replica, ...]}); returns the full parameters.
    `weights`: ``weights(step)`` -> each row's share of the step's mean gradient (default
    :func:`step_weights`; lab 08a passes a learner's), read through :func:`rows_and_scale`."""
    from .checkpoint import gather_full

    weights = weights or step_weights(train.global_batch, replicas, taken)
    steps = sorted(taken)
    plan = [rows_and_scale(weights(s)) for s in steps]
    rows = dict(zip(steps, (r for r, _ in plan)))
    tr = Trainer(model, ParallelConfig(), train, corpus=corpus, rows_of=rows.__getitem__,
                 data_parallel=lambda params, comm, layout, chunks: ScaledGradients(
                     default_data_parallel(params, comm, layout, chunks), [k for _, k in plan]))
    for step in steps:
        tr.step(step)
    return gather_full(tr)
