"""The loop options around compiled blocks (``mode="compiled-blocks"``, graphmem/capture/compiled_per_block.py), as
torchtune runs its memory-optimized recipes: each block and the loss compiled, the loop in Python.

GIVEN a real CPU step whose chain blocks (and loss function) are compiled by ``torch.compile(backend="aot_eager")``
(``blocks_compiled``, compiled before the measured steps), run through graphmem/training/loop.py's loop with a
loop option (benchmarks/compiled_loop.py ``real``),
WHEN graphmem analyzes the same step with ``mode="compiled-blocks"`` and that option,
THEN saved bytes (saved_tensors_hooks on the real step), the bytes the offloading hooks moved, and the first and
later steps' peaks are the real ones to the byte (the table in docs/loop.md, "Compiled blocks").
"""
from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
import torch.nn as nn
from paths import ROOT

import graphmem
from graphmem.capture.compiled_per_block import blocks_compiled
from graphmem.errors import UsageError
from graphmem.training.loop import make_train_step
from graphmem.training.step import run_step
from graphmem.validation.measure import measure_peak

sys.path.insert(0, str(ROOT / "benchmarks"))
from compiled_loop import MODELS, ROWS, predicted, real  # noqa: E402

# (model, row) -> measured |predicted - real| of the first and later peaks, where they are not 0 B: bitsandbytes'
# 8-bit AdamW stepped in backward after compiled blocks, 3,968 B = a (32, 32) gradient less a (32,) one. The
# engine runs a compiled block's parameters' post-accumulate-grad hooks in another order in the capture than in
# the real step (measured, docs/loop.md "Compiled blocks"); why is not found yet
GAPS: dict[tuple[str, str], list[int]] = {("gpt2", "torchtune"): [0, 3968]}


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x)) + x


class _Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return x


def _chain() -> tuple:
    torch.manual_seed(0)
    return _Chain(), (torch.randn(8, 32),), None


def test_offloading_around_compiled_blocks_moves_the_compiled_saves() -> None:
    """A tiny chain (fast): the offloading hooks see what AOTAutograd's CompiledFunction saves, in the real step
    and in graphmem's alike."""
    options = {"offload_activations": True, "optimizer": "adamw", "optimizer_in_backward": True}
    model, inputs, _ = _chain()
    r = graphmem.analyze(model, inputs, mode="compiled-blocks", **options)
    with blocks_compiled(model, None) as loss:
        run_step(model, inputs, loss)
        model.zero_grad(set_to_none=True)
        m = measure_peak(model, inputs, loss, train=make_train_step("adamw", optimizer_in_backward=True,
                                                                    offload_activations=True))
    assert all(b._compiled_call_impl is None for b in model.blocks)  # the user's module is left as it was
    assert r.budget.host_bytes == m.host_bytes > 0
    assert (r.activation_bytes, r.peak_bytes) == (m.saved_bytes, m.peak_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("row", ["release_output", "optimizer_in_backward", "offload_activations", "adamw8bit",
                                 "torchtune"])
@pytest.mark.parametrize("model", list(MODELS))
def test_each_loop_option_around_compiled_blocks_is_a_real_compiled_step(model: str, row: str) -> None:
    if ROWS[row].get("optimizer", "").endswith("8bit"):
        pytest.importorskip("bitsandbytes")
    if model == "hf_llama":
        pytest.importorskip("transformers")
    pr, re = predicted(MODELS[model], ROWS[row]), real(MODELS[model], ROWS[row])
    assert (pr["saved"], pr["host"]) == (re["saved"], re["host"])
    assert (re["host"] > 0) == bool(ROWS[row].get("offload_activations"))
    if (model, row) in GAPS:  # docs/loop.md: bitsandbytes' optimizers stepped in backward after compiled blocks
        assert [abs(pr[k] - re[k]) for k in ("first", "later")] == GAPS[model, row]
        assert all(abs(pr[k] - re[k]) <= 0.01 * re[k] for k in ("first", "later"))
    else:
        assert (pr["first"], pr["later"]) == (re["first"], re["later"])


@pytest.mark.parametrize("options,words", [
    (dict(mode="compiled", offload_activations=True), "mode='compiled-blocks'"),
    (dict(mode="compiled-blocks", rank=0, world_size=2, fsdp="fully_shard"), "mode='eager'"),
    (dict(mode="eager", memory_budget=0.5), "compiled-blocks"),
])
def test_what_does_not_combine_is_one_line(options: dict[str, Any], words: str) -> None:
    model, inputs, _ = _chain()
    with pytest.raises(UsageError, match=words.replace("(", r"\(")):
        graphmem.analyze(model, inputs, **options)


def test_a_model_without_a_chain_is_one_line() -> None:
    with pytest.raises(UsageError, match="no chain of repeated blocks"):
        graphmem.analyze(nn.Linear(4, 4), (torch.randn(2, 4),), mode="compiled-blocks")


@pytest.mark.slow
def test_offloading_hooks_move_the_partitions_saves_not_eagers() -> None:
    """Measured on real steps (torch 2.14): Python saved-tensor hooks apply to what AOTAutograd's CompiledFunction
    saves, so what they move follows the partition (bundled GPT-2: eager saves 226,164 B and moves 210,560 B,
    compiled blocks save 201,588 B and move 185,984 B: 24,576 B less of each)."""
    compiled = real(MODELS["gpt2"], ROWS["offload_activations"])
    model, inputs, loss = MODELS["gpt2"]()
    eager = measure_peak(model, inputs, loss, train=make_train_step(offload_activations=True))
    assert compiled["saved"] < eager.saved_bytes
    assert eager.host_bytes - compiled["host"] == eager.saved_bytes - compiled["saved"] > 0
