"""Checkpoint plans for a report's model: the plan object users apply, the planner (the
program of passes/checkpoint.py over the chain costs graphmem/planning/costs.py
measures), and the summary ``--plan`` prints."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch.nn as nn

from graphmem.errors import UsageError
from graphmem.passes.checkpoint import (
    ChainCosts,
    Evaluated,
    baselines,
    evaluate,
    frontier,
    minimum_peak,
    optimal,
    segments_of,
    tables,
)
from graphmem.planning.apply import Applied, apply_segments, chain_blocks
from graphmem.planning.costs import PlanError, chain_costs, measure, op_flops
from graphmem.units import fmt_bytes, parse_bytes

__all__ = ["CheckpointPlan", "Planner", "PlanSummary", "PlanError", "chain_costs", "measure", "op_flops",
           "parse_limits", "summarize"]


# -- plans -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckpointPlan:
    """A checkpoint plan for a report's model: which blocks run as checkpointed segments.

    ``segments`` are (first, last) block indices of the chain ``chain`` (inclusive);
    ``paths`` the same as module paths. ``peak_bytes`` is the step's predicted peak with the
    plan applied, ``activation_bytes`` what the forward keeps for backward, ``recompute_flops``
    the forward FLOPs run again in backward, ``overhead`` those over the step's FLOPs.
    """

    name: str
    chain: str
    blocks: int
    segments: tuple[tuple[int, int], ...]
    peak_bytes: int
    activation_bytes: int
    recompute_flops: int
    step_flops: int
    budget: Optional[int] = None
    policies: tuple[Any, ...] = ()  # per segment: its selective policy (graphmem.planning.OpPolicy) or None
    max_overhead: Optional[float] = None  # the recompute cap it was chosen under (instead of a budget)
    block_paths: tuple[str, ...] = ()  # module path of each block (chains over several holders)

    @property
    def overhead(self) -> float:
        return self.recompute_flops / self.step_flops if self.step_flops else 0.0

    @property
    def paths(self) -> tuple[str, ...]:
        if "," in self.chain and len(self.block_paths) == self.blocks:  # several holders: the blocks' own paths
            bp = self.block_paths
            return tuple(bp[a] if a == b else f"{bp[a]}..{bp[b]}" for a, b in self.segments)
        p = f"{self.chain}." if self.chain else ""
        return tuple(f"{p}{a}" if a == b else f"{p}{a}..{b}" for a, b in self.segments)

    def apply(self, model: nn.Module) -> Applied:
        """Checkpoint the plan's segments of ``model`` (torch.utils.checkpoint, non-reentrant);
        returns a handle whose ``remove()`` (or ``with`` exit) undoes it."""
        have = len(chain_blocks(model, self.chain))
        if have != self.blocks:
            raise UsageError(f"this plan is for {self.blocks} blocks in {self.chain or 'the model'}, the model has {have}")
        return apply_segments(model, self.chain, self.segments, self.policies or None)

    def code(self) -> str:
        """Python that applies the plan."""
        if not self.segments:
            return "# nothing to checkpoint: this plan keeps every block's activations"
        if any(p is not None for p in self.policies):
            return _policy_code(self)
        segs = ", ".join(f"({a}, {b})" for a, b in self.segments)
        lines = ["import graphmem.planning as gc",
                 f"gc.apply_segments(model, {self.chain!r}, [{segs}])  # torch.utils.checkpoint, non-reentrant"]
        if self.segments and all(a == b for a, b in self.segments) and "," not in self.chain:
            idx = ", ".join(str(a) for a, _ in self.segments)
            lines += ["# or, in the parent's forward, with torch alone:",
                      f"#   for i, block in enumerate(self.{self.chain.split('.')[-1] or 'blocks'}):",
                      f"#       x = checkpoint(block, x, use_reentrant=False) if i in {{{idx}}} else block(x)"]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "chain": self.chain, "blocks": self.blocks,
                "segments": [list(s) for s in self.segments], "paths": list(self.paths),
                "peak_bytes": self.peak_bytes, "activation_bytes": self.activation_bytes,
                "recompute_flops": self.recompute_flops, "overhead": self.overhead, "budget": self.budget,
                "max_overhead": self.max_overhead,
                **({"policies": [p.name if p is not None else None for p in self.policies]} if self.policies else {})}


def _policy_code(plan: CheckpointPlan) -> str:
    """Python that applies a plan with selective segments."""
    used: dict[str, Any] = {}  # name -> graphmem.planning.selective.OpPolicy
    for p in plan.policies:
        if p is not None:
            used.setdefault(p.name, p)
    names = {name: f"keep_{name.lower()}" for name in used}
    segs = ", ".join(f"({a}, {b})" for a, b in plan.segments)
    pols = ", ".join(names[p.name] if p is not None else "None" for p in plan.policies)
    lines = ["import graphmem.planning as gc", "from graphmem.planning import OpPolicy",
             "# each block keeps the outputs of these ops ((op, its call index in the block)); the rest is recomputed"]
    lines += [f"{names[n]} = OpPolicy(frozenset({p.literal()}), {n!r})" for n, p in used.items()]
    lines += [f"gc.apply_segments(model, {plan.chain!r}, [{segs}],",
              f"                  policies=[{pols}])  # torch.utils.checkpoint, non-reentrant, selective"]
    if plan.segments and all(a == b for a, b in plan.segments) and None not in plan.policies and len(used) == 1:
        (name, _), = used.items()
        lines += ["# or, in the parent's forward, with torch alone (one block per checkpoint call):",
                  f"#   x = checkpoint(block, x, use_reentrant=False, context_fn={names[name]}.context_fn)"]
    return "\n".join(lines)


def step_flops(g: Any) -> int:
    """FLOPs of the whole step: with k micro-batches, of which two were traced, the second
    micro-step's count k - 1 times (graphmem/training/loop.py)."""
    flops = [op_flops(op) for op in g.ops]
    k = g.train.micro_batches if g.train is not None else 1
    if len(g.micro_steps) < 2 or k <= len(g.micro_steps):
        return sum(flops)
    second, end = g.micro_steps[1][0], g.phase_start.get("optimizer", g.num_ops)
    return sum(flops[:second]) + (k - 1) * sum(flops[second:end]) + sum(flops[end:])


