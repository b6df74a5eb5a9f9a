"""Fake tensors for a step: the model's state and the batch on the target device, the context
that wraps forward and loss for the target, and the one-line error a failed fake run becomes."""
from __future__ import annotations

import contextlib
import re
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Optional, Union

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)

from graphmem.capture.cuda_rules import CudaRules
from graphmem.capture.recorder import _Recorder
from graphmem.capture.target import Target
from graphmem.capture.values import Values
from graphmem.errors import CaptureError, DataDependentError, GraphmemError, UnsupportedOpError
from graphmem.training.batch import Batch, as_batch
from graphmem.training.qlora import fake_quant_state, quant_state_of

if TYPE_CHECKING:
    from bitsandbytes.functional import QuantState

Inputs = Union[tuple, dict, Batch, Callable[[], Any]]


def _fake_like(t: torch.Tensor, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Same shape/strides; floating tensors take the target's parameter dtype if one is set."""
    dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
    fake = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=dtype, device=device)
    return fake.requires_grad_(t.requires_grad) if t.is_floating_point() else fake


def fake_state(model: nn.Module, device: torch.device, dtype: Optional[torch.dtype],
               on_new: Callable[[torch.Tensor, str, str], None] = lambda t, kind, name: None,
               ) -> tuple[dict[str, torch.Tensor], dict[int, torch.Tensor]]:
    """Fresh fake parameters and buffers by name (tied ones stay one tensor), run under a fake
    mode; ``on_new(tensor, kind, name)`` is told of each distinct one."""
    state: dict[str, torch.Tensor] = {}
    seen: dict[int, torch.Tensor] = {}
    for kind, named in (("parameter", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):
        for name, p in named:
            if id(p) not in seen:
                seen[id(p)] = _fake_like(p, device, dtype)
                on_new(seen[id(p)], kind, name)
                qs = quant_state_of(p)
                if qs is not None:
                    _attach_quant_state(seen[id(p)], qs, name, device, seen, on_new)
            state[name] = seen[id(p)]
    return state, seen


def _attach_quant_state(fake: torch.Tensor, qs: QuantState, name: str, device: torch.device, seen: dict[int, torch.Tensor],
                        on_new: Callable[[torch.Tensor, str, str], None]) -> None:
    """A bitsandbytes 4-bit weight (graphmem/training/qlora.py): its fake carries a QuantState of
    fake tensors in their own dtypes (fp32 and uint8 block scales), each reported as a buffer, so
    ``Linear4bit.forward`` finds ``weight.quant_state`` as on the real parameter
    (bitsandbytes/nn/modules.py ``fix_4bit_weight_quant_state_from_module``)."""
    def make(t: torch.Tensor, field: str) -> torch.Tensor:
        if id(t) not in seen:  # double quantization's code can be shared between layers
            seen[id(t)] = _fake_like(t, device)
            on_new(seen[id(t)], "buffer", f"{name}.quant_state.{field}")
        return seen[id(t)]

    fake.quant_state = fake_quant_state(qs, make)  # type: ignore[attr-defined]


def fake_batch(inputs: "Inputs", fake_mode: FakeTensorMode, device: torch.device,
               dtype: Optional[torch.dtype], values: Optional[Values] = None) -> Batch:
    """The step's inputs (a tuple, dict or ``(args, kwargs)``: graphmem/training/batch.py) as
    fake tensors of ``fake_mode`` (run under it); ``values`` keeps the real tensors' values
    beside their fakes (graphmem/capture/values.py)."""
    with torch.device(device), values.making_batch() if values is not None else contextlib.nullcontext():
        raw = inputs() if callable(inputs) and not isinstance(inputs, Batch) else inputs

    def fake(x: torch.Tensor) -> torch.Tensor:
        if fake_mode is getattr(x, "fake_mode", None) and (dtype is None or not x.is_floating_point()):
            if values is not None:
                values.admit(x)
            return x
        made = _fake_like(x, device, dtype)
        if values is not None:
            values.attach(made, x)
        return made
    return as_batch(raw).map(fake)


def forward_context(target: Target, used: dict[str, int],
                    clearing: Callable[[], ContextManager[object]] = contextlib.nullcontext,
                    ) -> Callable[[], ContextManager[object]]:
    """What wraps forward and loss for the target: CPU autocast / SDPA backend, or CUDA rules
    (``clearing`` wraps their cast cache's emptying)."""
    if target.device == "cuda":
        rules = CudaRules(target, used, clearing)  # it counts the SDPA backends it picks into ``used``
        return lambda: rules

    def cpu() -> contextlib.ExitStack:
        from contextlib import ExitStack

        from torch.nn.attention import SDPBackend, sdpa_kernel

        stack = ExitStack()
        if target.amp_dtype is not None:
            stack.enter_context(torch.autocast("cpu", dtype=target.amp_dtype))
        if target.attention in ("flash", "math"):
            backend = SDPBackend.FLASH_ATTENTION if target.attention == "flash" else SDPBackend.MATH
            stack.enter_context(sdpa_kernel(backend))
        return stack
    return cpu


def translate_error(e: Exception, cap: _Recorder, root: str) -> GraphmemError:
    """What failed while ``cap`` recorded ``root``'s step, as a one-line error naming the fix."""
    return translate_in(e, cap.phase, root, cap.stack[-1] if cap.stack else "")


def translate_in(e: Exception, phase: str, root: str, module: str = "") -> GraphmemError:
    """What failed in ``phase`` of ``root``'s step (in ``module``, a path, when known), as a
    one-line error naming the fix."""
    where = f"module {module!r}" if module else f"{root}.forward"
    if phase == "backward":
        where = "backward"
    elif phase == "loss":
        where = "the loss"
    if isinstance(e, DataDependentOutputException):
        return DataDependentError(
            f"{where} reads tensor values ({e.func}), which fake tensors do not have; graphmem "
            "analyzes without running real data: replace .item()/.tolist()/value-dependent "
            "`if` with shape-based code or Python constants"
        )
    if isinstance(e, DynamicOutputShapeException):
        return DataDependentError(
            f"{where} calls {e.func}, whose output shape depends on tensor values (e.g. "
            "torch.nonzero or boolean-mask indexing); use a fixed-shape form such as "
            "torch.where(mask, x, 0) or a mask multiply"
        )
    if isinstance(e, UnsupportedOperatorException):
        return UnsupportedOpError(
            f"operator {e.func} (in {where}) has no fake-tensor implementation; register one "
            "with torch.library.register_fake, or replace the op"
        )
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    fake_impl = re.search(r"no fake impl registered for <CustomOpDef\((\S+)\)>", msg)
    if fake_impl:
        return UnsupportedOpError(
            f"custom op {fake_impl.group(1)} (in {where}) has no fake-tensor implementation; add one "
            f"with @{fake_impl.group(1).split('::')[-1]}.register_fake (torch.library.register_fake), "
            "returning an empty tensor of the output's shape"
        )
    return CaptureError(
        f"{where} raised {type(e).__name__}: {msg} (while running the {phase} on fake "
        "tensors); check that the input shape fits the model, or rerun with `debug` for the traceback"
    )
