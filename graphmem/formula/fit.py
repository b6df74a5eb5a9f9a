"""Exact activation and peak formulas in the input's dimensions, and per-block alpha/beta/gamma.

How: captures at chosen sizes give exact byte counts; finite differences find each variable's
degree, Lagrange interpolation over a grid gives the exact polynomial, and held-out captures at
the full depth must match it to the byte before anything is printed. A repeated block chain
(a ModuleList of identical children) is captured truncated to 2 and 3 blocks, which is cheap
for deep models: whole(L) = rest + L * block, checked against full-depth captures.

The per-block polynomial and alpha/beta/gamma are the marginal cost of one more block, the
whole step at 3 blocks minus at 2 (a short chain: at L minus at L - 1), as Korthikanti et al.
count (a block's input belongs to the block; tests/formula/test_korthikanti.py). The per-module table
(passes/saved.py) stays module attribution: the bytes made inside each module.

The result type is graphmem/formula/coefficients.py; the largest size that fits a memory, read
off a fitted peak formula, is graphmem/formula/largest.py.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Callable, Optional, cast

import sympy

from graphmem.errors import UsageError
from graphmem.formula.coefficients import MIN_SIZE, Coefficients, NotPolynomialError
from graphmem.formula.sampler import Sample, Sampler
from graphmem.passes import SavedTensor
from graphmem.passes.budget import rank_share
from graphmem.passes.coefficients import (
    PeakModel,
    degree_of,
    interpolate,
    mismatches,
    split_block,
    terms,
)

PROBES = 5  # equally spaced samples per variable to find its degree (<= 3, one kept as a check)
STEPS = (1, 32)  # try consecutive sizes, then multiples of 32 (strided convs and pooling round)
ALPHA_B, ALPHA_S = 11, 13  # primes no bundled width divides: they tell b and s apart in shapes


def _probe_values(base: int, step: int) -> list[int]:
    low = base - (PROBES - 1) * step
    if low >= MIN_SIZE and (step == 1 or low % step == 0):
        return [base - j * step for j in range(PROBES)][::-1]
    start = MIN_SIZE if step == 1 else step
    return [start + j * step for j in range(PROBES)]


def fit(sampler: Sampler, names: tuple[str, ...], d_model: Optional[int] = None,
        n_heads: Optional[int] = None, checks: int = 5,
        bounds: Optional[dict[int, tuple[int, Optional[int]]]] = None) -> Coefficients:
    """Find the exact activation (and peak) polynomial; raise NotPolynomialError if none holds.
    ``bounds`` (variable index -> (lowest, highest or None)) keeps the held-out checks inside
    one piece of a piecewise formula (graphmem/formula/piecewise.py); the probes stay near the base."""
    base_point = tuple(sampler.base[d] for d in sampler.dims)
    chain = sampler.chain if sampler.chain and sampler.chain.length > 3 else None
    k2 = 2 if chain else None
    symbols = [sympy.Symbol(n) for n in names]

    # 1. degree of each variable, at depth 2 when there is a chain
    degrees, steps, grids, peak_degrees = _degrees(sampler, names, base_point, k2)

    # 2. interpolate on the grid (depth 2 and 3 for a chain)
    def poly_of(depth: Optional[int], attr: str, degs: list[int]) -> sympy.Expr:
        sub = [g[: d + 1] for g, d in zip(grids, degs)]
        samples = {p: getattr(sampler(p, depth), attr) for p in _product(sub)}
        return interpolate(samples, sub, symbols)

    act2 = poly_of(k2, "activation", degrees)
    block_poly = sympy.Integer(0)
    if chain:  # what one more block costs: the whole step at 3 blocks minus at 2 (DESIGN.md, alpha/beta/gamma)
        block_poly = sympy.expand(poly_of(3, "activation", degrees) - act2)
        activation = sympy.expand(act2 + (chain.length - 2) * block_poly)
    else:
        activation = act2

    # 3. held-out captures at full depth
    held = _held_out(base_point, steps, grids, checks, bounds or {})
    measured = {p: sampler(p) for p in held}
    _check_held_out(activation, symbols, names, measured)
    peak, peak_note, peak_terms = _peak(sampler, grids, peak_degrees, symbols, measured, base_point)

    # 4. per-block split
    coeffs = dict(
        variables=names, dims=sampler.dims, base_shape=sampler.base, steps=tuple(steps),
        activation=activation, activation_terms=terms(activation, symbols), peak=peak,
        peak_terms=peak_terms, peak_note=peak_note,
        held_out=tuple((p, s.activation, s.peak) for p, s in measured.items()), chain=sampler.chain,
        per_rank=sampler.parallel.describe() if sampler.parallel.tp > 1 else "",
    )
    if sampler.chain is None:
        return Coefficients(**coeffs)
    marginal = chain is not None or sampler.chain.length >= 2
    if chain is None:  # a short chain: the whole step at L blocks minus at L - 1 (one block: its own bytes)
        length = sampler.chain.length
        block_poly = (sympy.expand(activation - poly_of(length - 1, "activation", degrees)) if marginal
                      else poly_of(None, "block", degrees))
    block_terms = terms(block_poly, symbols)
    nonblock = sympy.expand(activation - sampler.chain.length * block_poly)
    coeffs.update(block_terms=block_terms, nonblock_terms=terms(nonblock, symbols))
    if names[:2] != ("b", "s"):
        return Coefficients(**coeffs, note="alpha/beta are defined for (b, s, d_model) token inputs")
    depth = k2 if chain is not None else (sampler.chain.length - 1 if marginal else None)
    d, h, gamma = _block_shapes(sampler, depth, d_model, n_heads, marginal)
    note = ""
    if h is None:
        h, note = 1, "n_heads not found in the attention shapes: beta is per b*s**2 (pass --heads)"
    return Coefficients(**coeffs, d_model=d, n_heads=h, split=split_block(block_terms, d, h, gamma), note=note)


def _peak(sampler: Sampler, grids: list[list[int]], peak_degrees: list[Optional[int]], symbols: list[sympy.Symbol],
          measured: dict, base_point: tuple[int, ...]
          ) -> tuple[Optional[PeakModel], str, Optional[dict[str, Fraction]]]:
    """The peak's model (``peak_model`` below), its note, and its terms at the base point's piece; none where
    some op's live bytes are not a polynomial in the input size."""
    if None in peak_degrees:
        return None, "the live bytes of some op are not a polynomial in the input size; use captures", None
    peak, note = peak_model(sampler, [g[: cast(int, d) + 1] for g, d in zip(grids, peak_degrees)], symbols, measured)
    return peak, note, None if peak is None else terms(peak.polynomial(peak.at(base_point)[1]), symbols)


