"""Ground truth for ``graphmem.analyze(trainer)`` on the Trainer's own batch: a REAL ``trainer.train()``
on the CPU, its own dataloader, sampler, collator and loop (nothing of graphmem's runner), measured
under one torch.profiler window (``profile_memory``) around the whole call, the garbage collector paused:

- each optimizer step's peak: the bytes held before ``train()`` (parameters and buffers) plus the
  highest running sum of the CPU allocator's events between the marks a ``TrainerCallback`` leaves at
  ``on_train_begin`` and at each ``on_step_end`` (a marker allocation of a size no tensor of the step
  has, allocated and freed at once, as tests/zero_truth.py marks phases);
- the first step's saved bytes: the distinct storages ``saved_tensors_hooks`` sees packed before the
  first ``on_step_end``, parameters and buffers excluded (graphmem's definition of activation bytes);
- the shapes of every micro-batch ``training_step`` is given, to tell which batches the run drew.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from graphmem.validation.measure import _allocation_events

MARK = 1_000_003  # marker sizes: MARK + the number of steps done, in bytes (uint8)


@dataclass(frozen=True)
class RunTruth:
    saved_bytes: int  # the first step's saved-for-backward storages
    peaks: tuple[int, ...]  # each optimizer step's peak, bytes held before train() included
    shapes: tuple[tuple[int, ...], ...]  # the first tensor's shape of each micro-batch train() ran


def _held(tensors: list[torch.Tensor]) -> tuple[set[int], int]:
    keys = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return set(keys), sum(keys.values())


def measure_train(trainer: Any) -> RunTruth:
    """``trainer.train()`` for real (set ``max_steps`` in its arguments), measured as the module docstring says."""
    from transformers import TrainerCallback

    model = trainer.model
    excluded, before = _held([*model.parameters(), *model.buffers()])
    done = [0]
    saved: dict[int, int] = {}
    shapes: list[tuple[int, ...]] = []

    class Marks(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            torch.empty(MARK, dtype=torch.uint8)

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            done[0] += 1
            torch.empty(MARK + done[0], dtype=torch.uint8)

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if done[0] == 0 and st._cdata not in excluded:
            saved[st._cdata] = st.nbytes()
        return t

    step = trainer.training_step

    def training_step(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        shapes.append(tuple(next(v for v in inputs.values() if isinstance(v, torch.Tensor)).shape))
        return step(model, inputs, *args, **kwargs)

    marks = Marks()
    trainer.add_callback(marks)
    trainer.training_step = training_step
    gc.collect()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            trainer.train()
    finally:
        gc.enable()
        trainer.remove_callback(marks)
        del trainer.training_step
    return RunTruth(sum(saved.values()), _step_peaks(prof, before), tuple(shapes))


def _step_peaks(prof: Any, before: int) -> tuple[int, ...]:
    """The highest running sum between consecutive marks (the marks themselves not counted)."""
    highs: list[int] = []
    running = 0
    for _, size in _allocation_events(prof):
        if MARK <= abs(size) < MARK + 1000:
            if size > 0:
                highs.append(running)
            continue
        running += size
        if highs:
            highs[-1] = max(highs[-1], running)
    return tuple(before + h for h in highs[:-1])  # (the last mark's interval is train()'s ending)


__all__ = ["RunTruth", "measure_train"]
