"""``graphmem advise``: what to change so the step fits in --memory, ranked, each lever's peak
measured by a capture of the changed step (graphmem/advise)."""
from __future__ import annotations

import argparse
import json
import sys

from graphmem.cli.options import add_debug_argument, add_figure_argument, add_step_arguments, analyze_args, check_memory
from graphmem.errors import UsageError


class Advise:
    name = "advise"
    help = "what to change so the step fits in --memory: levers ranked, each measured by a capture"

    def prepare_parser(self, p: argparse.ArgumentParser) -> None:
        add_step_arguments(p)
        g = p.add_argument_group("advice")
        g.add_argument("--memory", metavar="MEM", help="the device's memory, e.g. 80GiB (default on --device cuda: the "
                       "--gpu card's capacity as CUDA reports it, e.g. 21.95 GiB for the L4)")
        g.add_argument("--ranks", type=int, default=8, metavar="N",
                       help="GPUs the sharding levers (ZeRO, FSDP) split over (default 8)")
        g.add_argument("--advise-lora-rank", type=int, default=16, metavar="R",
                       help="rank of the LoRA lever (default 16; weighed when the step has an optimizer)")
        g.add_argument("--combine", action="store_true",
                       help="also combine the best levers when one alone fits (default: only when none does)")
        add_figure_argument(g)
        p.add_argument("--json", action="store_true", help="JSON output (exact integers)")
        add_debug_argument(p)

    def run(self, args: argparse.Namespace) -> int:
        from graphmem.cli.progress import Progress, quiet
        from graphmem.render.advise import advice_json, render_advice
        check_memory(args, args.memory, "--memory")  # a bad --memory fails before the analysis
        for flag, value in (("--ranks", args.ranks), ("--advise-lora-rank", args.advise_lora_rank)):
            if value < 1:
                raise UsageError(f"{flag} must be a positive integer, got {value}")
        with quiet(args.json):
            report = analyze_args(args)
            with Progress(desc="captures") as bar:
                advice = report.advise(args.memory, ranks=args.ranks, lora_rank=args.advise_lora_rank, tick=bar.update,
                                        combine=args.combine, figure=args.figure)
        if args.json:
            sys.stdout.write(json.dumps(advice_json(report, advice), indent=2) + "\n")
        else:
            shape = "x".join(map(str, report.input_shapes[0])) if report.input_shapes else ""
            sys.stdout.write(render_advice(advice, f"{report.model} {shape}: "))
        return 0 if advice.base_peak <= advice.memory or advice.choice is not None else 1
