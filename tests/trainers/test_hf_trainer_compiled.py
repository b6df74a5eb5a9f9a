"""A transformers ``Trainer`` with ``torch_compile=True`` (graphmem/training/hf_trainer.py): the Trainer's
own step over the model accelerate compiles, captured in compiled mode with the backend's partition,
against the same step run for real on the CPU over the module accelerate's ``prepare_model`` compiled.

Ground truth as in tests/trainers/test_hf_trainer.py (graphmem/validation/measure.py with the same runner):
saved bytes by ``saved_tensors_hooks`` around the real compiled step (AOTAutograd's runtime saves what
the compiled forward returns for backward with ``ctx.save_for_backward``, whatever the backend), the
optimizer states, and the peaks from the CPU allocator's events; the real module is compiled by a
whole step of its own before the measured ones.

Measured (tiny configs, 2x16, ``max_grad_norm=1.0``, ``gradient_accumulation_steps=2``, adamw_torch),
predicted / real, bytes before the step exact everywhere:

- ``aot_eager``, Llama: saved 144,008 / 144,008 B, states 214,356 / 214,356 B, peak 469,880 / 469,880 B,
  later steps 622,860 / 622,860 B. GPT-2 under bf16: saved 205,704 / 205,704 B, peaks exact.
- ``inductor`` (the Trainer's default), Llama: saved 143,764 / 143,764 B (aot_eager's partition would
  say 144,008 B), states exact, peak 469,868 / 469,880 B, later steps 622,732 / 606,624 B: 16,108 B
  (2.7 %) above. GPT-2 under bf16: saved 172,564 / 172,564 B (aot_eager's: 205,704 B), later steps
  733,832 / 697,480 B (36,352 B, 5.2 % above). graphmem runs the split graphs op by op; Inductor's
  fused kernels never allocate their intermediates and it reuses buffers (docs/inductor.md), so its
  peaks are not judged: the relation measured here (above the real one) is asserted for these cases,
  not claimed in general.
- With gradient checkpointing, Llama: ``aot_eager`` saved 31,880 / 31,880 B, later steps 581,900 /
  581,900 B; ``inductor`` saved 31,636 / 31,636 B, later steps 592,140 / 587,084 B (0.9 % above).

The first step's peak is AdamW's update (eager code): exact, with the 8 B double and 4 B cast that
tests/trainers/test_hf_trainer.py's docstring traces (the Inductor rows above were measured before they were
counted: 12 B under then).
"""
from __future__ import annotations

import json
import tempfile
from typing import Any

import pytest
import torch

import graphmem
from graphmem.frontends.trainer import trainer_batch
from graphmem.render import render_json, render_text
from graphmem.validation.trainer import measure_trainer
from tests.trainers.test_hf_trainer import _gpt2, _llama, _lora_llama  # the eager Trainer checks' tiny configs

transformers = pytest.importorskip("transformers")
PEAK_TOLERANCE = 0.001  # as tests/trainers/test_hf_trainer.py; the gaps measured: module docstring



def _trainer(model: Any, out: str, **kwargs: Any) -> Any:
    kwargs = {"gradient_accumulation_steps": 2, "optim": "adamw_torch", **kwargs}
    args = transformers.TrainingArguments(output_dir=out, report_to=[], use_cpu=True, max_grad_norm=1.0, **kwargs)
    return transformers.Trainer(model=model, args=args)


def _batch(trainer: Any) -> dict:
    torch.manual_seed(0)
    return trainer_batch(trainer, (2, 16))


def _aot_eager(model: Any, out: str, **kwargs: Any) -> tuple[Any, dict, Any]:
    trainer = _trainer(model, out, torch_compile_backend="aot_eager", **kwargs)
    assert trainer.args.torch_compile
    batch = _batch(trainer)
    r = graphmem.analyze(trainer, batch)
    assert r.step is not None
    r.step.check()
    return trainer, batch, r


