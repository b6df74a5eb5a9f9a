"""oneDNN's gemm-based convolution weight gradient on the CPU (``gemm:jit`` in oneDNN's verbose
output): the path of patch embeddings whose kernel is wider than 14 (ViT, DeiT, CLIP, SigLIP at
patch 16 or 32). graphmem/capture/workspace_conv.py registers the rule; this module computes it.

Which kernel runs (oneDNN v3.12, AVX-512, fp32, plain ``nchw`` layout):
src/cpu/cpu_convolution_list.cpp tries, for ``backward_weights``, the inner-product convolution
(unit stride only), the depthwise and 1x1 kernels, ``jit_avx512_common_convolution_bwd_weights``
(src/cpu/x64/jit_avx512_common_conv_kernel.cpp ``init_conf``: ``if (!jcp.is_hw_transp &&
jcp.kw > 14) return unimplemented``; ``is_hw_transp`` needs unit strides), the AVX2 kernel
(jit_avx2_conv_kernel_f32.cpp: ``kw < 14``), then ``gemm_convolution_bwd_weights_t``. So a
kernel wider than 14 with a stride above 1 reaches the gemm convolution (checked with
``torch.backends.mkldnn.verbose`` and against the allocator on random shapes,
tests/test_workspace_conv_gemm.py).

Its scratchpad, src/cpu/gemm_convolution_utils.cpp ``init_conf`` (``!jcp.is_nspc && is_bwd_w``):

- ``key_conv_wei_reduction``: ``book<float>(nthr * weights_d.size())``; ``size()`` is already in
  bytes, so it books 4x the weight's bytes per thread;
- ``key_conv_gemm_col`` (im2col): ``nthr * ic * ks * os`` floats (none for a 1x1 unit-stride
  convolution), its spatial block cut (``os_block = max(simd_w, 0.05 * max_os_block)``) when it
  would not fit under ``scratchpad_limit = min(1 GiB, 15 * max_threads * (src + wei + dst))``;
- ``nthr`` = ``max_threads`` under outer threading (``thr_mem_estimate < scratchpad_limit &&
  os / max_threads < 256 && (mb != 1 || ngroups > 2)``), else 1;
- src/common/memory_tracking.hpp ``registrar_t::book``: each booking's capacity is its size plus
  its 128-byte alignment.

PyTorch's side, aten/src/ATen/native/mkldnn/Conv.cpp ``mkldnn_convolution_backward_weights``:
ideep allocates the weight (and bias) gradient in the primitive's plain layout and the
scratchpad (user mode, through c10's CPU allocator: aten/src/ATen/native/mkldnn/
IDeepRegistration.cpp), frees the scratchpad after the primitive, then copies both gradients
into the dense outputs. ``grad_output.contiguous()`` before all that is a copy when the
gradient arrives strided (a patch embedding's ``flatten(2).transpose(1, 2)``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ALIGN = 128  # memory_tracking.hpp default_alignment
SIMD_W = 16  # fp32 lanes of a 64-byte vector register (AVX-512)


@dataclass(frozen=True)
class Conv:
    """One convolution as oneDNN sees it after PyTorch views a 1-d one as 2-d (aten/src/ATen/
    native/Convolution.cpp ``view1d_as_2d``): per-group channels, spatial sizes (h, w)."""

    n: int
    groups: int
    ic: int  # per group
    oc: int  # per group
    ih: int
    iw: int
    oh: int
    ow: int
    kh: int
    kw: int
    sh: int
    sw: int

    @property
    def weight_bytes(self) -> int:
        return self.groups * self.oc * self.ic * self.kh * self.kw * 4

    @property
    def src_bytes(self) -> int:
        return self.n * self.groups * self.ic * self.ih * self.iw * 4

    @property
    def dst_bytes(self) -> int:
        return self.n * self.groups * self.oc * self.oh * self.ow * 4


def gemm_applies(c: Conv, pads: tuple[int, int], dilated: bool, channels_last: bool) -> bool:
    """Where oneDNN's fp32 weight gradient falls through to the gemm convolution (module
    docstring): plain layout, no dilation, one group, a kernel wider than 14 and a stride above
    1 (so neither the inner-product form nor ``is_hw_transp`` applies). Narrower kernels keep
    the report's note."""
    return (not channels_last and not dilated and c.groups == 1 and c.kw > 14 and c.sw > 1
            and pads == (0, 0))


