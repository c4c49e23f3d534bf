"""Which rank measures which head: spread evenly over any number of ranks."""

from __future__ import annotations

from collections import Counter

import pytest

from agent.distributed.assignment import head_rank, heads_of


@pytest.mark.parametrize(
    ("layers", "heads", "world"),
    [(80, 64, 1024), (61, 128, 2048), (32, 32, 8), (2, 4, 2), (3, 5, 4)],
)
def test_every_head_has_one_rank_and_the_ranks_share_them_evenly(layers, heads, world):
    """70B on 1024 ranks: 5 heads each (the earlier (layer + head) % world put up to 64 on
    one rank and none on 881 of them)."""
    load = Counter(head_rank(i, h, heads, world) for i in range(layers) for h in range(heads))
    total = layers * heads
    assert sum(load.values()) == total
    assert max(load.values()) == -(-total // world)  # ceil: no rank takes more than its share
    assert len(load) == min(world, total)
    for i in range(layers):
        mine = [heads_of(i, heads, r, world) for r in range(min(world, 8))]
        assert all(head_rank(i, h, heads, world) == r for r, hs in enumerate(mine) for h in hs)


def test_a_layers_heads_are_spread_over_consecutive_ranks():
    """One evaluation of one layer lands on as many ranks as it has heads (up to world)."""
    assert [head_rank(3, h, 64, 1024) for h in range(4)] == [192, 193, 194, 195]
    assert [head_rank(1, h, 4, 2) for h in range(4)] == [0, 1, 0, 1]


def test_local_heads_stay_where_their_rows_are():
    assert [head_rank(5, h, 4, 2, owners=[0, 0, 1, 1]) for h in range(4)] == [0, 0, 1, 1]
