"""Lab 0: the ring all-reduce, written from point-to-point messages.

Every rank holds a flat tensor of N elements; all-reduce leaves the sum of all n of them
on every rank. The ring does it with each rank talking only to its neighbours (Patarasuk
& Yuan 2009; what NCCL and gloo run for large messages): cut the tensor into n chunks,
then

1. **reduce-scatter**, n − 1 steps: at each step every rank sends one chunk to the next
   rank and adds the chunk it receives from the previous one into its own; afterwards
   each rank holds one chunk summed over all ranks;
2. **all-gather**, n − 1 steps: the summed chunks travel once more around the ring,
   each rank overwriting its copy with the one it receives.

2(n − 1) rounds of one chunk each: every rank sends 2(n − 1)/n · N elements, whatever n
(:func:`minitron.analysis.ring_allreduce_wire_bytes`). N need not be divisible by
n: the chunks then differ in size by one element (``torch.tensor_split``).

The learner writes ``ring_allreduce(x, rank, n, send, recv) -> tensor``, with the two
message functions the checker provides (they count what is sent):

* ``send(t, to)`` posts `t` to rank `to` and returns at once, with a handle whose
  ``wait()`` returns when `t` may be changed again;
* ``recv(buf, frm)`` returns when `buf` holds the message rank `frm` sent.

On rings of 4, 5, 3 and 2 gloo ranks (one launch of 5: each ring is the first n ranks,
odd counts among them) the checker runs it on flat tensors of several sizes, most of which
n does not divide, in float64 and float32, and compares each rank's result with the sum
all-reduce gives, exactly (rank r's tensor is 2^r times a vector of small integers, so
every sum is exact in either dtype, and each element of a wrong result tells which
ranks' values it holds). While the learner's function runs, any communication but the
given `send` and `recv` (the engine's collectives, lesson 0's, torch.distributed's, its
process groups) is refused (:class:`~minitron.labs.runner.Tripwire`). It then counts the rank's messages, 2(n − 1), and their
elements, 2(n − 1)/n · N within the two elements by which uneven chunks differ. A wrong
result is diagnosed (the all-gather phase missing, the remainder of an uneven N
forgotten, a rank's value counted twice or missing); a rank that waits for a message
nobody sent is stopped after ``timeout``/3 seconds (at least 3) and named.

    result = check_ring_allreduce(SOURCE)   # {"ok", "message"}
"""
from __future__ import annotations

import datetime
import itertools
import math

import torch
import torch.distributed as dist

from ..analysis import ring_allreduce_wire_bytes
from ..config import ParallelConfig
from .runner import LabError, Tripwire, agree, call, load, run_sources

NAME = "ring_allreduce"
RANKS = 5  # the launch: rings of every size in RINGS run on its first n ranks
# (N, dtype): none divisible by 4 but the last; 6 leaves torch.chunk only 3 chunks
SIZES = ((1001, torch.float64), (6, torch.float64), (4099, torch.float32), (12, torch.float64))
# (n, sizes): rings of odd and even sizes, so that nothing hard-wired to one count passes
RINGS = ((4, SIZES), (5, SIZES), (3, SIZES[:2] + ((7, torch.float64),)), (2, ((1001, torch.float64),)))
# lesson 0's ring (the engine's own answer) and the library's collectives
FORBIDDEN = ("minitron.course.collectives", "torch.distributed.all_reduce", "minitron.comm")
_CASE = itertools.count()  # the case number in this launch: the same on every rank
SCHEDULE = ("in reduce-scatter step s (0 ≤ s < n−1) rank r sends chunk (r − s) mod n to r + 1 and adds the "
            "chunk (r − s − 1) mod n it receives from r − 1; in all-gather step s it sends chunk (r + 1 − s) "
            "mod n and keeps the chunk (r − s) mod n it receives")


