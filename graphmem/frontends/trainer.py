"""``graphmem.analyze(trainer)``: a transformers ``Trainer``'s own step on fake tensors
(graphmem/training/hf_trainer.py runs it), and the batch it trains on.

The batch: ``inputs`` as given (a dict, as the Trainer's dataloader yields); else, with no
``input_shape``, the batch ``trainer.train()`` draws from ``train_dataset`` through its own
dataloader (sampler, column removal, collator: graphmem/training/hf_trainer_batch.py; ``trainer_batch``
"first" or "longest"); with ``input_shape``, that batch (or, without a train_dataset, token samples
made for the model through ``trainer.data_collator``) resized to exactly ``input_shape``.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any, Iterator, Optional, TypeVar, Union

import torch
import torch.nn as nn

from graphmem.capture.hf import batch as hf_batch
from graphmem.capture.target import Target, check_device
from graphmem.errors import UsageError
from graphmem.step.spec import Inputs, Single, StepSpec, shape_of
from graphmem.training.batch import Batch, as_batch, resizer
from graphmem.training.hf_trainer import check_trainer, trainer_step
from graphmem.training.hf_trainer_batch import collator_name, drawn_batch, fit_to_shape
from graphmem.training.hf_trainer_cuda import bf16_check_answered
from graphmem.training.hf_trainer_ddp import TrainerDDP
from graphmem.training.loop import PlannedTrainer
from graphmem.training.spec import Training

if TYPE_CHECKING:
    from transformers import Trainer

T = TypeVar("T")


def trainer_batch(trainer: Trainer, shape: tuple[int, ...]) -> dict[str, object]:
    """The Trainer's batch at exactly ``shape`` (``input_shape``): the first batch ``train()`` draws from its
    train_dataset (graphmem/training/hf_trainer_batch.py), or without one ``shape[0]`` token samples made
    for its model (graphmem/capture/hf.py) through its collator, resized to ``shape`` (the collator's
    padding or the dataset's lengths never change a shape the user gave)."""
    return trainer_inputs(trainer, None, shape)[0]


def trainer_inputs(trainer: Any, inputs: Optional[T], shape: Optional[tuple[int, ...]], which: str = "first",
                   world_size: int = 1, rank: int = 0) -> tuple[Union[T, dict[str, object]], dict[str, str]]:
    """The step's batch and what the report says of it: ``inputs`` as given; else the batch ``train()``
    draws (``which``), at ``shape`` when given."""
    if inputs is not None:
        return inputs, {}
    if trainer.train_dataset is None and shape is not None:
        made = hf_batch(trainer.model, shape)
        out = trainer.data_collator([{k: v[i] for k, v in made.items()} for i in range(shape[0])])
        if not hasattr(out, "items"):
            raise UsageError(f"the Trainer's data_collator returned {type(out).__name__}, not a dict of tensors: "
                             "pass inputs= (the batch dict the model takes)")
        source = {"dataset": f"none: token samples made for the model, {collator_name(trainer.data_collator)}"}
        return fit_to_shape(dict(out), shape, "made for the model"), source
    batch, settings = drawn_batch(trainer, which, world_size, rank)
    if shape is None:
        return batch, settings
    drawn = "x".join(map(str, next(v for v in batch.values() if isinstance(v, torch.Tensor)).shape))
    settings["batch"] = f"input_shape as given (train()'s first, {drawn}, resized)"
    return fit_to_shape(batch, shape, "the first batch train() draws"), settings


def trainer_spec(trainer: Any, inputs: object = None, input_shape: Union[str, tuple, list, None] = None,
                 world_size: int = 1, rank: Optional[int] = None, device: Optional[str] = None,
                 trainer_batch: str = "first") -> StepSpec:
    """The StepSpec of the step ``trainer.train()`` runs: its model, the batch (``inputs``; else the one
    its dataloader yields, ``trainer_batch`` "first" or "longest" of the run's, at ``input_shape`` when
    given: ``trainer_inputs``), and its loop (graphmem/training/hf_trainer.py TrainerStep:
    ``args.optim``, ``max_grad_norm``, ``gradient_accumulation_steps``, bf16/fp16 through accelerate,
    gradient checkpointing), which the capture runs through the Trainer's own code; with
    ``torch_compile``, in compiled mode with its backend's partition. ``world_size`` > 1: the step
    of rank ``rank`` (default 0) when the Trainer is launched on ``world_size`` processes, the model
    in torch's DistributedDataParallel under a fake process group (graphmem/training/hf_trainer_ddp.py;
    with ``torch_compile``, compiled over DDP as accelerate compiles it, split at DDP's buckets);
    the batch is that rank's (``per_device_train_batch_size`` rows). ``device``: the target, by default
    the Trainer's own (``args.device``); ``"cuda"`` runs its step with CUDA's rules on fake CPU tensors
    (graphmem/training/hf_trainer_cuda.py), also for a Trainer built where no GPU is found.

    >>> report = graphmem.analyze(trainer)  # doctest: +SKIP
    >>> report.batch["drawn"], report.budget.peak_bytes, report.budget.rank.later_peak_bytes  # doctest: +SKIP
    """
    check_trainer(trainer)
    check_ranks(trainer, world_size, rank)
    device = trainer_device(trainer, device)
    shape = shape_of(input_shape) if input_shape is not None and inputs is None else None
    inputs, settings = trainer_inputs(trainer, inputs, shape, trainer_batch, world_size, rank or 0)
    batch = as_batch(inputs)
    if batch.form != "dict":
        raise UsageError("a Trainer's batch is a dict of keyword inputs (as its dataloader yields): pass inputs={...}")
    first = batch.tensors()[0]
    args = trainer.args  # torch_compile: the model compiled as accelerate compiles it (graphmem/training/hf_trainer.py)
    # on the CUDA target, CUDA autocast's state is the target's amp where accelerate's region turns it on: a
    # checkpoint's recompute runs in it as on the GPU (graphmem/training/hf_trainer_cuda.py)
    amp = "bf16" if device == "cuda" and args.bf16 else None
    target = Target(device, mode="compiled", compile_backend=args.torch_compile_backend) \
        if args.torch_compile else Target(device, amp=amp)
    return StepSpec(type(trainer.model).__name__, trainer.model,
                    Inputs(resizer(batch), tuple(first.shape), batch, tuple(settings.items())), None,
                    target, Training(trainer_step(trainer, world_size, rank or 0), None),
                    TrainerDDP(world_size, rank or 0) if world_size > 1 else Single(), reuse=False)


def trainer_device(trainer: Trainer, device: Optional[str]) -> str:
    """The target's device for the Trainer's step (``device``, else ``args.device``'s), checked in one line."""
    own = trainer.args.device.type
    device = own if device is None else str(device)
    if device not in ("cpu", "cuda"):
        raise UsageError(f"unknown device {device!r}: use cpu or cuda")
    check_device(device)
    if device == "cpu" and own == "cuda":
        raise UsageError("the Trainer runs on cuda: analyze it with `device='cuda'` (or set use_cpu=True in its "
                         "TrainingArguments for the CPU step)")
    if device == "cuda" and trainer.args.torch_compile:
        raise UsageError("a compiled Trainer (torch_compile) is analyzed on the CPU target only yet: drop `device='cuda'` "
                         "and set use_cpu=True, or unset torch_compile for the CUDA target")
    if device == "cuda" and "paged" in str(getattr(trainer.args.optim, "value", trainer.args.optim)):
        raise UsageError("a paged optimizer keeps its states in CUDA managed memory (outside PyTorch's allocator), "
                         "which graphmem does not model: use `optim='adamw_bnb_8bit'` or the CPU target")
    if device == "cuda" and trainer.args.fp16:
        raise UsageError("fp16 on the CUDA target (accelerate's GradScaler) is not run yet: use bf16=True in the "
                         "TrainingArguments, or analyze the model with `amp='fp16'`")
    return device


def check_ranks(trainer: PlannedTrainer, world_size: object, rank: object) -> None:
    """``world_size`` and ``rank`` of a DDP job, checked; the error names the fix."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise UsageError(f"`world_size` must be a positive integer, got {world_size!r}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size):
        raise UsageError(f"`rank={rank!r}` is not one of the {world_size} ranks: use 0 to {world_size - 1}")
    if world_size > 1 and trainer.args.torch_compile:  # compiled over DDP (graphmem/training/hf_trainer_ddp.py)
        from torch._dynamo.utils import get_optimize_ddp_mode

        if get_optimize_ddp_mode() not in ("ddp_optimizer", "no_optimization"):
            raise UsageError(f"torch._dynamo.config.optimize_ddp={get_optimize_ddp_mode()!r}: graphmem runs DDPOptimizer's "
                             "split or one graph per rank; set `torch._dynamo.config.optimize_ddp` to True or False")


def trainer_from_file(model: nn.Module, path: str, target: Optional[Target] = None, train_dataset: Optional[str] = None
                      ) -> Any:
    """A ``transformers.Trainer`` around ``model`` with the TrainingArguments of a JSON or YAML file
    (or, when they ask for FSDP, the TrainingArguments themselves: the Trainer is then built per rank,
    ``fsdp_trainer_spec``)
    (``HfArgumentParser(TrainingArguments).parse_json_file`` / ``parse_yaml_file``). The model may be
    on the meta device (graphmem/capture/load.py): the arguments leave it where it is
    (``place_model_on_device``, the property TrainingArguments documents for overriding). ``target`` on
    cuda: the file is a GPU user's (``bf16`` without ``use_cpu``), read as on the target's GPU
    (``_with_gpu_bf16``). ``train_dataset``: the Trainer's (``dataset_from_file``), whose first batch the step runs."""
    import os

    from transformers import HfArgumentParser, Trainer, TrainingArguments

    @dataclasses.dataclass
    class InPlace(TrainingArguments):
        @property
        def place_model_on_device(self) -> bool:
            return False

    from graphmem.training.peft_lora import is_hf_model

    if not is_hf_model(model):
        raise UsageError(f"training_args builds a transformers Trainer around a Hugging Face model; {type(model).__name__} "
                         "is not one: give a Hugging Face config, hub id or preset (e.g. hf-gpt2, llama-3.1-8b)")
    if not os.path.isfile(path):
        raise UsageError(f"training_args {path!r}: no such file; give a JSON or YAML file of TrainingArguments")
    parser = HfArgumentParser(InPlace)  # type: ignore[arg-type]
    try:
        with _names_deepspeed(path) or _with_gpu_bf16(target):
            (args,) = parser.parse_yaml_file(path) if path.endswith((".yaml", ".yml")) else parser.parse_json_file(path)
    except Exception as e:  # a malformed file, an unknown field, a value TrainingArguments refuses
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"training_args {path!r} is not readable as TrainingArguments: {first}") from None
    if args.fsdp or args.deepspeed:  # Trainer.__init__ raises "Using fsdp only works in distributed training." in one
        if train_dataset is not None:  # process; a DeepSpeed Trainer is built per rank too (graphmem/deepspeed/trainer.py)
            raise UsageError("`train_dataset` with FSDP or DeepSpeed arguments is not run yet: give `input_shape` for "
                             "the rank's batch")
        return args  # the Trainer is built per rank (graphmem/distributed/trainer_fsdp.py)
    data = dataset_from_file(train_dataset) if train_dataset is not None else None
    return Trainer(model=model, args=args, train_dataset=data)