def test_aot_eager_compiled_trainer_step_matches_a_real_one() -> None:
    """torch_compile_backend="aot_eager": saved bytes and optimizer states exact, the peak within the
    tolerance; the report names the compile; the model is left as it was. (One micro-batch, to keep it
    short: the slow tests run two.)"""
    model = _llama()
    forward = model.forward
    with tempfile.TemporaryDirectory() as out:
        trainer, batch, r = _aot_eager(model, out, gradient_accumulation_steps=1)
        first = measure_trainer(trainer, batch)
    b = r.budget.rank
    assert r.activation_bytes == first.saved_bytes
    assert b.row("optimizer states").size == first.state_bytes and r.baseline_bytes == first.baseline_bytes
    assert first.peak_bytes == b.peak_bytes and b.peak_phase == "optimizer"  # AdamW's first update (module docstring)
    assert "torch.compile (aot_eager)" in render_text(r)
    d = json.loads(render_json(r))
    assert d["budget"]["torch_compile"] == "aot_eager" and d["target"]["mode"] == "compiled"
    assert model.forward == forward and "_original_forward" not in model.__dict__


@pytest.mark.slow  # 10-40 s
def test_aot_eager_compiled_trainer_later_steps_and_eager_beside() -> None:
    """The later steps' peak within the tolerance; eager beside it is the same Trainer's eager step."""
    model = _llama()
    with tempfile.TemporaryDirectory() as out:
        trainer, batch, r = _aot_eager(model, out)
        later = measure_trainer(trainer, batch, warm_steps=1)
        eager = graphmem.analyze(_trainer(model, out), batch)
    assert later.peak_bytes == r.budget.rank.later_peak_bytes
    assert r.compiled is not None and r.compiled.eager_bytes == eager.activation_bytes != r.activation_bytes


@pytest.mark.slow  # 40-70 s
def test_aot_eager_compiled_trainer_with_gradient_checkpointing() -> None:
    """gradient_checkpointing=True under torch_compile (the checkpointed layers inside dynamo's graphs):
    saved bytes exact (31,880 B, a fifth of the step without it) and the later steps' peak within the tolerance."""
    with tempfile.TemporaryDirectory() as out:
        trainer = _trainer(_llama(), out, torch_compile_backend="aot_eager", gradient_checkpointing=True)
        batch = _batch(trainer)
        r = graphmem.analyze(trainer, batch)
        first, later = measure_trainer(trainer, batch), measure_trainer(trainer, batch, warm_steps=1)
    assert r.activation_bytes == first.saved_bytes and r.budget is not None
    assert (first.peak_bytes, later.peak_bytes) == (r.budget.rank.peak_bytes, r.budget.rank.later_peak_bytes)


def test_aot_eager_compiled_trainer_step_without_an_attention_mask_saves_what_a_real_one_saves() -> None:
    """The quick check of the test below: one micro-step, the first step only."""
    with tempfile.TemporaryDirectory() as out:
        trainer = _trainer(_llama(), out, torch_compile_backend="aot_eager", gradient_accumulation_steps=1)
        batch = {k: v for k, v in _batch(trainer).items() if k != "attention_mask"}
        r = graphmem.analyze(trainer, batch)
        first = measure_trainer(trainer, batch)
    assert r.activation_bytes == first.saved_bytes == 144_008 and r.baseline_bytes == first.baseline_bytes
    assert r.budget is not None
    assert first.peak_bytes == r.budget.rank.peak_bytes


@pytest.mark.slow  # 15-20 s each alone: three compiled steps
@pytest.mark.parametrize("make", [_llama, _gpt2])
def test_aot_eager_compiled_trainer_step_without_an_attention_mask(make: Any) -> None:
    """A batch without ``attention_mask``: transformers' mask code then reads the position ids
    (``masking_utils.find_packed_sequence_indices``), which dynamo traces and guards on. The replay
    runs under the trace's functions (graphmem/capture/hf_paths.py ``real_paths``), so its forward
    graph runs once per micro-step. Saved bytes, optimizer states, bytes before the step and the
    both peaks exact. Measured (bytes): Llama saved 144,008, states 214,356, later peak 622,348, first
    peak 469,368; GPT-2 saved 232,328, states 253,040, later peak 799,368, first peak 548,928."""
    with tempfile.TemporaryDirectory() as out:
        trainer = _trainer(make(), out, torch_compile_backend="aot_eager")
        batch = {k: v for k, v in _batch(trainer).items() if k != "attention_mask"}
        assert set(batch) == {"input_ids", "labels"}
        r = graphmem.analyze(trainer, batch)
        first, later = measure_trainer(trainer, batch), measure_trainer(trainer, batch, warm_steps=1)
    assert r.budget is not None
    b = r.budget.rank
    assert r.compiled is not None and r.activation_bytes == first.saved_bytes
    assert b.row("optimizer states").size == first.state_bytes and r.baseline_bytes == first.baseline_bytes
    assert first.peak_bytes == b.peak_bytes and b.peak_phase == "optimizer"
    assert later.peak_bytes == b.later_peak_bytes


