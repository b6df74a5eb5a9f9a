"""Depth reuse in compiled mode: a chain of >= 16 identical blocks compiled once at depth 6 (budget
1: the partition is made block by block; graphmem/capture/reuse_compiled.py) or at depth 5 and 6
(budget 0.8; graphmem/capture/reuse.py) (torch.compile's step: dynamo, AOTAutograd, the min-cut
partitioner), widened to full depth, is the full compiled capture exactly; where the partition
may not repeat block by block (a memory budget whose knapsack weighs the whole step, a block
compiled differently), every block is compiled, with a note."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphmem
from graphmem.capture.capture import capture
from graphmem.capture.compiled import CompiledStep
from graphmem.capture.reuse import compiled_signature, signature
from graphmem.capture.reuse_compiled import compiled_reusing
from graphmem.capture.target import make_target
from graphmem.capture.widen import widen
from graphmem.chains import find_chain, truncated
from graphmem.models import gpt2, llama
from graphmem.passes import liveness, saved
from graphmem.passes.modes import recomputed

HEAVY = pytest.mark.heavy  # pyproject.toml: the larger twins of cases CI runs

pytestmark = pytest.mark.slow


def _lm_loss(out: Any, inputs: tuple) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), inputs[0].flatten())


def _bundled_gpt2() -> tuple[nn.Module, tuple, Callable]:
    return gpt2.build(gpt2.GPTConfig(vocab_size=101, block_size=32, n_layer=16, n_head=2, n_embd=32)), \
        (torch.randint(0, 101, (2, 16)),), gpt2.loss


def _bundled_llama() -> tuple[nn.Module, tuple, Callable]:
    return llama.build(llama.LlamaConfig(vocab_size=101, dim=32, n_layers=16, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                                         max_seq_len=32)), (torch.randint(0, 101, (2, 16)),), llama.loss


def _hf(name: str) -> Callable[[], tuple[nn.Module, tuple, Callable]]:
    def build() -> tuple[nn.Module, tuple, Callable]:
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        if name == "gpt2":
            model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=16, n_embd=32, n_head=2, vocab_size=64,
                                                                         n_positions=32))
        else:
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
                num_hidden_layers=16, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=64, max_position_embeddings=32))
        return model, (torch.randint(0, 64, (2, 16)),), _lm_loss
    return build


@pytest.fixture
def compiled_depths(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of modules of each model torch.compile compiles (a model cut to k blocks has fewer)."""
    depths: list[int] = []
    trace = CompiledStep.trace

    def counted(model: nn.Module, *args: Any, **kwargs: Any) -> CompiledStep:
        depths.append(len(list(model.modules())))
        return trace(model, *args, **kwargs)
    monkeypatch.setattr(CompiledStep, "trace", staticmethod(counted))
    return depths


def _widened_and_full(build: Callable[[], tuple[nn.Module, tuple, Callable]], budget: Any) -> tuple:
    model, x, loss = build()
    target = make_target("cpu", None, None, "auto", "h100", "compiled", budget)
    at = lambda t: capture(model, x, loss, t)  # noqa: E731
    return compiled_reusing(model, at, target), at(target), at


def _modules_at(build: Callable[[], tuple[nn.Module, tuple, Callable]], k: int) -> int:
    model, _, _ = build()
    with truncated(model, find_chain(model), k):
        return len(list(model.modules()))


def _assert_same(widened: Any, full: Any) -> None:
    widened.check()
    assert signature(widened) == signature(full)  # op for op, storage for storage, save for save
    assert compiled_signature(widened) == compiled_signature(full)
    a, b = liveness(widened), liveness(full)
    assert (a.peak_bytes, a.peak_index, a.timeline) == (b.peak_bytes, b.peak_index, b.timeline)
    assert saved(widened).activation_bytes == saved(full).activation_bytes
    assert widened.num_ops == full.num_ops and widened.gradients == full.gradients
    assert recomputed(widened.compiled) == recomputed(full.compiled)  # in the same order


# heavy (pyproject.toml): the bundled models and the HF Llama take 2.5 to 7 minutes each; CI runs the HF GPT-2
@pytest.mark.parametrize("build", [pytest.param(_bundled_gpt2, marks=HEAVY), pytest.param(_bundled_llama, marks=HEAVY),
                                   _hf("gpt2"), pytest.param(_hf("llama"), marks=HEAVY)],
                         ids=["gpt2", "llama", "hf_gpt2", "hf_llama"])
def test_widened_compiled_step_is_the_full_compiled_capture(build: Callable, compiled_depths: list[int]) -> None:
    # GIVEN a 16-block model compiled at the default budget (1: one min cut, block by block)
    # WHEN it is captured with depth reuse and without
    reused, full, at = _widened_and_full(build, None)
    # THEN reuse was taken and the widened step is the full one, exactly
    assert reused.used, reused.why
    _assert_same(reused.graph, full)
    # AND reuse compiled the model once, cut to 6 blocks (then the full capture compiled all 16)
    assert compiled_depths == [_modules_at(build, 6), _modules_at(build, 16)]
    # AND its eager check's step, widened, is the full eager capture (the eager analysis beside the compiled one)
    assert reused.eager is not None
    assert signature(reused.eager) == signature(at(make_target("cpu", None, None, "auto", "h100", "eager", None)))


