"""torch.optim's fused kernels that have no fake (meta) kernel: ``aten._fused_sgd_`` (SGD and SGD
with momentum, ``fused=True``). Without a rule, FakeTensorMode runs its fallback
(torch/_subclasses/fake_tensor.py ``run_fallback_kernel``): the real CPU kernel over zero-filled
real copies of every parameter, gradient and momentum buffer, three times the model's size in the
analyzing process's memory (19 GB for GPT-2 XL), never part of the step's own memory.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from graphmem.oprules.registry import Run, aten_op, register_kernel

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode


@register_kernel(aten_op("_fused_sgd_"), aten_op("_fused_sgd_", "tensor_lr"),
                 source="aten/src/ATen/native/FusedSGD.cpp _fused_sgd_kernel_cpu_; "
                        "aten/src/ATen/native/cuda/FusedSgdKernel.cu _fused_sgd_kernel_cuda_")
def _fused_sgd_(run: Run, args: tuple, kwargs: dict, mode: FakeTensorMode) -> None:
    """The update runs in place over the parameters, gradients and momentum buffers (the optimizer
    makes those itself on the first step, torch/optim/sgd.py ``_fused_sgd``) and returns nothing.
    The CPU kernel checks the lists' lengths (``_fused_sgd_kernel_cpu_``'s TORCH_CHECKs, kept here)
    and updates each parameter in place (cpu/FusedSGDKernel.cpp ``fused_sgd_kernel``: its
    ``grad.contiguous()`` is the gradient itself, a gradient being as contiguous as its parameter);
    the CUDA kernel is a multi-tensor apply: no allocation to record."""
    params, grads, buffers = args[0], args[1], args[2]
    if len(grads) != len(params):
        raise RuntimeError("_fused_sgd_: grads and params differ in length")
    if len(buffers) != (0 if kwargs["momentum"] == 0.0 else len(params)):
        raise RuntimeError("_fused_sgd_: momentum_buffer_list must be empty without momentum, else one per param")
    return None