def _inductor_validates(model: Any, **kwargs: Any) -> Any:
    """graphmem.validate of a Trainer with torch_compile=True (Inductor, the Trainer's default backend)."""
    with tempfile.TemporaryDirectory() as out:
        trainer = _trainer(model, out, torch_compile=True, **kwargs)
        assert trainer.args.torch_compile_backend == "inductor"
        v = graphmem.validate(trainer, _batch(trainer))
    assert v.ok, v.reason
    for name in ("saved for backward", "optimizer states", "before the step"):
        assert v.row(name).difference == 0, v.row(name)
    assert v.row("peak").rule == v.row("peak (later steps)").rule == "info"
    assert v.report is not None and v.report.to_dict()["target"]["compile_backend"] == "inductor"
    return v


@pytest.mark.slow  # ~60 s: Inductor compiles the real step's C++ kernels
def test_inductor_compiled_trainer_step_saves_what_a_real_one_saves() -> None:
    v = _inductor_validates(_llama())
    assert v.row("saved for backward").measured == 143_764  # aot_eager's partition saves 144,008 B here
    first, later = v.row("peak"), v.row("peak (later steps)")
    assert 0 <= -first.difference <= PEAK_TOLERANCE * first.measured  # the first step's peak is AdamW's (eager)
    assert later.difference > 0  # the graphs run op by op, unfused: above Inductor's (module docstring)


@pytest.mark.heavy  # ~90-110 s: GPT-2's graph breaks compile several Inductor graphs; CI runs the fp32 case
def test_inductor_compiled_trainer_step_under_bf16() -> None:
    v = _inductor_validates(_gpt2(), bf16=True)
    assert v.row("saved for backward").measured == 172_564  # aot_eager's partition saves 205,704 B here
    assert v.row("peak (later steps)").difference > 0


@pytest.mark.slow  # ~40 s each: two real compiled steps
@pytest.mark.parametrize("make,kwargs,under", [
    (_lora_llama, {}, 0),  # peft's LoRA adapters inside dynamo's graphs
    (_llama, {"optim": "adamw_bnb_8bit"}, 0),  # bitsandbytes' 8-bit AdamW (eager) after the compiled step
])
def test_peft_and_8bit_adamw_under_torch_compile(make: Any, kwargs: dict, under: int) -> None:
    """``torch_compile`` with a peft LoRA model, and with ``optim="adamw_bnb_8bit"``: saved bytes, optimizer
    states and bytes before the step exact, the later steps' peak exact, the first step's peak exact or
    ``under`` bytes below it. Measured (predicted / real, bytes): LoRA saved 112,904, states 7,200, peaks
    277,688 and 284,888, all equal; 8-bit AdamW saved 144,008, states 191,872, later peak 600,376, all
    equal, first peak 488,376 (with the Python float bitsandbytes' CPU kernel divides by, wrapped into an
    8 B double and a 4 B cast inside its op: graphmem/oprules/bnb.py)."""
    if "optim" in kwargs:
        pytest.importorskip("bitsandbytes")
    with tempfile.TemporaryDirectory() as out:
        trainer, batch, r = _aot_eager(make(), out, **kwargs)
        first, later = measure_trainer(trainer, batch), measure_trainer(trainer, batch, warm_steps=1)
    b = r.budget.rank
    assert r.activation_bytes == first.saved_bytes and r.baseline_bytes == first.baseline_bytes
    assert b.row("optimizer states").size == first.state_bytes
    assert first.peak_bytes - b.peak_bytes == under and later.peak_bytes == b.later_peak_bytes
