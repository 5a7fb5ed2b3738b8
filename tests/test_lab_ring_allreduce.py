"""Lab 0's checker (``minitron.labs.ring_allreduce``): the reference ring passes, the usual
mistakes each get their own line.

A syntax error is found before any rank starts; everything else runs on 5 gloo ranks (rings
of 4, 5, 3 and 2), all
the sources in as few launches as their outcomes allow (a deadlock leaves the ranks out
of step: the cases after it get a fresh launch).
"""
import pytest
import torch

from minitron.labs.ring_allreduce import check_ring_allreduce, check_ring_allreduce_all, coded_input, diagnose
from planted import broken_in

REFERENCE = '''
def ring_allreduce(x, rank, n, send, recv):
    chunks = list(torch.tensor_split(x.clone(), n))
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    for s in range(n - 1):  # reduce-scatter
        out, into = (rank - s) % n, (rank - s - 1) % n
        buf = torch.empty_like(chunks[into])
        h = send(chunks[out], nxt)
        recv(buf, prv)
        h.wait()
        chunks[into] += buf
    for s in range(n - 1):  # all-gather
        out, into = (rank + 1 - s) % n, (rank - s) % n
        buf = torch.empty_like(chunks[into])
        h = send(chunks[out], nxt)
        recv(buf, prv)
        h.wait()
        chunks[into] = buf
    return torch.cat(chunks)
'''

NAIVE = '''
def ring_allreduce(x, rank, n, send, recv):
    total = x.clone()
    if rank == 0:
        for q in range(1, n):
            buf = torch.empty_like(x)
            recv(buf, q)
            total += buf
        for h in [send(total, q) for q in range(1, n)]:
            h.wait()
    else:
        send(x.clone(), 0).wait()
        recv(total, 0)
    return total
'''


broken = broken_in(REFERENCE)


def test_syntax_error_needs_no_ranks():
    res = check_ring_allreduce(broken("def ring_allreduce(x, rank, n, send, recv):",
                                      "def ring_allreduce(x, rank, n, send, recv)"))
    assert res["ok"] is False and res["message"].startswith("your code does not compile: expected ':' at line 2")


def test_diagnosis_of_coded_results_needs_no_ranks():
    """The diagnosis reads which ranks each element holds (rank r's tensor is 2^r·w)."""
    n, N = 4, 10
    _, w = coded_input(N, torch.float64, 0)
    full = w * (2 ** n - 1)
    assert diagnose(full, w, n, 0) == ""
    partial = w * 1.0
    partial[3:6] = full[3:6]
    assert "the all-gather phase is missing" in diagnose(partial, w, n, 0)
    tail = full.clone()
    tail[-2:] = w[-2:]
    assert "the last 2 elements" in diagnose(tail, w, n, 0)
    twice = full.clone()
    twice[0] = w[0] * 16
    assert "more than once" in diagnose(twice, w, n, 0)


@pytest.mark.multirank
def test_reference_passes_and_mistakes_get_one_line():
    cases = {
        "reference": REFERENCE,
        "stub": ("def ring_allreduce(x, rank, n, send, recv):\n"
                 "    raise NotImplementedError  # your code here\n"),
        "naive all-to-one": NAIVE,
        "off-by-one chunk": broken("out, into = (rank - s) % n, (rank - s - 1) % n",
                                   "out, into = (rank - s) % n, (rank - s + 1) % n"),
        "reduce-scatter only": broken("    for s in range(n - 1):  # all-gather", "    for s in range(0):"),
        "uneven sizes forgotten": broken("chunks = list(torch.tensor_split(x.clone(), n))",
                                         "c = x.numel() // n\n"
                                         "    chunks = [x[i * c:(i + 1) * c].clone() for i in range(n)]"),
        "torch.chunk": broken("torch.tensor_split(x.clone(), n)", "torch.chunk(x.clone(), n)"),
        "sends never waited for": broken("        h.wait()\n", "", broken("        h.wait()\n", "")),
        "receive first (deadlock)": broken("        h = send(chunks[out], nxt)\n        recv(buf, prv)\n",
                                           "        recv(buf, prv)\n        h = send(chunks[out], nxt)\n"),
        # what the old checker (4 ranks only) let through
        "steps hard-wired to 4 ranks": REFERENCE.replace("for s in range(n - 1):", "for s in range(3):"),
        "neighbours hard-wired to 4 ranks": broken("nxt, prv = (rank + 1) % n, (rank - 1) % n",
                                                  "nxt, prv = (rank + 1) % 4, (rank - 1) % 4"),
        # the engine's (or torch's) all-reduce, reached past the screen
        **{f"engine by {how}": ("import importlib, sys\ndef ring_allreduce(x, rank, n, send, recv):\n"
                                f"    D = {module}\n    y = x.clone()\n    D.all_reduce(y)\n"
                                "    return y\n")
           for how, module in (("importlib", "importlib.import_module('torch.' + 'distributed')"),
                               ("sys.modules", "sys.modules['torch.distributed']"),
                               ("__import__", "__import__('torch.' + 'distributed', fromlist=['x'])"))},
        "process group": ("def ring_allreduce(x, rank, n, send, recv):\n    y = x.clone()\n"
                          "    send.__self__.group.allreduce([y]).wait()\n    return y\n"),
    }
    got = dict(zip(cases, check_ring_allreduce_all(list(cases.values()), timeout=15)))
    for name in ("reference", "sends never waited for"):  # the checker waits for every send at the end
        assert got[name]["ok"], (name, got[name])
    assert got["reference"]["message"].startswith("your ring_allreduce equals all_reduce on rings of 4, 5, 3, 2 "
                                                  "ranks")
    want = {
        "stub": "ring_allreduce is not written yet (still `raise NotImplementedError`): fill in",
        "naive all-to-one": "rank 0 sent 3003 elements for N = 1001 on 4 ranks, 2.00x what a ring sends, "
                            "2(n − 1)/n·N = 1501.5",
        "off-by-one chunk": "the two ranks disagree about which chunk travels in this step",
        "reduce-scatter only": "the all-gather phase is missing",
        "uneven sizes forgotten": "returned 1000 elements for N = 1001 on n = 4 ranks: 4 does not divide 1001",
        "torch.chunk": "IndexError: list index out of range in ring_allreduce, line",
        "receive first (deadlock)": "waited 5 s in recv for a message from rank",
        "steps hard-wired to 4 ranks": "your ring_allreduce ran 3 steps per phase on n = 5 ranks (N = 1001): each "
                                       "phase takes n − 1 = 4 steps, whatever n is",
        "neighbours hard-wired to 4 ranks": "rank 0 received from rank 3 on a ring of n = 5 ranks: each rank sends "
                                            "only to (r + 1) mod n and receives only from (r − 1) mod n, here 4",
        **{f"engine by {how}": "your code runs the engine's own torch.distributed (from line 5 of your code: "
                               "`D.all_reduce(y)`)" for how in ("importlib", "sys.modules", "__import__")},
        "process group": "your code runs the engine's own torch.distributed (from line 3 of your code",
    }
    for name, words in want.items():
        res = got[name]
        assert not res["ok"] and words in res["message"] and "\n" not in res["message"], (name, res)
    assert "(a deadlock)" in got["receive first (deadlock)"]["message"]
