"""The process groups the runtime creates, decided purely (:mod:`dmuon.functional.group_layout`)."""
from __future__ import annotations

import pytest

from dmuon.functional.group_layout import check_grids, grid_position, group_ranks, standard_grid


def test_standard_grid_and_position():
    g = standard_grid(3, 2)
    assert g == ((0, 1, 2), (3, 4, 5))
    assert standard_grid(2) == ((0, 1),)
    assert grid_position((g,), 4) == (0, (1, 1))


def test_check_grids_refuses_what_is_not_the_world():
    assert check_grids([[[1, 0]]], 2) == (((1, 0),),)
    with pytest.raises(ValueError, match="R x G arrangement"):
        check_grids([[[0, 1]]], 3)
    with pytest.raises(ValueError, match="R x G arrangement"):
        check_grids([((0, 1),), ((2,),)], 3)


def test_group_ranks_one_order_lanes_tp_control():
    grids = check_grids([((0, 2), (4, 6)), ((1, 3), (5, 7))], 8)  # T=2, R=2, G=2
    assert grid_position(grids, 5) == (1, (0, 1))
    made = group_ranks(grids, lanes=("replicate", "unshard"))  # LANES order, whatever given
    assert made[:4] == [("unshard", (0, 2)), ("unshard", (4, 6)),
                        ("replicate", (0, 4)), ("replicate", (2, 6))]
    assert made[4:8] == [("unshard", (1, 3)), ("unshard", (5, 7)),
                         ("replicate", (1, 5)), ("replicate", (3, 7))]
    assert made[8:] == [("tp", (0, 1)), ("tp", (2, 3)), ("tp", (4, 5)), ("tp", (6, 7)),
                        ("control", tuple(range(8)))]
    assert [k for k, _ in group_ranks(grids[:1])] == ["unshard"] * 2 + ["reduce"] * 2 + [
        "replicate"] * 2 + ["control"]
    with pytest.raises(ValueError, match="unknown lane 'tp'"):
        group_ranks(grids, lanes=("tp",))
