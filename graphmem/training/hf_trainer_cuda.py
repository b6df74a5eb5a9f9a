"""A transformers ``Trainer``'s step on the CUDA target (graphmem/training/hf_trainer.py runs it).

The CUDA target runs the step on fake CPU tensors with CUDA's rules applied (graphmem/capture/target.py,
graphmem/capture/cuda_rules.py). The Trainer's own code still runs; these are the places where it
binds to its device, routed through the target (transformers 5.24 ``trainer.py``/``training_args.py``,
accelerate 1.15 ``accelerator.py``/``utils/modeling.py``):

- ``args.device`` (``TrainingArguments._setup_devices``, a cached property) and accelerate's
  ``PartialState.device`` read ``cpu`` for the step, so ``_prepare_input``'s ``.to(args.device)``,
  ``get_batch_samples``' token count and ``_tr_loss`` stay on the fake CPU tensors (on this machine
  they read ``cpu`` already: a GPU user's TrainingArguments fall back to the CPU where none is found);
- accelerate's ``prepare_model`` builds its autocast once, ``torch.autocast(device_type=state.device.type,
  dtype=bf16)`` (``get_mixed_precision_context_manager``): the runner calls it in its first run, inside
  the target's rules, where an autocast made for the fake tensors' device type is the CUDA region it
  stands for (graphmem/capture/cuda_rules.py ``_translated_init``), whose casts follow CUDA's lists,
  not CPU autocast's; so is CUDA autocast's state, the target's ``amp`` (bf16 under ``bf16=True``),
  in a checkpoint's recompute, as torch.utils.checkpoint restores the forward's on the GPU;
- ``compute_loss`` (forward and the model's loss) runs under the target's ``CudaRules`` (SDPA's CUDA
  kernel, the fused dropout, CUDA autocast's casts where accelerate's region turns it on); the
  rules' cast cache is emptied where ``torch.autocast.__exit__`` empties autocast's, at the end of the
  outermost region (accelerate's, around the model's forward), as on the GPU;
- the optimizer's implementation: torch.optim given neither ``foreach`` nor ``fused`` picks foreach
  for CUDA tensors (torch/optim/optimizer.py ``_default_to_fused_or_foreach``), the for-loop for the
  fake CPU ones, so ``foreach=True`` is set in such groups (as graphmem's loop pins it, optim.py
  ``make_optimizer``); ``adamw_torch_fused`` stays fused (torch's fused Adam has a CPU kernel);
- torch.optim's scalar ``step`` states live in host memory unless the group is fused or capturable
  (torch/optim/adam.py ``_init_group``): marked so (``HOST_STATE``), no device bytes.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Optional

import torch
import torch.nn as nn

from graphmem.training.loop import Mark
from graphmem.training.optim import HOST_STATE, state_tensors

if TYPE_CHECKING:
    from transformers import Trainer

__all__ = ["bf16_check_answered", "cuda_step", "foreach_as_real", "mark_states", "on_fake_cpu", "pin_foreach"]


@contextlib.contextmanager
def on_fake_cpu(trainer: Trainer) -> Iterator[None]:
    """``trainer.args.device`` and accelerate's device read ``cpu`` inside (the fake tensors' device)."""
    from accelerate.state import PartialState

    args, shared, cpu = trainer.args, PartialState._shared_state, torch.device("cpu")
    kept_args = args.__dict__.get("_setup_devices")
    kept_state = shared.get("device")
    args.__dict__["_setup_devices"] = cpu  # the cached property's value (TrainingArguments.device)
    if kept_state is not None:
        shared["device"] = cpu
    try:
        yield
    finally:
        if kept_args is None:
            args.__dict__.pop("_setup_devices", None)
        else:
            args.__dict__["_setup_devices"] = kept_args
        if kept_state is not None:
            shared["device"] = kept_state


def pin_foreach(optimizer: object) -> None:
    """``foreach=True`` where a torch.optim group leaves both ``foreach`` and ``fused`` unset: CUDA's pick."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return
    for group in optimizer.param_groups:
        if "foreach" in group and group["foreach"] is None and not group.get("fused"):
            group["foreach"] = True


def mark_states(mark: Mark, model: nn.Module, optimizer: torch.optim.Optimizer, cuda: bool) -> None:
    """Name the optimizer's states for the capture (``mark``, as graphmem's loop names them); on the CUDA
    target the scalar ``step`` states torch.optim keeps on the host (groups neither fused nor
    capturable) as ``HOST_STATE``: no device bytes."""
    names, states = {id(p): n for n, p in model.named_parameters()}, state_tensors(optimizer)
    on_host = {id(p) for g in optimizer.param_groups if not (g.get("fused") or g.get("capturable")) for p in g["params"]} \
        if cuda and isinstance(optimizer, torch.optim.Optimizer) else set()
    host = {id(v) for p, key, v in states if key == "step" and v.numel() <= 1 and id(p) in on_host}
    for kind in ("optimizer state", HOST_STATE):
        mark(kind, [(f"{names.get(id(p), '?')}:{key}", v) for p, key, v in states if (id(v) in host) == (kind == HOST_STATE)])


@contextlib.contextmanager
def cuda_step(forward_context: Callable[[], Any], deferred: contextlib.ExitStack,
              prepare: Optional[Callable[[], ContextManager[object]]]) -> Iterator[Callable[[], ContextManager[object]]]:
    """What the CUDA target changes for one run of the step. ``prepare`` (the first run: accelerate's
    ``prepare_model``) is entered into ``deferred`` (the runner's session) under the target's rules
    (``forward_context()``: one ``CudaRules``), so the autocast it builds is CUDA's. Yields the rules
    for each ``compute_loss``; while inside,
    ``torch.clear_autocast_cache`` (called by the outermost autocast region's exit) also empties the
    rules' cast cache."""
    rules = forward_context()
    clear = torch.clear_autocast_cache

    def cleared() -> None:
        clear()
        rules.clear_casts()

    if prepare is not None:
        with rules:
            deferred.enter_context(prepare())
    torch.clear_autocast_cache = cleared  # type: ignore[assignment]
    try:
        yield lambda: rules
    finally:
        torch.clear_autocast_cache = clear  # type: ignore[assignment]


@contextlib.contextmanager
def foreach_as_real(fake: bool) -> Iterator[None]:
    """``fake``: fake tensors count as the plain tensors they stand for in
    ``torch.utils._foreach_utils._has_foreach_support`` (its ``type(t) in [torch.Tensor]`` check), so
    accelerate's ``clip_grad_norm_`` (``foreach=None``) takes the ``_foreach_norm`` path real
    gradients take, on the CPU (``"cpu"`` is among its devices) as on CUDA."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils import _foreach_utils

    types = _foreach_utils._foreach_supported_types
    added = fake and FakeTensor not in types
    if added:
        types.append(FakeTensor)
    try:
        yield
    finally:
        if added:
            types.remove(FakeTensor)


@contextlib.contextmanager
def bf16_check_answered(answer: bool) -> Iterator[None]:
    """TrainingArguments' bf16 check (transformers training_args.py ``_validate_args``: "Your setup doesn't
    support bf16/gpu" unless ``is_torch_bf16_gpu_available()`` or ``use_cpu``) answered ``answer`` while
    arguments are built here, for the machine they were written for rather than this one."""
    import transformers.training_args as training_args

    kept = training_args.is_torch_bf16_gpu_available
    training_args.is_torch_bf16_gpu_available = lambda *a, **k: answer
    try:
        yield
    finally:
        training_args.is_torch_bf16_gpu_available = kept
