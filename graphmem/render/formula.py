"""Coefficients / FitAnswer / Sweep -> text."""
from __future__ import annotations

from fractions import Fraction
from typing import TYPE_CHECKING

from tabulate import tabulate

from graphmem.formula.piecewise import PiecewiseCoefficients
from graphmem.passes.run_memory import FIGURE_NAMES
from graphmem.units import fmt_bytes

if TYPE_CHECKING:
    from graphmem.formula import AnyCoefficients, FitAnswer, Sweep


def _q(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


def _poly(terms: dict[str, Fraction]) -> str:
    if not terms:
        return "0"
    parts = []
    for mono, c in terms.items():
        coef = _q(abs(c))
        body = coef if mono == "1" else (mono if abs(c) == 1 else f"{coef}*{mono}")
        parts.append(("- " if c < 0 else "+ ") + body)
    text = " ".join(parts)
    return text[2:] if text.startswith("+ ") else "-" + text[2:]


def render_coefficients(c: AnyCoefficients) -> str:
    if isinstance(c, PiecewiseCoefficients):
        name = c.variables[c.index]
        return (f"Piecewise in {name}, breakpoint {name} = {c.breakpoint}: {c.why}\n"
                f"The input ({name} = {c.point(c.base_shape)[c.index]}) falls in [{c.current_piece.range}]; "
                f"alpha, beta and the formulas read from a report are that piece's\n"
                f"[{name} < {c.breakpoint}] " + render_coefficients(c.below)
                + f"[{name} >= {c.breakpoint}] " + render_coefficients(c.above))
    names = ", ".join(c.variables)
    where = " (polynomial on multiples of " + ", ".join(
        f"{st} in {n}" for n, st in zip(c.variables, c.steps) if st > 1) + ")" if any(st > 1 for st in c.steps) else ""
    checked = ", ".join("(" + ", ".join(map(str, p)) + ")" for p, _, _ in c.held_out)
    lines = [f"Exact activation bytes in {names}{where}; reproduced to the byte by captures at {checked}",
             f"  whole step:   {_poly(c.activation_terms)}"]
    if c.per_rank:
        lines.insert(1, f"  one rank's bytes ({c.per_rank})")
    if c.chain is not None and c.block_terms:
        lines.append(f"  per block ({c.chain.path}, {c.blocks} blocks): {_poly(c.block_terms)}")
        lines.append(f"  outside the blocks: {_poly(c.nonblock_terms)}")
    if c.split is not None:
        sp = c.split
        rest = "".join(f" + {_poly({k: v})}" for k, v in sp.rest.items())
        lines.append(f"  m_act = α·b·s·d_model + β·b·n_heads·s² + γ·b·s{' + …' if sp.rest else ''}"
                     f"   α = {_q(sp.alpha)}, β = {_q(sp.beta)}, γ = {_q(sp.gamma)}, d_model = {c.d_model}, "
                     f"n_heads = {c.n_heads}{rest and ', other: ' + rest[3:]}")
        b, s = c.base_shape[c.dims[0]], c.base_shape[c.dims[1]]
        total = sp.alpha * b * s * c.d_model + sp.beta * b * c.n_heads * s * s + sp.gamma * b * s
        total += sum((v * _mono(k, b, s) for k, v in sp.rest.items()), Fraction(0))
        lines.append(f"  at b={b}, s={s}: {_q(sp.alpha)}·{b}·{s}·{c.d_model} + {_q(sp.beta)}·{b}·{c.n_heads}·{s}² + "
                     f"{_q(sp.gamma)}·{b}·{s}{' + …' if sp.rest else ''} = {_q(total)} B ({fmt_bytes(int(total))}) per block")
    if c.peak is not None:
        lines.append(f"  peak:         exact as the largest of {len(c.peak.rows)} per-op polynomials; "
                     f"at the base shape: {_poly(c.peak_terms or {})}")
    else:
        lines.append(f"  peak:         no formula: {c.peak_note}")
    if c.note:
        lines.append(f"  note: {c.note}")
    return "\n".join(lines) + "\n"


def _mono(name: str, b: int, s: int) -> int:
    value = 1
    for part in name.split("*") if name != "1" else []:
        if not part:
            continue
        var, _, exp = part.partition("**") if "**" in part else (part, "", "1")
        value *= {"b": b, "s": s}.get(var, 1) ** int(exp or 1)
    return value


def render_fit(a: FitAnswer) -> str:
    fixed = ", ".join(f"{k}={v}" for k, v in a.fixed.items())
    what = "batch size" if a.variable == "b" else "sequence length"
    rows = [[f"{a.variable}={a.value}", fmt_bytes(a.peak_at_value) if a.peak_at_value is not None else "-",
             fmt_bytes(a.captured_at_value) if a.captured_at_value is not None else "-", "fits"],
            [f"{a.variable}={a.value + 1}", fmt_bytes(a.peak_above),
             fmt_bytes(a.captured_above) if a.captured_above is not None else "model refuses",
             "does not fit" if a.peak_above > a.memory else "fits, but the model refuses it"]]
    head = (f"Largest {what} that fits in {fmt_bytes(a.memory)}" + (f" ({fixed})" if fixed else "") + f": {a.value}")
    head += f" ({a.limit})" if a.limit else ""
    if a.figure:
        above = fmt_bytes(a.figure_above) if a.figure_above is not None else "model refuses"
        at = fmt_bytes(a.figure_bytes) if a.figure_bytes is not None else "-"
        head = (f"Largest {what} whose {FIGURE_NAMES[a.figure]} fits in {fmt_bytes(a.memory)}"
                + (f" ({fixed})" if fixed else "") + f": {a.value} (compared: the {FIGURE_NAMES[a.figure]}, "
                f"captured: {at} at {a.variable}={a.value}, {above} at {a.variable}={a.value + 1})\n"
                f"the first step's tensors alone (the formula) would allow {a.variable}={a.tensors_value}")
        head += f" ({a.limit})" if a.limit else ""
    return head + "\n\n" + tabulate(rows, headers=["", "predicted peak", "captured peak", ""], tablefmt="simple") + "\n"


def render_sweep(sw: Sweep) -> str:
    rows = [[b, s, fmt_bytes(act), fmt_bytes(peak) if peak is not None else "-",
             ("captured: " + ("same" if (cact, cpeak) == (act, peak) else f"{cact} / {cpeak}")) if cact is not None else ""]
            for b, s, act, peak, cact, cpeak in sw.rows]
    return ("Activation and peak bytes from the exact formulas\n\n"
            + tabulate(rows, headers=["batch", "seq", "activations", "peak", "check"], tablefmt="simple") + "\n")
