"""The whole training step per rank (optimizer, micro-batches, LoRA) through FSDP2 against real gloo runs.

GIVEN a model wrapped by fully_shard over 2 ranks (after peft's get_peft_model for LoRA), or the
bundled Llama split by parallelize_module (TP + SP), and a
torch.optim optimizer over its DTensor parameters (graphmem/training/loop.py's Session, the step
graphmem traces), with micro-batches reduce-scattered each (FSDP2's default) or only the last
(set_requires_gradient_sync(False) before the others)
WHEN graphmem captures rank r's whole step on fake tensors under the fake process group
THEN on every rank: the last micro-step's saved bytes and the optimizer states' bytes equal a real
2-process gloo job's to the byte; the first step's peak and a later step's peak (the states then
exist before the step: passes/later_steps.py later_steps_peak) equal the real ones up to the gap the
single-device prediction has on the same model in the same phase, as in tests/test_distributed.py:
in the optimizer step 12 B on the CPU (the for-loop AdamW's ``exp_avg_sq.sqrt() /
bias_correction2_sqrt`` wraps the Python float in an 8-byte double tensor and copies it to a 4-byte
float32 one, both live during aten.div and invisible to fake tensors); in forward/backward 0 B,
except peft's LoRA Llama's 64 B, which its single-device step has too.
"""
from __future__ import annotations

from typing import Any

import pytest

import graphmem
from graphmem.distributed import Sharding, make_sharding
from graphmem.training.loop import TrainStep
from graphmem.training.spec import make_training
from graphmem.validation.measure import measure_peak
from tests.dist_truth import case, measure_train_ranks

pytestmark = pytest.mark.usefixtures("one_thread")  # the single-device gaps and every rank with one thread, as each gloo rank runs
WORLD = 2
CASES: list[tuple[str, Sharding, TrainStep]] = [
    ("chain", make_sharding(WORLD, 0, fsdp=True), TrainStep("adamw")),  # for-loop AdamW (the CPU's default)
    ("chain", make_sharding(WORLD, 0, fsdp=True), TrainStep("adamw", micro_batches=3)),  # reduce-scatter each micro-batch
    # transformers' Llama, foreach AdamW, gradient sync on the last of 3 micro-batches only
    ("llama_gqa", make_sharding(WORLD, 0, fsdp=True, no_sync=True, training=make_training(micro_batches=3)), TrainStep("adamw", "foreach", micro_batches=3)),
    ("lora_llama", make_sharding(WORLD, 0, fsdp=True), TrainStep("adamw")),  # peft's get_peft_model, then fully_shard
    ("llama_bundled", make_sharding(WORLD, 0, tp=WORLD, sp=True), TrainStep("adamw")),  # parallelize_module, TP + SP
]
# the real side's model -> what graphmem is given: the base model and its LoRA options (tests/zoo.py's lora_llama)
AS_GIVEN = {"lora_llama": ("llama_gqa", {"lora_rank": 4, "lora_targets": "q_proj,v_proj"})}


def _ids(c: tuple[str, Sharding, TrainStep]) -> str:
    name, s, t = c
    return f"{name}-{t.describe()}" + ("-no-sync" if s.no_sync else "") + ("-tp-sp" if s.tp > 1 else "")


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
    b = _analyze(name, train).budget.rank
    model, batch = case(name)
    first = measure_peak(model, batch, train=train).peak_bytes - b.peak_bytes
    model, batch = case(name)
    later = measure_peak(model, batch, train=train, warm_steps=1).peak_bytes - b.later_peak_bytes
    return {"step": fb, "first": first if b.peak_phase == "optimizer" else -1,
            "later": later if b.later_peak_phase == "optimizer" else -1}


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CASES)), ids=[_ids(c) for c in CASES])
def test_rank_step_matches_real_gloo(real: list[list[dict[str, int]]], index: int) -> None:
    name, sharding, train = CASES[index]
    gaps = _single_gaps(name, train)
    for rank in range(WORLD):
        r = _analyze(name, train, world_size=WORLD, rank=rank, fsdp="fully_shard" if sharding.fsdp else None,
                     reshard_after_forward=sharding.reshard_after_forward, fsdp_no_sync=sharding.no_sync,
                     tp=sharding.tp, sp=sharding.sp)
        b, m = r.budget.rank, real[index][rank]
        assert r.activation_bytes == m["saved"], (name, rank)
        assert b.row("optimizer states").size == m["states"] > 0, (name, rank)
        assert b.peak_bytes == r.peak_bytes
        assert m["peak"] - b.peak_bytes == gaps["first" if b.peak_phase == "optimizer" else "step"], (name, rank)
        assert m["later"] - b.later_peak_bytes == gaps["later" if b.later_peak_phase == "optimizer" else "step"], \
            (name, rank)
