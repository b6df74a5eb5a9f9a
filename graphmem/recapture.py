"""The live side of a Report: what it needs to capture the same step again (at other input
sizes for formulas and fits, with checkpoint plans applied for the planner), and what those
later questions keep so they are asked once (samplers, planners, kept answers for JSON).

A Report itself is frozen data; everything that captures again goes through this object.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn as nn

from graphmem.capture.target import Target
from graphmem.errors import UsageError
from graphmem.training.loop import TrainStep
from graphmem.training.step import LossFn

if TYPE_CHECKING:
    from graphmem.formula.fit import Sampler


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
    """The analyzed module, how to make inputs of another shape, the loss, the target and the
    training step (``train``: micro-batches, optimizer), as the first capture ran them."""

    def __init__(self, module: nn.Module, make: Any, loss: Optional[LossFn], target: Target,
                 example: tuple, base_shape: tuple[int, ...], train: Optional[TrainStep] = None,
                 reuse: bool = True) -> None:
        self.module, self.make, self.loss, self.target, self.base_shape = module, make, loss, target, base_shape
        self.train = train
        self.reuse = reuse  # depth reuse (graphmem/capture/reuse.py) for captures at full depth
        self.names, self.dims = variables_of(example)
        self._sampler: Optional[Sampler] = None
        self.kept: dict[str, Any] = {}  # answers computed once: planners, kept coefficients and plans

    def sampler_for(self, base: tuple[int, ...], dims: tuple[int, ...], tick: Any = None) -> Sampler:
        """A fresh sampler around another base shape, varying only ``dims``."""
        from graphmem.formula.fit import Sampler  # sympy (0.3 s) is imported only when formulas are asked for

        return Sampler(self.module, self.make, self.loss, base, dims, self.target, tick or (lambda: None))

    def sampler(self, tick: Any = None) -> Sampler:
        """The report's own sampler (kept, so its captures are reused across calls)."""
        if self._sampler is None:
            self._sampler = self.sampler_for(self.base_shape, self.dims)
        if tick is not None:
            self._sampler.tick = tick
        return self._sampler
