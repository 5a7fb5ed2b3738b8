"""The process grid: which rank does which part of the work.

Megatron's order (PTD-P §3): tensor-parallel rank varies fastest, then data,
then pipeline, so that a tensor group is a block of neighbouring ranks (one node):

    rank = tp_rank + tp * dp_rank + tp * dp * pp_rank

Context parallelism (``--cp``) sits between tensor and data, as in Megatron-Core (tp, cp,
dp, pp, fastest first): ``rank = tp_rank + tp*cp_rank + tp*cp*dp_rank + tp*cp*dp*pp_rank``.
Its ranks hold the same weights and different tokens, so gradients are averaged over
the 'dp_cp' axis (data and context ranks together, Megatron's data-parallel group
"with context parallel").

With 3-D tensor parallelism the tp ranks form a q×q×q cube with coordinates
(i, j, k), i fastest: tp_rank = i + q*j + q*q*k (Bian et al. 2021).

The rank arithmetic here is pure (no processes); :meth:`ProcessGrid.build_groups`
creates every torch.distributed group, in the same order on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .config import cube_edge, square_edge

AXES = ("tp", "cp", "dp", "pp")
CUBE_AXES = ("cube_i", "cube_j", "cube_k")
# 2-D / 2.5-D (SUMMA, Tesseract): tp_rank = c + q*r + q*q*k on a q×q×d grid; 'summa_row'
# is the line through a rank along which c varies, 'summa_col' r, 'summa_dep' k.
SUMMA_AXES = ("summa_row", "summa_col", "summa_dep")


@dataclass(frozen=True)
class Coord:
    tp: int
    dp: int
    pp: int
    cp: int = 0


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
    groups: dict = field(default_factory=dict, repr=False)

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.pp * self.cp

    @property
    def q(self) -> int:
        """Edge of the tensor cube (1 in 1-D mode)."""
        return cube_edge(self.tp) if self.cube else 1

    @property
    def summa_q(self) -> int:
        """Edge q of the 2-D / 2.5-D grid (q²·d = tp; 1 without one)."""
        return square_edge(self.tp // self.summa_depth) if self.summa_depth else 1

    # --- pure rank arithmetic -------------------------------------------------
    def coord(self, rank: int | None = None) -> Coord:
        r = self.rank if rank is None else rank
        if not 0 <= r < self.world:
            raise ValueError(f"rank {r} outside a world of {self.world}")
        tc = self.tp * self.cp
        return Coord(tp=r % self.tp, dp=(r // tc) % self.dp, pp=r // (tc * self.dp), cp=(r // self.tp) % self.cp)

    def rank_of(self, tp: int = 0, dp: int = 0, pp: int = 0, cp: int = 0) -> int:
        tc = self.tp * self.cp
        return tp + self.tp * cp + tc * dp + tc * self.dp * pp

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
        if axis in CUBE_AXES:
            q = self.q
            i, j, k = self.cube_coord(rank)
            pos = {"cube_i": 0, "cube_j": 1, "cube_k": 2}[axis]
            out = []
            for x in range(q):
                ijk = [i, j, k]
                ijk[pos] = x
                out.append(self.rank_of(tp=ijk[0] + q * ijk[1] + q * q * ijk[2], dp=c.dp, pp=c.pp, cp=c.cp))
            return out
        if axis in SUMMA_AXES:
            q, (r, col, k) = self.summa_q, self.summa_coord(rank)
            n = self.summa_depth if axis == "summa_dep" else q
            rck = {"summa_row": lambda x: (r, x, k), "summa_col": lambda x: (x, col, k),
                   "summa_dep": lambda x: (r, col, x)}[axis]
            return [self.rank_of(**{**vars(c), "tp": cc + q * rr + q * q * kk})
                    for rr, cc, kk in map(rck, range(n))]
        if axis == "embed":  # first and last pipeline stage hold the (tied) embedding
            return sorted({self.rank_of(c.tp, c.dp, 0, c.cp), self.rank_of(c.tp, c.dp, self.pp - 1, c.cp)})
        if axis == "dp_cp":  # gradient averaging under context parallelism: cp fastest, then dp
            return [self.rank_of(c.tp, d, c.pp, x) for d in range(self.dp) for x in range(self.cp)]
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
    def axes(self) -> list[str]:
        return (list(AXES) + (list(CUBE_AXES) if self.cube else [])
                + (list(SUMMA_AXES) if self.summa_depth else []) + (["dp_cp"] if self.cp > 1 else [])
                + ["embed", "world"])

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
        lines = ["rank  tp  dp  pp" + ("   (i,j,k)" if self.cube else "") + ("  cp" if self.cp > 1 else "")]
        for r in range(self.world):
            c = self.coord(r)
            extra = f"   {self.cube_coord(r)}" if self.cube else ""
            extra += f" {c.cp:>3}" if self.cp > 1 else ""
            lines.append(f"{r:>4} {c.tp:>3} {c.dp:>3} {c.pp:>3}{extra}")
        return "\n".join(lines)

