"""Command line: parses arguments, calls the library, turns GraphmemError into one stderr
line and an exit code (2: usage, 1: analysis failed). ``--debug`` shows tracebacks."""
from __future__ import annotations

import argparse
import sys
from typing import NoReturn, Optional, Sequence

from graphmem.cli.options import add_training_arguments, training_options
from graphmem.errors import GraphmemError, UsageError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage block
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="graphmem", description="Exact activation memory of one PyTorch training step, on fake tensors.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    a = sub.add_parser("analyze", help="analyze one training step (forward, loss, backward)")
    a.add_argument("model", help="a model file (defines `model`) or a preset name, see `graphmem presets`")
    a.add_argument("--input-shape", required=True, metavar="SHAPE", help="e.g. 32x1024 (tokens) or 8x3x224x224")
    add_target_arguments(a)
    add_training_arguments(a)
    a.add_argument("--json", action="store_true", help="print the report as JSON (exact integers); same as --format json")
    a.add_argument("--format", choices=["text", "json", "markdown"], help="output format (default text)")
    a.add_argument("--tree", action="store_true", help="print the module tree of saved bytes (text format)")
    a.add_argument("--plot", metavar="PATH", help="also write a PNG of memory over the step (needs graphmem[plot])")
    a.add_argument("--snapshot", metavar="PATH", help="also write the step as a memory_viz snapshot pickle")
    a.add_argument("--depth", type=int, default=3, help="module table depth (default 3)")
    a.add_argument("--top", type=int, default=10, help="rows in the largest-tensor tables (default 10)")
    a.add_argument("--formula", action="store_true",
                   help="also fit the exact formulas (alpha/beta/gamma per block; a few more captures)")
    a.add_argument("--plan", action="store_true",
                   help="also plan activation checkpoints (with --budget or --max-overhead: choose one)")
    from graphmem.cli.plan import add_plan_arguments

    add_plan_arguments(a)
    a.add_argument("--debug", action="store_true", help="show tracebacks")
    a.set_defaults(run=_analyze)
    pr = sub.add_parser("presets", help="list the bundled model presets")
    pr.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    pr.set_defaults(run=_presets)
    for module in _command_modules():  # each adds its subcommand(s) with set_defaults(run=...)
        module.add_commands(sub)
    return p


def add_target_arguments(p: argparse.ArgumentParser) -> None:
    """--device/--dtype/--amp/--attention/--gpu, shared by every command that analyzes."""
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="target device (default cpu)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="parameter dtype (default: as built, fp32)")
    p.add_argument("--amp", choices=["bf16", "fp16"], help="autocast with fp32 parameters")
    p.add_argument("--attention", default="auto", choices=["auto", "flash", "efficient", "cudnn", "math"],
                   help="SDPA backend (default auto: PyTorch's own choice for the target)")
    p.add_argument("--gpu", default="h100", help="GPU for the CUDA backend rules: h100, a100, l4, a10, t4, v100, ...")
    p.add_argument("--mode", default="eager", choices=["eager", "compiled"],
                   help="eager autograd (default) or torch.compile's step (AOTAutograd, min-cut partition), shown beside eager")
    p.add_argument("--no-reuse", action="store_true",
                   help="capture every block of a deep chain (default: 5 captured and copied, checked at depth 6)")


def target_options(args: argparse.Namespace) -> dict:
    return {"device": args.device, "dtype": args.dtype, "amp": args.amp, "attention": args.attention, "gpu": args.gpu,
            "mode": args.mode, "reuse": not args.no_reuse}


def _command_modules() -> list:
    """Subcommands that live in their own files: one module per feature."""
    from graphmem.cli import formula, plan, report, validate

    return [formula, plan, report, validate]


def _presets(args: argparse.Namespace) -> int:
    from graphmem import models

    for name, (family, cfg) in models.PRESETS.items():
        print(f"{name:14s} {family:7s} {cfg}")
    return 0


def _run(args: argparse.Namespace) -> int:
    return int(args.run(args))


def _analyze(args: argparse.Namespace) -> int:
    from graphmem import analyze
    from graphmem.cli.plan import check_plan_arguments
    from graphmem.cli.report import output_format, render_report, write_files
    from graphmem.progress import quiet

    fmt = output_format(args)  # flag mistakes and a missing matplotlib fail before the analysis
    check_plan_arguments(args, args.plan)
    with quiet(fmt == "json"):
        report = analyze(args.model, input_shape=args.input_shape, **target_options(args), **training_options(args))
        summary = report.plans(args.budget, args.max_overhead, points=args.points, keep=True,
                               selective=args.selective) if args.plan else None
        if args.formula:
            from graphmem.progress import Progress

            with Progress(desc="captures") as bar:
                report.formula(tick=bar.update, keep=True)
    write_files(report, args)  # --plot, --snapshot
    sys.stdout.write(render_report(report, fmt, args))
    if summary is not None:
        from graphmem.cli.plan import plan_status

        return plan_status(summary)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for i, arg in enumerate(argv[:-1]):  # `--input-shape -1x5` would parse as an option: keep the value
        if arg == "--input-shape" and argv[i + 1].startswith("-"):
            argv[i: i + 2] = [f"--input-shape={argv[i + 1]}"]
            break
    debug = "--debug" in argv
    try:
        return _run(_parser().parse_args(argv))
    except GraphmemError as e:
        if debug:
            raise
        print(f"graphmem: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("graphmem: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug in graphmem: still one line unless --debug
        if debug:
            raise
        print(f"graphmem: internal error: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''} "
              "(rerun with --debug and report the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
