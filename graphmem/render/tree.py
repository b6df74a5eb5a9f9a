"""Report -> the module tree of saved-for-backward bytes (``graphmem analyze --tree``).

Each row is a module with the bytes saved in its subtree, its share of all activation bytes,
the bytes its own ops saved (``self``) and how many saved tensors the subtree holds. Modules
that save nothing are left out, as in the text report's module table; ``depth`` counts levels
below the model, and deeper modules are folded into their displayed ancestor. Runs of identical
sibling blocks are one row (graphmem/render/collapse.py) unless ``expand``.
"""
from __future__ import annotations

from tabulate import tabulate

from graphmem.render.collapse import ModuleRow, each, label
from graphmem.render.text import ROOT, _scope, _shapes, _shown_modules
from graphmem.report import Report
from graphmem.units import fmt_bytes, fmt_share


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def _rows(report: Report, depth: int, expand: bool) -> list[list[object]]:
    shown = _shown_modules(report, depth, expand)
    children: dict[str, list[ModuleRow]] = {}
    for m in shown:
        if m.path:
            children.setdefault(_parent(m.path), []).append(m)
    total = report.activation_bytes
    rows: list[list[object]] = []

    def walk(m: ModuleRow, lead: str, indent: str) -> None:  # lead: before the name; indent: for children
        name = m.path.rsplit(".", 1)[-1] if m.path else ROOT
        rows.append([lead + label(m, name), each(m, fmt_bytes(m.activation_bytes)), fmt_share(m.activation_bytes, total),
                     fmt_bytes(m.self_bytes), m.count])
        kids = children.get(m.path, [])
        for i, child in enumerate(kids):
            last = i == len(kids) - 1
            walk(child, indent + ("└── " if last else "├── "), indent + ("    " if last else "│   "))

    root = next((m for m in shown if m.path == ""), ModuleRow("", 0, 0, 0))
    walk(root, "", "")
    return rows


def render_tree(report: Report, depth: int = 3, expand: bool = False) -> str:
    """The header, the totals and the module tree, as text."""
    shapes = _shapes(report)
    peak = (f"op {report.peak_index} ({report.peak_phase})" if report.peak_index >= 0 else "before the step")
    lines = [f"graphmem · {report.model} · input {shapes} · target {report.target.describe() if report.target is not None else report.device} · {_scope(report)}",
             f"activations {fmt_bytes(report.activation_bytes)} saved for backward · "
             f"peak {fmt_bytes(report.peak_bytes)} at {peak}",
             "",
             f"Saved for backward by module (depth ≤ {depth})",
             tabulate(_rows(report, depth, expand), headers=["module", "saved", "share", "self", "tensors"],
                      tablefmt="simple", colalign=("left", "right", "right", "right", "right"),
                      preserve_whitespace=True)]
    return "\n".join(lines) + "\n"

