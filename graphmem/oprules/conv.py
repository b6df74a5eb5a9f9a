"""Kernel rules for oneDNN's CPU convolution (graphmem/oprules/registry.py's scratch rules), and the
report's notes for the convolution scratch no rule covers (oneDNN's elsewhere, cuDNN's).

Which oneDNN primitive runs, and so which layouts it reorders into, is chosen at run time from
the shape, the ISA and the data type. The rules here cover the case whose scratch is large and
follows one measured law: the depthwise convolution in channels-last layout (ConvNeXt's 7x7,
MobileNet's and EfficientNet's in channels-last), fp32, square kernels, 16 channels or more.
Other convolutions keep the report's note (below): weight- and activation-sized
reorders, a few percent of a step.

PyTorch's side: aten/src/ATen/native/Convolution.cpp ``_select_conv_backend`` sends a CPU fp32
convolution with ``groups > 1`` to oneDNN (``ConvParams::use_mkldnn``); aten/src/ATen/native/
mkldnn/Conv.cpp ``mkldnn_convolution_backward`` lays input, weight and gradient out channels-last
when ``mkldnn_conv_use_channels_last(input, weight)`` (either suggests ChannelsLast) and calls
ideep's ``convolution_backward_weights::compute_v2``, which computes the weight gradient in the
primitive's own weight format (``pd.diff_weights_desc()``) and reorders it into the dense output.

Measured on oneDNN v3.12 (torch 2.14, AVX-512), to the byte over random shapes, 1 or 2 threads
(tests/oprules/test_workspace_conv.py); an AVX2 CPU runs oneDNN's AVX2 kernels, 8 channels wide where these
are 16 (conv_gemm.simd_w; each function below says where that changes the bytes), checked the same
way on an AVX2 CPU. On other CPUs (``conv_gemm.onednn_x64``) the rules decline and the note stays:

- the forward and the input gradient reorder the weight to ``Goihw16g`` (groups padded to 16);
- the weight gradient runs oneDNN's depthwise kernel where its ``init_conf`` accepts the shape
  (``dw_backward_weights_applies``: kernel width <= 3, ...): its ``Goihw16g`` gradient, the dense
  copy, a bias-sized buffer with the bias gradient. Where it refuses (ConvNeXt's 7x7, MobileNet's
  5x5), a grouped kernel computes it with each group's 1x1 (out, in) blocked to 16x16:
  ``G·16·16·kh·kw`` fp32 elements (1,024x the weight), plus the same dense and bias buffers.
  Batch, image size, stride and thread count do not change it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch._prims_common import suggest_memory_format

import graphmem.oprules.conv_brgemm as brg
import graphmem.oprules.conv_dw as dw
import graphmem.oprules.conv_gemm as gemm
import graphmem.oprules.conv_jit as jit
from graphmem.oprules.registry import RecordedOp, Scratch, register_note, register_scratch

aten = torch.ops.aten
WHAT = "oneDNN depthwise convolution, channels-last (mkldnn/Conv.cpp, measured law)"


def _channels_last(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Conv.cpp ``mkldnn_conv_use_channels_last``: input or weight suggests ChannelsLast."""
    return torch.channels_last in (suggest_memory_format(x), suggest_memory_format(w))


@dataclass(frozen=True)
class Geometry:
    """One 2-d convolution as oneDNN's ``jit_conv_conf_t`` sees it (its dilation is PyTorch's - 1)."""

    g: int
    ih: int
    iw: int
    oh: int
    ow: int
    kh: int
    kw: int
    sh: int
    sw: int
    t_pad: int
    l_pad: int

    def end_pad(self, along_w: bool) -> int:
        """oneDNN ``calculate_end_padding``: (dst - 1)·stride + k - src - start."""
        if along_w:
            return (self.ow - 1) * self.sw + self.kw - self.iw - self.l_pad
        return (self.oh - 1) * self.sh + self.kh - self.ih - self.t_pad


def _geometry(b: dict, out_hw: tuple[int, int]) -> Optional[Geometry]:
    """The convolution, when it is a channels-last fp32 2-d depthwise one without dilation, with
    a square kernel and at least 16 channels (one full ``ch_block``): the domain measured to the
    byte. Narrower or non-square ones (measured: up to a bias- or block-sized buffer more, from
    oneDNN's bias and tail handling) and dilated ones (other kernels) keep the report's note."""
    x, w = b["input"], b["weight"]
    if not (x.dim() == 4 and not b["transposed"] and x.dtype == torch.float32 and b["groups"] > 1
            and tuple(w.shape[:2]) == (b["groups"], 1) and x.size(1) == b["groups"] and _channels_last(x, w)
            and gemm.expand(b["dilation"], 2) == [1, 1] and b["groups"] >= 16 and w.size(2) == w.size(3)):
        return None
    (sh, sw), (ph, pw) = gemm.expand(b["stride"], 2), gemm.expand(b["padding"], 2)
    return Geometry(b["groups"], x.size(2), x.size(3), out_hw[0], out_hw[1], w.size(2), w.size(3), sh, sw, ph, pw)


