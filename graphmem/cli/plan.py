"""``graphmem plan`` (and the exit status of ``graphmem analyze --plan``): checkpoint
placement under a budget."""
from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from graphmem.cli.options import (
    add_debug_argument,
    add_plan_arguments,
    add_step_arguments,
    analyze_args,
    check_plan_arguments,
)

if TYPE_CHECKING:
    from graphmem.planning.planner import PlanSummary


class Plan:
    name = "plan"
    help = "activation checkpoint plans: the cheapest that fits a budget, baselines, frontier"

    def prepare_parser(self, p: argparse.ArgumentParser) -> None:
        add_step_arguments(p)
        add_plan_arguments(p)
        p.add_argument("--top", type=int, default=12, help="frontier rows shown (default 12)")
        p.add_argument("--json", action="store_true", help="JSON output (exact integers)")
        add_debug_argument(p)

    def run(self, args: argparse.Namespace) -> int:
        from graphmem.render.plan import render_plan
        from graphmem.units import fmt_bytes

        check_plan_arguments(args, True)
        report = analyze_args(args)
        summary = report.plans(args.budget, args.max_overhead, points=args.points, selective=args.selective,
                               figure=args.figure)
        if args.json:
            sys.stdout.write(json.dumps({"model": report.model, "input_shapes": [list(s) for s in report.input_shapes],
                                         "peak_bytes": report.peak_bytes, "run_peak_bytes": report.run_peak_bytes,
                                         "plan": summary.to_dict()}, indent=2) + "\n")
        else:
            shape = "x".join(map(str, report.input_shapes[0])) if report.input_shapes else ""
            sys.stdout.write(f"{report.model} {shape}: run peak {fmt_bytes(report.run_peak_bytes)} without checkpoints "
                             f"(first step {fmt_bytes(report.peak_bytes)})\n\n")
            sys.stdout.write(render_plan(summary, top=args.top))
        return plan_status(summary)


def plan_status(summary: PlanSummary) -> int:
    """Exit status: 1 when a budget was given and no plan fits it (the output says why)."""
    if summary.problem is not None:
        print(f"graphmem: {summary.problem}", file=sys.stderr)
        return 1
    return 0
