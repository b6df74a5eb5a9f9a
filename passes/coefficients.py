"""Exact polynomials from exact samples, and the per-block alpha/beta/gamma split.

Pure functions (no capture): the driver (graphmem/formula/fit.py) feeds them byte counts measured
by captures at chosen input sizes. Everything is exact rational arithmetic (sympy).
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from itertools import product
from typing import Mapping, Optional, Sequence

import sympy

MAX_DEGREE = 3


def degree_of(values: Sequence[int]) -> Optional[int]:
    """Degree of the polynomial through equally spaced samples, from finite differences;
    None if the samples are not a polynomial of degree <= len(values) - 2 (one sample is
    kept back as the check)."""
    diffs = list(values)
    for degree in range(len(values) - 1):
        if len(set(diffs)) == 1:  # the degree-th differences are constant (checked on >= 2)
            return degree
        diffs = [b - a for a, b in zip(diffs, diffs[1:])]
    return None


def interpolate(samples: Mapping[tuple[int, ...], int], grids: Sequence[Sequence[int]],
                symbols: Sequence[sympy.Symbol]) -> sympy.Expr:
    """The unique polynomial of degree < len(grid_k) in each variable through the samples on
    the tensor grid (multivariate Lagrange), expanded, with exact rational coefficients."""
    basis = []
    for grid, x in zip(grids, symbols):
        polys = []
        for i, xi in enumerate(grid):
            term = sympy.Integer(1)
            for j, xj in enumerate(grid):
                if j != i:
                    term *= (x - xj) / sympy.Integer(xi - xj)
            polys.append(term)
        basis.append(polys)
    total = sympy.Integer(0)
    for idx in product(*(range(len(g)) for g in grids)):
        point = tuple(g[i] for g, i in zip(grids, idx))
        value = samples[point]
        if value:
            term = sympy.Integer(value)
            for k, i in enumerate(idx):
                term *= basis[k][i]
            total += term
    return sympy.expand(total)


def evaluate(poly: sympy.Expr, symbols: Sequence[sympy.Symbol], point: Sequence[int]) -> Fraction:
    value = poly.subs(dict(zip(symbols, point)))
    return Fraction(int(sympy.numer(value)), int(sympy.denom(value)))


def mismatches(poly: sympy.Expr, symbols: Sequence[sympy.Symbol],
               held_out: Mapping[tuple[int, ...], int]) -> list[tuple[tuple[int, ...], int, Fraction]]:
    """(point, measured, predicted) wherever the polynomial misses a held-out sample."""
    out = []
    for point, measured in held_out.items():
        predicted = evaluate(poly, symbols, point)
        if predicted != measured:
            out.append((point, measured, predicted))
    return out


def terms(poly: sympy.Expr, symbols: Sequence[sympy.Symbol]) -> dict[str, Fraction]:
    """{monomial: coefficient}, monomials written like 'b*s**2', '1' for the constant."""
    out: dict[str, Fraction] = {}
    for monom, coef in sympy.Poly(poly, *symbols).terms():
        name = "*".join(f"{x}**{e}" if e > 1 else str(x) for x, e in zip(symbols, monom) if e) or "1"
        out[name] = Fraction(int(sympy.numer(coef)), int(sympy.denom(coef)))
    return out


@dataclass(frozen=True)
class BlockSplit:
    """m_act = alpha*b*s*d + beta*b*h*s**2 + gamma*b*s + rest, in bytes, for one block."""

    alpha: Fraction
    beta: Fraction
    gamma: Fraction
    rest: dict[str, Fraction]  # the other monomials of the block polynomial


def split_block(block_terms: Mapping[str, Fraction], d_model: int, n_heads: int,
                per_token_not_d: Fraction) -> BlockSplit:
    """Split the block polynomial's b*s coefficient into alpha*d (tensors whose per-token size
    is a multiple of d_model) and gamma (the rest: e.g. LayerNorm's mean/rstd, 8 B a token);
    beta is the b*s**2 coefficient per head. ``per_token_not_d`` (bytes per token of the
    saved tensors whose per-token element count is not a multiple of d_model) comes from the
    saved shapes."""
    bs = Fraction(block_terms.get("b*s", 0))
    bss = Fraction(block_terms.get("b*s**2", 0))
    gamma = Fraction(per_token_not_d)
    rest = {k: Fraction(v) for k, v in block_terms.items() if k not in ("b*s", "b*s**2")}
    return BlockSplit((bs - gamma) / d_model, bss / n_heads, gamma, rest)


class PeakModel:
    """The peak as an exact piecewise polynomial: the live bytes during each op are a
    polynomial in the input sizes (a sum of storage sizes), and the peak is the largest of
    them. Built from the timelines of captures on a grid whose op sequences are identical;
    stored as integer coefficient rows over a monomial basis with one common denominator."""

    def __init__(self, timelines: Mapping[tuple[int, ...], Sequence[int]], grids: Sequence[Sequence[int]],
                 symbols: Sequence[sympy.Symbol]) -> None:
        self.symbols = list(symbols)
        self.exponents = list(product(*(range(len(g)) for g in grids)))  # monomial basis
        # Lagrange basis polynomial of each grid point, as rational coefficient rows
        rows: dict[tuple[int, ...], list[Fraction]] = {}
        for idx in product(*(range(len(g)) for g in grids)):
            point = tuple(g[i] for g, i in zip(grids, idx))
            poly = interpolate({p: int(p == point) for p in product(*grids)}, grids, symbols)
            coeffs = dict(sympy.Poly(poly, *symbols).terms()) if poly != 0 else {}
            rows[point] = [Fraction(int(sympy.numer(c)), int(sympy.denom(c)))
                           for c in (coeffs.get(e, 0) for e in self.exponents)]
        denom = 1
        for row in rows.values():
            for c in row:
                denom = denom * c.denominator // _gcd(denom, c.denominator)
        self.denom = denom
        n = len(next(iter(timelines.values())))
        self.rows = [[0] * len(self.exponents) for _ in range(n)]  # op i -> integer coefficients * denom
        for point, row in rows.items():
            scaled = [int(f * denom) for f in row]
            for i, value in enumerate(timelines[point]):
                if value:
                    r = self.rows[i]
                    for k, coef in enumerate(scaled):
                        if coef:
                            r[k] += value * coef

    def __eq__(self, other: object) -> bool:
        """The same rows over the same basis (a PeakModel read back from JSON equals the fitted one)."""
        return isinstance(other, PeakModel) and (self.symbols, self.exponents, self.denom, self.rows) \
            == (other.symbols, other.exponents, other.denom, other.rows)

    __hash__ = None  # type: ignore[assignment]  # mutable lists inside

    def _monomials(self, point: Sequence[int]) -> list[int]:
        out = []
        for exps in self.exponents:
            m = 1
            for v, e in zip(point, exps):
                m *= v ** e
            out.append(m)
        return out

    def live(self, point: Sequence[int]) -> list[int]:
        """Live bytes during each op at ``point`` (exact)."""
        mono = self._monomials(point)
        out = []
        for r in self.rows:
            total = sum(c * m for c, m in zip(r, mono) if c)
            q, rem = divmod(total, self.denom)
            out.append(q if rem == 0 else -1)  # -1: not an integer here, the fit does not hold
        return out

    def at(self, point: Sequence[int]) -> tuple[int, int]:
        """(peak bytes, op index where it happens) at ``point``."""
        live = self.live(point)
        i = max(range(len(live)), key=live.__getitem__)
        return live[i], i

    def polynomial(self, op: int) -> sympy.Expr:
        """The live-bytes polynomial of one op (the piece of the peak where that op peaks)."""
        expr = sympy.Integer(0)
        for c, exps in zip(self.rows[op], self.exponents):
            if c:
                term = sympy.Rational(c, self.denom)
                for x, e in zip(self.symbols, exps):
                    term *= x ** e
                expr += term
        return expr


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a