def _goihw16g(c: Geometry) -> int:
    """The weight in oneDNN's depthwise format ``Goihw16g``: groups padded to 16 (fp32). On an AVX2
    CPU ``Goihw8g`` (jit_uni_dw_conv_kernel_utils.cpp ``init_conf``: ``wei_tag = isa == avx512_core ?
    Goihw16g : Goihw8g``) and the forward's brdgmm kernel's ``debcA8a``: groups padded to 8."""
    return -(-c.g // gemm.simd_w()) * gemm.simd_w() * c.kh * c.kw * 4


def dw_backward_weights_applies(c: Geometry) -> bool:
    """Same file, ``jit_uni_dw_conv_bwd_weights_kernel_t::init_conf``: kw <= 3, stride_w <= kw,
    the output size the padded input gives, paddings at most k/2 (a multiple of the stride
    above 1), an input that holds the filter."""
    b_pad, r_pad = max(0, c.end_pad(False)), max(0, c.end_pad(True))
    return (c.kw <= 3 and c.sw <= c.kw
            and c.oh == (c.ih + c.t_pad + b_pad - c.kh) // c.sh + 1
            and c.ow == (c.iw + c.l_pad + r_pad - c.kw) // c.sw + 1
            and max(c.t_pad, b_pad) <= c.kh // 2 and max(c.l_pad, r_pad) <= c.kw // 2
            and c.ih >= c.kh + (-c.t_pad) % c.sh
            and (c.t_pad <= 1 or c.t_pad % c.sh == 0) and (b_pad <= 1 or b_pad % c.sh == 0))


@register_scratch(aten.convolution.default, source="aten/src/ATen/native/mkldnn/Conv.cpp mkldnn_convolution "
                  "(oneDNN's Goihw16g weight reorder, measured law)")
def _convolution(args: tuple, kwargs: dict, out: object) -> list[Scratch]:
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "transposed", "output_padding", "groups")
    b = dict(zip(names, args), **kwargs)
    c = _geometry(b, (out.size(2), out.size(3)) if isinstance(out, torch.Tensor) and out.dim() == 4 else (0, 0))
    if c is None or not gemm.onednn_x64():
        return []
    # measured: the weight is reordered to Goihw16g whichever kernel runs
    return [Scratch(_goihw16g(c), f"weight reorder to Goihw16g: {WHAT}")]


def depthwise_weight_grad_scratch(c: Geometry, n: int, bias_grad: bool) -> int:
    """Bytes beside the outputs while oneDNN computes a channels-last depthwise weight gradient:
    the depthwise kernel's Goihw16g gradient and its dense copy, or, where that kernel refuses the
    shape, a grouped kernel's gradient with each group's 1x1 blocked to 16x16, the dense copy and
    a bias-sized one (measured). On an AVX2 CPU the same law with 8x8 blocks where the AVX2 jit
    kernel takes the shape (``avx2_weights_applies``; ``aBCde8c8b`` in oneDNN's verbose output),
    else the gemm convolution (``x64:gemm:jit``): ideep's gradient and bias beside its channels-last
    scratchpad (conv_gemm.gemm_nspc_bwd_weights_scratchpad), then their dense copies (measured)."""
    dense, bias = c.g * c.kh * c.kw * 4, (c.g * 4 if bias_grad else 0)
    if dw_backward_weights_applies(c):
        return _goihw16g(c) + dense + bias
    if gemm.avx512():
        return c.g * 16 * 16 * c.kh * c.kw * 4 + dense + bias
    if avx2_weights_applies(c):  # the same law with AVX2's 8x8 blocks (gOIhw8i8o, ``aBCde8c8b`` in the verbose output)
        return c.g * 8 * 8 * c.kh * c.kw * 4 + dense + bias
    conv = gemm.Conv(n, c.g, 1, 1, c.ih, c.iw, c.oh, c.ow, c.kh, c.kw, c.sh, c.sw)
    return max(gemm.gemm_nspc_bwd_weights_scratchpad(conv, gemm.threads()), dense + bias)


