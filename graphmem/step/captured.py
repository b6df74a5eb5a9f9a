"""A captured step and the passes every report runs on it (``Captured``), built by one tail
(``passes_over``: liveness, the saved set and the whole step's table) for every engine's graph; and
the steps of rank r that ``measure`` (graphmem/step/measure.py) asks of PyTorch's wrappers and of a
pipeline's schedule.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch.nn as nn

from graphmem.capture.fakes import Inputs
from graphmem.capture.reuse import capture_reusing, reuses
from graphmem.capture.target import Target
from graphmem.distributed import Sharding, capture_rank
from graphmem.distributed.pipeline import Pipeline, analyze_stage
from graphmem.distributed.pipeline_stages import Layout
from graphmem.passes import Liveness, SavedSet, liveness, saved
from graphmem.passes.budget import Parallel
from graphmem.stepgraph import StepGraph
from graphmem.training.spec import StepBudget, Training, prepare, step_budget
from graphmem.training.step import LossFn


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


def passes_over(g: StepGraph, training: Optional[Training], module: nn.Module, target: Target,
                lora_layers: tuple[str, ...] = (), whose: str = "", layout: Parallel = Parallel(),
                passes: Optional[tuple[Liveness, SavedSet]] = None, **fields: Any) -> Captured:
    """``g`` with the passes every report runs on it: liveness, the saved set (``passes``, when the
    engine ran them already) and, when ``training`` is given, the whole step's table over ``g``
    (graphmem/training/spec.py step_budget: ``whose`` step it is, the formulas' ``layout`` per rank).
    ``fields``: the rest of Captured's."""
    lv, sv = passes if passes is not None else (liveness(g), saved(g))
    budget = step_budget(g, lv, sv, training, module, lora_layers, whose, layout) if training is not None else None
    return Captured(g, lv, sv, budget, module, lora_layers, target, **fields)


def capture_rank_step(module: nn.Module, make: Inputs, loss: Optional[LossFn], target: Target, sharding: Sharding,
                      training: Training, reuse: bool = True) -> Captured:
    """Rank ``sharding.rank``'s step through PyTorch's own wrappers (fully_shard, DTensor's
    parallelize_module under the fake process group: graphmem/distributed/capture.py), LoRA
    applied first as users do with FSDP2, and the passes; the budget table is over the rank's
    own graph (its shards, its optimizer states: nothing divided). What ``graphmem.analyze`` runs for ``--rank``/``--fsdp`` and what
    ``Analysis.advise``'s FSDP2 levers capture."""
    prepared, lora_layers = prepare(module, training, target.param_dtype)
    if training.keeps_dtypes(module):  # peft's fp32 adapters on a 16-bit model (graphmem/training/spec.py)
        target = dataclasses.replace(target, dtype=None)
    train = training.train if training.train.active else None
    at: Callable[[], StepGraph] = lambda: capture_rank(prepared, make, loss, target, sharding, train)  # noqa: E731
    # a deep chain: 5 blocks captured, checked at 6; the optimizer step too, not micro-batches (as on one device)
    reused = capture_reusing(prepared, at) if reuse and reuses(train) else None
    g = reused.graph if reused is not None else at()
    # the whole step's table (optimizer states, later steps' peak) over rank r's own graph
    traced = dataclasses.replace(training, train=g.train) if g.train is not None else training  # its micro-steps
    return passes_over(g, traced if training.requested else None, prepared, target, lora_layers,
                       reuse_note=reused.why if reused is not None else "")


def capture_stage_step(module: nn.Module, make: Inputs, loss: Optional[LossFn], target: Target, training: Training,
                       plan: Pipeline, layout: Optional[Layout] = None) -> tuple[Captured, tuple[str, ...], Layout]:
    """Pipeline rank ``plan.rank``'s step under torch.distributed.pipelining's schedule
    (graphmem/distributed/pipeline.py), with the optimizer step over its stage's parameters when
    ``training`` has one, and the passes; its notes (stage, micro-batches in flight). What
    ``graphmem.analyze --pp`` and ``Analysis.advise``'s pipeline lever run (``layout``: the split
    another rank's capture probed, passed on so every rank does not probe it again)."""
    train = training.train if training.train.optimizer is not None else None
    st = analyze_stage(module, make, loss, target, plan, train, layout)
    # the whole step's table (the stage's optimizer states, later steps' peak) over rank r's own graph;
    # the schedule's micro-batches are not gradient-accumulation micro-steps
    traced = dataclasses.replace(training, train=st.graph.train) if st.graph.train is not None else None
    return passes_over(st.graph, traced, module, target, (), plan.describe(), passes=(st.liveness, st.saved)), \
        st.notes, st.layout


__all__ = ["Captured", "capture_rank_step", "capture_stage_step", "passes_over"]
