"""Command line: argparse only, one module per command (analyze, plan, formula, report,
validate), the shared options declared once (options.py); errors become exit codes (main.py)."""
from graphmem.cli.main import main

__all__ = ["main"]
