"""What the min-cut partitioner decided for each joint graph, recorded so that depth reuse can
tell whether a partition made at a memory budget between 0 and 1 repeats at full depth.

At budget 1 the partition is one min cut (torch/_functorch/partitioners.py ``solve_min_cut``):
each block's cut depends on that block alone. Between 0 and 1, ``choose_saved_values_set``
weighs the whole step at once: it compares the saved bytes of more and more aggressive cuts
with the budget as fractions of the whole step's (``get_mem_ratio``), and if none fits, a
knapsack picks which values to recompute over every block together. Both depend on the
depth. This module wraps ``choose_saved_values_set``, ``solve_min_cut`` and
``_optimize_runtime_with_given_memory`` while a step compiles and keeps, per joint graph, the
saved bytes of each cut in the order the partitioner made them and whether the knapsack ran.
graphmem/capture/reuse.py extends the byte counts linearly in the depth (captures at depth k and
k + 1) and replays the same comparisons at full depth.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Optional

if TYPE_CHECKING:
    import torch.fx as fx
    from torch._functorch.partitioners import NodeInfo
    from torch.utils._ordered_set import OrderedSet


@dataclass(frozen=True)
class Partition:
    budget: float
    sizes: tuple[int, ...]  # bytes: the graph's inputs, then each min cut's saved values, in call order
    knapsack: bool  # the knapsack chose (the budget fell below every cut's ratio)


@contextlib.contextmanager
def recording(out: list[Partition]) -> Iterator[None]:
    """Append one Partition per joint graph partitioned inside the block to ``out``."""
    from torch._functorch import partitioners as parts

    choose, solve, optimize = parts.choose_saved_values_set, parts.solve_min_cut, parts._optimize_runtime_with_given_memory
    open_: list[tuple[list[int], list[bool]]] = []

    def solve_min_cut(*args: Any, **kwargs: Any) -> tuple[list[fx.Node], OrderedSet[fx.Node]]:  # its own arguments
        saved, banned = solve(*args, **kwargs)
        if open_:
            open_[-1][0].append(sum(map(parts._size_of, saved)))
        return saved, banned

    def knapsack(*args: Any, **kwargs: Any) -> tuple[float, list[int], list[int]]:  # its own arguments
        if open_:
            open_[-1][1].append(True)
        return optimize(*args, **kwargs)

    def choose_saved_values_set(joint_graph: fx.Graph, node_info: NodeInfo, memory_budget: float = 1) -> list[fx.Node]:
        open_.append(([sum(map(parts._size_of, node_info.inputs))], []))
        try:
            return choose(joint_graph, node_info, memory_budget)
        finally:
            sizes, ran = open_.pop()
            out.append(Partition(memory_budget, tuple(sizes), bool(ran)))

    parts.choose_saved_values_set, parts.solve_min_cut = choose_saved_values_set, solve_min_cut  # type: ignore[assignment]
    parts._optimize_runtime_with_given_memory = knapsack  # type: ignore[assignment]
    try:
        yield
    finally:
        parts.choose_saved_values_set, parts.solve_min_cut, parts._optimize_runtime_with_given_memory = choose, solve, optimize


def not_periodic(small: tuple[Partition, ...], check: tuple[Partition, ...], k: int, n: int) -> Optional[str]:
    """Why the partitions recorded at depth k (``small``) and k + 1 (``check``) may not be the
    partition at depth n (None: they are, as far as the partitioner's own comparisons go)."""
    if len(small) != len(check):
        return "a different number of joint graphs at depth k and k + 1"
    for p, q in zip(small, check):
        if p.budget in (0, 1):
            continue  # one min cut, block by block (or nothing saved but the inputs)
        if p.knapsack or q.knapsack:
            return (f"at memory budget {p.budget:g} the partitioner's knapsack chooses what to recompute over "
                    "all blocks at once")
        if len(p.sizes) != len(q.sizes):
            return f"at memory budget {p.budget:g} the partitioner takes another cut at depth k + 1"
        at_n = [a + (n - k) * (b - a) for a, b in zip(p.sizes, q.sizes)]  # each cut's bytes grow by one block's
        if _cuts_tried(at_n, p.budget) != _cuts_tried(list(p.sizes), p.budget):
            return f"at memory budget {p.budget:g} the partitioner would take another cut at full depth"
    return None


def _cuts_tried(sizes: list[int], budget: float) -> int:
    """How many min cuts ``choose_saved_values_set`` makes for these byte counts (inputs, the
    runtime-optimal cut, the more aggressive, the aggressive), with its comparisons
    (torch/_functorch/partitioners.py): it stops at the first cut whose ratio is below the budget."""
    low, high = sizes[0], sizes[1]
    if high <= low:
        return 1
    for tried, cut in enumerate(sizes[2:4], start=2):
        if (cut - low) / (high - low) < budget:
            return tried
    return 4
