"""A pipeline schedule as a value: for every pipeline rank, the ordered list of actions it
performs in one training step (a forward/backward of microbatch k on a model chunk, or
the send/receive of an activation or a gradient). `parallel/schedules.py` builds it,
`parallel/schedule_comms.py` places its sends and receives, the runtime
(`parallel/pipeline.py`) executes it, `parallel/schedule_check.py` proves it executable,
`analysis/pipeline_sim.py` times it and `viz` draws it.

Point-to-point contract between a schedule and the runtime (`schedule_check.validate`
proves it):
  * A rank executes `Schedule.steps(rank)` in order. A step is a compute action or a
    batch: a maximal run of consecutive comm actions, posted in list order as one
    `torch.distributed.batch_isend_irecv` and waited on (all of it) before the next
    step. Tensors received in a batch are consumed by the compute that follows.
  * Messages between two ranks match in posting order (NCCL, and gloo with the
    default tag): the k-th send from r to q is the k-th receive on q from r. The
    schedule makes each such pair agree on direction, microbatch and stage.
  * It never deadlocks, whether a send completes only once its receive is posted
    (rendezvous: a batch finishes when every partner op has been posted) or at once
    (eager). So the runtime may block on every batch, and needs no tags or threads.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Union

from ..config import SCHEDULES, V_SCHEDULES
from ..placement import Placement, placement_for

KINDS = SCHEDULES  # the schedule names, defined once in config
SPLIT_BACKWARD = ("zb-h1", *V_SCHEDULES)  # B is the input gradient, W the weight gradients
COMPUTE_OPS = ("F", "B", "W")
COMM_OPS = ("send_fwd", "recv_fwd", "send_bwd", "recv_bwd")


def default_costs(kind: str) -> dict[str, float]:
    """Uniform costs: backward twice the forward; the split-backward kinds (zb-h1, zb-v,
    dualpipe-v) split it into B=W=1. The timed comms placement uses them
    (`schedule_comms.with_timed_comms`), and so does the simulator by default."""
    return {"F": 1, "B": 1, "W": 1} if kind in SPLIT_BACKWARD else {"F": 1, "B": 2, "W": 0}


class ScheduleError(ValueError):
    """A schedule that cannot be executed (missing action, bad order, deadlock)."""


@dataclass(frozen=True)
class Action:
    """One thing a rank does: compute (F, B, W) or move a tensor (send/recv).

    `chunk` is always the *local* chunk on the rank that performs the action; for a
    send/recv it is the chunk that produced or will consume the tensor. `peer` is the
    pipeline rank at the other end of a send/recv, None for compute.
    In the split-backward kinds (zb-h1, zb-v, dualpipe-v) B is the input-gradient pass
    and W the weight-gradient pass; in the other kinds B is the full backward and there
    is no W.
    """
    op: str
    mb: int
    chunk: int = 0
    peer: int | None = None

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE_OPS

    def __str__(self) -> str:
        s = f"{self.op}{self.mb}.c{self.chunk}"
        if self.peer is None:
            return s
        return s + ("->" if self.op.startswith("send") else "<-") + str(self.peer)


Step = Union[Action, tuple]  # a compute Action, or a tuple of comm Actions (one batch)


@dataclass(frozen=True)
class Schedule:
    """`actions`: one ordered tuple per pipeline rank. `overlapped`: per rank, the
    (F, B) pairs that run as one overlapped F&B unit (DualPipe-V); on a GPU their compute
    and communication would overlap, on the CPU the runtime runs them one after the
    other and the pair is only a pairing in the schedule (the simulator prices it
    with an ``F&B`` cost when given)."""
    kind: str
    p: int
    v: int
    m: int
    actions: tuple[tuple[Action, ...], ...]  # one ordered tuple per pipeline rank
    overlapped: tuple[tuple[tuple[Action, Action], ...], ...] = ()

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    @cached_property
    def placement(self) -> Placement:
        return placement_for(self.kind, self.p, self.v)

    def stage(self, rank: int, chunk: int) -> int:
        return self.placement.stage(rank, chunk)

    def is_first(self, rank: int, chunk: int) -> bool:
        return self.placement.chunk_ends(rank, chunk)[0]

    def is_last(self, rank: int, chunk: int) -> bool:
        return self.placement.chunk_ends(rank, chunk)[1]

    def compute_actions(self, rank: int) -> tuple[Action, ...]:
        return tuple(a for a in self.actions[rank] if a.is_compute)

    def steps(self, rank: int) -> tuple[Step, ...]:
        """The rank's actions with each run of consecutive comm actions batched into a
        tuple: the runtime posts such a tuple as one batch_isend_irecv and waits."""
        out, batch = [], []
        for a in self.actions[rank]:
            if a.is_compute:
                if batch:
                    out.append(tuple(batch))
                    batch = []
                out.append(a)
            else:
                batch.append(a)
        if batch:
            out.append(tuple(batch))
        return tuple(out)
