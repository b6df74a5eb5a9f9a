"""Options shared by the commands, declared once, and turned into the frozen objects the
library takes: a Target (graphmem/capture/target.py) and a Training spec
(graphmem/training/spec.py). Torch is imported only when an option object is built, so
``graphmem --help`` and usage errors answer fast. The choices below are the library's own
(tests/cli/test_cli_options.py checks they agree)."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, Optional, TypedDict

from graphmem.errors import UsageError
from graphmem.step.options import (
    FIGURE_GROUP,
    FORMULA_GROUP,
    HF_GROUP,
    LOOP_GROUP,
    PARALLEL,
    PIPELINE_GROUP,
    PLAN_GROUP,
    TARGET_GROUP,
    TRAINER_BATCH_GROUP,
    TRAINER_LOOP_GROUP,
    WRAPPER_GROUP,
    default,
    default_device,
    in_group,
    names,
)
from graphmem.units import parse_bytes

if TYPE_CHECKING:  # (torch is imported only when an option object is built)
    from graphmem.api import Analysis
    from graphmem.capture.hf import HFOptions
    from graphmem.capture.target import Target
    from graphmem.step.spec import Parallelism, StepSpec
    from graphmem.training.spec import Training

# a parser or one of its argument groups: what ``add_argument`` is called on
Arguments = argparse._ActionsContainer



def add_options(g: Arguments, group: str) -> None:
    """The flags of the step options the table declares in ``group`` (graphmem/step/options.py), each with its doc."""
    for o in in_group(group):
        g.add_argument(o.cli_flag, help=o.help, **o.cli)  # type: ignore[arg-type]


def add_model_arguments(p: argparse.ArgumentParser, shape_required: bool = True, real: bool = False,
                        job: bool = False) -> None:
    """``job``: MODEL and --input-shape may be left out for ``--torchtitan`` (graphmem/cli/titan.py checks)."""
    if job:
        shape_required = False
    p.add_argument("model", nargs="?" if job else None, help="a model file (defines `model`), a preset name (see `graphmem presets`), or a "
                   "Hugging Face hub id, config.json or model directory" + ("; built for real" if real else ""))
    p.add_argument("--input-shape", required=shape_required, metavar="SHAPE",
                   help="e.g. 32x1024 (tokens) or 8x3x224x224" + (" (keep it small: this allocates)" if real else ""))
    add_options(p.add_argument_group("Hugging Face models (pip install 'graphmem[hf]')"), HF_GROUP)


def add_step_arguments(p: argparse.ArgumentParser, job: bool = False) -> None:
    """The model, its target and its training step: what every command that analyzes a step takes
    (``job``: or a torchtitan job instead of the model: ``graphmem analyze --torchtitan``)."""
    add_model_arguments(p, job=job)
    add_target_arguments(p)
    add_training_arguments(p)


def add_debug_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def add_depth_argument(p: Arguments) -> None:
    """--depth of the module table (analyze's, compare's): a parser or an argument group."""
    p.add_argument("--depth", type=int, default=3, help="module table depth (default 3)")


def add_target_arguments(p: argparse.ArgumentParser) -> None:
    """--device/--dtype/--amp/--attention/--gpu/--mode/--memory-budget/--no-reuse."""
    g = p.add_argument_group("target")
    add_options(g, TARGET_GROUP)
    g.add_argument("--overhead", action="append", default=[], metavar="NAME=SIZE",
                   help="replace a device row's figure in the device total, e.g. cuda_context=600MiB (rows: "
                   "cuda_context, cublas_workspace, cudnn_workspace, nccl (each communicator), torch_distributed); "
                   "repeat for several")


def add_training_arguments(p: argparse.ArgumentParser) -> None:
    """The loop's options and how the step is split over ranks."""
    g = add_loop_arguments(p)
    add_parallel_arguments(p, g)


