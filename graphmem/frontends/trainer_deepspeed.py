"""``graphmem.analyze`` of a Trainer whose TrainingArguments name ``deepspeed``: rank r of the job, the Trainer
built per rank and stepped by its own code through accelerate's DeepSpeed (graphmem/deepspeed/trainer.py,
captured by graphmem/deepspeed/trainer_capture.py). Three doors lead here: a built Trainer
(``graphmem.analyze(trainer, world_size=N, rank=r)``), a model with the arguments
(``graphmem.analyze(model, inputs, training_args=args, world_size=N, rank=r)``) and the CLI's
``--training-args`` file with ``deepspeed`` in it.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional, Union

from graphmem.capture.target import make_target
from graphmem.errors import UsageError
from graphmem.step.spec import Inputs, StepSpec, shape_of
from graphmem.training.batch import resizer
from graphmem.training.spec import Training

if TYPE_CHECKING:
    from transformers import Trainer


def deepspeed_trainer_spec(model: Any, training_args: object, inputs: object = None,
                           input_shape: Union[str, tuple, list, None] = None, world_size: int = 1,
                           rank: Optional[int] = None, trainer_class: Optional[type[Trainer]] = None,
                           device: Optional[str] = None, gpu: Optional[str] = None) -> StepSpec:
    """The StepSpec of rank ``rank`` (default 0) of the Trainer (``trainer_class``, default
    ``transformers.Trainer``) around ``model`` with ``training_args`` naming ``deepspeed``, launched on
    ``world_size`` processes. The batch: ``inputs`` (the rank's micro-batch, a dict), or ``input_shape``'s
    samples made for the model through ``default_data_collator``.

    >>> args = TrainingArguments("out", deepspeed={"zero_optimization": {"stage": 2}})  # doctest: +SKIP
    >>> graphmem.analyze(model, batch, training_args=args, world_size=2, rank=1)  # doctest: +SKIP
    """
    from transformers import Trainer, TrainingArguments

    from graphmem.deepspeed.trainer import deepspeed_of
    from graphmem.frontends.trainer import check_ranks, rank_batch
    from graphmem.training.hf_trainer import trainer_step
    from graphmem.training.peft_lora import is_hf_model

    if not isinstance(training_args, TrainingArguments):
        raise UsageError(f"`training_args` is {type(training_args).__name__}, not transformers.TrainingArguments")
    if not is_hf_model(model):
        raise UsageError(f"`training_args` builds a transformers Trainer around a Hugging Face model; "
                         f"{type(model).__name__} is not one")
    if training_args.use_cpu:
        raise UsageError("`use_cpu=True` turns DeepSpeed off in accelerate (AcceleratorState: DeepSpeed only where "
                         "not cpu): leave it unset; DeepSpeed's CPU accelerator runs the rank")
    fake = type("Planned", (), {"args": training_args, "optimizer": None})()  # what trainer_step reads
    check_ranks(fake, world_size, rank)
    job = deepspeed_of(trainer_class or Trainer, training_args, world_size, rank)
    batch = rank_batch(model, inputs, input_shape)
    step = dataclasses.replace(trainer_step(fake, world_size, job.rank), trainer=None,
                               deepspeed=f"DeepSpeed ZeRO-{job.stage} (accelerate)",
                               precision="bf16 (DeepSpeed's bf16 engine)" if training_args.bf16 else "fp32")
    first = batch.tensors()[0]
    return StepSpec(type(model).__name__, model, Inputs(resizer(batch), tuple(first.shape), batch), None,
                    make_target(device=device or "cpu", gpu=gpu or "h100"), Training(step, None), job,
                    reuse=False)


def built_deepspeed_spec(trainer: Any, inputs: object, input_shape: Union[str, tuple, list, None], world_size: int, rank: Optional[int],
                         device: Optional[str]) -> StepSpec:
    """A Trainer built with ``deepspeed`` in its arguments (in one process: accelerate reads DeepSpeed from its
    plugin): rank ``rank`` of ``world_size``, rebuilt per rank from its class, model and arguments; the batch
    ``inputs``, else ``input_shape``'s, else the first batch its train_dataset gives."""
    from graphmem.frontends.trainer import trainer_inputs

    if trainer.args.deepspeed is None:
        raise UsageError("the Trainer runs DeepSpeed from accelerate's own config (accelerate launch), not from its "
                         "TrainingArguments: set `deepspeed` in them")
    if inputs is None:
        shape = shape_of(input_shape) if input_shape is not None else None
        inputs, _ = trainer_inputs(trainer, None, shape)
    return deepspeed_trainer_spec(trainer.model, trainer.args, inputs, None, world_size, rank, type(trainer), device)


__all__ = ["built_deepspeed_spec", "deepspeed_trainer_spec"]