class Planner:
    """Plans for one report: the optimum under a budget or an overhead cap, baselines, frontier."""

    def __init__(self, report: Any, measured: Optional[tuple[ChainCosts, int]] = None) -> None:
        self.report = report
        self.costs, self.depth = measured or measure(report)
        self.tables = tables(self.costs)
        self.step_flops = step_flops(report.step)
        self._none = evaluate(self.costs, segments_of(self.costs.n, []))

    def _plan(self, name: str, e: Evaluated, budget: Optional[int] = None) -> CheckpointPlan:
        act = self.report.activation_bytes + e.kept_bytes - self._none.kept_bytes
        return CheckpointPlan(name, self.costs.chain, self.costs.n, e.checkpointed, e.peak_bytes, act,
                              e.recompute_flops, self.step_flops, budget, self._policies(e),
                              block_paths=tuple(s.name for s in self.costs.stages))

    def _policies(self, e: Evaluated) -> tuple[Any, ...]:
        return ()

    def _optimal(self, budget: int) -> Optional[Evaluated]:
        return optimal(self.costs, budget, self.tables)

    def minimum_peak(self) -> int:
        return minimum_peak(self.costs, self.tables)

    def plan(self, budget: Optional[int] = None, max_overhead: Optional[float] = None) -> CheckpointPlan:
        if (budget is None) == (max_overhead is None):
            raise UsageError("give a memory budget or a maximum recompute overhead (not both)")
        if budget is not None:
            e = self._optimal(budget)
            if e is None:
                raise PlanError(f"no checkpoint plan fits {_gib(budget)}: the smallest peak any plan of "
                                f"{self.costs.chain} reaches is {_gib(self.minimum_peak())}; raise the "
                                "budget or shrink the batch")
            return self._plan("graphmem", e, budget)
        assert max_overhead is not None
        if max_overhead < 0:
            raise UsageError("the maximum overhead must be >= 0")
        lo, hi = self.minimum_peak(), self._none.peak_bytes  # smallest budget whose plan is cheap enough
        while lo < hi:
            mid = (lo + hi) // 2
            e = self._optimal(mid)
            if e is not None and e.recompute_flops <= max_overhead * self.step_flops:
                hi = mid
            else:
                lo = mid + 1
        e = self._optimal(lo)
        assert e is not None
        return replace(self._plan("graphmem", e), max_overhead=max_overhead)

    def baselines(self) -> list[tuple[CheckpointPlan, CheckpointPlan]]:
        """Each baseline beside graphmem's plan for the baseline's own peak as the budget."""
        out = []
        for name, e in self._baselines().items():
            base = self._plan(name, e, None)
            mine = self._optimal(e.peak_bytes)
            assert mine is not None  # the baseline itself fits
            out.append((base, self._plan("graphmem", mine, e.peak_bytes)))
        return out

    def _baselines(self) -> dict[str, Evaluated]:
        return baselines(self.costs)

    def frontier(self, points: int = 50) -> list[CheckpointPlan]:
        return [self._plan("graphmem", e) for e in frontier(self.costs, points, self.tables)]


