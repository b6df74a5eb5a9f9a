"""Captures of one step at chosen input sizes and chain depths, for the formulas (graphmem/formula/fit.py).

With tensor parallelism (``parallel.tp > 1``) a sample's activation, peak and timeline are one
rank's (passes/budget.py: the tensors passes/tensor_parallel.py marks as split, divided by t; with
sequence parallelism the stream too), so the fitted formulas and alpha/beta/gamma are per rank."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch.nn as nn

from graphmem.chains import find_chain, truncated
from graphmem.passes import SavedSet, liveness, saved
from graphmem.passes.budget import Parallel, budget
from graphmem.stepgraph import StepGraph


@dataclass(frozen=True)
class Sample:
    activation: int
    peak: int
    block: int  # bytes saved by block 1 of the chain (its subtree)
    timeline: tuple[int, ...]  # live bytes during each op
    ops: tuple[object, ...]  # the op sequence (targets: OpOverloads, compared only)
    step: tuple[StepGraph, SavedSet]  # the capture and its saved set


class Sampler:
    """Captures the step at given sizes (and chain depths), with a cache. ``graph_at(shape, reuse)``
    captures ``model``'s step at a first-input shape (``reuse``: a deep chain captured at depth 5 and
    widened, graphmem/capture/reuse.py): the report's StepSpec at that shape, measured
    (graphmem/step/recapture.py ``Recapture.sampler_for``)."""

    def __init__(self, model: nn.Module, graph_at: Callable[[tuple[int, ...], bool], StepGraph],
                 base: tuple[int, ...], dims: tuple[int, ...],
                 tick: Callable[[], None] = lambda: None, parallel: Parallel = Parallel()) -> None:
        self.model, self.graph_at, self.base, self.dims = model, graph_at, base, dims
        self.parallel = parallel  # with tensor parallelism, every number is one rank's
        self.chain = find_chain(model)
        self.cache: dict[tuple[tuple[int, ...], Optional[int]], Sample] = {}
        self.tick = tick

    def shape(self, point: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(self.base)
        for d, v in zip(self.dims, point):
            shape[d] = v
        return tuple(shape)

    def __call__(self, point: tuple[int, ...], depth: Optional[int] = None) -> Sample:
        key = (point, depth)
        if key not in self.cache:
            shape = self.shape(point)
            with truncated(self.model, self.chain, depth):
                full = depth is None or (self.chain is not None and depth >= self.chain.length)
                g = self.graph_at(shape, full)  # at full depth, a deep chain: 5 blocks captured, checked
            sv = saved(g)
            block = 0
            if self.chain is not None:
                path = f"{self.chain.path}.1" if self.chain.path else "1"
                block = next((m.activation_bytes for m in sv.modules if m.path == path), 0)
            lv = liveness(g)
            activation, peak, timeline = sv.activation_bytes, lv.peak_bytes, lv.timeline
            if self.parallel.tp > 1:  # one rank's: what tensor (and sequence) parallelism splits, passes/budget.py
                rank = budget(g, lv, sv, self.parallel)
                activation = next(r.size for r in rank.rows if r.name == "activations")
                peak, timeline = rank.peak_bytes, rank.timeline
            self.cache[key] = Sample(activation, peak, block, timeline, tuple(n.target for n in g.ops), (g, sv))
            self.tick()
        return self.cache[key]
