"""The largest batch or sequence length that fits a memory size, read off the exact peak formula
(graphmem/formula/coefficients.py) and confirmed by captures at the answer and one above.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from graphmem.errors import GraphmemError, UsageError
from graphmem.formula.coefficients import MIN_SIZE, NotPolynomialError
from graphmem.formula.piecewise import AnyCoefficients
from graphmem.formula.sampler import Sampler


@dataclass(frozen=True)
class FitAnswer:
    variable: str  # "b" or "s"
    value: int  # the largest value whose predicted peak fits (0: even 1 does not fit)
    memory: int
    fixed: dict[str, int]
    peak_at_value: Optional[int]  # predicted
    peak_above: int  # predicted at value + 1
    captured_at_value: Optional[int]  # confirmation captures at the full depth
    captured_above: Optional[int]  # None when the model itself refuses value + 1
    limit: str = ""  # set when the model, not the memory, bounds the answer
    # the run's figure the memory was compared with (passes/run_memory.py; "" when the formula's
    # first-step peak answered alone), captured at ``value`` and one above; ``tensors_value``: the
    # largest value the formula's first-step peak alone allows
    figure: str = ""
    figure_bytes: Optional[int] = None
    figure_above: Optional[int] = None
    tensors_value: Optional[int] = None


def largest_fitting(coeffs: AnyCoefficients, sampler: Sampler, memory: int, variable: str,
                    fixed: dict[str, int]) -> FitAnswer:
    """Largest value of ``variable`` (others fixed) whose predicted peak <= memory, exact from
    the peak formula (doubling, then bisection: bytes do not shrink as b or s grow), confirmed
    by captures at the answer and one above."""
    for piece in coeffs.pieces:
        if piece.coefficients.peak is None:
            raise NotPolynomialError(f"cannot answer from a formula: {piece.coefficients.peak_note}")
    names = list(coeffs.variables)
    if variable not in names:
        raise UsageError(f"{variable!r} is not one of the formula's variables {names}")
    base = dict(zip(names, (sampler.base[d] for d in sampler.dims)))
    base.update(fixed)

    def point(v: int) -> tuple[int, ...]:
        return tuple(v if n == variable else base[n] for n in names)

    def predict(v: int) -> int:  # below MIN_SIZE the formula does not hold: capture
        if v < MIN_SIZE:
            return sampler(point(v)).peak
        peak = coeffs.piece_at(point(v)).peak  # the piece that holds there (graphmem/formula/piecewise.py)
        assert peak is not None  # every piece has a peak formula (checked above)
        return peak.at(point(v))[0]

    lo, hi = 0, 1
    while predict(hi) <= memory:
        lo, hi = hi, hi * 2
        if hi > 2**40:
            raise UsageError(f"the predicted peak does not grow with {variable}; nothing bounds it")
    while hi - lo > 1:  # predict(lo) <= memory < predict(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if predict(mid) <= memory else (lo, mid)
    def runs(v: int) -> bool:
        try:
            sampler(point(v))
            return True
        except GraphmemError:
            return False

    limit = ""
    if lo >= 1 and not runs(lo):  # the memory allows more than the model accepts: bisect captures
        good, bad = base[variable], lo
        if not runs(good):
            raise GraphmemError(f"the model does not run at {variable}={good}")
        while bad - good > 1:
            mid = (good + bad) // 2
            good, bad = (mid, bad) if runs(mid) else (good, mid)
        lo, limit = good, f"the model accepts {variable} <= {good}; the memory would allow more"
    at = sampler(point(lo)).peak if lo >= 1 else None
    above = sampler(point(lo + 1)).peak if runs(lo + 1) else None
    if not limit and above is None:
        limit = f"the model accepts {variable} <= {lo}"
    if (at is not None and at != predict(lo)) or (above is not None and above != predict(lo + 1)):
        raise NotPolynomialError(
            f"the peak formula does not hold at {variable}={lo}..{lo + 1} (captured {at} and {above} B, "
            f"predicted {predict(lo) if lo else None} and {predict(lo + 1)} B); use captures")
    return FitAnswer(variable, lo, memory, {n: base[n] for n in names if n != variable},
                     predict(lo) if lo >= 1 else None, predict(lo + 1), at, above, limit)
