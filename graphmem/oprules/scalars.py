"""Kernel rules for the arithmetic ops that take a Scalar on the CPU (graphmem/oprules/registry.py's
scratch rules): the number becomes a tensor inside the kernel.

aten/src/ATen/native/BinaryOps.cpp: ``add``, ``sub``, ``mul``, ``div`` and their in-place forms,
given a Scalar, call the Tensor overload on ``wrapped_scalar_tensor(other)``: a 0-dim tensor made
by ``scalar_to_tensor`` (int64 for an integer, double for a float, complex128, bool: 8, 8, 16 and 1
bytes), allocated by the CPU allocator and freed when the call returns. TensorIterator then copies
it to the op's common dtype (TensorIterator.cpp ``compute_types``,
``promote_inputs_to_common_dtype_``) unless it is that dtype already: 4 B more for a float32 tensor.
The foreach forms run that per tensor on the CPU (ForeachOpsKernels.cpp ``FOREACH_BINARY_OP_SCALAR``
and ``_SCALARLIST``, the slow path: ``t.add_(scalar)`` for each ``t``), one tensor after the other, so
the most any one of them makes is live. ``torch._foreach_add_(state_steps, 1)`` in torch.optim's
fused and foreach AdamW is one: 12 B at a first step's peak (the Trainer's BERT with
``adamw_torch_fused``, measured from the profiler's allocation events).

Python's own ``x * 0.5`` never reaches these: the argument parser wraps the number before the
Tensor overload (graphmem/capture/wrapped_numbers.py counts those).
"""
from __future__ import annotations

from typing import Union

import torch

from graphmem.oprules.registry import Scratch, aten_op, register_scratch

# the 0-dim tensor a Python number becomes (c10 scalar_to_tensor; python_arg_parser.cpp likewise)
WRAPPED = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}
_NAMES = ("add", "sub", "mul", "div")
_SCALAR = tuple(aten_op(n + s, "Scalar") for n in _NAMES for s in ("", "_"))
_FOREACH = tuple(aten_op(f"_foreach_{n}{s}", o) for n in _NAMES for s in ("", "_") for o in ("Scalar", "ScalarList"))


def _common(dtype: torch.dtype, kind: type) -> torch.dtype:
    """torch's promotion of a tensor with a Python number (c10/core/ScalarType.h ``promoteTypes`` by
    category: the number wins only when its category is higher, then as the default dtype), here
    without dispatching ``torch.result_type`` inside the recording."""
    if kind is complex and not dtype.is_complex:
        return {torch.float64: torch.complex128, torch.float16: torch.complex32,
                torch.bfloat16: getattr(torch, "bcomplex32", torch.complex64)}.get(dtype, torch.complex64)
    if kind is float and not (dtype.is_floating_point or dtype.is_complex):
        return torch.get_default_dtype()
    if kind is int and dtype == torch.bool:
        return torch.int64
    return dtype


def cast_bytes(dtype: torch.dtype, value: object) -> int:
    """Bytes of TensorIterator's copy of ``value``'s wrapped tensor in the common dtype with a tensor of
    ``dtype`` (TensorIterator.cpp ``promote_inputs_to_common_dtype_``): 0 where it is that dtype already."""
    kind = next((k for k in (bool, int, float, complex) if isinstance(value, k)), float)
    common = _common(dtype, kind)
    return common.itemsize if common != WRAPPED[kind] else 0


def _one(t: torch.Tensor, value: Union[bool, int, float, complex]) -> int:
    """The wrapped tensor of ``value`` and its cast to the common dtype with ``t``."""
    kind = next((k for k in (bool, int, float, complex) if isinstance(value, k)), float)
    return WRAPPED[kind].itemsize + cast_bytes(t.dtype, value)


@register_scratch(*_SCALAR, source="aten/src/ATen/native/BinaryOps.cpp add/sub/mul/div (Scalar): wrapped_scalar_tensor")
def _scalar(args: tuple, kwargs: dict, out: object) -> list[Scratch]:
    t, value = args[0], args[1] if len(args) > 1 else kwargs["other"]
    return [Scratch(_one(t, value), "the Scalar as a 0-d tensor and its cast (BinaryOps.cpp wrapped_scalar_tensor)")]


@register_scratch(*_FOREACH, source="aten/src/ATen/native/ForeachOpsKernels.cpp FOREACH_BINARY_OP_SCALAR(LIST) "
                                    "slow path: BinaryOps.cpp wrapped_scalar_tensor per tensor")
def _foreach(args: tuple, kwargs: dict, out: object) -> list[Scratch]:
    tensors = args[0]
    given = args[1] if len(args) > 1 else kwargs.get("scalar", kwargs.get("scalars"))
    values = given if isinstance(given, (list, tuple)) else [given] * len(tensors)
    most = max((_one(t, v) for t, v in zip(tensors, values)), default=0)
    return [Scratch(most, "each tensor's Scalar as a 0-d tensor and its cast, one at a time "
                          "(ForeachOpsKernels.cpp slow path, BinaryOps.cpp wrapped_scalar_tensor)")] if most else []
