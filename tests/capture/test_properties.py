"""Property: for a random small model built from common pieces, at random small shapes and
dtypes, graphmem's saved bytes and peak equal a real CPU step (graphmem/validation/measure.py).

Pieces act on a (b, s, d) tensor: Linear, Conv1d over the sequence, LayerNorm, activations
(in-place too), dropout, SDPA and hand-written attention, residual adds, views/transposes,
slices, cat, a scalar multiply; an Embedding may come first (token inputs). Bounded for CI
(few examples, derandomized); shrunk failures are kept below as named regression tests.

bf16: the saved bytes are exact; the peak may exceed the prediction by oneDNN's bf16 GEMM
scratch inside matmuls (no rule, docs/kernel-rules.md): bounded by 64 KiB at these sizes. With a
Conv1d, oneDNN's convolution scratch (no rule either; tens of KB even at these sizes): only
"never above the real peak" is asserted.
"""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphmem
from graphmem.validation.measure import measure_peak

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

PIECES = ("linear", "conv1d", "layernorm", "gelu", "relu_", "silu", "tanh", "dropout", "sdpa", "attention",
          "residual", "transpose", "slice", "cat", "scale")
# (a Python-number operand, x * 0.5, makes an 8 B wrapped-number tensor, and a 4 B cast of it,
# outside any op graphmem records; a saving op keeps it to its backward: the pieces multiply by
# tensors made in __init__ instead)


