"""Report -> GitHub-flavoured Markdown (``graphmem analyze --format markdown``): the text report's
sections as pipe tables, for a pull-request comment or a CI job summary. Bytes are shown in
human units with the exact count beside the totals."""
from __future__ import annotations

from typing import Sequence

from tabulate import tabulate

from graphmem.render.collapse import each, label
from graphmem.render.formula import render_coefficients
from graphmem.render.text import _lifetime, _module, _shapes, _shown_modules, op_counts
from graphmem.report import Report
from graphmem.units import fmt_bytes, fmt_share


def _table(rows: Sequence[Sequence[object]], headers: list[str], align: str) -> str:
    """``align``: one letter per column, l or r."""
    cells = [[str(c).replace("|", "\\|") for c in row] for row in rows]
    return tabulate(cells, headers=headers, tablefmt="pipe", disable_numparse=True,
                    colalign=tuple("right" if a == "r" else "left" for a in align))


def _code(text: str) -> str:
    return f"`{text}`"


def _exact(n: int) -> str:
    return f"{n:,} B"


def render_markdown(report: Report, depth: int = 3, top: int = 10, expand: bool = False) -> str:
    shapes = _shapes(report)
    cats = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in report.by_category.items() if v)
    peak = (f"op {report.peak_index} ({report.peak_phase}, {_code(report.peak_op)}, {_module(report.peak_module)})"
            if report.peak_index >= 0 else "before the step")
    summary = [
        ["parameters", fmt_bytes(report.parameter_bytes), _exact(report.parameter_bytes), ""],
        ["buffers", fmt_bytes(report.buffer_bytes), _exact(report.buffer_bytes), ""],
        ["inputs", fmt_bytes(report.input_bytes), _exact(report.input_bytes), ""],
        ["gradients", fmt_bytes(report.gradient_bytes), _exact(report.gradient_bytes), "after backward"],
        ["**activations**", f"**{fmt_bytes(report.activation_bytes)}**", _exact(report.activation_bytes),
         f"saved for backward: {cats}" if cats else "nothing saved"],
        ["**peak**", f"**{fmt_bytes(report.peak_bytes)}**", _exact(report.peak_bytes), peak],
    ]
    out = [f"## graphmem · {report.model} · input {shapes} · target {report.target.describe() if report.target is not None else report.device}", "",
           _table(summary, ["", "bytes", "exact", ""], "lrrl"), "",
           f"ops recorded: {report.num_ops} ({op_counts(report.phase_start, report.num_ops)})"]

    total = report.activation_bytes
    rows = [[label(m, _module(m.path)), each(m, fmt_bytes(m.activation_bytes)),
             fmt_share(m.activation_bytes, total), m.count]
            for m in _shown_modules(report, depth, expand)]
    out += ["", f"### Saved for backward by module (depth ≤ {depth})", "",
            _table(rows, ["module", "saved", "share", "tensors"], "lrrr")]

    rows = [[_code(t.op), _module(t.module, report, t.created), "x".join(map(str, t.shape)) or "scalar", t.dtype,
             fmt_bytes(t.bytes), t.category, _lifetime(report, t.created, t.released)] for t in report.saved[:top]]
    out += ["", f"### Largest saved tensors (top {min(top, len(report.saved))} of {len(report.saved)})", "",
            _table(rows, ["op", "module", "shape", "dtype", "bytes", "category", "lifetime"], "llllrll")]

    rows = [[_code(t.name), t.kind, _module(t.module, report, t.created), "x".join(map(str, t.shape)) or "scalar",
             fmt_bytes(t.nbytes)] for t in report.live_at_peak[:top]]
    out += ["", f"### Live at the peak (top {min(top, len(report.live_at_peak))} of {len(report.live_at_peak)})", "",
            _table(rows, ["tensor", "kind", "module", "shape", "bytes"], "llllr")]
    if report.known_coefficients is not None:
        out += ["", "### Formula", "", "```", render_coefficients(report.known_coefficients).rstrip("\n"), "```"]
    if report.notes:
        out += ["", "### Notes", ""] + [f"- {n}" for n in report.notes]
    return "\n".join(out) + "\n"