def dataset_from_file(path: str) -> Any:
    """A train_dataset from a file: a directory saved by ``datasets.Dataset.save_to_disk`` (``load_from_disk``),
    or a JSON Lines file of samples (one JSON object a line, e.g. ``{"input_ids": [...]}``), read as a list of
    dicts (a Trainer takes any sized dataset; its collator turns the lists into tensors)."""
    import json
    import os

    if os.path.isdir(path):
        import datasets

        try:
            return datasets.load_from_disk(path)
        except Exception as e:  # not a saved dataset
            raise UsageError(f"train_dataset {path!r} is not a dataset saved by save_to_disk: {str(e).splitlines()[0]}") from None
    if not os.path.isfile(path):
        raise UsageError(f"train_dataset {path!r}: no such file; give a JSON Lines file of samples or a saved dataset directory")
    samples = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                samples.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise UsageError(f"train_dataset {path!r} line {n} is not JSON ({e.msg}): give one JSON object a line") from None
            if not isinstance(samples[-1], dict):
                raise UsageError(f"train_dataset {path!r} line {n} is not a JSON object of the sample's fields")
    return samples


def _names_deepspeed(path: str) -> Optional[contextlib.AbstractContextManager[None]]:
    """For a file of arguments naming ``deepspeed``, the context its bf16 is read in: DeepSpeed's bf16 engine
    (graphmem/deepspeed/trainer.py ``bf16_by_deepspeed``); else None (an unreadable file too: the parser says why)."""
    import json

    import yaml

    try:
        with open(path) as f:
            fields = yaml.safe_load(f) if path.endswith((".yaml", ".yml")) else json.load(f)
    except (OSError, ValueError, yaml.YAMLError):
        return None
    if not isinstance(fields, dict) or not fields.get("deepspeed"):
        return None
    from graphmem.deepspeed.trainer import bf16_by_deepspeed

    return bf16_by_deepspeed()


