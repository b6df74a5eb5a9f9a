"""The public entry point: ``graphmem.analyze``."""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional, Union

import torch
import torch.nn as nn

from graphmem.capture.capture import capture
from graphmem.capture.hf import HFOptions
from graphmem.capture.hf import batch as hf_inputs
from graphmem.capture.hf_batch import settings as hf_settings
from graphmem.capture.load import Loaded, from_exported, load, make_inputs, parse_shape
from graphmem.capture.reuse import capture_reusing
from graphmem.capture.target import Target, make_target
from graphmem.distributed import Sharding, make_sharding, wants_wrappers
from graphmem.distributed.pipeline import Pipeline, make_pipeline
from graphmem.distributed.tensor_parallel import tp_engine
from graphmem.distributed.view import rank_view
from graphmem.errors import UsageError
from graphmem.passes import allocator, compare_modes, liveness, notes, saved
from graphmem.recapture import Recapture, capture_rank_step, capture_stage_step, capture_step
from graphmem.report import Report
from graphmem.stepgraph import StepGraph
from graphmem.training.batch import as_batch, resizer
from graphmem.training.peft_lora import is_hf_model
from graphmem.training.spec import Training, make_training, units_of
from graphmem.training.step import LossFn

ModelLike = Union[nn.Module, str, "os.PathLike[str]"]


def _shape_of(shape: Union[str, tuple, list]) -> tuple[int, ...]:
    if isinstance(shape, str):
        return parse_shape(shape)
    dims = tuple(shape)
    if not dims or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
        raise UsageError(f"invalid input shape {shape!r}: expected positive integers, e.g. (32, 1024)")
    return dims


