"""torch.compile's activation memory budget, swept: one point per value of
``torch._functorch.config.activation_memory_budget`` (saved bytes, peak, what the min-cut
partitioner recomputes in backward and its FLOPs), and where the peak or the saved bytes do
not fall as the budget falls (pytorch/pytorch#197838 reports such peaks).

A point comes from one compiled-mode capture at that budget (``budget_point``); the sweep
orders the points from the largest budget down (``budget_sweep``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from graphmem.jsontypes import JSON
from graphmem.passes.liveness import Liveness
from graphmem.passes.modes import recomputed
from graphmem.passes.saved import SavedSet
from graphmem.stepgraph import StepGraph


@dataclass(frozen=True)
class BudgetPoint:
    budget: float  # activation_memory_budget the partition ran with
    saved_bytes: int  # activation bytes of the compiled step at this budget
    peak_bytes: int
    peak_phase: str
    recomputed_ops: int  # forward ops placed in backward (views and getitem left out)
    recomputed_bytes: int  # their outputs
    recompute_flops: int  # their FLOPs (torch.utils.flop_counter's formulas)


@dataclass(frozen=True)
class Rise:
    """Going from ``higher`` to ``lower`` budget, ``what`` ("peak" or "saved") rises by ``bytes``."""

    what: str
    higher: float
    lower: float
    bytes: int


@dataclass(frozen=True)
class BudgetSweep:
    points: tuple[BudgetPoint, ...]  # largest budget first
    rises: tuple[Rise, ...]  # where the peak or the saved bytes are not monotonic in the budget
    notes: tuple[str, ...] = ()  # how points were captured, where it matters (depth reuse not taken)

    @property
    def monotonic(self) -> bool:
        return not self.rises

    @property
    def lowest_peak(self) -> BudgetPoint:
        """The point with the lowest peak (the largest budget among ties: least recompute)."""
        return min(self.points, key=lambda p: (p.peak_bytes, -p.budget))

    def to_dict(self) -> dict[str, JSON]:
        return {"points": [{"budget": p.budget, "saved_bytes": p.saved_bytes, "peak_bytes": p.peak_bytes,
                            "peak_phase": p.peak_phase, "recomputed_ops": p.recomputed_ops,
                            "recomputed_bytes": p.recomputed_bytes, "recompute_flops": p.recompute_flops}
                           for p in self.points],
                "notes": list(self.notes),
                "not_monotonic": [{"what": r.what, "higher_budget": r.higher, "lower_budget": r.lower,
                                   "rise_bytes": r.bytes} for r in self.rises]}


def budget_point(g: StepGraph, sv: SavedSet, lv: Liveness, budget: Optional[float] = None) -> BudgetPoint:
    """One point: ``g`` is a compiled-mode capture, ``sv`` and ``lv`` its saved set and liveness;
    ``budget`` defaults to the capture's own (``g.target.memory_budget``, None meaning 1.0)."""
    if g.compiled is None:
        raise ValueError("budget_point needs a compiled-mode StepGraph (Target(mode='compiled'))")
    if budget is None:
        own = g.target.memory_budget if g.target is not None else None
        budget = 1.0 if own is None else own
    redo = recomputed(g.compiled)
    return BudgetPoint(budget, sv.activation_bytes, lv.peak_bytes, lv.peak_phase, len(redo),
                       sum(r.bytes for r in redo), sum(r.flops for r in redo))


def budget_sweep(points: Sequence[BudgetPoint]) -> BudgetSweep:
    """The points from the largest budget down, and each step down where the peak or the saved
    bytes rise."""
    ordered = tuple(sorted(points, key=lambda p: -p.budget))
    rises = []
    for hi, lo in zip(ordered, ordered[1:]):
        for what, before, after in (("peak", hi.peak_bytes, lo.peak_bytes), ("saved", hi.saved_bytes, lo.saved_bytes)):
            if after > before:
                rises.append(Rise(what, hi.budget, lo.budget, after - before))
    return BudgetSweep(ordered, tuple(rises))


__all__ = ["BudgetPoint", "BudgetSweep", "Rise", "budget_point", "budget_sweep"]
