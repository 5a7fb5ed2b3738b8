"""Lab 10b's checker (``minitron.labs.rope_cp``): the reference passes inside the engine (--cp 4,
--cp 2 --tp 2 vs one device), the usual mistakes each get their own line, the engine's own
positions and rotation are refused by any route. One 4-rank launch."""
import pytest

from minitron.labs.rope_cp import check_rope_cp, check_rope_cp_all
from planted import assert_each_named, broken_in

REFERENCE = '''
def positions(n_local, cp, r):
    c = n_local // 2
    first, second = r, 2 * cp - 1 - r
    return torch.cat([torch.arange(first * c, (first + 1) * c), torch.arange(second * c, (second + 1) * c)])


def rope(x, cos, sin):
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
'''

STUB = '''
def positions(n_local, cp, r):
    raise NotImplementedError  # your code here


def rope(x, cos, sin):
    raise NotImplementedError  # your code here
'''


broken = broken_in(REFERENCE)


def test_stub_and_engine_copy_need_no_ranks():
    assert check_rope_cp(STUB)["message"] == ("positions and rope are not written yet (still `raise "
                                              "NotImplementedError`): fill in the `# your code here` lines in SOURCE")
    msg = check_rope_cp("from minitron.model import rotate\n" + REFERENCE)["message"]
    assert msg.startswith("your code uses the engine's own minitron.model.rotate"), msg


@pytest.mark.multirank
def test_reference_passes_and_mistakes_get_one_line():
    ret = "    return torch.cat([torch.arange(first * c, (first + 1) * c), torch.arange(second * c, (second + 1) * c)])"
    cases = {
        "reference": REFERENCE,
        "local positions": broken(ret, "    return torch.arange(n_local)"),
        "contiguous shard": broken(ret, "    return torch.arange(r * n_local, (r + 1) * n_local)"),
        "neighbour pairs": broken("    x1, x2 = x[..., : d // 2], x[..., d // 2:]\n"
                                  "    return x * cos + torch.cat([-x2, x1], dim=-1) * sin",
                                  "    x1, x2, c, s = x[..., 0::2], x[..., 1::2], cos[..., : d // 2], sin[..., : d // 2]\n"
                                  "    return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)"),
        "the other way": broken("torch.cat([-x2, x1], dim=-1)", "torch.cat([x2, -x1], dim=-1)"),
        "chunks swapped": broken("first, second = r, 2 * cp - 1 - r", "second, first = r, 2 * cp - 1 - r"),
        "engine by sys.modules": "import sys\n" + broken(
            "def rope(x, cos, sin):\n",
            "def rope(x, cos, sin):\n    return getattr(sys.modules['minitron.' + 'model'], 'rot' + 'ate')(x, cos, sin)\n"),
    }
    got = dict(zip(cases, check_rope_cp_all(list(cases.values()))))
    res = got["reference"]
    assert res["ok"] and res["max_param_rel_diff"] <= 1e-9 and res["max_loss_abs_diff"] <= 1e-9, res
    want = {
        "local positions": "local positions",
        "contiguous shard": "a contiguous shard",
        "neighbour pairs": "pairs neighbouring dimensions",
        "the other way": "rotates the other way",
        "chunks swapped": "the right positions in another order",
        "engine by sys.modules": "runs the engine's own minitron.model.rotate",
    }
    assert_each_named(got, want)
