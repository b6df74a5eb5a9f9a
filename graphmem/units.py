"""Byte units, one table: parsing sizes users give ("80GiB", "40GB") and formatting sizes for
text output (JSON keeps exact integers)."""
from __future__ import annotations

import re

from graphmem.errors import UsageError

_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")  # formatting: powers of 1024
_UNITS = {u.lower(): 1024**i for i, u in enumerate(_BINARY)} | {"kb": 10**3, "mb": 10**6, "gb": 10**9,
                                                                 "tb": 10**12, "pb": 10**15}
_NAMES = "B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB (powers of 1024)"
_SIZE = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: "str | int") -> int:
    """``"80GiB"`` -> 85899345920; ``"40GB"`` -> 40000000000; an int is bytes. A string needs its
    unit ("24" could be bytes or GB: refused), and a size must be positive."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise UsageError(f"memory must be positive, got {text}")
        return text
    m = _SIZE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS | {"": 1}:
        raise UsageError(f"invalid memory size {text!r}: expected a number with a unit, e.g. 80GiB, 40GB or 512MiB "
                         f"(units: {_NAMES})")
    number, unit = m.groups()
    if float(number) <= 0:
        raise UsageError(f"invalid memory size {text!r}: it must be positive, e.g. 80GiB or 40GB")
    if not unit:
        raise UsageError(f"invalid memory size {text!r}: no unit; write {number}GB or {number}GiB (units: {_NAMES})")
    return int(float(number) * _UNITS[unit.lower()])


def fmt_bytes(n: int) -> str:
    """1536 -> '1.50 KiB'; exact below 1 KiB."""
    if abs(n) < 1024:
        return f"{n} B"
    x = float(n)
    for unit in _BINARY:
        if abs(x) < 1024 or unit == _BINARY[-1]:
            return f"{x:.2f} {unit}"
        x /= 1024
    raise AssertionError("unreachable")


def fmt_share(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"
