"""The loop options real trainers use, run by graphmem/training/loop.py's Session on fake tensors
(the capture) and on real ones (graphmem/validation/measure.py) alike:

- ``release_output``: the model's output is dropped before backward, keeping only the loss
  (HF Trainer's ``compute_loss`` returns the loss alone; torchtune and torchtitan ``del logits``):
  graphmem/training/step.py ``run_step``.
- ``clip_grad_norm``: ``torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=...)`` after the
  last micro-step's backward, before the optimizer step (HF Trainer, torchtitan): ``clip``.
- ``optimizer_in_backward``: one optimizer per parameter, stepped from
  ``Tensor.register_post_accumulate_grad_hook`` and its gradient set to None right after (PyTorch's
  tutorial "How to save memory by fusing the optimizer step into the backward pass", torchtune's
  ``register_optim_in_bwd_hooks``): ``InBackward``.
- ``offload_activations``: tensors saved in forward go to host memory through
  ``torch.autograd.graph.saved_tensors_hooks`` and come back in backward, as
  ``torch.autograd.graph.save_on_cpu`` runs it (pack: an empty contiguous host tensor of the
  saved tensor's size, ``copy_``; unpack: a copy back to the device): ``Offload``.

Known limitations: offloading follows torchtune's OffloadActivations in not moving parameters
(``save_on_cpu`` copies them too), and offloads every other tensor saved in the forward phase
(torchtune skips those under ``min_offload_size``, 1 KiB; the loss's saves stay on the device,
as torchtune's recipes compute the loss outside the offloading context). Host memory is not part of
the device's peak: its bytes are reported apart (``host_bytes``). On the CPU target the "host" of
a real run is memory outside torch's CPU allocator (a numpy buffer: the profiler does not see it,
as the CUDA caching allocator does not see pinned host memory), so a real CPU step measures what
a GPU step would hold on the device.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional

import numpy as np
import torch

from graphmem.errors import UsageError
from graphmem.training.optim import ScalarReads, make_optimizer, state_tensors

if TYPE_CHECKING:
    from graphmem.stepgraph import Storage

Mark = Callable[[str, list[tuple[str, torch.Tensor]]], None]
# (pack_as(saved, kept) -> handle autograd holds, unpack(handle) -> kept): the caller's own view of the
# saves (the capture's recorder: graphmem/capture/recorder.py ``pack_as``), told of the tensor autograd
# saved while ``kept`` (its host copy) is what the handle holds
Observe = tuple[Callable[[torch.Tensor, torch.Tensor], Any], Callable[[Any], torch.Tensor]]
PLAIN: Observe = (lambda saved, kept: kept, lambda handle: handle)
OFFLOADED = "offloaded"  # the kind of a host copy's storage in the StepGraph (0 device bytes)


def check_loop_options(optimizer: Optional[str], micro_batches: int, master_weights: bool, release_output: bool,
                       clip_grad_norm: Optional[float], clip_foreach: bool, optimizer_in_backward: bool,
                       offload_activations: bool) -> None:
    """Raise UsageError naming the fix for a loop option that is malformed or does not combine."""
    for name, value in (("release_output", release_output), ("clip_foreach", clip_foreach),
                        ("optimizer_in_backward", optimizer_in_backward), ("offload_activations", offload_activations)):
        if not isinstance(value, bool):
            raise UsageError(f"{name} must be True or False, got {value!r}")
    if clip_grad_norm is not None:
        if isinstance(clip_grad_norm, bool) or not isinstance(clip_grad_norm, (int, float)) or not clip_grad_norm > 0:
            raise UsageError(f"clip_grad_norm is the largest gradient norm, a positive number (e.g. 1.0), got {clip_grad_norm!r}")
        if optimizer is None:
            raise UsageError("clip_grad_norm clips the gradients before the optimizer step: add optimizer='adamw' (or another)")
    elif not clip_foreach:
        raise UsageError("clip_foreach picks clip_grad_norm_'s implementation: add clip_grad_norm=1.0 (or another norm)")
    if optimizer_in_backward:
        if optimizer is None:
            raise UsageError("optimizer_in_backward steps an optimizer per parameter in backward: add optimizer='adamw' (or another)")
        clash = ("micro_batches > 1" if micro_batches > 1 else "clip_grad_norm" if clip_grad_norm is not None
                 else "master_weights" if master_weights else "")
        if clash:
            raise UsageError(f"optimizer_in_backward steps each parameter as soon as its gradient is made, so it does not "
                             f"combine with {clash} (torchtune refuses it too): drop one of them")


def describe(release_output: bool, clip_grad_norm: Optional[float], clip_foreach: bool, optimizer_in_backward: bool,
             offload_activations: bool) -> list[str]:
    """The report's words for the options set."""
    parts = []
    if optimizer_in_backward:
        parts.append("optimizer in backward (per-parameter, post-accumulate-grad hooks)")
    if clip_grad_norm is not None:
        parts.append(f"clip_grad_norm_ {clip_grad_norm:g} ({'foreach' if clip_foreach else 'per tensor'})")
    if release_output:
        parts.append("output released before backward")
    if offload_activations:
        parts.append("activations offloaded to host")
    return parts


