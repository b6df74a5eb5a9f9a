"""Activation and peak bytes over a grid of (batch, seq) from the exact formulas (one piece
each side of a sliding window), the first point spot-checked by a capture."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch.nn as nn

from graphmem.errors import UsageError
from graphmem.formula.coefficients import NotPolynomialError
from graphmem.formula.fit import fit
from graphmem.formula.piecewise import AnyCoefficients, fit_windowed, window_of
from graphmem.formula.sampler import Sampler


class SweepSource(Protocol):
    """What a sweep reads of the step's Recapture (graphmem/step/recapture.py, a layer above)."""

    @property
    def base_shape(self) -> tuple[int, ...]: ...

    @property
    def names(self) -> tuple[str, ...]: ...

    @property
    def module(self) -> nn.Module: ...

    def sampler_for(self, base: tuple[int, ...], dims: tuple[int, ...],
                    tick: Optional[Callable[[], None]] = None) -> Sampler: ...


@dataclass(frozen=True)
class Sweep:
    batches: tuple[int, ...]
    seqs: tuple[int, ...]
    rows: tuple[tuple[int, int, int, Optional[int], Optional[int], Optional[int]], ...]
    # (b, s, activation, peak, captured activation, captured peak): captured only where spot-checked
    coefficients: AnyCoefficients


def sweep(source: SweepSource, batches: list[int], seqs: list[int], tick: Optional[Callable[[], None]] = None) -> Sweep:
    """Activation and peak over the grid from the exact formulas; the first point is captured."""
    if not batches or not seqs or min(batches + seqs) < 1:
        raise UsageError("sweep needs positive batch and sequence lists, e.g. `batch=1,8,32` `seq=512,1024`")
    base = list(source.base_shape)
    if tuple(source.names[:2]) != ("b", "s"):
        raise UsageError(f"sweep varies batch and sequence length, but this model's input {tuple(base)} has "
                         f"no sequence dimension (its sizes are {', '.join(source.names)}); analyze each size instead")
    base[0], base[1] = max(batches), max(seqs)
    sampler = source.sampler_for(tuple(base), (0, 1), tick)
    try:
        coeffs: AnyCoefficients = fit(sampler, ("b", "s"), checks=2)
    except NotPolynomialError:  # one polynomial on each side of a sliding window (graphmem/formula/piecewise.py)
        window = window_of(source.module)
        if window is None:
            raise
        coeffs = fit_windowed(lambda shape: source.sampler_for(shape, (0, 1), tick), ("b", "s"), (0, 1),
                              tuple(base), window, 2)
    rows: list[tuple[int, int, int, Optional[int], Optional[int], Optional[int]]] = []
    for i, (b, s) in enumerate((b, s) for b in batches for s in seqs):
        shape = tuple([b, s] + base[2:])
        if not coeffs.covers(shape):  # too small for the formula: the capture is the answer
            c = sampler((b, s))
            rows.append((b, s, c.activation, c.peak, c.activation, c.peak))
            continue
        peak = coeffs.peak_at(shape) if coeffs.piece(shape).peak is not None else None
        captured = sampler((b, s)) if i == 0 else None
        rows.append((b, s, coeffs.activation_at(shape), peak,
                     captured.activation if captured else None, captured.peak if captured else None))
    return Sweep(tuple(batches), tuple(seqs), tuple(rows), coeffs)
