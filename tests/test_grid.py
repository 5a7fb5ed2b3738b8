"""Pure rank arithmetic of the process grid, exhaustively for small worlds."""
import itertools

import pytest

from minitron.grid import ProcessGrid


def test_megatron_example_8_ranks():
    g = ProcessGrid(tp=2, dp=2, pp=2)
    assert g.all_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.all_groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.all_groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.all_groups("embed") == [[0, 4], [1, 5], [2, 6], [3, 7]]


SIZES = [1, 2, 3, 4]


@pytest.mark.parametrize("tp,dp,pp", list(itertools.product(SIZES, SIZES, SIZES)))
def test_coords_roundtrip_and_partitions(tp, dp, pp):
    g = ProcessGrid(tp=tp, dp=dp, pp=pp)
    seen = set()
    for r in range(g.world):
        c = g.coord(r)
        assert g.rank_of(c.tp, c.dp, c.pp) == r
        assert r == c.tp + tp * c.dp + tp * dp * c.pp  # Megatron's order
        seen.add((c.tp, c.dp, c.pp))
    assert len(seen) == g.world
    for axis, n in (("tp", tp), ("dp", dp), ("pp", pp)):
        groups = g.all_groups(axis)
        assert sorted(r for grp in groups for r in grp) == list(range(g.world))  # a partition
        assert all(len(grp) == n for grp in groups)
        for grp in groups:  # members differ only along this axis
            for r in grp:
                others = {k: v for k, v in vars(g.coord(r)).items() if k != axis}
                assert others == {k: v for k, v in vars(g.coord(grp[0])).items() if k != axis}
                assert g.axis_index(axis, r) == getattr(g.coord(r), axis)
    assert g.all_groups("tp")[0] == list(range(tp))  # tensor groups are neighbours


@pytest.mark.parametrize("q,dp,pp", [(2, 1, 1), (2, 2, 1), (2, 1, 2), (3, 1, 1)])
def test_cube_lines(q, dp, pp):
    g = ProcessGrid(tp=q ** 3, dp=dp, pp=pp, cube=True)
    assert g.q == q
    coords = {g.cube_coord(r) for r in range(q ** 3)}
    assert coords == set(itertools.product(range(q), repeat=3))
    for axis, pos in (("cube_i", 0), ("cube_j", 1), ("cube_k", 2)):
        groups = g.all_groups(axis)
        assert len(groups) == g.world // q and all(len(x) == q for x in groups)
        for grp in groups:
            cs = [g.cube_coord(r) for r in grp]
            assert [c[pos] for c in cs] == list(range(q))
            assert len({tuple(v for k, v in enumerate(c) if k != pos) for c in cs}) == 1
            assert len({(g.coord(r).dp, g.coord(r).pp) for r in grp}) == 1


def test_bad_rank():
    with pytest.raises(ValueError):
        ProcessGrid(tp=2).coord(2)
