"""``graphmem analyze --torchtitan CONFIG_NAME --world-size N [--rank r|all] [--gpu h100] [-- overrides]``:
a torchtitan job's ranks (graphmem/titan/), the job's own command-line overrides after ``--``."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Optional, Sequence

from graphmem.cli.options import device_of
from graphmem.errors import UsageError

if TYPE_CHECKING:
    from graphmem.report.live import Analysis

# the step options a job takes from its own config: given with --torchtitan, they are refused
_JOB_OWN = ("input_shape", "optimizer", "micro_batches", "dtype", "amp", "fsdp", "zero", "tp", "pp", "lora_rank", "qlora",
            "training_args")


def add_job_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("torchtitan jobs (pip install 'graphmem[titan]')")
    g.add_argument("--torchtitan", metavar="CONFIG", help="a torchtitan config registry name (llama3_8b, "
                   "llama3_debugmodel, deepseek_v3_16b, ...): analyze that job's rank --rank over --world-size ranks "
                   "(default: the first rank of each pipeline stage, the highest reported); torchtitan's own "
                   "overrides go after --")
    g.add_argument("--sdpa", action="store_true", help="with --torchtitan: the job's FlexAttention swapped for "
                   "SDPA is_causal (as torchtitan's published Llama 3 runs; the one a CPU can train)")


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """graphmem's arguments and, with --torchtitan, the job's overrides after a bare ``--``."""
    if "--torchtitan" in argv and "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def job_report(args: argparse.Namespace, overrides: Sequence[str]) -> Analysis:
    """The report of the job's rank ``--rank``; without it, the highest of the pipeline stages' first
    ranks (graphmem/frontends/titan_job.py ``highest``)."""
    import sys

    from graphmem.api import parse_overheads, report_of
    from graphmem.cli.options import overheads_of
    from graphmem.frontends.titan_job import highest
    from graphmem.titan import load_job

    _check(args)
    job = load_job(args.torchtitan, list(overrides), gpu=args.gpu if device_of(args) == "cuda" else None)
    if args.attention not in ("auto", None):
        raise UsageError("--torchtitan takes its attention from the job; --sdpa swaps FlexAttention for SDPA: "
                         "drop --attention")
    attention = "sdpa" if args.sdpa else None
    measured, peaks = highest(job, world_size=args.world_size if args.world_size > 1 else None, rank=args.rank,
                            device=device_of(args), gpu=args.gpu, attention=attention)
    if len(peaks) > 1:
        print("graphmem: later steps' peak by rank: " + "; ".join(f"rank {r}: {p:,} B" for r, p in peaks),
              file=sys.stderr)
    return report_of(measured, parse_overheads(overheads_of(args)))


def _check(args: argparse.Namespace) -> None:
    if args.model is not None:
        raise UsageError(f"--torchtitan analyzes the job's own model; drop MODEL ({args.model})")
    given = [name for name in _JOB_OWN if getattr(args, name, None) not in (None, False, 1, "fp32")]
    if given:
        raise UsageError(f"--torchtitan takes the step from the job's config; drop {', '.join(given)} and give "
                         "torchtitan's own overrides after -- (e.g. -- --training.local_batch_size 2)")


def require_model(args: argparse.Namespace, overrides: Optional[Sequence[str]]) -> None:
    """Without --torchtitan, MODEL is required, and --input-shape unless --training-args (its Trainer's batch)."""
    if overrides:
        raise UsageError("arguments after -- are torchtitan's overrides: give --torchtitan CONFIG")
    if args.model is None:
        raise UsageError("give MODEL (a model file, preset or Hugging Face id) or --torchtitan CONFIG")
    if args.input_shape is None and not args.training_args:  # a Trainer draws its batch from --train-dataset
        raise UsageError("--input-shape is required for MODEL (e.g. --input-shape 32x1024); only --torchtitan and "
                         "--training-args with --train-dataset take their batch from the job (see `graphmem analyze --help`)")


__all__ = ["add_job_arguments", "job_report", "require_model", "split_overrides"]