@contextlib.contextmanager
def _with_gpu_bf16(target: Optional[Target]) -> Iterator[None]:
    """On the CUDA target, TrainingArguments' bf16 check (``_validate_args``: "Your setup doesn't support
    bf16/gpu" where ``is_torch_bf16_gpu_available()`` is False, as on a machine without a GPU) answers
    for the target's GPU: bf16 from compute capability 8.0 (Ampere) on."""
    if target is None or target.device != "cuda":
        yield
        return
    with bf16_check_answered(target.capability >= (8, 0)):
        yield


def rank_batch(model: nn.Module, inputs: object, input_shape: Union[str, tuple, list, None]) -> Batch:
    """A Trainer rank's micro-batch: ``inputs`` (a dict, as its dataloader yields), or ``input_shape``'s samples
    made for the model (graphmem/capture/hf.py) through ``default_data_collator``."""
    from transformers import default_data_collator

    if inputs is None:
        if input_shape is None:
            raise UsageError("no inputs: pass inputs= (a batch dict) or `input_shape` (batch, seq) for the Trainer")
        shape = shape_of(input_shape)
        made = hf_batch(model, shape)
        inputs = dict(default_data_collator([{k: v[i] for k, v in made.items()} for i in range(shape[0])]))
    batch = as_batch(inputs)
    if batch.form != "dict":
        raise UsageError("a Trainer's batch is a dict of keyword inputs (as its dataloader yields): pass inputs={...}")
    return batch


