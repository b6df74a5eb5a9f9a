"""LayerNorm on the CPU: the backward's reduction buffer and the dense copies of strided operands
(aten/src/ATen/native/cpu/layer_norm_kernel.cpp, aten/src/ATen/native/layer_norm.cpp).
"""
from __future__ import annotations

import math

import torch

from graphmem.oprules.registry import Scratch, aten_op, register_scratch


@register_scratch(aten_op("native_layer_norm_backward"), source="aten/src/ATen/native/cpu/layer_norm_kernel.cpp "
                  "LayerNormBackwardKernelImplInternal; aten/src/ATen/native/layer_norm.cpp layer_norm_backward_cpu")
def _layer_norm_backward(args: tuple, kwargs: dict, out: object) -> list[Scratch]:
    """aten/src/ATen/native/cpu/layer_norm_kernel.cpp ``LayerNormBackwardKernelImplInternal``:
    when dgamma or dbeta is wanted, a zeroed {2, num_threads, N} buffer for the two-pass
    reduction; ``LayerNormBackwardKernelImpl`` first makes ``dY.contiguous()``, and
    aten/src/ATen/native/layer_norm.cpp ``layer_norm_backward_cpu`` the input's."""
    names = ("grad_out", "input", "normalized_shape", "mean", "rstd", "weight", "bias", "output_mask")
    bound = dict(zip(names, args), **kwargs)
    dy, x, mask = bound["grad_out"], bound["input"], bound["output_mask"]
    n = math.prod(bound["normalized_shape"])
    found = []
    if mask[1] or mask[2]:
        found.append(Scratch(2 * torch.get_num_threads() * n * x.dtype.itemsize, "layer norm backward buffer (layer_norm_kernel.cpp)"))
    if not dy.is_contiguous():
        found.append(Scratch(dy.numel() * dy.dtype.itemsize, "dY.contiguous()"))
    if not x.is_contiguous():  # aten/src/ATen/native/layer_norm.cpp layer_norm_backward_cpu: expect_contiguous
        found.append(Scratch(x.numel() * x.dtype.itemsize, "input.expect_contiguous()"))
    return found


@register_scratch(aten_op("native_layer_norm"), source="aten/src/ATen/native/layer_norm.cpp layer_norm_cpu")
def _layer_norm(args: tuple, kwargs: dict, out: object) -> list[Scratch]:
    """aten/src/ATen/native/layer_norm.cpp ``layer_norm_cpu``: ``input.expect_contiguous()``, a
    dense copy of a strided input for the kernel, gone when the op returns."""
    x = args[0]
    return [] if x.is_contiguous() else [Scratch(x.numel() * x.dtype.itemsize, "input.expect_contiguous()")]

