"""Module rows for the tables, with runs of identical sibling blocks folded into one row.

Deep models repeat one block: a module table of llama-2-7b at depth 3 would list 32 layers,
each with its children. Consecutive numbered siblings (``layers.0``, ``layers.1``, ...) whose
subtrees save the same bytes, module by module (same relative paths, same saved and self bytes,
same tensor counts), become one row ``layers.0-31 ×32`` whose numbers are one block's ("each");
its children are shown once under it. A block that differs (the first, saving the batch or a
mask) stays its own row, so ``layers.0``, ``layers.1-30 ×30``, ``layers.31`` can appear. The
numbers in the folded rows are the ones every block in the run has, so nothing the table shows
is lost; ``expand=True`` (``--expand``) lists every block. The text, Markdown and tree views
all take their rows from here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from graphmem.passes import ModuleSaved


@dataclass(frozen=True)
class ModuleRow:
    """A module, or (``times`` > 1) a run of identical sibling blocks: bytes are one block's."""

    path: str  # "model.layers.0-31" for a run (and "model.layers.0-31.mlp" below it)
    activation_bytes: int
    self_bytes: int
    count: int
    times: int = 1


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def collapsed(modules: Sequence[ModuleSaved], expand: bool = False) -> list[ModuleRow]:
    """``modules`` (named_modules order, root first) as rows, runs folded unless ``expand``."""
    rows = [ModuleRow(m.path, m.activation_bytes, m.self_bytes, m.count) for m in modules]
    if expand:
        return rows
    subtree: dict[str, list[ModuleSaved]] = {m.path: [] for m in modules}
    children: dict[str, list[str]] = {}
    for m in modules:
        if m.path:
            children.setdefault(_parent(m.path), []).append(m.path)
        p = m.path
        while True:  # every ancestor (and itself) holds it
            if p in subtree:
                subtree[p].append(m)
            if not p:
                break
            p = _parent(p)

    def signature(path: str) -> tuple:
        n = len(path)
        return tuple((m.path[n:], m.activation_bytes, m.self_bytes, m.count) for m in subtree[path])

    renamed: dict[str, tuple[str, int]] = {}  # first block's path -> (run's path, length)
    hidden: set[str] = set()  # later blocks of a run
    for parent, kids in children.items():
        numbered = [k for k in kids if k.rsplit(".", 1)[-1].isdigit()]
        i = 0
        while i < len(numbered):
            j = i + 1
            sig = signature(numbered[i])
            while (j < len(numbered) and signature(numbered[j]) == sig
                   and int(numbered[j].rsplit(".", 1)[-1]) == int(numbered[j - 1].rsplit(".", 1)[-1]) + 1):
                j += 1
            if j - i > 1:
                first, last = numbered[i].rsplit(".", 1)[-1], numbered[j - 1].rsplit(".", 1)[-1]
                renamed[numbered[i]] = (f"{parent + '.' if parent else ''}{first}-{last}", j - i)
                hidden.update(numbered[i + 1:j])
            i = j

    out = []
    for r in rows:
        parts, shown, prefix, times, skip = r.path.split(".") if r.path else [], [], "", 1, False
        for part in parts:  # outer runs first: layers.0-31.experts.0-7 is 32 x 8 blocks
            prefix = f"{prefix}.{part}" if prefix else part
            if prefix in hidden:
                skip = True
                break
            if prefix in renamed:
                name, n = renamed[prefix]
                shown.append(name.rsplit(".", 1)[-1])
                times *= n
            else:
                shown.append(part)
        if not skip:
            out.append(ModuleRow(".".join(shown), r.activation_bytes, r.self_bytes, r.count, times))
    return out


def label(row: ModuleRow, name: str) -> str:
    """``name`` with the run's length (``layers.0-31 ×32``)."""
    return f"{name} ×{row.times}" if row.times > 1 else name


def each(row: ModuleRow, text: str) -> str:
    return f"{text} each" if row.times > 1 else text
