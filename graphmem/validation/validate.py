"""``graphmem.validate``: the final REAL run. One training step is predicted on fake tensors
(``graphmem.analyze``), then run for real on the CPU or a GPU, and the numbers are put side by
side: saved-for-backward bytes must match exactly, the peak within a tolerance (the rows and
their verdicts: graphmem/validation/result.py).

What is compared (the same step, graphmem/training/step.py, in train mode with ``.grad`` unset):

- CPU (graphmem/validation/measure.py): saved bytes from ``saved_tensors_hooks`` (distinct storages,
  parameters excluded) — exact; the bytes live before the step (parameters, buffers, inputs) —
  exact; the peak from the CPU allocator's own events (torch.profiler) plus those bytes. The
  prediction may be below the real peak by the scratch a kernel allocates inside one op
  (oneDNN convolution workspaces: ~2.5 % for ResNets, ``--tolerance 2.5``) and is never above it.
- CUDA: a warm-up step first (cuBLAS/cuDNN create their workspaces and handles; they stay
  allocated and are not part of the step), then ``reset_peak_memory_stats`` and the measured
  step. ``peak allocated`` compares ``torch.cuda.max_memory_allocated()`` with the allocated
  bytes at the start of the measured step plus the rise that the caching-allocator model
  (passes/allocator.py) predicts over the step; the before-step bytes (which hold the
  workspaces) and the reserved peak (the real cache was shaped by building the model and the
  warm-up, the model's starts empty) are shown for information and have no verdict.

Validate allocates the real model, so it first refuses a step whose predicted peak exceeds a
safety budget (half of the available RAM; 90 % of the free GPU memory for CUDA, where running
out is an error, not a machine in swap).
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, ContextManager, Iterator, Mapping, Optional, Union

import torch
import torch.nn as nn

import graphmem.validation.measure as measure  # called through the module: tests patch it
from graphmem.api import analyze
from graphmem.capture.hf import HFOptions
from graphmem.capture.load import Loaded, load, parse_shape
from graphmem.capture.target import DTYPES, GPUS, Target
from graphmem.errors import UsageError, check_keywords
from graphmem.frontends.door import FSDP_TRAINER, TRAINER
from graphmem.noise import quiet
from graphmem.passes.allocator import AllocatorResult, allocator
from graphmem.report.live import Analysis
from graphmem.step.spec import ModelLike, UserInputs, shape_of, spec_keywords
from graphmem.training.batch import Batch, as_batch
from graphmem.training.hf_trainer import is_trainer
from graphmem.training.spec import Training
from graphmem.training.step import LossFn, run_step
from graphmem.units import fmt_bytes
from graphmem.validation.profiler_log import without_profiler_log
from graphmem.validation.real import RAM_SHARE, available_memory
from graphmem.validation.real import prepared as _prepared
from graphmem.validation.real import real_inputs as _inputs
from graphmem.validation.real import to_device as _to
from graphmem.validation.result import NO_GPU, Row, Validation, ValidationError, checked_tolerance, judge

GPU_SHARE = 0.9  # of the free device memory: an OOM there is an exception, not a frozen machine



@quiet  # third-party warnings about graphmem's own work, not the user's step (graphmem/noise.py)
def validate(
    model: Union[nn.Module, str, "os.PathLike[str]"],
    inputs: Optional[UserInputs] = None,
    *,
    input_shape: Union[str, tuple, list, None] = None,
    loss: Optional[LossFn] = None,
    device: Union[str, torch.device] = "cpu",
    tolerance: Optional[float] = None,
    hf: Optional[HFOptions] = None,
    **options: Any,
) -> Validation:
    """Predict one training step on fake tensors, run it for real, compare.

    ``options``: the step's loop, as ``graphmem.analyze`` takes it (``optimizer``, ``optimizer_impl``,
    ``master_weights``, ``micro_batches``, ``dtype``, ``amp``, ``lora_rank``/``lora_targets``/``lora_alpha``):
    the real run is that loop (graphmem/training/loop.py, the one the capture runs), with the
    optimizer's states, the later steps' peak (a second real step, the first unmeasured) and the
    peak compared. ``world_size`` with ``fsdp="fully_shard"`` and/or ``tp``/``sp`` (``rank``: that rank only,
    else every rank) runs each rank's step for real in gloo CPU processes, wrapped by the same call as the
    per-rank analysis, rows per rank (graphmem/validation/ranks.py); ``zero``, ``fsdp="full"``/``"grad-op"``
    (formulas), ``pp`` and ``fsdp_offload`` are refused in one line.

    ``inputs``: a tuple, a dict (``model(**inputs)``, as Hugging Face loops call it) or
    ``(args, kwargs)``. ``model``: a model file or preset (built for real on ``device`` after the prediction fits
    the memory budget) or a real nn.Module on ``device`` (used as it is; its train/eval flags
    and ``.grad`` are restored afterwards, its weights are never changed). ``tolerance``: the
    allowed peak gap in percent of the measured peak (default 1; CPU convnets need ~2.5).

    >>> import torch, graphmem
    >>> net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    >>> v = graphmem.validate(net, (torch.randn(8, 16),))
    >>> v.ok, v.row("saved for backward").difference
    (True, 0)
    """

    if is_trainer(model) or "training_args" in options:  # the Trainer's own step (graphmem/frontends/trainer.py)
        return _trainer(model, inputs, input_shape, loss, device, tolerance, hf, options)
    check_keywords(options, spec_keywords() | {"tolerance"}, "graphmem.validate")
    dev, tol = _device(device), checked_tolerance(tolerance)
    if inputs is None and input_shape is None:
        raise UsageError("no inputs: pass example inputs or `input_shape='32x1024'`")
    shape = _shape(input_shape) if inputs is None else None
    given = None if inputs is None else as_batch(inputs)
    if any(k in options for k in _PARALLEL):  # rank r's step through the wrappers, on real gloo ranks
        return _ranks(model, given, shape, loss, dev, tol, hf, options)
    _check_loop(options)

    report, loaded, source = _predict(model, given, shape, loss, dev, hf, options)
    measured, shapes = _real(report, loaded, given, shape, loss, dev, hf, source)
    convs = report.step is not None and any("convolution" in str(op.target) for op in report.step.ops)
    hint = " (CPU convnets need ~2.5 %, oneDNN scratch: --tolerance 2.5)" if dev.type == "cpu" and convs and tol < 2.5 else ""
    rows, reason = judge(measured, tol, hint)
    return Validation(report.model, str(dev), shapes, tol, rows, reason, report)


def _trainer(model: Any, inputs: Optional[UserInputs], input_shape: Union[str, tuple, list, None], loss: Optional[LossFn],
             device: Union[str, torch.device], tolerance: Optional[float], hf: Optional[HFOptions],
             options: dict[str, Any]) -> Validation:
    """A transformers Trainer (its own step, real on the CPU: graphmem/validation/trainer.py), or a model with
    FSDP ``training_args``, built per rank (graphmem/validation/trainer_fsdp.py)."""
    if is_trainer(model):
        from graphmem.validation.trainer import validate_trainer

        unknown = sorted(set(options) - (TRAINER - {"input_shape", "device"}))  # (validate's own parameters)
        if unknown:
            raise UsageError(f"a Trainer's step is set by its TrainingArguments, not {', '.join(f'`{k}`' for k in unknown)}"
                             ": drop it (`world_size`/`rank` validate its DDP ranks)")
        return validate_trainer(model, inputs, input_shape, tolerance, device=device, **options)
    from graphmem.validation.deepspeed_ranks import validate_deepspeed_trainer
    from graphmem.validation.trainer_fsdp import validate_fsdp_ranks

    unknown = sorted(set(options) - (FSDP_TRAINER - {"input_shape"}))
    if unknown or loss is not None or hf is not None:
        raise UsageError("a Trainer's step is set by its TrainingArguments: give `training_args`, `world_size`, `rank` "
                         "(and `trainer_class`) only")
    if getattr(options["training_args"], "deepspeed", None) is not None:  # DeepSpeed through accelerate, per rank
        return validate_deepspeed_trainer(model, options["training_args"], inputs, input_shape,
                                          checked_tolerance(tolerance), options.get("world_size", 1), options.get("rank"),
                                          options.get("trainer_class"))
    return validate_fsdp_ranks(model, options["training_args"], inputs, input_shape, tolerance,
                               options.get("world_size", 1), options.get("rank"), options.get("trainer_class"))


def _predict(model: ModelLike, given: Optional[Batch], shape: Optional[tuple[int, ...]], loss: Optional[LossFn],
             dev: torch.device, hf: Optional[HFOptions],
             options: dict[str, Any]) -> tuple[Analysis, Optional[Loaded], Optional[str]]:
    """The prediction, refused if it would not fit the real run's memory; the model as given (a real module) or
    the file or preset to build once it fits."""
    if isinstance(model, nn.Module):
        _check_real(model, dev)
        report = analyze(model, given, input_shape=shape, loss=loss, **_target(dev), **options)
        _check_budget(report, dev, resident=report.parameter_bytes + report.buffer_bytes)
        return report, Loaded(type(model).__name__, model, None, None), None
    if isinstance(model, (str, os.PathLike)):
        source = os.fspath(model)
        report = analyze(source, given, input_shape=shape, loss=loss, hf=hf, **_target(dev), **options)
        _check_budget(report, dev, resident=0)  # nothing real exists yet
        return report, None, source
    raise UsageError(f"model must be an nn.Module, a model file or a preset name, not {type(model).__name__}")


def _real(report: Analysis, loaded: Optional[Loaded], given: Optional[Batch], shape: Optional[tuple[int, ...]],
          loss: Optional[LossFn], dev: torch.device, hf: Optional[HFOptions],
          source: Optional[str]) -> tuple[tuple[Row, ...], tuple[tuple[int, ...], ...]]:
    """The real step beside the prediction: the model built (a file or preset, ``spec``) or used as given, the
    same inputs, the same loop; what it measured and the input shapes."""
    assert report.source is not None  # one device's step
    training, target = report.source.spec.training, report.source.spec.target

    with _rng(dev):
        torch.manual_seed(0)  # deterministic weights and inputs (values never change the bytes)
        if loaded is None:
            assert source is not None
            loaded = _build(source, dev, report, hf)
        real = given.map(lambda x: _to(x, dev)) if given is not None else _inputs(loaded, shape or (), dev)
        shapes = tuple(tuple(x.shape) for x in real.tensors())
        if shapes != tuple(report.input_shapes):
            raise ValidationError(f"the real inputs have shapes {shapes}, the analyzed ones {report.input_shapes}; "
                                  "example_inputs(shape) must return the same shapes every time")
        loss_fn = loss or loaded.loss
        with _restored(loaded.module):
            module = _prepared(loaded.module, training, target)
            measured = _cpu(report, module, real, loss_fn, training, target) if dev.type == "cpu" else \
                _cuda(report, module, real, loss_fn, dev, training, target)
    return measured, shapes


# -- the real model and inputs ----------------------------------------------------------------

_PARALLEL = ("world_size", "zero", "fsdp", "tp", "sp", "pp", "schedule", "rank", "reshard_after_forward",
             "fsdp_param_dtype", "fsdp_reduce_dtype", "fsdp_offload", "fsdp_no_sync", "loss_parallel", "parallel",
             "deepspeed")


def _ranks(model: ModelLike, given: Optional[Batch], shape: Optional[tuple[int, ...]], loss: Optional[LossFn],
           dev: torch.device, tol: float, hf: Optional[HFOptions], options: dict[str, Any]) -> Validation:
    """Rank r's step through fully_shard/parallelize_module (graphmem/validation/ranks.py) or DeepSpeed's engine
    (graphmem/validation/deepspeed_ranks.py), run on real gloo ranks."""
    from graphmem.validation.deepspeed_ranks import validate_deepspeed
    from graphmem.validation.ranks import validate_ranks

    if dev.type != "cpu":
        raise UsageError("validate runs the ranks' real steps as CPU processes over gloo: use `device='cpu'`")
    if isinstance(model, nn.Module):
        _check_real(model, dev)
    if options.get("deepspeed") is not None:
        return validate_deepspeed(model, given, shape, loss, hf, tol, options)
    return validate_ranks(model, given, shape, loss, hf, tol, options)


def _check_loop(options: Mapping[str, object]) -> None:
    if options.get("qlora") or options.get("quantization"):
        raise UsageError("validate does not run QLoRA's 4-bit step for real yet (its real CPU steps are "
                         "tests/trainers/test_qlora.py's): drop `qlora`")


def _device(device: Union[str, torch.device]) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UsageError(f"invalid device {device!r}: expected cpu or cuda") from None
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"validate runs on cpu or cuda, not {dev.type}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(NO_GPU)
        dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
    return dev


def _target(dev: torch.device) -> dict[str, Any]:
    """analyze()'s target for this device; for CUDA, the GPU generation actually present (its
    SDPA backend rules decide what attention saves)."""
    if dev.type == "cpu":
        return {"device": "cpu"}

    cap = torch.cuda.get_device_capability(dev)
    known = sorted((c, name) for name, c in GPUS.items() if c <= cap)  # exact match, else the closest older one
    exact = [name for c, name in known if c == cap]
    return {"device": "cuda", "gpu": exact[0] if exact else known[-1][1] if known else "v100"}


def _cuda_model(report: Analysis) -> AllocatorResult:
    """The caching-allocator model's result for the predicted step (analyze computes it for the
    CUDA target)."""

    assert report.step is not None
    return getattr(report, "cuda_allocator", None) or allocator(report.step)


def _shape(input_shape: Union[str, tuple, list, None]) -> tuple[int, ...]:
    return parse_shape(input_shape) if isinstance(input_shape, str) else shape_of(input_shape)  # type: ignore[arg-type]


def _check_real(module: nn.Module, dev: torch.device) -> None:
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if t.device.type == "meta":
            raise UsageError(f"{name} is on the meta device: a real run needs real weights; pass a real module, "
                             "or the model file / preset name, which validate builds for real")
        if t.device.type != dev.type:
            raise UsageError(f"{name} is on {t.device} but the run is on {dev}; move the module with "
                             f".to({dev.type!r}) or validate with device={t.device.type!r}")


def _build(spec: str, dev: torch.device, report: Optional[Analysis] = None, hf: Optional[HFOptions] = None) -> Loaded:
    """The model built for real on ``dev`` from its preset or model file.

    Why rebuild rather than ``load(spec).module.to_empty(device)`` and re-initialize: the
    model's own ``__init__`` also computes non-persistent buffers (LLaMA's RoPE cos/sin, GPT-2's
    causal mask, position-id tables used for indexing) that ``to_empty`` would leave as garbage
    and no generic initializer can recompute; rebuilding gives exactly the buffers, weight
    tying and init a user's training run would have. ``load`` (meta) has already run during
    the prediction, so the file is known to be well formed here."""
    target = report.step.target if report is not None and report.step is not None else None  # an HF model's dtype, attention
    return load(spec, device=str(dev), target=target, options=hf)


@contextlib.contextmanager
def _rng(dev: torch.device) -> Iterator[None]:
    """Seed freely without changing the caller's random streams."""
    with torch.random.fork_rng(devices=[dev.index] if dev.type == "cuda" else []):
        yield


