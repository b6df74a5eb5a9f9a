"""What ``Report.planner``, ``.plan`` and ``.plans`` run: planners measured once per report
(kept in its graphmem.step.recapture.Recapture) and the plans they choose."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from graphmem.analysis import Analysis
from graphmem.capture.target import CARD, memory_limit
from graphmem.errors import UsageError, no_source
from graphmem.noise import quiet  # third-party notes on the captures these answers run (graphmem/noise.py)
from graphmem.planning.figures import figure_of, plan_within
from graphmem.planning.pieces import PlanError
from graphmem.planning.planner import CheckpointPlan, Planner, PlanSummary, parse_limits, summarize
from graphmem.planning.selective import LEVELS, SelectivePlanner


def planner(report: Analysis, selective: Any = False) -> Planner:
    """The report's planner for ``selective`` (False: plain; True: LEVELS levels; an int: that many)."""
    if report.source is None:
        raise no_source(report.sharding)
    kept = report.source.cache
    if selective is False or selective is None:
        if "planner" not in kept:
            kept["planner"] = Planner(report)
        return kept["planner"]
    count = LEVELS if selective is True else selective
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise UsageError(f"selective must be True, False or a number of levels >= 1, not {selective!r}")
    key = f"selective_planner_{count}"
    if key not in kept:
        kept[key] = SelectivePlanner(report, planner(report), count)
    return kept[key]



def card_budget(report: Analysis, budget: Any) -> Any:
    """``budget="gpu"``: the CUDA target card's capacity in bytes (graphmem/capture/target.py ``CAPACITY``)."""
    return memory_limit(budget, report.target, "budget") if isinstance(budget, str) and budget.strip().lower() == CARD \
        else budget


@quiet
def plan(report: Analysis, budget: Any = None, max_overhead: Any = None, selective: Any = False,
         figure: Optional[str] = None) -> CheckpointPlan:
    """The plan for ``budget``, judged on ``figure`` of the run (graphmem/planning/figures.py)."""
    limit, cap = parse_limits(card_budget(report, budget), max_overhead)
    p = planner(report, selective)
    if limit is None:
        return p.plan(limit, cap)
    return plan_within(report, p, limit, figure_of(report, figure))[0]


@quiet
def plans(report: Analysis, budget: Any = None, max_overhead: Any = None, points: int = 50,
          selective: Any = False, figure: Optional[str] = None) -> PlanSummary:
    limit, cap = parse_limits(card_budget(report, budget), max_overhead, required=False)
    p = planner(report, selective)
    if limit is None:
        return summarize(p, limit, cap, points=points)
    name = figure_of(report, figure)
    try:
        chosen, inner = plan_within(report, p, limit, name)
    except PlanError as e:
        return dataclasses.replace(summarize(p, None, None, points=points), problem=str(e))
    return dataclasses.replace(summarize(p, inner, None, points=points), chosen=chosen)
