"""Checkpoint plans for a report's model: the plan object users apply, the planner (the
program of passes/checkpoint_program.py over the chain costs graphmem/planning/costs.py
measures), and the summary ``--plan`` prints."""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

import torch.nn as nn

from graphmem.analysis import AnalysisView, captured
from graphmem.errors import UsageError
from graphmem.passes.budget import later_steps_peak
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
from graphmem.planning.apply import Applied, PlanPolicy, apply_segments, chain_blocks, hf_checkpointed
from graphmem.planning.costs import PlanError, chain_costs, measure_chain
from graphmem.planning.flops import op_flops
from graphmem.planning.verify import UNRUNNABLE, Verification, Verifier, forward_end, search
from graphmem.units import fmt_bytes, parse_bytes

__all__ = ["CheckpointPlan", "Planner", "PlanSummary", "PlanError", "chain_costs", "measure_chain", "op_flops",
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
    policies: tuple[Optional[PlanPolicy], ...] = ()  # per segment: its selective policy (graphmem.planning.OpPolicy) or None
    max_overhead: Optional[float] = None  # the recompute cap it was chosen under (instead of a budget)
    block_paths: tuple[str, ...] = ()  # module path of each block (chains over several holders)
    # how the peak was checked (a capture with the plan applied, graphmem/planning/verify.py): then peaks are captured
    verification: Optional[Verification] = None
    figure: str = ""  # the figure of the run the budget was compared with (graphmem/planning/figures.py)
    figure_bytes: Optional[int] = None  # and its bytes

    def __str__(self) -> str:  # the text view (graphmem/render/plan.py, a layer above: loaded by name)
        return str(importlib.import_module("graphmem.render.plan").render_chosen(self))

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
                "verification": self.verification.to_dict() if self.verification is not None else None,
                **({"policies": [p.name if p is not None else None for p in self.policies]} if self.policies else {}),
                **({"figure": self.figure, "figure_bytes": self.figure_bytes} if self.figure else {})}


