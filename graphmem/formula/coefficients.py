"""The exact formulas of one model, target and loss (``Coefficients``, fitted by
graphmem/formula/fit.py): the activation and peak polynomials in the input's dimensions, the
per-block terms and alpha/beta/gamma, where they hold (``covers``), and their values.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Optional, Union

import sympy

from graphmem.chains import Chain
from graphmem.errors import GraphmemError
from graphmem.jsontypes import JSON
from graphmem.passes.coefficients import BlockSplit, PeakModel, evaluate

MIN_SIZE = 3  # formulas are fitted and checked for sizes >= 3: PyTorch special-cases sizes 1 and 2
# (a size-1 dim makes reshape a view instead of a copy, e.g. logits[:, :-1] at s = 2); smaller
# sizes are captured instead of read off a formula


class NotPolynomialError(GraphmemError):
    """The bytes are not a polynomial in some input dimension (padding, rounding, branches)."""


@dataclass(frozen=True)
class Piece:
    """One exact formula and where it holds: ``low <= variable < high`` (``high`` None: no
    upper end; ``variable`` None: one polynomial at every size >= MIN_SIZE)."""

    variable: Optional[str]
    low: int
    high: Optional[int]
    coefficients: "Coefficients"

    @property
    def range(self) -> str:
        if self.variable is None:
            return f"every size >= {MIN_SIZE}"
        if self.high is None:
            return f"{self.variable} >= {self.low}"
        return f"{self.low} <= {self.variable} < {self.high}"


@dataclass(frozen=True)
class Coefficients:
    """Exact formulas for one model, target and loss. Polynomials are sympy expressions in
    ``variables`` (``b`` is the batch); ``*_terms`` map monomials to exact coefficients."""

    variables: tuple[str, ...]
    dims: tuple[int, ...]  # which input dimensions the variables are
    base_shape: tuple[int, ...]
    steps: tuple[int, ...]  # a variable with step 32 is polynomial on multiples of 32 only
    activation: sympy.Expr
    activation_terms: dict[str, Fraction]
    peak: Optional[PeakModel]  # exact: the largest of the per-op live-bytes polynomials
    peak_terms: Optional[dict[str, Fraction]]  # the piece that peaks at the base shape
    peak_note: str
    held_out: tuple[tuple[tuple[int, ...], int, int], ...]  # (point, activation, peak) captured
    chain: Optional[Chain]
    block_terms: dict[str, Fraction] = field(default_factory=dict)  # per block
    nonblock_terms: dict[str, Fraction] = field(default_factory=dict)
    d_model: Optional[int] = None
    n_heads: Optional[int] = None
    split: Optional[BlockSplit] = None
    note: str = ""
    per_rank: str = ""  # with tensor parallelism: the parallel layout whose one rank every number is

    @property
    def alpha(self) -> Optional[Fraction]:
        return self.split.alpha if self.split else None

    @property
    def beta(self) -> Optional[Fraction]:
        return self.split.beta if self.split else None

    @property
    def gamma(self) -> Optional[Fraction]:
        return self.split.gamma if self.split else None

    @property
    def blocks(self) -> int:
        return self.chain.length if self.chain else 0

    @property
    def pieces(self) -> tuple[Piece, ...]:
        """The formulas and where each holds: this one, everywhere (a piecewise formula,
        graphmem/formula/piecewise.py, lists one per range)."""
        return (Piece(None, MIN_SIZE, None, self),)

    @property
    def current(self) -> "Coefficients":
        """The piece that holds at the report's input shape: this one."""
        return self

    @property
    def current_piece(self) -> Piece:
        """``current`` with where it holds (everywhere)."""
        return self.pieces[0]

    def piece_at(self, point: tuple[int, ...]) -> "Coefficients":
        """The formula that holds at ``point`` (values of ``variables``): this one."""
        return self

    def piece(self, shape: tuple[int, ...]) -> "Coefficients":
        return self

    def _symbols(self) -> list[sympy.Symbol]:
        return [sympy.Symbol(v) for v in self.variables]

    def point(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(shape[d] for d in self.dims)

    def covers(self, shape: tuple[int, ...]) -> bool:
        """Whether the formulas hold at ``shape`` (sizes >= MIN_SIZE, on each variable's lattice)."""
        return all(v >= MIN_SIZE and v % st == 0 for v, st in zip(self.point(shape), self.steps))

    def activation_at(self, shape: tuple[int, ...]) -> int:
        return _exact_int(evaluate(self.activation, self._symbols(), self.point(shape)))

    def peak_at(self, shape: tuple[int, ...]) -> int:
        if self.peak is None:
            raise NotPolynomialError(self.peak_note)
        return self.peak.at(self.point(shape))[0]

    def to_dict(self) -> dict[str, JSON]:
        q = _jsonable
        return {
            "variables": list(self.variables), "dims": list(self.dims), "steps": list(self.steps),
            "activation": str(self.activation), "activation_terms": {k: q(v) for k, v in self.activation_terms.items()},
            "peak": (str(self.peak.polynomial(self.peak.at(self.point(self.base_shape))[1]))
                     if self.peak is not None else None),
            "peak_pieces": len(self.peak.rows) if self.peak is not None else 0,
            "peak_terms": {k: q(v) for k, v in self.peak_terms.items()} if self.peak_terms else None,
            "peak_note": self.peak_note,
            "alpha": q(self.alpha), "beta": q(self.beta), "gamma": q(self.gamma),
            "d_model": self.d_model, "n_heads": self.n_heads, "blocks": self.blocks,
            "block_path": self.chain.path if self.chain else None,
            "block_terms": {k: q(v) for k, v in self.block_terms.items()},
            "nonblock_terms": {k: q(v) for k, v in self.nonblock_terms.items()},
            "held_out": [{"point": list(p), "activation_bytes": a, "peak_bytes": pk} for p, a, pk in self.held_out],
            "note": self.note, "per_rank": self.per_rank or None,
        }


def _jsonable(x: Optional[Fraction]) -> Union[int, str, None]:
    if x is None:
        return None
    return int(x) if x.denominator == 1 else str(x)


def _exact_int(x: Fraction) -> int:
    if x.denominator != 1:
        raise NotPolynomialError(f"the formula gives a non-integer byte count {x} here: outside where it holds")
    return int(x)
