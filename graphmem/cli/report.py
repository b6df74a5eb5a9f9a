"""CLI for report views: ``graphmem compare a.json b.json``, and the output side of ``analyze``
(``--format text|json|markdown``, ``--tree``, ``--plot PATH``, ``--snapshot PATH``)."""
from __future__ import annotations

import argparse
import os
import sys

from graphmem.errors import UsageError
from graphmem.report import Report


def add_commands(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("compare", help="what changed between two `graphmem analyze --json` reports")
    c.add_argument("before", help="a report written by `graphmem analyze ... --json > before.json`")
    c.add_argument("after", help="the report to compare with it")
    c.add_argument("--top", type=int, default=10, help="rows in the added/removed tensor tables (default 10)")
    c.add_argument("--debug", action="store_true", help="show tracebacks")
    c.set_defaults(run=_compare)


def _compare(args: argparse.Namespace) -> int:
    from graphmem.compare import compare, load_json_report
    from graphmem.render.compare import render_comparison

    before, after = load_json_report(args.before), load_json_report(args.after)
    sys.stdout.write(render_comparison(compare(before, after, (args.before, args.after)), top=args.top))
    return 0


def output_format(args: argparse.Namespace) -> str:
    """Check the analyze output flags before the analysis runs, so a mistake costs nothing."""
    fmt = args.format or ("json" if args.json else "text")
    if args.json and fmt != "json":
        raise UsageError(f"--json and --format {fmt} disagree; use one of them")
    if args.tree and fmt != "text":
        raise UsageError(f"--tree draws the text module tree; it does not combine with --format {fmt}")
    for flag, path in (("--plot", args.plot), ("--snapshot", args.snapshot)):
        if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise UsageError(f"{flag} {path}: the folder {os.path.dirname(os.path.abspath(path))} does not exist")
    if args.plot is not None:
        from graphmem.render.plot import require_matplotlib

        require_matplotlib()
    return fmt


def render_report(report: Report, fmt: str, args: argparse.Namespace) -> str:
    from graphmem.render import render_json, render_markdown, render_text, render_tree

    if fmt == "json":
        return render_json(report)
    plans = ""
    if report.known_plans is not None:
        from graphmem.render.plan import render_plan

        plans = render_plan(report.known_plans)
    if fmt == "markdown":
        out = render_markdown(report, depth=args.depth, top=args.top)
        return out + (f"\n## Checkpoint plans\n\n```\n{plans}```\n" if plans else "")
    out = render_tree(report, depth=args.depth) if args.tree else render_text(report, depth=args.depth, top=args.top)
    return out + (f"\n{plans}" if plans else "")


def write_files(report: Report, args: argparse.Namespace) -> None:
    """``--plot`` (PNG) and ``--snapshot`` (memory_viz pickle); a line on stderr for each."""
    from graphmem.render.plot import plot_timeline
    from graphmem.render.snapshot import snapshot_bytes

    for path, make, what in ((args.plot, plot_timeline, "memory plot"),
                             (args.snapshot, snapshot_bytes, "memory snapshot (open it at https://pytorch.org/memory_viz)")):
        if path is None:
            continue
        try:
            with open(path, "wb") as f:
                f.write(make(report))
        except OSError as e:
            raise UsageError(f"cannot write {path}: {e.strerror or e}") from None
        print(f"graphmem: wrote the {what} to {path}", file=sys.stderr)
