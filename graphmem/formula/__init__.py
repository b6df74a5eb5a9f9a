"""Exact formulas: polynomials in the input's dimensions fitted from captures at chosen sizes,
the per-block coefficients α/β/γ, sweeps and the largest size that fits (fit.py)."""
from graphmem.formula.fit import Coefficients, FitAnswer, NotPolynomialError, Sampler, Sweep, largest_fitting, sweep

__all__ = ["Coefficients", "FitAnswer", "NotPolynomialError", "Sampler", "Sweep", "largest_fitting", "sweep"]
