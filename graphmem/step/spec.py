"""The step as one value: ``StepSpec``, everything one training step is made from, frozen and
checked where it is built. ``graphmem.analyze(model, inputs, **options)``, the CLI (once, from its
arguments) and advise's levers (``dataclasses.replace`` on a spec) all build one;
graphmem/step/measure.py's ``measure`` is the one function that captures it.

The parallel setting is one sum type, ``Parallelism``:

- ``Single()``: one device;
- ``Formula(layout)``: the single-device step, with per-rank budgets from the formulas
  (passes/budget.py: ZeRO 1-3, FSDP full/grad-op, Megatron TP/SP over ``layout.world_size`` ranks);
- ``Ranks(sharding)``: rank r's step through PyTorch's own wrappers under a fake process group
  (``fully_shard``, ``parallelize_module`` TP/SP, ``loss_parallel``: graphmem/distributed/);
- ``Stages(pipeline)``: pipeline rank r's step under torch.distributed.pipelining's schedule;
- ``Job(config, world_size, rank)``: rank r of a torchtitan job, built and stepped by the job's
  own code (graphmem/titan/).

>>> import torch, graphmem
>>> from graphmem.step.spec import make_spec
>>> net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
>>> spec = make_spec(net, (torch.randn(8, 16),), optimizer="adamw")
>>> graphmem.analyze(spec).activation_bytes
1536
"""
from __future__ import annotations

import dataclasses
import inspect
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, TypedDict, Union

import torch
import torch.nn as nn

from graphmem.capture.fakes import Inputs as Batchlike
from graphmem.capture.hf import HFOptions
from graphmem.capture.hf import batch as hf_inputs
from graphmem.capture.hf_batch import settings as hf_settings
from graphmem.capture.load import Loaded, from_exported, load, make_inputs, parse_shape
from graphmem.capture.target import Target, make_target
from graphmem.deepspeed.config import DeepSpeedJob, make_job
from graphmem.deepspeed.trainer import TrainerDeepSpeed
from graphmem.distributed.pipeline import Pipeline, make_pipeline
from graphmem.distributed.pipeline_stages import Layout
from graphmem.distributed.spec import Sharding, check_training, make_sharding, wants_wrappers
from graphmem.errors import UsageError, check_keywords
from graphmem.passes.budget import Parallel, make_parallel
from graphmem.step.options import PARALLEL, TARGET, default_device, names
from graphmem.training.batch import Batch, as_batch, resizer
from graphmem.training.hf_trainer_ddp import TrainerDDP
from graphmem.training.hf_trainer_fsdp import TrainerShards
from graphmem.training.peft_lora import is_hf_model
from graphmem.training.spec import Training, make_training
from graphmem.training.step import LossFn

if TYPE_CHECKING:
    from typing import Unpack  # (Python 3.11; graphmem runs on 3.10)

    from torchtitan.trainer import Trainer as TitanTrainer

ModelLike = Union[nn.Module, str, "os.PathLike[str]"]
# a batch as the user gives it: what graphmem/training/batch.py as_batch reads (a BatchEncoding is a Mapping)
UserInputs = Union[torch.Tensor, tuple, list, Mapping[str, object], Batch]


@dataclass(frozen=True)
class Single:
    """One device: no parallelism."""

    formula = Parallel()  # no per-rank formula

    def describe(self) -> str:
        return "one device"

    def check(self, spec: "StepSpec") -> None:
        """Nothing beyond the target's and the loop's own checks."""


@dataclass(frozen=True)
class Formula:
    """The single-device step captured once; each rank's budget from the formulas over it."""

    formula: Parallel  # world size, ZeRO stage or FSDP strategy, tensor/sequence parallel (passes/budget.py)

    def describe(self) -> str:
        return self.formula.describe()

    def check(self, spec: "StepSpec") -> None:
        if spec.training.quantization is not None:
            raise UsageError("`qlora` is analyzed on one device: drop `world_size`/`zero`/`fsdp`/`tp`")


