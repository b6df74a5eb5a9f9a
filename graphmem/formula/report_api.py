"""What ``Report.formula``, ``.coefficients``, ``.fit`` and ``.sweep`` run: the report's
model captured again at other input sizes (through its graphmem.step.recapture.Recapture)."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from graphmem.analysis import Analysis
from graphmem.capture.target import memory_limit
from graphmem.errors import GraphmemError, UsageError, no_source
from graphmem.formula.coefficients import NotPolynomialError
from graphmem.formula.fit import fit as fit_formula
from graphmem.formula.largest import FitAnswer, largest_fitting
from graphmem.formula.piecewise import fit_windowed, window_of
from graphmem.formula.sweep import Sweep
from graphmem.formula.sweep import sweep as sweep_formula
from graphmem.noise import quiet  # third-party notes on the captures these answers run (graphmem/noise.py)
from graphmem.passes.run_memory import figure_for, step_memory


def _source(report: Analysis) -> Any:
    if report.source is None:
        raise no_source(report.sharding)
    return report.source


@quiet
def coefficients(report: Analysis) -> Any:
    """The formulas at the defaults, fitted once per report (its Recapture's cache)."""
    cache = _source(report).cache
    if "coefficients" not in cache:
        cache["coefficients"] = formula(report)
    return cache["coefficients"]


@quiet
def formula(report: Analysis, d_model: Optional[int] = None, n_heads: Optional[int] = None, checks: int = 5,
            tick: Any = None) -> Any:
    source = _source(report)
    result: Any  # Coefficients, or PiecewiseCoefficients around a sliding window
    try:
        result = fit_formula(source.sampler(tick), source.names, d_model=d_model, n_heads=n_heads, checks=checks)
    except NotPolynomialError:  # one polynomial on each side of a sliding window?
        window = window_of(source.module)
        if window is None:
            raise
        result = fit_windowed(lambda base: source.sampler_for(base, source.dims, tick), source.names, source.dims,
                              source.base_shape, window, checks, d_model=d_model, n_heads=n_heads)
    return result


@quiet
def fit(report: Analysis, memory: Any, seq: Optional[int] = None, batch: Optional[int] = None,
        tick: Any = None, figure: Optional[str] = None) -> FitAnswer:
    source = _source(report)
    if seq is not None and batch is not None:
        raise UsageError("give seq= (to find the batch) or batch= (to find the sequence length), not both")
    memory_bytes = memory_limit(memory, report.target)
    base = list(source.base_shape)
    if (seq is not None or batch is not None) and tuple(source.names[:2]) != ("b", "s"):
        raise UsageError(f"this model's input {tuple(base)} has no sequence dimension; use fit without seq/batch")
    if batch is None:
        if seq is not None:
            if len(base) < 2:
                raise UsageError("seq= needs a (batch, seq, ...) input")
            base[1] = seq
        sampler, name = source.sampler_for(tuple(base), (0,), tick), "b"
    else:
        if len(base) < 2:
            raise UsageError("batch= needs a (batch, seq, ...) input")
        base[0] = batch
        sampler, name = source.sampler_for(tuple(base), (1,), tick), "s"
    coeffs: Any
    try:
        coeffs = fit_formula(sampler, (name,), checks=0)  # the confirming captures check it
    except NotPolynomialError:
        window = window_of(source.module) if name == "s" else None
        if window is None:
            raise
        coeffs = fit_windowed(lambda b: source.sampler_for(b, (1,), tick), ("s",), (1,), tuple(base), window, 0)
    answer = largest_fitting(coeffs, sampler, memory_bytes, name, {})
    device = report.target.device if report.target is not None else "cpu"
    return judged(report, answer, tuple(base), 0 if name == "b" else 1, figure_for(device, figure))


def judged(report: Analysis, a: FitAnswer, base: tuple[int, ...], dim: int, figure: str) -> FitAnswer:
    """``a`` judged on the run's ``figure`` (passes/run_memory.py): the whole step (its optimizer
    states, the allocator's reserved bytes, the device rows) captured at each value tried; the
    formula's first-step answer bounds it from above, bisected down by captures."""
    source, seen = report.source, {}

    def value_at(v: int) -> Optional[int]:
        if v not in seen:
            shape = list(base)
            shape[dim] = v
            try:
                seen[v] = step_memory(source.capture(tuple(shape)), report.memory.rows, source.parallel).figure(figure)
            except GraphmemError:  # the model refuses the size
                seen[v] = None
        return seen[v]

    def fits(v: int) -> bool:
        got = value_at(v)
        return got is not None and got <= a.memory

    good, bad = 0, a.value + 1
    if a.value >= 1 and fits(a.value):
        good = a.value
    else:
        while bad - good > 1:
            mid = (good + bad) // 2
            good, bad = (mid, bad) if fits(mid) else (good, mid)
    return dataclasses.replace(a, value=good, figure=figure, figure_bytes=value_at(good) if good else None,
                               figure_above=value_at(good + 1), tensors_value=a.value)


@quiet
def sweep(report: Analysis, batches: Any, seqs: Any, tick: Any = None) -> Sweep:
    return sweep_formula(_source(report), list(batches), list(seqs), tick)