class Piece(nn.Module):
    def __init__(self, kind: str, d: int) -> None:
        super().__init__()
        self.kind, self.d = kind, d
        if kind == "linear":
            self.f = nn.Linear(d, d)
        elif kind == "conv1d":
            self.f = nn.Conv1d(d, d, 3, padding=1)
        elif kind == "layernorm":
            self.f = nn.LayerNorm(d)
        elif kind in ("sdpa", "attention"):
            self.qkv = nn.Linear(d, 3 * d)
            self.register_buffer("scale", torch.tensor(1 / math.sqrt(d // (2 if d % 2 == 0 else 1))))
        elif kind == "residual":
            self.f = nn.Sequential(nn.Linear(d, d), nn.GELU())
        elif kind == "cat":
            self.f = nn.Linear(2 * d, d)
        elif kind == "scale":
            self.register_buffer("factor", torch.full((d,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, b, s = self.kind, x.shape[0], x.shape[1]
        if k in ("linear", "layernorm"):
            return self.f(x)
        if k == "conv1d":
            return self.f(x.transpose(1, 2)).transpose(1, 2)
        if k == "gelu":
            return F.gelu(x)
        if k == "relu_":
            return F.relu(x.clone(), inplace=True)  # in place on a fresh tensor
        if k == "silu":
            return F.silu(x)
        if k == "tanh":
            return torch.tanh(x)
        if k == "dropout":
            return F.dropout(x, 0.25, self.training)
        if k in ("sdpa", "attention"):
            h = 2 if self.d % 2 == 0 else 1
            q, kk, v = self.qkv(x).view(b, s, 3, h, self.d // h).permute(2, 0, 3, 1, 4)
            if k == "sdpa":
                o = F.scaled_dot_product_attention(q, kk, v, is_causal=True)
            else:
                w = torch.softmax((q @ kk.transpose(-2, -1)) * self.scale, dim=-1)
                o = w @ v
            return o.transpose(1, 2).reshape(b, s, self.d)
        if k == "residual":
            return x + self.f(x)
        if k == "transpose":  # (s, b, d) from here on; the pieces take any two leading dims
            # (a strided gradient reaching gelu_backward makes the CPU kernel allocate one or two
            # input-sized temporaries that graphmem has no rule for, so the result is contiguous)
            return x.transpose(0, 1).contiguous()
        if k == "slice":
            return x[:, 1:] if s > 2 else x
        if k == "strided":  # a strided (b, s, d) view: kernels that need dense inputs copy it
            return x.transpose(0, 1).contiguous().transpose(0, 1)
        if k == "cat":
            return self.f(torch.cat([x, x.flip(1)], dim=-1))
        if k == "scale":
            return x * self.factor
        raise AssertionError(k)


class Net(nn.Module):
    def __init__(self, kinds: list[str], d: int, vocab: int = 0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d) if vocab else None
        self.pieces = nn.ModuleList(Piece(k, d) for k in kinds)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for p in self.pieces:
            x = p(x)
        return x


def _build(kinds: list[str], b: int, s: int, d: int, tokens: bool, dtype: torch.dtype) -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    net = Net(kinds, d, vocab=11 if tokens else 0).to(dtype)
    x = torch.randint(0, 11, (b, s)) if tokens else torch.randn(b, s, d, dtype=dtype, requires_grad=True)
    return net, (x,)


def square_loss(out: torch.Tensor, inputs: tuple) -> torch.Tensor:
    """A dense output gradient: ``sum()``'s is an expanded (stride-0) tensor, for which some CPU
    elementwise backward kernels (gelu_backward, ...) allocate an output-sized temporary that
    graphmem has no rule for (tests/capture/test_ground_truth.py uses the same loss for blocks)."""
    return (out.float() * out.float()).sum()


def check(kinds: list[str], b: int, s: int, d: int, tokens: bool = False, dtype: torch.dtype = torch.float32) -> None:
    net, inputs = _build(kinds, b, s, d, tokens, dtype)
    report = graphmem.analyze(net, inputs, loss=square_loss)
    report.step.check()
    real = measure_peak(net, inputs, square_loss)
    assert report.activation_bytes == real.saved_bytes, (kinds, b, s, d, tokens, dtype)
    gap = real.peak_bytes - report.peak_bytes
    if "conv1d" in kinds:  # oneDNN's convolution scratch has no rule (27 KB for a (2, 4, 3) Conv1d here)
        assert 0 <= gap, (kinds, b, s, d, tokens, dtype, report.peak_bytes, real.peak_bytes)
    elif dtype == torch.float32:
        assert gap == 0, (kinds, b, s, d, tokens, report.peak_bytes, real.peak_bytes)
    else:
        assert 0 <= gap <= 64 * 1024, (kinds, b, s, d, tokens, dtype, report.peak_bytes, real.peak_bytes)


@hypothesis.settings(max_examples=12, deadline=None, derandomize=True, database=None,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(kinds=st.lists(st.sampled_from(PIECES), min_size=1, max_size=5),
                  b=st.integers(1, 3), s=st.integers(3, 9), d=st.sampled_from([4, 6, 8, 16]),
                  tokens=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_random_models_match_a_real_cpu_step(kinds: list[str], b: int, s: int, d: int, tokens: bool,
                                             dtype: torch.dtype) -> None:
    check(kinds, b, s, d, tokens, dtype)


# -- shrunk failures, kept as regression tests -----------------------------------------------------
REGRESSIONS: dict[str, dict[str, Any]] = {
    # oneDNN's convolution scratch: 27 KB real, none predicted; the prediction stays below
    "conv1d_scratch_never_above_real": dict(kinds=["conv1d"], b=2, s=3, d=4),
    # a strided LayerNorm input: layer_norm_cpu / layer_norm_backward_cpu copy it dense
    "layernorm_of_a_strided_input": dict(kinds=["strided", "layernorm"], b=2, s=3, d=4),
    # a strided output gradient into the embedding: embedding_dense_backward_cpu copies it dense
    "embedding_gradient_strided": dict(kinds=["strided"], b=2, s=3, d=4, tokens=True),
    # in-place activation on a fresh tensor, and bf16
    "relu_inplace": dict(kinds=["relu_"], b=1, s=3, d=4),
    "bf16_attention_residual": dict(kinds=["attention", "residual"], b=2, s=5, d=8, dtype=torch.bfloat16),
}


@pytest.mark.parametrize("name", list(REGRESSIONS))
def test_regression(name: str) -> None:
    check(**REGRESSIONS[name])
