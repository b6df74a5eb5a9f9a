"""Exact formulas: polynomials in the input's dimensions fitted from captures at chosen sizes,
the per-block coefficients α/β/γ (what one more block costs), the largest size that fits
(fit.py), one polynomial each side of a sliding window (piecewise.py), and sweeps over a grid
of sizes (sweep.py)."""
from graphmem.formula.fit import Coefficients, FitAnswer, NotPolynomialError, Sampler, largest_fitting
from graphmem.formula.sweep import Sweep, sweep

__all__ = ["Coefficients", "FitAnswer", "NotPolynomialError", "Sampler", "Sweep", "largest_fitting", "sweep"]
