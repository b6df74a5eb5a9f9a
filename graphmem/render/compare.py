"""Comparison -> text (``graphmem compare a.json b.json``)."""
from __future__ import annotations

from tabulate import tabulate

from graphmem.render.text import ROOT
from graphmem.report.compare import Comparison, SavedGroup
from graphmem.units import fmt_bytes


def _signed(n: int) -> str:
    return ("+" if n > 0 else "") + fmt_bytes(n)


def _change(before: int, after: int) -> list[str]:
    delta = after - before
    if not delta:
        return ["", ""]
    share = f"{100.0 * delta / before:+.1f}%" if before else "new"
    return [_signed(delta), f"{delta:+,} B  {share}"]


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _saved_table(title: str, groups: tuple[SavedGroup, ...], top: int) -> list[str]:
    if not groups:
        return []
    counted = any(g.count > 1 for g in groups)  # the count and total columns only when some identity repeats
    rows = [[g.op, g.module or ROOT, "x".join(map(str, g.shape)) or "scalar", g.dtype, g.category, fmt_bytes(g.bytes)]
            + ([f"×{g.count}", fmt_bytes(g.total)] if counted else []) for g in groups[:top]]
    headers = ["op", "module", "shape", "dtype", "category", "bytes"] + (["count", "total"] if counted else [])
    n = sum(g.count for g in groups)
    return ["", f"{title}: {_plural(n, 'tensor')}, {fmt_bytes(sum(g.total for g in groups))}"
                + (f" (top {top} rows of {len(groups)})" if len(groups) > top else ""),
            tabulate(rows, headers=headers, tablefmt="simple", colalign=("left",) * 5 + ("right",) * (len(headers) - 5))]


def _setup(c: Comparison) -> list[str]:
    """How the two steps were set up: what both share on one line, what differs in a table."""
    same = " · ".join(f"{what} {a}" for what, a, b in c.context if a == b)
    differ = [[what, a, b] for what, a, b in c.context if a != b]
    lines = [same] if same else []
    if differ:
        lines += ["", tabulate(differ, headers=["set up differently", c.before, c.after], tablefmt="simple",
                               disable_numparse=True)]
    return lines


def render_comparison(c: Comparison, top: int = 10, depth: int = 3) -> str:
    """``depth``: the module table's depth, as ``graphmem analyze --depth`` (the root and the
    changed modules above it)."""
    lines = [f"graphmem compare · {c.before} → {c.after}"] + _setup(c)
    rows = [[t.name, fmt_bytes(t.before) if t.shown[0] else "-", fmt_bytes(t.after) if t.shown[1] else "-",
             *(_change(t.before, t.after) if all(t.shown) else ["", ""])] for t in c.totals]
    lines += ["", tabulate(rows, headers=["", c.before, c.after, "change", "exact change"], tablefmt="simple",
                           colalign=("left", "right", "right", "right", "left"))]
    lines.append(f"peak at: {c.peak_at[0]}" if c.peak_at[0] == c.peak_at[1]
                 else f"peak at: {c.peak_at[0]} → {c.peak_at[1]}")

    shown = [m for m in c.modules if not m.name or m.name.count(".") < depth]
    if shown:
        rows = [["  " * (m.name.count(".") + 1 if m.name else 0) + (m.name or ROOT), fmt_bytes(m.before),
                 fmt_bytes(m.after), _signed(m.delta)] for m in shown]
        lines += ["", f"Saved for backward by module ({len(c.modules)} changed; depth ≤ {depth})",
                  tabulate(rows, headers=["module", c.before, c.after, "change"], tablefmt="simple",
                           colalign=("left", "right", "right", "right"), preserve_whitespace=True)]
    else:
        lines += ["", "Saved for backward by module: no change"]
    lines += _saved_table(f"Saved only in {c.after}", c.added, top)
    lines += _saved_table(f"Saved only in {c.before}", c.removed, top)
    if not c.added and not c.removed:
        lines += ["", "Saved tensors: the same in both"]
    return "\n".join(lines) + "\n"
