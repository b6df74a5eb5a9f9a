"""Models and building blocks used by the ground-truth tests: small shapes, real CPU runs.

Each case is built fresh (seeded) and returns (module, inputs, loss or None).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from graphmem.models import gpt2, llama, mlp, resnet

Case = tuple[nn.Module, tuple, Optional[Callable[[Any, tuple], torch.Tensor]]]


class SelfAttention(nn.Module):
    """nn.MultiheadAttention used as self-attention (it takes query, key, value)."""

    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(d, heads, dropout=dropout, batch_first=True)

    def forward(self, x: torch.Tensor) -> Any:
        return self.mha(x, x, x)


class SDPA(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float, causal: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.heads, self.dropout, self.causal = heads, dropout, causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)  # (b, h, s, hd)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout, is_causal=self.causal)


class InPlace(nn.Module):
    """`x += y`, views and an in-place activation on a view: all resolve to base storages."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        y += self.b(x)
        z = y.view(-1, 8, 4).transpose(1, 2)
        return torch.tanh(z).sum(-1)


def _ce(output: torch.Tensor, inputs: tuple) -> torch.Tensor:
    return F.cross_entropy(output, torch.zeros(output.shape[0], dtype=torch.long))


def square_loss(output: Any, inputs: tuple) -> torch.Tensor:
    """Sum of squares of every floating output: its gradient is dense, unlike `sum()`'s stride-0
    expand, which makes some CPU kernels copy it into scratch that no aten op owns."""
    from graphmem.training.step import _floating_tensors

    parts = [(t * t).sum() for t in _floating_tensors(output) if t.requires_grad]
    return torch.stack(parts).sum()


def _grad_input(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=True)


BLOCKS: dict[str, Callable[[], Case]] = {
    "conv_bn_relu_inplace": lambda: (nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True)),
                                     (torch.randn(4, 8, 32, 32),), square_loss),
    "lstm": lambda: (nn.LSTM(16, 32, num_layers=2, batch_first=True), (torch.randn(4, 10, 16),), square_loss),
    "multihead_attention": lambda: (SelfAttention(32, 4, 0.1), (torch.randn(4, 10, 32),), square_loss),
    "embedding": lambda: (nn.Embedding(100, 16), (torch.randint(0, 100, (4, 10)),), square_loss),
    "layernorm": lambda: (nn.LayerNorm(32), (_grad_input(4, 10, 32),), square_loss),
    "gelu": lambda: (nn.GELU(), (_grad_input(4, 10, 32),), square_loss),
    "dropout": lambda: (nn.Dropout(0.3), (_grad_input(4, 10, 32),), square_loss),
    "sdpa_causal": lambda: (SDPA(32, 4, 0.0, True), (torch.randn(2, 16, 32),), square_loss),
    "sdpa_dropout": lambda: (SDPA(32, 4, 0.1, False), (torch.randn(2, 16, 32),), square_loss),
    "cross_entropy": lambda: (nn.Linear(32, 10), (torch.randn(8, 32),), _ce),
    "inplace_add_views": lambda: (InPlace(), (torch.randn(4, 16),), square_loss),
}

_GPT = dict(vocab_size=101, block_size=32, n_layer=2, n_head=2, n_embd=32)
_LLAMA = dict(vocab_size=101, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=32)
_tokens = lambda: (torch.randint(0, 101, (2, 16)),)  # noqa: E731

MODELS: dict[str, Callable[[], Case]] = {
    "gpt2_explicit": lambda: (gpt2.build(gpt2.GPTConfig(**_GPT, attention="explicit")), _tokens(), gpt2.loss),
    "gpt2_sdpa": lambda: (gpt2.build(gpt2.GPTConfig(**_GPT, attention="sdpa")), _tokens(), gpt2.loss),
    "llama_sdpa": lambda: (llama.build(llama.LlamaConfig(**_LLAMA, attention="sdpa")), _tokens(), llama.loss),
    "llama_explicit": lambda: (llama.build(llama.LlamaConfig(**_LLAMA, attention="explicit")), _tokens(), llama.loss),
    "mlp": lambda: (mlp.build(mlp.MLPConfig(in_features=64, hidden=(128, 128), out_features=10, activation="gelu",
                                             dropout=0.1, layernorm=True)), (torch.randn(4, 64),), mlp.loss),
    "resnet_small": lambda: (resnet.build(resnet.ResNetConfig(width=8)), (torch.randn(2, 3, 32, 32),), resnet.loss),
    "resnet_bottleneck": lambda: (resnet.build(resnet.ResNetConfig(block="bottleneck", layers=(1, 1, 1, 1), width=8)),
                                  (torch.randn(2, 3, 32, 32),), resnet.loss),
}


def tiny_gpt(n_layer: int = 2, attention: str = "sdpa", dropout: float = 0.0, block_size: int = 32) -> nn.Module:
    """The tiny GPT-2 the tests share (vocab 101, 2 heads, d_model 32), seeded."""
    torch.manual_seed(0)
    return gpt2.build(gpt2.GPTConfig(vocab_size=101, block_size=block_size, n_layer=n_layer, n_head=2, n_embd=32,
                                     attention=attention, dropout=dropout))


def tokens(b: int = 2, s: int = 16) -> tuple[torch.Tensor]:
    return (torch.randint(0, 101, (b, s)),)


def build(table: dict[str, Callable[[], Case]], name: str) -> Case:
    torch.manual_seed(0)
    return table[name]()
