"""Tensor subclasses and real tensors seen by the recording fake mode (graphmem/capture/recorder.py).

torch.distributed's wrappers put DTensors (wrapper subclasses around a local tensor) in the step
and keep small real tensors for their bookkeeping (a DeviceMesh's rank layout); these helpers say
which is which, so the recorder records only what allocates on rank r.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold ``t``'s memory: itself, or a wrapper subclass's inner tensors
    (``__tensor_flatten__``, as DTensor keeps its local shard), recursively."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = [getattr(t, name) for name in names]
    return [x for i in inner if isinstance(i, torch.Tensor) for x in inner_tensors(i)]


def all_real(args: tuple, kwargs: Optional[dict]) -> bool:
    """Every tensor argument is a real (non-fake) tensor, and there is one."""
    tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
    return bool(tensors) and not any(isinstance(t, FakeTensor) or is_traceable_wrapper_subclass(t) for t in tensors)


def wrapped(types: Iterable[type]) -> bool:
    """An op on a tensor subclass that wraps others (DTensor): the fake mode hands it back to the
    subclass (NotImplemented), whose ``__torch_dispatch__`` runs the op on its inner tensors,
    which come back here and are recorded; the wrapper itself allocates nothing."""
    return any(t is not FakeTensor and issubclass(t, torch.Tensor) and t is not torch.Tensor
               and t is not nn.Parameter for t in types)
