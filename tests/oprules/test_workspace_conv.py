"""oneDNN's depthwise convolution scratch (graphmem/oprules/conv.py) against real CPU kernels
and real steps: the per-op rule to the byte over random shapes, and whole models whose peak it decides."""
from __future__ import annotations

import random

import pytest
import torch
from conftest import torch_settings
from test_workspace import _op_scratch

import graphmem
from graphmem.oprules import scratch
from graphmem.validation.measure import measure_peak

aten = torch.ops.aten


def _case(rng: random.Random) -> tuple:
    c = rng.choice([16, 24, 40, 64, 96])
    kh = kw = rng.choice([2, 3, 4, 5, 7, 9, 11])
    dil, stride = 1, rng.choice([1, 2])
    n, h = rng.choice([1, 2, 3]), rng.choice([5, 8, 13])
    mask = rng.choice([[True, True, True], [False, True, False], [True, False, False], [True, True, False]])
    return c, kh, kw, dil, stride, n, h, mask


@pytest.mark.parametrize("seed", range(3))
def test_depthwise_channels_last_scratch_equals_real_kernel(seed: int) -> None:
    """12 random channels-last fp32 depthwise convolutions per seed: the forward's and the backward's
    bytes beside their outputs, read from the CPU allocator's events, equal the rule's."""
    rng = random.Random(seed)
    for _ in range(12):
        c, kh, kw, dil, stride, n, h, mask = _case(rng)
        x = torch.randn(n, c, h, h).contiguous(memory_format=torch.channels_last)
        w, b = torch.randn(c, 1, kh, kw), torch.randn(c)
        conv = (x, w, b, [stride] * 2, [kh // 2 * dil, kw // 2 * dil], [dil] * 2, False, [0, 0], c)
        y = aten.convolution.default(*conv)
        bwd = (torch.randn_like(y), x, w, [c], *conv[3:], mask)
        for op, args, out in ((aten.convolution.default, conv, y), (aten.convolution_backward.default, bwd, None)):
            real = _op_scratch(lambda: op(*args), (op.name(),))
            predicted = sum(s.nbytes for s in scratch(op, "cpu", args, {}, out))
            assert real == [predicted], (op, c, kh, kw, dil, stride, n, h, mask)


def test_rule_leaves_other_convolutions_alone() -> None:
    """Contiguous, grouped-but-not-depthwise, bf16, dilated, non-square and narrow (< 16 channels)
    convolutions take other oneDNN paths or were not measured to the byte: no rule, the note stays."""
    x = torch.randn(2, 16, 8, 8)
    cl = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(16, 1, 7, 7)
    cases = [(x, w, 16, 1), (cl, torch.randn(16, 4, 3, 3), 4, 1), (cl, w, 16, 2), (cl, torch.randn(16, 1, 7, 1), 16, 1),
             (cl.to(torch.bfloat16), w.to(torch.bfloat16), 16, 1), (cl[:, :8], torch.randn(8, 1, 7, 7), 8, 1)]
    for inp, weight, groups, dil in cases:
        args = (inp, weight, None, [1, 1], [1, 1], [dil, dil], False, [0, 0], groups)
        assert scratch(aten.convolution.default, "cpu", args, {}, None) == []


def _channels_last_mobilenet() -> tuple:
    models = pytest.importorskip("torchvision.models")
    torch.manual_seed(0)
    model = models.mobilenet_v3_small(num_classes=10).to(memory_format=torch.channels_last)
    return model, (torch.randn(2, 3, 32, 32).contiguous(memory_format=torch.channels_last),)


def _convnextv2() -> tuple:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return timm.create_model("convnextv2_atto", num_classes=10), (torch.randn(3, 3, 48, 48),)


@pytest.mark.slow
@pytest.mark.parametrize("build", [_channels_last_mobilenet, _convnextv2], ids=["mobilenet_v3_cl", "convnextv2"])
def test_depthwise_models_peak_equals_real_step(build: object) -> None:
    """MobileNetV3 in channels-last (3x3 and 5x5 depthwise) and ConvNeXt-V2 (7x7, 48 px, batch 3):
    the peak, decided by a depthwise weight gradient, equals the real CPU step's to the byte."""
    model, inputs = build()  # type: ignore[operator]
    # two threads, as these were derived and checked: with one thread (one pytest-xdist worker a core),
    # ConvNeXt-V2's real peak is 316,064 B above graphmem's (31,495,616 against 31,179,552 B), a
    # one-thread path of oneDNN's depthwise weight gradient not modelled yet (docs/validation.md)
    with torch_settings(num_threads=2):
        report = graphmem.analyze(model, inputs)
        real = measure_peak(model, inputs)
    assert report.activation_bytes == real.saved_bytes
    assert report.peak_bytes == real.peak_bytes
