"""oneDNN's AVX2 brgemm convolution kernels on the CPU where graphmem/oprules/conv.py's AVX2 rules
use them: the strided input gradient (``brgconv_strided:avx2`` in oneDNN's verbose output:
Whisper's stride-2 Conv1d, a ResNet's downsampling 3x3). graphmem/oprules/conv.py registers the
rule; this module computes it.

Which kernel runs (fp32, AVX2): src/cpu/cpu_convolution_list.cpp tries, for ``backward_data``,
the inner-product form, ``brgemm_convolution_bwd_t<avx2>`` (unit strides only: its ``init_conf``
refuses ``everyone_is(1, stride_d, stride_h, stride_w)`` inverted), then
``brgemm_convolution_bwd_strided_t<avx2>`` (src/cpu/x64/jit_brgemm_conv_bwd_strided.cpp). Its
configuration, src/cpu/x64/jit_brgemm_conv_bwd_utils.cpp ``init_jcp`` and ``init_conf``: the output
gradient and the input gradient in ``nwc``/``nhwc``; the weight in ``Bcda<ic_block>b`` (``Iwo..i``
family, ``pick_tags``), its input channels padded to ``ic_block``, which the blocking search
(``est_eff``, cache sizes of the host) picks among 8, 16, 24 and 32; ``nb_oc_blocking = 1``;
``use_buffer`` only for a non-fp32 output or a sum post-op; ``exec_trans`` when ``iw % stride_w``.

Its scratchpad (same file, ``init_scratchpad``; each booking 4096-aligned, ``P4K``, which
src/common/memory_tracking.hpp adds to its capacity):

- ``key_brgemm_primitive_batch``: ``nthr·adjusted_batch_size`` elements of
  ``brgemm_batch_element_t`` (40 bytes, src/cpu/x64/brgemm/brgemm_types.hpp), where
  ``adjusted_batch_size = div_up(rnd_up(gemm_batch_size·40, 4096), 40)`` and ``gemm_batch_size``
  is at most ``kh·kw`` (``kh_block`` is ``kh`` or ``stride_h``);
- ``key_conv_brgemm_inp_buffer``: ``nthr·rnd_up(ohp·owp·oc, 4096)`` fp32, ``ohp``/``owp`` the
  output padded by the overflows ``t_ovf``/``b_ovf``/``l_ovf``/``r_ovf`` (``max(0, k - 1 - pad) / stride``);
- ``key_conv_brgemm_inp_buffer_mask``: ``nthr·rnd_up(nb_ih·nb_iw·nb_oc, 4096)`` bytes;
- ``exec_trans`` only: ``key_conv_brgemm_out_buffer``, ``nthr·rnd_up(iw_block·stride_w·ic, 4096)`` fp32.

``nthr`` is oneDNN's thread count. The rule keeps to the domain where the blocking search cannot
change these bytes (``strided_data_applies``): every candidate ``ic_block`` pads the input channels
alike (ic ≤ 8, 16, or a multiple of 32, where 24 never wins: measured), ``kh·kw ≤ 102`` (one 4 KiB
batch page), and the mask and out buffers within one 4096-element page.

PyTorch's side (aten/src/ATen/native/mkldnn/Conv.cpp ``mkldnn_convolution_backward_input``, plain
layout): ideep reorders the output gradient to ``nhwc`` and the weight, allocates the ``nhwc``
input gradient and the scratchpad, runs the primitive, frees the scratchpad and the reorders, then
copies the gradient into the dense output (measured: two input-sized buffers beside it at once).
Checked against the allocator on random shapes (tests/oprules/test_workspace_conv_brgemm.py).
"""
from __future__ import annotations

import graphmem.oprules.conv_gemm as gemm

P4K = 4096
BATCH_ELEMENT = 40  # sizeof(brgemm_batch_element_t): two pointers, vvpad {top, bottom}, has_s8s8_comp_batch_pad
# init_jcp ``is_regression_shape``: fp32 shapes the strided kernel refuses (ic, oc, ih, iw, oh, ow, k, stride 2)
_REGRESSION = {(512, 1024, 8, 8, 4, 4, 4), (1024, 2048, 4, 4, 2, 2, 4), (64, 128, 513, 513, 256, 256, 3),
               (32, 64, 1025, 1025, 512, 512, 3), (128, 256, 257, 257, 128, 128, 3), (64, 128, 14, 14, 7, 7, 4),
               (1, 64, 28, 28, 14, 14, 4)}


