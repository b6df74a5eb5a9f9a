"""The activation-memory-budget sweep as text (``analyze --mode compiled --memory-budget 1,0.5,0.2``)."""
from __future__ import annotations

from tabulate import tabulate

from graphmem.passes.memory_budget import BudgetSweep
from graphmem.render.plan import fmt_flops
from graphmem.units import fmt_bytes


def render_memory_budgets(s: BudgetSweep) -> str:
    first = s.points[0]
    rows = [[f"{p.budget:g}", fmt_bytes(p.saved_bytes), fmt_bytes(p.peak_bytes), p.peak_phase,
             str(p.recomputed_ops), fmt_bytes(p.recomputed_bytes), fmt_flops(p.recompute_flops),
             ("=" if p.peak_bytes == first.peak_bytes else
              f"{'+' if p.peak_bytes > first.peak_bytes else '-'}{fmt_bytes(abs(p.peak_bytes - first.peak_bytes))}")]
            for p in s.points]
    lines = ["torch.compile activation memory budget (torch._functorch.config.activation_memory_budget; each value "
             "partitioned by the real min-cut partitioner)",
             tabulate(rows, headers=["budget", "saved", "peak", "peak in", "recomputed ops", "recomputed bytes",
                                     "recompute FLOPs", f"peak vs {first.budget:g}"], tablefmt="simple",
                      colalign=("right", "right", "right", "left", "right", "right", "right", "right"))]
    if s.rises:
        lines += ["", "Not monotonic in the budget (cf. pytorch/pytorch#197838):"]
        lines += [f"- {r.what} {'rises' if r.what == 'peak' else 'bytes rise'} by {fmt_bytes(r.bytes)} from budget "
                  f"{r.higher:g} to {r.lower:g}" for r in s.rises]
    else:
        lines += ["", "Peak and saved bytes fall (or stay) as the budget falls."]
    best = s.lowest_peak
    lines.append(f"Lowest peak: {fmt_bytes(best.peak_bytes)} at budget {best.budget:g} "
                 f"({fmt_flops(best.recompute_flops)} recomputed)")
    lines += [f"Note: {n}" for n in s.notes]
    return "\n".join(lines) + "\n"