def avx2_weights_applies(c: Geometry) -> bool:
    """src/cpu/x64/jit_avx2_conv_kernel_f32.cpp ``jit_avx2_conv_bwd_weights_kernel_f32::init_conf``
    (channels-last, so no channel padding; no dilation here): ``boundaries_ok`` (every padding
    below the kernel) and ``params_ok`` (``kw < 14``, ``kh <= t_pad + ih``, ``kh <= ih``,
    ``t_pad < kh``). Where it refuses, the gemm convolution runs."""
    b_pad, r_pad = max(0, c.end_pad(False)), max(0, c.end_pad(True))
    return (max(c.t_pad, b_pad) < c.kh and max(c.l_pad, r_pad) < c.kw
            and c.kw < 14 and c.kh <= c.t_pad + c.ih and c.kh <= c.ih)


@register_scratch(aten.convolution_backward.default, source="aten/src/ATen/native/mkldnn/Conv.cpp "
                  "mkldnn_convolution_backward; oneDNN jit_uni_dw_conv_kernel_utils.cpp, gemm_convolution_utils.cpp, "
                  "jit_avx512_common_conv_kernel.cpp init_conf")
def _convolution_backward(args: tuple, kwargs: dict, out: object) -> list[Scratch]:
    names = ("grad_output", "input", "weight", "bias_sizes", "stride", "padding", "dilation", "transposed",
             "output_padding", "groups", "output_mask")
    b = dict(zip(names, args), **kwargs)
    grad = b["grad_output"]
    if b["transposed"] or grad.dim() not in (3, 4) or not gemm.onednn_x64():
        return []
    c = _geometry(b, (grad.size(2), grad.size(3)) if grad.dim() == 4 else (0, 0))
    mask = b["output_mask"]
    if c is None:
        return (_plain_depthwise_backward(b) or _gemm_backward(b) or _first_conv_backward(b) or _avx2_jit_backward(b)
                or _avx2_cl_1x1_backward(b))
    # the input gradient runs first and frees its Goihw16g weight before the weight gradient starts
    data = _goihw16g(c) if mask[0] else 0
    weights = depthwise_weight_grad_scratch(c, grad.size(0), mask[2]) if mask[1] else 0
    return [Scratch(max(data, weights), f"weight-gradient blocks and reorders: {WHAT}")]


def _plain_depthwise_backward(b: dict) -> list[Scratch]:
    """A depthwise convolution in the plain layout (graphmem/oprules/conv_dw.py): fp32,
    1-d (viewed as 2-d, Convolution.cpp ``view1d_as_2d``) or 2-d with a square kernel, one output
    channel per group, no dilation, both gradients or the weight's (a bias gradient alone keeps
    the note). A strided input's or gradient's ``contiguous()`` copy lives through the op."""
    grad, x, w, mask = b["grad_output"], b["input"], b["weight"], tuple(b["output_mask"])
    one_d = x.dim() == 3
    if not (x.dim() in (3, 4) and x.dtype == torch.float32 and b["groups"] > 1 and x.size(1) == b["groups"]
            and tuple(w.shape[:2]) == (b["groups"], 1) and (one_d or w.size(2) == w.size(3)) and mask[1]
            and all(d == 1 for d in gemm.expand(b["dilation"], x.dim() - 2)) and (one_d or not _channels_last(x, w))):
        return []
    c = gemm.as_conv(b, grad)
    stride, padding = gemm.expand(b["stride"], x.dim() - 2), gemm.expand(b["padding"], x.dim() - 2)
    (sh, sw), (ph, pw) = ((1, stride[0]), (0, padding[0])) if one_d else (stride, padding)
    if not gemm.uses_onednn(c, x, (ph, pw), False):
        return []
    geo = Geometry(c.groups, c.ih, c.iw, c.oh, c.ow, c.kh, c.kw, sh, sw, ph, pw)
    copies = sum(t.numel() * t.element_size() for t in (x, grad) if not t.is_contiguous())
    nbytes = dw.depthwise_backward_scratch(c, mask, dw_backward_weights_applies(geo), gemm.threads()) + copies
    return [Scratch(nbytes, "oneDNN depthwise convolution backward, plain layout: nChw16c/Goihw16g reorders "
                            "and reductions (jit_uni_dw_conv_kernel_utils.cpp, mkldnn/Conv.cpp)")]


