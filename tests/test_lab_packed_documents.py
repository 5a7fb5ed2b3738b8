"""Lab 09c's checker (``minitron.labs.packed_documents``): the reference passes inside a real
``--pack`` run (--cp 2 --dp 2, --cp 4 vs the single-device packed model), the usual mistakes
each get their own line, the engine's own pieces are refused by any route. One 4-rank launch."""
from types import SimpleNamespace

import pytest
import torch

from minitron.labs.packed_documents import (_LearnersMask, _document_ids, _visible, check_packed_documents,
                                            check_packed_documents_all)
from minitron.labs.runner import Tripwire
from minitron.packing import SEPARATOR_BYTE, Documents, document_ids
from minitron.parallel.context_parallel import ChunkMask
from planted import assert_each_named, broken_in

REFERENCE = '''
def document_ids(x, separator):
    starts = torch.zeros_like(x)
    starts[:, 1:] = (x[:, :-1] == separator).long()  # a new document after each separator
    return starts.cumsum(1)


def visible(segments, cp, q_rank, q_slot, k_rank, k_slot):
    c = segments.shape[1] // (2 * cp)
    q_chunk = q_rank if q_slot == 0 else 2 * cp - 1 - q_rank
    k_chunk = k_rank if k_slot == 0 else 2 * cp - 1 - k_rank
    q = q_chunk * c + torch.arange(c)
    k = k_chunk * c + torch.arange(c)
    causal = k[None, :] <= q[:, None]
    return causal[None] & (segments[:, q, None] == segments[:, None, k])
'''

STUB = '''
def document_ids(x, separator):
    raise NotImplementedError  # your code here


def visible(segments, cp, q_rank, q_slot, k_rank, k_slot):
    raise NotImplementedError  # your code here
'''


broken = broken_in(REFERENCE)


def test_the_checkers_answers_are_the_engines():
    """The checker's own document ids and masks agree with the engine's (Documents, ChunkMask)."""
    x = torch.tensor([[SEPARATOR_BYTE, 5, 6, SEPARATOR_BYTE, 7, SEPARATOR_BYTE, 8, 9, 9, SEPARATOR_BYTE, 4, 4]])
    assert torch.equal(_document_ids(x, SEPARATOR_BYTE), document_ids(x, SEPARATOR_BYTE))
    docs = Documents.of(x, SEPARATOR_BYTE)
    n, c = 3, 2
    checker = SimpleNamespace(visible=_visible, watch=Tripwire({}))
    rule, mine = ChunkMask(n, c, 0, docs), ChunkMask(n, c, 0, _LearnersMask(docs.segments, n, checker))
    assert rule.kinds == mine.kinds and rule.reach == mine.reach
    assert any(k == "none" for (a, b), k in rule.kinds.items() if a > b)  # the documents empty some pairs
    for a, b in rule.kinds:
        if rule.kinds[(a, b)] == "masked":
            assert torch.equal(rule.mask(a, b, None, False), mine.mask(a, b, None, False))


def test_stub_and_engine_copy_need_no_ranks():
    assert check_packed_documents(STUB)["message"] == (
        "document_ids and visible are not written yet (still `raise NotImplementedError`): fill in the "
        "`# your code here` lines in SOURCE")
    msg = check_packed_documents("from minitron.packing import document_ids as ids\n" + REFERENCE)["message"]
    assert msg.startswith("your code uses the engine's own minitron.packing.document_ids"), msg


@pytest.mark.multirank
def test_reference_passes_and_mistakes_get_one_line():
    cases = {
        "reference": REFERENCE,
        "separator in the next document": broken(
            "    starts[:, 1:] = (x[:, :-1] == separator).long()  # a new document after each separator\n"
            "    return starts.cumsum(1)", "    return (x == separator).long().cumsum(1)"),
        "documents from 1": broken("    return starts.cumsum(1)", "    return starts.cumsum(1) + 1"),
        "attention across documents": broken("    return causal[None] & (segments[:, q, None] == segments[:, None, k])",
                                             "    return causal[None].expand(segments.shape[0], c, c)"),
        "local positions": broken("    q = q_chunk * c + torch.arange(c)\n    k = k_chunk * c + torch.arange(c)",
                                  "    q = q_slot * c + torch.arange(c)\n    k = k_slot * c + torch.arange(c)"),
        "contiguous shard": broken("    q_chunk = q_rank if q_slot == 0 else 2 * cp - 1 - q_rank\n"
                                   "    k_chunk = k_rank if k_slot == 0 else 2 * cp - 1 - k_rank",
                                   "    q_chunk = 2 * q_rank + q_slot\n    k_chunk = 2 * k_rank + k_slot"),
        "cp hard-wired": broken("    q_chunk = q_rank if q_slot == 0 else 2 * cp - 1 - q_rank\n"
                                "    k_chunk = k_rank if k_slot == 0 else 2 * cp - 1 - k_rank",
                                "    q_chunk = q_rank if q_slot == 0 else 3 - q_rank\n"
                                "    k_chunk = k_rank if k_slot == 0 else 3 - k_rank"),
        "engine by sys.modules": "import sys\n" + broken(
            "def document_ids(x, separator):\n",
            "def document_ids(x, separator):\n    return getattr(sys.modules['minitron.' + 'packing'], "
            "'document' + '_ids')(x, separator)\n"),
    }
    got = dict(zip(cases, check_packed_documents_all(list(cases.values()))))
    res = got["reference"]
    assert res["ok"] and res["max_param_rel_diff"] <= 1e-9 and res["max_loss_abs_diff"] <= 1e-9, res
    want = {
        "separator in the next document": "the separator put in the next document",
        "documents from 1": "documents counted from 1",
        "attention across documents": "attention across documents",
        "local positions": "positions local to the rank's shard",
        "contiguous shard": "chunk 2N−1−r forgotten",
        "cp hard-wired": "--cp 4: your visible (cp = 4, chunks of c = 1) gives cp = 2's chunks: a cp hard-wired",
        "engine by sys.modules": "runs the engine's own minitron.packing",
    }
    assert_each_named(got, want)
