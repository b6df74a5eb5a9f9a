"""Depth reuse for a step with a checkpoint plan applied (graphmem/capture/reuse_units.py): the plan's
longest run of alike units (a checkpointed segment, or a stored block) captured cut to 5 units, checked
at 6 and widened, is the full capture op for op, storage for storage, save for save (``signature``), on
transformers' Llama with LoRA on the CUDA target and the bundled Llama and GPT-2; a plan with no run long
enough, or one whose widened capture differs from the check, is captured whole and says why."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

import graphmem
from graphmem.capture.capture import capture
from graphmem.capture.reuse import signature
from graphmem.capture.reuse_units import capture_units, layout_for
from graphmem.capture.widen_units import Layout, block_copies
from graphmem.chains import find_chain
from graphmem.models import gpt2, llama
from graphmem.planning.apply import apply_segments, plan_units
from graphmem.planning.verify import plan_graph


def _singles(a: int, n: int) -> list[tuple[int, int]]:
    return [(i, i) for i in range(a, n)]


def _both(model: nn.Module, x: tuple, loss: Any, segments: list[tuple[int, int]], target: Any = "cpu") -> tuple:
    chain = find_chain(model)
    assert chain is not None
    at = lambda: capture(model, x, loss, target)  # noqa: E731
    with apply_segments(model, chain.path, segments):
        sizes, kinds = plan_units(chain.length, segments)
        reused = capture_units(model, chain.path, sizes, kinds, at)
        return reused, at()


def test_layout_of_blocks_is_reuses_scheme() -> None:
    # GIVEN a chain of one-block units captured with 5 and widened to 20: the scheme of graphmem/capture/reuse.py
    lay = Layout.blocks(5, 20)
    assert [lay.copies(j) for j in range(5)] == [block_copies(j, 5, 20) for j in range(5)]
    assert [lay.template(b) for b in range(20)] == [0, 1] + [2] * 16 + [3, 4]
    # AND a plan's units: 2 stored blocks, then 10 segments of 2 blocks, then 1 stored block, the run cut to 5
    lay = Layout((1, 1) + (2,) * 10 + (1,), 2, 10, 5)
    assert lay.k == 8 and lay.captured_blocks() == [*range(12), 22]
    assert [lay.unit_of(i) for i in range(13)] == [0, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7]
    assert lay.copies(4) == list(range(4, 10)) and lay.copies(7) == [12] and lay.template(9) == 4
    assert lay.rename("h.5.attn", "h.", 3, 11) == "h.21.attn"  # block 5 is unit 3's second: unit 11's is block 21
    for b in range(lay.n):  # every unit copies a captured unit that becomes it
        assert b in lay.copies(lay.template(b))


def test_every_block_checkpointed_hf_llama_lora_cuda_is_the_full_capture() -> None:
    # GIVEN transformers' Llama, 18 layers, LoRA on every linear layer, AdamW, the CUDA target
    model, options = _hf_llama(18)
    report = graphmem.analyze(model, device="cuda", gpu="l4", optimizer="adamw", lora_rank=4, lora_targets="all-linear",
                              **options)
    chain = find_chain(report.source.module)
    assert chain is not None
    segments = _singles(0, 18)
    # WHEN the step with every layer checkpointed is captured with reuse, and whole
    reused = plan_graph(report.source, chain.path, segments)
    with apply_segments(report.source.module, chain.path, segments):
        full = report.source.capture()
    # THEN reuse was taken and the graphs agree, SDPA calls (recomputes included) counted alike
    assert reused.used, reused.why
    reused.graph.check()
    assert signature(reused.graph) == signature(full)
    assert reused.graph.attention_backends == full.attention_backends


def test_stored_blocks_then_checkpointed_bundled_llama_is_the_full_capture() -> None:
    # GIVEN the bundled Llama, 20 layers, its first 3 stored and every later one checkpointed (two kinds of unit)
    model = llama.build(llama.LlamaConfig(vocab_size=101, dim=32, n_layers=20, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                                          max_seq_len=32))
    x = (torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(1)),)
    reused, full = _both(model, x, llama.loss, _singles(3, 20))
    assert reused.used, reused.why
    assert signature(reused.graph) == signature(full)


def test_segments_of_two_blocks_bundled_gpt2_is_the_full_capture() -> None:
    # GIVEN the bundled GPT-2 (dropout: the CPU RNG states checkpoint stashes), 32 blocks in segments of 2
    model = gpt2.build(gpt2.GPTConfig(vocab_size=101, block_size=32, n_layer=32, n_head=2, n_embd=32))
    x = (torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(1)),)
    reused, full = _both(model, x, gpt2.loss, [(i, i + 1) for i in range(0, 32, 2)])
    assert reused.used, reused.why
    assert signature(reused.graph) == signature(full)


def test_a_plan_without_a_long_run_is_captured_whole() -> None:
    # GIVEN irregular segments, and segments of 4 blocks on 32 (8 units: the captures at 5 and 6 hold 44 blocks)
    assert "too short" in str(layout_for(*plan_units(32, [(1, 3), (4, 6), (10, 12), (20, 20)])))
    assert "too short" in str(layout_for(*plan_units(32, [(a, a + 3) for a in range(0, 32, 4)])))
    assert isinstance(layout_for(*plan_units(32, _singles(4, 32))), Layout)
    model = llama.build(llama.LlamaConfig(vocab_size=101, dim=32, n_layers=16, n_heads=4, ffn_hidden=64, max_seq_len=32))
    x = (torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(1)),)
    # WHEN such a plan is captured: THEN whole, saying why, and the same as without reuse
    reused, full = _both(model, x, llama.loss, [(1, 3), (4, 6), (10, 12)])
    assert not reused.used and "too short" in reused.why
    assert signature(reused.graph) == signature(full)


class _Doubling(nn.Module):
    """A chain whose parent scales the activation after its fourth block: the check at 6 units sees the
    widened step put that after the wrong block."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, blk in enumerate(self.blocks):
            x = blk(x)
            if i == 3:
                x = x * 2
        return x


def test_a_widened_capture_that_differs_from_the_check_is_captured_whole() -> None:
    with torch.device("meta"):
        model = _Doubling(20)
    reused, full = _both(model, (torch.randn(4, 8),), None, _singles(0, 20))
    assert not reused.used and reused.why == "the widened graph differs from the capture"
    assert signature(reused.graph) == signature(full)


def _hf_llama(n: int) -> tuple[nn.Module, dict]:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=n,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model, {"input_shape": "2x32"}


def test_selective_segments_bundled_llama_is_the_full_capture() -> None:
    # GIVEN the bundled Llama, 18 layers, each its own segment under one selective policy (matmuls kept)
    from graphmem.planning.selective import OpPolicy

    model = llama.build(llama.LlamaConfig(vocab_size=101, dim=32, n_layers=18, n_heads=4, ffn_hidden=64, max_seq_len=32))
    x = (torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(1)),)
    policy = OpPolicy(frozenset({("aten.mm.default", 0), ("aten.mm.default", 1)}), "matmuls")
    chain = find_chain(model)
    assert chain is not None
    segments = _singles(0, 18)
    at = lambda: capture(model, x, llama.loss, "cpu")  # noqa: E731
    with apply_segments(model, chain.path, segments, [policy] * 18):
        reused = capture_units(model, chain.path, *plan_units(18, segments, [policy] * 18), at)
        full = at()
    assert reused.used, reused.why
    assert signature(reused.graph) == signature(full)
