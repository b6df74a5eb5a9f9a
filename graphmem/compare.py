"""What changed between two analyses: totals, per-module saved bytes, and the saved tensors that
appear in only one of them (``graphmem compare a.json b.json``).

Works on the JSON form of a report (``Report.to_dict()``, what ``analyze --json`` prints), so
reports saved by earlier runs or other machines compare as well as fresh ones; a saved file is
read back through ``Report.from_dict`` (``load_json_report``). A saved tensor is
identified by (op, module, shape, dtype, category); the same identity saved n times in one report
and m times in the other counts as |n - m| added or removed tensors.
"""
from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Union

from graphmem.errors import UsageError
from graphmem.report import Report

TOTALS = (("activations", "activation_bytes"), ("peak", "peak_bytes"), ("parameters", "parameter_bytes"),
          ("gradients", "gradient_bytes"), ("buffers", "buffer_bytes"), ("inputs", "input_bytes"))
REQUIRED = ("activation_bytes", "peak_bytes", "parameter_bytes", "gradient_bytes", "modules", "saved")
ReportLike = Union[Report, Mapping[str, Any]]


@dataclass(frozen=True)
class Change:
    name: str
    before: int
    after: int

    @property
    def delta(self) -> int:
        return self.after - self.before


@dataclass(frozen=True)
class SavedGroup:
    """Saved tensors of one identity that only one side has (``count`` of them)."""

    op: str
    module: str
    shape: tuple[int, ...]
    dtype: str
    category: str
    bytes: int  # of one tensor
    count: int

    @property
    def total(self) -> int:
        return self.bytes * self.count


@dataclass(frozen=True)
class Comparison:
    before: str  # labels, e.g. the file names
    after: str
    context: tuple[tuple[str, str, str], ...]  # (what, before, after): model, input, target
    totals: tuple[Change, ...]  # TOTALS order; buffers and inputs only when they changed
    peak_at: tuple[str, str]  # where each peak is
    modules: tuple[Change, ...]  # modules whose saved bytes changed, in module order
    added: tuple[SavedGroup, ...]  # only in ``after``, largest first
    removed: tuple[SavedGroup, ...]  # only in ``before``, largest first


def load_json_report(path: Union[str, "os.PathLike[str]"]) -> Report:
    """Read a report written by ``graphmem analyze ... --json`` (``Report.to_dict()``) back as a
    Report (``Report.from_dict``); UsageError if it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise UsageError(f"no such file: {os.fspath(path)}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{os.fspath(path)} is not a JSON report ({type(e).__name__}: {e}); write one with "
                         "json.dump(report.to_dict(), file) (`json` on the command line)") from None
    _checked(data, os.fspath(path))
    try:
        return Report.from_dict(data)
    except UsageError as e:
        raise UsageError(f"{os.fspath(path)} is {str(e)[0].lower()}{str(e)[1:]}") from None


def _checked(data: Any, label: str) -> dict[str, Any]:
    missing = [k for k in REQUIRED if not isinstance(data, dict) or k not in data]
    if missing:
        raise UsageError(f"{label} is not a graphmem JSON report (no {', '.join(missing)}); write one with "
                         "json.dump(report.to_dict(), file) (`json` on the command line)")
    return data


def _as_dict(r: ReportLike, label: str) -> dict[str, Any]:
    return r.to_dict() if isinstance(r, Report) else _checked(dict(r), label)


def _saved_counts(d: Mapping[str, Any]) -> Counter[tuple[str, str, tuple[int, ...], str, str, int]]:
    return Counter((t["op"], t["module"], tuple(t["shape"]), t["dtype"], t["category"], t["bytes"])
                   for t in d["saved"])


def _groups(counts: Counter[tuple[str, str, tuple[int, ...], str, str, int]]) -> tuple[SavedGroup, ...]:
    groups = [SavedGroup(*key, count=n) for key, n in counts.items() if n > 0]
    return tuple(sorted(groups, key=lambda g: (-g.total, -g.bytes, g.module, g.op)))


def _peak_at(d: Mapping[str, Any]) -> str:
    p = d.get("peak") or {}
    if p.get("index", -1) < 0:
        return "before the step"
    return f"op {p['index']} ({p.get('phase', '?')}, {p.get('op', '?')}, {p.get('module') or '(model)'})"


def _context(a: Mapping[str, Any], b: Mapping[str, Any]) -> tuple[tuple[str, str, str], ...]:
    def shapes(d: Mapping[str, Any]) -> str:
        return ", ".join("x".join(map(str, s)) for s in d.get("input_shapes", [])) or "-"

    def device(d: Mapping[str, Any]) -> str:
        return str((d.get("target") or {}).get("device", "?"))

    return (("model", str(a.get("model", "?")), str(b.get("model", "?"))),
            ("input", shapes(a), shapes(b)), ("target", device(a), device(b)))


def compare(before: ReportLike, after: ReportLike, labels: tuple[str, str] = ("before", "after")) -> Comparison:
    """Compare two reports (Report objects or their JSON dicts).

    >>> import torch, graphmem
    >>> from graphmem.compare import compare
    >>> def net(act): return torch.nn.Sequential(torch.nn.Linear(16, 32), act, torch.nn.Linear(32, 4))
    >>> x = (torch.randn(8, 16),)
    >>> c = compare(graphmem.analyze(net(torch.nn.GELU()), x), graphmem.analyze(net(torch.nn.ReLU()), x))
    >>> c.totals[0].delta              # GELU also saves its input, the first Linear's 8x32 output
    -1024
    """
    a, b = _as_dict(before, labels[0]), _as_dict(after, labels[1])
    totals = tuple(Change(name, int(a.get(key, 0)), int(b.get(key, 0))) for name, key in TOTALS
                   if key in REQUIRED or a.get(key, 0) != b.get(key, 0))
    mods_a = {m["path"]: int(m["activation_bytes"]) for m in a["modules"]}
    mods_b = {m["path"]: int(m["activation_bytes"]) for m in b["modules"]}
    modules = tuple(Change(p, mods_a.get(p, 0), mods_b.get(p, 0)) for p in dict.fromkeys([*mods_a, *mods_b])
                    if mods_a.get(p, 0) != mods_b.get(p, 0))
    saved_a, saved_b = _saved_counts(a), _saved_counts(b)
    return Comparison(labels[0], labels[1], _context(a, b), totals, (_peak_at(a), _peak_at(b)), modules,
                      added=_groups(saved_b - saved_a), removed=_groups(saved_a - saved_b))
