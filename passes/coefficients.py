"""Exact polynomials from exact samples, and the per-block alpha/beta/gamma split.

Pure functions (no capture): the driver (graphmem/formula.py) feeds them byte counts measured
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
