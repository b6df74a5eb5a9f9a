"""The live side of a Report: what it needs to capture the same step again (at other input
sizes for formulas and fits, with checkpoint plans applied for the planner), and what those
later questions keep so they are asked once (samplers, planners, kept answers for JSON).

A Report itself is frozen data; everything that captures again goes through this object.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn as nn

from graphmem.capture.capture import capture
from graphmem.capture.reuse import capture_reusing, reuses
from graphmem.capture.reuse_compiled import CompiledReused, compiled_reusing
from graphmem.capture.target import Target
from graphmem.distributed import Sharding, capture_rank
from graphmem.distributed.pipeline import Pipeline, analyze_stage
from graphmem.distributed.pipeline_stages import Layout
from graphmem.errors import UsageError
from graphmem.passes import Liveness, SavedSet, liveness, saved
from graphmem.passes.budget import Parallel
from graphmem.stepgraph import StepGraph
from graphmem.training.loop import TrainStep
from graphmem.training.spec import StepBudget, Training, prepare, step_budget
from graphmem.training.step import LossFn

if TYPE_CHECKING:
    from graphmem.formula.sampler import Sampler
    from graphmem.step.spec import StepSpec


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


@dataclass(frozen=True)
class Captured:
    """One captured step and the passes every report runs on it (``graphmem.analyze``'s core)."""

    graph: StepGraph
    liveness: Liveness
    saved: SavedSet
    budget: Optional[StepBudget]  # when the training spec asks for one
    module: nn.Module  # the module captured (with LoRA adapters when asked for)
    lora_layers: tuple[str, ...]
    target: Target  # the target captured (dtype left to the module when it holds its own: QLoRA)
    reuse_note: str = ""  # why depth reuse was not taken, when it was tried and not taken
    eager: Optional[StepGraph] = None  # compiled mode: the eager step, where depth reuse's check captured it

    @property
    def peak_bytes(self) -> int:
        """The step's peak: per rank when the training spec splits it over ranks."""
        return self.budget.peak_bytes if self.budget is not None else self.liveness.peak_bytes


def capture_step(module: nn.Module, make: Any, loss: Optional[LossFn], target: Target, training: Training,
                 reuse: bool = True, formula: Parallel = Parallel()) -> Captured:
    """Capture one training step of ``module`` (LoRA applied from ``training``) and run the
    passes, with the per-rank budget of ``formula`` (passes/budget.py) over it: a StepSpec's
    ``Single`` or ``Formula`` step (graphmem/step/measure.py)."""
    prepared, lora_layers = prepare(module, training, target.param_dtype)
    if training.keeps_dtypes(module):  # 4-bit weights, peft's fp32 adapters (graphmem/training/spec.py)
        target = dataclasses.replace(target, dtype=None)
    with training.train.runner(target) as runner:  # a trainer's own step, or None: graphmem's loop
        own = runner.run if runner is not None else None
        train = None if runner is not None else training.train
        # a deep chain of identical blocks is captured at depth 5 and widened (checked at depth 6), in
        # eager and compiled mode; in eager mode with the optimizer step too, not micro-batches (reuse.py reuses)
        capture_at: Any = lambda: capture(prepared, make, loss, target, train=train, runner=own)  # noqa: E731
        reused: Any = None
        if reuse and not training.train.active and target.mode == "compiled":  # one compilation, block by block
            reused = compiled_reusing(prepared, lambda t: capture(prepared, make, loss, t), target)
        elif reuse and target.mode != "compiled" and (not training.train.active or (own is None and reuses(train))):
            reused = capture_reusing(prepared, capture_at)
        g = reused.graph if reused is not None else capture_at()
    lv, sv = liveness(g), saved(g)
    plan = step_budget(g, lv, sv, training, prepared, lora_layers, layout=formula) \
        if training.requested or formula != Parallel() else None
    return Captured(g, lv, sv, plan, prepared, lora_layers, target, reused.why if reused is not None else "",
                    reused.eager if isinstance(reused, CompiledReused) else None)


def capture_rank_step(module: nn.Module, make: Any, loss: Optional[LossFn], target: Target, sharding: Sharding,
                      training: Training, reuse: bool = True) -> Captured:
    """Rank ``sharding.rank``'s step through PyTorch's own wrappers (fully_shard, DTensor's
    parallelize_module under the fake process group: graphmem/distributed/capture.py), LoRA
    applied first as users do with FSDP2, and the passes; the budget table is over the rank's
    own graph (its shards, its optimizer states: nothing divided). What ``graphmem.analyze`` runs for ``--rank``/``--fsdp`` and what
    ``Report.advise``'s FSDP2 levers capture."""
    prepared, lora_layers = prepare(module, training, target.param_dtype)
    if training.keeps_dtypes(module):  # peft's fp32 adapters on a 16-bit model (graphmem/training/spec.py)
        target = dataclasses.replace(target, dtype=None)
    train = training.train if training.train.active else None
    at: Any = lambda: capture_rank(prepared, make, loss, target, sharding, train)  # noqa: E731
    # a deep chain: 5 blocks captured, checked at 6; the optimizer step too, not micro-batches (as on one device)
    reused = capture_reusing(prepared, at) if reuse and reuses(train) else None
    g = reused.graph if reused is not None else at()
    lv, sv = liveness(g), saved(g)
    # the whole step's table (optimizer states, later steps' peak) over rank r's own graph
    traced = dataclasses.replace(training, train=g.train) if g.train is not None else training  # its micro-steps
    plan = step_budget(g, lv, sv, traced, prepared, lora_layers) if training.requested else None
    return Captured(g, lv, sv, plan, prepared, lora_layers, target, reused.why if reused is not None else "")


def capture_stage_step(module: nn.Module, make: Any, loss: Optional[LossFn], target: Target, training: Training,
                       plan: Pipeline, layout: Optional[Layout] = None) -> tuple[Captured, tuple[str, ...], Layout]:
    """Pipeline rank ``plan.rank``'s step under torch.distributed.pipelining's schedule
    (graphmem/distributed/pipeline.py), with the optimizer step over its stage's parameters when
    ``training`` has one, and the passes; its notes (stage, micro-batches in flight). What
    ``graphmem.analyze --pp`` and ``Report.advise``'s pipeline lever run (``layout``: the split
    another rank's capture probed, passed on so every rank does not probe it again)."""
    train = training.train if training.train.optimizer is not None else None
    st = analyze_stage(module, make, loss, target, plan, train, layout)
    # the whole step's table (the stage's optimizer states, later steps' peak) over rank r's own graph;
    # the schedule's micro-batches are not gradient-accumulation micro-steps
    traced = dataclasses.replace(training, train=st.graph.train) if st.graph.train is not None else None
    budget = step_budget(st.graph, st.liveness, st.saved, traced, module, (), plan.describe()) \
        if traced is not None else None
    return Captured(st.graph, st.liveness, st.saved, budget, module, (), target), st.notes, st.layout


class Recapture:
    """What a report's later questions (formulas, fits, plans, advise) capture again: the StepSpec
    it was analyzed from (``spec``), the module and target the capture ran (with LoRA adapters; the
    dtype left to a QLoRA module's own) and the first input's dimensions that vary."""

    def __init__(self, spec: "StepSpec", captured: Captured, example: tuple) -> None:
        self.spec = spec
        self.module, self.target = captured.module, captured.target
        self.make, self.loss, self.base_shape = spec.inputs.make, spec.loss, tuple(example[0].shape)
        self.training, self.original, self.reuse, self.asked_target = spec.training, spec.module, spec.reuse, spec.target
        self.parallel: Parallel = spec.parallel.formula  # formulas are one rank's under tensor parallelism
        self.names, self.dims = variables_of(example)
        self._sampler: Optional[Sampler] = None
        self.cache: dict[str, Any] = {}  # answers computed once: planners, the default formulas

    @property
    def train(self) -> Optional[TrainStep]:
        """The training step's loop (micro-batches, optimizer) as the first capture ran it."""
        return self.training.train if self.training is not None else None

    def capture(self, shape: Optional[tuple[int, ...]] = None) -> StepGraph:
        """The step captured again at ``shape`` (default: the analyzed one), with the training step
        (micro-batches, optimizer) as the first capture ran it."""
        size = self.base_shape if shape is None else shape
        return capture(self.module, lambda: self.make(size), self.loss, self.target, train=self.train)

    def sampler_for(self, base: tuple[int, ...], dims: tuple[int, ...], tick: Any = None) -> Sampler:
        """A fresh sampler around another base shape, varying only ``dims``."""
        from graphmem.formula.sampler import Sampler  # sympy (0.3 s) is imported only when formulas are asked for

        return Sampler(self.module, self.make, self.loss, base, dims, self.target, tick or (lambda: None), self.parallel)

    def sampler(self, tick: Any = None) -> Sampler:
        """The report's own sampler (kept, so its captures are reused across calls)."""
        if self._sampler is None:
            self._sampler = self.sampler_for(self.base_shape, self.dims)
        if tick is not None:
            self._sampler.tick = tick
        return self._sampler
