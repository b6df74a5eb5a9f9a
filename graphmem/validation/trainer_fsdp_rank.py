"""One gloo rank of ``graphmem.validate(model, training_args=args, world_size=N)`` for FSDP arguments
(graphmem/validation/trainer_fsdp.py: what it measures and why), run by graphmem/validation/trainer_ranks.py's
spawned ranks."""
from __future__ import annotations

import contextlib
import io
from typing import Any, Callable

import torch

from graphmem.capture.collector import quiet_gc
from graphmem.errors import GraphmemError
from graphmem.training.batch import as_batch
from graphmem.training.hf_trainer_fsdp import FsdpRunner, build_trainer
from graphmem.validation.ranks import Saves, _held, _storages, profiled, record
from graphmem.validation.settle import addresses

Named = Callable[[tuple[str, str]], type]  # (module, qualified name) -> the class it names


def measure_fsdp_rank(job: Any, named: Named) -> dict[str, int]:
    """This rank's figures (the module docstring); ``named`` imports a (module, name) pair."""
    kept: list[object] = []
    if job.compiled:  # a Trainer of its own compiles first: the measured steps run dynamo's cached code
        kept.append(_compiled_once(job, named))
    torch.manual_seed(0)
    model = torch.load(io.BytesIO(job.model), weights_only=False)
    trainer = build_trainer(named(job.trainer_class), model, named(job.args_class), job.args)
    batch = torch.load(io.BytesIO(job.batch), weights_only=False)
    runner = FsdpRunner(trainer)
    kept += [trainer, batch, runner]
    compiles = _compiles()
    result: dict[str, int] = {}
    with runner.session():
        with quiet_gc():
            runner.prepare()  # accelerate's _prepare_fsdp2: the call the capture makes
        wrapped = trainer.model
        saves = Saves(wrapped)
        states = lambda: [t for _, _, t in runner.state_tensors()]  # noqa: E731
        # (compiled: autograd calls the hook from a compiled frame's eager code, where dynamo would compile it too)
        pack = torch._dynamo.disable(saves.pack) if job.compiled else saves.pack
        for i in range(2):
            baseline = sum(_storages(_held(wrapped) + list(as_batch(batch).tensors()) + states()
                                     + runner.held_tensors()).values())
            with profiled(saves, pack) as prof:
                out, loss = runner.run(wrapped, batch, None, saves.set_phase, contextlib.nullcontext)
            grads = [p.grad for p in wrapped.parameters() if p.grad is not None]
            held = addresses([*_held(wrapped), *grads, *as_batch(batch).tensors(), *states(),
                              *runner.held_tensors(), loss])
            kept.append((out, loss))  # freed after profiling would confuse the next profile (ranks.py)
            record(result, i, prof, held, saves, baseline, states())
    kept.append(wrapped)
    _KEPT.append(kept)
    if _compiles() != compiles:
        raise GraphmemError(f"dynamo compiled {_compiles() - compiles} frame(s) during the measured steps (its cached "
                            "code's guards failed on this Trainer's model): the peaks would include compile time")
    return result


def _compiles() -> int:
    """Frames dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _compiled_once(job: Any, named: Named) -> list[object]:
    """One step of a Trainer of the same job, unmeasured: dynamo compiles the model's frames there; its
    objects are kept (freed during a profile they would read as the step's frees)."""
    torch.manual_seed(0)
    model = torch.load(io.BytesIO(job.model), weights_only=False)
    trainer = build_trainer(named(job.trainer_class), model, named(job.args_class), job.args)
    batch = torch.load(io.BytesIO(job.batch), weights_only=False)
    runner = FsdpRunner(trainer)
    with runner.session():
        runner.prepare()
        out = runner.run(trainer.model, batch, None, lambda phase: None, contextlib.nullcontext)
    return [trainer, batch, runner, out]


_KEPT: list[object] = []  # a spawned rank's measured objects, alive until it exits (see ``kept``)


__all__ = ["measure_fsdp_rank"]
