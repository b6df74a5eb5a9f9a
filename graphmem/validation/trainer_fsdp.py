"""``graphmem.validate(model, training_args=args, world_size=N)`` where the arguments ask for FSDP: each
rank's prediction (graphmem/distributed/trainer_fsdp.py) beside a REAL job of N gloo CPU
processes (graphmem/validation/trainer_ranks.py spawns them: a torchrun rank's environment each), each
rank building the Trainer and setting it up as an FSDP job with the same call as the analysis
(graphmem/training/hf_trainer_fsdp.py ``build_trainer``), so accelerate's own ``_prepare_fsdp2`` shards the
real model (``FsdpRunner.prepare``), then running the Trainer's step with the runner the capture runs.

Each rank measures what graphmem/validation/ranks.py measures for a fully_shard step: the distinct
storages autograd saves in the last micro-step's forward and loss (a DTensor's local shard; the
parameters and buffers as registered at each save excluded, since FSDP2 registers the unsharded
parameters during forward), the bytes live before the step (the local shards, buffers, the batch;
the optimizer's states and ``_tr_loss`` before the later step) and each step's peak: those bytes plus
the largest running sum of the CPU allocator's events under torch.profiler. The collectives are
settled (graphmem/validation/settle.py, opened by the rank's main): their buffers die on the rank's
own thread or get their free at the end of the call. ``prepare`` (the sharding) runs before the
first profile: what it leaves is the local shards, counted as live. One fresh Trainer per rank, two
steps (the later one starts with the optimizer's states), as ranks.py measures the wrappers' steps.
Each rank sets OMP_NUM_THREADS to the prediction's thread count before accelerate's ``PartialState``
would set its own (state.py 266-282): the CPU scratch rules depend on it. Each rank's measurement:
graphmem/validation/trainer_fsdp_rank.py.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Union

import torch

from graphmem.errors import UsageError
from graphmem.training.batch import as_batch
from graphmem.validation.result import Row, Validation, checked_tolerance, judge

if TYPE_CHECKING:
    import torch.nn as nn
    from transformers import Trainer, TrainingArguments


def validate_fsdp_ranks(model: nn.Module, training_args: TrainingArguments, inputs: object = None,
                        input_shape: Union[str, tuple, list, None] = None,
                        tolerance: Optional[float] = None, world_size: int = 1, rank: Optional[int] = None,
                        trainer_class: Optional[type[Trainer]] = None) -> Validation:
    """Each rank's (``rank``, else all ``world_size``) prediction beside the real gloo job; rows carry their rank.
    The model must be real (on the CPU); it is left as it was (each rank shards its own pickled copy)."""
    from graphmem.api import analyze
    from graphmem.frontends.trainer import fsdp_trainer_spec
    from graphmem.validation.ranks import check_budget, pickled
    from graphmem.validation.trainer_ranks import TrainerJob, _args_class, _importable, _rows, run_trainer_ranks

    tol = checked_tolerance(tolerance)
    if any(p.is_meta for p in model.parameters()):
        raise UsageError("the model is on the meta device; validate runs its Trainer's step for real: build it on the CPU")
    spec = fsdp_trainer_spec(model, training_args, inputs, input_shape, world_size, rank, trainer_class)
    batch = spec.inputs.given.kwargs
    shards: Any = spec.parallel  # a TrainerShards (graphmem/training/hf_trainer_fsdp.py)
    trainer_named, args_named = _importable(shards.trainer_class), _args_class(training_args)
    if trainer_named is None or args_named is None:
        raise UsageError("each gloo rank builds the Trainer by its class and the TrainingArguments by theirs: define "
                         "them at module level of an importable module")
    pickled(shards.fields, "the TrainingArguments")
    job = TrainerJob(trainer_named, args_named, shards.fields, pickled(model, "the model"),
                     pickled(dict(batch), "the inputs"), torch.get_num_threads(), compiled=bool(training_args.torch_compile), fsdp=True)
    ranks = [rank] if rank is not None else list(range(world_size))
    reports = {r: analyze(model, dict(batch), training_args=training_args, world_size=world_size, rank=r,
                          trainer_class=shards.trainer_class) for r in ranks}
    check_budget(reports, world_size)
    measured = run_trainer_ranks(job, world_size)
    rows: list[Row] = []
    # Inductor's fused kernels lower a compiled step's peak below its graphs run op by op (graphmem/validation/trainer.py)
    peak = "info" if training_args.torch_compile and training_args.torch_compile_backend == "inductor" else "tolerance"
    for r, report in reports.items():
        rows.extend(_rows(report, measured[r], r, peak))
    judged, reason = judge(tuple(rows), tol)
    shapes = tuple(tuple(x.shape) for x in as_batch(batch).tensors())
    return Validation(reports[ranks[0]].model, "cpu", shapes, tol, judged, reason, reports[ranks[0]])


__all__ = ["validate_fsdp_ranks"]
