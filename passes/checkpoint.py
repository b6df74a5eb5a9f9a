"""Checkpoint plans for a chain of blocks: baselines (none, every block, sqrt(n) segments), the
smallest reachable peak, the frontier of plans (peak against recompute FLOPs), and a
brute-force check of the program.

The model of a chain (its pieces, and the exact peak of a plan: ``evaluate``) is
passes/checkpoint_model.py; the program that finds the cheapest plan under a budget
(``optimal``) is passes/checkpoint_program.py. This module re-exports their public names, the
import path the planners and tests use.
"""
from __future__ import annotations

import itertools
import math
from typing import Callable, Iterator, Optional

from graphmem.passes.checkpoint_model import (
    NOTHING,
    UNMEASURED,
    ChainCosts,
    Evaluated,
    Piece,
    Segment,
    Stage,
    evaluate,
    level_after,
    segments_of,
)
from graphmem.passes.checkpoint_program import Tables, optimal, optimal_many, program, tables

__all__ = ["NOTHING", "UNMEASURED", "ChainCosts", "Evaluated", "Piece", "Segment", "Stage", "Tables", "all_plans",
           "baselines", "brute_force", "evaluate", "frontier", "level_after", "minimum_peak", "optimal",
           "optimal_many", "program", "segments_of", "tables"]


def brute_force(costs: ChainCosts, budget: int) -> Optional[Evaluated]:
    """Every segmentation, for testing ``optimal`` (exponential: small chains only)."""
    best: Optional[Evaluated] = None
    for plan in all_plans(costs.n):
        e = evaluate(costs, plan)
        if e.peak_bytes <= budget and (best is None or (e.recompute_flops, e.kept_bytes) < (best.recompute_flops, best.kept_bytes)):
            best = e
    return best


def all_plans(n: int) -> Iterator[tuple[Segment, ...]]:
    for cuts in itertools.product((False, True), repeat=max(n - 1, 0)):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        parts = [(bounds[i], bounds[i + 1] - 1) for i in range(len(bounds) - 1)]
        singles = [i for i, (a, b) in enumerate(parts) if a == b]
        for stored in itertools.product((False, True), repeat=len(singles)):
            flags = dict(zip(singles, stored))
            yield tuple((a, b, not flags.get(i, False)) for i, (a, b) in enumerate(parts))


# -- baselines and the frontier -----------------------------------------------------------------
def baselines(costs: ChainCosts) -> dict[str, Evaluated]:
    n = costs.n
    size = max(1, math.isqrt(n - 1) + 1 if n > 1 else 1)  # ceil(sqrt(n))
    return {
        "none": evaluate(costs, segments_of(n, [])),
        "every block": evaluate(costs, segments_of(n, [(i, i) for i in range(n)])),
        f"sqrt(n) segments ({size} blocks)": evaluate(
            costs, segments_of(n, [(a, min(a + size, n) - 1) for a in range(0, n, size)])),
    }


Solver = Callable[[int], Optional[Evaluated]]  # budget -> the cheapest plan that fits


def minimum_peak(costs: ChainCosts, t: Optional[Tables] = None, solve: Optional[Solver] = None) -> int:
    """The smallest peak any plan reaches (bisection on the budget; the program, or ``solve``
    for plans with more ways to run a segment, decides)."""
    t = t or tables(costs)
    solve = solve or (lambda budget: optimal(costs, budget, t))
    lo = t.fixed
    hi = evaluate(costs, segments_of(costs.n, [(i, i) for i in range(costs.n)])).peak_bytes
    hi = min(hi, evaluate(costs, segments_of(costs.n, [])).peak_bytes)
    while lo < hi:
        mid = (lo + hi) // 2
        if solve(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    return lo


def frontier(costs: ChainCosts, points: int = 50, t: Optional[Tables] = None,
             solve: Optional[Solver] = None) -> tuple[Evaluated, ...]:
    """Pareto-optimal plans (peak, recompute FLOPs) at ``points`` budgets from the smallest
    reachable peak to the peak without checkpointing, cheapest first."""
    t = t or tables(costs)
    solve = solve or (lambda budget: optimal(costs, budget, t))
    lo = minimum_peak(costs, t, solve)
    hi = evaluate(costs, segments_of(costs.n, [])).peak_bytes
    budgets = sorted({lo + (hi - lo) * k // max(points - 1, 1) for k in range(points)})
    found: dict[tuple[Segment, ...], Evaluated] = {}
    for e in map(solve, budgets):
        if e is not None:
            found[e.segments] = e
    plans = sorted(found.values(), key=lambda e: (e.recompute_flops, e.peak_bytes))
    out: list[Evaluated] = []
    for e in plans:  # drop plans another beats on both axes
        if not out or e.peak_bytes < out[-1].peak_bytes:
            out.append(e)
    return tuple(out)
