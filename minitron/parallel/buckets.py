"""The flat gradient (and parameter) layout of data parallelism: tensors back to back in
one buffer, cut into buckets, each bucket padded so that d ranks can split it evenly.

One plan for two readers: the engine (``parallel/data.py``: bucketed all-reduce and
ZeRO-1; ``parallel/zero.py``: ZeRO-2/3's units) lays its buffers out with these
functions, and the analysis (``minitron.analysis.data_parallel``, ``analysis.zero``)
counts calls and bytes from the very same plan.

Pure Python: no tensors, no processes.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Bucket:
    """A contiguous piece ``[start, end)`` of the flat gradient buffer."""

    index: int
    start: int
    end: int
    tensors: list = field(default_factory=list)  # positions of the tensors it touches (buffer order)
    late: bool = False  # started after backward (ZeRO-1: tensors summed over another axis first)
    axis: str = "dp"  # the data group its gradients are averaged over (their ShardInfo.data_axes)

    @property
    def numel(self) -> int:
        return self.end - self.start


def bucket_elements(bucket_mb: float, bytes_per_el: int) -> int:
    """`--bucket-mb` as a number of elements (at least one)."""
    return max(1, int(bucket_mb * 2**20) // bytes_per_el)


def plan_buckets(numels, cap: int, multiple: int = 1) -> tuple[list[int], list[Bucket], int]:
    """Lay tensors of `numels` elements one after another and cut the buffer into buckets.

    A bucket closes at the first tensor end that brings it to `cap` elements (so a tensor
    larger than `cap` gets a bucket of its own). With `multiple` > 1 (ZeRO-1: d) every
    bucket end is rounded up to a multiple of it — a tensor may then straddle two buckets —
    and the buffer is padded to ``ceil(n/multiple)·multiple``: each rank's slice of every
    bucket is whole, and the padding is only at the very end.

    Returns (offset of each tensor, buckets, buffer size in elements).
    """
    offsets, n = [], 0
    for k in numels:
        offsets.append(n)
        n += k
    total = -(-n // multiple) * multiple
    buckets: list[Bucket] = []
    start = 0
    for i, k in enumerate(numels):
        end = offsets[i] + k
        if end <= start:  # already inside the previous bucket (its rounding swallowed it)
            continue
        if i == len(numels) - 1:
            end = total
        elif end - start >= cap:
            end = min(total, -(-end // multiple) * multiple)
        else:
            continue
        buckets.append(Bucket(len(buckets), start, end))
        start = end
    if start < total:
        buckets.append(Bucket(len(buckets), start, total))
    for b in buckets:
        b.tensors = [i for i, (o, k) in enumerate(zip(offsets, numels)) if o < b.end and o + k > b.start]
    return offsets, buckets, total


def plan_by_axis(numels, axes, cap: int, multiple: int = 1) -> tuple[list[int], list[Bucket], int]:
    """:func:`plan_buckets` for tensors averaged over different data groups (`axes`, one per
    tensor, each group's tensors contiguous): each group gets its own buckets, one after
    the other, every bucket tagged with its group. One group is plain ``plan_buckets``."""
    offsets, buckets, base = [], [], 0
    for axis in dict.fromkeys(axes):
        idx = [i for i, a in enumerate(axes) if a == axis]
        offs, bks, n = plan_buckets([numels[i] for i in idx], cap, multiple)
        offsets += [o + base for o in offs]
        buckets += [Bucket(len(buckets) + k, b.start + base, b.end + base, [idx[t] for t in b.tensors], axis=axis)
                    for k, b in enumerate(bks)]
        base += n
    return offsets, buckets, base


def plan_units(unit_numels, d: int) -> tuple[list[int], list[Bucket], int]:
    """ZeRO-2/3's layout: units of tensors (``[[numel, ...], ...]``) one after another,
    each unit padded up to a multiple of `d`. Returns (offset of each tensor, one Bucket
    per unit, size of the flat layout); rank r's shard of unit u is
    ``[start + r·k, start + (r+1)·k)`` with ``k = numel/d``, and the shards of all units,
    concatenated, are the rank's flat shard."""
    offsets, buckets, n, i = [], [], 0, 0
    for numels in unit_numels:
        start, first = n, i
        for k in numels:
            offsets.append(n)
            n += k
            i += 1
        n = start + -(-(n - start) // d) * d
        buckets.append(Bucket(len(buckets), start, n, list(range(first, i))))
    return offsets, buckets, n