def _gemm_backward(b: dict) -> list[Scratch]:
    """A gradient oneDNN computes with its gemm convolution (graphmem/oprules/conv_gemm.py)."""
    grad, x, mask = b["grad_output"], b["input"], tuple(b["output_mask"])
    c = gemm.as_conv(b, grad)
    padding = gemm.expand(b["padding"], x.dim() - 2)
    pads = (0, padding[0]) if x.dim() == 3 else (padding[0], padding[1])
    dilated = any(d != 1 for d in gemm.expand(b["dilation"], x.dim() - 2))
    cl = x.dim() == 4 and _channels_last(x, b["weight"])
    if x.dim() == 4 and mask[1] and x.dtype == torch.float32 and gemm.uses_onednn(c, x, pads, dilated) \
            and gemm.avx2_gemm_weights(c, pads, dilated, cl):
        copies = sum(t.numel() * t.element_size() for t in (x, grad) if not t.is_contiguous())
        return [Scratch(gemm.avx2_backward_scratch(c, mask, copies, gemm.threads()),
                        "oneDNN AVX2 convolution backward: nChw8c/ABcd8a8b reorders (jit_avx2_conv_kernel_f32.cpp) "
                        "and the gemm weight gradient's scratchpad (gemm_convolution_utils.cpp)")]
    if not mask[1] or x.dtype != torch.float32 or not gemm.uses_onednn(c, x, pads, dilated) \
            or not gemm.weights_by_gemm(c, pads, dilated, cl) or (mask[0] and not gemm.data_by_gemm(c, pads, dilated, cl)):
        return []  # an input gradient by another kernel, or a bias gradient alone: the note stays
    # Convolution.cpp / mkldnn/Conv.cpp: input.contiguous(), grad_output.contiguous()
    copies = sum(t.numel() * t.element_size() for t in (x, grad) if not t.is_contiguous())
    nbytes = gemm.gemm_backward_scratch(c, mask, copies, gemm.threads())
    return [Scratch(nbytes, "oneDNN gemm convolution backward: scratchpad (gemm_convolution_utils.cpp) "
                            "and gradient copies (mkldnn/Conv.cpp)")]


def _first_conv_backward(b: dict) -> list[Scratch]:
    """A patch embedding's weight gradient by oneDNN's jit first-convolution kernel (graphmem/
    oprules/conv_jit.py): fp32, 2-d, plain layout, one group, 1 to 3 input channels
    (``src_ok`` of ``init_conf``), stride = kernel (2 to 14), no padding, no input gradient."""
    grad, x, w, mask = b["grad_output"], b["input"], b["weight"], tuple(b["output_mask"])
    if not (x.dim() == 4 and x.dtype == torch.float32 and b["groups"] == 1 and x.size(1) <= 3 and mask[1]
            and not mask[0] and not _channels_last(x, w)):
        return []
    c = gemm.as_conv(b, grad)
    stride, padding = gemm.expand(b["stride"], 2), gemm.expand(b["padding"], 2)
    if not (stride == [c.kh, c.kw] and 2 <= c.kw <= 14 and padding == [0, 0]
            and gemm.expand(b["dilation"], 2) == [1, 1] and gemm.uses_onednn(c, x, (0, 0), False)):
        return []
    copies = sum(t.numel() * t.element_size() for t in (x, grad) if not t.is_contiguous())
    if not gemm.avx512():  # AVX2: jit_avx2_conv_kernel_f32.cpp below kernel 14, the gemm convolution at 14
        if not jit.avx2_first_conv_applies(c):
            return []
        return [Scratch(jit.avx2_first_conv_weight_grad_scratch(c, mask[2], gemm.threads()) + copies,
                        "oneDNN AVX2 weight gradient: nChw8c/OIhw8i8o reorders and reducers "
                        "(jit_avx2_conv_kernel_f32.cpp, jit_avx2_convolution.hpp, mkldnn/Conv.cpp)")]
    if mask[2] and jit.balance(c, gemm.threads()) > 1:
        return []  # a bias gradient reduced over threads: measured 12,352 B more than the source read explains
    nbytes = jit.first_conv_weight_grad_scratch(c, mask[2], gemm.threads()) + copies
    return [Scratch(nbytes, "oneDNN first-convolution weight gradient: nChw16c/Ohwi16o reorders and reductions "
                            "(jit_avx512_common_conv_kernel.cpp, mkldnn/Conv.cpp)")]


