"""The live side of a Report: what it needs to capture the same step again (at other input
sizes for formulas and fits, with checkpoint plans applied for the planner), and what those
later questions keep so they are asked once (samplers, planners, kept answers for JSON).

A Report itself is frozen data; everything that captures again goes through this object.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch

from graphmem.capture.reuse_compiled import CompiledReused
from graphmem.errors import UsageError
from graphmem.passes.budget import Parallel
from graphmem.step.captured import Captured
from graphmem.step.measure import step_graph
from graphmem.step.spec import StepSpec
from graphmem.stepgraph import StepGraph
from graphmem.training.loop import TrainStep

if TYPE_CHECKING:
    from graphmem.formula.sampler import Sampler
    from graphmem.passes.run_memory import RunMemory


def variables_of(example: tuple) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Which input dimensions vary: all of an integer (token) input, named (b, s); a float
    input keeps its feature dimension fixed: (b, s, d) -> (b, s), (b, c, h, w) -> (b, h, w),
    (b, d) -> (b,)."""
    x = next((t for t in example if isinstance(t, torch.Tensor)), None)
    if x is None:
        raise UsageError("the model's first input is not a tensor; nothing to vary")
    n = x.dim()
    if not x.is_floating_point():
        dims = tuple(range(n))
    elif n >= 4:
        dims = (0, *range(2, n))
    else:
        dims = tuple(range(n - 1))
    if len(dims) == 2:
        return ("b", "s"), dims
    if n >= 4 and x.is_floating_point() and len(dims) == 3:
        return ("b", "h", "w"), dims
    return ("b", *(f"x{d}" for d in dims[1:])), dims


class Recapture:
    """What a report's later questions (formulas, fits, plans, advise) capture again: the StepSpec
    it was analyzed from (``spec``), the module and target the capture ran (with LoRA adapters; the
    dtype left to a QLoRA module's own) and the first input's dimensions that vary."""

    def __init__(self, spec: StepSpec, captured: Captured, example: tuple) -> None:
        self.spec = spec
        self.module, self.target = captured.module, captured.target
        # the step as the first capture ran it (the dtype left to a module that keeps its own), on one device
        self.base = spec.replace(target=captured.target)
        self.make, self.loss, self.base_shape = spec.inputs.make, spec.loss, tuple(example[0].shape)
        self.training, self.original, self.reuse, self.asked_target = spec.training, spec.module, spec.reuse, spec.target
        self.parallel: Parallel = spec.parallel.formula  # formulas are one rank's under tensor parallelism
        self.names, self.dims = variables_of(example)
        self._sampler: Optional[Sampler] = None
        # each checkpoint plan's run memory, captured with it applied (graphmem/planning/figures.py ``plan_memory``):
        # a bisection may land on a plan twice, and advise asks for the lowest-peak plan after plan_within did
        self.plan_memories: dict[tuple, RunMemory] = {}

    @property
    def train(self) -> Optional[TrainStep]:
        """The training step's loop (micro-batches, optimizer) as the first capture ran it."""
        return self.training.train if self.training is not None else None

    def capture(self, shape: Optional[tuple[int, ...]] = None) -> StepGraph:
        """The step captured again at ``shape`` (default: the analyzed one), with the training step
        (micro-batches, optimizer) as the first capture ran it."""
        return self.measure(self.base.at(self.base_shape if shape is None else shape), train=self.train).graph

    def measure(self, spec: StepSpec, train: Optional[TrainStep] = None, reuse: bool = False,
                one_compilation: bool = True) -> CompiledReused:
        """``spec`` (this step changed: ``self.base.at(shape)``, ``.with_target(...)``) captured again on the
        module the first capture ran (LoRA applied, a plan's checkpoints installed where the planner put them):
        graphmem/step/measure.py ``step_graph``."""
        return step_graph(spec, self.module, train, reuse=reuse, one_compilation=one_compilation)

    def sampler_for(self, base: tuple[int, ...], dims: tuple[int, ...], tick: Optional[Callable[[], None]] = None) -> Sampler:
        """A fresh sampler around another base shape, varying only ``dims``."""
        from graphmem.formula.sampler import Sampler  # sympy (0.3 s) is imported only when formulas are asked for

        def graph_at(shape: tuple[int, ...], reuse: bool) -> StepGraph:  # (the sampler's captures: no training loop)
            return self.measure(self.base.at(shape), reuse=reuse, one_compilation=False).graph

        return Sampler(self.module, graph_at, base, dims, tick or (lambda: None), self.parallel)

    def sampler(self, tick: Optional[Callable[[], None]] = None) -> Sampler:
        """The report's own sampler (kept, so its captures are reused across calls)."""
        if self._sampler is None:
            self._sampler = self.sampler_for(self.base_shape, self.dims)
        if tick is not None:
            self._sampler.tick = tick
        return self._sampler


__all__ = ["Captured", "Recapture", "variables_of"]
