"""The eager-vs-compiled section of the text report (``analyze --mode compiled``)."""
from __future__ import annotations

from tabulate import tabulate

from graphmem.passes import ModeComparison
from graphmem.render.plan import fmt_flops
from graphmem.units import fmt_bytes

ROOT = "(model)"


def _change(before: int, after: int) -> str:
    diff = after - before
    if not diff:
        return "="
    sign = "+" if diff > 0 else "-"
    share = f" ({sign}{100.0 * abs(diff) / before:.1f}%)" if before else ""
    return f"{sign}{fmt_bytes(abs(diff))}{share}"


def render_modes(c: ModeComparison, depth: int = 3, top: int = 10) -> str:
    graphs = f"{c.forward_graphs} forward graph{'s' if c.forward_graphs != 1 else ''}"
    breaks = f"{len(c.graph_breaks)} graph break reason{'s' if len(c.graph_breaks) != 1 else ''}" if c.graph_breaks \
        else "no graph breaks"
    budget = f", activation memory budget {c.memory_budget:g}" if c.memory_budget is not None else ""
    lines = [f"Eager vs compiled (torch.compile, AOTAutograd + min-cut partition{budget}; {graphs}, {breaks})",
             f"saved for backward: eager {fmt_bytes(c.eager_bytes)} → compiled {fmt_bytes(c.compiled_bytes)} "
             f"({_change(c.eager_bytes, c.compiled_bytes)})"]
    rows = [["  " * (m.path.count(".") + 1 if m.path else 0) + (m.path or ROOT), fmt_bytes(m.eager_bytes),
             fmt_bytes(m.compiled_bytes), _change(m.eager_bytes, m.compiled_bytes)]
            for m in c.modules
            if m.path == "" or ((m.eager_bytes or m.compiled_bytes) and m.path.count(".") < depth)]
    lines += ["", tabulate(rows, headers=["module", "eager", "compiled", "change"], tablefmt="simple",
                           colalign=("left", "right", "right", "right"), preserve_whitespace=True)]
    if c.recomputed:
        rows = [[r.op, r.module or ROOT, "x".join(map(str, r.shape)) or "scalar", r.dtype, fmt_bytes(r.bytes)]
                for r in c.recomputed[:top]]
        lines += ["", f"Recomputed in backward instead of saved (top {min(top, len(c.recomputed))} of "
                      f"{len(c.recomputed)} ops, outputs {fmt_bytes(c.recomputed_bytes)}, {fmt_flops(c.recomputed_flops)})",
                  tabulate(rows, headers=["op", "module", "shape", "dtype", "bytes"], tablefmt="simple",
                           colalign=("left", "left", "left", "left", "right"))]
    else:
        lines += ["", "Recomputed in backward: nothing (the partitioner saved every value backward needs)"]
    if c.graph_breaks:
        lines += ["", "Graph breaks (dynamo's reasons)"] + [f"- {b}" for b in c.graph_breaks]
    lines += ["", "The compiled peak is AOTAutograd's graphs run op by op (the aot_eager backend); Inductor's fused "
                  "kernels never materialize the intermediates inside a fusion and its scheduler reorders for peak "
                  "memory, so an Inductor step's peak would be lower (docs/inductor.md)"]
    return "\n".join(lines) + "\n"