def _avx2_jit_backward(b: dict) -> list[Scratch]:
    """AVX2 only: a one-group fp32 convolution in the plain layout, 1-d or 2-d, undilated, whose
    weight gradient (and input gradient, at unit stride) oneDNN's AVX2 jit kernels compute
    (graphmem/oprules/conv_jit.py ``avx2_jit_applies``): Whisper's kernel-3 Conv1d, a 3x3 stem."""
    grad, x, w, mask = b["grad_output"], b["input"], b["weight"], tuple(b["output_mask"])
    if gemm.avx512() or not (x.dtype == torch.float32 and b["groups"] == 1 and mask[1]
                             and all(d == 1 for d in gemm.expand(b["dilation"], x.dim() - 2))
                             and not (x.dim() == 4 and _channels_last(x, w))):
        return []
    c, padding = gemm.as_conv(b, grad), gemm.expand(b["padding"], x.dim() - 2)
    pads = (0, padding[0]) if x.dim() == 3 else (padding[0], padding[1])
    strided = mask[0] and (c.sh > 1 or c.sw > 1)  # the input gradient on brgconv_strided:avx2 (conv_brgemm.py)
    if not ((jit.avx2_jit_applies(c, pads, mask[0] and not strided) or jit.avx2_1x1_applies(c, pads))
            and gemm.uses_onednn(c, x, pads, False)
            and (not strided or brg.strided_data_applies(c, pads))):
        return []
    copies = sum(t.numel() * t.element_size() for t in (x, grad) if not t.is_contiguous())
    data_high = brg.strided_data_high(c, pads, gemm.threads()) if strided else None
    return [Scratch(jit.avx2_backward_scratch(c, mask, gemm.threads(), data_high) + copies,
                    "oneDNN AVX2 convolution backward: nChw8c/ABcd8a8b/OIhw8i8o reorders and reducers "
                    "(jit_avx2_conv_kernel_f32.cpp, jit_avx2_convolution.hpp, mkldnn/Conv.cpp)")]


def _avx2_cl_1x1_backward(b: dict) -> list[Scratch]:
    """AVX2 only: a channels-last one-group fp32 1x1 convolution (ConvNeXt's pointwise ones as
    convolutions) whose input and output gradient are both channels-last (no reorders):
    graphmem/oprules/conv_brgemm.py ``cl_1x1_applies``."""
    grad, x, w, mask = b["grad_output"], b["input"], b["weight"], tuple(b["output_mask"])
    cl = torch.channels_last
    if gemm.avx512() or not (x.dim() == 4 and x.dtype == torch.float32 and b["groups"] == 1 and mask[1]
                             and x.is_contiguous(memory_format=cl) and grad.is_contiguous(memory_format=cl)
                             and not x.is_contiguous() and _channels_last(x, w)):
        return []
    c, pads = gemm.as_conv(b, grad), tuple(gemm.expand(b["padding"], 2))
    if not (brg.cl_1x1_applies(c, (pads[0], pads[1])) and gemm.uses_onednn(c, x, (0, 0), False)):
        return []
    weights_pad = jit.avx2_1x1_weights_scratchpad(c, mask[2], gemm.threads(), nxc=True)
    return [Scratch(brg.cl_1x1_scratch(c, mask, weights_pad, gemm.threads()),
                    "oneDNN AVX2 channels-last 1x1 backward: Bcda32b weight reorder, brgemm batch, "
                    "jit_1x1 reducers (jit_brgemm_conv_bwd.cpp, jit_avx2_1x1_convolution.hpp)")]


@register_note(aten.convolution.default, aten.convolution_backward.default, devices=("cpu",),
               source="aten/src/ATen/native/mkldnn/Conv.cpp mkldnn_convolution, mkldnn_convolution_backward "
                      "(oneDNN's reorders and scratchpad)")
def _onednn_conv(node: RecordedOp) -> str:
    if node.meta.get("scratch"):  # covered by a rule above (depthwise channels-last; conv_dw.py: depthwise NCHW;
        return ""                 # conv_gemm.py: kernels > 14; conv_jit.py: patch embeddings)
    return ("aten.convolution (CPU): oneDNN's scratch inside the op (weight and activation reorders to its "
            "blocked layouts, its scratchpad; chosen per shape, ISA and thread count) is not modelled except for "
            "fp32 depthwise convolutions, kernels wider than 14 (oneDNN's gemm path) and patch embeddings: the "
            "real peak can be higher by up to a few weight- or activation-sized buffers per convolution "
            "(measured: ResNet-18 +0.09 %, Whisper's Conv1d up to +10 % at toy sizes)")


@register_note(aten.convolution.default, aten.convolution_backward.default, devices=("cuda",),
               source="aten/src/ATen/native/cudnn/Conv_v8.cpp (cuDNN's algorithm search and workspace)")
def _cudnn_conv(node: RecordedOp) -> str:
    # cuDNN documents no size or bound for it: only a per-algorithm runtime query (cudnnGetConvolution*WorkspaceSize)
    return "aten.convolution (CUDA): cuDNN's workspace (chosen by its algorithm search) is not modelled"
