"""LLaMA / Llama 2 / Llama 3 (Touvron et al. 2023; Meta Llama 3 model card).

Pre-norm decoder with RMSNorm, SwiGLU feed-forward, rotary position embeddings
and grouped-query attention. Self-contained: it imports only torch and the
standard library so it can be loaded directly by path as a model file.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class LlamaConfig:
    vocab_size: int = 32000
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None means n_heads (plain multi-head attention)
    ffn_hidden: int = 11008
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 4096
    attention: str = "sdpa"  # "sdpa" (fused kernel) or "explicit" (materialised scores)


# Published sizes: Touvron et al. 2023 ("Llama 2", Table 1) and Meta's params.json
# files for Llama 2; Meta's Llama 3 model card / params.json for llama-3-8b.
# ffn_hidden is the value Meta's reference code derives from multiple_of /
# ffn_dim_multiplier, written out directly here.
PRESETS: dict[str, LlamaConfig] = {
    "llama-2-7b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_hidden=11008),
    "llama-2-13b": LlamaConfig(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_hidden=13824),
    "llama-2-70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672),
    "llama-3-8b": LlamaConfig(
        vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
        ffn_hidden=14336, rope_theta=500000.0, max_seq_len=8192,
    ),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 for stability under bf16/fp16, then cast back (as Meta's reference).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (max_seq_len, head_dim) for rotate-half RoPE."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))  # (hd/2,)
    t = torch.arange(max_seq_len, dtype=torch.float32)  # (max_seq_len,)
    freqs = torch.outer(t, inv_freq)  # (max_seq_len, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (max_seq_len, hd)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (b, h, s, hd); cos/sin: (s, hd) broadcast over batch and heads.
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        n_kv = config.n_kv_heads or config.n_heads
        if config.dim % config.n_heads != 0:
            raise ValueError(f"dim={config.dim} is not divisible by n_heads={config.n_heads}")
        if config.n_heads % n_kv != 0:
            raise ValueError(f"n_heads={config.n_heads} is not divisible by n_kv_heads={n_kv}")
        if config.attention not in ("sdpa", "explicit"):
            raise ValueError(f"attention must be 'sdpa' or 'explicit', got {config.attention!r}")
        self.n_heads = config.n_heads
        self.n_kv_heads = n_kv
        self.head_dim = config.dim // config.n_heads
        self.attention = config.attention
        self.wq = nn.Linear(config.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, config.dim, bias=False)

    def _repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        # (b, kv, s, hd) -> (b, h, s, hd); query head i uses kv head i // n_rep.
        n_rep = self.n_heads // self.n_kv_heads
        if n_rep == 1:
            return x
        b, kv, s, hd = x.shape
        return x[:, :, None].expand(b, kv, n_rep, s, hd).reshape(b, kv * n_rep, s, hd)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # (b, s, dim)
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)  # (b, h, s, hd)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (b, kv, s, hd)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (b, kv, s, hd)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        k = self._repeat_kv(k)  # (b, h, s, hd)
        v = self._repeat_kv(v)  # (b, h, s, hd)

        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, h, s, hd)
        else:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # (b, h, s, s)
            # Mask depends only on the (static) sequence length, never on tensor values.
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()  # (s, s)
            scores = scores.masked_fill(~causal, float("-inf"))
            probs = F.softmax(scores.float(), dim=-1).type_as(q)  # (b, h, s, s), softmax in fp32
            y = probs @ v  # (b, h, s, hd)

        y = y.transpose(1, 2).contiguous().view(b, s, self.n_heads * self.head_dim)  # (b, s, dim)
        return self.wo(y)


class FeedForward(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_hidden, bias=False)  # gate
        self.w3 = nn.Linear(config.dim, config.ffn_hidden, bias=False)  # up
        self.w2 = nn.Linear(config.ffn_hidden, config.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # SwiGLU: (b, s, ffn) -> (b, s, dim)


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    rope_cos: torch.Tensor  # (max_seq_len, head_dim)
    rope_sin: torch.Tensor

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList([TransformerBlock(config) for _ in range(config.n_layers)])
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)  # untied, unlike GPT-2
        # One RoPE table shared by all layers; real tensors (no complex dtype) so every
        # backend and tensor subclass handles them. Non-persistent: derived, not learned.
        cos, sin = rope_tables(config.dim // config.n_heads, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq_len, hd)
        self.register_buffer("rope_sin", sin, persistent=False)  # (max_seq_len, hd)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # Meta's reference loads checkpoints and has no init; use a GPT-style normal(0, 0.02).
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape  # (b, s) token ids
        if s > self.config.max_seq_len:
            raise ValueError(f"sequence length {s} exceeds max_seq_len {self.config.max_seq_len}")
        h = self.tok_embeddings(tokens)  # (b, s, dim)
        cos = self.rope_cos[:s].to(h.dtype)  # (s, hd)
        sin = self.rope_sin[:s].to(h.dtype)  # (s, hd)
        for layer in self.layers:
            h = layer(h, cos, sin)
        h = self.norm(h)  # (b, s, dim)
        return self.output(h)  # (b, s, vocab)


def build(config: LlamaConfig) -> Transformer:
    return Transformer(config)


def model() -> Transformer:
    return Transformer(PRESETS["llama-2-7b"])


def example_inputs(shape: tuple[int, ...], config: LlamaConfig | None = None) -> tuple[torch.Tensor]:
    """Random token ids of `shape` (b, s) on the current default device."""
    vocab = (config or PRESETS["llama-2-7b"]).vocab_size
    return (torch.randint(0, vocab, tuple(shape), dtype=torch.long),)


def loss(output: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Next-token cross entropy: position t predicts token t + 1."""
    vocab = output.shape[-1]
    logits = output[:, :-1].reshape(-1, vocab)  # (b * (s - 1), vocab)
    targets = inputs[0][:, 1:].reshape(-1)  # (b * (s - 1),)
    return F.cross_entropy(logits, targets)
