"""The optimizers graphmem runs after backward: real ``torch.optim`` classes, on fake tensors
in the capture and on real ones in the ground-truth measurement (graphmem/validation/measure.py).

``impl`` picks PyTorch's implementation: ``forloop`` (one op at a time per parameter),
``foreach`` (``torch._foreach_*`` ops over all parameters at once: faster, and about one
parameter-sized set of intermediates more at its peak, as torch.optim's docs say), ``fused``
(one kernel per parameter group: SGD, momentum, Adam and AdamW on CPU and CUDA) or ``auto``:
what ``torch.optim`` itself picks on the target's device (foreach on CUDA, for-loop on CPU).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphmem.errors import UsageError

# name -> (class, keyword arguments); hyperparameters are torch.optim's defaults (the lr does
# not change memory; momentum > 0 is what makes SGD keep a momentum buffer)
OPTIMIZERS: dict[str, tuple[Callable[..., torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 1e-3}),
    "momentum": (torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 1e-3}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-3}),
    "adafactor": (torch.optim.Adafactor, {"lr": 1e-2}),
}
IMPLS = ("auto", "foreach", "forloop", "fused")
_FUSED = ("sgd", "momentum", "adam", "adamw")  # torch.optim classes with a fused= option


def check_optimizer(name: Optional[str], impl: str) -> None:
    """Raise UsageError naming the fix for an unknown optimizer or an impl it does not have."""
    if name is not None and name not in OPTIMIZERS:
        raise UsageError(f"unknown optimizer {name!r}: use one of {', '.join(OPTIMIZERS)}")
    if impl not in IMPLS:
        raise UsageError(f"unknown optimizer implementation {impl!r}: use one of {', '.join(IMPLS)}")
    if name is None and impl != "auto":
        raise UsageError(f"`optimizer_impl={impl}` needs an optimizer: add `optimizer='adam'` (or sgd, momentum, adamw, adafactor)")
    if impl == "fused" and name not in _FUSED:
        raise UsageError(f"torch.optim has no fused {name}; use `optimizer_impl='foreach'` or forloop")


def resolved_impl(impl: str, device: str) -> str:
    """``auto`` -> what torch.optim picks for tensors on ``device`` when neither foreach nor
    fused is given (torch/optim/optimizer.py, _default_to_fused_or_foreach: foreach on CUDA)."""
    if impl != "auto":
        return impl
    return "foreach" if device == "cuda" else "forloop"


def make_optimizer(name: str, impl: str, params: list[torch.Tensor], device: str) -> torch.optim.Optimizer:
    """The torch.optim optimizer over ``params`` with the implementation pinned explicitly (the
    CUDA target runs on fake CPU tensors, where torch.optim's own default would be the CPU's)."""
    cls, kwargs = OPTIMIZERS[name]
    chosen = resolved_impl(impl, device)
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "forloop": {"foreach": False}}[chosen]
    return cls(params, **kwargs, **flags)


def state_tensors(opt: torch.optim.Optimizer) -> list[tuple[torch.Tensor, str, torch.Tensor]]:
    """(parameter, state name, tensor) for every tensor the optimizer holds as state."""
    return [(p, key, v) for p, st in opt.state.items() for key, v in st.items() if isinstance(v, torch.Tensor)]


class ScalarReads(TorchDispatchMode):
    """Answers ``.item()`` during the optimizer step on fake tensors. torch.optim reads a few
    tensors as Python numbers (Adam's step count for the bias correction, Adafactor's step and
    norms for its relative step size); they only scale arithmetic on Python floats, never decide
    a shape or an allocation, so any value gives the same memory. 1 keeps every formula finite
    (the step count is 1 after the first step)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            return True if t.dtype == torch.bool else 1.0 if t.is_floating_point() else 1
        return func(*args, **(kwargs or {}))