def _degrees(sampler: Sampler, names: tuple[str, ...], base_point: tuple[int, ...], depth: Optional[int]
             ) -> tuple[list[int], list[int], list[list[int]], list[Optional[int]]]:
    """Per variable, the activation's degree, the probe step that found it (consecutive sizes,
    else multiples of 32), the probed values and the degree of the live-bytes timeline; captures
    at ``depth`` blocks."""
    degrees, steps, grids, peak_degrees = [], [], [], []
    for i, name in enumerate(names):
        for step in STEPS:
            values = _probe_values(base_point[i], step)
            points = [base_point[:i] + (v,) + base_point[i + 1:] for v in values]
            act = [sampler(p, depth).activation for p in points]
            deg = degree_of(act)
            if deg is not None:
                break
        else:
            raise NotPolynomialError(
                f"activation bytes are not a polynomial in {name} (input dimension {sampler.dims[i]}): "
                f"samples at {name}={values} give {act}; the model pads, rounds or branches on it, so "
                "graphmem prints no formula (analyze each size instead)")
        degrees.append(deg)
        steps.append(step)
        grids.append(values)
        peak_degrees.append(_timeline_degree([sampler(p, depth) for p in points]))
    return degrees, steps, grids, peak_degrees


def _check_held_out(activation: sympy.Expr, symbols: list[sympy.Symbol], names: tuple[str, ...],
                    measured: dict[tuple[int, ...], Sample]) -> None:
    """The fitted activation polynomial must give every held-out capture's bytes exactly."""
    bad = mismatches(activation, symbols, {p: s.activation for p, s in measured.items()})
    if bad:
        p, m, pred = bad[0]
        raise NotPolynomialError(
            f"activation bytes are not one polynomial over the sampled range: at {dict(zip(names, p))} "
            f"a capture gives {m} B, the fitted polynomial {pred} B; graphmem prints no formula")


def _timeline_degree(samples: list[Sample]) -> Optional[int]:
    """Highest degree, over ops, of the live bytes along equally spaced samples."""
    if len({s.ops for s in samples}) != 1:
        return None
    worst = 0
    for column in zip(*(s.timeline for s in samples)):
        d = degree_of(column)
        if d is None:
            return None
        worst = max(worst, d)
    return worst


