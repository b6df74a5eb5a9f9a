"""What ``Analysis.memory_budgets`` runs: the report's compiled step captured again at each value
of torch.compile's ``activation_memory_budget`` (the real min-cut partitioner each time,
graphmem/capture/compiled.py), summarized by passes/memory_budget.py.

This is compiled mode's way to trade recompute for memory: the partitioner, not a checkpoint
plan, chooses what to recompute, and the budget is the knob users turn.

Known limitations: each value compiles the step again (dynamo, AOTAutograd, the partitioner),
so a sweep costs about one compiled analysis per value.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence, Union

from graphmem.analysis import AnalysisView
from graphmem.capture.target import check_memory_budget
from graphmem.errors import UsageError, no_source
from graphmem.passes.liveness import liveness
from graphmem.passes.memory_budget import BudgetPoint, BudgetSweep, budget_point, budget_sweep
from graphmem.passes.saved import saved
from graphmem.stepgraph import StepGraph


def parse_budgets(values: Union[str, float, Sequence[float]]) -> tuple[float, ...]:
    """``"1,0.8,0.5"``, a number or a sequence of numbers -> distinct budgets in [0, 1], in order."""
    if isinstance(values, str):
        try:
            items: list[float] = [float(v) for v in values.split(",") if v.strip()]
        except ValueError:
            raise UsageError(f"`memory_budget={values!r}`: give fractions in [0, 1], e.g. 0.5 or 1,0.8,0.5,0.2") from None
    elif isinstance(values, (int, float)):
        items = [values]
    else:
        items = list(values)
    if not items:
        raise UsageError("no memory budget given: e.g. `memory_budget=0.5` or `memory_budget=1,0.8,0.5,0.2`")
    return tuple(dict.fromkeys(check_memory_budget(v) for v in items))


def memory_budgets(report: AnalysisView, values: Union[str, float, Sequence[float]],
                   tick: Optional[Callable[[], object]] = None) -> BudgetSweep:
    """One point per budget in ``values``: the report's own capture where its budget is one of
    them, a compiled capture at each other value."""
    source = report.source
    if source is None:
        raise no_source(report.sharding)
    if source.target.mode != "compiled":
        raise UsageError("the memory budget is torch.compile's partitioner knob: analyze with mode=\"compiled\" "
                         "(`mode='compiled'`)")
    if source.train is not None and source.train.active:
        raise UsageError("the memory-budget sweep runs the plain step (forward, loss, backward): drop the optimizer "
                         "and micro-batch options")
    own = source.target.memory_budget
    points: list[BudgetPoint] = []
    notes: list[str] = []
    for v in parse_budgets(values):
        if own == v and report.step is not None:
            g, lv = report.step, report.liveness
        else:
            g, why = _capture_at(source, v)
            lv = liveness(g)
            if why:
                notes.append(f"budget {v:g}: depth reuse not taken ({why}): every block was compiled and captured")
        points.append(budget_point(g, saved(g), lv if lv is not None else liveness(g), v))
        if tick is not None:
            tick()
    return dataclasses.replace(budget_sweep(points), notes=tuple(notes))


def _capture_at(source: Any, budget: float) -> tuple[StepGraph, str]:
    """The report's step compiled at ``budget``: a deep chain compiled at depth 6 (budget 1 or 0)
    or at 5 and 6 (other values) and widened where the partition repeats block by block
    (graphmem/capture/reuse_compiled.py); why not, if not."""
    reused = source.measure(source.base.at(source.base_shape).with_target(memory_budget=budget), reuse=source.reuse)
    return reused.graph, reused.why


__all__ = ["memory_budgets", "parse_budgets"]
