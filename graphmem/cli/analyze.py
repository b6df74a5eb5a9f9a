"""``graphmem analyze``: one training step's memory (tables, JSON, Markdown, tree, plot,
memory_viz snapshot), optionally with formulas and checkpoint plans; ``graphmem presets``."""
from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from graphmem.cli.options import (
    add_debug_argument,
    add_depth_argument,
    add_pipeline_arguments,
    add_plan_arguments,
    add_step_arguments,
    add_trainer_batch_arguments,
    analyze_args,
    check_pipeline_arguments,
    check_plan_arguments,
    memory_budgets_of,
)
from graphmem.cli.plan import plan_status
from graphmem.cli.titan import add_job_arguments, job_report, require_model
from graphmem.errors import UsageError

if TYPE_CHECKING:
    from graphmem.report import Report
    from graphmem.report.live import Analysis


class Analyze:
    name = "analyze"
    help = "analyze one training step (forward, loss, backward)"

    def prepare_parser(self, p: argparse.ArgumentParser) -> None:
        add_step_arguments(p, job=True)
        add_job_arguments(p)
        add_pipeline_arguments(p)
        p.add_argument("--training-args", metavar="PATH",
                       help="a JSON or YAML file of transformers TrainingArguments: analyze the step a Trainer "
                            "around the (Hugging Face) model runs (its optim, clipping, accumulation, bf16/fp16, "
                            "gradient checkpointing); with --world-size N [--rank R], rank R of its DDP job on N "
                            "processes")
        add_trainer_batch_arguments(p)
        o = p.add_argument_group("output")
        o.add_argument("--json", action="store_true", help="print the report as JSON (exact integers); same as --format json")
        o.add_argument("--format", choices=["text", "json", "markdown"], help="output format (default text)")
        o.add_argument("--tree", action="store_true", help="print the module tree of saved bytes (text format)")
        o.add_argument("--plot", metavar="PATH", help="also write a PNG of memory over the step (needs graphmem[plot])")
        o.add_argument("--snapshot", metavar="PATH", help="also write the step as a memory_viz snapshot pickle")
        add_depth_argument(o)
        o.add_argument("--expand", action="store_true",
                       help="list every block of a run of identical ones (default: one row, e.g. layers.0-31 ×32)")
        o.add_argument("--top", type=int, default=10, help="rows in the largest-tensor tables (default 10)")
        p.add_argument("--formula", action="store_true",
                       help="also fit the exact formulas (alpha/beta/gamma per block; a few more captures)")
        p.add_argument("--plan", action="store_true",
                       help="also plan activation checkpoints (with --budget or --max-overhead: choose one)")
        add_plan_arguments(p)
        add_debug_argument(p)

    def run(self, args: argparse.Namespace) -> int:
        from graphmem.cli.progress import Progress, quiet

        fmt = output_format(args)  # flag mistakes and a missing matplotlib fail before the analysis
        check_plan_arguments(args, args.plan)
        budgets = memory_budgets_of(args)
        check_pipeline_arguments(args)
        if args.train_dataset and not args.training_args:
            raise UsageError("--train-dataset is the Trainer's: give --training-args too")
        overrides = getattr(args, "job_overrides", [])
        if args.torchtitan is None:
            require_model(args, overrides)
        with quiet(fmt == "json"):
            report = job_report(args, overrides) if args.torchtitan else \
                trainer_report(args) if args.training_args else analyze_args(args)
            if len(budgets) > 1:  # the report is at the first value; the table has them all
                with Progress(total=len(budgets), desc="memory budgets") as bar:
                    report = report.keeping(memory_budgets=report.memory_budgets(budgets, tick=bar.update))
            summary = report.plans(args.budget, args.max_overhead, points=args.points,
                                   selective=args.selective, figure=args.figure) if args.plan else None
            report = report.keeping(plans=summary)
            if args.formula:
                with Progress(desc="captures") as bar:
                    report = report.keeping(coefficients=report.formula(tick=bar.update))
        write_files(report, args)  # --plot, --snapshot
        sys.stdout.write(render_report(report, fmt, args))
        return plan_status(summary) if summary is not None else 0


def trainer_report(args: argparse.Namespace) -> Analysis:
    """``--training-args``: a transformers Trainer around the loaded model (graphmem/frontends/trainer.py);
    with ``--world-size N [--rank R]``, rank R of the DDP job it runs on N processes; ``--device cuda``:
    its step on the CUDA target."""
    from graphmem.api import analyze
    from graphmem.capture.load import load
    from graphmem.cli.options import hf_of, target_of
    from graphmem.frontends.trainer import trainer_from_file
    from graphmem.training.hf_trainer import is_trainer

    if args.plan or args.formula:
        raise UsageError("--training-args analyzes the Trainer's step; --plan and --formula are not run on it yet")
    if args.zero or args.fsdp or args.tp != 1:
        raise UsageError("--training-args runs the Trainer's own step, per rank as a DDP job (--world-size N "
                         "[--rank R]); drop --zero, --fsdp and --tp")
    target = target_of(args)
    loaded = load(args.model, target=target, options=hf_of(args))
    trainer = trainer_from_file(loaded.module, args.training_args, target, args.train_dataset)
    if not is_trainer(trainer):  # FSDP or DeepSpeed arguments: the Trainer is built per rank (frontends/door.py)
        if getattr(trainer, "deepspeed", None) is not None and target.device == "cuda":  # (DeepSpeed's: any target)
            return analyze(loaded.module, training_args=trainer, input_shape=args.input_shape,
                           world_size=args.world_size, rank=args.rank, device="cuda", gpu=target.gpu)
        return analyze(loaded.module, training_args=trainer, input_shape=args.input_shape, world_size=args.world_size,
                       rank=args.rank)
    device = "cuda" if target.device == "cuda" else None  # else the Trainer's own (cuda where built on a GPU)
    return analyze(trainer, input_shape=args.input_shape, world_size=args.world_size, rank=args.rank, device=device,
                   trainer_batch=args.trainer_batch)


class Presets:
    name = "presets"
    help = "list the bundled model presets"

    def prepare_parser(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)

    def run(self, args: argparse.Namespace) -> int:
        from graphmem import models
        from graphmem.capture.presets_hf import HF_PRESETS

        for name, (family, cfg) in models.PRESETS.items():
            print(f"{name:14s} {family:7s} {cfg}")
        for name, (repo, raw) in HF_PRESETS.items():  # Hugging Face configs (docs/hf.md), needs graphmem[hf]
            print(f"{name:14s} {'hf':7s} {raw['architectures'][0]} from {repo}'s config.json")
        return 0


def output_format(args: argparse.Namespace) -> str:
    """Check the output flags before the analysis runs, so a mistake costs nothing."""
    fmt: str = args.format or ("json" if args.json else "text")
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
    from graphmem.render.plan import render_plan

    if fmt == "json":
        return render_json(report)
    plans = render_plan(report.known_plans) if report.known_plans is not None else ""
    if fmt == "markdown":
        out = render_markdown(report, depth=args.depth, top=args.top, expand=args.expand)
        return out + (f"\n## Checkpoint plans\n\n```\n{plans}```\n" if plans else "")
    out = (render_tree(report, depth=args.depth, expand=args.expand) if args.tree
           else render_text(report, depth=args.depth, top=args.top, expand=args.expand))
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