def fsdp_trainer_spec(model: Any, training_args: object, inputs: object = None,
                      input_shape: Union[str, tuple, list, None] = None, world_size: int = 1,
                      rank: Optional[int] = None, trainer_class: Optional[type[Trainer]] = None) -> StepSpec:
    """The StepSpec of rank ``rank`` (default 0) of the Trainer (``trainer_class``, default
    ``transformers.Trainer``) around ``model`` with ``training_args`` that ask for FSDP, launched on
    ``world_size`` processes: the Trainer is built per rank and accelerate's own FSDP2 code wraps the
    model (graphmem/training/hf_trainer_fsdp.py). The batch: ``inputs``, or ``input_shape``'s samples
    made for the model (graphmem/capture/hf.py) through ``default_data_collator`` (the Trainer's
    collator when it is given no processing class).

    >>> args = TrainingArguments("out", use_cpu=True, fsdp="full_shard auto_wrap")  # doctest: +SKIP
    >>> graphmem.analyze(model, training_args=args, world_size=8, rank=0, input_shape=(2, 512))  # doctest: +SKIP
    """
    from transformers import Trainer, TrainingArguments

    from graphmem.training.hf_trainer_fsdp import shards_of
    from graphmem.training.peft_lora import is_hf_model

    if not isinstance(training_args, TrainingArguments):
        raise UsageError(f"`training_args` is {type(training_args).__name__}, not transformers.TrainingArguments")
    if not training_args.fsdp:
        raise UsageError("`training_args` without fsdp: build the Trainer and pass it, graphmem.analyze(trainer)")
    if world_size == 1:
        raise UsageError("the TrainingArguments ask for FSDP, which the Trainer runs only launched on several "
                         "processes: give `world_size` (> 1) and `rank` for one rank of the job")
    if not is_hf_model(model):
        raise UsageError(f"`training_args` builds a transformers Trainer around a Hugging Face model; "
                         f"{type(model).__name__} is not one")
    shards = shards_of(trainer_class or Trainer, model, training_args, world_size, rank)
    fake = type("Planned", (), {"args": training_args, "optimizer": None})()  # what trainer_step reads
    check_ranks(fake, world_size, rank)
    batch = rank_batch(model, inputs, input_shape)
    step = dataclasses.replace(trainer_step(fake, world_size, rank or 0), fsdp=True, trainer=None)
    if step.micro_batches > 2:  # under no_sync: the first, a middle and the last micro-step traced (4..k repeat the middle)
        step = dataclasses.replace(step, trace_micro_steps=3)
    if step.precision != "fp32":  # no autocast under FSDP2: accelerate's MixedPrecisionPolicy (param, reduce, output dtype)
        step = dataclasses.replace(step, precision=f"{step.precision.split()[0]} MixedPrecisionPolicy (fp32 shards)")
    first = batch.tensors()[0]
    return StepSpec(type(model).__name__, model, Inputs(resizer(batch), tuple(first.shape), batch), None,
                    Target("cpu"), Training(step, None), shards, reuse=False)


__all__ = ["check_ranks", "dataset_from_file", "fsdp_trainer_spec", "trainer_batch", "trainer_from_file", "trainer_inputs", "trainer_spec"]
