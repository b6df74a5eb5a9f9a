"""The tables of benchmarks/gpu_truth.py (Markdown, printed and written into docs/validation.md)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from gpu_truth_steps import Side

MiB = 1 << 20
SKIPPED = "skipped"


@dataclass
class ZooRow:
    model: str
    variant: str
    predicted: Union[Side, str, None] = None  # a Side, or why there is none (an error, skipped)
    real: Union[Side, str, None] = None  # None: dry run


@dataclass
class AnchorRow:
    source: str
    case: str
    setting: str  # "eager" | "budget 0.5" | "ckpt: after fwd" ...
    expected: Optional[float]  # the test's figure (MiB); None: the test asserts none
    graphmem: Union[float, str, None] = None
    real: Union[float, str, None] = None
    allowance: float = 0.0  # the test's own: 0 (assertEqual on 0.1 MiB) or 1 MiB (FSDP's cmp)
    budget: Optional[float] = None  # test_ac: the activation memory budget (None: eager)

    def verdict(self) -> str:
        if not isinstance(self.graphmem, float):
            return "-" if self.graphmem is None else "error"
        if self.expected is None:
            return "(no figure)"
        value = round(self.graphmem) if self.allowance else self.graphmem  # FSDP's test: whole MiB, +-1
        return "ok" if abs(value - self.expected) <= self.allowance + 1e-9 else "DIFFERS"


@dataclass
class Run:
    title: str
    zoo: list[ZooRow] = field(default_factory=list)
    anchors: list[AnchorRow] = field(default_factory=list)
    timings: list[str] = field(default_factory=list)


def _b(n: int) -> str:
    return f"{n:,}"


def _pct(pred: int, real: int) -> str:
    if real == 0:
        return "0" if pred == 0 else "inf"
    return f"{100 * (pred - real) / real:+.2f} %"


def _cells(row: ZooRow) -> list[str]:
    p, r = row.predicted, row.real
    if not isinstance(p, Side):
        return [row.model, row.variant, "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", _short(p)]
    cells = [row.model, row.variant, f"{p.seconds:.2f}", _b(p.saved)]
    if not isinstance(r, Side):
        note = "dry run" if r is None else _short(r)
        return cells + ["-", "-", _b(p.peak_exact), _b(p.peak_allocated), "-", "-", _b(p.peak_reserved), "-", "-", "-",
                        "; ".join(x for x in (p.note, note) if x)]
    return cells + [_b(r.saved), f"{p.saved - r.saved:+,}", _b(p.peak_exact), _b(p.peak_allocated),
                    _b(r.peak_allocated), _pct(p.peak_allocated, r.peak_allocated), _b(p.peak_reserved),
                    _b(r.peak_reserved), _pct(p.peak_reserved, r.peak_reserved), f"{r.seconds:.2f}", p.note]


def _short(x: object) -> str:
    text = str(x).splitlines()[0] if x else ""
    return text[:140].replace("|", "/")


ZOO_HEAD = ["model", "target", "graphmem s", "saved pred (B)", "saved real (B)", "saved diff (B)", "peak rise exact",
            "alloc rise pred", "alloc rise real", "alloc diff", "reserved rise pred", "reserved rise real",
            "reserved diff", "real s", "notes"]
ANCHOR_HEAD = ["source", "case", "setting", "test asserts (MiB)", "graphmem (MiB)", "real GPU (MiB)", "graphmem vs test"]


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _mib(x: Union[float, str, None]) -> str:
    return "-" if x is None else f"{x:g}" if isinstance(x, float) else _short(x)


def anchor_summary(rows: list[AnchorRow]) -> str:
    done = [r for r in rows if r.expected is not None and isinstance(r.graphmem, float)]
    ok = sum(r.verdict() == "ok" for r in done)
    return f"graphmem reproduces {ok} of {len(done)} published figures" + (
        "" if ok == len(done) else ": " + "; ".join(f"{r.case} {r.setting}: test {r.expected:g}, graphmem "
                                                   f"{r.graphmem:g}" for r in done if r.verdict() != "ok"))


def zoo_summary(rows: list[ZooRow]) -> str:
    pred = [r for r in rows if isinstance(r.predicted, Side)]
    real = [r for r in pred if isinstance(r.real, Side)]
    exact = sum(r.predicted.saved == r.real.saved for r in real)  # type: ignore[union-attr]
    skipped = sum(1 for r in rows if isinstance(r.predicted, str) and r.predicted.startswith(SKIPPED))
    errors = len(rows) - len(pred) - skipped
    text = f"{len(rows)} rows: graphmem side {len(pred)} ran, {errors} errors, {skipped} skipped (time guard)"
    if real:
        text += f"; real side {len(real)} ran, saved bytes exact on {exact} of {len(real)}"
    return text


def markdown(run: Run) -> str:
    parts = [run.title, ""]
    if run.anchors:
        parts += ["PyTorch's own GPU memory tests (their figures, graphmem's CUDA target on fake tensors, and "
                  "on a GPU the test's own measurement): " + anchor_summary(run.anchors) + ".", "",
                  _table(ANCHOR_HEAD, [[r.source, r.case, r.setting, _mib(r.expected), _mib(r.graphmem), _mib(r.real),
                                        r.verdict()] for r in run.anchors]), ""]
    if run.zoo:
        parts += ["The zoo on graphmem's CUDA target" + (" beside real CUDA steps" if any(
            isinstance(r.real, Side) for r in run.zoo) else " (dry: the real side is not run)") + ": "
                  + zoo_summary(run.zoo) + ". Rises are over the bytes allocated/reserved when the step starts.", "",
                  _table(ZOO_HEAD, [_cells(r) for r in run.zoo]), ""]
    if run.timings:
        parts += ["Timings: " + "; ".join(run.timings) + ".", ""]
    return "\n".join(parts)


def write_section(path: Path, kind: str, text: str) -> None:
    """Replace (or append) the section between this kind's markers in ``path``."""
    begin, end = f"<!-- gpu_truth:{kind}:begin -->", f"<!-- gpu_truth:{kind}:end -->"
    old = path.read_text() if path.exists() else ""
    block = f"{begin}\n{text.rstrip()}\n{end}"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    new = pattern.sub(lambda m: block, old) if pattern.search(old) else old.rstrip() + "\n\n" + block + "\n"
    path.write_text(new)
