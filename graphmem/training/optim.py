"""The optimizers graphmem runs after backward: real ``torch.optim`` classes, on fake tensors
in the capture and on real ones in the ground-truth measurement (graphmem/validation/measure.py).

``impl`` picks PyTorch's implementation: ``forloop`` (one op at a time per parameter),
``foreach`` (``torch._foreach_*`` ops over all parameters at once: faster, and about one
parameter-sized set of intermediates more at its peak, as torch.optim's docs say), ``fused``
(one kernel per parameter group: SGD, momentum, Adam and AdamW on CPU and CUDA) or ``auto``:
what ``torch.optim`` itself picks on the target's device (foreach on CUDA, for-loop on CPU).

bitsandbytes' 8-bit Adam (``adam8bit``, ``adamw8bit``, ``paged_adamw8bit``: the classes
``bitsandbytes.optim.Adam8bit`` / ``AdamW8bit`` / ``PagedAdamW8bit`` with their own defaults) has
one implementation, its own kernels per parameter (graphmem/oprules/bnb.py: their CPU scratch).
Its states (bitsandbytes/optim/optimizer.py ``Optimizer2State.init_state``, 0.50): a parameter of
``min_8bit_size`` (4096) elements or more gets two uint8 states of its shape and two fp32 absmax
vectors of one value per 256-element block, plus the optimizer's two 256-entry fp32 quantization
maps (``qmap1``/``qmap2``: one pair per optimizer, shared by every parameter); a smaller one two
fp32 states; the step count is a Python int. ``paged_adamw8bit`` on the CPU is ``adamw8bit``
(``get_state_buffer``: "Paged optimizers are not supported on CPU", zeros_like); on CUDA its
states of parameters of 1e5 elements or more come from ``F.get_paged`` (cudaMallocManaged,
outside PyTorch's caching allocator, paged out to the host under pressure), which the CUDA
target does not model: refused there.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from graphmem.errors import UsageError

# name -> (class, keyword arguments); hyperparameters are torch.optim's defaults (the lr does
# not change memory; momentum > 0 is what makes SGD keep a momentum buffer)
OPTIMIZERS: dict[str, tuple[Callable[..., torch.optim.Optimizer], dict[str, object]]] = {
    "sgd": (torch.optim.SGD, {"lr": 1e-3}),
    "momentum": (torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 1e-3}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-3}),
    "adafactor": (torch.optim.Adafactor, {"lr": 1e-2}),
}
# name -> bitsandbytes.optim class (imported when used: bitsandbytes is optional)
BNB_OPTIMIZERS = {"adam8bit": "Adam8bit", "adamw8bit": "AdamW8bit", "paged_adamw8bit": "PagedAdamW8bit"}
NAMES = (*OPTIMIZERS, *BNB_OPTIMIZERS)
IMPLS = ("auto", "foreach", "forloop", "fused")
_FUSED = ("sgd", "momentum", "adam", "adamw")  # torch.optim classes with a fused= option


def check_optimizer(name: Optional[str], impl: str) -> None:
    """Raise UsageError naming the fix for an unknown optimizer or an impl it does not have."""
    if name is not None and name not in NAMES:
        raise UsageError(f"unknown optimizer {name!r}: use one of {', '.join(NAMES)}")
    if impl not in IMPLS:
        raise UsageError(f"unknown optimizer implementation {impl!r}: use one of {', '.join(IMPLS)}")
    if name is None and impl != "auto":
        raise UsageError(f"`optimizer_impl={impl}` needs an optimizer: add `optimizer='adam'` (or sgd, momentum, adamw, adafactor)")
    if name in BNB_OPTIMIZERS and impl != "auto":
        raise UsageError(f"bitsandbytes' {name} has one implementation (its own kernels): drop `optimizer_impl`")
    if impl == "fused" and name not in _FUSED:
        raise UsageError(f"torch.optim has no fused {name}; use `optimizer_impl='foreach'` or forloop")


def resolved_impl(impl: str, device: str) -> str:
    """``auto`` -> what torch.optim picks for tensors on ``device`` when neither foreach nor
    fused is given (torch/optim/optimizer.py, _default_to_fused_or_foreach: foreach on CUDA)."""
    if impl != "auto":
        return impl
    return "foreach" if device == "cuda" else "forloop"


def describe_impl(name: str, impl: str, device: str) -> str:
    """The implementation as the report names it: torch.optim's resolved one, or bitsandbytes'."""
    return "bitsandbytes" if name in BNB_OPTIMIZERS else resolved_impl(impl, device)


def make_optimizer(name: str, impl: str, params: list[torch.Tensor], device: str) -> torch.optim.Optimizer:
    """The torch.optim optimizer over ``params`` with the implementation pinned explicitly (the
    CUDA target runs on fake CPU tensors, where torch.optim's own default would be the CPU's);
    bitsandbytes' over fake parameters under ScalarReads (its quantization maps are built from
    values it reads, bitsandbytes/functional.py ``create_dynamic_map``)."""
    if name in BNB_OPTIMIZERS:
        return _bnb_optimizer(name, params, device)
    cls, kwargs = OPTIMIZERS[name]
    chosen = resolved_impl(impl, device)
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "forloop": {"foreach": False}}[chosen]
    return cls(params, **kwargs, **flags)


def _bnb_optimizer(name: str, params: list[torch.Tensor], device: str) -> torch.optim.Optimizer:
    if name.startswith("paged") and device == "cuda":
        raise UsageError(f"{name} keeps large states in CUDA managed memory (cudaMallocManaged, outside PyTorch's "
                         "allocator), which graphmem does not model: use `optimizer='adamw8bit'` (the same bytes "
                         "in PyTorch's allocator) or `device='cpu'`")
    try:
        import bitsandbytes.optim as bnb_optim
    except ImportError as e:
        raise UsageError(f"`optimizer='{name}'` runs bitsandbytes' optimizer: pip install bitsandbytes ({e})") from None
    cls = getattr(bnb_optim, BNB_OPTIMIZERS[name])
    fake = any(isinstance(p, FakeTensor) for p in params)
    with ScalarReads() if fake else contextlib.nullcontext():
        return cls(params)


# the kind a runner marks an optimizer state with when it lives in host memory (graphmem/capture/capture.py
# ``marker``): torch.optim's scalar ``step`` on a CUDA device, outside a fused or capturable group
HOST_STATE = "optimizer state (host memory)"


def state_tensors(opt: torch.optim.Optimizer) -> list[tuple[torch.Tensor, str, torch.Tensor]]:
    """(parameter, state name, tensor) for every tensor the optimizer holds as state."""
    return [(p, key, v) for p, st in opt.state.items() for key, v in st.items() if isinstance(v, torch.Tensor)]


def held_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Tensors the optimizer holds outside its per-parameter state from construction on: bitsandbytes'
    quantization maps (bitsandbytes/optim/optimizer.py ``Optimizer8bit.fill_qmap``, ``name2qmap``:
    live before the first step, in every parameter's state as ``qmap1``/``qmap2`` after it)."""
    return [t for t in getattr(opt, "name2qmap", {}).values() if isinstance(t, torch.Tensor)]


class ScalarReads(TorchDispatchMode):
    """Answers ``.item()`` during the optimizer step on fake tensors. torch.optim reads a few
    tensors as Python numbers (Adam's step count for the bias correction, Adafactor's step and
    norms for its relative step size); they only scale arithmetic on Python floats, never decide
    a shape or an allocation, so any value gives the same memory. 1 keeps every formula finite
    (the step count is 1 after the first step)."""

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: Sequence[type], args: tuple = (),
                           kwargs: Optional[dict] = None) -> object:
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            return True if t.dtype == torch.bool else 1.0 if t.is_floating_point() else 1
        return func(*args, **(kwargs or {}))
