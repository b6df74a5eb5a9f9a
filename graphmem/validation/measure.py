"""Ground truth from a REAL run of the same training step (graphmem/training/step.py) on the CPU.

- Saved bytes: ``saved_tensors_hooks`` on the real forward and loss, deduplicated by storage,
  parameters and buffers excluded — the definition of activation bytes; what selective
  checkpointing keeps passes through them too (graphmem/capture/sac.py).
- Model state: parameters, buffers and a 4-bit model's bitsandbytes quant states
  (graphmem/training/qlora.py), which live beside the packed weights.
- Peak: the CPU allocator's own events, read from ``torch.profiler`` with
  ``profile_memory=True`` (every c10 CPU allocation and free, with its size). The peak is the
  bytes live before the step (parameters, buffers, inputs) plus the largest running sum of
  those events during the step.

These functions allocate real memory: use small shapes.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Protocol

import torch
import torch.nn as nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from graphmem.capture.collector import quiet_gc
from graphmem.capture.sac import through_hooks
from graphmem.training.batch import as_batch
from graphmem.training.loop import LoopRunner, Session, TrainStep
from graphmem.training.qlora import quant_state_tensors
from graphmem.training.step import LossFn, run_step

Runner = Callable[..., Any]  # Session.run's signature (graphmem/capture/capture.py StepRunner)


class StepSession(LoopRunner, Protocol):
    """What ``measure_peak`` reads of a step runner: graphmem's ``Session`` (graphmem/training/loop.py) or a
    Trainer's (graphmem/training/hf_trainer.py ``TrainerRunner``)."""

    @property
    def masters(self) -> dict[str, torch.Tensor]: ...

    @property
    def host_bytes(self) -> int: ...

    def state_tensors(self) -> list[tuple[torch.Tensor, str, torch.Tensor]]: ...

    def held_tensors(self) -> list[torch.Tensor]: ...


@dataclass(frozen=True)
class RealStep:
    saved_bytes: int  # distinct non-parameter storages saved for backward (forward + loss)
    peak_bytes: int  # baseline + largest running sum of allocator events
    baseline_bytes: int  # parameters, buffers and inputs, live before the step
    allocations: int  # allocator events seen
    state_bytes: int = 0  # optimizer state (distinct storages) after the step, with graphmem/training/loop.py
    host_bytes: int = 0  # what the loop's offloading hooks moved to host memory in the measured step


def _storage_bytes(tensors: list[torch.Tensor]) -> tuple[set[int], int]:
    keys: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        keys[st._cdata] = st.nbytes()
    return set(keys), sum(keys.values())


def _autocast(amp: Optional[torch.dtype]) -> Callable[[], ContextManager[object]]:
    """The real step's forward context: CPU autocast to ``amp``, or nothing."""
    return (lambda: torch.autocast("cpu", dtype=amp)) if amp is not None else contextlib.nullcontext


def measure_saved(model: nn.Module, inputs: object, loss_fn: Optional[LossFn] = None,
                  amp: Optional[torch.dtype] = None,
                  forward_context: Optional[Callable[[], ContextManager[object]]] = None,
                  runner: Optional[Runner] = None) -> int:
    """Bytes of the distinct storages autograd saves in a real forward + loss (under CPU
    autocast to ``amp`` if given, or under ``forward_context()``: e.g. CUDA autocast and an SDPA
    backend, benchmarks/gpu_truth.py). ``inputs``: a tuple, a dict (``model(**inputs)``) or
    ``(args, kwargs)``, as graphmem/training/batch.py reads them; any device. ``runner`` (a step
    runner, as the capture takes: graphmem/training/hf_trainer.py) runs its whole step instead; the
    last micro-step's forward and loss are counted, as the capture's phases name them."""
    state = [*model.parameters(), *model.buffers(), *quant_state_tensors(model)]
    excluded, _ = _storage_bytes(state)
    saved: dict[int, int] = {}
    phase = ["forward"]

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if phase[0] in ("forward", "loss") and st._cdata not in excluded:
            saved[st._cdata] = st.nbytes()
        return t

    def set_phase(p: str) -> None:
        if p == "forward":  # a later micro-step: the last one's saved set is the step's
            saved.clear()
        phase[0] = p

    model.train()
    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), through_hooks():  # SAC's kept tensors too
        context = forward_context or _autocast(amp)
        if runner is None:
            run_step(model, inputs, loss_fn, set_phase, context)
        else:
            runner(model, inputs, loss_fn, set_phase, context)
    model.zero_grad(set_to_none=True)
    return sum(saved.values())


def _allocation_events(prof: Any) -> list[tuple[int, int]]:
    events: list[tuple[int, int]] = []
    todo = list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, e.extra_fields.alloc_size))
        todo.extend(e.children)
    events.sort()
    return events


def measure_peak(model: nn.Module, inputs: object, loss_fn: Optional[LossFn] = None,
                 train: Optional[TrainStep] = None, warm_steps: int = 0,
                 amp: Optional[torch.dtype] = None, runner: Optional[StepSession] = None) -> RealStep:
    """Real CPU step under the profiler; the peak from the allocator's events. ``train`` adds
    micro-batches and the optimizer step (graphmem/training/loop.py); ``warm_steps`` runs that many
    whole steps first, unprofiled (the optimizer states then exist before the measured one);
    ``amp`` runs forward and loss under CPU autocast to that dtype. ``runner``: an object with
    Session's ``run``, ``optimizer`` and ``masters``, and ``held_tensors()`` (a transformers Trainer's step: graphmem/training/hf_trainer.py)
    runs the step in its place, the same runner the capture ran."""
    context = _autocast(amp)
    model.train()
    model.zero_grad(set_to_none=True)
    session: Optional[StepSession] = runner if runner is not None else Session(train, dict(model.named_parameters()), "cpu") \
        if train is not None else None
    for _ in range(warm_steps):
        if session is not None:
            out, loss = session.run(model, inputs, loss_fn, lambda p: None, context)
            del out, loss
    states = [t for _, _, t in session.state_tensors()] if session is not None else []
    masters = list(session.masters.values()) if session is not None else []
    # what the loop keeps between steps besides states: the Trainer's _tr_loss, bitsandbytes' maps
    held = session.held_tensors() if session is not None else []
    tensors = [*model.parameters(), *model.buffers(), *quant_state_tensors(model), *as_batch(inputs).tensors(),
               *masters, *states, *held]
    _, baseline = _storage_bytes(tensors)
    moved = session.host_bytes if session is not None else 0  # by the warm steps
    with quiet_gc(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        if session is None:
            out, loss = run_step(model, inputs, loss_fn, forward_context=context)
        else:
            out, loss = session.run(model, inputs, loss_fn, lambda p: None, context)
    del out, loss
    state_bytes = host_bytes = 0
    if session is not None:
        state_bytes = _storage_bytes([t for _, _, t in session.state_tensors()])[1]
        host_bytes = session.host_bytes - moved
    events = _allocation_events(prof)
    running = high = 0
    for _, size in events:
        running += size
        high = max(high, running)
    model.zero_grad(set_to_none=True)
    saved = measure_saved(model, inputs, loss_fn, amp, runner=runner.run if runner is not None else None)
    return RealStep(saved, baseline + high, baseline, len(events), state_bytes, host_bytes)