def _rnd_up(a: int, b: int) -> int:
    return -(-a // b) * b


def _ovf(k: int, pad: int, stride: int) -> int:
    """``init_conf``: ``l_ovf = max(0, ext_kw - 1 - l_pad) / stride_w`` (and t, b, r alike)."""
    return max(0, k - 1 - pad) // stride


def _end_pads(c: gemm.Conv, pads: tuple[int, int]) -> tuple[int, int]:
    """``calculate_end_padding``: (dst - 1)·stride + k - src - start, for h and w."""
    return (c.oh - 1) * c.sh + c.kh - c.ih - pads[0], (c.ow - 1) * c.sw + c.kw - c.iw - pads[1]


def _weight_padded_ic(c: gemm.Conv) -> int:
    """The weight's input channels padded to ``ic_block`` (``pick_tags``' ``Bcda<ic_block>b``): the
    same for every block the search may pick where ``strided_data_applies``."""
    return _rnd_up(c.ic, 8)


def strided_data_applies(c: gemm.Conv, pads: tuple[int, int]) -> bool:
    """AVX2, one group, a stride above 1, no dilation, not the inner-product form and not one of
    ``init_jcp``'s refused regression shapes: ``brgconv_strided:avx2`` computes the input gradient;
    and within the domain where its blocking search does not change the bytes (module docstring)."""
    exec_trans = c.iw % c.sw != 0
    regression = c.sh == c.sw == 2 and c.kh == c.kw and (c.ic, c.oc, c.ih, c.iw, c.oh, c.ow, c.kh) in _REGRESSION
    return (not gemm.avx512() and c.groups == 1 and (c.sh > 1 or c.sw > 1) and not regression
            and (c.ic <= 8 or c.ic == 16 or c.ic % 32 == 0) and c.kh * c.kw * BATCH_ELEMENT <= P4K
            and c.ih * c.iw <= P4K and (not exec_trans or _rnd_up(c.iw, c.sw) * c.sw * c.ic <= P4K))


def strided_data_scratchpad(c: gemm.Conv, pads: tuple[int, int], nthr: int) -> int:
    """Bytes of the scratchpad ``brgemm_convolution_bwd_strided_t<avx2>`` books (module docstring)."""
    b_pad, r_pad = _end_pads(c, pads)
    ohp = c.oh + _ovf(c.kh, pads[0], c.sh) + _ovf(c.kh, b_pad, c.sh)
    owp = c.ow + _ovf(c.kw, pads[1], c.sw) + _ovf(c.kw, r_pad, c.sw)
    batch = nthr * _rnd_up(P4K, BATCH_ELEMENT) + P4K  # adjusted_batch_size: one 4 KiB page of elements per thread
    inp = nthr * _rnd_up(ohp * owp * c.oc, P4K) * 4 + P4K
    mask = nthr * P4K + P4K  # nb_ih·nb_iw·nb_oc ≤ ih·iw ≤ 4096 (strided_data_applies)
    out = nthr * P4K * 4 + P4K if c.iw % c.sw else 0  # exec_trans: iw_block·stride_w·ic ≤ 4096 elements
    return batch + inp + mask + out


def strided_data_high(c: gemm.Conv, pads: tuple[int, int], nthr: int) -> int:
    """The high point of the input-gradient phase (bytes live inside the op, the dense input
    gradient included): the ``nhwc`` output gradient, the padded weight, the ``nhwc`` input
    gradient and the scratchpad; then the gradient and two input-sized copies (measured)."""
    go, x = c.n * c.oc * c.oh * c.ow * 4, c.src_bytes
    wei = c.oc * _weight_padded_ic(c) * c.kh * c.kw * 4
    return max(go + wei + x + strided_data_scratchpad(c, pads, nthr), 3 * x)


def cl_1x1_applies(c: gemm.Conv, pads: tuple[int, int]) -> bool:
    """AVX2, channels-last, one group, 1x1, unit strides, no padding: the input gradient on
    ``brg_conv_bwd:avx2+brgconv_1x1:avx2`` (the backward as a forward 1x1 brgemm convolution,
    src/cpu/x64/jit_brgemm_conv_bwd.cpp), the weight gradient on ``jit_1x1:avx2`` in ``nhwc``;
    within the domain where the blocking search cannot change the bytes (as ``strided_data_applies``:
    the weight's input channels padded alike by every candidate block; the output channels, the
    forward's reduction, within one 4 KiB page of batch elements at 8 per block)."""
    return (not gemm.avx512() and c.groups == 1 and (c.kh, c.kw) == (1, 1) and c.sh == c.sw == 1
            and pads == (0, 0) and (c.ic <= 8 or c.ic == 16 or c.ic % 32 == 0)
            and -(-c.oc // 8) * BATCH_ELEMENT <= P4K)


def cl_1x1_scratch(c: gemm.Conv, mask: tuple[bool, bool, bool], weights_pad: int, nthr: int) -> int:
    """Bytes beside the outputs of a channels-last 1x1 backward (``cl_1x1_applies``): the input
    gradient written in place (``nhwc``) beside the weight reordered to ``Bcda<ic_block>b`` and the
    nested forward's scratchpad (its batch elements, one 4 KiB page per thread, and the nested
    registry's 128-byte alignment: jit_brgemm_conv_utils.cpp ``init_scratchpad``); then the weight
    gradient in ``OIhw8i8o``, the bias gradient and ``weights_pad`` (the 1x1 kernel's reducers,
    conv_jit.py), then two dense weight copies and the bias copy (measured)."""
    x, w, b = c.src_bytes if mask[0] else 0, c.weight_bytes, (c.oc * 4 if mask[2] else 0)
    pad = nthr * _rnd_up(P4K, BATCH_ELEMENT) + P4K + gemm.ALIGN
    high = x + c.oc * _weight_padded_ic(c) * 4 + pad if mask[0] else 0
    if mask[1]:
        wb = _rnd_up(c.oc, 8) * _rnd_up(c.ic, 8) * 4
        high = max(high, x + wb + b + max(weights_pad, b + 2 * w))
    return high - (x + (w + b if mask[1] else 0))
