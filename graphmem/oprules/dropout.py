"""Kernel rules for the fused dropout ops on the CPU (graphmem/oprules/registry.py's scratch rules).

Eager CPU dropout never calls them (aten/src/ATen/native/Dropout.cpp ``dropout``: the fused
kernel only for CUDA-like devices, ``is_fused_kernel_acceptable``); AOTAutograd's decomposition
does, so they matter in compiled mode (``mode="compiled"``), where the backward's temporaries
can make the step's peak (tests/oprules/test_workspace.py: a compiled nn.TransformerEncoder step).
Both follow Dropout.cpp and are checked against the real kernels to the byte, fp32/bf16/fp16.
"""
from __future__ import annotations

import math

import torch

from graphmem.oprules.registry import Scratch, register_scratch

aten = torch.ops.aten
_WRAPPED = 8  # a Python float operand becomes a 0-d double tensor ("wrapped number")


def _dense(t: torch.Tensor) -> int:
    return math.prod(t.shape) * t.element_size()


@register_scratch(aten.native_dropout.default, source="aten/src/ATen/native/Dropout.cpp native_dropout_cpu")
def _native_dropout(args: tuple, kwargs: dict, out: object) -> list[Scratch]:
    """Dropout.cpp ``native_dropout_cpu``: ``input.mul(mask)`` with the bool mask: TensorIterator
    casts the mask to the input's dtype first (an input-sized temporary); ``mul_(scale)`` is in place."""
    x, train = args[0], (args[2] if len(args) > 2 else kwargs.get("train"))
    if train is False:
        return []
    return [Scratch(_dense(x), "the bool mask cast to the input's dtype (Dropout.cpp native_dropout_cpu)")]


@register_scratch(aten.native_dropout_backward.default, source="aten/src/ATen/native/Dropout.cpp native_dropout_backward")
def _native_dropout_backward(args: tuple, kwargs: dict, out: object) -> list[Scratch]:
    """Dropout.cpp ``native_dropout_backward``: ``grad * mask * scale``: the mask cast to the
    gradient's dtype, the product ``grad * mask`` (both gradient-sized), then ``scale`` as a
    wrapped double and its cast to the gradient's dtype; the cast dies before the scale is made."""
    grad = args[0]
    return [Scratch(_dense(grad) + _WRAPPED + grad.element_size(),
                    "grad * mask and the scale's wrapped number (Dropout.cpp native_dropout_backward)")]
