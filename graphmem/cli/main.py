"""Command line: the commands (one small object each, graphmem/cli/command.py's protocol),
one parser, and the one place where GraphmemError becomes a stderr line and an exit code
(2: usage, 1: analysis failed). ``--debug`` shows tracebacks."""
from __future__ import annotations

import argparse
import re
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
from graphmem.errors import GraphmemError, UsageError, one_line
from graphmem.noise import quiet_third_party

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


def _valued(p: argparse.ArgumentParser) -> set[str]:
    """The option strings of ``p`` and its commands that take a value."""
    names: set[str] = set()
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                names |= _valued(sub)
        elif action.nargs != 0:
            names.update(action.option_strings)
    return names


def _negative_values(argv: list[str], valued: set[str]) -> list[str]:
    """``--memory -5GB``, ``--input-shape -1x5``: argparse takes a value that starts with "-" (and is
    not a plain number) for an option and says "expected one argument"; joined as ``--memory=-5GB``,
    the option's own check names the value."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in valued and re.match(r"-[0-9.]", arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv, overrides = split_overrides(argv)  # --torchtitan's own overrides after a bare --
    try:
        p = parser()
        args = p.parse_args(_negative_values(argv, _valued(p)))
        args.job_overrides = overrides
        with quiet_third_party():  # torch's, transformers', torchtitan's notes on graphmem's own work
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
        print(f"graphmem: internal error: {type(e).__name__}: {one_line(e)} (rerun with --debug and report the "
              "traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
