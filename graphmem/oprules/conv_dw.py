"""oneDNN's depthwise convolution backward in the plain (NCHW) layout on the CPU: EfficientNet's
and MobileNet's depthwise convolutions when the model is not channels-last, and 1-d depthwise
convolutions (a Conformer's, Mamba's), which PyTorch views as 2-d (Convolution.cpp
``view1d_as_2d``).
graphmem/oprules/conv.py registers the rule; this module computes it.

PyTorch's side, aten/src/ATen/native/mkldnn/Conv.cpp ``mkldnn_convolution_backward`` (not
channels-last): ideep reorders what the primitive wants in another layout, allocates the
gradient in the primitive's layout, runs it, then copies that gradient into the dense output.
oneDNN's side (fp32; ``ch_block`` 16 with AVX-512, 8 with AVX2, ``init_conf``'s ``isa == avx512_core ?
16 : 8``: ``nChw16c``/``Goihw16g`` below are ``nChw8c``/``Goihw8g`` on an AVX2 CPU, the same bookings):

- input gradient: ``jit_uni_dw_convolution_bwd_data`` (src/cpu/x64/jit_uni_dw_conv_kernel_utils.cpp
  ``init_conf``: one channel per group, no dilation; the plain layout's channels padded to 16,
  ``nChw16c``; no scratchpad): the output gradient and the input gradient in ``nChw16c``, the
  weight in ``Goihw16g``;
- weight gradient, where the depthwise kernel takes the shape (``dw_backward_weights_applies``,
  graphmem/oprules/conv.py): the output gradient and the input in ``nChw16c``, the
  weight gradient in ``Goihw16g``, the bias gradient, and (``init_scratchpad``, harness
  ``mb_reduction``: ``nthr_g = min(nb_ch, nthreads)``, ``nthr_mb = min(max(1, nthreads / nthr_g),
  mb)``) per-thread reduction buffers of the weight and bias gradients when ``nthr_mb > 1``;
- else the gemm convolution (graphmem/oprules/conv_gemm.py) in the plain layout.

Checked against the allocator on random 2-d and 1-d shapes (tests/oprules/test_workspace_conv_dw.py).
"""
from __future__ import annotations

import graphmem.oprules.conv_gemm as gemm

ALIGN = gemm.ALIGN


def _padded(c: int) -> int:
    """Channels padded to ``ch_block`` (``init_conf``: ``rnd_up(ngroups, ch_block)``; 16 or 8, gemm.simd_w)."""
    return -(-c // gemm.simd_w()) * gemm.simd_w()


def _dw_reduction(c: gemm.Conv, bias: bool, threads: int) -> int:
    """``jit_uni_dw_conv_bwd_weights_kernel::init_scratchpad`` (harness ``mb_reduction``; ``balance``:
    ``nthr_g = min(nb_ch, nthreads)`` with ``nb_ch = ngroups / ch_block``)."""
    nthr_g = min(_padded(c.groups) // gemm.simd_w(), threads)
    nthr_mb = min(max(1, threads // nthr_g), c.n)
    if nthr_mb == 1:
        return 0
    wei = _padded(c.groups) * c.kh * c.kw * (nthr_mb - 1) * 4 + ALIGN
    return wei + (_padded(c.groups) * (nthr_mb - 1) * 4 + ALIGN if bias else 0)  # ngroups padded to ch_block


def depthwise_backward_scratch(c: gemm.Conv, mask: tuple[bool, bool, bool], dw_weights: bool, threads: int) -> int:
    """Bytes beside the outputs at the op's high point (module docstring): the input gradient's
    phase, then the weight gradient's beside the dense input gradient."""
    e, c16 = 4, _padded(c.groups)
    xb, gob = c.n * c16 * c.ih * c.iw * e, c.n * c16 * c.oh * c.ow * e
    wb, x, w = c16 * c.kh * c.kw * e, c.src_bytes, c.weight_bytes
    bias = c.groups * e if mask[2] else 0
    live = x if mask[0] else 0
    high = max(gob + wb + xb, xb + x) if mask[0] else 0
    if mask[1] and dw_weights:
        blocked = gob + xb + wb + bias + _dw_reduction(c, mask[2], threads)
        high = max(high, live + max(blocked, wb + 2 * bias + w))
    elif mask[1]:
        high = max(high, live + w + bias + max(gemm.gemm_bwd_weights_scratchpad(c, threads), w + bias))
    return max(0, high - (live + (w + bias if mask[1] else 0)))