def gemm_bwd_weights_scratchpad(c: Conv, max_threads: int) -> int:
    """Bytes of the scratchpad ``gemm_convolution_bwd_weights_t`` asks for (module docstring)."""
    w = c.weight_bytes
    ks, os_ = c.kh * c.kw, c.oh * c.ow
    limit = min(1 << 30, 15 * max_threads * (c.src_bytes + w + c.dst_bytes))
    estimate = 4 * max_threads * w + 4 * max_threads * c.ic * ks * SIMD_W
    outer = estimate < limit and os_ // max_threads < 256 and (c.n != 1 or c.groups > 2)
    nthr = max_threads if outer else 1
    im2col = 0 if (c.ow == c.iw and c.oh == c.ih and c.sh == c.sw == 1 and ks == 1) else c.ic * ks * os_
    reduction = 4 * nthr * w
    size = reduction + ALIGN
    col = nthr * im2col
    if limit - size < col * 4:  # the spatial block is cut to what fits
        max_os_block = (limit - size) // (4 * nthr * (im2col // os_))
        col = nthr * c.ic * ks * max(SIMD_W, int(max_os_block * 0.05))
    return size + (col * 4 + ALIGN if col else 0)


def gemm_bwd_weights_scratch(c: Conv, bias_grad: bool, grad_copy: bool, max_threads: int) -> int:
    """Bytes beside the op's outputs at its high point: the scratchpad beside ideep's weight and
    bias gradients, or those beside their dense copies, whichever is more; plus the dense copy
    of a strided output gradient, live through the op."""
    bias = c.groups * c.oc * 4 if bias_grad else 0
    copy = math.prod((c.n, c.groups, c.oc, c.oh, c.ow, 4)) if grad_copy else 0
    return max(gemm_bwd_weights_scratchpad(c, max_threads), c.weight_bytes + bias) + copy


def threads() -> int:
    """oneDNN's ``dnnl_get_max_threads()``: OpenMP's, which PyTorch sets to its own count."""
    return torch.get_num_threads()


def as_conv(b: dict, grad: torch.Tensor) -> Conv:
    """The convolution of ``convolution_backward``'s bound arguments, a 1-d one viewed as 2-d."""
    x, w = b["input"], b["weight"]
    g = b["groups"]
    one_d = x.dim() == 3
    ih, iw = (1, x.size(2)) if one_d else (x.size(2), x.size(3))
    oh, ow = (1, grad.size(2)) if one_d else (grad.size(2), grad.size(3))
    kh, kw = (1, w.size(2)) if one_d else (w.size(2), w.size(3))
    sh, sw = (1, b["stride"][0]) if one_d else (b["stride"][0], b["stride"][1])
    return Conv(x.size(0), g, x.size(1) // g, w.size(0) // g, ih, iw, oh, ow, kh, kw, sh, sw)


def uses_onednn(c: Conv, x: torch.Tensor, pads: tuple[int, int], dilated: bool) -> bool:
    """aten/src/ATen/native/Convolution.cpp ``ConvParams::use_mkldnn`` for an fp32 CPU tensor
    (after the 1-d view): strided, dilated, a batch of 16 or more, a kernel other than 1x1 or more
    than one thread; and more than one group, a kernel above 3x3 both ways, a batch above 1 or an
    input above 20,480 elements."""
    return (bool(torch.backends.mkldnn.enabled) and x.dtype == torch.float32
            and (c.sh > 1 or c.sw > 1 or dilated or c.n >= 16 or (c.kh, c.kw) != (1, 1) or threads() > 1)
            and (c.groups > 1 or (c.kh > 3 and c.kw > 3) or c.n > 1 or c.n * c.groups * c.ic * c.ih * c.iw > 20480))