def peak_model(sampler: Sampler, grids: list[list[int]], symbols: list[sympy.Symbol],
               checks: dict[tuple[int, ...], Sample]) -> tuple[Optional[PeakModel], str]:
    """The exact piecewise-polynomial peak from full-depth captures on ``grids``, checked at
    ``checks``; (None, why) when the op sequence changes with the size or a check misses."""
    samples = {p: sampler(p) for p in _product(grids)}
    ops = {s.ops for s in samples.values()} | {s.ops for s in checks.values()}
    if len(ops) > 1:
        return None, "the op sequence changes with the input size, so the peak is not a formula; use captures"
    model = PeakModel({p: s.timeline for p, s in samples.items()}, grids, symbols)
    for p, s in checks.items():
        if model.at(p)[0] != s.peak:
            return None, (f"the peak is not a polynomial per op over the sampled range (at {p}: captured "
                          f"{s.peak} B, formula {model.at(p)[0]} B); use captures")
    return model, ""


def _block_shapes(sampler: Sampler, depth: Optional[int], d_model: Optional[int],
                  n_heads: Optional[int], marginal: bool = True) -> tuple[int, Optional[int], Fraction]:
    """d_model (block input's last dim), n_heads (dim 1 of (b, h, s, ...) tensors the block
    saves) and gamma (bytes per token of saved tensors whose per-token size is not a multiple
    of d_model), read off captures at b=11, s=13: for gamma, what one more block adds (the step
    at ``depth`` + 1 blocks minus at ``depth``), or block 1's own tensors when not ``marginal``."""
    point = (ALPHA_B, ALPHA_S) + tuple(sampler.base[d] for d in sampler.dims[2:])
    g, sv = sampler(point, depth + 1 if marginal and depth is not None else depth).step
    assert sampler.chain is not None  # the caller found the chain
    prefix = f"{sampler.chain.path}.1" if sampler.chain.path else "1"
    block_input = g.module_inputs.get(prefix, ())
    d = d_model or (block_input[-1] if block_input else None)
    if not d:
        raise UsageError("cannot infer d_model from the block's input; pass `d_model`")
    mine = [t for t in sv.tensors if t.module == prefix or t.module.startswith(prefix + ".")]
    heads = [t.shape[1] for t in mine if len(t.shape) == 4 and t.shape[0] == ALPHA_B and t.shape[2] == ALPHA_S]
    h = n_heads or (max(heads) if heads else None)
    if not marginal:
        return d, h, _not_d_per_token(mine, d, rank_share(g, sampler.parallel))
    fg, fewer = sampler(point, depth).step
    return d, h, (_not_d_per_token(list(sv.tensors), d, rank_share(g, sampler.parallel))
                  - _not_d_per_token(list(fewer.tensors), d, rank_share(fg, sampler.parallel)))


def _not_d_per_token(tensors: list[SavedTensor], d: int, share: Callable[[int], Fraction]) -> Fraction:
    """Bytes per token (at b=11, s=13) of the saved tensors whose per-token element count is not
    a multiple of d_model (LayerNorm's mean/rstd, a logsumexp (b, h, s)); one rank's part
    (``share``: under sequence parallelism LayerNorm's statistics are split too)."""
    gamma = Fraction(0)
    per_token = ALPHA_B * ALPHA_S
    itemsize = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "bool": 1, "uint8": 1, "int8": 1}
    for t in tensors:
        if t.bytes % per_token or list(t.shape).count(ALPHA_S) >= 2:
            continue  # not per token (or the s**2 attention tensors: beta)
        elements = t.bytes // per_token // itemsize.get(t.dtype, 1)
        if elements % d:
            gamma += share(t.sid) * (t.bytes // per_token)
    return gamma


def _product(grids: list[list[int]]) -> list[tuple[int, ...]]:
    from itertools import product

    return [tuple(p) for p in product(*grids)]


def _held_out(base: tuple[int, ...], steps: list[int], grids: list[list[int]], n: int,
              bounds: Optional[dict[int, tuple[int, Optional[int]]]] = None) -> list[tuple[int, ...]]:
    """n deterministic pseudo-random points in [MIN_SIZE, max(base, 8)] per variable (on the variable's
    lattice; within ``bounds`` where given), off the fitting grid."""
    import random

    rng = random.Random(20261122)
    out: list[tuple[int, ...]] = []
    ranges = []
    for i, (b, st) in enumerate(zip(base, steps)):
        low, high = MIN_SIZE if st == 1 else st, max(b, 8 * st)
        if bounds and i in bounds:
            lo, hi = bounds[i]
            low, high = max(low, -(-lo // st) * st), high if hi is None else min(high, hi)
        ranges.append((low, max(low, high)))
    for _ in range(100 * n):
        p = tuple(rng.randrange(low, high + 1, st) for (low, high), st in zip(ranges, steps))
        if p not in out and not all(v in g for v, g in zip(p, grids)):
            out.append(p)
        if len(out) == n:
            break
    return out
