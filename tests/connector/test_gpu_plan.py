"""kvkeeper.connector.gpu.plan: layer groups and copy runs (pure Python)."""
from __future__ import annotations

import pytest

from kvkeeper.connector.gpu.plan import copy_runs, layer_groups


def test_layer_groups_reach_the_minimum_copy() -> None:
    # 64 KiB layers, 256 KiB minimum: four layers per copy, the rest last
    assert layer_groups(6, 64 << 10, 256 << 10) == [range(0, 4), range(4, 6)]
    # layers at least the minimum: one group (and one event) each
    assert layer_groups(3, 1 << 20, 256 << 10) == [range(0, 1), range(1, 2), range(2, 3)]
    # a minimum above the block: one group, the whole block
    assert layer_groups(6, 64 << 10, 1 << 30) == [range(0, 6)]
    assert layer_groups(4, 100, 0) == [range(i, i + 1) for i in range(4)]
    groups = layer_groups(7, 3000, 10000)
    assert [i for g in groups for i in g] == list(range(7))


@pytest.mark.parametrize("bad", [(0, 10), (3, 0), (-1, 10)])
def test_layer_groups_reject_empty_shapes(bad) -> None:
    with pytest.raises(ValueError):
        layer_groups(*bad)


def test_copy_runs_merge_adjacent_blocks_only() -> None:
    bb = 100
    assert copy_runs([1000, 1100, 1200, 5000, 5100, 300], bb) == [(0, 3), (3, 2), (5, 1)]
    # adjacent the other way round is not one forward copy
    assert copy_runs([1100, 1000], bb) == [(0, 1), (1, 1)]
    assert copy_runs([], bb) == []
    assert copy_runs([7], bb) == [(0, 1)]
