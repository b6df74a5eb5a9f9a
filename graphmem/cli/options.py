"""Options shared by the commands, declared once, and turned into the frozen objects the
library takes: a Target (graphmem/capture/target.py) and a Training spec
(graphmem/training/spec.py). Torch is imported only when an option object is built, so
``graphmem --help`` and usage errors answer fast. The choices below are the library's own
(tests/cli/test_cli_options.py checks they agree)."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, Optional, TypedDict

from graphmem.errors import UsageError
from graphmem.units import parse_bytes

if TYPE_CHECKING:  # (torch is imported only when an option object is built)
    from graphmem.api import Analysis
    from graphmem.capture.hf import HFOptions
    from graphmem.capture.target import Target
    from graphmem.step.spec import Parallelism, StepSpec
    from graphmem.training.spec import Training

# a parser or one of its argument groups: what ``add_argument`` is called on
Arguments = argparse._ActionsContainer

DEVICES = ("cpu", "cuda")
DTYPES = ("fp32", "bf16", "fp16")
AMP = ("bf16", "fp16")
ATTENTION = ("auto", "flash", "efficient", "cudnn", "math", "eager")
MODES = ("eager", "compiled", "compiled-blocks")
OPTIMIZERS = ("sgd", "momentum", "adam", "adamw", "adafactor", "adam8bit", "adamw8bit", "paged_adamw8bit")
IMPLS = ("auto", "foreach", "forloop", "fused")


def add_model_arguments(p: argparse.ArgumentParser, shape_required: bool = True, real: bool = False,
                        job: bool = False) -> None:
    """``job``: MODEL and --input-shape may be left out for ``--torchtitan`` (graphmem/cli/titan.py checks)."""
    if job:
        shape_required = False
    p.add_argument("model", nargs="?" if job else None, help="a model file (defines `model`), a preset name (see `graphmem presets`), or a "
                   "Hugging Face hub id, config.json or model directory" + ("; built for real" if real else ""))
    p.add_argument("--input-shape", required=shape_required, metavar="SHAPE",
                   help="e.g. 32x1024 (tokens) or 8x3x224x224" + (" (keep it small: this allocates)" if real else ""))
    g = p.add_argument_group("Hugging Face models (pip install 'graphmem[hf]')")
    g.add_argument("--config", metavar="PATH", help="the model's config.json (or its directory), instead of resolving "
                   "MODEL locally, in the cache or on the hub")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="allow a config that names the repository's own code (auto_map), as transformers does")
    g.add_argument("--decoder-length", type=int, metavar="T",
                   help="encoder-decoder models: the labels' length (default: the input length; speech models need it)")
    g.add_argument("--padding", choices=("none", "first-token"), default="none",
                   help="the attention mask of the batch made for --input-shape: none (all ones, as a tokenizer "
                   "gives equal-length sequences; default) or first-token (the first sequence's first token is padding)")
    g.add_argument("--use-cache", choices=("config", "on", "off"), default="config",
                   help="use_cache in the training step (default: as the model's config says, as from_pretrained "
                   "leaves it)")


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
    g.add_argument("--device", default="cpu", choices=DEVICES, help="target device (default cpu)")
    g.add_argument("--dtype", choices=DTYPES, help="parameter dtype (default: as built, fp32)")
    g.add_argument("--amp", choices=AMP, help="autocast with fp32 parameters")
    g.add_argument("--attention", default="auto", choices=ATTENTION,
                   help="SDPA backend (default auto: PyTorch's own choice for the target); a Hugging Face model runs "
                   "attn_implementation='sdpa' with it, or its own softmax attention with eager")
    g.add_argument("--gpu", default="h100", metavar="GPU",
                   help="the card (default h100): its CUDA rules (compute capability) and its capacity (--memory gpu): "
                   "v100, v100-32gb, t4, a100 (80GB), a100-40gb, a10, l4, h100, h200, b200")
    g.add_argument("--mode", default="eager", choices=MODES,
                   help="eager autograd (default), torch.compile's step (AOTAutograd, min-cut partition), shown beside eager, or "
                   "compiled-blocks: each block of the model's chain and the loss compiled, the loop eager (as torchtune compiles)")
    g.add_argument("--memory-budget", metavar="F[,F...]",
                   help="with --mode compiled: torch.compile's activation_memory_budget (0-1) for the partitioner; "
                   "several values, e.g. 1,0.8,0.5,0.2, also print a sweep table (the report is at the first value)")
    g.add_argument("--overhead", action="append", default=[], metavar="NAME=SIZE",
                   help="replace a device row's figure in the device total, e.g. cuda_context=600MiB (rows: "
                   "cuda_context, cublas_workspace, cudnn_workspace, nccl (each communicator), torch_distributed); "
                   "repeat for several")
    g.add_argument("--no-reuse", action="store_true",
                   help="capture every block of a deep chain (default: 5 captured and copied, checked at depth 6; "
                   "with --mode compiled, also that the partition repeats at full depth)")


def add_training_arguments(p: argparse.ArgumentParser) -> None:
    """The loop's options and how the step is split over ranks."""
    g = add_loop_arguments(p)
    add_parallel_arguments(p, g)


