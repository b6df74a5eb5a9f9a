"""`graphmem plan` (and `graphmem analyze --plan`): checkpoint placement under a budget."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from graphmem.errors import UsageError


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget", metavar="MEM", help="memory budget for the step's peak, e.g. 40GiB: the plan with the "
                   "fewest recompute FLOPs that fits")
    p.add_argument("--max-overhead", metavar="PCT", help="recompute cap, e.g. 20%%: the plan with the lowest peak "
                   "whose recompute stays within it")
    p.add_argument("--selective", nargs="?", const=True, default=False, type=int, metavar="LEVELS",
                   help="selective checkpointing: a checkpointed segment may also keep some ops' outputs (the knapsack's "
                   "choice at LEVELS memory levels, default 3), measured like plain checkpointing")
    p.add_argument("--points", type=int, default=50, help="budgets tried for the Pareto frontier (default 50)")


def check_plan_arguments(args: argparse.Namespace, planning: bool) -> None:
    if not planning and (args.budget is not None or args.max_overhead is not None or args.selective is not False):
        raise UsageError("--budget, --max-overhead and --selective choose a checkpoint plan: add --plan")
    if args.selective is not True and args.selective is not False and args.selective < 1:
        raise UsageError("--selective takes a number of levels >= 1")
    if args.budget is not None and args.max_overhead is not None:
        raise UsageError("give --budget or --max-overhead, not both")
    if args.points < 2:
        raise UsageError("--points must be at least 2")


def add_commands(sub: Any) -> None:
    p = sub.add_parser("plan", help="activation checkpoint plans: the cheapest that fits a budget, baselines, frontier")
    p.add_argument("model", help="a model file or a preset name")
    p.add_argument("--input-shape", required=True, metavar="SHAPE", help="e.g. 32x1024")
    from graphmem.cli.main import add_target_arguments
    from graphmem.cli.options import add_training_arguments

    add_target_arguments(p)
    add_training_arguments(p)
    add_plan_arguments(p)
    p.add_argument("--top", type=int, default=12, help="frontier rows shown (default 12)")
    p.add_argument("--json", action="store_true", help="JSON output (exact integers)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(run=_plan)


def _plan(args: argparse.Namespace) -> int:
    from graphmem import analyze
    from graphmem.cli.main import target_options
    from graphmem.cli.options import training_options
    from graphmem.render.plan import render_plan
    from graphmem.units import fmt_bytes

    check_plan_arguments(args, True)
    report = analyze(args.model, input_shape=args.input_shape, **target_options(args), **training_options(args))
    summary = report.plans(args.budget, args.max_overhead, points=args.points, keep=True, selective=args.selective)
    if args.json:
        sys.stdout.write(json.dumps({"model": report.model, "input_shapes": [list(s) for s in report.input_shapes],
                                     "peak_bytes": report.peak_bytes, "plan": summary.to_dict()}, indent=2) + "\n")
    else:
        sys.stdout.write(f"{report.model} {'x'.join(map(str, report.input_shapes[0])) if report.input_shapes else ''}: "
                         f"peak {fmt_bytes(report.peak_bytes)} without checkpoints\n\n")
        sys.stdout.write(render_plan(summary, top=args.top))
    return plan_status(summary)


def plan_status(summary: Any) -> int:
    """Exit status: 1 when a budget was given and no plan fits it (the output says why)."""
    if summary.problem is not None:
        print(f"graphmem: {summary.problem}", file=sys.stderr)
        return 1
    return 0
