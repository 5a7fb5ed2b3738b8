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


@pytest.mark.parametrize("tp,cp,ep,dp,pp", [(2, 1, 2, 2, 1), (1, 2, 2, 1, 2), (2, 2, 2, 1, 1), (1, 1, 4, 2, 1)])
def test_expert_axis_in_megatron_core_order(tp, cp, ep, dp, pp):
    g = ProcessGrid(tp=tp, cp=cp, ep=ep, dp=dp, pp=pp)
    assert g.world == tp * cp * ep * dp * pp
    for r in range(g.world):  # rank = tp + tp*cp + tp*cp*ep + tp*cp*ep*dp + ..., tp fastest
        c = g.coord(r)
        assert r == c.tp + tp * (c.cp + cp * (c.ep + ep * (c.dp + dp * c.pp)))
        assert g.rank_of(**vars(c)) == r
        assert g.data_index(r) == c.ep + ep * c.dp  # the share of the batch it reads
    assert g.all_groups("ep")[0] == [i * tp * cp for i in range(ep)]
    # a dense parameter is averaged over cp x ep x dp, an expert over cp x dp
    dense, expert = g.data_axis(), g.data_axis(("dp", "cp"))
    assert dense == "dp" + ("_cp" if cp > 1 else "") + "_ep" and expert == ("dp_cp" if cp > 1 else "dp")
    assert set(g.data_groups()) == {dense} | ({expert} if expert != "dp" else set())
    for r in range(g.world):
        c = g.coord(r)
        same = {k: v for k, v in vars(c).items() if k in ("tp", "pp")}
        group = g.axis_ranks(dense, r)
        assert len(group) == cp * ep * dp and all({k: getattr(g.coord(x), k) for k in same} == same for x in group)
        assert sorted(group) == group  # fastest-first axes: rank order
    assert ProcessGrid(dp=2).data_axis() == "dp" and ProcessGrid(cp=2).data_axis() == "dp_cp"
