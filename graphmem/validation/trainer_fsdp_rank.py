"""One gloo rank of ``graphmem.validate(model, training_args=args, world_size=N)`` for FSDP arguments
(graphmem/validation/trainer_fsdp.py: what it measures and why), run by graphmem/validation/trainer_ranks.py's
spawned ranks."""
from __future__ import annotations

import contextlib
import io
from typing import Any

import torch

import graphmem.validation.measure as measure
from graphmem.training.batch import as_batch
from graphmem.training.hf_trainer_fsdp import FsdpRunner, build_trainer
from graphmem.validation.ranks import _held, _Saves, _storages, profiled, record
from graphmem.validation.settle import addresses


def measure_fsdp_rank(job: Any, named: Any) -> dict[str, int]:
    """This rank's figures (the module docstring); ``named`` imports a (module, name) pair."""
    torch.manual_seed(0)
    model = torch.load(io.BytesIO(job.model), weights_only=False)
    trainer = build_trainer(named(job.trainer_class), model, named(job.args_class), job.args)
    batch = torch.load(io.BytesIO(job.batch), weights_only=False)
    runner = FsdpRunner(trainer)
    kept: list[Any] = [trainer, batch, runner]
    result: dict[str, int] = {}
    with runner.session():
        with measure._quiet_gc():
            runner.prepare()  # accelerate's _prepare_fsdp2: the call the capture makes
        wrapped = trainer.model
        saves = _Saves(wrapped)
        states = lambda: [t for _, _, t in runner.state_tensors()]  # noqa: E731
        for i in range(2):
            baseline = sum(_storages(_held(wrapped) + list(as_batch(batch).tensors()) + states()
                                     + runner.held_tensors()).values())
            with profiled(saves) as prof:
                out, loss = runner.run(wrapped, batch, None, saves.set_phase, contextlib.nullcontext)
            grads = [p.grad for p in wrapped.parameters() if p.grad is not None]
            held = addresses([*_held(wrapped), *grads, *as_batch(batch).tensors(), *states(),
                              *runner.held_tensors(), loss])
            kept.append((out, loss))  # freed after profiling would confuse the next profile (ranks.py)
            record(result, i, prof, held, saves, baseline, states())
    kept.append(wrapped)
    _KEPT.append(kept)
    return result


_KEPT: list[Any] = []  # a spawned rank's measured objects, alive until it exits (see ``kept``)


__all__ = ["measure_fsdp_rank"]