def coded_input(n_elements: int, dtype: torch.dtype, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, w): rank `rank`'s tensor x = 2^rank · w, with w small integers shared by all
    ranks. A sum over a set S of ranks is w · Σ_{r∈S} 2^r: exact, and it names S."""
    g = torch.Generator().manual_seed(n_elements)
    w = torch.randint(1, 10, (n_elements,), generator=g).to(dtype)
    return w * 2.0 ** rank, w


class Messages:
    """The `send` and `recv` a learner's ring is given: they post on a process group of
    their own (a message left unmatched cannot meet a later case's), count what this rank
    sends and stop a `recv` that waits longer than `wait_s` seconds."""

    def __init__(self, group, ranks: list[int], wait_s: float):
        self.group, self.ranks, self.wait_s = group, ranks, wait_s
        self.sent: list[int] = []  # elements of each message this rank sent
        self.problem = ""  # the first message that did not fit its receive buffer
        self.posted: list[_Sent] = []  # every send of the run, waited for at its end
        self.peers: list[tuple[str, int]] = []  # ("send", to) and ("recv", frm) of the run, in order

    def start(self) -> None:
        """Forget the previous run's messages."""
        self.sent.clear()
        self.posted.clear()
        self.peers.clear()
        self.problem = ""

    def stranger(self, rank: int) -> str:
        """'' when every message of this rank's run went to its next rank and came from its
        previous one, else the first that did not (a ring talks to its neighbours only)."""
        n = len(self.ranks)
        for what, peer in self.peers:
            want = (rank + 1) % n if what == "send" else (rank - 1) % n
            if peer != want:
                way = "sent to" if what == "send" else "received from"
                return (f"rank {rank} {way} rank {peer} on a ring of n = {n} ranks: each rank sends only to (r + 1) "
                        f"mod n and receives only from (r − 1) mod n, here {want} (are the neighbours written for "
                        f"one number of ranks?)")
        return ""

    def finish(self) -> str:
        """Wait for every send of the run (also those whose handle the learner dropped):
        '' or the problem."""
        try:
            for handle in self.posted:
                handle.wait()
        except LabError as e:
            return str(e)
        return ""

    def _peer(self, what: str, peer) -> int:
        n = len(self.ranks)
        if not isinstance(peer, int) or not 0 <= peer < n:
            raise LabError(f"your {NAME} called {what} with rank {peer!r}: ranks are the integers 0 .. {n - 1}")
        return self.ranks[peer]

    def _tensor(self, what: str, t) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise LabError(f"your {NAME} called {what} with a {type(t).__name__}: pass a tensor")
        if not t.is_contiguous():
            raise LabError(f"your {NAME} called {what} with a non-contiguous tensor: messages are contiguous "
                           f"(a slice of a flat tensor is)")
        return t

    def send(self, t, to):
        """Post `t` to rank `to`; returns at once a handle: ``wait()`` before changing `t`.
        A header of (elements, bytes per element) goes first, so that a receiver expecting
        another chunk can say so instead of the backend aborting on a size mismatch."""
        t, dst = self._tensor("send", t), self._peer("send", to)
        self.sent.append(t.numel())
        self.peers.append(("send", to))
        header = torch.tensor([t.numel(), t.element_size()], dtype=torch.int64)
        handle = _Sent([dist.isend(header, dst, group=self.group), dist.isend(t, dst, group=self.group)], to,
                       self.wait_s)
        self.posted.append(handle)
        return handle

    def recv(self, buf, frm) -> None:
        """Return when `buf` holds the message rank `frm` sent."""
        buf, src = self._tensor("recv", buf), self._peer("recv", frm)
        self.peers.append(("recv", frm))
        header = torch.zeros(2, dtype=torch.int64)
        try:
            dist.irecv(header, src, group=self.group).wait(datetime.timedelta(seconds=self.wait_s))
        except Exception:
            raise LabError(
                f"your {NAME} waited {self.wait_s:g} s in recv for a message from rank {frm} that never came: if "
                f"every rank receives before it sends, all of them wait for each other (a deadlock); post the "
                f"send first (it returns at once), then receive") from None
        numel, esize = header.tolist()
        if numel != buf.numel() or esize != buf.element_size():
            # take the message and go on (stopping here would leave the peers waiting): the
            # first such mismatch is the verdict once the learner's function returns
            drain = torch.empty(numel * esize, dtype=torch.uint8)
            dist.irecv(drain, src, group=self.group).wait(datetime.timedelta(seconds=self.wait_s))
            self.problem = self.problem or (
                f"your {NAME} received into a buffer of {buf.numel()} elements a message of {numel} that rank "
                f"{frm} sent: the two ranks disagree about which chunk travels in this step (uneven chunks differ "
                f"in size): check the chunk indices; {SCHEDULE}")
            return
        dist.irecv(buf, src, group=self.group).wait(datetime.timedelta(seconds=self.wait_s))


class _Sent:
    """The handle `send` returns: the header's and the tensor's messages to rank `to`."""

    def __init__(self, works, to: int, wait_s: float):
        self.works, self.to, self.wait_s = works, to, wait_s
        self.done = False  # gloo's wait consumes the completion: a second one would block

    def wait(self) -> None:
        """Return when the message has left (its buffer may change); LabError after `wait_s`."""
        if self.done:
            return
        try:
            for w in self.works:
                w.wait(datetime.timedelta(seconds=self.wait_s))
        except Exception:
            raise LabError(f"a message your {NAME} sent to rank {self.to} was not received within "
                           f"{self.wait_s:g} s: every send needs its recv on the peer") from None
        self.done = True


def _ranks_in(coefficient: float, n: int) -> tuple[list[int], bool]:
    """Which ranks' values a coded element holds: (ranks, exactly a set of distinct ranks)."""
    c = round(coefficient)
    if c != coefficient or not 0 <= c < 2 ** n:
        return [], False
    return [r for r in range(n) if c >> r & 1], True


def diagnose(got: torch.Tensor, w: torch.Tensor, n: int, rank: int) -> str:
    """What is wrong with rank `rank`'s result `got` of a coded all-reduce ('' if right)."""
    N = w.numel()
    coeff = (got / w).tolist()
    full = 2 ** n - 1
    wrong = [i for i, c in enumerate(coeff) if c != full]
    if not wrong:
        return ""
    size = f"N = {N} elements over n = {n} ranks"
    right = [i for i, c in enumerate(coeff) if c == full]
    all_subsets = all(_ranks_in(c, n)[1] for c in coeff)
    if right and all_subsets and right == list(range(right[0], right[-1] + 1)) and len(right) <= math.ceil(N / n):
        return (f"rank {rank} holds the sum of all ranks only in elements {right[0]}..{right[-1]} (one chunk), "
                f"partial sums elsewhere ({size}): that is where reduce-scatter leaves it; the all-gather "
                f"phase is missing: pass the summed chunks n − 1 more steps around the ring")
    tail = N - n * (N // n)
    if tail and wrong == list(range(N - tail, N)):
        return (f"the last {tail} element{'s' if tail > 1 else ''} of rank {rank}'s result "
                f"{'are' if tail > 1 else 'is'} not summed over the ranks ({size}): {n} does not divide {N}, "
                f"so chunks of N // n = {N // n} miss the remainder; split into n chunks whose sizes differ "
                f"by at most one (torch.tensor_split)")
    i = wrong[0]
    ranks, distinct = _ranks_in(coeff[i], n)
    what = (f"the values of ranks {ranks}" if distinct and ranks
            else "no rank's value" if distinct else "some rank's value more than once")
    return (f"wrong sums: element {i} of rank {rank}'s result holds {what}, not each of the {n} ranks' once "
            f"({len(wrong)} of {N} elements wrong, {size}): check which chunk each step sends and which it "
            f"adds to; {SCHEDULE}")


def _check_traffic(sent: list[int], N: int, esize: int, n: int, rank: int) -> str:
    """'' when rank `rank` sent 2(n − 1) messages totalling the ring's elements."""
    ring = ring_allreduce_wire_bytes(N * esize, n) / esize  # elements per rank
    total = sum(sent)
    # uneven chunks differ by one element: a rank skips one chunk per phase, so it
    # sends within 2 elements of the mean 2(n − 1)/n·N
    if abs(total - ring) >= 2:
        return (f"rank {rank} sent {total} elements for N = {N} on {n} ranks, {total / ring:.2f}x what a ring "
                f"sends, 2(n − 1)/n·N = {ring:g} (ring_allreduce_wire_bytes): "
                + ("each rank sends one chunk of about N/n per step, never the whole tensor to one rank"
                   if total > ring else "every chunk must travel n − 1 steps in each of the two phases"))
    if len(sent) != 2 * (n - 1):
        return (f"rank {rank} sent {len(sent)} messages for N = {N} on {n} ranks: the ring takes 2(n − 1) = "
                f"{2 * (n - 1)} rounds of one chunk each (n − 1 reduce-scatter, n − 1 all-gather)")
    return ""


def watch() -> Tripwire:
    """All communication but the `send` and `recv` the learner is given: the engine's
    collectives, lesson 0's ring, torch.distributed and its C++ process groups."""
    from ..course import collectives
    from .. import comm

    return Tripwire({"minitron.comm": comm, "minitron.course.collectives": collectives,
                     "torch.distributed": dist.distributed_c10d},
                    allowed=(Messages.send, Messages.recv, _Sent.wait), communication=True)


def _run_one(comm, fn, msgs: Messages, n: int, N: int, dtype: torch.dtype) -> str:
    """Run the learner's ring of the first n ranks on this rank's coded tensor of N
    elements: '' or the problem."""
    r = comm.index("dp")
    x, w = coded_input(N, dtype, r)
    want = w * float(2 ** n - 1)  # the sum of 2^q·w over the ring's ranks q: exact
    msgs.start()
    try:
        with watch().armed():
            got = call(f"your {NAME}", fn, x.clone(), r, n, msgs.send, msgs.recv)
    except LabError:
        if msgs.stranger(r) or msgs.problem:  # what went wrong first
            return msgs.stranger(r) or msgs.problem
        raise
    problem = msgs.problem or msgs.finish()
    if problem:
        return msgs.stranger(r) or problem
    if not isinstance(got, torch.Tensor):
        return f"your {NAME} returned {type(got).__name__}: return the summed tensor"
    if got.dim() == 1 and got.numel() == n * (N // n) < N:
        return (f"your {NAME} returned {got.numel()} elements for N = {N} on n = {n} ranks: {n} does not divide "
                f"{N}, so chunks of N // n = {N // n} drop the last {N % n}; split into n chunks whose sizes "
                f"differ by at most one (torch.tensor_split)")
    if got.shape != x.shape or got.dtype != x.dtype:
        return (f"your {NAME} returned a {got.dtype} tensor of shape {list(got.shape)} for a {x.dtype} input of "
                f"shape {list(x.shape)} (N = {N}): return the sum in the input's shape and dtype")
    if not torch.equal(got, want):
        if msgs.stranger(r):
            return msgs.stranger(r)
        steps = len(msgs.sent) / 2
        if steps != n - 1 and len(msgs.sent) % 2 == 0:
            return (f"your {NAME} ran {steps:g} steps per phase on n = {n} ranks (N = {N}): each phase takes n − 1 "
                    f"= {n - 1} steps, whatever n is (is the count written for one number of ranks?)")
        return diagnose(got, w, n, r) or f"rank {r}'s result differs from all_reduce (N = {N}, n = {n})"
    return _check_traffic(msgs.sent, N, x.element_size(), n, r)


def _job(comm, source: str, timeout: float) -> dict:
    case = next(_CASE)
    ranks = comm.grid.axis_ranks("dp")
    r = comm.index("dp")
    # a group per ring and per case: a message left unmatched cannot meet another's
    groups = {n: dist.new_group(ranks[:n]) for n, _ in RINGS if n <= len(ranks)}
    with watch().armed():
        fn = load(source, (NAME,), {"torch": torch})[NAME]
    for n, sizes in RINGS:
        if n > len(ranks):
            continue
        msgs = Messages(groups[n], list(range(n)), max(3.0, timeout / 3))
        for i, (N, dtype) in enumerate(sizes):
            try:
                problem = _run_one(comm, fn, msgs, n, N, dtype) if r < n else ""
            except LabError as e:  # the learner's code raised or returned a malformed value
                problem = str(e)
            agree(comm, f"ring/{case}/{n}/{i}", problem, timeout)
    rings = [n for n, _ in RINGS if n <= len(ranks)]
    return {"ok": True, "message": f"your {NAME} equals all_reduce on rings of {', '.join(map(str, rings))} ranks "
            f"for N = {', '.join(str(N) for N, _ in SIZES)} and others, in 2(n − 1) rounds of 2(n − 1)/n·N elements"}


def check_ring_allreduce_all(sources: list[str], ranks: int = RANKS, timeout: float = 60) -> list[dict]:
    """`check_ring_allreduce` for several sources, in as few launches as their outcomes allow."""
    return run_sources(_job, ParallelConfig(dp=ranks, device="cpu"), sources, timeout, timeout,
                       forbidden=FORBIDDEN, names=(NAME,))


def check_ring_allreduce(source: str, ranks: int = RANKS, timeout: float = 60) -> dict:
    """Lab 0: run the function `ring_allreduce(x, rank, n, send, recv)` defined in `source` on
    `ranks` gloo ranks for flat tensors of several uneven sizes (float64, float32); compare
    each result with the engine's all_reduce, count the messages (2(n − 1)) and the
    elements each rank sends (``ring_allreduce_wire_bytes``). Returns {"ok", "message"}; on
    a failure the message names the first problem in one line, also when the code does not
    compile, raises, deadlocks or runs past `timeout` seconds."""
    return check_ring_allreduce_all([source], ranks, timeout)[0]