@dataclass(frozen=True)
class Ranks:
    """Rank ``sharding.rank``'s step through PyTorch's wrappers under a fake process group."""

    sharding: Sharding  # fully_shard and its policies, TP/SP, loss parallel (graphmem/distributed/spec.py)
    formula = Parallel()  # the wrappers split the step itself: no formula over it

    def describe(self) -> str:
        return f"rank {self.sharding.rank} of {self.sharding.world_size}"

    def check(self, spec: "StepSpec") -> None:
        check_training(spec.training, self.sharding.no_sync)  # what of the loop runs over DTensor parameters
        if spec.training.train.loop_options:
            raise UsageError(f"{', '.join(f'`{o}`' for o in spec.training.train.loop_options)}: analyzed on one device "
                             "only yet; drop them, or drop `rank` and `fsdp`")
        if spec.target.mode != "eager":
            raise UsageError("the per-rank step runs the wrappers eagerly: use `mode='eager'`, or the formulas "
                             "(`zero`, `fsdp='full'` or `tp` without `rank`)")
        if self.sharding.offload and spec.target.device == "cuda":
            raise UsageError("`fsdp_offload` on `device='cuda'` is not modelled yet: the CUDA target runs on CPU fake "
                             "tensors, where CPUOffloadPolicy's host-to-device copies do not appear")


@dataclass(frozen=True)
class Stages:
    """Pipeline rank ``pipeline.rank``'s step under torch.distributed.pipelining's schedule."""

    pipeline: Pipeline  # stages, rank, schedule and its micro-batches (graphmem/distributed/pipeline_stages.py)
    split: Optional[Layout] = field(default=None, compare=False)  # the split another rank probed, reused
    formula = Parallel()  # the schedule splits the step itself: no formula over it

    def describe(self) -> str:
        return self.pipeline.describe()

    def check(self, spec: "StepSpec") -> None:
        tr = spec.training
        if tr.lora is not None or tr.quantization is not None or tr.train.master_weights \
                or spec.target.mode != "eager" or tr.train.loop_options:
            raise UsageError("a pipeline stage (`pp` > 1) runs one pipeline rank's schedule and its optimizer; it does "
                             "not combine with `lora_rank`, `qlora`, `master_weights`, `mode='compiled'` or the loop "
                             "options (`release_output`, `clip_grad_norm`, `optimizer_in_backward`, "
                             "`offload_activations`) yet")


@dataclass(frozen=True)
class Job:
    """Rank ``rank`` of a torchtitan job over ``world_size`` ranks, built and stepped by the job's
    own code (graphmem/titan/): its parallelism is the job config's."""

    config: TitanTrainer.Config = field(compare=False, repr=False)  # the job's config (graphmem/titan/job.py)
    world_size: int = 1
    rank: int = 0
    formula = Parallel()  # the job splits the step itself: no formula over it

    def describe(self) -> str:
        p = self.config.parallelism
        degrees = [f"{n} {d}" for n, d in (("dp_replicate", p.data_parallel_replicate_degree),
                                            ("dp_shard", p.data_parallel_shard_degree), ("tp", p.tensor_parallel_degree),
                                            ("pp", p.pipeline_parallel_degree), ("cp", p.context_parallel_degree),
                                            ("ep", p.expert_parallel_degree))
                   if d not in (1, 0)]
        return f"torchtitan job, rank {self.rank} of {self.world_size} ({', '.join(degrees) or 'one device'})"

    def check(self, spec: "StepSpec") -> None:
        if not 0 <= self.rank < self.world_size:
            raise UsageError(f"`rank={self.rank}` is not one of the job's {self.world_size} ranks: use 0 to "
                             f"{self.world_size - 1}")
        if spec.target.mode != "eager":
            raise UsageError("a torchtitan job's compile setting is its own (`compile.enable` in its config): drop "
                             "`mode='compiled'`")
        p = self.config.parallelism
        if p.context_parallel_degree > 1 and spec.target.device == "cpu":
            raise UsageError("context parallel runs on the CUDA target only: torch's ring attention handles CUDA's "
                             "SDPA kernels (torch/distributed/tensor/experimental/_context_parallel/_attention.py) and "
                             "FlexAttention has no CPU backward, so the job fails on a CPU too: analyze with "
                             "`device='cuda'`")


