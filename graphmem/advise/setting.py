"""A step's setting is its StepSpec (graphmem/step/spec.py), and the captures of its changes: every
lever is ``dataclasses.replace`` on the report's spec, and every lever's peak is the changed spec
measured (graphmem/step/measure.py, what ``graphmem.analyze`` runs), never an estimate.

Captures are cached by the spec. The formulas' parallel layout (``Formula``: ZeRO over ranks) is
not part of the key: passes/budget.py turns one captured step into a per-rank budget, so a ZeRO
lever costs no capture. A pipeline setting is every rank's step; its peak is the highest rank's."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from graphmem.analysis import AnalysisView, captured
from graphmem.errors import no_source
from graphmem.passes import saved
from graphmem.passes.budget import Parallel
from graphmem.passes.run_memory import RunMemory
from graphmem.planning.planner import step_flops
from graphmem.step.measure import Measured, measure_ranks
from graphmem.step.recapture import Captured
from graphmem.step.spec import Single, StepSpec
from graphmem.training.spec import step_budget


def _key(spec: StepSpec) -> StepSpec:
    """What the capture depends on: the spec without the formulas' layout."""
    return spec.replace(parallel=Single()) if spec.parallel.formula != Parallel() else spec


class Measurer:
    """Measures specs (once each), starting from the report's own capture."""

    def __init__(self, report: AnalysisView, tick: Optional[Callable[[], None]] = None) -> None:
        self.source = report.source
        if self.source is None:
            raise no_source(report.sharding)
        self.base: StepSpec = self.source.spec
        self.tick = tick or (lambda: None)
        self.captures = 0  # captures run (the report's own is not counted)
        self._flops: dict[StepSpec, int] = {}  # by the capture's key
        self._runs: dict[StepSpec, list[RunMemory]] = {}  # the run's memory of each rank captured (one but a pipeline's)
        rows = report.memory.rows if report.memory is not None else ()
        self.overrides = {r.name: r.bytes for r in rows if r.overridden}  # the user's row sizes, on every lever
        step, lv = captured(report)
        lora = report.budget.lora_layers if report.budget is not None else ()
        self._cache: dict[StepSpec, list[Captured]] = {_key(self.base): [
            Captured(step, lv, saved(step), report.budget, self.source.module, lora, self.source.target)]}

    def captured(self, spec: StepSpec) -> Captured:
        """The step of ``spec``, captured (or taken from the cache), its budget per rank: the
        highest rank's for a pipeline."""
        key = _key(spec)
        steps = self._cache.get(key)
        if steps is None:
            steps = [m.step for m in measure_ranks(key)]
            self._cache[key] = steps
            self.captures += 1
            self.tick()
        if len(steps) > 1:
            return max(steps, key=step_peak)
        cached = steps[0]
        formula = spec.parallel.formula
        if cached.budget is not None and cached.budget.training == spec.training and cached.budget.layout == formula:
            return cached
        if not spec.training.requested and formula == Parallel():
            return dataclasses.replace(cached, budget=None)
        g = cached.graph  # same step, another parallel layout: passes/budget.py's per-rank formulas
        plan = step_budget(g, cached.liveness, cached.saved, spec.training, cached.module, cached.lora_layers,
                           layout=formula)
        return dataclasses.replace(cached, budget=plan)

    def peak(self, spec: StepSpec) -> int:
        return step_peak(self.captured(spec))

    def figure(self, spec: StepSpec, name: str) -> int:
        """``name`` of the run of ``spec`` (passes/run_memory.py: "allocated", "reserved" or "device"),
        as ``graphmem.analyze`` gives it for that setting (graphmem/step/measure.py ``Measured.memory``); a
        pipeline's highest rank."""
        if spec not in self._runs:
            c = self.captured(spec)
            steps = self._cache[_key(spec)] if len(self._cache[_key(spec)]) > 1 else [c]
            self._runs[spec] = [Measured(spec, step).memory(self.overrides) for step in steps]
        return max(m.figure(name) for m in self._runs[spec])

    def flops(self, spec: StepSpec) -> int:
        """FLOPs of the step's recorded ops (planning/planner.py's ``step_flops``), counted once a step."""
        key = _key(spec)
        if key not in self._flops:
            self._flops[key] = step_flops(self.captured(spec).graph)
        return self._flops[key]

    def release(self, spec: StepSpec) -> None:
        """``spec``'s captured steps dropped once what advise reads of them is read (its run's figures and FLOPs
        stay): every lever's graph held to the advice's end made each of Python's full collections traverse them
        all, and the process held them all. Asked for again, the step is captured again; the report's own is kept."""
        if _key(spec) != _key(self.base):
            self._cache.pop(_key(spec), None)


def step_peak(step: Captured) -> int:
    """The highest peak of any training step: the first, or a later one, whose optimizer states
    exist before it starts (passes/budget.py's ``later_peak_bytes``), per rank."""
    if step.budget is None:
        return step.liveness.peak_bytes
    return max(step.budget.peak_bytes, step.budget.rank.later_peak_bytes)
