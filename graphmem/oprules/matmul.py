"""Matrix multiplies on the CPU: ``aten._grouped_mm``'s fake-kernel fix (MoE experts, whose meta
kernel refuses fp32) and the operand copies BLAS makes of ``mm``/``addmm`` operands it cannot read
in place (aten/src/ATen/native/LinearAlgebra.cpp, aten/src/ATen/native/GroupedMMUtils.h).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from graphmem.oprules.registry import Run, Scratch, aten_op, register_kernel, register_scratch

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode


@register_kernel(aten_op("_grouped_mm"), source="aten/src/ATen/native/GroupedMMUtils.h "
                 "_grouped_mm_validate_inputs, create_grouped_gemm_output_tensor")
def _grouped_mm(run: Run, args: tuple, kwargs: dict, mode: FakeTensorMode) -> torch.Tensor:
    """The CPU (and CUDA) kernel's own checks and output, where torch/_meta_registrations.py's
    ``meta_grouped_mm`` refuses fp32 (it copies the CUDA fast path's bf16 checks). After
    aten/src/ATen/native/GroupedMMUtils.h: ``_grouped_mm_validate_inputs`` (fp32, bf16 or fp16;
    2-d or 3-d; int32 offsets), ``_resolve_grouped_mm_out_dtype`` and
    ``create_grouped_gemm_output_tensor`` (the last dim's stride padded to 16 bytes, off ROCm);
    the CPU kernel then loops ``at::mm_out`` over the groups into that output (no other
    allocation: ``offs.cpu()`` of a CPU tensor is itself)."""
    names = ("mat_a", "mat_b", "offs", "bias", "out_dtype")
    bound = dict(zip(names, args), **kwargs)
    a, b = bound["mat_a"], bound["mat_b"]
    offs, bias, out_dtype = bound.get("offs"), bound.get("bias"), bound.get("out_dtype")
    floats = (torch.float32, torch.bfloat16, torch.float16)

    def check(ok: bool, msg: str) -> None:
        if not ok:
            raise RuntimeError(msg)

    check(a.dtype in floats, f"Expected mat_a to be Float32, BFloat16 or Float16 matrix, got {a.dtype}")
    check(b.dtype in floats, f"Expected mat_b to be Float32, BFloat16 or Float16 matrix, got {b.dtype}")
    check(a.dim() in (2, 3) and b.dim() in (2, 3), "mat_a and mat_b have to be 2 or 3d")
    for m in (a, b):  # check_valid_strides_and_return_transposed: one unit stride, the other 16-byte aligned
        st, sz, align = m.stride(), m.shape, 16 // m.element_size()
        if st[-2] == 1 and st[-1] >= max(1, sz[-2]):
            check(st[-1] % align == 0, "strides should be multiple of 16 bytes")
        elif st[-1] == 1 and st[-2] >= max(1, sz[-1]):
            check(st[-2] % align == 0, "strides should be multiple of 16 bytes")
        else:
            check(False, f"Invalid strides/sizes, got {st} for strides and {tuple(sz)} for sizes")
    a2, b2 = a.dim() == 2, b.dim() == 2
    if not (a2 and b2):
        check(a.size(-1) == b.size(-2), "contraction dimension of mat_a and mat_b must match")
    check((offs is not None) == (a2 or b2), "Have to provide offsets if there is a 2d matrix, or no offset if both matrices are 3d")
    if offs is not None:
        check(offs.dim() == 1 and offs.dtype == torch.int32, "Offsets have to be a 1-d int32 tensor")
    check(bias is None, "Bias not supported yet")
    dtype = out_dtype or a.dtype
    check(dtype == a.dtype, "Grouped gemm output dtype must match `mat_a` dtype")
    if a2:
        assert offs is not None  # checked above: 2-d operands come with offsets
        size = [offs.size(0), a.size(0), b.size(1)] if b2 else [a.size(0), b.size(-1)]
        if not b2:
            check(offs.size(0) == b.size(0), "matrix batch sizes have to match")
    else:
        size = [a.size(1), b.size(1)] if b2 else [a.size(0), a.size(1), b.size(-1)]
    align = 16 // dtype.itemsize
    padded = size[:-1] + [-(-size[-1] // align) * align]
    stride = [math.prod(padded[i + 1:]) for i in range(len(padded))]
    with mode:
        return torch.empty_strided(size, stride, dtype=dtype, device=a.device)



def _blas_copies(m1: torch.Tensor, m2: torch.Tensor, result: torch.Tensor) -> int:
    """aten/src/ATen/native/LinearAlgebra.cpp ``addmm_impl_cpu_``: BLAS reads each operand as a
    column- or row-major matrix with a leading dimension at least its rows; an operand that is
    neither (an expanded gradient, stride 0, as ``sum()``'s) is first cloned contiguous. The
    result (made contiguous by the op) decides which operand plays BLAS's ``a``."""
    rs, rz = result.stride(), result.shape
    transpose_c = not (rs[0] == 1 and (rz[1] == 1 or rs[1] >= max(1, rz[0]))) and \
        rs[1] == 1 and (rz[0] == 1 or rs[0] >= max(1, rz[1]))
    if transpose_c:
        m1, m2 = m2, m1
    m, n = (rz[1], rz[0]) if transpose_c else (rz[0], rz[1])
    k = m1.shape[0 if transpose_c else 1]
    i, j = (1, 0) if transpose_c else (0, 1)
    copies = 0
    for t, lead, other in ((m1, m, k), (m2, k, n)):
        st = t.stride()
        if not ((st[i] == 1 and st[j] >= max(1, lead)) or (st[j] == 1 and st[i] >= max(1, other))):
            copies += t.numel() * t.element_size()
    return copies


@register_scratch(aten_op("mm"), aten_op("addmm"), source="aten/src/ATen/native/LinearAlgebra.cpp addmm_impl_cpu_")
def _mm(args: tuple, kwargs: dict, out: object) -> list[Scratch]:
    m1, m2 = (args[0], args[1]) if len(args) < 3 or not isinstance(args[2], torch.Tensor) else (args[1], args[2])
    if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.numel() == 0 or m1.shape[1] == 0 \
            or out.dtype not in (torch.float32, torch.float64):  # bf16/fp16 may take oneDNN's matmul instead
        return []
    return [Scratch(_blas_copies(m1, m2, out), "operand copies for BLAS (LinearAlgebra.cpp addmm_impl_cpu_)")]