# every way a step is split: a Trainer's DDP rank (TrainerDDP, graphmem/training/hf_trainer_ddp.py) and FSDP2 rank
# (TrainerShards, graphmem/training/hf_trainer_fsdp.py), a DeepSpeed engine's rank (DeepSpeedJob,
# graphmem/deepspeed/config.py) and a Trainer's DeepSpeed rank (TrainerDeepSpeed) are variants too
Parallelism = Union[Single, Formula, Ranks, Stages, Job, DeepSpeedJob, TrainerDDP, TrainerShards, TrainerDeepSpeed]


@dataclass(frozen=True)
class Inputs:
    """How the step's batch is made: ``make(shape)`` at any first-input shape (formulas, fits and
    sweeps vary it); ``shape`` is the analyzed one."""

    make: Callable[[tuple[int, ...]], Union[tuple, dict, Batch]] = field(compare=False)  # shape -> a tuple, dict or (args, kwargs)
    shape: tuple[int, ...]  # the first input's shape in the analyzed step
    given: Any = field(default=None, compare=False)  # the user's own batch, when one was given (made at ``shape``)
    settings: tuple[tuple[str, str], ...] = ()  # the choices in a batch graphmem made (an HF model's padding, use_cache)

    @property
    def captured(self) -> Batchlike:
        """What the capture takes: the user's own batch (its values read where the real step reads
        them), or a zero-argument maker at ``shape`` (run under the fake mode)."""
        return self.given if self.given is not None else lambda: self.make(self.shape)

    def resized(self, shape: tuple[int, ...]) -> "Inputs":
        return Inputs(self.make, tuple(shape), settings=self.settings)


class SpecChanges(TypedDict, total=False):
    """StepSpec's fields, as ``StepSpec.replace`` takes them."""

    name: str
    module: nn.Module
    inputs: Inputs
    loss: Optional[LossFn]
    target: Target
    training: Training
    parallel: Parallelism
    reuse: bool


@dataclass(frozen=True)
class StepSpec:
    """One training step, as the user's loop runs it."""

    name: str  # the model's name in reports (a file, a preset, the module's class)
    module: nn.Module  # the loaded module (meta, fake or the user's own), before LoRA
    inputs: Inputs  # the batch, and how to make it at other shapes
    loss: Optional[LossFn]  # loss(output, inputs); None: the model's own .loss, a scalar output, or the outputs' sum
    target: Target  # device, dtypes, autocast, SDPA backend, eager or compiled (graphmem/capture/target.py)
    training: Training  # the loop: optimizer, precision, micro-batches, LoRA/QLoRA (graphmem/training/spec.py)
    parallel: Parallelism = Single()  # how the step is split over ranks, if it is
    reuse: bool = True  # a deep chain of identical blocks: capture 5, copy the rest (checked at depth 6)

    def __post_init__(self) -> None:
        check_spec(self)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.inputs.shape

    def replace(self, **changes: Unpack[SpecChanges]) -> "StepSpec":
        return dataclasses.replace(self, **changes)

    def with_train(self, **changes: Any) -> "StepSpec":
        """The same step with the loop's options changed (graphmem/training/loop.py TrainStep)."""
        return self.replace(training=dataclasses.replace(
            self.training, train=dataclasses.replace(self.training.train, **changes)))

    def with_target(self, **changes: Any) -> "StepSpec":
        return self.replace(target=dataclasses.replace(self.target, **changes))

    def at(self, shape: tuple[int, ...]) -> "StepSpec":
        """The same step at another first-input shape."""
        return self.replace(inputs=self.inputs.resized(shape))


def check_spec(spec: StepSpec) -> None:
    """What no single option object can check alone: the options against each other."""
    t = spec.target
    if not hasattr(spec.parallel, "check"):
        raise UsageError(f"parallel must be Single(), Formula(...), Ranks(...), Stages(...) or Job(...), "
                         f"not {type(spec.parallel).__name__}")
    if t.attention == "eager" and not is_hf_model(spec.module):
        raise UsageError("`attention='eager'` picks a Hugging Face model's own attention; this model is not one: "
                         "use `attention='math'` for SDPA's explicit kernel")
    if spec.training.quantization is not None and t.mode != "eager":
        raise UsageError("`qlora` is analyzed in eager mode (bitsandbytes' ops under torch.compile are not traced "
                         "here): use `mode='eager'`")
    spec.parallel.check(spec)