def analyze(
    model: ModelLike,
    inputs: Any = None,
    *,
    input_shape: Union[str, tuple, list, None] = None,
    loss: Optional[LossFn] = None,
    device: Union[str, torch.device] = "cpu",
    dtype: Optional[str] = None,
    amp: Optional[str] = None,
    attention: str = "auto",
    gpu: str = "h100",
    mode: str = "eager",
    memory_budget: Optional[float] = None,
    reuse: bool = True,
    optimizer: Optional[str] = None,
    optimizer_impl: str = "auto",
    master_weights: bool = False,
    micro_batches: int = 1,
    lora_rank: Optional[int] = None,
    lora_targets: Any = None,
    qlora: bool = False,
    world_size: int = 1,
    zero: int = 0,
    fsdp: Optional[str] = None,
    tp: int = 1,
    sp: bool = False,
    pp: int = 1,
    schedule: str = "1f1b",
    rank: Optional[int] = None,
    reshard_after_forward: bool = True,
    fsdp_param_dtype: Optional[str] = None,
    fsdp_reduce_dtype: Optional[str] = None,
    fsdp_offload: bool = False,
    fsdp_no_sync: bool = False,
    loss_parallel: bool = False,
    target: Optional[Target] = None,
    training: Optional[Training] = None,
    hf: Optional[HFOptions] = None,
) -> Report:
    """Analyze one training step (forward, loss, backward) on fake tensors.

    ``model`` is an nn.Module (real, or built under ``torch.device("meta")``; an fx.GraphModule
    is one), a ``torch.export.ExportedProgram`` (its example inputs are used when none are
    given), a path to a model file or a ``.pt2`` exported program, or a preset name. Give ``inputs`` (a tensor or tuple of tensors; only shapes
    and dtypes are used) or ``input_shape``. Nothing real is allocated and the module is left
    as it was. The target: ``device`` ("cpu" or "cuda"), ``dtype`` of the parameters ("fp32",
    "bf16", "fp16"), ``amp`` (autocast "bf16"/"fp16" with fp32 parameters), ``attention`` (the
    SDPA backend: "auto", "flash", "efficient", "cudnn", "math") and ``gpu`` ("h100", "a100", ...)
    for the CUDA backend rules. ``mode="compiled"`` predicts ``torch.compile(model)``'s step
    (AOTAutograd's graphs split by the min-cut partitioner, as the ``aot_eager`` backend runs
    them) and puts eager beside it in ``report.compiled``; ``memory_budget`` (0 to 1) sets
    torch.compile's ``activation_memory_budget`` for the partition (``report.memory_budgets``
    sweeps several values). ``reuse`` (default on): a chain of
    >= 16 identical blocks is captured at depth 5 and the other blocks copied, after a check at
    depth 6 (graphmem/capture/reuse.py), in eager and compiled mode (where the partition must
    also repeat at full depth; if not, every block is compiled and a note says why);
    ``reuse=False`` captures every block.

    The whole training step (graphmem/training/loop.py), reported as ``report.budget``: ``optimizer``
    ("sgd", "momentum", "adam", "adamw", "adafactor"; torch.optim, run after backward, then
    ``zero_grad``) with ``optimizer_impl`` ("auto", "foreach", "forloop", "fused"),
    ``master_weights`` (fp32 masters of 16-bit parameters), ``micro_batches`` (gradient
    accumulation), ``lora_rank``/``lora_targets`` (adapters on the named linear layers, the rest
    frozen), ``qlora`` (a Hugging Face model's linear layers in 4-bit NF4 with double quantization
    and bf16 compute through bitsandbytes, LoRA adapters through peft: graphmem/training/qlora.py),
    and per-rank budgets for ``world_size`` ranks with ``zero`` (1-3) or ``fsdp``
    ("full", "grad-op") and ``tp`` (tensor parallel, ``sp`` sequence parallel). ``pp`` > 1: the
    step of pipeline rank ``rank`` under torch.distributed.pipelining's ``schedule`` ("1f1b",
    "gpipe", "interleaved") with ``micro_batches`` micro-batches (graphmem/distributed/pipeline.py); docs/pipeline.md.

    Rank ``rank``'s step as PyTorch's own wrappers run it (graphmem/distributed/, docs/distributed.md):
    give ``rank`` or ``fsdp="fully_shard"``. ``fully_shard`` (FSDP2) wraps each block of the
    model's chain and the root over ``world_size // tp`` ranks, with ``reshard_after_forward``,
    ``fsdp_param_dtype``/``fsdp_reduce_dtype`` (MixedPrecisionPolicy) and ``fsdp_offload``
    (CPUOffloadPolicy), and ``fsdp_no_sync`` (with ``micro_batches``: ``set_requires_gradient_sync(False)``
    for all micro-batches but the last); ``tp``/``sp`` run DTensor's ``parallelize_module``; ``loss_parallel``
    leaves the LM head's logits split over the vocabulary into ``loss_parallel()``'s cross-entropy. ``optimizer``
    runs torch.optim over the wrapped DTensor parameters and ``micro_batches`` accumulate, as on one device. The report is that
    rank's (local shards; collective buffers in the "communication" category) and
    ``report.sharding`` puts the formula beside it.

    The keyword options are a convenience: they build a frozen ``Target``
    (graphmem/capture/target.py) and a frozen ``Training`` spec (graphmem/training/spec.py),
    checked once; pass ``target=`` / ``training=`` objects instead to reuse them.

    >>> import torch, graphmem
    >>> net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    >>> report = graphmem.analyze(net, (torch.randn(8, 16),))
    >>> report.activation_bytes          # input (512 B) + ReLU output (1024 B), saved for backward
    1536
    """
    if target is None:
        target = make_target(torch.device(device).type, dtype, amp, attention, gpu, mode, memory_budget)
    loaded = load(os.fspath(model), target=target, options=hf) if isinstance(model, (str, os.PathLike)) else None
    if isinstance(model, torch.export.ExportedProgram):
        loaded = from_exported(model)
        if inputs is None and input_shape is None and model.example_inputs:
            inputs = tuple(model.example_inputs[0])
    if loaded is None:
        if not isinstance(model, nn.Module):
            raise UsageError(f"model must be an nn.Module, a model file or a preset name, not {type(model).__name__}")
        hf_batch = None
        settings: dict[str, str] = {}
        if is_hf_model(model):  # --input-shape makes the batch its forward takes (graphmem/capture/hf_batch.py)
            o = hf or HFOptions()
            hf_batch = lambda shape: hf_inputs(model, shape, o.decoder_length, o.padding, o.use_cache)  # noqa: E731
            settings = hf_settings(model, o.padding, o.use_cache)
        loaded = Loaded(type(model).__name__, model, hf_batch, None, batch_settings=settings)
    if inputs is None:
        if input_shape is None:
            raise UsageError("no inputs: pass example inputs or input_shape=(batch, ...) / --input-shape 32x1024")
        shape = _shape_of(input_shape)
        make: Any = lambda: make_inputs(loaded, shape)
        resize: Any = lambda s: make_inputs(loaded, s)
    else:
        make = as_batch(inputs)
        resize = resizer(make)
    loss_fn = loss or loaded.loss
    if loaded.dtype is not None and target.dtype is None and target.amp is None:
        target = dataclasses.replace(target, dtype=loaded.dtype)  # an HF config's torch_dtype
    if target.attention == "eager" and not is_hf_model(loaded.module):
        raise UsageError("--attention eager picks a Hugging Face model's own attention; this model is not one: "
                         "use math for SDPA's explicit kernel")
    if pp != 1 or schedule != "1f1b":  # rank r's stage under torch's pipeline schedules (graphmem/distributed/pipeline.py)
        training = training or make_training(dtype, optimizer, optimizer_impl, master_weights, micro_batches, lora_rank,
                                             lora_targets, world_size, zero, fsdp, tp, sp)
        return _made(_pipeline_stage(loaded, make, loss_fn, target, training, make_pipeline(
            pp, rank if rank is not None else 0, schedule, training.train.micro_batches)), loaded, inputs)
    if wants_wrappers(rank, fsdp, reshard_after_forward, fsdp_param_dtype, fsdp_reduce_dtype, fsdp_offload, fsdp_no_sync,
                      loss_parallel):
        training = training or make_training(dtype, optimizer, optimizer_impl, master_weights, micro_batches, lora_rank,
                                             lora_targets, quantization="nf4" if qlora else None)
        sharding = make_sharding(world_size, rank or 0, fsdp == "fully_shard", reshard_after_forward, fsdp_param_dtype,
                                 fsdp_reduce_dtype, fsdp_offload, tp, sp, fsdp_no_sync, training, loss_parallel)
        return _made(_per_rank(loaded.name, loaded.module, make, loss_fn, target, sharding,
                               bool(zero) or fsdp in ("full", "grad-op"), training, reuse), loaded, inputs)
    if training is None:
        training = make_training(dtype, optimizer, optimizer_impl, master_weights, micro_batches, lora_rank,
                                 lora_targets, world_size, zero, fsdp, tp, sp, quantization="nf4" if qlora else None)
    if training.quantization is not None and target.mode == "compiled":
        raise UsageError("--qlora is analyzed in eager mode (bitsandbytes' ops under torch.compile are not traced "
                         "here): drop --mode compiled")
    step = capture_step(loaded.module, make, loss_fn, target, training, reuse)
    g, module = step.graph, step.module
    shapes = tuple(g.storages[n.meta["storage"]].shape for n in g.placeholders if n.meta.get("kind") == "input")
    loss_name = "default (the model's own loss if its output has one, else the output if scalar, else the sum of floating outputs)" if loss_fn is None else getattr(loss_fn, "__qualname__", "custom")
    example = tuple(g.storages[n.meta["storage"]] for n in g.placeholders if n.meta.get("kind") == "input")
    source: Optional[Recapture] = None
    if example:
        probe = tuple(torch.empty(s.shape, dtype=getattr(torch, s.dtype), device="meta") for s in example)
        source = Recapture(module, resize, loss_fn, step.target, probe, example[0].shape, training,
                           original=loaded.module, reuse=reuse, asked_target=target)
    alloc = allocator(g) if target.device == "cuda" else None  # the caching allocator's view of the step
    found = notes(g)
    if step.reuse_note and target.mode == "compiled":
        found += (f"depth reuse not taken ({step.reuse_note}): every block was compiled and captured",)
    report = Report.build(g, step.liveness, step.saved, loaded.name, shapes, loss_name, found, source, alloc,
                          budget=step.budget)
    if target.mode == "compiled":  # eager beside it: saved bytes per module, what was recomputed
        report = _beside_eager(report, loaded.module, make, loss_fn, step.eager if step.module is loaded.module else None)
    return _made(report, loaded, inputs)


