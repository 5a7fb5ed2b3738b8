"""A layout as the throughput model prices it and the planner ranks it: a run's
:class:`~minitron.config.ParallelConfig` and what pricing needs beyond it (one type, each
field spelled once), read from a planner entry by :meth:`PlannedLayout.of`."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import CP_MODES, ParallelConfig

__all__ = ["PlannedLayout", "PLANNED_CP_MODES"]


@dataclass(frozen=True)
class PlannedLayout(ParallelConfig):
    """A layout as the throughput model prices it and the planner ranks it: a run's
    :class:`minitron.config.ParallelConfig`, every field spelled and meant as there, with
    what a priced layout needs beyond it: its microbatch size (a run derives it from its
    :class:`~minitron.config.TrainConfig`) and HSDP's shard (``fsdp_shard``, which the
    engine does not run). Two things differ from a run, each for a reason:

    - the expert-parallel ranks are drawn from the tp·cp·dp ranks (Megatron-Core's expert
      parallelism), not an axis of their own, so ``world`` is tp·pp·dp·cp and ``dp``
      counts every data replica;
    - Megatron-LM's defaults: pipeline scatter/gather on, and the schedule (when not given)
      interleaved if vpp > 1 else 1F1B; ``cp_mode`` may also be ``"allgather"`` (K, V
      gathered first, exposed: Llama 3), which is priced but not run (``PLANNED_CP_MODES``).
    """

    schedule: str | None = None  # None: interleaved if vpp > 1 else 1f1b
    scatter_gather: bool = True
    microbatch_size: int = 1
    fsdp_shard: int = 0         # HSDP: parameters sharded over this many ranks (0: all dp·cp)

    def __post_init__(self):
        super().__post_init__()
        if self.schedule is None:
            object.__setattr__(self, "schedule", "interleaved" if self.vpp > 1 else "1f1b")

    @property
    def world(self) -> int:
        """GPUs of the layout: t·p·d·cp (the ep ranks are among them)."""
        return self.tp * self.pp * self.dp * self.cp

    @property
    def data_replicas(self) -> int:
        """Replicas that read different rows of the global batch: dp (ep is among them)."""
        return self.dp

    @classmethod
    def of(cls, entry: PlannedLayout | dict, carried: frozenset = frozenset()) -> PlannedLayout:
        """`entry` itself, or the PlannedLayout a planner entry (a dict) names: its fields,
        the keys of `carried` beside them left (a priced entry's prediction); any other key
        is refused by name, so that a misspelled field is never priced at its default."""
        if isinstance(entry, cls):
            return entry
        if not isinstance(entry, dict):
            raise TypeError(f"a layout to price is a PlannedLayout or a planner entry (dict), not "
                            f"{type(entry).__name__}")
        unknown = sorted(set(entry) - _PLANNED_FIELDS - carried)
        if unknown:
            raise ValueError(f"{', '.join(unknown)}: not a field of a PlannedLayout (its fields: "
                             f"{', '.join(sorted(_PLANNED_FIELDS))})")
        return cls(**{k: v for k, v in entry.items() if k in _PLANNED_FIELDS})


_PLANNED_FIELDS = frozenset(PlannedLayout.__dataclass_fields__)
# What the throughput model prices: the engine's modes and the all-gather it does not run
PLANNED_CP_MODES = CP_MODES[:1] + ("allgather",) + CP_MODES[1:]
