"""The front door: whatever a user hands graphmem, as one StepSpec (graphmem/step/spec.py).

``spec_for(subject, inputs, **options)`` recognizes each kind of subject and builds its step with the
front end that knows it: a StepSpec as it is; a transformers ``Trainer`` (its own step, its own batch:
graphmem/frontends/trainer.py; with ``deepspeed`` in its arguments, rebuilt per rank:
graphmem/frontends/trainer_deepspeed.py); a Hugging Face model with FSDP or DeepSpeed ``training_args`` (the
Trainer built per rank); a torchtitan ``Trainer.Config`` (graphmem/frontends/titan_job.py); anything else (an nn.Module, an
exported program, a model file, a preset, a hub id or config) through ``make_spec``. ``graphmem.analyze``
measures what it returns, and so does ``graphmem.validate``'s prediction.
"""
from __future__ import annotations

from typing import Any, Mapping, Union

from graphmem.errors import UsageError, check_keywords
from graphmem.step.spec import ModelLike, StepSpec, make_spec, spec_keywords
from graphmem.titan.job import is_job_config
from graphmem.training.hf_trainer import is_trainer

TRAINER = frozenset({"input_shape", "world_size", "rank", "device", "trainer_batch"})  # a built Trainer's options
FSDP_TRAINER = frozenset({"training_args", "input_shape", "world_size", "rank", "trainer_class"})  # one built per rank


def spec_for(subject: Union[ModelLike, StepSpec, Any], inputs: Any = None, *, caller: str = "graphmem.analyze",
             **options: Any) -> StepSpec:
    """The StepSpec of ``subject`` with ``inputs`` and the keyword ``options`` (graphmem.analyze's);
    ``caller`` names the function in the errors. Options a kind of subject does not take are one line."""
    if is_trainer(subject) and _names_deepspeed(subject):  # rank r rebuilt per rank, DeepSpeed through accelerate
        from graphmem.frontends.trainer_deepspeed import built_deepspeed_spec

        _only(options, TRAINER - {"trainer_batch"}, "a DeepSpeed Trainer's step comes from its TrainingArguments (and "
                                                    "`world_size`/`rank` for the rank)")
        return built_deepspeed_spec(subject, inputs, options.get("input_shape"), options.get("world_size", 1),
                                    options.get("rank"), options.get("device"))
    if is_trainer(subject):  # a transformers Trainer: its own step (graphmem/frontends/trainer.py)
        from graphmem.frontends.trainer import trainer_spec

        _only(options, TRAINER, "a Trainer's step comes from its TrainingArguments (and `world_size`/`rank` for a "
                                "DDP job's rank, `device` for its target)")
        return trainer_spec(subject, inputs, options.get("input_shape"), options.get("world_size", 1),
                            options.get("rank"), options.get("device"), options.get("trainer_batch", "first"))
    if "training_args" in options:  # a Trainer built per rank: FSDP (graphmem/training/hf_trainer_fsdp.py) or DeepSpeed
        from graphmem.frontends.trainer import fsdp_trainer_spec
        from graphmem.frontends.trainer_deepspeed import deepspeed_trainer_spec

        if getattr(options["training_args"], "deepspeed", None) is not None:  # (and the target: DeepSpeed's CPU accelerator
            _only(options, FSDP_TRAINER | {"device", "gpu"},  # runs under the CUDA target's rules)
                  "a DeepSpeed Trainer's step comes from its TrainingArguments (and `world_size`/`rank`, `device`)")
            return deepspeed_trainer_spec(subject, options["training_args"], inputs, options.get("input_shape"),
                                          options.get("world_size", 1), options.get("rank"), options.get("trainer_class"),
                                          options.get("device"), options.get("gpu"))
        _only(options, FSDP_TRAINER, "a Trainer's step comes from its TrainingArguments (and `world_size`/`rank`)")
        return fsdp_trainer_spec(subject, options["training_args"], inputs, options.get("input_shape"),
                                 options.get("world_size", 1), options.get("rank"), options.get("trainer_class"))
    if is_job_config(subject):  # a torchtitan Trainer.Config: the job's own code per rank (graphmem/titan/)
        from graphmem.frontends.titan_job import OPTIONS, job_spec

        extra = sorted(set(options) - OPTIONS)
        if extra or inputs is not None:
            raise UsageError(f"a torchtitan job's step comes from its config; drop {', '.join(extra) or 'inputs'} "
                             f"(options: {', '.join(sorted(OPTIONS))})")
        return job_spec(subject, **options)
    check_keywords(options, spec_keywords(), caller)
    if isinstance(subject, StepSpec):
        if inputs is not None or options:
            raise UsageError(f"{caller.rpartition('.')[2]}(spec) takes the StepSpec alone: change it with "
                             "dataclasses.replace")
        return subject
    return make_spec(subject, inputs, **options)


def _names_deepspeed(trainer: Any) -> bool:
    """The Trainer's TrainingArguments name a DeepSpeed config (graphmem/frontends/trainer_deepspeed.py)."""
    return trainer.args.deepspeed is not None


def _only(options: Mapping[str, object], allowed: frozenset[str], why: str) -> None:
    extra = sorted(set(options) - allowed)
    if extra:
        raise UsageError(f"{why}; drop {', '.join(extra)}")


__all__ = ["FSDP_TRAINER", "TRAINER", "spec_for"]