def add_loop_arguments(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The loop around forward and backward: optimizer, precision recipe, micro-batches, LoRA/QLoRA."""
    g = p.add_argument_group("training step (any of these adds the per-rank budget table)")
    add_options(g, LOOP_GROUP)
    add_trainer_loop_arguments(g)
    return g


def add_parallel_arguments(p: argparse.ArgumentParser, g: Arguments) -> None:
    """How the step is split: the per-rank formulas (in group ``g``) and rank r through the wrappers."""
    add_options(g, FORMULA_GROUP)
    add_options(p.add_argument_group("per rank through PyTorch's own wrappers (docs/distributed.md)"), WRAPPER_GROUP)


def add_trainer_loop_arguments(g: Arguments) -> None:
    """The loop options real trainers use (graphmem/training/loop_options.py, docs/loop.md)."""
    add_options(g, TRAINER_LOOP_GROUP)


def add_pipeline_arguments(p: argparse.ArgumentParser) -> None:
    add_options(p.add_argument_group("pipeline parallel (torch.distributed.pipelining's schedules, rank r's step)"),
                PIPELINE_GROUP)


def add_trainer_batch_arguments(p: argparse.ArgumentParser) -> None:
    """--train-dataset/--trainer-batch: the batch a Trainer's dataloader yields (with --training-args)."""
    add_options(p, TRAINER_BATCH_GROUP)


def check_pipeline_arguments(args: argparse.Namespace) -> None:
    """The pipeline options with analyze's others (the Pipeline itself is checked where the spec is built)."""
    if args.pp > 1 and (args.plan or args.formula or args.memory_budget is not None):
        raise UsageError("--pp reports one pipeline rank's step; --plan, --formula and --memory-budget do not "
                         "combine with it yet")


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpoint plans")
    add_options(g, PLAN_GROUP)
    add_figure_argument(g)


def add_figure_argument(g: Arguments) -> None:
    """--figure: which of the run's figures a verdict compares with the memory given."""
    add_options(g, FIGURE_GROUP)


def check_plan_arguments(args: argparse.Namespace, planning: bool) -> None:
    if not planning and (args.budget is not None or args.max_overhead is not None or args.selective is not False):
        raise UsageError("--budget, --max-overhead and --selective choose a checkpoint plan: add --plan")
    if args.selective is not True and args.selective is not False and args.selective < 1:
        raise UsageError("--selective takes a number of levels >= 1")
    if args.budget is not None and args.max_overhead is not None:
        raise UsageError("give --budget or --max-overhead, not both")
    if args.budget is not None:
        check_memory(args, args.budget, "--budget")  # a bad size fails before the analysis
    if args.points < 2:
        raise UsageError("--points must be at least 2")


def check_memory(args: argparse.Namespace, value: Optional[str], flag: str) -> None:
    """``value`` is a size, or ``gpu`` (or nothing, for a required one) on ``--device cuda``: the card's capacity
    (graphmem/capture/target.py ``CAPACITY``); a bad one fails before the analysis."""
    if value is None or str(value).strip().lower() == "gpu":
        if device_of(args) != "cuda":
            raise UsageError(f"give {flag} a size, e.g. {flag} 24GiB (`{flag} gpu`, the card's capacity, needs "
                             "--device cuda)")
        return
    parse_bytes(value)


def device_of(args: argparse.Namespace) -> str:
    """``--device``, or when not given the CPU's, but a ``--deepspeed`` job's GPUs (graphmem/step/options.py
    ``default_device``). (``validate`` declares its own ``--device``, default cpu: it runs the job for real here.)"""
    device = getattr(args, "device", None)
    return str(device) if device is not None else default_device(getattr(args, "deepspeed", None))


def target_of(args: argparse.Namespace) -> Target:
    """The frozen Target the target options name (checked once, here)."""
    from graphmem.capture.target import make_target

    budgets = memory_budgets_of(args)
    return make_target(device_of(args), args.dtype, args.amp, args.attention, args.gpu, args.mode,
                       budgets[0] if budgets else None)


def memory_budgets_of(args: argparse.Namespace) -> tuple[float, ...]:
    """The values of --memory-budget (none when not given), each checked to lie in [0, 1]."""
    if args.memory_budget is None:
        return ()
    from graphmem.planning.memory_budget import parse_budgets

    return parse_budgets(args.memory_budget)


class LoopOptions(TypedDict):
    """The loop's keyword options (graphmem/training/spec.py ``make_training``'s, ``graphmem.analyze``'s)."""

    optimizer: Optional[str]
    optimizer_impl: str
    master_weights: bool
    micro_batches: int
    lora_rank: Optional[int]
    lora_targets: Optional[str]
    lora_alpha: Optional[float]
    quantization: Optional[str]
    release_output: bool
    clip_grad_norm: Optional[float]
    clip_foreach: bool
    optimizer_in_backward: bool
    offload_activations: bool


def loop_options(args: argparse.Namespace) -> LoopOptions:
    """The loop options as ``graphmem.analyze``/``graphmem.validate`` keywords (checked where the spec is built)."""
    return dict(optimizer=args.optimizer, optimizer_impl=args.optimizer_impl, master_weights=args.master_weights,
                micro_batches=args.micro_batches, lora_rank=args.lora_rank, lora_targets=args.lora_targets,
                lora_alpha=args.lora_alpha, quantization=args.quantization, release_output=args.release_output,
                clip_grad_norm=args.clip_grad_norm, clip_foreach=args.clip_foreach,
                optimizer_in_backward=args.optimizer_in_backward, offload_activations=args.offload_activations)


def per_rank_options(args: argparse.Namespace) -> dict[str, Any]:  # (those given: any of validate's keywords)
    """The parallel options given on the command line (left at their defaults: none), as
    ``graphmem.validate`` keywords: any of them runs the ranks for real (graphmem/validation/ranks.py)."""
    kept = [k for k in names(PARALLEL) if k not in ("pp", "schedule")]  # (validate's: not its flags)
    return {k: getattr(args, k) for k in kept if getattr(args, k) != default(k)}


def training_of(args: argparse.Namespace) -> Training:
    """The frozen Training spec (the loop) the training options name (checked once, here)."""
    from graphmem.training.spec import make_training

    return make_training(args.dtype, **loop_options(args))


def parallel_of(args: argparse.Namespace, training: Training) -> Parallelism:
    """The parallel setting the options name (graphmem/step/spec.py ``make_parallelism`` decides which:
    a pipeline stage, rank r through the wrappers, or the per-rank formulas)."""
    from graphmem.step.spec import make_parallelism

    piped = vars(args)  # --pp and --schedule belong to analyze alone
    return make_parallelism(args.world_size, args.zero, args.fsdp, args.tp, args.sp, piped.get("pp", 1),
                            piped.get("schedule", "1f1b"), args.rank, args.reshard_after_forward, args.fsdp_param_dtype,
                            args.fsdp_reduce_dtype, args.fsdp_offload, args.fsdp_no_sync, args.loss_parallel, training,
                            piped.get("deepspeed"))


def hf_of(args: argparse.Namespace) -> HFOptions:
    """The frozen HFOptions (graphmem/capture/hf.py) the Hugging Face options name."""
    from graphmem.capture.hf import HFOptions

    return HFOptions(args.config, args.trust_remote_code, args.decoder_length, args.padding,
                     {"config": None, "on": True, "off": False}[args.use_cache])


def spec_of(args: argparse.Namespace, input_shape: Optional[str] = None, training: Optional[Training] = None,
            parallel: Optional[Parallelism] = None) -> StepSpec:
    """The command's StepSpec (graphmem/step/spec.py), built once from its arguments: its model, target,
    loop and parallel setting (or the given ``training``/``parallel``, for commands without those
    options)."""
    from graphmem.step.spec import make_spec

    training = training_of(args) if training is None else training
    return make_spec(args.model, input_shape=args.input_shape if input_shape is None else input_shape,
                     target=target_of(args), training=training,
                     parallel=parallel_of(args, training) if parallel is None else parallel,
                     reuse=not args.no_reuse, hf=hf_of(args))


def overheads_of(args: argparse.Namespace) -> dict[str, str]:
    """--overhead NAME=SIZE, as ``graphmem.analyze``'s ``overheads`` (names and sizes checked there)."""
    out = {}
    for item in vars(args).get("overhead") or []:
        name, eq, size = item.partition("=")
        if not eq or not name or not size:
            raise UsageError(f"--overhead takes NAME=SIZE, e.g. cuda_context=600MiB, not {item!r}")
        out[name.strip()] = size.strip()
    return out


def analyze_args(args: argparse.Namespace, input_shape: Optional[str] = None, training: Optional[Training] = None,
                 parallel: Optional[Parallelism] = None) -> Analysis:
    """``graphmem.analyze`` of the command's StepSpec (``spec_of``)."""
    from graphmem.api import analyze

    return analyze(spec_of(args, input_shape, training, parallel), overheads=overheads_of(args) or None)