def _made(report: Report, loaded: Loaded, inputs: Any) -> Report:
    """``report`` naming the choices graphmem made in the batch it built for an input shape
    (a Hugging Face model's padding and use_cache: graphmem/capture/hf_batch.py)."""
    if inputs is not None or not loaded.batch_settings:
        return report
    return dataclasses.replace(report, batch=dict(loaded.batch_settings))


def _pipeline_stage(loaded: Loaded, inputs: Any, loss_fn: Optional[LossFn], target: Target, training: Training,
                    plan: Pipeline) -> Report:
    step, found, _ = capture_stage_step(loaded.module, inputs, loss_fn, target, training, plan)
    shapes = tuple(s.shape for s in step.graph.storages.values() if s.kind == "input")
    return Report.build(step.graph, step.liveness, step.saved, loaded.name, shapes, "pipeline stage loss", found,
                        budget=step.budget, sharding=plan)


def _per_rank(name: str, module: nn.Module, make: Any, loss_fn: Optional[LossFn], target: Target,
              sharding: Sharding, formula: Any, training: Training, reuse: bool) -> Report:
    """Rank r's step through the real wrappers (graphmem/recapture.py ``capture_rank_step``), with the
    per-rank formula over the single-device step beside it (graphmem/distributed/view.py)."""
    if formula:
        raise UsageError("--zero and --fsdp full|grad-op are the per-rank formulas; --rank and bare --fsdp run "
                         "PyTorch's wrappers: give one or the other")
    step = capture_rank_step(module, make, loss_fn, target, sharding, training, reuse)
    g, module, lv, sv = step.graph, step.module, step.liveness, step.saved
    slow = (f"depth reuse not taken ({step.reuse_note}): every block was captured",) if step.reuse_note else ()
    shapes = tuple(g.storages[n.meta["storage"]].shape for n in g.placeholders if n.meta.get("kind") == "input")
    train = training.train if training.train.active else None
    single_at: Any = lambda: capture(module, make, loss_fn, step.target, train=train)  # noqa: E731
    single = capture_reusing(module, single_at)[0] if reuse and train is None else single_at()
    view = rank_view(g, lv, sv, sharding, (single, liveness(single), saved(single)), units_of(module), tp_engine(module))
    loss_name = "default" if loss_fn is None else getattr(loss_fn, "__qualname__", "custom")
    alloc = allocator(g) if step.target.device == "cuda" else None
    plan = dataclasses.replace(step.budget, whose=view.describe()) if step.budget is not None else None
    return Report.build(g, lv, sv, name, shapes, loss_name, notes(g) + slow + view.lines(), None, alloc, budget=plan,
                        sharding=view)


def _beside_eager(report: Report, model: nn.Module, inputs: Any, loss_fn: Optional[LossFn],
                  eager: Optional[StepGraph] = None) -> Report:
    """``report`` (compiled mode) with ``compiled``: the same step captured eagerly, side by side
    (``eager``: already captured by compiled depth reuse's check, graphmem/capture/reuse_compiled.py)."""
    g = report.step
    assert g is not None  # analyze keeps the step graph
    if eager is None:
        eager_target = dataclasses.replace(g.target, mode="eager")
        eager = capture_reusing(model, lambda: capture(model, inputs, loss_fn, eager_target)).graph
    return dataclasses.replace(report, compiled=compare_modes(g, saved(g), saved(eager)))