def test_the_compiled_report_is_the_full_one_and_its_eager_side_is_captured_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import graphmem.step.measure as measure

    # GIVEN a 16-block model analyzed in compiled mode, with eager beside it (report.compiled)
    model, x, loss = _bundled_gpt2()
    beside: list[int] = []
    real = measure.capture_reusing
    monkeypatch.setattr(measure, "capture_reusing", lambda *a, **k: beside.append(1) or real(*a, **k))
    # WHEN analyzed with depth reuse
    reused = graphmem.analyze(model, x, loss=loss, mode="compiled")
    # THEN the eager side is the eager check's step (not captured again), and the report is the full one
    assert beside == [] and reused.step is not None and reused.step.compiled.widened is not None
    assert reused.to_dict() == graphmem.analyze(model, x, loss=loss, mode="compiled", reuse=False).to_dict()


def test_budget_zero_is_compiled_once_and_widened(compiled_depths: list[int]) -> None:
    # GIVEN budget 0: the partitioner saves only the graph's inputs and recomputes the rest (no comparison
    # of cuts over the whole step), so one compilation at depth 6 is checked and widened
    reused, full, _ = _widened_and_full(_bundled_gpt2, 0.0)
    assert reused.used, reused.why
    _assert_same(reused.graph, full)
    assert compiled_depths == [_modules_at(_bundled_gpt2, 6), _modules_at(_bundled_gpt2, 16)]


def test_a_fractional_budget_whose_cut_repeats_is_widened(compiled_depths: list[int]) -> None:
    # GIVEN budget 0.8: the partitioner takes a more aggressive min cut, chosen by comparing its
    # saved bytes with the whole step's (a ratio that depends on the depth)
    reused, full, _ = _widened_and_full(_bundled_gpt2, 0.8)
    # THEN the comparison comes out the same at full depth, and the widened step is the full one
    assert reused.used, reused.why
    # (checked on two compilations, at depth 5 and 6: the partitions' bytes at two depths)
    assert compiled_depths == [_modules_at(_bundled_gpt2, k) for k in (5, 6, 16)]
    assert not full.compiled.partitions[0].knapsack and len(full.compiled.partitions[0].sizes) > 2
    _assert_same(reused.graph, full)


def test_a_knapsack_partition_is_compiled_at_full_depth_with_a_note() -> None:
    # GIVEN budget 0.5, where the partitioner's knapsack picks what to recompute over all blocks at once
    model, x, loss = _bundled_gpt2()
    # WHEN analyzed with depth reuse (the default)
    report = graphmem.analyze(model, x, loss=loss, mode="compiled", memory_budget=0.5)
    # THEN every block was compiled (the knapsack's choice need not repeat block by block), and the report says so
    assert report.step is not None and report.step.compiled.widened is None
    assert report.step.compiled.partitions[0].knapsack
    assert any("depth reuse not taken" in n and "knapsack" in n for n in report.notes)
    assert report.compiled is not None and report.compiled.memory_budget == 0.5
    # AND it had to: the depth-5 step widened to 16 blocks anyway is not the 16-block step (the
    # knapsack recomputes other values at 16 blocks than 5 blocks' pattern copied)
    with truncated(model, find_chain(model), 5):
        small = capture(model, x, loss, make_target("cpu", None, None, "auto", "h100", "compiled", 0.5))
    forced = widen(small, find_chain(model), 5, 16, [name for name, _ in model.named_modules()])
    assert saved(forced).activation_bytes != report.activation_bytes
    # AND the sweep reuses depth at a value whose cut repeats (0.8: compiled at depth 5 and 6 only, no note)
    sweep = report.memory_budgets([0.5, 0.8])
    assert [p.budget for p in sweep.points] == [0.8, 0.5] and sweep.notes == ()
    assert sweep.points[1].saved_bytes == report.activation_bytes


def test_a_block_compiled_otherwise_than_its_neighbour_is_not_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN 16 alike blocks whose eager steps repeat, but torch.compile traces block 3 otherwise
    model, x, loss = _bundled_gpt2()
    third, forward = model.transformer.h[3], gpt2.Block.forward

    def patched(self: nn.Module, h: torch.Tensor) -> torch.Tensor:
        out = forward(self, h)
        if torch.compiler.is_compiling() and self is third:
            out = out * 2  # block 3 only, and only under torch.compile
        return out
    monkeypatch.setattr(gpt2.Block, "forward", patched)
    target = make_target("cpu", None, None, "auto", "h100", "compiled", None)
    at = lambda t: capture(model, x, loss, t)  # noqa: E731
    # WHEN captured with depth reuse
    reused = compiled_reusing(model, at, target)
    # THEN the copy of block 2 written as block 3 does not match the compiled capture: every block is compiled
    assert not reused.used and reused.why.startswith("a compiled block differs from its neighbour's copy"), reused.why
    _assert_same(reused.graph, at(target))
    assert any(str(op.target) == "aten.mul.Tensor" and op.meta["module"] == "transformer.h.3" for op in reused.graph.ops)


def test_sweep_notes_are_rendered() -> None:
    from graphmem.passes.memory_budget import BudgetPoint, budget_sweep
    from graphmem.render.memory_budget import render_memory_budgets

    sweep = dataclasses.replace(budget_sweep([BudgetPoint(1.0, 500, 1000, "backward", 0, 0, 0)]),
                                notes=("budget 0.5: depth reuse not taken (why)",))
    assert "Note: budget 0.5: depth reuse not taken (why)" in render_memory_budgets(sweep)
    assert sweep.to_dict()["notes"] == ["budget 0.5: depth reuse not taken (why)"]
