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
from typing import Callable, Mapping, Optional, Union

from graphmem.errors import UsageError
from graphmem.jsontypes import JSON
from graphmem.report import Report

REQUIRED = ("activation_bytes", "peak_bytes", "parameter_bytes", "gradient_bytes", "modules", "saved")
ReportLike = Union[Report, Mapping[str, JSON]]
Figure = Callable[[Report], Optional[int]]

# the figures compared, one line each: (name, the report's figure or None where it has none, shown
# even when equal); a figure that is None on one side counts as 0 there
TOTALS: tuple[tuple[str, Figure, bool], ...] = (
    ("activations", lambda r: r.activation_bytes, True),
    ("peak (run)", lambda r: r.run_peak_bytes, True),
    ("peak (first step)", lambda r: r.peak_bytes, False),
    ("peak (later steps)", lambda r: r.budget.rank.later_peak_bytes if r.budget is not None else None, False),
    ("reserved (run)", lambda r: r.memory.run_max_reserved if r.memory is not None and r.memory.rows else None, False),
    ("device total", lambda r: r.memory.device_total if r.memory is not None and r.memory.rows else None, False),
    ("CUDA max allocated", lambda r: r.cuda_allocator.max_allocated if r.cuda_allocator is not None else None, False),
    ("CUDA max reserved", lambda r: r.cuda_allocator.max_reserved if r.cuda_allocator is not None else None, False),
    ("parameters", lambda r: r.parameter_bytes, True),
    ("gradients", lambda r: r.gradient_bytes, True),
    ("buffers", lambda r: r.buffer_bytes, False),
    ("inputs", lambda r: r.input_bytes, False),
)


@dataclass(frozen=True)
class Change:
    name: str
    before: int
    after: int
    shown: tuple[bool, bool] = (True, True)  # whether each report has the figure (a later-steps peak needs a loop)

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
    context: tuple[tuple[str, str, str], ...]  # (what, before, after): SETUP's rows
    totals: tuple[Change, ...]  # TOTALS order; those not always shown only when they changed
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


def _checked(data: object, label: str) -> dict[str, object]:
    missing = [k for k in REQUIRED if not isinstance(data, dict) or k not in data]
    if missing or not isinstance(data, dict):  # (not a dict: every key missing)
        raise UsageError(f"{label} is not a graphmem JSON report (no {', '.join(missing)}); write one with "
                         "json.dump(report.to_dict(), file) (`json` on the command line)")
    return data


def _as_report(r: ReportLike, label: str) -> Report:
    if isinstance(r, Report):
        return r
    try:
        return Report.from_dict(_checked(dict(r), label))
    except UsageError as e:
        raise UsageError(f"{label} is {str(e)[0].lower()}{str(e)[1:]}") from None


def _saved_counts(r: Report) -> Counter[tuple[str, str, tuple[int, ...], str, str, int]]:
    return Counter((t.op, t.module, tuple(t.shape), t.dtype, t.category, t.bytes) for t in r.saved)


def _groups(counts: Counter[tuple[str, str, tuple[int, ...], str, str, int]]) -> tuple[SavedGroup, ...]:
    groups = [SavedGroup(*key, count=n) for key, n in counts.items() if n > 0]
    return tuple(sorted(groups, key=lambda g: (-g.total, -g.bytes, g.module, g.op)))


def _peak_at(r: Report) -> str:
    if r.peak_index < 0:
        return "before the step"
    return f"op {r.peak_index} ({r.peak_phase}, {r.peak_op}, {r.peak_module or '(model)'})"


def _target(r: Report) -> str:
    t = r.target
    if t is None:
        return r.device
    parts = [t.device + (f" ({t.gpu})" if t.device == "cuda" else "")]
    if t.attention != "auto":
        parts.append(f"attention {t.attention}")
    if t.mode == "compiled":
        parts.append(f"torch.compile ({t.compile_backend}" + (f", activation memory budget {t.memory_budget:g})"
                                                              if t.memory_budget is not None else ")"))
    return ", ".join(parts)


def _precision(r: Report) -> str:
    t = r.target
    if t is None:
        return "-"
    return f"{t.dtype or 'fp32'} parameters" + (f", {t.amp} autocast" if t.amp else "")


def _loop(r: Report) -> str:
    """The loop around forward and backward: optimizer, micro-batches, loop options, adapters."""
    if r.budget is None:
        return "forward and backward, no optimizer step"
    t, device = r.budget.training, r.budget.device
    parts = [t.train.describe(device) or "forward and backward, no optimizer step"]
    if t.quantization is not None:
        parts.append(t.quantization.describe())
    if t.lora is not None:
        parts.append(t.lora.describe())
    return ", ".join(parts)


def _parallel(r: Report) -> str:
    if r.sharding is not None:
        return r.sharding.describe()
    return r.budget.layout.describe() if r.budget is not None else "1 rank"


# how each step was set up, one line each: (what, the report's words for it)
SETUP: tuple[tuple[str, Callable[[Report], str]], ...] = (
    ("model", lambda r: r.model),
    ("input", lambda r: ", ".join("x".join(map(str, s)) for s in r.input_shapes) or "-"),
    ("target", _target),
    ("precision", _precision),
    ("optimizer", lambda r: (r.budget.training.train.optimizer or "none") if r.budget is not None else "none"),
    ("loop", _loop),
    ("parallel", _parallel),
)


def _change(name: str, a: Optional[int], b: Optional[int]) -> Change:
    return Change(name, a or 0, b or 0, (a is not None, b is not None))


def compare(before: ReportLike, after: ReportLike, labels: tuple[str, str] = ("before", "after")) -> Comparison:
    """Compare two reports (Report objects or their JSON dicts).

    >>> import torch, graphmem
    >>> from graphmem.report.compare import compare
    >>> def net(act): return torch.nn.Sequential(torch.nn.Linear(16, 32), act, torch.nn.Linear(32, 4))
    >>> x = (torch.randn(8, 16),)
    >>> c = compare(graphmem.analyze(net(torch.nn.GELU()), x), graphmem.analyze(net(torch.nn.ReLU()), x))
    >>> c.totals[0].delta              # GELU also saves its input, the first Linear's 8x32 output
    -1024
    """
    ra, rb = _as_report(before, labels[0]), _as_report(after, labels[1])
    totals = tuple(_change(name, figure(ra), figure(rb)) for name, figure, always in TOTALS
                   if (always or figure(ra) != figure(rb)) and (figure(ra) is not None or figure(rb) is not None))
    mods_a = {m.path: m.activation_bytes for m in ra.modules}
    mods_b = {m.path: m.activation_bytes for m in rb.modules}
    modules = tuple(Change(p, mods_a.get(p, 0), mods_b.get(p, 0)) for p in dict.fromkeys([*mods_a, *mods_b])
                    if mods_a.get(p, 0) != mods_b.get(p, 0))
    saved_a, saved_b = _saved_counts(ra), _saved_counts(rb)
    context = tuple((what, words(ra), words(rb)) for what, words in SETUP)
    return Comparison(labels[0], labels[1], context, totals, (_peak_at(ra), _peak_at(rb)), modules,
                      added=_groups(saved_b - saved_a), removed=_groups(saved_a - saved_b))