def _policy_code(plan: CheckpointPlan) -> str:
    """Python that applies a plan with selective segments."""
    used: dict[str, PlanPolicy] = {}  # name -> its policy
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

    def __init__(self, report: AnalysisView, measured: Optional[tuple[ChainCosts, int]] = None) -> None:
        self.report = report
        self.costs, self.depth = measured or measure_chain(report)
        self.tables = tables(self.costs)
        self.step_flops = step_flops(report.step)
        self._none = evaluate(self.costs, segments_of(self.costs.n, []))
        self.verifier = Verifier(report, self.costs.chain, self._policies)
        # transformers' own checkpointing is on (gradient_checkpointing_enable()): the report is
        # that step; plans are measured and applied in its place
        self.hf_checkpointing = report.source is not None and any(
            hf_checkpointed(m) for _, m in chain_blocks(report.source.module, self.costs.chain))
        step, lv = captured(report)
        self._kept_without = lv.timeline[forward_end(step)]

    @property
    def exact(self) -> bool:
        """Whether the chain's pieces compose (the program's plans are then optimal)."""
        return self.costs.exact

    @property
    def problem(self) -> str:
        return self.costs.problem

    def _plan(self, name: str, e: Evaluated, budget: Optional[int] = None,
              verification: Optional[Verification] = None) -> CheckpointPlan:
        act = self.report.activation_bytes + e.kept_bytes - self._none.kept_bytes
        peak = e.peak_bytes
        if verification is not None:  # what the forward keeps, from the capture
            peak = verification.captured_peak
            act = self.report.activation_bytes + verification.captured_kept - self._kept_without
        return CheckpointPlan(name, self.costs.chain, self.costs.n, e.checkpointed, peak, act,
                              e.recompute_flops, self.step_flops, budget, self._policies(e),
                              block_paths=tuple(s.name for s in self.costs.stages), verification=verification)

    def _verified(self, name: str, e: Evaluated, budget: Optional[int], proven: bool) -> CheckpointPlan:
        peak, saved_bytes, kept = self.verifier.measure(e)
        v = Verification(e.peak_bytes, peak, saved_bytes, kept, proven, len(self.verifier.seen),
                         "" if self.exact else self.problem)
        return self._plan(name, e, budget, v)

    def _candidates(self) -> list[Evaluated]:
        """Plans a search may capture: the frontier's and the baselines'."""
        return [*self._frontier(), *self._baselines().values()]

    def _frontier(self, points: int = 50) -> tuple[Evaluated, ...]:
        return frontier(self.costs, points, self.tables)

    def _smallest_captured(self) -> int:
        return min((p for p, _, _ in self.verifier.seen.values() if p < UNRUNNABLE), default=UNRUNNABLE)

    def _runnable(self, e: Evaluated) -> bool:
        return e.peak_bytes < UNRUNNABLE and self.verifier.measure(e)[0] < UNRUNNABLE

    def _policies(self, e: Evaluated) -> tuple[Optional[PlanPolicy], ...]:
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
            if self.exact:
                if e is None:
                    raise PlanError(f"no checkpoint plan fits {fmt_bytes(budget)}: the smallest peak any plan of "
                                    f"{self.costs.chain} reaches is {fmt_bytes(self.minimum_peak())}; raise the "
                                    "budget or shrink the batch")
                if self.verifier.measure(e)[0] == e.peak_bytes:  # the capture confirms the program
                    return self._verified("graphmem", e, budget, True)
            got, _ = search(self.verifier, self._candidates(), lambda peak, c: peak <= budget, e, self._optimal, budget)
            if got is None:
                raise PlanError(f"no checkpoint plan fits {fmt_bytes(budget)}: the smallest peak of the "
                                f"{len(self.verifier.seen)} plans of {self.costs.chain} graphmem captured is "
                                f"{fmt_bytes(self._smallest_captured())}; raise the budget or shrink the batch")
            return self._verified("graphmem", got, budget, False)
        assert max_overhead is not None
        if max_overhead < 0:
            raise UsageError("the maximum overhead must be >= 0")
        if not self.exact:
            return replace(self._capped(max_overhead), max_overhead=max_overhead)
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
        if self.verifier.measure(e)[0] != e.peak_bytes:
            return replace(self._capped(max_overhead), max_overhead=max_overhead)
        return replace(self._verified("graphmem", e, None, True), max_overhead=max_overhead)

    def _capped(self, max_overhead: float) -> CheckpointPlan:
        """The lowest captured peak among candidate plans within the recompute cap (the
        pieces do not compose: the program's peaks are estimates)."""
        cap = max_overhead * self.step_flops
        within = sorted({self.verifier.key(c): c for c in self._candidates()
                         if c.recompute_flops <= cap and c.peak_bytes < UNRUNNABLE}.values(),
                        key=lambda c: (c.peak_bytes, c.recompute_flops))
        tried = [c for c in within if self.verifier.key(c) in self.verifier.seen]
        for c in within:
            if len(self.verifier.seen) >= 10:
                break
            self.verifier.measure(c)
            tried.append(c)
        if not tried:
            tried = [evaluate(self.costs, segments_of(self.costs.n, []))]
        best = min(tried, key=lambda c: (self.verifier.measure(c)[0], c.recompute_flops))
        return self._verified("graphmem", best, None, False)

    def no_plan_peak(self) -> int:
        """The peak without checkpoints (the report's, unless transformers' checkpointing is on)."""
        if not self.hf_checkpointing:
            return later_steps_peak(self.report.step, self.report.liveness)
        return self.verifier.measure(self._none)[0]

    def hf_baseline(self) -> Optional[tuple[CheckpointPlan, CheckpointPlan]]:
        """transformers' gradient checkpointing, as the model has it on (every layer, the
        report's own step), beside graphmem's plan for its peak; None when it is off."""
        if not self.hf_checkpointing:
            return None
        every = evaluate(self.costs, segments_of(self.costs.n, [(i, i) for i in range(self.costs.n)]))
        peak = later_steps_peak(self.report.step, self.report.liveness)
        base = replace(self._plan("transformers gradient_checkpointing_enable()", every, None), peak_bytes=peak,
                       activation_bytes=int(self.report.activation_bytes), verification=None)
        try:
            mine = self.plan(budget=peak)
        except PlanError:
            return None
        return base, mine

    def baselines(self) -> list[tuple[CheckpointPlan, CheckpointPlan]]:
        """Each baseline beside graphmem's plan for the baseline's own peak as the budget
        (where the pieces do not compose, the baseline's captured peak, and graphmem's plan
        the cheapest captured one that fits it)."""
        out = []
        hf = self.hf_baseline()
        if hf is not None:
            out.append(hf)
        for name, e in self._baselines().items():
            if not self.exact:
                if not self._runnable(e):
                    continue
                base = self._verified(name, e, None, False)
                try:
                    mine = self.plan(budget=base.peak_bytes)
                except PlanError:  # the search's captures ran out before it met the baseline
                    mine = replace(base, name="graphmem", budget=base.peak_bytes)
                out.append((base, mine))
                continue
            base = self._plan(name, e, None)
            chosen = self._optimal(e.peak_bytes)
            assert chosen is not None  # the baseline itself fits
            out.append((base, self._plan("graphmem", chosen, e.peak_bytes)))
        return out

    def _baselines(self) -> dict[str, Evaluated]:
        return baselines(self.costs)

    def frontier(self, points: int = 50) -> list[CheckpointPlan]:
        if not self.exact:  # the captured plans, Pareto-optimal by captured peak
            return _pareto([self._verified("graphmem", e, None, False) for e in self._captured() if self._runnable(e)])
        return [self._plan("graphmem", e) for e in self._frontier(points)]

    def _captured(self) -> list[Evaluated]:
        return list(self.verifier.plans.values())


