"""The partition periodicity check of depth reuse (graphmem/capture/partition_record.py): the
partitioner's own comparisons replayed on byte counts extended to full depth."""
from __future__ import annotations

from graphmem.capture.partition_record import Partition, not_periodic

# bytes: inputs, runtime-optimal cut, more aggressive cut (per depth: fixed + per block)


def _at(depth: int, budget: float, more_per_block: int, knapsack: bool = False) -> Partition:
    return Partition(budget, (1000 + 10 * depth, 2000 + 100 * depth, 1000 + more_per_block * depth), knapsack)


def test_budgets_0_and_1_are_cut_block_by_block() -> None:
    assert not_periodic((Partition(1.0, (10, 20), False),), (Partition(1.0, (11, 22), False),), 5, 48) is None
    assert not_periodic((Partition(0.0, (10,), False),), (Partition(0.0, (11,), False),), 5, 48) is None


def test_the_same_cut_at_full_depth_is_periodic() -> None:
    # the more aggressive cut's ratio: (1000 + 30 d - 1000 - 10 d) / (1000 + 90 d) < 0.5 at every depth
    assert not_periodic((_at(5, 0.5, 30),), (_at(6, 0.5, 30),), 5, 48) is None


def test_a_ratio_that_crosses_the_budget_with_depth_is_not() -> None:
    # ratio (1000 + 60 d - (1000 + 10 d)) / (2000 + 100 d - (1000 + 10 d)) = 50 d / (1000 + 90 d): 0.172 at
    # depth 5, 0.233 at 8, 0.328 at 16; with budget 0.3 the partitioner stops at this cut at depth 5 and 6 (and 8)
    # but would go on to the aggressive cut at depth 16
    why = not_periodic((_at(5, 0.3, 60),), (_at(6, 0.3, 60),), 5, 16)
    assert why is not None and "full depth" in why
    assert not_periodic((_at(5, 0.3, 60),), (_at(6, 0.3, 60),), 5, 8) is None


def test_the_knapsack_and_a_changed_graph_count_are_not() -> None:
    assert "knapsack" in (not_periodic((_at(5, 0.5, 30, True),), (_at(6, 0.5, 30, True),), 5, 48) or "")
    assert not_periodic((_at(5, 0.5, 30),), (), 5, 48) is not None