def parse_limits(budget: Any, max_overhead: Any, required: bool = True) -> tuple[Optional[int], Optional[float]]:
    """("40GiB" | bytes | None, "20%" | 0.2 | None) -> (bytes, fraction); exactly one unless not required."""

    if budget is not None and max_overhead is not None:
        raise UsageError("give a memory budget or a maximum recompute overhead, not both")
    if required and budget is None and max_overhead is None:
        raise UsageError("give a memory budget (e.g. budget=\"40GiB\", --budget 40GiB) or a maximum "
                         "recompute overhead (max_overhead=0.2, --max-overhead 20%)")
    fraction = None
    if max_overhead is not None:
        text = str(max_overhead).strip()
        try:
            fraction = float(text[:-1]) / 100 if text.endswith("%") else float(text)
        except ValueError:
            raise UsageError(f"invalid overhead {max_overhead!r}: expected a percentage like 20% or a fraction like 0.2") from None
        if not (fraction >= 0 and math.isfinite(fraction)):
            raise UsageError(f"invalid overhead {max_overhead!r}: it must be >= 0")
    return (parse_bytes(budget) if budget is not None else None), fraction


def _gib(n: int) -> str:
    return fmt_bytes(n)


@dataclass(frozen=True)
class PlanSummary:
    """What ``--plan`` shows: the chosen plan (when a budget or an overhead cap was given),
    the baselines each beside graphmem's plan at the same budget, and the Pareto frontier."""

    chain: str
    blocks: int
    step_flops: int
    no_plan_peak: int
    minimum_peak: int
    chosen: Optional[CheckpointPlan]
    baselines: tuple[tuple[CheckpointPlan, CheckpointPlan], ...]
    frontier: tuple[CheckpointPlan, ...]
    depth_captured: int  # blocks captured to measure the chain (4 for identical blocks)
    problem: Optional[str] = None  # why no plan was chosen for the budget given (none fits)
    selective: Any = None  # graphmem.planning.selective.Levels: the ops each selective level keeps

    def to_dict(self) -> dict[str, Any]:
        return {
            "chain": self.chain, "blocks": self.blocks, "step_flops": self.step_flops,
            "no_plan_peak_bytes": self.no_plan_peak, "minimum_peak_bytes": self.minimum_peak,
            "chosen": self.chosen.to_dict() if self.chosen is not None else None,
            "problem": self.problem,
            "baselines": [{"baseline": b.to_dict(), "graphmem": g.to_dict()} for b, g in self.baselines],
            "frontier": [p.to_dict() for p in self.frontier],
            **({"selective": self.selective.to_dict()} if self.selective is not None else {}),
        }


def summarize(planner: Planner, budget: Optional[int] = None, max_overhead: Optional[float] = None,
              points: int = 50) -> PlanSummary:
    chosen, problem = None, None
    if budget is not None or max_overhead is not None:
        try:
            chosen = planner.plan(budget, max_overhead)
        except PlanError as e:  # no plan fits: the frontier still shows what is reachable
            problem = str(e)
    c = planner.costs
    return PlanSummary(c.chain, c.n, planner.step_flops, planner._none.peak_bytes, planner.minimum_peak(),
                       chosen, tuple(planner.baselines()), tuple(planner.frontier(points)), planner.depth,
                       problem, getattr(planner, "levels", None))