def make_parallelism(world_size: int = 1, zero: int = 0, fsdp: Optional[str] = None, tp: int = 1, sp: bool = False,
                     pp: int = 1, schedule: str = "1f1b", rank: Optional[int] = None, reshard_after_forward: bool = True,
                     fsdp_param_dtype: Optional[str] = None, fsdp_reduce_dtype: Optional[str] = None,
                     fsdp_offload: bool = False, fsdp_no_sync: bool = False, loss_parallel: bool = False,
                     training: Optional[Training] = None,
                     deepspeed: Union[Mapping[str, object], str, "os.PathLike[str]", None] = None) -> Parallelism:
    """The parallel setting the keyword options name, decided here once: ``pp`` > 1 (or another
    schedule) is a pipeline stage; ``rank``, ``fsdp="fully_shard"`` or a fully_shard option is rank
    r through the wrappers; ``zero``/``fsdp="full"|"grad-op"``/``tp`` alone are the formulas; ``deepspeed``
    (a DeepSpeed config) is rank r of that job through DeepSpeed's engine (graphmem/deepspeed/)."""
    if deepspeed is not None:
        if zero or fsdp or tp != 1 or sp or pp != 1:
            raise UsageError("a DeepSpeed job's sharding is its config's (`zero_optimization.stage`): drop `zero`, "
                             "`fsdp`, `tp`, `sp` and `pp`")
        return make_job(deepspeed, world_size, rank)
    if pp != 1 or schedule != "1f1b":
        if world_size != 1 or zero or fsdp or tp != 1:
            raise UsageError("a pipeline stage (`pp` > 1) does not combine with `world_size`, `zero`, `fsdp` or `tp` yet: "
                             "give `pp` alone")
        return Stages(make_pipeline(pp, rank if rank is not None else 0, schedule,
                                    training.train.micro_batches if training is not None else 1))
    if wants_wrappers(rank, fsdp, reshard_after_forward, fsdp_param_dtype, fsdp_reduce_dtype, fsdp_offload,
                      fsdp_no_sync, loss_parallel):
        if zero or fsdp in ("full", "grad-op"):
            raise UsageError("`zero` and `fsdp='full'` or `fsdp='grad-op'` are the per-rank formulas; `rank` and bare "
                             "`fsdp` run PyTorch's wrappers: give one or the other")
        return Ranks(make_sharding(world_size, rank or 0, fsdp == "fully_shard", reshard_after_forward,
                                   fsdp_param_dtype, fsdp_reduce_dtype, fsdp_offload, tp, sp, fsdp_no_sync, training,
                                   loss_parallel))
    layout = make_parallel(world_size, zero, fsdp, tp, sp)
    return Single() if layout == Parallel() else Formula(layout)


def shape_of(shape: Union[str, tuple, list]) -> tuple[int, ...]:
    if isinstance(shape, str):
        return parse_shape(shape)
    dims = tuple(shape)
    if not dims or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
        raise UsageError(f"invalid input shape {shape!r}: expected positive integers, e.g. (32, 1024)")
    return dims


def _loaded(model: object, target: Target, hf: Optional[HFOptions]) -> tuple[Loaded, Optional[tuple]]:
    """The model as graphmem loads it, and the exported program's example inputs (if any)."""
    if isinstance(model, (str, os.PathLike)):
        return load(os.fspath(model), target=target, options=hf), None
    if isinstance(model, torch.export.ExportedProgram):
        example = tuple(model.example_inputs[0]) if model.example_inputs else None
        return from_exported(model), example
    if not isinstance(model, nn.Module):
        raise UsageError(f"model must be an nn.Module, a model file or a preset name, not {type(model).__name__}")
    hf_batch = None
    settings: dict[str, str] = {}
    if is_hf_model(model):  # input_shape makes the batch its forward takes (graphmem/capture/hf_batch.py)
        o = hf or HFOptions()
        hf_batch = lambda shape: hf_inputs(model, shape, o.decoder_length, o.padding, o.use_cache)  # noqa: E731
        settings = hf_settings(model, o.padding, o.use_cache)
    return Loaded(type(model).__name__, model, hf_batch, None, batch_settings=settings), None


