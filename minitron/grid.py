"""The process grid: which rank does which part of the work.

Megatron's order (PTD-P §3): tensor-parallel rank varies fastest, then data,
then pipeline, so that a tensor group is a block of neighbouring ranks (one node):

    rank = tp_rank + tp * dp_rank + tp * dp * pp_rank

Context parallelism (``--cp``) and expert parallelism (``--ep``) sit between tensor and
data, as in Megatron-Core (tp, cp, ep, dp, pp, fastest first, :data:`AXES`):
``rank = tp_rank + tp*cp_rank + tp*cp*ep_rank + tp*cp*ep*dp_rank + tp*cp*ep*dp*pp_rank``.
Context ranks hold the same weights and different tokens; expert ranks hold the same
dense weights, different experts and different rows of the batch. So a parameter's
gradient is averaged over the *data axes* it is replicated on (``ShardInfo.data_axes``):
a dense one over cp × ep × dp, an expert over cp × dp only. :meth:`ProcessGrid.data_axis`
names the group of such a set ('dp', 'dp_cp' — Megatron's data-parallel group "with
context parallel" —, 'dp_ep', 'dp_cp_ep').

USP (``--cp-mode usp --cp-a2a U``, Fang & Zhao 2024): the N context ranks form a U × R
grid, cp_rank = u + U·j (u fastest, so that the all-to-all's ranks are neighbours, and a
row's chunks r, 2N−1−r make the ring's load-balanced pair); the sub-axis 'cp_a2a' is the
U ranks of one row (j fixed: its all-to-all), 'cp_ring' the R of one column (u fixed: its ring).

With 3-D tensor parallelism the tp ranks form a q×q×q cube with coordinates
(i, j, k), i fastest: tp_rank = i + q*j + q*q*k (Bian et al. 2021).

The rank arithmetic here is pure (no processes); :meth:`ProcessGrid.build_groups`
creates every torch.distributed group, in the same order on every rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .config import ParallelConfig, cube_edge, square_edge
from .placement import Placement, placement_for, placement_of

AXES = ("tp", "cp", "ep", "dp", "pp")  # fastest first
# the axes whose ranks see different tokens of the batch, in the order a data-axis group is named
DATA_AXES = ("dp", "cp", "ep")
CUBE_AXES = ("cube_i", "cube_j", "cube_k")
# 2-D / 2.5-D (SUMMA, Tesseract): tp_rank = c + q*r + q*q*k on a q×q×d grid; 'summa_row'
# is the line through a rank along which c varies, 'summa_col' r, 'summa_dep' k.
SUMMA_AXES = ("summa_row", "summa_col", "summa_dep")
CP_SUB_AXES = ("cp_a2a", "cp_ring")  # USP's rows (all-to-all) and columns (ring) of the cp ranks


@dataclass(frozen=True)
class Coord:
    tp: int
    dp: int
    pp: int
    cp: int = 0
    ep: int = 0


@dataclass
class ProcessGrid:
    """Rank <-> coordinates, and the group of every axis.

    `groups[axis]` maps the axis name ('tp', 'dp', 'pp', 'cube_i', ..., 'world',
    'embed') to this rank's torch.distributed group (None until built, or when the
    world has one rank).
    """

    tp: int = 1
    dp: int = 1
    pp: int = 1
    rank: int = 0
    cube: bool = False
    cp: int = 1
    summa_depth: int = 0  # d of the q×q×d SUMMA grid (--tp-mode 2d: 1, 2.5d: d); 0: no such grid
    ep: int = 1  # expert parallel: the experts split over ep ranks that also split the batch
    cp_a2a: int = 1  # USP: the cp ranks of one all-to-all (U; the ring over cp/U); 1 otherwise
    # the pipeline's stage placement (the schedule's: who holds the embedding and the head);
    # None: the loop's, one chunk per rank
    placement: Placement | None = field(default=None, repr=False)
    groups: dict = field(default_factory=dict, repr=False)

    @property
    def world(self) -> int:
        return math.prod(self.sizes().values())

    @classmethod
    def for_layout(cls, layout: ParallelConfig, rank: int = 0) -> "ProcessGrid":
        """The grid of a ParallelConfig (its degrees and tensor mode), seen from `rank`."""
        return cls(tp=layout.tp, dp=layout.dp, pp=layout.pp, cp=layout.cp, ep=layout.ep,
                   cp_a2a=layout.cp_a2a if layout.cp_mode == "usp" else 1,
                   cube=layout.tp_mode == "3d", rank=rank, placement=placement_of(layout),
                   summa_depth=layout.tp_depth if layout.tp_mode in ("2d", "2.5d") else 0)

    @property
    def stages(self) -> Placement:
        """Which pipeline rank holds which chunk, the embedding and the head (the
        schedule's :class:`~minitron.placement.Placement`; the loop's by default)."""
        return self.placement or placement_for("1f1b", self.pp)

    @property
    def q(self) -> int:
        """Edge of the tensor cube (1 in 1-D mode)."""
        return cube_edge(self.tp) if self.cube else 1

    @property
    def summa_q(self) -> int:
        """Edge q of the 2-D / 2.5-D grid (q²·d = tp; 1 without one)."""
        return square_edge(self.tp // self.summa_depth) if self.summa_depth else 1

    # --- pure rank arithmetic -------------------------------------------------
    def sizes(self) -> dict[str, int]:
        """The size of each axis of :data:`AXES`, fastest first: the grid is this ordered
        list of axes, and a rank is its mixed-radix number."""
        return {a: getattr(self, a) for a in AXES}

    def coord(self, rank: int | None = None) -> Coord:
        r = self.rank if rank is None else rank
        if not 0 <= r < self.world:
            raise ValueError(f"rank {r} outside a world of {self.world}")
        index = {}
        for axis, n in self.sizes().items():  # fastest first: the digits of r
            r, index[axis] = divmod(r, n)
        return Coord(**index)

    def rank_of(self, tp: int = 0, dp: int = 0, pp: int = 0, cp: int = 0, ep: int = 0) -> int:
        index, rank, stride = {"tp": tp, "cp": cp, "ep": ep, "dp": dp, "pp": pp}, 0, 1
        for axis, n in self.sizes().items():
            rank += index[axis] * stride
            stride *= n
        return rank

    def data_index(self, rank: int | None = None) -> int:
        """Which share of the global batch this rank's data replica reads: the expert and
        data coordinates together, ep fastest (ep × dp replicas; context ranks share one)."""
        c = self.coord(rank)
        return c.ep + self.ep * c.dp

    @property
    def data_replicas(self) -> int:
        """The replicas that read different rows of the batch: ep × dp."""
        return self.ep * self.dp

    def data_axis(self, axes=DATA_AXES) -> str:
        """The name of the group over which a gradient replicated on `axes` (some of
        :data:`DATA_AXES`) is averaged: 'dp', then '_cp' and '_ep' for those of them with
        more than one rank ('dp' even when dp = 1: one name for "the data group")."""
        return "_".join(["dp"] + [a for a in DATA_AXES[1:] if a in axes and getattr(self, a) > 1])

    def cube_coord(self, rank: int | None = None) -> tuple[int, int, int]:
        """(i, j, k) of this rank's tensor rank on the q×q×q cube."""
        t, q = self.coord(rank).tp, self.q
        return t % q, (t // q) % q, t // (q * q)

    def summa_coord(self, rank: int | None = None) -> tuple[int, int, int]:
        """(r, c, k) of this rank's tensor rank on the q×q×d grid: row, column, depth."""
        t, q = self.coord(rank).tp, self.summa_q
        return (t // q) % q, t % q, t // (q * q)

    def axis_ranks(self, axis: str, rank: int | None = None) -> list[int]:
        """All global ranks in `rank`'s group along `axis`, ordered by the axis index."""
        c = self.coord(rank)
        if axis == "world":
            return list(range(self.world))
        if axis in AXES:
            n = getattr(self, axis)
            return [self.rank_of(**{**vars(c), axis: x}) for x in range(n)]
        if axis in CP_SUB_AXES:  # cp_rank = u + U·j: a row varies u, a column j
            u, j = c.cp % self.cp_a2a, c.cp // self.cp_a2a
            cps = ([x + self.cp_a2a * j for x in range(self.cp_a2a)] if axis == "cp_a2a"
                   else [u + self.cp_a2a * x for x in range(self.cp // self.cp_a2a)])
            return [self.rank_of(**{**vars(c), "cp": x}) for x in cps]
        if axis in CUBE_AXES:
            q = self.q
            i, j, k = self.cube_coord(rank)
            pos = {"cube_i": 0, "cube_j": 1, "cube_k": 2}[axis]
            out = []
            for x in range(q):
                ijk = [i, j, k]
                ijk[pos] = x
                out.append(self.rank_of(tp=ijk[0] + q * ijk[1] + q * q * ijk[2], dp=c.dp, pp=c.pp, cp=c.cp, ep=c.ep))
            return out
        if axis in SUMMA_AXES:
            q, (r, col, k) = self.summa_q, self.summa_coord(rank)
            n = self.summa_depth if axis == "summa_dep" else q
            rck = {"summa_row": lambda x: (r, x, k), "summa_col": lambda x: (x, col, k),
                   "summa_dep": lambda x: (r, col, x)}[axis]
            return [self.rank_of(**{**vars(c), "tp": cc + q * rr + q * q * kk})
                    for rr, cc, kk in map(rck, range(n))]
        if axis == "embed":  # the pipeline ranks of the first and the last stage hold the (tied) embedding
            return [self.rank_of(c.tp, c.dp, r, c.cp, c.ep) for r in self.stages.end_ranks()]
        if axis.startswith("tp_kv"):  # n neighbouring tensor ranks (one replicated kv head's copies)
            n = int(axis[len("tp_kv"):])
            first = c.tp - c.tp % n
            return [self.rank_of(**{**vars(c), "tp": first + x}) for x in range(n)]
        if axis.startswith("dp_") and set(axis.split("_")) <= set(DATA_AXES):  # a data-axis group
            parts = axis.split("_")
            vary = [a for a in AXES if a in parts]  # fastest first: cp, ep, dp
            base = vars(c)
            out = []
            for r in range(self.world):  # rank order is fastest-first order along the varied axes
                rc = vars(self.coord(r))
                if all(rc[a] == base[a] for a in AXES if a not in vary):
                    out.append(r)
            return out
        raise ValueError(f"unknown axis '{axis}'")

    def axis_index(self, axis: str, rank: int | None = None) -> int:
        r = self.rank if rank is None else rank
        return self.axis_ranks(axis, r).index(r)

    def axis_size(self, axis: str) -> int:
        return len(self.axis_ranks(axis))

    def all_groups(self, axis: str) -> list[list[int]]:
        """Every group along `axis`, as lists of ranks (the partition of the world)."""
        seen, out = set(), []
        for r in range(self.world):
            g = tuple(self.axis_ranks(axis, r))
            if g not in seen:
                seen.add(g)
                out.append(list(g))
        return out

    # --- groups ---------------------------------------------------------------
    def kv_share_axes(self) -> list[str]:
        """'tp_kv{n}' for every n dividing tp (1 < n < tp): the n neighbouring tensor ranks
        that hold copies of one key/value head when tp > kv_heads (grouped-query attention
        under 1-D tensor parallelism; their gradients are summed over exactly them)."""
        if self.cube or self.summa_depth:
            return []
        return [f"tp_kv{n}" for n in range(2, self.tp) if self.tp % n == 0]

    def axes(self) -> list[str]:
        return (list(AXES) + self.kv_share_axes() + (list(CUBE_AXES) if self.cube else [])
                + (list(CP_SUB_AXES) if self.cp_a2a > 1 else [])
                + (list(SUMMA_AXES) if self.summa_depth else []) + self.data_groups()
                + ["embed", "world"])

    def data_groups(self) -> list[str]:
        """The data-axis groups beyond 'dp' this grid needs: every parameter's (dense:
        cp × ep × dp, experts: cp × dp) when context or expert parallelism is on."""
        names = {self.data_axis(), self.data_axis(("dp", "cp"))}
        return sorted(n for n in names if n != "dp")

    def build_groups(self, timeout=None) -> "ProcessGrid":
        """Create every group of every axis (collective: all ranks call it in order)."""
        import torch.distributed as dist

        for axis in self.axes():
            for ranks in self.all_groups(axis):
                if axis == "world":
                    g = dist.group.WORLD
                else:
                    g = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
                if self.rank in ranks:
                    self.groups[axis] = g
        return self

    def describe(self) -> str:
        """A table of every rank's coordinates (handy in lessons)."""
        lines = ["rank  tp  dp  pp" + ("   (i,j,k)" if self.cube else "") + ("  cp" if self.cp > 1 else "")
                 + ("  ep" if self.ep > 1 else "")]
        for r in range(self.world):
            c = self.coord(r)
            extra = f"   {self.cube_coord(r)}" if self.cube else ""
            extra += f" {c.cp:>3}" if self.cp > 1 else ""
            extra += f" {c.ep:>3}" if self.ep > 1 else ""
            lines.append(f"{r:>4} {c.tp:>3} {c.dp:>3} {c.pp:>3}{extra}")
        return "\n".join(lines)