def add_loop_arguments(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The loop around forward and backward: optimizer, precision recipe, micro-batches, LoRA/QLoRA."""
    g = p.add_argument_group("training step (any of these adds the per-rank budget table)")
    g.add_argument("--optimizer", choices=OPTIMIZERS, help="run this optimizer after backward, then zero_grad: torch.optim, or bitsandbytes' 8-bit Adam (adam8bit, adamw8bit, paged_adamw8bit)")
    g.add_argument("--optimizer-impl", default="auto", choices=IMPLS,
                   help="auto (torch.optim's choice on the target: foreach on cuda, for-loop on cpu), foreach, forloop, fused")
    g.add_argument("--master-weights", action="store_true",
                   help="fp32 master copy of the 16-bit parameters for the optimizer (with --dtype bf16/fp16: ZeRO's 16-psi recipe)")
    g.add_argument("--micro-batches", type=int, default=1, metavar="K", help="gradient accumulation: K micro-steps of --input-shape")
    g.add_argument("--lora-rank", type=int, metavar="R", help="LoRA adapters of rank R; every other parameter frozen")
    g.add_argument("--lora-targets", metavar="NAMES", help="comma-separated module-name substrings of the layers to "
                   "adapt, e.g. q_proj,v_proj or c_attn,c_proj, or all-linear (Hugging Face models: through peft)")
    g.add_argument("--lora-alpha", type=float, metavar="A", help="LoRA alpha (default 8, peft's; memory does not depend on it)")
    g.add_argument("--qlora", dest="quantization", action="store_const", const="nf4",
                   help="QLoRA: the linear layers in 4-bit NF4 with double quantization and bf16 compute through "
                   "bitsandbytes (Hugging Face models, with --lora-rank; pip install 'graphmem[qlora]')")
    add_trainer_loop_arguments(g)
    return g


def add_parallel_arguments(p: argparse.ArgumentParser, g: Arguments) -> None:
    """How the step is split: the per-rank formulas (in group ``g``) and rank r through the wrappers."""
    g.add_argument("--world-size", type=int, default=1, metavar="N", help="ranks (data parallel x tensor parallel)")
    g.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="DeepSpeed ZeRO stage over the data-parallel ranks")
    g.add_argument("--fsdp", nargs="?", const="fully_shard", choices=["fully_shard", "full", "grad-op"],
                   help="alone: rank --rank's step through PyTorch's fully_shard (FSDP2) per block; full (FULL_SHARD) "
                   "or grad-op (SHARD_GRAD_OP): the per-rank formula over the single-device step")
    g.add_argument("--tp", type=int, default=1, metavar="T", help="tensor-parallel size: with --rank, DTensor's "
                   "parallelize_module runs; without, Megatron's column/row split of the graph's linears (formula)")
    g.add_argument("--sp", action="store_true", help="sequence parallel with --tp: the tensors outside the TP regions split too")
    d = p.add_argument_group("per rank through PyTorch's own wrappers (docs/distributed.md)")
    d.add_argument("--rank", type=int, metavar="R", help="analyze rank R's step as fully_shard / parallelize_module run "
                   "it under a fake process group of --world-size ranks (bare --fsdp implies --rank 0); with "
                   "--training-args, rank R of the Trainer's DDP job")
    d.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false",
                   help="fully_shard(reshard_after_forward=False): keep each block's gathered parameters until backward")
    d.add_argument("--fsdp-param-dtype", choices=["fp32", "bf16", "fp16"], help="MixedPrecisionPolicy(param_dtype=...)")
    d.add_argument("--fsdp-reduce-dtype", choices=["fp32", "bf16", "fp16"], help="MixedPrecisionPolicy(reduce_dtype=...)")
    d.add_argument("--fsdp-offload", action="store_true", help="CPUOffloadPolicy: sharded parameters and gradients in host memory")
    d.add_argument("--fsdp-no-sync", action="store_true", help="with --micro-batches: set_requires_gradient_sync(False) for "
                   "all but the last micro-batch (unsharded gradients accumulate; one reduce-scatter per step)")
    d.add_argument("--deepspeed", metavar="DS_CONFIG", help="a DeepSpeed config (JSON): rank --rank of --world-size "
                   "through DeepSpeed's own engine (deepspeed.initialize, engine.backward, engine.step) on fake tensors; "
                   "with offload_optimizer/offload_param to \"cpu\" (and zero_force_ds_cpu_optimizer false) the notes give "
                   "its host (pinned) and host (pageable) bytes (docs/deepspeed.md)")
    d.add_argument("--loss-parallel", action="store_true", help="with --tp: the LM head's logits stay split over the "
                   "vocabulary into torch's loss_parallel() cross-entropy (torchtitan's default), not gathered whole")


def add_trainer_loop_arguments(g: Arguments) -> None:
    """The loop options real trainers use (graphmem/training/loop_options.py, docs/loop.md)."""
    g.add_argument("--release-output", action="store_true", help="drop the model's output before backward, keep only "
                   "the loss (HF Trainer's compute_loss, torchtune's del logits)")
    g.add_argument("--clip-grad-norm", type=float, metavar="MAX", help="torch.nn.utils.clip_grad_norm_(params, MAX) "
                   "before the optimizer step")
    g.add_argument("--no-clip-foreach", dest="clip_foreach", action="store_false",
                   help="clip_grad_norm_(foreach=False): one norm per gradient instead of one _foreach_norm")
    g.add_argument("--optimizer-in-backward", action="store_true", help="per-parameter optimizers stepped from "
                   "post-accumulate-grad hooks in backward, each gradient freed right after (torchtune)")
    g.add_argument("--offload-activations", action="store_true", help="the forward's saved tensors to host memory "
                   "and back in backward (torch.autograd.graph.save_on_cpu's hooks); host bytes reported apart")


def add_pipeline_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("pipeline parallel (torch.distributed.pipelining's schedules, rank r's step)")
    g.add_argument("--pp", type=int, default=1, metavar="P", help="pipeline ranks: the chain of blocks split evenly "
                   "over P stages; the report is rank --rank's (default 0; --micro-batches: the schedule's micro-batches)")
    g.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe", "interleaved"],
                   help="Schedule1F1B, ScheduleGPipe or ScheduleInterleaved1F1B (two stages per rank)")


def add_trainer_batch_arguments(p: argparse.ArgumentParser) -> None:
    """--train-dataset/--trainer-batch: the batch a Trainer's dataloader yields (with --training-args)."""
    p.add_argument("--train-dataset", metavar="PATH",
                   help="with --training-args: the Trainer's train_dataset (a JSON Lines file of samples, or a "
                        "directory saved by datasets' save_to_disk); without --input-shape the step runs the "
                        "first batch train() draws from it")
    p.add_argument("--trainer-batch", choices=["first", "longest"], default="first",
                   help="with --train-dataset: the first batch train() draws (default), or the longest of the "
                        "run's (a padding collator's worst case)")


def check_pipeline_arguments(args: argparse.Namespace) -> None:
    """The pipeline options with analyze's others (the Pipeline itself is checked where the spec is built)."""
    if args.pp > 1 and (args.plan or args.formula or args.memory_budget is not None):
        raise UsageError("--pp reports one pipeline rank's step; --plan, --formula and --memory-budget do not "
                         "combine with it yet")


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpoint plans")
    g.add_argument("--budget", metavar="MEM", help="memory budget for the step's peak, e.g. 40GiB (gpu: the --gpu "
                   "card's capacity, on --device cuda): the plan with the fewest recompute FLOPs that fits")
    g.add_argument("--max-overhead", metavar="PCT", help="recompute cap, e.g. 20%%: the plan with the lowest peak "
                   "whose recompute stays within it")
    g.add_argument("--selective", nargs="?", const=True, default=False, type=int, metavar="LEVELS",
                   help="selective checkpointing: a checkpointed segment may also keep some ops' outputs (the knapsack's "
                   "choice at LEVELS memory levels, default 3), measured like plain checkpointing")
    g.add_argument("--points", type=int, default=50, help="budgets tried for the Pareto frontier (default 50)")
    add_figure_argument(g)


def add_figure_argument(g: Arguments) -> None:
    """--figure: which of the run's figures a verdict compares with the memory given."""
    g.add_argument("--figure", choices=("allocated", "reserved", "device"),
                   help="the run's figure compared with the budget: allocated (max_memory_allocated), reserved "
                   "(max_memory_reserved) or device (reserved + CUDA context, cuBLAS, NCCL: nvidia-smi); default "
                   "device on --device cuda, allocated on cpu (no caching allocator, no device rows)")


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
        if getattr(args, "device", "cpu") != "cuda":
            raise UsageError(f"give {flag} a size, e.g. {flag} 24GiB (`{flag} gpu`, the card's capacity, needs "
                             "--device cuda)")
        return
    parse_bytes(value)


def target_of(args: argparse.Namespace) -> Target:
    """The frozen Target the target options name (checked once, here)."""
    from graphmem.capture.target import make_target

    budgets = memory_budgets_of(args)
    return make_target(args.device, args.dtype, args.amp, args.attention, args.gpu, args.mode,
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
    defaults = {"world_size": 1, "zero": 0, "fsdp": None, "tp": 1, "sp": False, "rank": None,
                "reshard_after_forward": True, "fsdp_param_dtype": None, "fsdp_reduce_dtype": None,
                "fsdp_offload": False, "fsdp_no_sync": False, "loss_parallel": False}
    return {k: getattr(args, k) for k, d in defaults.items() if getattr(args, k) != d}


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
