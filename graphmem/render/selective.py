"""Selective checkpointing levels as text: each candidate op of the representative block, what
keeping its output costs and saves, and which levels keep it (the rest is recomputed)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from tabulate import tabulate

from graphmem.units import fmt_bytes

if TYPE_CHECKING:
    from graphmem.planning.selective import Levels


def render_levels(levels: Levels, fmt_flops: Callable[[int], str]) -> list[str]:
    """Lines for a graphmem.planning.selective.Levels."""
    names = [p.name for p in levels.policies]
    rows = []
    for o in levels.ops:
        marks = ["keep" if o.key in p.keep else "-" for p in levels.policies]
        rows.append([o.label, "x".join(map(str, o.shape)), fmt_bytes(o.nbytes), fmt_flops(o.flops), *marks,
                     o.why_not or ""])
    headers = ["op (module, op#call)", "output", "bytes", "FLOPs", *names, "not keepable"]
    if not levels.policies:
        title = f"Selective levels: no op of {levels.block} with FLOPs can be kept, so selective plans are plain ones"
    else:
        totals = [levels.kept(p) for p in levels.policies]
        rows.append(["kept per block", "", "", "", *(fmt_bytes(b) for b, _ in totals), ""])
        rows.append(["recompute saved per block", "", "", "", *(fmt_flops(f) for _, f in totals), ""])
        title = (f"Selective levels: ops of {levels.block} with FLOPs, kept ('keep') or recomputed ('-') by each "
                 "level (a checkpointed segment runs plainly or at one level; every other op is recomputed; "
                 "FLOPs by torch.utils.flop_counter, which counts pointwise ops as 0)")
    return ["", title, tabulate(rows, headers=headers, disable_numparse=True)]
