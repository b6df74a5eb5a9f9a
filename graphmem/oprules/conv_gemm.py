"""oneDNN's gemm-based convolution backward on the CPU (``gemm:jit`` in oneDNN's verbose output):
the path of kernels wider than 14 in the plain layout: patch embeddings (ViT, DeiT, CLIP, SigLIP
at patch 16 or 32), wide 1-d convolutions, wav2vec2's grouped positional convolution (kernel
128). graphmem/oprules/conv.py registers the rule; this module computes it.

Which kernel runs (fp32, AVX-512; read in oneDNN's source at a March 2025 commit, checked on the
v3.12 torch 2.14 links with ``torch.backends.mkldnn.verbose`` and against the allocator on 200
random shapes, tests/oprules/test_workspace_conv_gemm.py): src/cpu/cpu_convolution_list.cpp tries, for
``backward_weights``, the inner-product form (unit stride, kernel = input), the depthwise and
1x1 kernels, ``jit_avx512_common_convolution_bwd_weights`` (src/cpu/x64/
jit_avx512_common_conv_kernel.cpp ``init_conf``: ``if (!jcp.is_hw_transp && jcp.kw > 14) return
unimplemented``), the AVX2 kernels (jit_avx2_conv_kernel_f32.cpp: ``kw < 14``), then
``gemm_convolution_bwd_weights_t``. The input gradient's list is longer (``data_by_gemm``).

The scratchpad, src/cpu/gemm_convolution_utils.cpp ``init_conf``, plain layout:

- weight gradient: ``key_conv_wei_reduction``, ``book<float>(nthr * weights_d.size())``, where
  ``size()`` is already in bytes: 4x the weight's bytes per thread; then the im2col buffer;
- input gradient: the im2col buffer only;
- im2col (``key_conv_gemm_col``): ``nthr * ic * ks * os`` floats (ic per group; none for a 1x1
  unit-stride convolution), its spatial block cut (``os_block = max(simd_w, coef * max_os_block)``,
  coef 0.05 / 0.1) when it would not fit under ``scratchpad_limit = min(1 GiB, 15 * max_threads *
  (src + wei + dst))``;
- ``nthr`` = ``max_threads`` under outer threading (conditions in each function below), else 1;
- src/common/memory_tracking.hpp ``registrar_t::book``: each booking's capacity is its size plus
  its 128-byte alignment.

PyTorch's side, aten/src/ATen/native/mkldnn/Conv.cpp ``mkldnn_convolution_backward``: the input
gradient first (ideep's gradient in the primitive's plain layout and the scratchpad, both through
c10's CPU allocator: aten/src/ATen/native/mkldnn/IDeepRegistration.cpp; then the dense copy), then
the weight and bias gradients the same way. ``input.contiguous()`` and ``grad_output.contiguous()``
(Convolution.cpp for a 1-d convolution, Conv.cpp) are copies, live through the op, when those
arrive strided (wav2vec2's ``transpose(1, 2)`` input, a patch embedding's
``flatten(2).transpose(1, 2)`` gradient).

Known limitations: the bf16/fp16 paths, channels-last, dilated convolutions, a bias gradient
without the weight's, and input gradients of one group or of strided convolutions (brgemm
kernels) have no rule here (graphmem/oprules/conv.py's note stays).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

import graphmem.oprules.isa as isa

ALIGN = 128  # memory_tracking.hpp default_alignment


def avx512() -> bool:
    """Whether oneDNN runs its AVX-512 kernels in this process (graphmem/oprules/isa.py: the CPU's
    flags capped by ``ONEDNN_MAX_CPU_ISA``); an AVX2 CPU (or one capped at AVX2) runs oneDNN's AVX2
    kernels, whose blocks are 8 fp32 wide (checked with ``torch.backends.mkldnn.verbose``:
    ``nChw8c``, ``Goihw8g``, ``jit_dw:avx2``)."""
    return isa.onednn_isa() == isa.AVX512


def onednn_x64() -> bool:
    """The CPUs these rules were derived and checked on: AVX-512 or AVX2 x86-64 (another CPU, e.g.
    an Arm one, runs other kernels: the rules decline there and the report's note stays)."""
    return isa.onednn_isa() in (isa.AVX512, isa.AVX2)


def simd_w() -> int:
    """fp32 lanes of a vector register: src/cpu/gemm_convolution_utils.cpp ``init_conf``'s
    ``simd_w = vlen / data_size`` (vlen from ``platform::get_vector_register_size()``: 64 bytes
    with AVX-512, 32 with AVX2); also the depthwise kernels' ``ch_block`` (src/cpu/x64/
    jit_uni_dw_conv_kernel_utils.cpp ``init_conf``: ``isa == avx512_core ? 16 : 8``)."""
    return 16 if avx512() else 8


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


def _inner_product(c: Conv, pads: tuple[int, int]) -> bool:
    """src/cpu/x64/ip_convolution.hpp ``check_conv_ip``: a unit-stride, unpadded kernel that
    covers the whole input runs as an inner product instead."""
    return c.sh == c.sw == 1 and pads == (0, 0) and (c.kh, c.kw) == (c.ih, c.iw)


def weights_by_gemm(c: Conv, pads: tuple[int, int], dilated: bool, channels_last: bool) -> bool:
    """Where oneDNN's fp32 weight gradient falls through to the gemm convolution (module
    docstring): plain layout, no dilation, a kernel wider than 14, not the inner-product form,
    and not ``is_hw_transp`` (unit strides, ``ow == 1``, ``kw == iw``, ``kw < 20``, no padding). On an
    AVX2 CPU no AVX-512 kernel is tried: a kernel of 14 or wider (checked: patch embeddings of 14)."""
    if not avx512():  # AVX2: jit_avx2_conv_kernel_f32.cpp ``init_conf`` (``kw < 14``) is the last jit kernel tried
        return not channels_last and not dilated and c.kw >= 14 and not _inner_product(c, pads)
    hw_transp = c.sh == c.sw == 1 and c.ow == 1 and c.kw == c.iw and c.kw < 20 and pads == (0, 0)
    return not channels_last and not dilated and c.kw > 14 and not _inner_product(c, pads) and not hw_transp


def data_by_gemm(c: Conv, pads: tuple[int, int], dilated: bool, channels_last: bool) -> bool:
    """Where the input gradient also reaches ``gemm_convolution_bwd_data_t``. Before it,
    src/cpu/cpu_convolution_list.cpp tries the brgemm kernels (strided ones for strides above 1:
    excluded here), the depthwise kernel (excluded: one channel per group), the 1x1 kernel (its
    kernel is wider) and ``jit_avx512_common_convolution_bwd_data`` (jit_avx512_common_conv_kernel.cpp
    ``init_conf``), which refuses a group whose channels are not both multiples of 4 (its 16-, 8-
    and 4-wide blocks; one group pads instead) and a left overflow ``(kw - 1 - l_pad) / stride_w``
    above its unroll ``ur_w`` (at most 28 registers) unless ``large_w_filter`` (``kw < 20``).
    The AVX2 kernels need ``kw < 14``. One group is left out: the brgemm kernel computing the input
    gradient as a forward convolution takes some of those (measured: one input channel, kernel 32).
    Checked on random shapes (tests/oprules/test_workspace_conv_gemm.py)."""
    blocks_refused = c.ic % 4 != 0 or c.oc % 4 != 0
    overflow_refused = c.kw >= 20 and c.kw - 1 - pads[1] > 28
    return (weights_by_gemm(c, pads, dilated, channels_last) and c.kw > 14 and c.sh == c.sw == 1 and c.groups > 1
            and (c.ic, c.oc) != (1, 1) and (blocks_refused or overflow_refused))


def gemm_bwd_weights_scratchpad(c: Conv, max_threads: int) -> int:
    """Bytes of the scratchpad ``gemm_convolution_bwd_weights_t`` asks for (module docstring)."""
    w, limit = c.weight_bytes, _limit(c, max_threads)
    estimate = 4 * max_threads * w + 4 * max_threads * c.ic * c.kh * c.kw * simd_w()
    outer = estimate < limit and (c.oh * c.ow) // max_threads < 256 and (c.n != 1 or c.groups > 2)
    nthr = max_threads if outer else 1
    booked = 4 * nthr * w + ALIGN  # key_conv_wei_reduction
    return booked + _col_booking(c, nthr, booked, limit, 0.05)


def gemm_nspc_bwd_weights_scratchpad(c: Conv, max_threads: int) -> int:
    """Bytes of the scratchpad ``gemm_convolution_bwd_weights_t`` asks for in the channels-last
    layout (src/cpu/gemm_convolution_utils.cpp ``init_conf``, ``jcp.is_nspc && is_bwd_w``): under
    outer threading (``thr_mem_estimate = max_threads·(4·im2col_sz + 4·is·ic + 4·weights_d.size())``
    below the limit, ``os / max_threads < 256``, ``mb != 1 || ngroups > 2``) ``nthr = max_threads``,
    else 1; then ``key_conv_gemm_col`` (nthr·im2col_sz floats, no spatial cut in this layout),
    ``key_conv_wei_reduction`` (``book<float>(nthr·weights_d.size())``: 4x the weight's bytes per
    thread) and ``key_conv_gemm_imtr`` (nthr·is·ic floats), each plus its 128-byte alignment."""
    w, is_, os_ = c.weight_bytes, c.ih * c.iw, c.oh * c.ow
    im2col = _im2col(c)
    estimate = max_threads * (4 * im2col + 4 * is_ * c.ic + 4 * w)
    outer = estimate < _limit(c, max_threads) and os_ // max_threads < 256 and (c.n != 1 or c.groups > 2)
    nthr = max_threads if outer else 1
    col = nthr * im2col * 4 + ALIGN if im2col else 0
    return col + 4 * nthr * w + ALIGN + nthr * is_ * c.ic * 4 + ALIGN


def _im2col(c: Conv) -> int:
    """``jcp.im2col_sz``: ic·ks·os floats per thread, none for a 1x1 unit-stride convolution."""
    ks = c.kh * c.kw
    return 0 if (c.ow == c.iw and c.oh == c.ih and c.sh == c.sw == 1 and ks == 1) else c.ic * ks * c.oh * c.ow


def _col_booking(c: Conv, nthr: int, booked: int, limit: int, coef: float) -> int:
    """Bytes of ``key_conv_gemm_col``: nthr·im2col_sz floats, the spatial block cut to
    ``max(simd_w, coef·max_os_block)`` where that does not fit under the limit."""
    im2col, os_ = _im2col(c), c.oh * c.ow
    col = nthr * im2col
    if limit - booked < col * 4:
        max_os_block = (limit - booked) // (4 * nthr * (im2col // os_))
        col = nthr * c.ic * c.kh * c.kw * max(simd_w(), int(max_os_block * coef))
    return col * 4 + ALIGN if col else 0


def _limit(c: Conv, max_threads: int) -> int:
    return min(1 << 30, 15 * max_threads * (c.src_bytes + c.weight_bytes + c.dst_bytes))


def gemm_bwd_data_scratchpad(c: Conv, max_threads: int) -> int:
    """Bytes of the scratchpad ``gemm_convolution_bwd_data_t`` asks for (same ``init_conf``,
    ``!jcp.is_nspc && is_bwd_d``): only the im2col buffer, per thread under outer threading
    (``(os / max_threads < 512 || ks < 64) && (mb != 1 || ngroups > 2)`` and the outer split at
    least as even as the inner one, or little work per thread)."""
    is_, os_, ks = c.ih * c.iw, c.oh * c.ow, c.kh * c.kw
    outer_work, inner_work = c.groups * c.n, -(-is_ // simd_w()) * -(-c.ic // simd_w())

    def rnd_up(v: int) -> int:
        return -(-v // max_threads) * max_threads

    even = outer_work * rnd_up(inner_work) >= inner_work * rnd_up(outer_work)  # outer_thr_eff / inner_thr_eff >= 1
    outer = ((os_ // max_threads < 512 or ks < 64) and (c.n != 1 or c.groups > 2)
             and (even or (is_ * c.ic * c.oc) // max_threads < 64 * 1024))
    return _col_booking(c, max_threads if outer else 1, 0, _limit(c, max_threads), 0.1)


def gemm_backward_scratch(c: Conv, mask: tuple[bool, bool, bool], copies: int, max_threads: int) -> int:
    """Bytes beside the op's outputs at its high point (aten/src/ATen/native/mkldnn/Conv.cpp
    ``mkldnn_convolution_backward``, plain layout): the input gradient first (ideep's gradient
    and the scratchpad, then its dense copy), then the weight gradient beside it (ideep's weight
    and bias gradients and the scratchpad, then their dense copies); ``copies`` (``contiguous()``
    copies of a strided input or output gradient) live through the op."""
    x = c.src_bytes if mask[0] else 0
    w = c.weight_bytes if mask[1] else 0
    bias = c.groups * c.oc * 4 if mask[2] else 0
    high = x + max(gemm_bwd_data_scratchpad(c, max_threads), x) if mask[0] else 0
    if mask[1]:
        high = max(high, x + w + bias + max(gemm_bwd_weights_scratchpad(c, max_threads), w + bias))
    return max(0, high - (x + w + bias)) + copies


def avx2_gemm_weights(c: Conv, pads: tuple[int, int], dilated: bool, channels_last: bool) -> bool:
    """AVX2 only: a dense (one group), plain-layout, unit-stride convolution padded by half its
    square kernel (< 14 wide), whose kernel is taller than its input (ResNet's 3x3 convolutions on
    1x1 and 2x2 maps): jit_avx2_conv_kernel_f32.cpp ``jit_avx2_conv_bwd_weights_kernel_f32::
    init_conf`` refuses it (``params_ok``: ``kh <= ih``), so the gemm convolution computes the weight
    gradient, while ``jit_avx2_conv_bwd_data_kernel_f32`` computes the input gradient. The domain
    checked against the allocator (tests/oprules/test_workspace_conv_gemm.py); strided ones are left out."""
    return (not avx512() and c.groups == 1 and not channels_last and not dilated and c.sh == c.sw == 1
            and c.kh == c.kw < 14 and pads == (c.kh // 2, c.kw // 2) and c.kh > c.ih)


def avx2_backward_scratch(c: Conv, mask: tuple[bool, bool, bool], copies: int, max_threads: int) -> int:
    """Bytes beside the outputs where ``avx2_gemm_weights``: the input gradient first (ideep
    reorders the output gradient to ``nChw8c`` and the weight to ``ABcd8a8b``, both with channels
    padded to 8, computes the input gradient in ``nChw8c``, then copies it into the dense output),
    then the weight gradient as ``gemm_backward_scratch`` (measured to the byte)."""
    oc8, ic8 = -(-c.oc // 8) * 8, -(-c.ic // 8) * 8
    x = c.src_bytes if mask[0] else 0
    blocked = c.n * ic8 * c.ih * c.iw * 4
    high = max(c.n * oc8 * c.oh * c.ow * 4 + oc8 * ic8 * c.kh * c.kw * 4 + blocked, blocked + x) if mask[0] else 0
    w, bias = c.weight_bytes, (c.oc * 4 if mask[2] else 0)
    high = max(high, x + w + bias + max(gemm_bwd_weights_scratchpad(c, max_threads), w + bias))
    return max(0, high - (x + w + bias)) + copies


def threads() -> int:
    """oneDNN's ``dnnl_get_max_threads()``: OpenMP's, which PyTorch sets to its own count."""
    return torch.get_num_threads()


def expand(values: Union[int, list[int], tuple[int, ...]], dims: int) -> list[int]:
    """A convolution parameter per spatial dim (ATen's ``expand_param_if_needed``: one value for all)."""
    values = list(values) if isinstance(values, (list, tuple)) else [values]
    return values * dims if len(values) == 1 else values


def as_conv(b: dict, grad: torch.Tensor) -> Conv:
    """The convolution of ``convolution_backward``'s bound arguments, a 1-d one viewed as 2-d."""
    x, w = b["input"], b["weight"]
    g, stride = b["groups"], expand(b["stride"], x.dim() - 2)
    one_d = x.dim() == 3
    ih, iw = (1, x.size(2)) if one_d else (x.size(2), x.size(3))
    oh, ow = (1, grad.size(2)) if one_d else (grad.size(2), grad.size(3))
    kh, kw = (1, w.size(2)) if one_d else (w.size(2), w.size(3))
    sh, sw = (1, stride[0]) if one_d else (stride[0], stride[1])
    return Conv(x.size(0), g, x.size(1) // g, w.size(0) // g, ih, iw, oh, ow, kh, kw, sh, sw)


def uses_onednn(c: Conv, x: torch.Tensor, pads: tuple[int, int], dilated: bool) -> bool:
    """aten/src/ATen/native/Convolution.cpp ``ConvParams::use_mkldnn`` for an fp32 CPU tensor
    (after the 1-d view): strided, dilated, a batch of 16 or more, a kernel other than 1x1 or more
    than one thread; and more than one group, a kernel above 3x3 both ways, a batch above 1 or an
    input above 20,480 elements."""
    return (bool(torch.backends.mkldnn.enabled) and x.dtype == torch.float32
            and (c.sh > 1 or c.sw > 1 or dilated or c.n >= 16 or (c.kh, c.kw) != (1, 1) or threads() > 1)
            and (c.groups > 1 or (c.kh > 3 and c.kw > 3) or c.n > 1 or c.n * c.groups * c.ic * c.ih * c.iw > 20480))