@contextlib.contextmanager
def _restored(module: nn.Module) -> Iterator[None]:
    """A user's module comes back with its train/eval flags and ``.grad`` as they were."""
    modes = [(m, m.training) for m in module.modules()]
    grads = [(p, p.grad) for p in module.parameters()]
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training
        for p, g in grads:
            p.grad = g


# -- the memory budget ------------------------------------------------------------------------

def _check_budget(report: Analysis, dev: torch.device, resident: int) -> None:
    """Refuse (UsageError) a real step that could exhaust the machine. ``resident``: bytes that
    already exist (a real module's weights) and so need no new memory."""
    if dev.type == "cpu":
        needed, free, share, what = report.peak_bytes - resident, available_memory(), RAM_SHARE, "available RAM"
    else:
        needed = _cuda_model(report).max_reserved - resident
        free, share, what = torch.cuda.mem_get_info(dev)[0], GPU_SHARE, f"free memory on {dev}"
    budget = int(free * share)
    if needed <= budget:
        return
    fixed = report.baseline_bytes - report.input_bytes + report.gradient_bytes - resident
    shapes = ", ".join("x".join(map(str, s)) for s in report.input_shapes)
    hint = ("the weights and gradients alone exceed it: validate a smaller configuration of the model"
            if fixed > budget else f"use a smaller --input-shape than {shapes}, e.g. {_smaller(report)}")
    raise UsageError(f"a real step of {report.model} needs about {fmt_bytes(needed)} ({needed:,} B), over the "
                     f"safety budget of {fmt_bytes(budget)} ({share:.0%} of the {fmt_bytes(free)} {what}); {hint}")


