"""Depth reuse: a deep chain captured at depth 4 and widened is the full capture, exactly."""
from __future__ import annotations

import torch
import torch.nn as nn

import graphmem
from graphmem.capture.capture import capture
from graphmem.capture.reuse import blocks_alike, capture_reusing, signature
from graphmem.capture.target import make_target
from graphmem.chains import find_chain
from graphmem.models import gpt2, llama
from graphmem.passes import liveness, saved


def _both(model: nn.Module, x: tuple, loss: object, target: object = None) -> tuple:
    at = lambda: capture(model, x, loss, target or "cpu")  # noqa: E731
    widened, used, _ = capture_reusing(model, at)
    return widened, used, at()


def test_widened_gpt2_is_the_full_capture() -> None:
    # GIVEN a 16-block GPT-2 (dropout, explicit attention)
    model = gpt2.build(gpt2.GPTConfig(vocab_size=101, block_size=32, n_layer=16, n_head=2, n_embd=32,
                                      attention="explicit"))
    x = (torch.randint(0, 101, (2, 16)),)
    # WHEN it is captured with reuse and without
    widened, used, full = _both(model, x, gpt2.loss)
    # THEN reuse was taken and the graphs agree op for op, storage for storage, save for save
    assert used
    widened.check()
    assert signature(widened) == signature(full)
    a, b = liveness(widened), liveness(full)
    assert a.timeline == b.timeline and a.peak_bytes == b.peak_bytes
    assert saved(widened).activation_bytes == saved(full).activation_bytes
    assert [s.name for s in widened.storages.values()] == [s.name for s in full.storages.values()]
    assert widened.gradients == full.gradients
    assert [p.target for p in widened.placeholders] == [p.target for p in full.placeholders]


def test_widened_llama_on_the_cuda_target_counts_attention_kernels() -> None:
    model = llama.build(llama.LlamaConfig(vocab_size=101, dim=32, n_layers=17, n_heads=4, n_kv_heads=2,
                                          ffn_hidden=64, max_seq_len=32))
    x = (torch.randint(0, 101, (2, 16)),)
    target = make_target("cuda", "bf16", None, "auto", "h100")
    widened, used, full = _both(model, x, llama.loss, target)
    assert used and signature(widened) == signature(full)
    assert widened.attention_backends == full.attention_backends and sum(full.attention_backends.values()) == 17


def test_reports_are_equal_with_and_without_reuse() -> None:
    model = gpt2.build(gpt2.GPTConfig(vocab_size=101, block_size=32, n_layer=16, n_head=2, n_embd=32))
    x = (torch.randint(0, 101, (2, 16)),)
    a = graphmem.analyze(model, x, loss=gpt2.loss).to_dict()
    b = graphmem.analyze(model, x, loss=gpt2.loss, reuse=False).to_dict()
    assert a == b


class _Indexed(nn.Module):
    """A block that knows its index and does more at one of them (what reuse must not copy)."""

    def __init__(self, i: int) -> None:
        super().__init__()
        self.i = i
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.lin(x))
        return y * torch.sigmoid(y) if self.i == 11 else y


def test_blocks_that_differ_are_captured_whole() -> None:
    model = nn.Sequential(*[_Indexed(i) for i in range(18)])
    assert not blocks_alike(model, find_chain(model))
    widened, used, full = _both(model, (torch.randn(4, 16),), None)
    assert not used and signature(widened) == signature(full)


def test_short_chains_are_captured_whole() -> None:
    model = gpt2.build(gpt2.GPTConfig(vocab_size=101, block_size=32, n_layer=6, n_head=2, n_embd=32))
    _, used, _ = _both(model, (torch.randint(0, 101, (2, 16)),), gpt2.loss)
    assert not used
