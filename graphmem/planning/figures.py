"""Plans judged on one named figure of the run (passes/run_memory.py): "allocated", "reserved" or
"device" (the device total, the default on the CUDA target). The planner's own peaks are the step's
exact live bytes in later steps; the figure adds the caching allocator's rounding and cached
segments and the rows outside it. So the budget the planner gets is lowered by that headroom,
measured on the report's own step, and each chosen plan is captured with the plan applied and its
figure computed from the capture; a plan over the budget lowers the planner's budget by the
excess and plans again (a few rounds)."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from graphmem.analysis import Analysis, captured
from graphmem.passes.later_steps import later_steps_peak
from graphmem.passes.run_memory import FIGURE_NAMES, RunMemory, figure_for, step_memory
from graphmem.planning.apply import apply_segments
from graphmem.planning.pieces import PlanError
from graphmem.units import fmt_bytes

ROUNDS = 4


def figure_of(report: Analysis, figure: Optional[str]) -> str:
    """``figure`` checked, or the target's default."""
    return figure_for(report.target.device if report.target is not None else "cpu", figure)


def headroom(report: Analysis, figure: str) -> int:
    """The figure minus the exact later-steps peak, on the report's own step."""
    g, lv = captured(report)
    memory: RunMemory = report.memory
    exact = report.budget.rank.later_peak_bytes if report.budget is not None else later_steps_peak(g, lv)
    return max(0, memory.figure(figure) - exact)


def plan_memory(report: Analysis, plan: Any) -> RunMemory:
    """The run memory of the report's step captured with ``plan`` applied."""
    source = report.source
    with apply_segments(source.module, plan.chain, plan.segments, plan.policies or None):
        g = source.capture()
    return step_memory(g, report.memory.rows, source.parallel)


def plan_within(report: Analysis, planner: Any, budget: int, figure: str) -> tuple[Any, int]:
    """The planner's plan whose ``figure`` (captured) fits ``budget``, and the allocated budget the
    planner was given for it."""
    room, lowest_tried = headroom(report, figure), False
    for _ in range(ROUNDS):
        inner = budget - room
        if inner <= 0:
            break
        try:
            plan = planner.plan(inner, None)
        except PlanError:
            # the headroom was measured on the step without checkpoints, whose cached segments grow with
            # its activations: the cheapest plan under the budget itself, judged by its own capture, may
            # still fit (a PlanError here: not even the plans' tensors fit)
            if lowest_tried:
                raise
            lowest_tried, room = True, 0
            plan = planner.plan(budget, None)
        value = plan_memory(report, plan).figure(figure)
        if value <= budget:
            return dataclasses.replace(plan, budget=budget, figure=figure, figure_bytes=value), inner
        room += value - budget
    raise PlanError(f"no plan's {FIGURE_NAMES[figure]} fits {fmt_bytes(budget)} (outside the step's tensors: "
                    f"{fmt_bytes(headroom(report, figure))}); give figure='allocated' to judge the tensors alone")


__all__ = ["figure_of", "headroom", "plan_memory", "plan_within"]
