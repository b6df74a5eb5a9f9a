"""oneDNN's jit first-convolution weight gradient (graphmem/oprules/conv_jit.py) against the
real CPU kernel, to the byte over random patch embeddings, and the ViTs whose peak it decides."""
from __future__ import annotations

import random
from typing import Callable

import pytest
import torch
from test_workspace import _op_scratch

import graphmem
from graphmem.oprules import scratch
from graphmem.oprules.conv_gemm import Conv
from graphmem.oprules.conv_jit import balance
from graphmem.validation.measure import measure_peak

aten = torch.ops.aten


def test_patch_embedding_weight_grad_equals_real_kernel(threads: None) -> None:
    """80 random patch embeddings (stride = kernel 2 to 14, 1 or 3 input channels, batch 2-5,
    1 or 2 threads, strided output gradients among them): the bytes allocated inside
    convolution_backward above its outputs equal the rule's. (A bias gradient that oneDNN reduces
    over threads, ``nthr_mb > 1``, is left out: measured 12,352 B more than the source explains,
    so the rule declines it.)"""
    rng = random.Random(8)
    for _ in range(80):
        torch.set_num_threads(rng.choice([1, 2]))
        k, n, ic, oc = rng.choice([2, 4, 7, 8, 14]), rng.choice([2, 3, 5]), rng.choice([1, 3]), rng.choice([8, 16, 24, 64, 192])
        x, w = torch.randn(n, ic, k * rng.choice([1, 2, 4, 12]), k * rng.choice([1, 2, 4, 12])), torch.randn(oc, ic, k, k)
        oh, ow = x.size(2) // k, x.size(3) // k
        split = balance(Conv(n, 1, ic, oc, x.size(2), x.size(3), oh, ow, k, k, k, k), torch.get_num_threads())
        bias = rng.random() < 0.7 and split == 1
        conv = (x, w, torch.randn(oc) if bias else None, [k, k], [0, 0], [1, 1], False, [0, 0], 1)
        y = aten.convolution.default(*conv)
        grad = torch.randn_like(y) if rng.random() < 0.7 else torch.randn(n, *reversed(y.shape[1:])).transpose(1, -1)
        bwd = (grad, x, w, [oc] if bias else None, *conv[3:], [False, True, bias])
        real = _op_scratch(lambda: aten.convolution_backward.default(*bwd), ("aten::convolution_backward",))
        predicted = sum(sc.nbytes for sc in scratch(aten.convolution_backward.default, "cpu", bwd, {}, None))
        assert predicted > 0
        assert real == [predicted], (torch.get_num_threads(), tuple(x.shape), tuple(w.shape), grad.is_contiguous(), bias)


def _timm_vit() -> tuple:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=32, patch_size=8, depth=2)
    return model, (torch.randn(2, 3, 32, 32),)


def _hf_vit() -> tuple:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                    image_size=32, patch_size=8, num_labels=10)
    return transformers.ViTForImageClassification(config), (torch.randn(2, 3, 32, 32),)


@pytest.mark.slow
@pytest.mark.parametrize("build", [_timm_vit, _hf_vit], ids=["timm_vit_tiny_patch8", "hf_vit_patch8"])
def test_patch8_vits_peak_equals_real_step(build: Callable[[], tuple]) -> None:
    """ViTs at patch 8 peak in the patch embedding's weight gradient: equal to the real CPU step's
    peak to the byte (measured before this rule, 2 threads: 2.25 % and 0.20 % under)."""
    model, inputs = build()
    report = graphmem.analyze(model, inputs)
    real = measure_peak(model, inputs)
    assert report.activation_bytes == real.saved_bytes
    assert report.peak_bytes == real.peak_bytes


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX2", reason="oneDNN's AVX2 kernels (an AVX2-only CPU)")
def test_avx2_dense_convolution_backward_equals_real_kernel(threads: None) -> None:
    """60 random one-group convolutions on oneDNN's AVX2 jit kernels (conv_jit.py ``avx2_jit_applies``):
    1-d (Whisper's kernel 3) and 2-d, kernels 2 to 7, padding below the kernel, channels not always
    multiples of 8 (3 among them), bias or not, 1 or 2 threads, the input gradient at unit stride,
    strided inputs among them: the bytes inside convolution_backward above its outputs equal the rule's."""
    rng = random.Random(11)
    for _ in range(60):
        torch.set_num_threads(rng.choice([1, 2]))
        one_d, k, s = rng.random() < 0.5, rng.choice([2, 3, 3, 5, 7]), rng.choice([1, 1, 2])
        n, ic, oc, size = rng.choice([2, 3]), rng.choice([3, 8, 12, 16, 80]), rng.choice([16, 20, 32, 64]), rng.choice([8, 16, 30])
        bias, p, dims = rng.random() < 0.5, rng.randint(0, k - 1), 1 if one_d else 2
        shape = (n, ic, size) if one_d else (n, ic, size // 2 + k, size // 2 + k)
        x = torch.randn(*shape) if rng.random() < 0.7 else torch.randn(*reversed(shape)).permute(*reversed(range(len(shape))))
        w = torch.randn(oc, ic, *([k] * dims))
        conv = (x, w, torch.randn(oc) if bias else None, [s] * dims, [p] * dims, [1] * dims, False, [0] * dims, 1)
        y = aten.convolution.default(*conv)
        bwd = (torch.randn_like(y), x, w, [oc] if bias else None, *conv[3:], [s == 1 and rng.random() < 0.6, True, bias])
        real = _op_scratch(lambda: aten.convolution_backward.default(*bwd), ("aten::convolution_backward",))
        predicted = sum(sc.nbytes for sc in scratch(aten.convolution_backward.default, "cpu", bwd, {}, None))
        assert predicted > 0, (shape, k, s, p)
        assert real == [predicted], (torch.get_num_threads(), shape, x.is_contiguous(), k, s, p, bwd[-1])
