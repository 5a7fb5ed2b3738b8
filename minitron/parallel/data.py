"""Data parallelism written on torch.distributed collectives.

`NaiveDataParallel` is the teaching baseline: after the last microbatch's backward,
all-reduce every gradient and divide by d. Earlier microbatches only accumulate
locally. The result equals the single-device gradient of the whole global batch,
because every microbatch loss is a mean over its tokens scaled by 1/m.
"""
from __future__ import annotations

from contextlib import contextmanager

from ..comm import Comm
from ..optim import unique_params


class NaiveDataParallel:
    """All-reduce every gradient after backward (one call per parameter)."""

    def __init__(self, params, comm: Comm):
        self.params, self.comm = unique_params(params), comm
        self.d = comm.size("dp")

    @contextmanager
    def microbatch(self, last: bool):
        """Wrap a microbatch's backward; only the last one will be synchronised."""
        yield

    def finish(self) -> None:
        """Average gradients over the data-parallel group (before the optimizer step)."""
        if self.d == 1:
            return
        for p in self.params:
            if p.grad is not None:
                self.comm.all_reduce(p.grad, "dp")
                p.grad.div_(self.d)


def make_data_parallel(params, comm: Comm, layout):
    """The gradient synchroniser chosen by `--dp-impl`."""
    return NaiveDataParallel(params, comm)
