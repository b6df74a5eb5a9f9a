"""A validation's result (graphmem/validation/validate.py runs the step): each compared quantity
as a ``Row`` with its rule, and the verdicts: saved and before-step bytes must match exactly; the
peak may be below the measured one by at most the tolerance and is never above it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

from graphmem.errors import GraphmemError, UsageError
from graphmem.report.live import Analysis

DEFAULT_TOLERANCE = 1.0  # percent of the measured peak
NO_GPU = "no GPU on this machine; validate --device cpu here, or run on a GPU host"


def checked_tolerance(tolerance: object) -> float:
    """validate's ``tolerance`` as a percentage (``DEFAULT_TOLERANCE`` when None); anything else refused in one line."""
    try:
        tol = DEFAULT_TOLERANCE if tolerance is None else float(tolerance)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        tol = math.nan
    if not math.isfinite(tol) or tol < 0:
        raise UsageError(f"invalid tolerance {tolerance!r}: expected a percentage >= 0, e.g. 1 or 2.5")
    return tol


class ValidationError(GraphmemError):
    """The real run disagrees with the prediction (exit code 1)."""

    exit_code = 1


@dataclass(frozen=True)
class Row:
    """One compared quantity. ``rule``: "exact", "tolerance" or "info" (no verdict); ``rank``: the
    gloo rank it was measured on (a per-rank validation, graphmem/validation/ranks.py), else None."""

    name: str
    predicted: int
    measured: int
    rule: str
    ok: Optional[bool]  # None for "info"
    rank: Optional[int] = None

    @property
    def difference(self) -> int:
        return self.predicted - self.measured  # negative: the prediction is below the real run

    @property
    def percent(self) -> Optional[float]:
        return 100.0 * self.difference / self.measured if self.measured else None


@dataclass(frozen=True)
class Validation:
    """Predicted vs measured for one real step. ``ok``: every row with a verdict passed;
    ``reason``: one line naming the first failure ("" when ok); ``check()`` raises it."""

    model: str
    device: str
    input_shapes: tuple[tuple[int, ...], ...]
    tolerance: float  # percent
    rows: tuple[Row, ...]
    reason: str
    report: Optional[Analysis] = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return not self.reason

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks the rows were measured on (a per-rank validation); () for one device's step."""
        return tuple(dict.fromkeys(r.rank for r in self.rows if r.rank is not None))

    def row(self, name: str, rank: Optional[int] = None) -> Row:
        return next(r for r in self.rows if r.name == name and (rank is None or r.rank == rank))

    def check(self) -> None:
        """Raise ValidationError (exit code 1 in the CLI) when outside the tolerance."""
        if self.reason:
            raise ValidationError(self.reason)

    def to_dict(self) -> dict[str, object]:
        return {"model": self.model, "device": self.device, "input_shapes": [list(s) for s in self.input_shapes],
                "tolerance_percent": self.tolerance, "ok": self.ok, "reason": self.reason,
                "rows": [{"name": r.name, **({"rank": r.rank} if r.rank is not None else {}), "predicted": r.predicted,
                          "measured": r.measured, "difference": r.difference, "percent": r.percent, "rule": r.rule,
                          "ok": r.ok} for r in self.rows]}

def judge(rows: tuple[Row, ...], tol: float, hint: str = "") -> tuple[tuple[Row, ...], str]:
    """Each row with its verdict, and one line naming the first failure ("" when all pass);
    ``hint`` ends a peak failure's line."""
    judged, reason = [], ""
    for r in rows:
        ok, why = _verdict(r, tol, hint)
        judged.append(replace(r, ok=ok))
        reason = reason or why
    return tuple(judged), reason


def _verdict(r: Row, tol: float, hint: str) -> tuple[Optional[bool], str]:
    d = r.difference
    if r.rule == "info":
        return None, ""
    if r.rule == "exact":
        return d == 0, "" if d == 0 else (f"{_named(r)}: predicted {r.predicted:,} B, measured {r.measured:,} B ({d:+,} B); "
                                          "these must match exactly (a graphmem bug: please report it with the --json output)")
    if d > 0:
        return False, (f"{_named(r)}: predicted {r.predicted:,} B is above the measured {r.measured:,} B by {d:,} B; "
                       "graphmem counts memory the real step never allocates (a graphmem bug: please report it)")
    if -d <= tol / 100.0 * r.measured:
        return True, ""
    return False, (f"{_named(r)}: predicted {r.predicted:,} B is {-(r.percent or 0.0):.3f} % below the measured "
                   f"{r.measured:,} B, outside the {tol:g} % tolerance{hint}")


def _named(r: Row) -> str:
    return r.name if r.rank is None else f"rank {r.rank}'s {r.name}"
