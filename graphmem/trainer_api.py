"""``graphmem.analyze(trainer)``: a transformers ``Trainer``'s own step on fake tensors
(graphmem/training/hf_trainer.py runs it), and the batch it trains on.

The batch: ``inputs`` as given (a dict, as the Trainer's dataloader yields), else ``input_shape``'s
first dimension of samples collated by ``trainer.data_collator`` (so the collator's padding
decides the length): the first samples of ``trainer.train_dataset`` when it has one, else
token samples of ``input_shape`` made for the model (graphmem/capture/hf.py) split into rows.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import torch

from graphmem.capture.capture import capture
from graphmem.capture.hf import batch as hf_batch
from graphmem.capture.target import Target
from graphmem.errors import UsageError
from graphmem.passes import liveness, notes, saved
from graphmem.report import Report
from graphmem.training.batch import as_batch
from graphmem.training.hf_trainer import TrainerRunner, check_trainer, trainer_step
from graphmem.training.spec import Training, step_budget


def trainer_batch(trainer: Any, shape: tuple[int, ...]) -> dict[str, Any]:
    """``shape[0]`` samples through the Trainer's collator (as ``Trainer._get_dataloader`` sets it up:
    unused columns removed), from its train_dataset or made for its model at ``shape``."""
    b = shape[0]
    dataset = trainer.train_dataset
    collator = trainer.data_collator
    try:
        import datasets

        is_hf_dataset = isinstance(dataset, datasets.Dataset)
    except ImportError:
        is_hf_dataset = False
    if dataset is not None:
        if is_hf_dataset:
            dataset = trainer._remove_unused_columns(dataset, description="training")
        else:
            collator = trainer._get_collator_with_removed_columns(collator, description="training")
        if len(dataset) < b:
            raise UsageError(f"train_dataset has {len(dataset)} samples, fewer than the batch of {b}: give a "
                             "smaller input_shape or inputs=")
        samples = [dataset[i] for i in range(b)]
    else:
        made = hf_batch(trainer.model, shape)
        samples = [{k: v[i] for k, v in made.items()} for i in range(b)]
    out = collator(samples)
    if not hasattr(out, "items"):
        raise UsageError(f"the Trainer's data_collator returned {type(out).__name__}, not a dict of tensors: "
                         "pass inputs= (the batch dict the model takes)")
    return dict(out)


def analyze_trainer(trainer: Any, inputs: Any = None, input_shape: Union[str, tuple, list, None] = None) -> Report:
    """The step ``trainer.train()`` runs, on fake tensors: its optimizer (``args.optim``), clipping
    (``max_grad_norm``), ``gradient_accumulation_steps``, precision (``bf16``/``fp16`` through
    accelerate), gradient checkpointing; ``report.budget`` holds the whole step.

    >>> report = graphmem.analyze(trainer, input_shape=(8, 512))  # doctest: +SKIP
    >>> report.budget.peak_bytes, report.budget.rank.later_peak_bytes  # doctest: +SKIP
    """
    from graphmem.spec import shape_of as _shape_of

    check_trainer(trainer)
    if inputs is None:
        if input_shape is None:
            raise UsageError("no inputs: pass inputs= (a batch dict) or input_shape=(batch, seq) for the Trainer")
        inputs = trainer_batch(trainer, _shape_of(input_shape))
    batch = as_batch(inputs)
    if batch.form != "dict":
        raise UsageError("a Trainer's batch is a dict of keyword inputs (as its dataloader yields): pass inputs={...}")
    model = trainer.model
    target = Target(trainer.args.device.type)
    with TrainerRunner(trainer).session() as runner:
        g = capture(model, batch, None, target, runner=runner.run)
    lv, sv = liveness(g), saved(g)
    training = Training(trainer_step(trainer), None)
    plan = step_budget(g, lv, sv, training, model, ())
    shapes = tuple(s.shape for s in g.storages.values() if s.kind == "input")
    found = notes(g) + ("the loop is the transformers Trainer's own (training_step, accelerate's clipping, "
                        f"its optimizer and scheduler): {training.train.describe(target.device)}",)
    report = Report.build(g, lv, sv, type(model).__name__, shapes, "the Trainer's compute_loss", found, None, None,
                          budget=plan)
    return dataclasses.replace(report, source=None)


def measure_trainer(trainer: Any, inputs: Any, warm_steps: int = 0) -> Any:
    """The same step run for real on the CPU (graphmem/validation/measure.py with the Trainer's runner)."""
    from graphmem.validation.measure import measure_peak

    with TrainerRunner(trainer).session() as runner:
        with torch.random.fork_rng():
            return measure_peak(trainer.model, inputs, runner=runner, warm_steps=warm_steps)


def validate_trainer(trainer: Any, inputs: Any = None, input_shape: Union[str, tuple, list, None] = None,
                     tolerance: Optional[float] = None) -> Any:
    """``graphmem.validate(trainer)``: the prediction beside the Trainer's step run for real on the CPU by
    the same runner (first step, then a later one whose optimizer states exist before it). The model
    must be real (not on the meta device); its weights change (the real steps are optimizer steps)."""
    from graphmem.validation.result import Row, Validation, judge
    from graphmem.validation.validate import DEFAULT_TOLERANCE, _without_profiler_log

    check_trainer(trainer)
    if any(p.is_meta for p in trainer.model.parameters()):
        raise UsageError("the Trainer's model is on the meta device; validate runs its step for real: build it on the CPU")
    if trainer.args.device.type != "cpu":
        raise UsageError("validate runs the Trainer's step on the CPU: set use_cpu=True in its TrainingArguments")
    if inputs is None:
        if input_shape is None:
            raise UsageError("no inputs: pass inputs= (a batch dict) or input_shape=(batch, seq) for the Trainer")
        from graphmem.spec import shape_of as _shape_of

        torch.manual_seed(0)
        inputs = trainer_batch(trainer, _shape_of(input_shape))
    report = analyze_trainer(trainer, inputs)
    with _without_profiler_log():
        first, later = measure_trainer(trainer, inputs), measure_trainer(trainer, inputs, warm_steps=1)
    budget = report.budget
    assert budget is not None
    rows = (Row("saved for backward", report.activation_bytes, first.saved_bytes, "exact", None),
            Row("before the step", report.baseline_bytes, first.baseline_bytes, "exact", None),
            Row("optimizer states", budget.row("optimizer states").size, first.state_bytes, "exact", None),
            Row("peak", budget.peak_bytes, first.peak_bytes, "tolerance", None),
            Row("peak (later steps)", budget.rank.later_peak_bytes, later.peak_bytes, "tolerance", None))
    tol = DEFAULT_TOLERANCE if tolerance is None else float(tolerance)
    judged, reason = judge(rows, tol)
    shapes = tuple(tuple(x.shape) for x in as_batch(inputs).tensors())
    return Validation(report.model, "cpu", shapes, tol, judged, reason, report)


def trainer_from_file(model: Any, path: str) -> Any:
    """A ``transformers.Trainer`` around ``model`` with the TrainingArguments of a JSON or YAML file
    (``HfArgumentParser(TrainingArguments).parse_json_file`` / ``parse_yaml_file``). The model may be
    on the meta device (graphmem/capture/load.py): the arguments leave it where it is
    (``place_model_on_device``, the property TrainingArguments documents for overriding)."""
    import os

    from transformers import HfArgumentParser, Trainer, TrainingArguments

    @dataclasses.dataclass
    class InPlace(TrainingArguments):
        @property
        def place_model_on_device(self) -> bool:
            return False

    from graphmem.training.peft_lora import is_hf_model

    if not is_hf_model(model):
        raise UsageError(f"training_args builds a transformers Trainer around a Hugging Face model; {type(model).__name__} "
                         "is not one: give a Hugging Face config, hub id or preset (e.g. hf-gpt2, llama-3.1-8b)")
    if not os.path.isfile(path):
        raise UsageError(f"training_args {path!r}: no such file; give a JSON or YAML file of TrainingArguments")
    parser = HfArgumentParser(InPlace)  # type: ignore[arg-type]
    try:
        if path.endswith((".yaml", ".yml")):
            (args,) = parser.parse_yaml_file(path)
        else:
            (args,) = parser.parse_json_file(path)
    except Exception as e:  # a malformed file, an unknown field, a value TrainingArguments refuses
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"training_args {path!r} is not readable as TrainingArguments: {first}") from None
    return Trainer(model=model, args=args)


__all__ = ["analyze_trainer", "measure_trainer", "trainer_batch", "trainer_from_file", "validate_trainer"]
