"""Piecewise formulas: one exact polynomial per range of the sequence length, where a model
switches code paths at a size it was configured with.

Sliding-window attention (Mistral, Qwen2 and Gemma's local layers, ``config.sliding_window``):
below the window every query sees every earlier key, so transformers runs plain causal
attention; from the window on it builds the sliding-window mask, and the step's bytes follow a
second polynomial. graphmem fits each piece as ``graphmem/formula/fit.py`` fits one (degrees,
interpolation, held-out captures, all inside the piece), names the breakpoint, and answers
``formula``, ``fit`` and ``sweep`` from the piece that holds at each size.

Known limitations: one breakpoint, in ``s``, read from the configuration (``sliding_window``);
the lower piece needs 5 sizes in [3, window - 1] (a window of at least 8); other switches
(padding to a multiple, size-dependent kernels) still get "not a polynomial".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch.nn as nn

from graphmem.formula.coefficients import MIN_SIZE, Coefficients, NotPolynomialError
from graphmem.formula.fit import PROBES, fit


def window_of(model: nn.Module) -> Optional[int]:
    """The sliding window a model's configuration declares (transformers: ``config.sliding_window``)."""
    for m in model.modules():
        w = getattr(getattr(m, "config", None), "sliding_window", None)
        if isinstance(w, int) and not isinstance(w, bool) and w > 0:
            return w
    return None


class _Peak:
    """``PeakModel.at`` over the pieces, for graphmem.formula.largest_fitting."""

    def __init__(self, owner: "PiecewiseCoefficients") -> None:
        self.owner = owner

    def at(self, point: tuple[int, ...]) -> tuple[int, int]:
        piece = self.owner.piece_at(point)
        if piece.peak is None:
            raise NotPolynomialError(piece.peak_note)
        return piece.peak.at(point)


@dataclass(frozen=True)
class PiecewiseCoefficients:
    """Two exact formulas split at ``breakpoint`` in ``variables[index]``: ``below`` holds for
    MIN_SIZE <= s < breakpoint, ``above`` for s >= breakpoint."""

    variables: tuple[str, ...]
    dims: tuple[int, ...]
    base_shape: tuple[int, ...]
    index: int  # which variable is split (s)
    breakpoint: int
    why: str
    below: Coefficients
    above: Coefficients

    @property
    def steps(self) -> tuple[int, ...]:
        return self.above.steps

    @property
    def peak(self) -> Optional[_Peak]:
        return _Peak(self) if self.below.peak is not None and self.above.peak is not None else None

    @property
    def peak_note(self) -> str:
        return self.below.peak_note or self.above.peak_note

    def point(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(shape[d] for d in self.dims)

    def piece_at(self, point: tuple[int, ...]) -> Coefficients:
        return self.below if point[self.index] < self.breakpoint else self.above

    def piece(self, shape: tuple[int, ...]) -> Coefficients:
        return self.piece_at(self.point(shape))

    def covers(self, shape: tuple[int, ...]) -> bool:
        return self.piece(shape).covers(shape)

    def activation_at(self, shape: tuple[int, ...]) -> int:
        return self.piece(shape).activation_at(shape)

    def peak_at(self, shape: tuple[int, ...]) -> int:
        return self.piece(shape).peak_at(shape)

    def to_dict(self) -> dict[str, Any]:
        name = self.variables[self.index]
        return {"piecewise": {"variable": name, "breakpoint": self.breakpoint, "why": self.why,
                              "pieces": [{"range": f"{MIN_SIZE} <= {name} < {self.breakpoint}", **self.below.to_dict()},
                                         {"range": f"{name} >= {self.breakpoint}", **self.above.to_dict()}]}}


def fit_windowed(sampler_for: Callable[[tuple[int, ...]], Any], names: tuple[str, ...], dims: tuple[int, ...],
                 base: tuple[int, ...], window: int, checks: int = 5, **kwargs: Any) -> PiecewiseCoefficients:
    """Fit the two pieces around a sliding window ``window`` in ``s`` (``sampler_for(base_shape)``
    makes a graphmem.formula.Sampler around another base shape, varying ``dims``)."""
    if "s" not in names:
        raise NotPolynomialError("the bytes are not one polynomial, and the input has no sequence length to split")
    index = names.index("s")
    dim = dims[index]
    if window - 1 - (PROBES - 1) < MIN_SIZE:
        raise NotPolynomialError(f"the sliding window ({window}) is too short to fit a formula below it "
                                 f"(needs {PROBES} sizes in [{MIN_SIZE}, {window - 1}]); analyze each size instead")
    low_base = list(base)
    low_base[dim] = window - 1
    high_base = list(base)
    high_base[dim] = max(base[dim], window + PROBES - 1)
    why = (f"sliding_window = {window} (the model's config): for s < {window} attention is causal over all "
           f"earlier tokens; from s = {window} on, through the window")
    try:
        below = fit(sampler_for(tuple(low_base)), names, checks=checks, bounds={index: (MIN_SIZE, window - 1)}, **kwargs)
        above = fit(sampler_for(tuple(high_base)), names, checks=checks, bounds={index: (window, None)}, **kwargs)
    except NotPolynomialError as e:
        raise NotPolynomialError(f"not one polynomial, nor one on each side of the sliding window ({window}): {e}") from e
    return PiecewiseCoefficients(names, dims, base, index, window, why, below, above)
