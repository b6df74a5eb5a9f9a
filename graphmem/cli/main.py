"""Command line: the commands (one small object each, graphmem/cli/command.py's protocol),
one parser, and the one place where GraphmemError becomes a stderr line and an exit code
(2: usage, 1: analysis failed). ``--debug`` shows tracebacks."""
from __future__ import annotations

import argparse
import sys
from typing import NoReturn, Optional, Sequence

from graphmem.cli.advise import Advise
from graphmem.cli.analyze import Analyze, Presets
from graphmem.cli.command import Command
from graphmem.cli.compare import Compare
from graphmem.cli.flags import to_flags
from graphmem.cli.formula import Fit, Formula, Sweep
from graphmem.cli.plan import Plan
from graphmem.cli.titan import split_overrides
from graphmem.cli.validate import Validate
from graphmem.errors import GraphmemError, UsageError

COMMANDS: list[Command] = [Analyze(), Plan(), Advise(), Formula(), Fit(), Sweep(), Validate(), Compare(), Presets()]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage block
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="graphmem", description="Exact activation memory of one PyTorch training step, on fake tensors.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in COMMANDS:
        c = sub.add_parser(command.name, help=command.help)
        command.prepare_parser(c)
        c.set_defaults(run=command.run)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for i, arg in enumerate(argv[:-1]):  # `--input-shape -1x5` would parse as an option: keep the value
        if arg == "--input-shape" and argv[i + 1].startswith("-"):
            argv[i: i + 2] = [f"--input-shape={argv[i + 1]}"]
            break
    debug = "--debug" in argv
    argv, overrides = split_overrides(argv)  # --torchtitan's own overrides after a bare --
    try:
        args = parser().parse_args(argv)
        args.job_overrides = overrides
        return int(args.run(args))
    except GraphmemError as e:
        if debug:
            raise
        print(f"graphmem: error: {to_flags(str(e))}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("graphmem: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug in graphmem: still one line unless --debug
        if debug:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"graphmem: internal error: {type(e).__name__}: {first} (rerun with --debug and report the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