def clip(params: list[torch.Tensor], max_norm: float, foreach: bool) -> None:
    """torch's own clip_grad_norm_, foreach pinned (with ``foreach=None`` torch picks foreach only for
    plain tensors, so fake ones would run the per-tensor path a real step does not run)."""
    torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=foreach)


class InBackward:
    """One optimizer per trainable parameter, stepped by a post-accumulate-grad hook (then its
    gradient set to None), registered for one step's backward by ``hooks``."""

    def __init__(self, name: str, impl: str, params: dict[str, torch.Tensor], device: str) -> None:
        self.params = params
        self.optimizers = {n: make_optimizer(name, impl, [p], device) for n, p in params.items()}

    def states(self) -> list[tuple[torch.Tensor, str, torch.Tensor]]:
        return [s for opt in self.optimizers.values() for s in state_tensors(opt)]

    @contextlib.contextmanager
    def hooks(self, mark: Mark, fake: bool) -> Iterator[None]:
        def step(name: str, p: torch.Tensor) -> None:
            opt = self.optimizers[name]
            if p.grad is not None:
                mark("gradient", [(name, p.grad)])
            with ScalarReads() if fake else contextlib.nullcontext():  # Adam's step count, on fake tensors
                opt.step()
            mark("optimizer state", [(f"{name}:{key}", t) for _, key, t in state_tensors(opt)])
            opt.zero_grad(set_to_none=True)

        handles = [p.register_post_accumulate_grad_hook(lambda p, n=n: step(n, p)) for n, p in self.params.items()]
        try:
            yield
        finally:
            for h in handles:
                h.remove()


def _host_copy(t: torch.Tensor, fake: bool) -> torch.Tensor:
    """save_on_cpu's pack: an empty contiguous tensor of ``t``'s size in host memory, ``copy_``."""
    if fake or t.device.type != "cpu":
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout,
                           device="cpu", pin_memory=not fake and torch.cuda.is_available())
    else:  # a real CPU step: host memory outside torch's allocator (module docstring)
        raw = torch.from_numpy(np.empty(t.numel() * t.element_size(), dtype=np.uint8))
        host = raw.view(t.dtype).view(t.size())
    return host.copy_(t)


class Offload:
    """Saved-tensor hooks moving what the forward saves to host memory and back (see the module
    docstring). ``host_bytes``: what the hooks moved, counted per packed tensor as save_on_cpu
    copies it (a storage saved twice is copied twice)."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.kept = frozenset(p.untyped_storage()._cdata for p in params.values())  # parameters stay
        self.host_bytes = 0

    @contextlib.contextmanager
    def hooks(self, phase: list[str], device: str, mark: Mark, fake: bool, observe: Observe) -> Iterator[None]:
        """Active for the whole step; ``phase[0]`` (kept by the loop) says whether a save is the forward's."""
        seen, unseen = observe

        def pack(t: torch.Tensor) -> tuple[bool, object]:
            if phase[0] != "forward" or t.untyped_storage()._cdata in self.kept:
                return False, seen(t, t)
            host = _host_copy(t, fake)
            self.host_bytes += t.numel() * t.element_size()
            mark(OFFLOADED, [("saved tensor (host memory)", host)])
            return True, seen(t, host)

        def unpack(packed: tuple[bool, object]) -> torch.Tensor:
            moved, handle = packed
            t = unseen(handle)
            if not moved:
                return t
            if fake or device == "cpu":  # the copy back (on the CPU target: into torch's allocator)
                return t.clone()
            return t.to(device, non_blocking=True)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield


def host_bytes_of(storages: Iterable[Storage]) -> int:
    """Bytes the offloaded saves hold in host memory: their storages take none on the device."""
    total = 0
    for s in storages:
        if s.kind == OFFLOADED:
            n = 1
            for d in s.shape:
                n *= d
            total += n * torch.empty((), dtype=getattr(torch, s.dtype)).element_size()
    return total
