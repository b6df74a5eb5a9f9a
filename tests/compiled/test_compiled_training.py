"""torch.compile as users train with it: the model compiled, the optimizer step eager after its
compiled backward, micro-batches through the compiled graphs.

GIVEN a real ``torch.compile(model, backend="aot_eager")`` CPU step (compiled before the measured
one) with graphmem/training/loop.py's loop around it (micro-steps, ``optimizer.step()``,
``zero_grad(set_to_none=True)``), measured by graphmem/validation/measure.py,
WHEN graphmem analyzes the same step with ``mode="compiled"`` and the training options,
THEN the optimizer states are the real ones to the byte, and the first and a later step's peaks
(the states then exist before the step) are the real ones within tests/trainers/test_training.py's
tolerance, never above. Measured: 0 B in forward and backward; 12 B where the peak is inside an
Adam step (for-loop and foreach), the gap the eager step of the same model has (a Python scalar of
the update wrapped in an 8-byte double and copied to a 4-byte float32 tensor, invisible to fake
tensors; torch/optim/adam.py). gpt2_explicit + AdamW: first step 524,276 B predicted, 524,288 B
real; later steps 580,984 B both (eager mode's later peak is 600,056 B: the partitioner saves less).
"""
from __future__ import annotations

import pytest
import torch
from cases import MODELS, build

import graphmem
from graphmem.training.loop import TrainStep
from graphmem.training.step import run_step
from graphmem.validation.measure import measure_peak

TOLERANCE = 0.001  # tests/trainers/test_training.py's LM tolerance; the measured gaps are named in the docstring


def _real(name: str, train: TrainStep) -> tuple[int, int, int]:
    """A real compiled step's (first peak, later peak, optimizer state bytes)."""
    module, inputs, loss = build(MODELS, name)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(module, backend="aot_eager")
        run_step(compiled, inputs, loss)  # compile outside the measured steps
        first = measure_peak(compiled, inputs, loss, train=train)
        later = measure_peak(compiled, inputs, loss, train=train, warm_steps=1)
    finally:
        torch._dynamo.reset()
    return first.peak_bytes, later.peak_bytes, first.state_bytes


@pytest.mark.parametrize("name,train", [
    ("gpt2_explicit", TrainStep("adamw")),  # for-loop AdamW (the CPU's default)
    ("llama_sdpa", TrainStep("adam", "foreach")),
    ("mlp", TrainStep("momentum", micro_batches=2)),
    ("gpt2_explicit", TrainStep("adamw", "foreach", micro_batches=3)),
], ids=["gpt2-adamw", "llama-adam-foreach", "mlp-momentum-2mb", "gpt2-adamw-foreach-3mb"])
def test_a_compiled_step_with_its_optimizer_is_a_real_one(name: str, train: TrainStep) -> None:
    module, inputs, loss = build(MODELS, name)
    report = graphmem.analyze(module, inputs, loss=loss, mode="compiled", optimizer=train.optimizer,
                              optimizer_impl=train.impl, micro_batches=train.micro_batches)
    b = report.budget
    assert b is not None and report.compiled is not None  # the eager step beside the compiled one
    first, later, states = _real(name, train)
    assert b.row("optimizer states").size == states > 0
    for predicted, real in ((b.peak_bytes, first), (b.rank.later_peak_bytes, later)):
        assert 0 <= real - predicted <= TOLERANCE * real, (predicted, real)
    # the compiled step is what was traced: AOTAutograd's graphs ran, and the optimizer after them
    assert report.phase_start["optimizer"] > report.phase_start["backward"]
    assert any(n.target is not None and "foreach" in str(n.target) for n in report.step.ops) == (train.impl == "foreach")


def test_compiled_and_eager_steps_hold_the_same_optimizer_states() -> None:
    module, inputs, loss = build(MODELS, "llama_sdpa")
    eager = graphmem.analyze(module, inputs, loss=loss, optimizer="adamw")
    compiled = graphmem.analyze(module, inputs, loss=loss, optimizer="adamw", mode="compiled")
    assert compiled.budget.row("optimizer states").size == eager.budget.row("optimizer states").size
    # compiled mode saves less for backward (the partitioner recomputes), so its first peak is not above eager's
    assert compiled.activation_bytes <= eager.activation_bytes


@pytest.mark.parametrize("name", ["llama_gqa", "gpt2_sdpa"])
def test_transformers_models_compiled_with_adamw_are_real_steps(name: str) -> None:
    """transformers' LlamaForCausalLM and GPT2LMHeadModel (tiny configs, their own loss), compiled,
    AdamW eager after the compiled backward (measured: 12 B on the first step, in the AdamW step;
    later steps 0 B)."""
    from zoo import build as zoo_build

    module, inputs = zoo_build(name)
    report = graphmem.analyze(module, inputs, mode="compiled", optimizer="adamw")
    b = report.budget
    torch._dynamo.reset()
    try:
        compiled = torch.compile(module, backend="aot_eager")
        run_step(compiled, inputs, None)
        first = measure_peak(compiled, inputs, None, train=TrainStep("adamw"))
        later = measure_peak(compiled, inputs, None, train=TrainStep("adamw"), warm_steps=1)
    finally:
        torch._dynamo.reset()
    assert b.row("optimizer states").size == first.state_bytes > 0
    for predicted, real in ((b.peak_bytes, first.peak_bytes), (b.rank.later_peak_bytes, later.peak_bytes)):
        assert 0 <= real - predicted <= TOLERANCE * real, (predicted, real)
