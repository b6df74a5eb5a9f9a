"""GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners").

A compact decoder-only transformer in the style of nanoGPT. Self-contained: it
imports only torch and the standard library so it can be loaded directly by
path as a model file.
"""

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 50257
    block_size: int = 1024  # maximum sequence length (size of the position table)
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.1
    bias: bool = True  # bias in Linear and LayerNorm layers, as in the original GPT-2
    attention: str = "sdpa"  # "sdpa" (fused kernel) or "explicit" (materialised scores)


# Published sizes: Radford et al. 2019, Table 2, and the Hugging Face
# gpt2 / gpt2-medium / gpt2-large / gpt2-xl config.json files.
PRESETS: dict[str, GPTConfig] = {
    "gpt2": GPTConfig(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": GPTConfig(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": GPTConfig(n_layer=48, n_head=25, n_embd=1600),
}


class CausalSelfAttention(nn.Module):
    mask: torch.Tensor  # (1, 1, block_size, block_size) bool, explicit attention only

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head != 0:
            raise ValueError(f"n_embd={config.n_embd} is not divisible by n_head={config.n_head}")
        if config.attention not in ("sdpa", "explicit"):
            raise ValueError(f"attention must be 'sdpa' or 'explicit', got {config.attention!r}")
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.attention = config.attention
        # q, k and v projections fused into one matmul, as in the original checkpoint layout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        if self.attention == "explicit":
            # Only the explicit path needs a mask; non-persistent so it never enters state_dict.
            mask = torch.ones(config.block_size, config.block_size, dtype=torch.bool).tril()
            self.register_buffer("mask", mask.view(1, 1, config.block_size, config.block_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # (b, s, d)
        hd = self.n_embd // self.n_head  # n_head, n_embd: this rank's share under tensor parallel
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 x (b, s, d)
        q = q.view(b, s, self.n_head, hd).transpose(1, 2)  # (b, h, s, hd)
        k = k.view(b, s, self.n_head, hd).transpose(1, 2)  # (b, h, s, hd)
        v = v.view(b, s, self.n_head, hd).transpose(1, 2)  # (b, h, s, hd)

        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
            )  # (b, h, s, hd)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))  # (b, h, s, s)
            att = att.masked_fill(~self.mask[:, :, :s, :s], float("-inf"))  # (b, h, s, s)
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v  # (b, h, s, hd)

        y = y.transpose(1, 2).contiguous().view(b, s, self.n_embd)  # (b, s, d)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2 used the tanh approximation
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gelu(self.c_fc(x))  # (b, s, 4d)
        return self.dropout(self.c_proj(x))  # (b, s, d)


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Pre-LN residuals (GPT-2 moved LayerNorm to the input of each sub-block).
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    transformer: Any  # ModuleDict(wte, wpe, drop, h, ln_f): the names of HF's GPT-2

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying: the input embedding and output projection share one tensor.
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        # GPT-2 paper: scale residual-path projections by 1/sqrt(number of residual layers).
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # nn.init works on meta/fake tensors too (it simply does nothing to real data).
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, s = idx.shape  # (b, s) token ids
        if s > self.config.block_size:
            raise ValueError(
                f"sequence length {s} exceeds block_size {self.config.block_size}"
            )
        pos = torch.arange(s, dtype=torch.long, device=idx.device)  # (s,)
        tok_emb = self.transformer.wte(idx)  # (b, s, d)
        pos_emb = self.transformer.wpe(pos)  # (s, d), broadcast over the batch
        x = self.transformer.drop(tok_emb + pos_emb)  # (b, s, d)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)  # (b, s, d)
        return self.lm_head(x)  # (b, s, vocab)


def build(config: GPTConfig) -> GPT:
    return GPT(config)


def model() -> GPT:
    return GPT(PRESETS["gpt2"])


def example_inputs(shape: tuple[int, ...], config: GPTConfig | None = None) -> tuple[torch.Tensor]:
    """Random token ids of `shape` (b, s) on the current default device."""
    vocab = (config or PRESETS["gpt2"]).vocab_size
    return (torch.randint(0, vocab, tuple(shape), dtype=torch.long),)


def loss(output: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Next-token cross entropy: position t predicts token t + 1."""
    vocab = output.shape[-1]
    logits = output[:, :-1].reshape(-1, vocab)  # (b * (s - 1), vocab)
    targets = inputs[0][:, 1:].reshape(-1)  # (b * (s - 1),)
    return F.cross_entropy(logits, targets)
