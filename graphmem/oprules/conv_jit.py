"""oneDNN's jit weight gradient of a first convolution (fewer than 16 input channels, the plain
layout) on the CPU: patch embeddings whose kernel is 14 wide or less (ViT at patch 8 or 14).
graphmem/oprules/conv.py registers the rule; this module computes it.

Which kernel runs (fp32, AVX-512): ``jit_avx512_common_convolution_bwd_weights`` (src/cpu/x64/
jit_avx512_common_conv_kernel.cpp ``init_conf``): ``is_1stconv`` (``ic < 16``, one group) keeps the
source in the plain layout; the output gradient in ``nChw16c`` and the weight gradient in
``Ohwi16o``, both with the output channels padded to 16. Its scratchpad (``init_scratchpad``):
when ``balance`` splits the batch over ``nthr_mb > 1`` threads, ``(nthr_mb - 1)`` copies of the
padded weight and bias gradients (fp32) and a barrier context (``simple_barrier::ctx_t``, 4096-byte
aligned); a padded bias when the output channels are not a multiple of 16. Each booking adds its
alignment (src/common/memory_tracking.hpp).

PyTorch's side (aten/src/ATen/native/mkldnn/Conv.cpp ``mkldnn_convolution_backward_weights``):
ideep reorders the output gradient, allocates the blocked weight gradient, the bias gradient and
the scratchpad, runs the primitive, frees the reorder and the scratchpad, then copies both
gradients into the dense outputs. Checked on random shapes (tests/test_workspace_conv_jit.py).

Known limitations: with a bias gradient and ``nthr_mb > 1`` the v3.12 kernel books 12,352 B more
than the (March 2025) source read here explains (measured, one output-channel block); the rule
declines that case and the report's note stays.
"""
from __future__ import annotations

import graphmem.oprules.conv_gemm as gemm

MIN_OH_REDUCE = 9  # jit_avx512_common_conv_bwd_weights_kernel_f32::min_oh_reduce
BARRIER = 4096  # sizeof(simple_barrier::ctx_t), aligned to 4096 off Windows (src/cpu/x64/cpu_barrier.hpp)


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def balance(c: gemm.Conv, nthreads: int) -> int:
    """``nthr_mb`` of ``jit_avx512_common_conv_bwd_weights_kernel_f32::balance`` for one group:
    the split with the least memory cost, then one with less compute within 110 % of it."""
    two_d = c.oh > MIN_OH_REDUCE  # harness_2d_reduction
    ih_r, oh_r = (c.ih, c.oh) if two_d else (1, 1)
    ih_n, oh_n = (1, 1) if two_d else (c.ih, c.oh)
    nb_oc, nb_ic, ic_block = _div_up(c.oc, 16), 1, c.ic
    nthr_oh_reduce = max(1, oh_r // MIN_OH_REDUCE)

    def mem(mb: int, ocb: int, icb: int) -> int:
        return (_div_up(c.n * ih_r, mb) * _div_up(nb_ic, icb) * ic_block * ih_n * c.iw // c.sh // c.sw
                + _div_up(c.n * oh_r, mb) * _div_up(nb_oc, ocb) * 16 * oh_n * c.ow
                + 8 * _div_up(nb_oc, ocb) * _div_up(nb_ic, icb) * c.kh * c.kw * ic_block * 16)

    def comp(mb: int, ocb: int, icb: int) -> int:
        return _div_up(c.n * oh_r, mb) * _div_up(nb_oc, ocb) * _div_up(nb_ic, icb)

    best, best_mem = (1, 1, 1), mem(1, 1, 1)
    splits = [(mb, ocb, min(nthreads // mb // ocb, nb_ic)) for mb in range(1, min(nthreads, c.n * nthr_oh_reduce) + 1)
              for ocb in range(1, min(nthreads // mb, nb_oc) + 1)]
    for s in splits:
        if mem(*s) <= best_mem:
            best, best_mem = s, mem(*s)
    best_comp = comp(*best)
    for s in splits:
        if (comp(*s) <= best_comp and 10 * mem(*s) < 11 * best_mem) or 4 * comp(*s) <= 3 * best_comp:
            best, best_comp = s, comp(*s)
    nthr_mb = best[0]
    if nthreads // 2 < nthr_mb < nthreads:
        nthr_mb = min(c.n * nthr_oh_reduce, nthreads)
    return nthr_mb


def first_conv_weight_grad_scratch(c: gemm.Conv, bias: bool, threads: int) -> int:
    """Bytes beside the outputs at the op's high point (module docstring)."""
    oc16 = _div_up(c.oc, 16) * 16
    grad_b = c.n * oc16 * c.oh * c.ow * 4
    wb, w = oc16 * c.ic * c.kh * c.kw * 4, c.weight_bytes
    b = c.oc * 4 if bias else 0
    nthr_mb = balance(c, threads)
    pad = 0
    if nthr_mb > 1:
        pad += (oc16 * c.ic * c.kh * c.kw + oc16) * (nthr_mb - 1) * 4 + gemm.ALIGN + 2 * BARRIER
    if bias and c.oc % 16:
        pad += oc16 * 4 + gemm.ALIGN
    high = max(grad_b + wb + b + pad, wb + 2 * b + w)
    return high - (w + b)
