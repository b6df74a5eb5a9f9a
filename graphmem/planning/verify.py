"""Plans checked by captures: the program of passes/checkpoint_program.py chooses, a capture of the
step with the plan applied (the fake-tensor capture ``analyze`` runs) says what it costs.

Where the chain's pieces compose (``ChainCosts.exact``: every role measured alike in every
capture, the program's premise holds, stitching reproduces each captured plan) the program's
plan is the optimum (the program equals brute force over the piece model); one capture
confirms it and the plan says "proven optimal". Where they do not (a Hugging Face model whose
KV cache keeps the keys and values of stored blocks only, a block ending in an in-place op),
the program's peaks are estimates: graphmem captures candidate plans (the program's choice,
the program's choices at budgets tightened by the error a capture showed, the frontier's
plans, the baselines) cheapest first and returns the cheapest whose *captured* peak fits,
saying how many plans it captured.

Known limitations: the search is not exhaustive when the pieces do not compose (a plan no
candidate list holds is never tried); it captures at most ``MAX_CAPTURES`` plans per budget.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from graphmem.analysis import AnalysisView
from graphmem.capture.reuse import MIN_LENGTH, Reused, reuses
from graphmem.capture.reuse_units import capture_units
from graphmem.errors import GraphmemError
from graphmem.jsontypes import JSON
from graphmem.passes import liveness, saved
from graphmem.passes.budget import later_steps_peak
from graphmem.passes.checkpoint import UNMEASURED, Evaluated
from graphmem.passes.run_memory import step_memory
from graphmem.planning.apply import SegmentPolicy, apply_segments, chain_blocks, plan_units
from graphmem.stepgraph import StepGraph
from graphmem.units import fmt_bytes

MAX_CAPTURES = 10
UNRUNNABLE = UNMEASURED.high  # the "peak" of a plan whose capture failed


@dataclass(frozen=True)
class Verification:
    """How a plan's numbers were checked: ``captured_peak`` is the peak of the step captured
    with the plan applied; ``predicted_peak`` the piece model's; ``proven`` whether the plan
    is the optimum (the pieces compose, so the program is exact, and the capture agrees);
    otherwise ``captures`` plans were captured to find it."""

    predicted_peak: int
    captured_peak: int
    captured_saved: int  # activation bytes (distinct saved storages, as ``report.activation_bytes``)
    captured_kept: int  # live bytes when the forward ends (``plan.activation_bytes`` is this, relative)
    proven: bool
    captures: int
    problem: str = ""  # why the piece model is an estimate ("" when the pieces compose)

    def line(self) -> str:
        if self.captured_peak == self.predicted_peak:
            how = f"captured peak {fmt_bytes(self.captured_peak)} = predicted"
        else:
            how = (f"captured peak {fmt_bytes(self.captured_peak)} (the piece model predicted "
                   f"{fmt_bytes(self.predicted_peak)})")
        tail = "proven optimal" if self.proven else f"best of {self.captures} captured plans"
        return f"verified: {how}; {tail}"

    def to_dict(self) -> dict[str, JSON]:
        return {"predicted_peak_bytes": self.predicted_peak, "captured_peak_bytes": self.captured_peak,
                "captured_saved_bytes": self.captured_saved, "proven_optimal": self.proven,
                "plans_captured": self.captures, "problem": self.problem or None}


Key = tuple[Any, ...]


class Verifier:
    """Captures of a report's step with plans applied, each plan captured once."""

    def __init__(self, report: AnalysisView, chain: str,
                 policies: Callable[[Evaluated], tuple[Optional[SegmentPolicy], ...]]) -> None:
        self.report, self.chain, self.policies = report, chain, policies
        self.seen: dict[Key, tuple[int, int, int]] = {}  # plan -> (captured peak, saved bytes, kept bytes)
        self.plans: dict[Key, Evaluated] = {}  # the plans captured

    def key(self, e: Evaluated) -> Key:
        return (e.segments, tuple(getattr(p, "name", None) for p in self.policies(e)))

    def measure(self, e: Evaluated) -> tuple[int, int, int]:
        """(peak, saved bytes, bytes live when the forward ends) of the report's step captured with plan ``e`` applied.
        The run memory of the lowest-peak plan captured so far is kept for graphmem/planning/figures.py
        ``plan_memory`` (the plan a search without a fitting plan answers, asked for again there)."""
        k = self.key(e)
        if k not in self.seen:
            try:
                g = plan_graph(self.report.source, self.chain, e.checkpointed, self.policies(e) or None).graph
            except GraphmemError:  # the plan cannot run on this model (it is never chosen)
                self.seen[k] = (UNRUNNABLE, 0, 0)
            else:
                lv = liveness(g)
                lowest = all(later_steps_peak(g, lv) <= p for p, _, _ in self.seen.values())
                self.seen[k] = (later_steps_peak(g, lv), saved(g).activation_bytes, lv.timeline[forward_end(g)])
                memo_key = run_memory_key(self.report, self.chain, e.checkpointed, self.policies(e))
                if lowest and memo_key is not None:
                    self.report.source.plan_memories[memo_key] = step_memory(g, self.report.memory.rows,
                                                                             self.report.source.parallel)
            self.plans[k] = e
        return self.seen[k]


