"""The whole training step per rank (optimizer, micro-batches, LoRA) through FSDP2 against real gloo runs.

GIVEN a model wrapped by fully_shard over 2 ranks (after peft's get_peft_model for LoRA), or the
bundled Llama split by parallelize_module (TP + SP), and a torch.optim optimizer over its DTensor
parameters, with micro-batches reduce-scattered each (FSDP2's default) or only the last
(set_requires_gradient_sync(False) before the others); the real side wrapped and stepped as a
user writes it (tests/dist_plans.py, tests/dist_truth.py: plain torch.optim, no graphmem code)
WHEN graphmem captures rank r's whole step on fake tensors under the fake process group
THEN on every rank: the last micro-step's saved bytes and the optimizer states' bytes equal a real
2-process gloo job's to the byte; the first step's peak and a later step's peak (the states then
exist before the step: passes/later_steps.py later_steps_peak) equal the real ones up to the gap the
single-device prediction has on the same model in the same phase, bounded by STEP_GAP and
OPTIMIZER_GAP.
"""
from __future__ import annotations

from typing import Any

import pytest

import graphmem
from graphmem.training.loop import TrainStep
from graphmem.validation.measure import measure_peak
from tests.dist_truth import Train, Wrap, case, measure_train_ranks

pytestmark = pytest.mark.usefixtures("one_thread")  # the single-device gaps and every rank with one thread, as each gloo rank runs
WORLD = 2
CASES: list[tuple[str, Wrap, Train]] = [
    ("chain", Wrap(WORLD, fsdp=True), Train("adamw")),  # for-loop AdamW (the CPU's default)
    ("chain", Wrap(WORLD, fsdp=True), Train("adamw", micro_batches=3)),  # reduce-scatter each micro-batch
    # transformers' Llama, foreach AdamW, gradient sync on the last of 3 micro-batches only
    ("llama_gqa", Wrap(WORLD, fsdp=True, no_sync=True), Train("adamw", foreach=True, micro_batches=3)),
    ("lora_llama", Wrap(WORLD, fsdp=True), Train("adamw")),  # peft's get_peft_model, then fully_shard
    ("llama_bundled", Wrap(WORLD, tp=WORLD, sp=True), Train("adamw")),  # parallelize_module, TP + SP
]
# The single-device gaps (real minus predicted peak) each rank may have, by phase, are 0 B now that
# the capture counts Python numbers taken as tensors (graphmem/capture/wrapped_numbers.py):
# - "step" (the peak in forward/backward): peft's LoRA Llama read 64 B: each LoRA linear (q_proj,
#   v_proj of 4 layers) multiplies by the Python float ``scaling`` (peft/tuners/lora/layer.py),
#   which eager wraps in a 0-dim float64 tensor (8 B) that MulBackward0 keeps until the backward;
# - "optimizer" (the peak in AdamW's step): read 12 B, the for-loop AdamW's ``exp_avg_sq.sqrt() /
#   bias_correction2_sqrt`` (torch/optim/adam.py ``_single_tensor_adam``) wraps the Python float in
#   an 8-byte double tensor and TensorIterator copies it to a 4-byte float32 one, both live during
#   aten.div; the foreach one on the CPU divides by the same float per tensor (no fused CPU kernel:
#   the per-tensor fallback of ``_foreach_div_``), the same 12 B.
STEP_GAP: dict[str, int] = {}
OPTIMIZER_GAP = 0


def _bounded(name: str, gaps: dict[str, int]) -> dict[str, int]:
    assert gaps["step"] == STEP_GAP.get(name, 0), (name, gaps)
    for key in ("first", "later"):  # -1: that peak is not in the optimizer step
        assert gaps[key] in (-1, OPTIMIZER_GAP), (name, gaps)
    return gaps


def _step(train: Train) -> TrainStep:
    """The same step as graphmem's options name it."""
    return TrainStep(train.optimizer, "foreach" if train.foreach else "forloop", micro_batches=train.micro_batches)


# the real side's model -> what graphmem is given: the base model and its LoRA options (tests/zoo.py's lora_llama)
AS_GIVEN = {"lora_llama": ("llama_gqa", {"lora_rank": 4, "lora_targets": "q_proj,v_proj"})}


def _ids(c: tuple[str, Wrap, Train]) -> str:
    name, w, t = c
    return f"{name}-{_step(t).describe()}-{w.describe()}"


@pytest.fixture(scope="module")
def real() -> list[list[dict[str, int]]]:
    return measure_train_ranks(CASES, WORLD)


def _analyze(name: str, train: TrainStep, **options: Any) -> graphmem.Report:
    base, lora = AS_GIVEN.get(name, (name, {}))
    model, batch = case(base)
    return graphmem.analyze(model, batch, optimizer=train.optimizer, optimizer_impl=train.impl,
                            micro_batches=train.micro_batches, **lora, **options)


def _single_gaps(name: str, train: TrainStep) -> dict[str, int]:
    """Real minus predicted peak of the single-device step: forward and backward alone ("step"),
    and the whole step's first and later steps, where the single device peaks in the optimizer."""
    model, batch = case(name)
    fb = measure_peak(model, batch).peak_bytes - _analyze(name, TrainStep()).peak_bytes
    budget = _analyze(name, train).budget
    assert budget is not None
    b = budget.rank
    model, batch = case(name)
    first = measure_peak(model, batch, train=train).peak_bytes - b.peak_bytes
    model, batch = case(name)
    later = measure_peak(model, batch, train=train, warm_steps=1).peak_bytes - b.later_peak_bytes
    return {"step": fb, "first": first if b.peak_phase == "optimizer" else -1,
            "later": later if b.later_peak_phase == "optimizer" else -1}


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CASES)), ids=[_ids(c) for c in CASES])
def test_rank_step_matches_real_gloo(real: list[list[dict[str, int]]], index: int) -> None:
    name, wrap, train = CASES[index]
    gaps = _bounded(name, _single_gaps(name, _step(train)))
    for rank in range(WORLD):
        r = _analyze(name, _step(train), rank=rank, **wrap.options())
        assert r.budget is not None
        b, m = r.budget.rank, real[index][rank]
        assert r.activation_bytes == m["saved"], (name, rank)
        assert b.row("optimizer states").size == m["states"] > 0, (name, rank)
        assert b.peak_bytes == r.peak_bytes
        assert m["peak"] - b.peak_bytes == gaps["first" if b.peak_phase == "optimizer" else "step"], (name, rank)
        assert m["later"] - b.later_peak_bytes == gaps["later" if b.later_peak_phase == "optimizer" else "step"], \
            (name, rank)
