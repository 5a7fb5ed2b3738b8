"""Stage placement: which layers each model chunk holds, and which pipeline rank holds
which chunk, the embedding and the head.

A pipeline of p ranks with v chunks each runs p·v virtual stages (model chunks, in
model order). A :class:`Placement` says which (rank, local chunk) holds each of them,
and so which rank holds the first stage (the embeddings) and the last (the final norm,
the output layer and the loss). It is the one home of that fact: the schedule
(``parallel/schedule_actions.Schedule.placement``), the grid's ``embed`` group, the Trainer's
chunks, the run report and every analysis module read it.

* "loop": Megatron's interleaving (PTD-P §2.2.2): stage ``chunk·p + rank``, the model
  wraps around the ranks v times; the last stage is on rank p−1.
* "v" (v = 2): rank r holds stages r and 2p−1−r (Qi et al.'s ZB-V, DeepSeek's
  DualPipe-V): the model goes down the ranks and back up, so rank 0 holds the first
  *and* the last stage, rank p−1 the two middle ones.

Which layers a virtual stage holds (:func:`stage_layers`: even, or ``--stage-layers``) is
the other half of the same fact, kept here beside it.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import V_SCHEDULES, ModelConfig, ParallelConfig

PLACEMENTS = ("loop", "v")


@dataclass(frozen=True)
class Placement:
    """Which global (virtual) stage each (pipeline rank, local chunk) holds (module
    docstring): `kind` "loop" or "v", `p` ranks, `v` chunks per rank."""
    kind: str
    p: int
    v: int

    def __post_init__(self):
        if self.kind not in PLACEMENTS:
            raise ValueError(f"unknown placement {self.kind!r}; choose one of {', '.join(PLACEMENTS)}")
        if self.kind == "v" and self.v != 2:
            raise ValueError(f"the V placement holds two chunks per rank, got v={self.v}")

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    def stage(self, rank: int, chunk: int) -> int:
        """The global stage of local chunk `chunk` on pipeline rank `rank`."""
        if self.kind == "v":
            return rank if chunk == 0 else 2 * self.p - 1 - rank
        return chunk * self.p + rank

    def locate(self, stage: int) -> tuple[int, int]:
        """(rank, local chunk) of global stage `stage`: the inverse of :meth:`stage`."""
        if self.kind == "v":
            return (stage, 0) if stage < self.p else (2 * self.p - 1 - stage, 1)
        return stage % self.p, stage // self.p

    def table(self) -> tuple[tuple[int, ...], ...]:
        """The stages of each rank, chunk by chunk: ((0, 7), (1, 6), ...) for V on 4 ranks."""
        return tuple(tuple(self.stage(r, c) for c in range(self.v)) for r in range(self.p))

    @property
    def first_rank(self) -> int:
        """The pipeline rank of the first stage (the embeddings)."""
        return self.locate(0)[0]

    @property
    def last_rank(self) -> int:
        """The pipeline rank of the last stage (final norm, output layer, loss): p−1 in
        the loop, 0 in the V."""
        return self.locate(self.num_stages - 1)[0]

    def holds_ends(self, rank: int) -> tuple[bool, bool]:
        """Whether pipeline rank `rank` holds the first stage and the last one."""
        return rank == self.first_rank, rank == self.last_rank

    def chunk_ends(self, rank: int, chunk: int) -> tuple[bool, bool]:
        """Whether local chunk `chunk` of rank `rank` is the first stage, the last stage."""
        s = self.stage(rank, chunk)
        return s == 0, s == self.num_stages - 1

    def end_ranks(self) -> list[int]:
        """The pipeline ranks holding the embedding or the head, sorted (one rank in a V):
        the ranks of the tied embedding's gradient sum."""
        return sorted({self.first_rank, self.last_rank})


def placement_for(kind: str, p: int, v: int = 1) -> Placement:
    """The placement a schedule kind runs on: V for zb-v and dualpipe-v, else the loop
    (on one rank the two are the same: its chunks in model order)."""
    return Placement("v" if kind in V_SCHEDULES and p > 1 else "loop", p, v)


def placement_of(layout) -> Placement:
    """The placement of a :class:`~minitron.config.ParallelConfig`'s pipeline (its
    schedule's)."""
    return placement_for(layout.schedule, layout.pp, layout.vpp)


# --------------------------------------------------------------------------------------
# Pipeline stages: which layers each virtual stage (model chunk) holds
# --------------------------------------------------------------------------------------
def split_layers(layers: int, chunks: int) -> list[int]:
    """Layer counts of `chunks` contiguous chunks, as even as possible (the first
    ``layers % chunks`` chunks get one more layer)."""
    if chunks < 1 or chunks > layers:
        raise ValueError(f"cannot split {layers} layers into {chunks} pipeline chunks")
    base, extra = divmod(layers, chunks)
    return [base + (1 if c < extra else 0) for c in range(chunks)]


def stage_layer_counts(layers: int, pp: int = 1, vpp: int = 1, explicit: tuple[int, ...] = ()) -> list[int]:
    """Layers of each of the pp·vpp virtual stages, in model order: `explicit`
    (``--stage-layers``) when given, else :func:`split_layers`."""
    if explicit:
        if len(explicit) != pp * vpp or sum(explicit) != layers:
            raise ValueError(f"stage_layers {tuple(explicit)} must have pp*vpp = {pp * vpp} entries "
                             f"summing to {layers}")
        return list(explicit)
    return split_layers(layers, pp * vpp)


def stage_layers(model: ModelConfig, layout: ParallelConfig) -> list[list[int]]:
    """Global layer ids of each of the pp·vpp virtual stages (model chunks), in order."""
    out, start = [], 0
    for n in stage_layer_counts(model.layers, layout.pp, layout.vpp, tuple(layout.stage_layers)):
        out.append(list(range(start, start + n)))
        start += n
    return out
