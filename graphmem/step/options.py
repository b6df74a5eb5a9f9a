"""The step's option vocabulary, in one typed table: each option's keyword (``graphmem.analyze``'s), which of the
spec's builders takes it, its command-line flag with the flag's argparse settings, and its doc (the CLI's help).
graphmem/step/spec.py reads the builders' keyword sets from it, graphmem/cli/options.py declares the flags from it,
graphmem/cli/flags.py rewrites an error's ```option=value``` into the flag from it (tests/cli/test_cli_options.py checks
that each flag is the parser's and each keyword ``make_spec``'s). The choices are the library's own (the targets',
optimizers' and implementations' lists in the modules that check them)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

# which builder takes the keyword (graphmem/step/spec.py ``make_spec``), or which question: PLAN, ``Analysis.plans``
# (and ``plan``; ``figure`` advise's too); TRAINER, a Trainer's batch (graphmem/frontends/trainer.py)
SPEC, HF, TARGET, TRAINING, PARALLEL, PLAN, TRAINER = "spec", "hf", "target", "training", "parallel", "plan", "trainer"
# the command line's argument groups (graphmem/cli/options.py; a command's own flags are its own)
HF_GROUP, TARGET_GROUP, LOOP_GROUP, TRAINER_LOOP_GROUP = "hf", "target", "loop", "trainer loop"
FORMULA_GROUP, WRAPPER_GROUP, PIPELINE_GROUP = "formula", "wrappers", "pipeline"
PLAN_GROUP, FIGURE_GROUP, TRAINER_BATCH_GROUP = "plan", "figure", "trainer batch"

DEVICES = ("cpu", "cuda")
DTYPES = ("fp32", "bf16", "fp16")
AMP = ("bf16", "fp16")
ATTENTION = ("auto", "flash", "efficient", "cudnn", "math", "eager")
MODES = ("eager", "compiled", "compiled-blocks")
OPTIMIZERS = ("sgd", "momentum", "adam", "adamw", "adafactor", "adam8bit", "adamw8bit", "paged_adamw8bit")
IMPLS = ("auto", "foreach", "forloop", "fused")


@dataclass(frozen=True)
class Option:
    name: str  # the keyword graphmem.analyze (make_spec) takes
    takes: str  # the builder that takes it: SPEC, HF, TARGET, TRAINING or PARALLEL
    group: str  # the command line's argument group that declares its flag
    help: str  # its doc: what it sets
    cli: Mapping[str, object] = field(default_factory=dict)  # the flag's argparse settings (type, default, choices...)
    flag: str = ""  # its flag, where not ``--`` + the name with dashes
    negated: bool = False  # the flag sets the keyword False (``reuse=False`` is ``--no-reuse``)
    bare: Optional[str] = None  # the value a bare flag stands for (``fsdp='fully_shard'`` is bare ``--fsdp``)

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")


OPTIONS: tuple[Option, ...] = (
    # Hugging Face models (graphmem/capture/hf.py HFOptions)
    Option("config", HF, HF_GROUP, "the model's config.json (or its directory), instead of resolving MODEL locally, in "
           "the cache or on the hub", {"metavar": "PATH"}),
    Option("trust_remote_code", HF, HF_GROUP, "allow a config that names the repository's own code (auto_map), as "
           "transformers does", {"action": "store_true"}),
    Option("decoder_length", HF, HF_GROUP, "encoder-decoder models: the labels' length (default: the input length; "
           "speech models need it)", {"type": int, "metavar": "T"}),
    Option("padding", HF, HF_GROUP, "the attention mask of the batch made for --input-shape: none (all ones, as a "
           "tokenizer gives equal-length sequences; default) or first-token (the first sequence's first token is "
           "padding)", {"choices": ("none", "first-token"), "default": "none"}),
    Option("use_cache", HF, HF_GROUP, "use_cache in the training step (default: as the model's config says, as "
           "from_pretrained leaves it)", {"choices": ("config", "on", "off"), "default": "config"}),
    # the target (graphmem/capture/target.py make_target)
    Option("device", TARGET, TARGET_GROUP, "target device (default cpu; cuda for a --deepspeed job, whose ranks are "
           "GPUs: graphmem/step/spec.py default_device)", {"choices": DEVICES}),
    Option("dtype", TARGET, TARGET_GROUP, "parameter dtype (default: as built, fp32)", {"choices": DTYPES}),
    Option("amp", TARGET, TARGET_GROUP, "autocast with fp32 parameters", {"choices": AMP}),
    Option("attention", TARGET, TARGET_GROUP, "SDPA backend (default auto: PyTorch's own choice for the target); a "
           "Hugging Face model runs attn_implementation='sdpa' with it, or its own softmax attention with eager",
           {"default": "auto", "choices": ATTENTION}),
    Option("gpu", TARGET, TARGET_GROUP, "the card (default h100): its CUDA rules (compute capability) and its capacity "
           "(--memory gpu): v100, v100-32gb, t4, a100 (80GB), a100-40gb, a10, l4, h100, h200, b200",
           {"default": "h100", "metavar": "GPU"}),
    Option("mode", TARGET, TARGET_GROUP, "eager autograd (default), torch.compile's step (AOTAutograd, min-cut "
           "partition), shown beside eager, or compiled-blocks: each block of the model's chain and the loss compiled, "
           "the loop eager (as torchtune compiles)", {"default": "eager", "choices": MODES}),
    Option("memory_budget", TARGET, TARGET_GROUP, "with --mode compiled: torch.compile's activation_memory_budget (0-1) "
           "for the partitioner; several values, e.g. 1,0.8,0.5,0.2, also print a sweep table (the report is at the "
           "first value)", {"metavar": "F[,F...]"}),
    Option("reuse", SPEC, TARGET_GROUP, "capture every block of a deep chain (default: 5 captured and copied, checked "
           "at depth 6; with --mode compiled, also that the partition repeats at full depth)",
           {"action": "store_true"}, flag="--no-reuse", negated=True),
    # the loop (graphmem/training/spec.py make_training)
    Option("optimizer", TRAINING, LOOP_GROUP, "run this optimizer after backward, then zero_grad: torch.optim, or "
           "bitsandbytes' 8-bit Adam (adam8bit, adamw8bit, paged_adamw8bit)", {"choices": OPTIMIZERS}),
    Option("optimizer_impl", TRAINING, LOOP_GROUP, "auto (torch.optim's choice on the target: foreach on cuda, for-loop "
           "on cpu), foreach, forloop, fused", {"default": "auto", "choices": IMPLS}),
    Option("master_weights", TRAINING, LOOP_GROUP, "fp32 master copy of the 16-bit parameters for the optimizer (with "
           "--dtype bf16/fp16: ZeRO's 16-psi recipe)", {"action": "store_true"}),
    Option("micro_batches", TRAINING, LOOP_GROUP, "gradient accumulation: K micro-steps of --input-shape",
           {"type": int, "default": 1, "metavar": "K"}),
    Option("lora_rank", TRAINING, LOOP_GROUP, "LoRA adapters of rank R; every other parameter frozen",
           {"type": int, "metavar": "R"}),
    Option("lora_targets", TRAINING, LOOP_GROUP, "comma-separated module-name substrings of the layers to adapt, e.g. "
           "q_proj,v_proj or c_attn,c_proj, or all-linear (Hugging Face models: through peft)", {"metavar": "NAMES"}),
    Option("lora_alpha", TRAINING, LOOP_GROUP, "LoRA alpha (default 8, peft's; memory does not depend on it)",
           {"type": float, "metavar": "A"}),
    Option("quantization", TRAINING, LOOP_GROUP, "QLoRA: the linear layers in 4-bit NF4 with double quantization and "
           "bf16 compute through bitsandbytes (Hugging Face models, with --lora-rank; pip install 'graphmem[qlora]')",
           {"dest": "quantization", "action": "store_const", "const": "nf4"}, flag="--qlora", bare="nf4"),
    Option("release_output", TRAINING, TRAINER_LOOP_GROUP, "drop the model's output before backward, keep only the loss "
           "(HF Trainer's compute_loss, torchtune's del logits)", {"action": "store_true"}),
    Option("clip_grad_norm", TRAINING, TRAINER_LOOP_GROUP, "torch.nn.utils.clip_grad_norm_(params, MAX) before the "
           "optimizer step", {"type": float, "metavar": "MAX"}),
    Option("clip_foreach", TRAINING, TRAINER_LOOP_GROUP, "clip_grad_norm_(foreach=False): one norm per gradient instead "
           "of one _foreach_norm", {"dest": "clip_foreach", "action": "store_false"}, flag="--no-clip-foreach",
           negated=True),
    Option("optimizer_in_backward", TRAINING, TRAINER_LOOP_GROUP, "per-parameter optimizers stepped from "
           "post-accumulate-grad hooks in backward, each gradient freed right after (torchtune)", {"action": "store_true"}),
    Option("offload_activations", TRAINING, TRAINER_LOOP_GROUP, "the forward's saved tensors to host memory and back "
           "in backward (torch.autograd.graph.save_on_cpu's hooks); host bytes reported apart", {"action": "store_true"}),
    # how the step is split (graphmem/step/spec.py make_parallelism): the per-rank formulas
    Option("world_size", PARALLEL, FORMULA_GROUP, "ranks (data parallel x tensor parallel)",
           {"type": int, "default": 1, "metavar": "N"}),
    Option("zero", PARALLEL, FORMULA_GROUP, "DeepSpeed ZeRO stage over the data-parallel ranks",
           {"type": int, "default": 0, "choices": (0, 1, 2, 3)}),
    Option("fsdp", PARALLEL, FORMULA_GROUP, "alone: rank --rank's step through PyTorch's fully_shard (FSDP2) per "
           "block; full (FULL_SHARD) or grad-op (SHARD_GRAD_OP): the per-rank formula over the single-device step",
           {"nargs": "?", "const": "fully_shard", "choices": ("fully_shard", "full", "grad-op")}, bare="fully_shard"),
    Option("tp", PARALLEL, FORMULA_GROUP, "tensor-parallel size: with --rank, DTensor's parallelize_module runs; "
           "without, Megatron's column/row split of the graph's linears (formula)",
           {"type": int, "default": 1, "metavar": "T"}),
    Option("sp", PARALLEL, FORMULA_GROUP, "sequence parallel with --tp: the tensors outside the TP regions split too",
           {"action": "store_true"}),
    # rank r through the wrappers
    Option("rank", PARALLEL, WRAPPER_GROUP, "analyze rank R's step as fully_shard / parallelize_module run it under a "
           "fake process group of --world-size ranks (bare --fsdp implies --rank 0); with --training-args, rank R of "
           "the Trainer's DDP job", {"type": int, "metavar": "R"}),
    Option("reshard_after_forward", PARALLEL, WRAPPER_GROUP, "fully_shard(reshard_after_forward=False): keep each "
           "block's gathered parameters until backward", {"dest": "reshard_after_forward", "action": "store_false"},
           flag="--no-reshard-after-forward", negated=True),
    Option("fsdp_param_dtype", PARALLEL, WRAPPER_GROUP, "MixedPrecisionPolicy(param_dtype=...)", {"choices": DTYPES}),
    Option("fsdp_reduce_dtype", PARALLEL, WRAPPER_GROUP, "MixedPrecisionPolicy(reduce_dtype=...)", {"choices": DTYPES}),
    Option("fsdp_offload", PARALLEL, WRAPPER_GROUP, "CPUOffloadPolicy: sharded parameters and gradients in host memory",
           {"action": "store_true"}),
    Option("fsdp_no_sync", PARALLEL, WRAPPER_GROUP, "with --micro-batches: set_requires_gradient_sync(False) for all but "
           "the last micro-batch (unsharded gradients accumulate; one reduce-scatter per step)", {"action": "store_true"}),
    Option("deepspeed", PARALLEL, WRAPPER_GROUP, "a DeepSpeed config (JSON): rank --rank of --world-size through "
           "DeepSpeed's own engine (deepspeed.initialize, engine.backward, engine.step) on fake tensors; with "
           "offload_optimizer/offload_param to \"cpu\" (and zero_force_ds_cpu_optimizer false) the budget's host "
           "(pinned) and host (pageable) rows, outside the GPU's figures with --device cuda (docs/deepspeed.md)",
           {"metavar": "DS_CONFIG"}),
    Option("loss_parallel", PARALLEL, WRAPPER_GROUP, "with --tp: the LM head's logits stay split over the vocabulary "
           "into torch's loss_parallel() cross-entropy (torchtitan's default), not gathered whole",
           {"action": "store_true"}),
    # pipeline parallel (torch.distributed.pipelining)
    Option("pp", PARALLEL, PIPELINE_GROUP, "pipeline ranks: the chain of blocks split evenly over P stages; the report "
           "is rank --rank's (default 0; --micro-batches: the schedule's micro-batches)",
           {"type": int, "default": 1, "metavar": "P"}),
    Option("schedule", PARALLEL, PIPELINE_GROUP, "Schedule1F1B, ScheduleGPipe or ScheduleInterleaved1F1B (two stages "
           "per rank)", {"default": "1f1b", "choices": ("1f1b", "gpipe", "interleaved")}),
    # checkpoint plans (graphmem/report/live.py Analysis.plans)
    Option("budget", PLAN, PLAN_GROUP, "memory budget for the step's peak, e.g. 40GiB (gpu: the --gpu card's capacity, "
           "on --device cuda): the plan with the fewest recompute FLOPs that fits", {"metavar": "MEM"}),
    Option("max_overhead", PLAN, PLAN_GROUP, "recompute cap, e.g. 20%%: the plan with the lowest peak whose recompute "
           "stays within it", {"metavar": "PCT"}),
    Option("selective", PLAN, PLAN_GROUP, "selective checkpointing: a checkpointed segment may also keep some ops' "
           "outputs (the knapsack's choice at LEVELS memory levels, default 3), measured like plain checkpointing",
           {"nargs": "?", "const": True, "default": False, "type": int, "metavar": "LEVELS"}),
    Option("points", PLAN, PLAN_GROUP, "budgets tried for the Pareto frontier (default 50)", {"type": int, "default": 50}),
    Option("figure", PLAN, FIGURE_GROUP, "the run's figure compared with the budget: allocated (max_memory_allocated), "
           "reserved (max_memory_reserved) or device (reserved + CUDA context, cuBLAS, NCCL: nvidia-smi); default "
           "device on --device cuda, allocated on cpu (no caching allocator, no device rows)",
           {"choices": ("allocated", "reserved", "device")}),
    # a Trainer's batch (--training-args)
    Option("train_dataset", TRAINER, TRAINER_BATCH_GROUP, "with --training-args: the Trainer's train_dataset (a JSON "
           "Lines file of samples, or a directory saved by datasets' save_to_disk); without --input-shape the step runs "
           "the first batch train() draws from it", {"metavar": "PATH"}),
    Option("trainer_batch", TRAINER, TRAINER_BATCH_GROUP, "with --train-dataset: the first batch train() draws "
           "(default), or the longest of the run's (a padding collator's worst case)",
           {"choices": ("first", "longest"), "default": "first"}),
)
_BY_NAME = {o.name: o for o in OPTIONS}


def names(takes: str) -> tuple[str, ...]:
    """The keywords builder ``takes`` takes, in the table's order."""
    return tuple(o.name for o in OPTIONS if o.takes == takes)


