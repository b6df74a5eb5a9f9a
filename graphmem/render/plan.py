"""Checkpoint plans as text: the chosen plan with the code to apply it, the baselines beside
graphmem's plan at the same budget, and the Pareto frontier."""
from __future__ import annotations

import re

from tabulate import tabulate

from graphmem.passes.run_memory import FIGURE_NAMES
from graphmem.planning.planner import CheckpointPlan, PlanSummary
from graphmem.render.selective import render_levels
from graphmem.units import fmt_bytes


def fmt_flops(n: int) -> str:
    for unit, scale in (("PFLOP", 10**15), ("TFLOP", 10**12), ("GFLOP", 10**9), ("MFLOP", 10**6)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} FLOP"


def _segments(p: CheckpointPlan, limit: int = 8) -> str:
    if not p.segments:
        return "(none)"
    levels = [f" {pol.name}" if pol is not None else "" for pol in p.policies] or [""] * len(p.segments)
    shown = [(f"{a}" if a == b else f"{a}..{b}") + lv for (a, b), lv in zip(p.segments[:limit], levels)]
    more = f", … ({len(p.segments)} segments)" if len(p.segments) > limit else ""
    return ", ".join(shown) + more


def _row(p: CheckpointPlan) -> list[object]:
    return [fmt_bytes(p.peak_bytes), fmt_bytes(p.activation_bytes), fmt_flops(p.recompute_flops),
            f"{100 * p.overhead:.1f}%", _segments(p)]


def render_chosen(p: CheckpointPlan, heading: str = "Checkpoint plan") -> str:
    """One plan: what it was chosen under, its peak, activations and recompute, its segments, how
    its peak was checked, and the code that applies it (``str(plan)``)."""
    limit = (f"budget {fmt_bytes(p.budget)}" if p.budget is not None
             else f"recompute cap {100 * p.max_overhead:.1f}%" if p.max_overhead is not None else "no limit")
    lines = [f"{heading} ({limit}): peak {fmt_bytes(p.peak_bytes)}, activations "
             f"{fmt_bytes(p.activation_bytes)}, recompute {fmt_flops(p.recompute_flops)} "
             f"(+{100 * p.overhead:.1f}% of the step's FLOPs)",
             f"  checkpointed segments of {p.chain or '(model)'}: {_segments(p, limit=len(p.segments))}",
             *([f"  budget compared with the {FIGURE_NAMES[p.figure]}: {fmt_bytes(p.figure_bytes)} of "
                f"{fmt_bytes(p.budget)} (the plan's step captured, passes/run_memory.py)"]
               if p.figure and p.figure_bytes is not None and p.budget is not None else []),
             *([f"  {p.verification.line()}"] if p.verification is not None else []),
             "  apply it:",
             *("    " + line for line in p.code().splitlines())]
    return "\n".join(lines) + "\n"


_PIECES = re.compile(r"blocks (\d+)\.\.(\d+) checkpointed change memory by (-?\d+) B over the step but (-?\d+) B stored")


def not_composing(because: str) -> list[str]:
    """What it means for the plans that the chain's pieces do not compose (``because``: the check
    that failed, passes/checkpoint_model.py), and what to do about it."""
    m = _PIECES.search(because)
    if m is not None:
        a, b, seg, stored = m.groups()
        blocks = f"block {a} leaves" if a == b else f"blocks {a}..{b} leave"
        what = (f"{blocks} {fmt_bytes(int(seg))} behind over the step when checkpointed, {fmt_bytes(int(stored))} "
                "when stored")
    else:
        what = because.removeprefix("checkpoint: ").split("; the chain's pieces")[0]
    return [f"Not proven optimal: the blocks' memory does not add up block by block ({what}): something the "
            "blocks share moves with the plan, such as a KV cache that keeps only stored blocks' keys and values.",
            "Each peak printed is a capture of the step with that plan applied, so it is exact for that plan; only "
            "the choice is a search: the best of the plans captured, which a plan not captured could beat.",
            "Use the chosen plan as printed; for a proven optimum, remove what the blocks share (a transformers "
            "model: `use_cache=False`, `--use-cache off`) and plan again."]


def render_plan(s: PlanSummary, top: int = 12) -> str:
    chain = s.chain or "(model)"
    lines = [f"Checkpoint plans for {chain} ({s.blocks} blocks; recompute = forward FLOPs run again in "
             f"backward, overhead = recompute / the step's {fmt_flops(s.step_flops)})",
             f"  peak without checkpoints {fmt_bytes(s.no_plan_peak)}; smallest peak "
             f"{'any plan reaches' if s.exact else 'of the plans captured'} {fmt_bytes(s.minimum_peak)}"]
    if not s.exact:
        lines += [f"  {line}" for line in not_composing(s.inexact_because)]
    if s.chosen is not None:
        lines += ["", *render_chosen(s.chosen, "Chosen plan").splitlines()]
    if s.problem is not None:
        lines += ["", f"No plan chosen: {s.problem}"]
    rows = []
    for base, mine in s.baselines:
        rows.append([base.name, fmt_bytes(base.peak_bytes), fmt_flops(base.recompute_flops),
                     f"{100 * base.overhead:.1f}%", fmt_bytes(mine.peak_bytes), fmt_flops(mine.recompute_flops),
                     f"{100 * mine.overhead:.1f}%", _segments(mine, limit=4)])
    lines += ["", "Baselines, each beside graphmem's plan for the baseline's peak as the budget",
              tabulate(rows, headers=["baseline", "peak", "recompute", "overhead", "graphmem peak",
                                      "recompute", "overhead", "graphmem segments"], disable_numparse=True)]
    shown = list(s.frontier)
    if len(shown) > top:  # keep both ends and an even spread between
        step = (len(shown) - 1) / (top - 1)
        shown = [shown[round(i * step)] for i in range(top)]
    if s.selective is not None:
        lines += render_levels(s.selective, fmt_flops)
    what = "" if s.exact else ", of the plans captured"
    lines += ["", f"Pareto frontier{what}: {len(s.frontier)} plans (fewest FLOPs for their peak){'; ' + str(len(shown)) + ' shown' if len(shown) < len(s.frontier) else ''}",
              tabulate([_row(p) for p in shown],
                       headers=["peak", "activations", "recompute", "overhead", "checkpointed segments"],
                       disable_numparse=True)]
    return "\n".join(lines) + "\n"
