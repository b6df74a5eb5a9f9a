"""Exact formulas: polynomials in the input's dimensions fitted from captures at chosen sizes
and the per-block coefficients α/β/γ (what one more block costs) (fit.py; the result type:
coefficients.py), the largest size that fits (largest.py), one polynomial each side of a
sliding window (piecewise.py: the same fields, read from the piece the input falls in, and
``.pieces``), and sweeps over a grid of sizes (sweep.py)."""
from graphmem.formula.coefficients import Coefficients, NotPolynomialError, Piece
from graphmem.formula.largest import FitAnswer, largest_fitting
from graphmem.formula.piecewise import AnyCoefficients, PiecewiseCoefficients
from graphmem.formula.sampler import Sampler
from graphmem.formula.sweep import Sweep, sweep

__all__ = ["AnyCoefficients", "Coefficients", "FitAnswer", "NotPolynomialError", "Piece", "PiecewiseCoefficients", "Sampler", "Sweep", "largest_fitting", "sweep"]