def plan_graph(source: Any, chain: str, segments: Sequence[tuple[int, int]],
               policies: Optional[Sequence[Optional[SegmentPolicy]]] = None) -> Reused:
    """The step of a report's ``source`` (graphmem/step/recapture.py ``Recapture``) on fake tensors with the
    segments of ``chain`` checkpointed (as ``plan.apply`` does), at the report's own size and depth: widened
    from a shorter capture where the plan's units repeat (graphmem/capture/reuse_units.py, checked against a
    capture one unit deeper each time), else captured whole (``Reused.why`` says why)."""
    model = source.module
    with apply_segments(model, chain, segments, policies):
        n = len(chain_blocks(model, chain))
        if not source.reuse or not reuses(source.train) or n < MIN_LENGTH:
            return Reused(source.capture(), False, "" if source.reuse and reuses(source.train) else "reuse is off")
        sizes, kinds = plan_units(n, segments, policies)
        return capture_units(model, chain, sizes, kinds, source.capture)


def run_memory_key(report: AnalysisView, chain: str, segments: Sequence[tuple[int, int]],
                   policies: Sequence[object]) -> Optional[tuple]:
    """A plan's key among the run memories a report's source keeps (``Recapture.plan_memories``), None for
    one that cannot be a key (an unhashable selective policy) or a report without the run's figures."""
    if report.memory is None:
        return None
    key = (chain, tuple(segments), tuple(policies), report.memory.rows, report.source.parallel)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def forward_end(g: StepGraph) -> int:
    """The last op before the loss (the forward's end)."""
    return g.phase_start.get("loss", g.phase_start.get("backward", g.num_ops)) - 1


def search(verifier: Verifier, candidates: Sequence[Evaluated], fits: Callable[[int, Evaluated], bool],
           first: Optional[Evaluated], tighten: Callable[[int], Optional[Evaluated]],
           budget: Optional[int]) -> tuple[Optional[Evaluated], int]:
    """The cheapest plan (fewest recompute FLOPs, then lowest captured peak) among those
    captured whose captured peak ``fits``; returns it (None if none did) and the number of
    plans captured. Tried in turn: ``first`` (the program's plan); the program's plan for the
    budget lowered by what the capture exceeded it by (``tighten``, a few rounds); then a
    bisection over ``candidates`` sorted by FLOPs (captured peaks fall as FLOPs grow, mostly)
    and the two cheaper neighbours of the cheapest fitting one."""
    found: list[tuple[int, int, Evaluated]] = []

    def trial(e: Optional[Evaluated]) -> Optional[int]:
        if e is None or (len(verifier.seen) >= MAX_CAPTURES and verifier.key(e) not in verifier.seen):
            return None
        peak = verifier.measure(e)[0]
        if fits(peak, e):
            found.append((e.recompute_flops, peak, e))
        return peak

    peak = trial(first)
    if budget is not None and first is not None and peak is not None:
        target, e = budget, first
        for _ in range(3):  # the program again, the budget lowered by the error the capture showed
            if peak is None or peak <= budget or len(verifier.seen) >= MAX_CAPTURES:
                break
            target -= peak - budget
            e2 = tighten(target)
            if e2 is None or verifier.key(e2) == verifier.key(e):
                break
            e, peak = e2, trial(e2)
    order = sorted({verifier.key(c): c for c in candidates if c.peak_bytes < UNRUNNABLE}.values(),
                   key=lambda c: (c.recompute_flops, c.peak_bytes))
    lo, hi = 0, len(order) - 1
    best_i: Optional[int] = None
    while lo <= hi and len(verifier.seen) < MAX_CAPTURES:
        mid = (lo + hi) // 2
        p = trial(order[mid])
        if p is not None and fits(p, order[mid]):
            best_i, hi = mid, mid - 1
        else:
            lo = mid + 1
    if best_i is not None:
        for j in (best_i - 1, best_i - 2):
            if j >= 0:
                trial(order[j])
    if not found:
        return None, len(verifier.seen)
    return min(found, key=lambda f: (f[0], f[1]))[2], len(verifier.seen)
