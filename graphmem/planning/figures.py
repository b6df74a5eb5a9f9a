"""Plans judged on one named figure of the run (passes/run_memory.py): "allocated", "reserved" or
"device" (the device total, the default on the CUDA target). The planner's own peaks are the step's
exact live bytes in later steps; the figure adds the caching allocator's rounding and cached
segments and the rows outside it. So the budget the planner gets is lowered by that headroom,
measured on the report's own step, and each chosen plan is captured with the plan applied and its
figure computed from the capture; when that guess is over the budget or out of reach, the planner's
budget is bisected (``ROUNDS`` captures) between its lowest-peak plan and the budget."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

from graphmem.analysis import AnalysisView, captured
from graphmem.passes.later_steps import later_steps_peak
from graphmem.passes.run_memory import FIGURE_NAMES, RunMemory, figure_for, step_memory
from graphmem.planning.pieces import PlanError
from graphmem.planning.verify import plan_graph, run_memory_key
from graphmem.units import fmt_bytes

if TYPE_CHECKING:
    from graphmem.planning.planner import CheckpointPlan, Planner

ROUNDS = 4


def figure_of(report: AnalysisView, figure: Optional[str]) -> str:
    """``figure`` checked, or the target's default."""
    return figure_for(report.target.device if report.target is not None else "cpu", figure)


def headroom(report: AnalysisView, figure: str) -> int:
    """The figure minus the exact later-steps peak, on the report's own step."""
    g, lv = captured(report)
    memory: RunMemory = report.memory
    exact = report.budget.rank.later_peak_bytes if report.budget is not None else later_steps_peak(g, lv)
    return max(0, memory.figure(figure) - exact)


def plan_memory(report: AnalysisView, plan: CheckpointPlan) -> RunMemory:
    """The run memory of the report's step captured with ``plan`` applied (once per plan: kept by the report's source,
    graphmem/step/recapture.py ``Recapture.plan_memories``, where the planner's verifier also keeps its lowest-peak
    plan's: graphmem/planning/verify.py)."""
    source = report.source
    key = run_memory_key(report, plan.chain, plan.segments, plan.policies)  # (None: captured every time)
    memo: dict[tuple, RunMemory] = source.plan_memories
    if key is not None and key in memo:
        return memo[key]
    g = plan_graph(source, plan.chain, plan.segments, plan.policies or None).graph
    out = step_memory(g, report.memory.rows, source.parallel)
    if key is not None:
        memo[key] = out
    return out


def _plan(planner: Planner, budget: int) -> Any:  # a CheckpointPlan or None (plan_within holds both in one variable)
    """The planner's plan for ``budget``, None where none fits (an inexact chain's program estimates
    its plans' peaks; its captures may then find none under the budget)."""
    try:
        return planner.plan(budget, None)
    except PlanError:
        return None


def plan_within(report: AnalysisView, planner: Planner, budget: int, figure: str) -> tuple[CheckpointPlan, int]:
    """The planner's plan whose ``figure`` (captured) fits ``budget``, and the allocated budget the
    planner was given for it. The first guess lowers the budget by the unplanned step's headroom; when
    that plan is over, or out of reach (the cached segments shrink with the activations), the
    planner's budget is bisected between its lowest-peak plan and ``budget``, each plan captured."""
    room = headroom(report, figure)
    inner = budget - room
    if room == 0:  # the tensors alone (the CPU target's figures): the planner's own answer, or its error
        plan = planner.plan(budget, None)
        value = plan_memory(report, plan).figure(figure)
        if value <= budget:
            return dataclasses.replace(plan, budget=budget, figure=figure, figure_bytes=value), inner
    lowest = planner.plan(None, 1.0)  # recompute is at most the forward: every plan is within 100 %
    if lowest.peak_bytes > budget:
        planner.plan(budget, None)  # raises: not even the plans' tensors fit (the planner's own words)
    guess = _plan(planner, inner) if room > 0 and inner >= lowest.peak_bytes else None
    if guess is not None:
        value = plan_memory(report, guess).figure(figure)
        if value <= budget:
            return dataclasses.replace(guess, budget=budget, figure=figure, figure_bytes=value), inner
    value = plan_memory(report, lowest).figure(figure)
    if value > budget:
        raise PlanError(f"no plan's {FIGURE_NAMES[figure]} fits {fmt_bytes(budget)}: the lowest-peak plan's is "
                        f"{fmt_bytes(value)} (outside the step's tensors: {fmt_bytes(value - lowest.peak_bytes)}); "
                        "give figure='allocated' to judge the tensors alone")
    best, lo, hi = (lowest, value, lowest.peak_bytes), lowest.peak_bytes, budget
    for _ in range(ROUNDS):
        mid = (lo + hi) // 2
        plan = _plan(planner, mid)
        value = plan_memory(report, plan).figure(figure) if plan is not None else budget + 1
        if plan is not None and value <= budget:
            best, lo = (plan, value, mid), mid
        else:
            hi = mid
    plan, value, given = best
    return dataclasses.replace(plan, budget=budget, figure=figure, figure_bytes=value), given


__all__ = ["figure_of", "headroom", "plan_memory", "plan_within"]
