"""``graphmem compare a.json b.json``: what changed between two ``analyze --json`` reports."""
from __future__ import annotations

import argparse
import sys

from graphmem.cli.options import add_debug_argument, add_depth_argument


class Compare:
    name = "compare"
    help = "what changed between two `graphmem analyze --json` reports"

    def prepare_parser(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("before", help="a report written by `graphmem analyze ... --json > before.json`")
        p.add_argument("after", help="the report to compare with it")
        p.add_argument("--top", type=int, default=10, help="rows in the added/removed tensor tables (default 10)")
        add_depth_argument(p)
        add_debug_argument(p)

    def run(self, args: argparse.Namespace) -> int:
        from graphmem.render.compare import render_comparison
        from graphmem.report.compare import compare, load_json_report

        before, after = load_json_report(args.before), load_json_report(args.after)
        c = compare(before, after, (args.before, args.after))
        sys.stdout.write(render_comparison(c, top=args.top, depth=args.depth))
        return 0
