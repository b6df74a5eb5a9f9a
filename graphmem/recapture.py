"""The live side of a Report: what it needs to capture the same step again (at other input
sizes for formulas and fits, with checkpoint plans applied for the planner), and what those
later questions keep so they are asked once (samplers, planners, kept answers for JSON).

A Report itself is frozen data; everything that captures again goes through this object.
"""
from __future__ import annotations

from typing import Any, Optional

import torch.nn as nn

from graphmem.capture.target import Target
from graphmem.formula.fit import Sampler, variables_of
from graphmem.training.loop import TrainStep
from graphmem.training.step import LossFn


class Recapture:
    """The analyzed module, how to make inputs of another shape, the loss, the target and the
    training step (``train``: micro-batches, optimizer), as the first capture ran them."""

    def __init__(self, module: nn.Module, make: Any, loss: Optional[LossFn], target: Target,
                 example: tuple, base_shape: tuple[int, ...], train: Optional[TrainStep] = None) -> None:
        self.module, self.make, self.loss, self.target, self.base_shape = module, make, loss, target, base_shape
        self.train = train
        self.names, self.dims = variables_of(example)
        self._sampler: Optional[Sampler] = None
        self.kept: dict[str, Any] = {}  # answers computed once: planners, kept coefficients and plans

    @property
    def device(self) -> Target:  # the capture's target (named for capture()'s argument)
        return self.target

    def sampler_for(self, base: tuple[int, ...], dims: tuple[int, ...], tick: Any = None) -> Sampler:
        """A fresh sampler around another base shape, varying only ``dims``."""
        return Sampler(self.module, self.make, self.loss, base, dims, self.target, tick or (lambda: None))

    def sampler(self, tick: Any = None) -> Sampler:
        """The report's own sampler (kept, so its captures are reused across calls)."""
        if self._sampler is None:
            self._sampler = self.sampler_for(self.base_shape, self.dims)
        if tick is not None:
            self._sampler.tick = tick
        return self._sampler
