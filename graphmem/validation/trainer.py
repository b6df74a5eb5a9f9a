"""``graphmem.validate(trainer)``: a transformers Trainer's step run for real on the CPU by the runner the
capture runs (graphmem/training/hf_trainer.py), beside ``graphmem.analyze(trainer)``'s prediction."""
from __future__ import annotations

import contextlib
from typing import Any, Optional, Union

import torch

from graphmem.api import analyze
from graphmem.errors import UsageError
from graphmem.frontends.trainer import check_ranks, trainer_inputs
from graphmem.step.spec import UserInputs, shape_of
from graphmem.training.batch import as_batch
from graphmem.training.hf_trainer import TrainerRunner, check_trainer
from graphmem.validation.measure import RealStep, measure_peak
from graphmem.validation.profiler_log import without_profiler_log
from graphmem.validation.result import NO_GPU, Row, Validation, checked_tolerance, judge


def measure_trainer(trainer: Any, inputs: object, warm_steps: int = 0) -> RealStep:
    """The same step run for real on the CPU (graphmem/validation/measure.py with the Trainer's runner).
    With ``torch_compile`` the step is the module accelerate compiled (graphmem/training/hf_trainer.py),
    compiled by a whole step of its own first, so the measured ones run compiled code only; the runner
    then starts over (a first step: no optimizer states)."""
    with TrainerRunner(trainer).session() as runner:
        with torch.random.fork_rng():
            model = trainer.model
            if runner.compiled is not None:
                model = runner.compiled
                runner.run(model, inputs, None, lambda phase: None, contextlib.nullcontext)
                model.zero_grad(set_to_none=True)
                runner.restart()
            return measure_peak(model, inputs, runner=runner, warm_steps=warm_steps)


def trainer_on_cuda(refusal: str) -> None:
    """A Trainer's step validated on cuda: ``NO_GPU`` on a machine without one, else ``refusal`` (one line)."""
    if not torch.cuda.is_available():
        raise UsageError(NO_GPU)
    raise UsageError(refusal)


def validate_trainer(trainer: Any, inputs: Optional[UserInputs] = None, input_shape: Union[str, tuple, list, None] = None,
                     tolerance: Optional[float] = None, world_size: int = 1, rank: Optional[int] = None,
                     device: Union[str, torch.device] = "cpu", trainer_batch: str = "first") -> Validation:
    """``graphmem.validate(trainer)``: the prediction beside the Trainer's step run for real on the CPU by
    the same runner (first step, then a later one whose optimizer states exist before it). The model
    must be real (not on the meta device); its weights change (the real steps are optimizer steps).
    ``world_size`` > 1: each rank's (or ``rank``'s) step of the DDP job, beside a real gloo job of
    ``world_size`` CPU processes (graphmem/validation/trainer_ranks.py); the model is left as it was.
    No ``inputs``: the batch ``train()`` draws (``trainer_batch``, at ``input_shape`` when given), as analyze takes it.
    ``device="cuda"``: refused in one line (no GPU here: ``NO_GPU``; the real CUDA step is not run yet)."""
    if str(device).startswith("cuda"):
        trainer_on_cuda("validate runs a Trainer's step for real on the CPU only yet: drop `device='cuda'` "
                        "(graphmem.analyze(trainer, device='cuda') predicts its CUDA step)")
    check_trainer(trainer)
    check_ranks(trainer, world_size, rank)
    if any(p.is_meta for p in trainer.model.parameters()):
        raise UsageError("the Trainer's model is on the meta device; validate runs its step for real: build it on the CPU")
    if trainer.args.device.type != "cpu":
        raise UsageError("validate runs the Trainer's step on the CPU: set use_cpu=True in its TrainingArguments")
    tol = checked_tolerance(tolerance)
    if inputs is None:  # the batch train() draws, as analyze takes it (graphmem/frontends/trainer.py trainer_inputs)
        shape = shape_of(input_shape) if input_shape is not None else None
        if trainer.train_dataset is None and shape is not None:
            torch.manual_seed(0)  # the token samples made for the model
        inputs, _ = trainer_inputs(trainer, None, shape, trainer_batch, world_size, rank or 0)
    if world_size > 1:
        from graphmem.validation.trainer_ranks import validate_trainer_ranks

        return validate_trainer_ranks(trainer, inputs, world_size, rank, tol)
    report = analyze(trainer, inputs)
    with without_profiler_log():
        first, later = measure_trainer(trainer, inputs), measure_trainer(trainer, inputs, warm_steps=1)
    budget = report.budget
    assert budget is not None
    # Inductor's fused kernels and buffer reuse lower a compiled step's peak below its graphs run op by op
    # (docs/inductor.md), which graphmem does not model: its peaks are shown without a verdict
    peak = "info" if trainer.args.torch_compile and trainer.args.torch_compile_backend == "inductor" else "tolerance"
    rows = (Row("saved for backward", report.activation_bytes, first.saved_bytes, "exact", None),
            Row("before the step", report.baseline_bytes, first.baseline_bytes, "exact", None),
            Row("optimizer states", budget.row("optimizer states").size, first.state_bytes, "exact", None),
            Row("peak", budget.peak_bytes, first.peak_bytes, peak, None),
            Row("peak (later steps)", budget.rank.later_peak_bytes, later.peak_bytes, peak, None))
    judged, reason = judge(rows, tol)
    shapes = tuple(tuple(x.shape) for x in as_batch(inputs).tensors())
    return Validation(report.model, "cpu", shapes, tol, judged, reason, report)


__all__ = ["measure_trainer", "trainer_on_cuda", "validate_trainer"]
