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
from fractions import Fraction
from typing import Callable, Optional, Union

import sympy
import torch.nn as nn

from graphmem.chains import Chain
from graphmem.formula.coefficients import MIN_SIZE, Coefficients, NotPolynomialError, Piece
from graphmem.formula.fit import PROBES, fit
from graphmem.formula.sampler import Sampler
from graphmem.jsontypes import JSON
from graphmem.passes.coefficients import BlockSplit, PeakModel


def window_of(model: nn.Module) -> Optional[int]:
    """The sliding window a model's configuration declares (transformers: ``config.sliding_window``)."""
    for m in model.modules():
        w = getattr(getattr(m, "config", None), "sliding_window", None)
        if isinstance(w, int) and not isinstance(w, bool) and w > 0:
            return w
    return None


@dataclass(frozen=True)
class PiecewiseCoefficients:
    """Two exact formulas split at ``breakpoint`` in ``variables[index]``: ``below`` holds for
    MIN_SIZE <= s < breakpoint, ``above`` for s >= breakpoint.

    It answers as a graphmem.formula.Coefficients does: ``activation``, ``alpha``, ``beta``,
    ``gamma``, ``peak`` and the other fields are those of ``current``, the piece the report's
    input shape (``base_shape``) falls in; ``pieces`` lists every piece with its range;
    ``activation_at`` and ``peak_at`` evaluate the piece that holds at the shape given."""

    variables: tuple[str, ...]
    dims: tuple[int, ...]
    base_shape: tuple[int, ...]
    index: int  # which variable is split (s)
    breakpoint: int
    why: str
    below: Coefficients
    above: Coefficients

    @property
    def pieces(self) -> tuple[Piece, ...]:
        name = self.variables[self.index]
        return (Piece(name, MIN_SIZE, self.breakpoint, self.below), Piece(name, self.breakpoint, None, self.above))

    @property
    def current(self) -> Coefficients:
        """The piece that holds at the report's input shape."""
        return self.piece(self.base_shape)

    @property
    def current_piece(self) -> Piece:
        return next(p for p in self.pieces if p.coefficients is self.current)

    # -- the fields of Coefficients, read from the current piece
    @property
    def steps(self) -> tuple[int, ...]:
        return self.current.steps

    @property
    def activation(self) -> sympy.Expr:
        return self.current.activation

    @property
    def activation_terms(self) -> dict[str, Fraction]:
        return self.current.activation_terms

    @property
    def peak(self) -> Optional[PeakModel]:
        return self.current.peak

    @property
    def peak_terms(self) -> Optional[dict[str, Fraction]]:
        return self.current.peak_terms

    @property
    def peak_note(self) -> str:
        return self.current.peak_note

    @property
    def held_out(self) -> tuple[tuple[tuple[int, ...], int, int], ...]:
        return self.current.held_out

    @property
    def chain(self) -> Optional[Chain]:
        return self.current.chain

    @property
    def blocks(self) -> int:
        return self.current.blocks

    @property
    def block_terms(self) -> dict[str, Fraction]:
        return self.current.block_terms

    @property
    def nonblock_terms(self) -> dict[str, Fraction]:
        return self.current.nonblock_terms

    @property
    def d_model(self) -> Optional[int]:
        return self.current.d_model

    @property
    def n_heads(self) -> Optional[int]:
        return self.current.n_heads

    @property
    def split(self) -> Optional[BlockSplit]:
        return self.current.split

    @property
    def alpha(self) -> Optional[Fraction]:
        return self.current.alpha

    @property
    def beta(self) -> Optional[Fraction]:
        return self.current.beta

    @property
    def gamma(self) -> Optional[Fraction]:
        return self.current.gamma

    @property
    def note(self) -> str:
        return self.current.note

    @property
    def per_rank(self) -> str:
        return self.current.per_rank

    # -- evaluation: the piece that holds at each size
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

    def to_dict(self) -> dict[str, JSON]:
        """The current piece's fields (as Coefficients.to_dict), its range, and every piece."""
        name = self.variables[self.index]
        return {**self.current.to_dict(), "piece": self.current_piece.range,
                "piecewise": {"variable": name, "breakpoint": self.breakpoint, "why": self.why,
                              "pieces": [{"range": p.range, **p.coefficients.to_dict()} for p in self.pieces]}}


AnyCoefficients = Union[Coefficients, PiecewiseCoefficients]


def fit_windowed(sampler_for: Callable[[tuple[int, ...]], Sampler], names: tuple[str, ...], dims: tuple[int, ...],
                 base: tuple[int, ...], window: int, checks: int = 5, d_model: Optional[int] = None,
                 n_heads: Optional[int] = None) -> PiecewiseCoefficients:
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
        below = fit(sampler_for(tuple(low_base)), names, checks=checks, bounds={index: (MIN_SIZE, window - 1)},
                    d_model=d_model, n_heads=n_heads)
        above = fit(sampler_for(tuple(high_base)), names, checks=checks, bounds={index: (window, None)},
                    d_model=d_model, n_heads=n_heads)
    except NotPolynomialError as e:
        raise NotPolynomialError(f"not one polynomial, nor one on each side of the sliding window ({window}): {e}") from e
    return PiecewiseCoefficients(names, dims, base, index, window, why, below, above)
