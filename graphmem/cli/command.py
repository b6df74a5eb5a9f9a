"""The one protocol every command follows: a name, a help line, its arguments, and run."""
from __future__ import annotations

import argparse
from typing import Protocol


class Command(Protocol):
    name: str
    help: str

    def prepare_parser(self, p: argparse.ArgumentParser) -> None:
        """Declare the command's arguments (shared ones come from graphmem/cli/options.py)."""

    def run(self, args: argparse.Namespace) -> int:
        """Do the work; return the exit status. Raise GraphmemError for one-line failures."""
