"""Compiled mode on the CUDA target: the CUDA rules (SDPA backend ops, fused dropout's bool mask,
LayerNorm's fp32 statistics) hold in the graphs AOTAutograd partitions.

No GPU here, so the check is against the eager CUDA-target rules (themselves checked in
tests/test_targets.py), op by op, where the two must agree: models the partitioner recomputes
nothing in, whose compiled saved set is then the eager one tensor for tensor.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from cases import MODELS, build

import graphmem
from graphmem import cli
from graphmem.errors import UsageError
from graphmem.models import mlp


class Block(nn.Module):
    """LayerNorm, qkv, SDPA (causal), projection, dropout."""

    def __init__(self, d: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.ln, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.drop, self.heads = nn.Dropout(0.1), heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, h, s, hd)
        return self.drop(self.proj(y.transpose(1, 2).reshape(b, s, d)))


def _saved(report: graphmem.Report) -> Counter:
    return Counter((t.op, t.shape, t.dtype, t.bytes) for t in report.saved)


@pytest.mark.parametrize("options,backend", [({"dtype": "bf16"}, "flash"), ({"dtype": "bf16", "attention": "efficient"},
                                             "efficient"), ({"dtype": "bf16", "attention": "math"}, "math"),
                                            ({}, "efficient")])
def test_compiled_saved_set_is_the_eager_cuda_rules(options: dict, backend: str) -> None:
    torch.manual_seed(0)
    module, inputs = Block(), (torch.randn(2, 32, 64),)
    eager = graphmem.analyze(module, inputs, device="cuda", **options)
    compiled = graphmem.analyze(module, inputs, device="cuda", mode="compiled", **options)
    compiled.step.check()
    assert compiled.compiled.recomputed == ()  # nothing recomputed: the two saved sets must coincide
    assert _saved(compiled) == _saved(eager)
    assert compiled.activation_bytes == eager.activation_bytes == compiled.compiled.eager_bytes
    assert compiled.attention_backends == eager.attention_backends == {backend: 1}
    ops = {t.op for t in compiled.saved}
    assert "aten.native_dropout.default" in ops  # CUDA's fused dropout: a bool mask
    stats = [t for t in compiled.saved if t.op == "aten.native_layer_norm.default" and t.shape == (2, 32, 1)]
    assert stats and all(t.dtype == "float32" for t in stats)  # fp32 mean/rstd, as CUDA's kernel keeps


def test_bundled_gpt2_flash_bf16_matches_eager_cuda() -> None:
    module, inputs, loss = build(MODELS, "gpt2_sdpa")
    eager = graphmem.analyze(module, inputs, loss=loss, device="cuda", dtype="bf16")
    compiled = graphmem.analyze(module, inputs, loss=loss, device="cuda", dtype="bf16", mode="compiled")
    assert compiled.compiled.recomputed == ()
    assert _saved(compiled) == _saved(eager)
    assert compiled.attention_backends == eager.attention_backends and "flash" in compiled.attention_backends
    assert "aten._scaled_dot_product_flash_attention.default" in {t.op for t in compiled.saved}


def test_compiled_cuda_with_amp_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(UsageError, match="autocast"):
        graphmem.analyze(nn.Linear(4, 4), (torch.randn(2, 4),), mode="compiled", device="cuda", amp="bf16")
    assert cli.main(["analyze", mlp.__file__, "--input-shape", "4x784", "--mode", "compiled", "--device", "cuda",
                     "--amp", "bf16"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--amp" in err
