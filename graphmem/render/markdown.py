"""Report -> GitHub-flavoured Markdown (``graphmem analyze --format markdown``): the text report's
sections as pipe tables, for a pull-request comment or a CI job summary. Bytes are shown in
human units with the exact count beside the totals."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from tabulate import tabulate

from graphmem.render.budget import budget_notes, budget_table, budget_title
from graphmem.render.collapse import each, label
from graphmem.render.compiled import render_modes
from graphmem.render.formula import render_coefficients
from graphmem.render.memory_budget import render_memory_budgets
from graphmem.render.text import _lifetime, _module, _scope, _scratch, _shapes, _shown_modules, op_counts, run_rows
from graphmem.report import Report
from graphmem.units import fmt_bytes, fmt_share

if TYPE_CHECKING:
    from graphmem.training.spec import StepBudget


def _table(rows: Sequence[Sequence[object]], headers: list[str], align: str) -> str:
    """``align``: one letter per column, l or r."""
    cells = [[str(c).replace("|", "\\|") for c in row] for row in rows]
    return tabulate(cells, headers=headers, tablefmt="pipe", disable_numparse=True,
                    colalign=tuple("right" if a == "r" else "left" for a in align))


def _code(text: str) -> str:
    return f"`{text}`"


def _exact(n: int) -> str:
    return f"{n:,} B"


def _summary(report: Report) -> list[list[str]]:
    """The summary table's rows (the text view's, with the exact count beside each): one row a figure."""
    cats = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in report.by_category.items() if v)
    peak = (f"op {report.peak_index} ({report.peak_phase}, {_code(report.peak_op)}, {_module(report.peak_module)})"
            + _scratch(report) if report.peak_index >= 0 else "before the step")
    rows = [
        ["parameters", fmt_bytes(report.parameter_bytes), _exact(report.parameter_bytes), ""],
        ["buffers", fmt_bytes(report.buffer_bytes), _exact(report.buffer_bytes), ""],
        ["inputs", fmt_bytes(report.input_bytes), _exact(report.input_bytes), ""],
        ["gradients", fmt_bytes(report.gradient_bytes), _exact(report.gradient_bytes), "after backward"],
        ["**activations**", f"**{fmt_bytes(report.activation_bytes)}**", _exact(report.activation_bytes),
         f"saved for backward: {cats}" if cats else "nothing saved"],
    ]
    m = report.memory
    values = [report.peak_bytes] if m is None else [m.run_max_allocated, m.run_max_reserved, m.device_total]
    for (name, shown, detail), n in zip(run_rows(report), values):  # the text view's headline, bold
        rows.append([f"**{name}**", f"**{shown}**", _exact(n), detail])
    if m is not None and m.run_max_allocated != report.peak_bytes:
        rows.append(["peak (first step)", fmt_bytes(report.peak_bytes), _exact(report.peak_bytes), peak])
    if report.cuda_allocator is not None:
        a = report.cuda_allocator
        rows.append(["CUDA allocator", fmt_bytes(a.max_allocated), _exact(a.max_allocated),
                     f"max_memory_allocated; reserved {fmt_bytes(a.max_reserved)} ({_exact(a.max_reserved)}), "
                     f"fragmentation at the peak {fmt_bytes(a.fragmentation)} (caching allocator model)"])
    return rows


def render_markdown(report: Report, depth: int = 3, top: int = 10, expand: bool = False) -> str:
    shapes = _shapes(report)
    target = report.target.describe() if report.target is not None else report.device
    out = [f"## graphmem · {report.model} · input {shapes} · target {target}", ""]
    if report.sharding is not None:
        out += [f"{_scope(report)}", ""]
    if report.attention_backends:
        out += ["SDPA kernels: " + ", ".join(f"{_code(k)} × {v}" for k, v in report.attention_backends.items()), ""]
    out += [_table(_summary(report), ["", "bytes", "exact", ""], "lrrl"), "",
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
    out += _sections(report, depth, top)
    if report.budget is not None:
        out += _budget(report.budget)
    if report.notes:
        out += ["", "### Notes", ""] + [f"- {n}" for n in report.notes]
    return "\n".join(out) + "\n"


def _sections(report: Report, depth: int, top: int) -> list[str]:
    """The text view's further sections, each kept as it reads there in a code block."""
    sections = []
    if report.compiled is not None:
        sections.append(("Eager and compiled", render_modes(report.compiled, depth, top)))
    if report.known_memory_budgets is not None:
        sections.append(("Activation memory budgets", render_memory_budgets(report.known_memory_budgets)))
    if report.known_coefficients is not None:
        sections.append(("Formula", render_coefficients(report.known_coefficients)))
    return [line for title, text in sections for line in ("", f"### {title}", "", "```", text.rstrip("\n"), "```")]


def _budget(b: StepBudget) -> list[str]:
    """The training-step table of the text view (graphmem/render/budget.py), as a pipe table, and
    the lines under it as a list (a detail line, indented in the text, nested under its line)."""
    headers, rows = budget_table(b)
    notes = [f"  - {n.strip()}" if n.startswith("  ") else f"- {n}" for n in budget_notes(b)]
    return ["", f"### {budget_title(b)}", "", _table(rows, headers, "l" + "r" * (len(headers) - 2) + "l"), ""] + notes