def in_group(group: str) -> tuple[Option, ...]:
    """The options the command line declares in argument group ``group``, in the table's order."""
    return tuple(o for o in OPTIONS if o.group == group)


def default(name: str) -> object:
    """The keyword's value when its flag is not given: its argparse default, a switch's off value (``--no-reuse``
    unset: ``reuse=True``), else None."""
    o = _BY_NAME[name]
    action = o.cli.get("action")
    if "default" in o.cli:
        return o.cli["default"]
    if action == "store_true":
        return o.negated
    return True if action == "store_false" else None


def default_device(deepspeed: object = None) -> str:
    """The target's device when none is given: the CPU's, but a DeepSpeed job's ranks are GPUs, so its step is
    analyzed on the CUDA target (its kernel rules, the caching allocator, the device total), as a torchtitan
    job's is (graphmem/frontends/titan_job.py); ``device='cpu'`` analyzes the job's CPU run (DeepSpeed's CPU
    accelerator), which graphmem.validate runs for real. A job whose config offloads ZeRO-3's parameters
    (``offload_param``) stays on the CPU target, which runs it (the CUDA target does not yet: graphmem/deepspeed/
    config.py ``check_cuda``; its report says so)."""
    if deepspeed is None:
        return "cpu"
    from graphmem.deepspeed.config import offloads_parameters  # (torch's import: not for --help)

    return "cpu" if offloads_parameters(deepspeed) else "cuda"


__all__ = ["AMP", "ATTENTION", "DEVICES", "DTYPES", "IMPLS", "MODES", "OPTIMIZERS", "OPTIONS", "Option", "default", "default_device",
           "in_group", "names"]
