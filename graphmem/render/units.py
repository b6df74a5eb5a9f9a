"""Human units for text output only (JSON keeps exact integers)."""
from __future__ import annotations

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def fmt_bytes(n: int) -> str:
    """1536 -> '1.50 KiB'; exact below 1 KiB."""
    if abs(n) < 1024:
        return f"{n} B"
    x = float(n)
    for unit in _UNITS:
        if abs(x) < 1024 or unit == _UNITS[-1]:
            return f"{x:.2f} {unit}"
        x /= 1024
    raise AssertionError("unreachable")


def fmt_share(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"