def _smaller(report: Analysis) -> str:
    dims = list(report.input_shapes[0]) if report.input_shapes else [1]
    i = 0 if dims[0] > 1 else len(dims) - 1
    dims[i] = max(1, dims[i] // 2)
    return "x".join(map(str, dims))


# -- the measurements -------------------------------------------------------------------------

def _cpu(report: Analysis, module: nn.Module, inputs: Batch, loss_fn: Optional[LossFn], training: Training,
         target: Target) -> tuple[Row, ...]:
    train = training.train if training.train.active else None
    amp = DTYPES[target.amp] if target.amp else None
    with without_profiler_log():  # the step under the profiler, then the saved set
        real = measure.measure_peak(module, inputs, loss_fn, train=train, amp=amp)
    rows = (Row("saved for backward", report.activation_bytes, real.saved_bytes, "exact", None),
            Row("before the step", report.baseline_bytes, real.baseline_bytes, "exact", None),
            Row("peak", report.peak_bytes, real.peak_bytes, "tolerance", None))
    if train is None or train.optimizer is None or report.budget is None:
        return rows
    with without_profiler_log():  # a second step: the optimizer's states exist before it
        later = measure.measure_peak(module, inputs, loss_fn, train=train, warm_steps=1, amp=amp)
    b = report.budget.rank
    return rows + (Row("optimizer states", b.row("optimizer states").size, later.state_bytes, "exact", None),
                   Row("peak (later steps)", b.later_peak_bytes, later.peak_bytes, "tolerance", None))


def _cuda(report: Analysis, module: nn.Module, inputs: Batch, loss_fn: Optional[LossFn],
          dev: torch.device, training: Training, target: Target) -> tuple[Row, ...]:
    assert report.step is not None
    if training.train.active:
        raise UsageError("validate on cuda runs forward and backward only yet (the warm-up step would leave the "
                         "optimizer's states behind): drop `optimizer`/`micro_batches`, or validate on `device='cpu'`")
    amp = DTYPES[target.amp] if target.amp else None
    context: Callable[[], ContextManager[object]] = (lambda: torch.autocast("cuda", dtype=amp)) if amp is not None else contextlib.nullcontext
    model = _cuda_model(report)  # the caching allocator replayed over the predicted step
    first = sum(1 for s in report.step.storages.values() if s.created == -1 and s.nbytes)
    model_before = model.timeline[first - 1][0] if first else 0  # parameters, buffers, inputs

    module.train()

    def step() -> None:
        module.zero_grad(set_to_none=True)
        for x in inputs.tensors():
            if x.grad is not None:
                x.grad = None
        out, loss = run_step(module, inputs, loss_fn, forward_context=context)
        del out, loss
        torch.cuda.synchronize(dev)

    step()  # warm-up: workspaces and handles are created here and stay allocated
    module.zero_grad(set_to_none=True)
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    step()
    max_allocated, max_reserved = torch.cuda.max_memory_allocated(dev), torch.cuda.max_memory_reserved(dev)
    module.zero_grad(set_to_none=True)
    saved = measure.measure_saved(module, inputs, loss_fn)  # storages are storages on any device
    return (Row("saved for backward", report.activation_bytes, saved, "exact", None),
            Row("allocated before the step", model_before, before, "info", None),
            Row("peak allocated", before + model.max_allocated - model_before, max_allocated, "tolerance", None),
            Row("peak reserved", model.max_reserved, max_reserved, "info", None))
