"""alpha/beta/gamma as what one more block costs (the whole step at L+1 blocks minus at L;
DESIGN.md), reproducing Korthikanti et al. 2022, Table 2 (no parallelism): a pre-LN transformer
block in 16-bit with dropout and explicit softmax attention saves 34·sbh + 5·as²b bytes.

Table 2 counts, per layer (bytes): attention 11·sbh + 5·as²b (LN output 2, Q and K 4, V 2,
softmax output 2·as²b, its dropout mask as²b, dropped probabilities 2·as²b, the output
projection's input 2, its dropout mask 1), MLP 19·sbh (LN output 2, GeLU input 8, second
linear's input 8, dropout mask 1), the two LayerNorms' inputs 4·sbh: 34·sbh + 5·as²b. On the
CUDA target graphmem also sees what the table leaves out: LayerNorm's mean and rstd, kept in fp32
by CUDA's kernel (2 LayerNorms x 8 B = 16 B a token: gamma), and the (s, s) causal mask sliced
from a bool buffer (1 B per s², independent of b: ``rest``).

Where the residual adds live does not matter for the marginal cost; it does for the per-module
table (which stays module attribution): with the adds in the parent's loop, the residual stream
belongs to no block, and the former per-module split gave no formula at all there (its block
polynomial missed the stream, and the held-out captures refused the extrapolation).
"""
from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphmem

B, S, D, A, L = 4, 16, 32, 2, 4


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.attn_drop = nn.Dropout(0.1)
        self.register_buffer("mask", torch.ones(64, 64, dtype=torch.bool).tril(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, A, D // A).permute(2, 0, 3, 1, 4)  # 3 x (b, a, s, hd)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(D // A)  # (b, a, s, s)
        scores = scores.masked_fill(~self.mask[:s, :s], float("-inf"))
        probs = self.attn_drop(F.softmax(scores, dim=-1))
        return self.proj((probs @ v).transpose(1, 2).reshape(b, s, D))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Megatron's pre-LN layer: x + dropout(attn(ln1(x))), then + dropout(mlp(ln2(.)))."""

    def __init__(self, residual_inside: bool) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(D), Attention(), nn.LayerNorm(D), MLP()
        self.drop1, self.drop2 = nn.Dropout(0.1), nn.Dropout(0.1)
        self.residual_inside = residual_inside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.residual_inside:  # the block returns its update; the parent adds it to the stream
            h = self.drop1(self.attn(self.ln1(x)))
            return h + self.drop2(self.mlp(self.ln2(x + h)))
        x = x + self.drop1(self.attn(self.ln1(x)))
        return x + self.drop2(self.mlp(self.ln2(x)))


class Model(nn.Module):
    def __init__(self, residual_inside: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(101, D)
        self.blocks = nn.ModuleList(Block(residual_inside) for _ in range(L))
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, 101)
        self.residual_inside = residual_inside

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk(x) if self.residual_inside else x + blk(x)
        return self.head(self.ln_f(x))


def loss(out: torch.Tensor, inputs: tuple) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1).float(), inputs[0].flatten())


@pytest.mark.parametrize("residual_inside", [True, False])
def test_megatron_block_fp16_cuda_alpha_34_beta_5(residual_inside: bool) -> None:
    with torch.device("meta"):
        model = Model(residual_inside)
    report = graphmem.analyze(model, input_shape=(B, S), loss=loss, device="cuda", dtype="fp16")
    c = report.coefficients
    assert (c.d_model, c.n_heads, c.blocks) == (D, A, L)
    assert c.alpha == 34 and c.beta == 5
    assert c.gamma == 2 * (4 + 4)  # two LayerNorms' fp32 mean and rstd (CUDA's accumulation type)
    if residual_inside:
        assert c.split.rest == {"s**2": 1}  # the causal mask, 1 B per s**2
    # the marginal cost, checked directly: one more block adds exactly what alpha/beta/gamma say
    per_block = 34 * B * S * D + 5 * A * S * S * B + 16 * B * S + c.split.rest.get("s**2", 0) * S * S
    act = c.activation_at((B, S))
    with torch.device("meta"):
        deeper = Model(residual_inside)
        deeper.blocks.append(Block(residual_inside))
    more = graphmem.analyze(deeper, input_shape=(B, S), loss=loss, device="cuda", dtype="fp16")
    assert more.activation_bytes - act == per_block
    # the per-module table is module attribution, unchanged: with the adds in the parent, the
    # residual stream (2·sbh per add, saved by the next LayerNorm) is not inside any block
    block1 = next(m for m in report.modules if m.path == "blocks.1")
    assert (block1.activation_bytes == per_block) == residual_inside


def _rank_activations(model: nn.Module, tp: int, sp: bool) -> int:
    report = graphmem.analyze(model, input_shape=(B, S), loss=loss, device="cuda", dtype="fp16", world_size=tp, tp=tp, sp=sp)
    return next(r.size for r in report.budget.rank.rows if r.name == "activations")


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_megatron_block_per_rank_table2_rows(sp: bool) -> None:
    """Korthikanti et al. 2022, Table 2, per rank at t = 2: tensor parallel sbh(10 + 24/t + 5as/(ht))
    (LayerNorm inputs and outputs and the two dropout masks stay whole: 10; the rest is split),
    tensor + sequence parallel sbh/t·(34 + 5as/h). gamma (LayerNorm's fp32 mean and rstd) is whole
    under TP and split with SP; the causal mask (a bool buffer slice) stays whole on every rank."""
    t = 2
    with torch.device("meta"):
        model = Model(True)
    report = graphmem.analyze(model, input_shape=(B, S), loss=loss, device="cuda", dtype="fp16", world_size=t, tp=t, sp=sp)
    c = report.coefficients
    assert "tensor parallel 2" in c.per_rank and ("sequence parallel" in c.per_rank) == sp
    alpha, gamma = (Fraction(34, t), Fraction(16, t)) if sp else (10 + Fraction(24, t), Fraction(16))
    assert (c.alpha, c.beta, c.gamma) == (alpha, Fraction(5, t), gamma)
    assert c.split.rest == {"s**2": 1}
    # the marginal cost per rank, checked directly: one more block adds what the row says
    per_block = alpha * B * S * D + Fraction(5, t) * A * S * S * B + gamma * B * S + S * S
    with torch.device("meta"):
        deeper = Model(True)
        deeper.blocks.append(Block(True))
    assert _rank_activations(deeper, t, sp) - _rank_activations(model, t, sp) == per_block
    assert c.activation_at((B, S)) == _rank_activations(model, t, sp)
