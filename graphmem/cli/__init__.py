"""Command line: argparse only, one module per command (analyze and presets, plan, formula with fit and
sweep, advise, compare, validate, torchtitan's jobs), the shared options declared once (options.py);
errors become exit codes (main.py)."""
from graphmem.cli.main import main

__all__ = ["main"]
