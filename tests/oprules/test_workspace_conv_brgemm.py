"""oneDNN's AVX2 brgemm convolution kernels (graphmem/oprules/conv_brgemm.py) against the real CPU
kernels, to the byte over random shapes."""
from __future__ import annotations

import random

import pytest
import torch
from test_workspace import _op_scratch

from graphmem.oprules import scratch

aten = torch.ops.aten
AVX2 = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX2",
                          reason="oneDNN's AVX2 kernels (an AVX2-only CPU)")


@AVX2
def test_avx2_strided_input_gradient_equals_real_kernel(threads: None) -> None:
    """60 random one-group strided convolutions (``brgconv_strided:avx2`` for the input gradient,
    jit_avx2 for the weight's): 1-d (Whisper's stride-2 kernel-3 Conv1d) and 2-d, kernels 2 to 7,
    strides 2 and 3 (inputs the stride does not divide among them: its ``exec_trans`` buffer),
    padding below the kernel, 1 to 8, 16 or a multiple of 32 input channels, bias or not, 1 or 2
    threads, strided inputs among them: the bytes inside convolution_backward above its outputs
    equal the rule's."""
    rng = random.Random(12)
    for _ in range(60):
        torch.set_num_threads(rng.choice([1, 2]))
        one_d, k, s = rng.random() < 0.5, rng.choice([2, 3, 3, 4, 5, 7]), rng.choice([2, 2, 3])
        n, ic, oc = rng.choice([2, 3]), rng.choice([3, 8, 16, 32, 64, 96]), rng.choice([16, 20, 32, 64])
        bias, p, dims = rng.random() < 0.5, rng.randint(0, k - 1), 1 if one_d else 2
        width = rng.randint(k + 8, 120) if one_d else rng.randint(k + 4, 30)
        width += (-width % s) if ic > 8 else 0  # an uneven width's out buffer fits one 4 KiB page: ic <= 8
        shape = (n, ic, width) if one_d else (n, ic, rng.randint(k + 4, 30), width)
        x = torch.randn(*shape) if rng.random() < 0.7 else torch.randn(*reversed(shape)).permute(*reversed(range(len(shape))))
        w = torch.randn(oc, ic, *([k] * dims))
        conv = (x, w, torch.randn(oc) if bias else None, [s] * dims, [p] * dims, [1] * dims, False, [0] * dims, 1)
        y = aten.convolution.default(*conv)
        bwd = (torch.randn_like(y), x, w, [oc] if bias else None, *conv[3:], [True, True, bias])
        real = _op_scratch(lambda: aten.convolution_backward.default(*bwd), ("aten::convolution_backward",))
        predicted = sum(sc.nbytes for sc in scratch(aten.convolution_backward.default, "cpu", bwd, {}, None))
        assert predicted > 0, (shape, k, s, p)
        assert real == [predicted], (torch.get_num_threads(), shape, x.is_contiguous(), k, s, p, bias)


@AVX2
def test_avx2_1x1_convolution_backward_equals_real_kernel(threads: None) -> None:
    """60 random one-group 1x1 convolutions on ``jit_1x1:avx2`` (conv_jit.py ``avx2_1x1_applies``):
    EfficientNet's and ConvNeXt's pointwise and squeeze-excite ones, channels not always multiples
    of 8, 1x1 to 20x20 maps, bias or not, the input gradient or not, 2 threads (or 1 with a batch of
    16: ATen sends a 1x1 convolution to oneDNN only then), strided inputs among them: the bytes
    inside convolution_backward above its outputs equal the rule's (``jit_avx2_1x1`` reducers)."""
    rng = random.Random(13)
    for _ in range(60):
        torch.set_num_threads(rng.choice([1, 2]))
        n = 16 if torch.get_num_threads() == 1 else rng.choice([2, 3, 5])
        ic, oc = rng.choice([3, 8, 12, 24, 64, 96, 200, 320]), rng.choice([8, 12, 48, 64, 256, 400])
        shape, bias = (n, ic, rng.choice([1, 2, 4, 7, 16]), rng.choice([1, 2, 4, 7, 20])), rng.random() < 0.5
        x = torch.randn(*shape) if rng.random() < 0.8 else torch.randn(*reversed(shape)).permute(3, 2, 1, 0)
        w = torch.randn(oc, ic, 1, 1)
        conv = (x, w, torch.randn(oc) if bias else None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
        y = aten.convolution.default(*conv)
        bwd = (torch.randn_like(y), x, w, [oc] if bias else None, *conv[3:], [rng.random() < 0.7, True, bias])
        real = _op_scratch(lambda: aten.convolution_backward.default(*bwd), ("aten::convolution_backward",))
        predicted = sum(sc.nbytes for sc in scratch(aten.convolution_backward.default, "cpu", bwd, {}, None))
        assert predicted > 0, (shape, oc)
        assert real == [predicted], (torch.get_num_threads(), shape, oc, x.is_contiguous(), bwd[-1])


@AVX2
def test_avx2_channels_last_1x1_backward_equals_real_kernel(threads: None) -> None:
    """60 random channels-last one-group 1x1 convolutions (conv_brgemm.py ``cl_1x1_applies``: the
    input gradient on ``brg_conv_bwd:avx2+brgconv_1x1:avx2``, the weight gradient on ``jit_1x1:avx2``
    in nhwc): ConvNeXt's pointwise convolutions, 8, 16 or a multiple of 32 input channels, output
    channels not always multiples of 8, bias or not, the input gradient or not, 2 threads (or 1
    with a batch of 16): the bytes inside convolution_backward above its outputs equal the rule's."""
    rng = random.Random(14)
    cl = torch.channels_last
    for _ in range(60):
        torch.set_num_threads(rng.choice([1, 2]))
        n = 16 if torch.get_num_threads() == 1 else rng.choice([2, 3, 5])
        ic, oc = rng.choice([8, 16, 32, 64, 160, 320]), rng.choice([8, 12, 40, 80, 160, 640, 800])
        x = torch.randn(n, ic, rng.randint(2, 14), rng.randint(2, 14)).contiguous(memory_format=cl)
        w, bias = torch.randn(oc, ic, 1, 1), rng.random() < 0.5
        conv = (x, w, torch.randn(oc) if bias else None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
        y = aten.convolution.default(*conv)
        bwd = (torch.randn_like(y).contiguous(memory_format=cl), x, w, [oc] if bias else None, *conv[3:],
               [rng.random() < 0.7, True, bias])
        real = _op_scratch(lambda: aten.convolution_backward.default(*bwd), ("aten::convolution_backward",))
        predicted = sum(sc.nbytes for sc in scratch(aten.convolution_backward.default, "cpu", bwd, {}, None))
        assert predicted > 0, (tuple(x.shape), oc)
        assert real == [predicted], (torch.get_num_threads(), tuple(x.shape), oc, bwd[-1])
