"""``graphmem formula``, ``graphmem fit`` and ``graphmem sweep``: exact formulas and the questions
users ask of them (will it fit, what does a grid of sizes cost)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from graphmem.cli.options import (
    add_debug_argument,
    add_figure_argument,
    add_model_arguments,
    add_target_arguments,
    add_training_arguments,
    analyze_args,
    check_memory,
)
from graphmem.errors import UsageError

if TYPE_CHECKING:
    from graphmem.report.live import Analysis


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"invalid list {text!r}: expected positive integers separated by commas, e.g. 1,8,32") from None
    if not values or min(values) < 1:
        raise UsageError(f"invalid list {text!r}: expected positive integers separated by commas, e.g. 1,8,32")
    return values


def _common(p: argparse.ArgumentParser, shape_required: bool) -> None:
    add_model_arguments(p, shape_required)
    add_target_arguments(p)
    g = p.add_argument_group("tensor parallelism (every number becomes one rank's)")
    g.add_argument("--tp", type=int, default=1, metavar="T", help="tensor-parallel size (Megatron column/row linears, "
                   "from the graph): alpha/beta/gamma per rank, as Korthikanti et al. 2022, Table 2")
    g.add_argument("--sp", action="store_true", help="sequence parallel with --tp: the tensors outside the TP regions split too")
    p.add_argument("--json", action="store_true", help="JSON output")
    add_debug_argument(p)


class Formula:
    name = "formula"
    help = "exact activation/peak formulas and per-block alpha, beta, gamma"

    def prepare_parser(self, p: argparse.ArgumentParser) -> None:
        _common(p, True)
        p.add_argument("--d-model", type=int, help="override the inferred d_model")
        p.add_argument("--heads", type=int, help="override the inferred number of attention heads")

    def run(self, args: argparse.Namespace) -> int:
        return _formula(args)


class Fit:
    name = "fit"
    help = "largest batch (or sequence length) whose peak fits in memory"

    def prepare_parser(self, p: argparse.ArgumentParser) -> None:
        add_model_arguments(p, False)
        add_target_arguments(p)
        add_training_arguments(p)  # the step's loop and parallel setting, as analyze takes them
        p.add_argument("--json", action="store_true", help="JSON output")
        add_debug_argument(p)
        p.add_argument("--memory", help="e.g. 80GiB, 40GB (default on --device cuda: the --gpu card's capacity as CUDA "
                       "reports it)")
        add_figure_argument(p)
        g = p.add_mutually_exclusive_group()
        g.add_argument("--seq", type=int, help="fixed sequence length: find the batch size")
        g.add_argument("--batch", type=int, help="fixed batch size: find the sequence length")

    def run(self, args: argparse.Namespace) -> int:
        return _fit(args)


class Sweep:
    name = "sweep"
    help = "activation and peak bytes over batch x sequence sizes"

    def prepare_parser(self, p: argparse.ArgumentParser) -> None:
        _common(p, False)
        p.add_argument("--batch", required=True, help="e.g. 1,8,32")
        p.add_argument("--seq", required=True, help="e.g. 512,1024,2048")

    def run(self, args: argparse.Namespace) -> int:
        return _sweep(args)


def _report(args: argparse.Namespace, shape: str) -> Analysis:
    """The analyzed step; with --tp, on tp ranks (no data parallelism), so the formulas are one rank's."""
    from graphmem.step.spec import make_parallelism
    from graphmem.training.spec import make_training

    return analyze_args(args, shape, make_training(args.dtype), make_parallelism(args.tp, tp=args.tp, sp=args.sp))


def _formula(args: argparse.Namespace) -> int:
    from graphmem.cli.progress import Progress, quiet
    from graphmem.render.formula import render_coefficients

    with quiet(args.json), Progress(desc="captures") as bar:
        c = _report(args, args.input_shape).formula(d_model=args.d_model, n_heads=args.heads, tick=bar.update)
    sys.stdout.write(json.dumps({"coefficients": c.to_dict()}, indent=2) + "\n" if args.json else render_coefficients(c))
    return 0


def _fit(args: argparse.Namespace) -> int:
    from graphmem.capture.load import parse_shape
    from graphmem.render.formula import render_fit
    check_memory(args, args.memory, "--memory")
    for name in ("seq", "batch"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name} must be a positive integer")
    shape = args.input_shape
    if shape is None:
        if args.seq is None and args.batch is None:
            raise UsageError("give --seq (to find the batch size), --batch (to find the sequence length) or --input-shape")
        shape = f"{args.batch or 1}x{args.seq or 128}"
    parse_shape(shape)
    from graphmem.cli.progress import Progress, quiet

    with quiet(args.json), Progress(desc="captures") as bar:
        a = analyze_args(args, shape).fit(args.memory, seq=args.seq, batch=args.batch, tick=bar.update,
                                          figure=args.figure)
    if args.json:
        sys.stdout.write(json.dumps({"fit": {"variable": a.variable, "value": a.value, "memory_bytes": a.memory,
                                             "figure": a.figure, "figure_bytes": a.figure_bytes,
                                             "figure_above": a.figure_above, "tensors_value": a.tensors_value,
                                             "fixed": a.fixed, "predicted_peak": a.peak_at_value,
                                             "predicted_peak_above": a.peak_above, "captured_peak": a.captured_at_value,
                                             "captured_peak_above": a.captured_above}}, indent=2) + "\n")
    else:
        sys.stdout.write(render_fit(a))
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from graphmem.render.formula import render_sweep

    batches, seqs = _ints(args.batch), _ints(args.seq)
    shape = args.input_shape or f"{max(batches)}x{max(seqs)}"
    from graphmem.cli.progress import Progress, quiet

    with quiet(args.json), Progress(desc="captures") as bar:
        sw = _report(args, shape).sweep(batches, seqs, tick=bar.update)
    if args.json:
        sys.stdout.write(json.dumps({"sweep": [dict(zip(("batch", "seq", "activation_bytes", "peak_bytes",
                                                          "captured_activation_bytes", "captured_peak_bytes"), r))
                                               for r in sw.rows]}, indent=2) + "\n")
    else:
        sys.stdout.write(render_sweep(sw))
    return 0