def _pareto(plans: list[CheckpointPlan]) -> list[CheckpointPlan]:
    out: list[CheckpointPlan] = []
    for p in sorted(plans, key=lambda p: (p.recompute_flops, p.peak_bytes)):
        if not out or p.peak_bytes < out[-1].peak_bytes:
            out.append(p)
    return out


def parse_limits(budget: Union[int, str, None], max_overhead: Union[float, str, None], required: bool = True) -> tuple[Optional[int], Optional[float]]:
    """("40GiB" | bytes | None, "20%" | 0.2 | None) -> (bytes, fraction); exactly one unless not required."""

    if budget is not None and max_overhead is not None:
        raise UsageError("give a memory budget or a maximum recompute overhead, not both")
    if required and budget is None and max_overhead is None:
        raise UsageError("give a memory budget (e.g. `budget='40GiB'`) or a maximum recompute overhead "
                         "(e.g. `max_overhead='20%'`)")
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
    exact: bool = True  # the chain's pieces compose: the program's plans are optimal
    inexact_because: str = ""  # otherwise, what disagreed (plans are then the best of those captured)

    def __str__(self) -> str:  # as ``--plan`` prints it (graphmem/render/plan.py, a layer above: loaded by name)
        return str(importlib.import_module("graphmem.render.plan").render_plan(self))

    def to_dict(self) -> dict[str, Any]:
        return {
            "chain": self.chain, "blocks": self.blocks, "step_flops": self.step_flops,
            "no_plan_peak_bytes": self.no_plan_peak, "minimum_peak_bytes": self.minimum_peak,
            "chosen": self.chosen.to_dict() if self.chosen is not None else None,
            "problem": self.problem, "pieces_compose": self.exact,
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
    base, front = tuple(planner.baselines()), tuple(planner.frontier(points))
    low = planner.minimum_peak() if planner.exact else planner._smallest_captured()
    return PlanSummary(c.chain, c.n, planner.step_flops, planner.no_plan_peak(), low,
                       chosen, base, front, planner.depth, problem, getattr(planner, "levels", None),
                       planner.exact, planner.problem)