def _inputs(loaded: Loaded, inputs: Optional[UserInputs], input_shape: Union[str, tuple, list, None]) -> Inputs:
    if inputs is None:
        if input_shape is None:
            raise UsageError("no inputs: pass example inputs or `input_shape='32x1024'`")
        return Inputs(lambda s: make_inputs(loaded, s), shape_of(input_shape),
                      settings=tuple(sorted(loaded.batch_settings.items())))
    batch = as_batch(inputs)
    first = next(iter(batch.tensors()), None)
    if first is None:
        raise UsageError("the inputs hold no tensor: pass a tensor, a tuple or a dict of tensors")
    return Inputs(resizer(batch), tuple(first.shape), batch)


TARGET_OPTIONS = names(TARGET)  # make_target's (graphmem/step/options.py: the one table of the step's options)
PARALLEL_OPTIONS = names(PARALLEL)  # make_parallelism's


def spec_keywords() -> frozenset[str]:
    """Every keyword ``make_spec`` (and so ``graphmem.analyze``) takes besides the model and inputs: its
    own, the target's, the parallelism's, ``qlora`` and ``make_training``'s."""
    own = [p.name for p in inspect.signature(make_spec).parameters.values() if p.kind is p.KEYWORD_ONLY]
    loop = [p.name for p in inspect.signature(make_training).parameters.values()]
    return frozenset((*own, *TARGET_OPTIONS, *PARALLEL_OPTIONS, "qlora", *loop))


def make_spec(model: ModelLike, inputs: Optional[UserInputs] = None, *, input_shape: Union[str, tuple, list, None] = None,
              loss: Optional[LossFn] = None, target: Optional[Target] = None, training: Optional[Training] = None,
              parallel: Optional[Parallelism] = None, reuse: bool = True, hf: Optional[HFOptions] = None,
              **options: Any) -> StepSpec:
    """A StepSpec from ``graphmem.analyze``'s keyword options, checked once: the model, inputs and target as
    its docstring says; the training loop, the per-rank budgets and rank r's step as docs/spec.md's "Options"
    says. ``target=``, ``training=`` and ``parallel=`` take built objects instead of their options. Options:
    ``input_shape``, ``loss``, ``device``, ``dtype``, ``amp``, ``attention``, ``gpu``, ``mode``, ``memory_budget``,
    ``reuse``, ``optimizer``, ``optimizer_impl``, ``master_weights``, ``micro_batches``, ``lora_rank``,
    ``lora_targets``, ``lora_alpha``, ``qlora``, ``world_size``, ``zero``, ``fsdp``, ``tp``, ``sp``, ``pp``,
    ``schedule``, ``rank``, ``reshard_after_forward``, ``fsdp_param_dtype``, ``fsdp_reduce_dtype``,
    ``fsdp_offload``, ``fsdp_no_sync``, ``loss_parallel``, ``hf`` (graphmem/capture/hf.py HFOptions),
    ``deepspeed`` (graphmem/deepspeed/, docs/deepspeed.md)."""
    check_keywords(options, spec_keywords(), "graphmem.make_spec")
    t_opts = {k: options.pop(k) for k in TARGET_OPTIONS if k in options}
    p_opts = {k: options.pop(k) for k in PARALLEL_OPTIONS if k in options}
    qlora = options.pop("qlora", False)
    if "quantization" not in options and qlora:
        options["quantization"] = "nf4"
    if target is None:
        t_opts["device"] = torch.device(t_opts.get("device") or default_device(p_opts.get("deepspeed"))).type
        target = make_target(**t_opts)
    elif t_opts:
        raise UsageError(f"give target= or its options ({', '.join(t_opts)}), not both")
    if training is None:
        training = make_training(dtype=target.dtype, **options)
    elif options:
        raise UsageError(f"give training= or its options ({', '.join(options)}), not both")
    if parallel is None:
        parallel = make_parallelism(**p_opts, training=training)
    elif p_opts:
        raise UsageError(f"give parallel= or its options ({', '.join(p_opts)}), not both")
    loaded, example = _loaded(model, target, hf)
    if inputs is None and input_shape is None and example is not None:
        inputs = example
    if loaded.dtype is not None and target.dtype is None and target.amp is None:
        target = dataclasses.replace(target, dtype=loaded.dtype)  # an HF config's torch_dtype
    return StepSpec(loaded.name, loaded.module, _inputs(loaded, inputs, input_shape), loss or loaded.loss, target,
                    training, parallel, reuse)
