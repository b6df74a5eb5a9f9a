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
gradients into the dense outputs. Checked on random shapes (tests/oprules/test_workspace_conv_jit.py).

Known limitations: with a bias gradient and ``nthr_mb > 1`` the v3.12 kernel books 12,352 B more
than the (March 2025) source read here explains (measured, one output-channel block); the rule
declines that case and the report's note stays.
"""
from __future__ import annotations

from typing import Optional

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


# -- AVX2 (jit_avx2_conv_kernel_f32.cpp, jit_avx2_convolution.hpp): 8-wide blocks, cpu_reducer buffers --------------
def reduce_balance(nthr: int, job_size: int, njobs: int, reduction: int,
                   max_buffer: int = 1 << 21) -> tuple[int, int, int]:
    """src/cpu/x64/cpu_reducer.cpp ``reduce_balancer_t::balance`` (``max_buffer_size`` 1 << 21, as
    jit_avx2_convolution.hpp ``init_balancers`` passes, or the 1x1 kernel's; threads allowed in a
    group): (ngroups, nthr_per_group, njobs_per_group_ub)."""
    min_per_group = max(1, njobs // nthr)
    max_per_group = max(1, max_buffer // (nthr * job_size))
    ngroups = min(njobs // min_per_group, nthr)
    best = (ngroups, min(nthr // ngroups, reduction), _div_up(njobs, ngroups))
    best_cost = njobs * job_size * reduction
    for per_group in range(min_per_group, njobs):
        groups = min(njobs // per_group, nthr)
        in_group, ub = min(nthr // groups, reduction), _div_up(njobs, groups)
        if in_group > 1 and ub > max_per_group:
            continue
        cost = job_size * ub * (_div_up(reduction, in_group) + (in_group != 1))
        if cost < best_cost:
            best, best_cost = (groups, in_group, ub), cost
    return best


def reducer_space(nthr: int, job_size: int, njobs: int, reduction: int, max_buffer: int = 1 << 21) -> int:
    """``cpu_reducer_t::conf_t::init_scratchpad``: nothing with one thread per group; else
    ``ngroups·(nthr_per_group - 1)·njobs_per_group_ub·job_size`` floats (4 KiB aligned) and one
    barrier context per group (``simple_barrier::ctx_t``, 4 KiB each and aligned)."""
    groups, in_group, ub = reduce_balance(nthr, job_size, njobs, reduction, max_buffer)
    if in_group == 1:
        return 0
    return groups * (in_group - 1) * ub * job_size * 4 + BARRIER + groups * BARRIER + BARRIER


def avx2_weights_scratchpad(c: gemm.Conv, ic_block: int, bias: bool, threads: int) -> int:
    """The scratchpad of ``jit_avx2_convolution_bwd_weights_t`` (one group's blocks, ``oc_block`` 8,
    groups as jobs): ``init_scratchpad``'s padded bias (output channels not a multiple of 8), the
    bias reducer (jobs of 8 over the batch) and the weight reducer (jobs of kh·kw·ic_block·8)."""
    oc8, nb_ic = _div_up(c.oc, 8) * 8, _div_up(c.ic, ic_block)
    pad = c.groups * oc8 * 4 + gemm.ALIGN if bias and c.oc % 8 else 0
    bias_red = reducer_space(threads, 8, c.groups * oc8 // 8, c.n) if bias else 0
    return pad + bias_red + reducer_space(threads, c.kh * c.kw * ic_block * 8, c.groups * nb_ic * oc8 // 8, c.n)


def _blocking(nb: int, limit: int) -> int:
    """jit_avx2_1x1_conv_kernel_f32.cpp ``init_conf`` (backward_weights): a block count halved or
    divided by 3 while above ``limit`` (32 output-channel blocks, 9 input-channel blocks)."""
    while nb > limit and nb % 2 == 0 or nb > limit and nb % 3 == 0:
        nb = nb // 2 if nb % 2 == 0 else nb // 3
    return nb


def avx2_1x1_weights_scratchpad(c: gemm.Conv, bias: bool, threads: int, nxc: bool = False) -> int:
    """The scratchpad of ``jit_avx2_1x1_convolution_bwd_weights_t`` (jit_avx2_1x1_convolution.hpp
    ``init_balancers``; plain layout, channels padded to 8): the padded bias (output channels not a
    multiple of 8, ``init_scratchpad``), the bias reducer (``cpu_reducer_t``: jobs of 8 over the
    batch) and the weight reducer (``cpu_reducer_2d_t``: jobs of ``nb_load_blocking·nb_bcast_blocking``
    8x8 blocks reduced over batch x spatial; ``ngroups·nthr_per_group·njobs_per_group_ub·job_size``
    floats, 128-byte aligned, and the barriers), both with ``max_buffer_size = nthr·job_size·8``.
    Channels-last (``nxc``): the channels unpadded, the blockings cut only without a channel tail
    (and for the input channels, a map of at most 1024), to 17 input-channel blocks."""
    nb_oc, nb_ic = _div_up(c.oc, 8), _div_up(c.ic, 8)
    load = _blocking(nb_oc, 32) if not nxc or c.oc % 8 == 0 else nb_oc
    bcast = _blocking(nb_ic, 17 if nxc else 9) if not nxc or (c.ic % 8 == 0 and c.ih * c.iw <= 1024) else nb_ic
    job = load * bcast * 64
    njobs = _div_up(nb_ic, bcast) * _div_up(nb_oc, load)
    pad = nb_oc * 8 * 4 + gemm.ALIGN if bias and c.oc % 8 else 0
    bias_red = reducer_space(threads, 8, nb_oc, c.n, threads * job * 8) if bias else 0
    groups, in_group, ub = reduce_balance(threads, job, njobs, c.n * c.oh * c.ow, threads * job * 8)
    wei_red = groups * in_group * ub * job * 4 + gemm.ALIGN + groups * BARRIER + BARRIER if in_group > 1 else 0
    return pad + bias_red + wei_red


def avx2_1x1_applies(c: gemm.Conv, pads: tuple[int, int]) -> bool:
    """jit_avx2_1x1_conv_kernel_f32.cpp ``init_conf``: one group, a 1x1 kernel, unit strides, no
    padding (a strided one goes through ``rtus``, the reduce-to-unit-stride copy: not modelled)."""
    return c.groups == 1 and (c.kh, c.kw) == (1, 1) and c.sh == c.sw == 1 and pads == (0, 0)


def avx2_first_conv_applies(c: gemm.Conv) -> bool:
    """jit_avx2_conv_kernel_f32.cpp ``jit_avx2_conv_bwd_weights_kernel_f32::init_conf`` for an
    unpadded convolution: ``kw < 14``, ``kh <= ih`` (channels padded to 8, one group)."""
    return c.kw < 14 and c.kh <= c.ih


def avx2_first_conv_weight_grad_scratch(c: gemm.Conv, bias: bool, threads: int) -> int:
    """Bytes beside the outputs (AVX2): the output gradient reordered to ``nChw8c``, the source to
    ``nChw8c`` with its channels padded to 8 unless it has 3 (``flat``: the plain source stays),
    the weight gradient in ``Ohwi8o`` (3 channels) or ``OIhw8i8o``, the bias gradient and the
    scratchpad (``avx2_weights_scratchpad``); then the dense copies."""
    return avx2_backward_scratch(c, (False, True, bias), threads)


def avx2_backward_scratch(c: gemm.Conv, mask: tuple[bool, bool, bool], threads: int,
                          data_high: Optional[int] = None) -> int:
    """Bytes beside the outputs of a one-group convolution's backward on oneDNN's AVX2 jit kernels
    (mkldnn/Conv.cpp ``mkldnn_convolution_backward``: the input gradient first, then the weight's):
    the input gradient with the output gradient in ``nChw8c``, the weight in ``ABcd8a8b`` and the
    gradient in ``nChw8c`` (channels padded to 8: ``jit_avx2_conv_bwd_data_kernel_f32::init_conf``
    ``ok_to_pad_channels``), then its dense copy; then the weight gradient beside it, as
    ``avx2_first_conv_weight_grad_scratch`` says (measured to the byte). ``data_high``: the input
    gradient's high point where another kernel computes it (conv_brgemm.py, a strided one)."""
    oc8, ic8, flat = _div_up(c.oc, 8) * 8, _div_up(c.ic, 8) * 8, c.ic == 3 and (c.kh, c.kw) != (1, 1)
    grad_b, blocked_x, x = c.n * oc8 * c.oh * c.ow * 4, c.n * ic8 * c.ih * c.iw * 4, c.src_bytes if mask[0] else 0
    high = max(grad_b + oc8 * ic8 * c.kh * c.kw * 4 + blocked_x, blocked_x + x) if mask[0] else 0
    if mask[0] and data_high is not None:
        high = data_high
    ic_b = c.ic if flat else ic8
    src_b = 0 if flat else c.n * ic_b * c.ih * c.iw * 4
    wb, w, b = oc8 * ic_b * c.kh * c.kw * 4, c.weight_bytes, (c.oc * 4 if mask[2] else 0)
    pad = avx2_weights_scratchpad(c, 3 if flat else 8, mask[2], threads)
    if avx2_1x1_applies(c, (0, 0)):  # jit_avx2_1x1 (``jit_1x1:avx2``): the same reorders, its own reducers
        pad = avx2_1x1_weights_scratchpad(c, mask[2], threads)
    high = max(high, x + max(grad_b + src_b + wb + b + pad, wb + 2 * b + w))
    return high - (x + w + b)


def avx2_jit_applies(c: gemm.Conv, pads: tuple[int, int], input_grad: bool) -> bool:
    """Where oneDNN's AVX2 jit kernels compute a one-group, plain-layout, undilated fp32 backward
    (src/cpu/cpu_convolution_list.cpp: after the inner-product form and the 1x1 kernel):
    jit_avx2_conv_kernel_f32.cpp ``jit_avx2_conv_bwd_weights_kernel_f32::init_conf`` (``kw < 14``,
    ``kh <= ih``, every padding below the kernel); the input gradient only at unit stride (a strided
    one measured other bytes: left to the note)."""
    b_pad = (c.oh - 1) * c.sh + c.kh - c.ih - pads[0]
    r_pad = (c.ow - 1) * c.sw + c.kw - c.iw - pads[1]
    inner_product = c.sh == c.sw == 1 and pads == (0, 0) and (c.kh, c.kw) == (c.ih, c.iw)
    return (c.groups == 1 and (c.kh, c.kw) != (1, 1) and not inner_product and c.kw < 14 and c.kh <= c.ih
            and max(pads[0], b_pad) < c.kh and max(pads[1], r_pad) < c.kw
            and (not input_grad or c.sh == c.sw == 1))
