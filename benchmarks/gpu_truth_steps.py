"""Both sides of one row of benchmarks/gpu_truth.py: graphmem's CUDA target on fake tensors
(``predict``) and a real CUDA training step of the same model and batch (``measure_cuda``).

What is compared, and how each real figure is read:

- saved bytes: ``torch.autograd.graph.saved_tensors_hooks`` around a real forward + loss,
  distinct storages, parameters and buffers excluded (graphmem/validation/measure.py
  ``measure_saved``, the CPU truth's own code: storages are storages on any device), against
  ``report.activation_bytes``. Expected: 0 B apart.
- peak allocated: one warm-up step (cuBLAS/cuDNN workspaces and, compiled, the compilation are
  made there and stay), ``empty_cache``, ``reset_peak_memory_stats``, the measured step;
  ``torch.cuda.max_memory_allocated`` minus ``memory_allocated`` at its start (the step's rise)
  against the caching-allocator model's rise over the same step (passes/allocator.py: its
  ``max_allocated`` minus what it holds once parameters, buffers and inputs exist), as
  graphmem/validation/validate.py compares them. graphmem's exact ``peak_bytes`` (no 512 B
  rounding) is printed beside it.
- peak reserved: ``max_memory_reserved`` minus ``memory_reserved`` at the start of the measured step
  (after ``empty_cache``: the segments that still hold parameters, inputs and workspaces) against the
  model's ``max_reserved`` minus its reserved bytes once parameters, buffers and inputs exist.

The real side runs the step exactly as graphmem/training/step.py ``run_step`` does (forward and
loss inside the target's context, backward outside it): CUDA autocast for ``amp``, SDPA under
``torch.nn.attention.sdpa_kernel`` for a named backend, ``torch.compile(backend="aot_eager")``
for compiled mode. Why aot_eager and not inductor: graphmem's compiled mode predicts
AOTAutograd's min-cut partition run op by op (the graphs the aot_eager backend runs); inductor
partitions the same way but then fuses kernels and plans its own buffers (reusing storage inside
a graph), so its intermediate peaks are not the graphs graphmem replays (docs/inductor.md).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.nn as nn
from gpu_truth_zoo import VARIANTS, Variant, build

import graphmem
from graphmem.training.step import run_step
from graphmem.validation.measure import measure_saved

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Side:
    """One side's figures (bytes); the peaks are rises over the bytes live before the step."""

    saved: int
    peak_exact: int  # graphmem: report.peak_bytes - baseline; real: the same as peak_allocated
    peak_allocated: int  # rise of max_memory_allocated over the step start
    peak_reserved: int  # rise of max_memory_reserved over the step start
    seconds: float
    note: str = ""


def predict(model: nn.Module, inputs: tuple, variant: Variant, gpu: str = "h100") -> Side:
    """graphmem's CUDA target on fake tensors (CUDA rules on the CPU: no GPU is used)."""
    start = time.perf_counter()
    report = graphmem.analyze(model, inputs, device="cuda", gpu=gpu, **variant.options())
    alloc = report.cuda_allocator
    assert report.step is not None and alloc is not None  # the CUDA target always models the allocator
    first = sum(1 for s in report.step.storages.values() if s.created == -1 and s.nbytes)
    held, reserved = alloc.timeline[first - 1] if first else (0, 0)  # parameters, buffers, inputs
    backends = ", ".join(f"{k} x{n}" for k, n in sorted(report.attention_backends.items()))
    return Side(report.activation_bytes, report.peak_bytes - report.baseline_bytes, alloc.max_allocated - held,
                alloc.max_reserved - reserved, time.perf_counter() - start, backends)


def error_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"error: {type(e).__name__}: {text.splitlines()[0] if text else ''}"




def predict_row(model: str, variant: str, gpu: str) -> Any:
    """``predict`` of a zoo row by name (a process pool's task): a Side, or the error's first line."""
    try:
        side = predict(*build(model), VARIANTS[variant], gpu)
    except Exception as e:  # noqa: BLE001 - the table names every failure
        return error_line(e)
    return side


def _context(variant: Variant) -> Callable[[], ContextManager[Any]]:
    """Forward and loss's context on the real side: CUDA autocast and the SDPA backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "math": SDPBackend.MATH, "cudnn": SDPBackend.CUDNN_ATTENTION}.get(variant.attention)

    @contextlib.contextmanager
    def context() -> Any:
        with contextlib.ExitStack() as stack:
            if variant.amp is not None:
                stack.enter_context(torch.autocast("cuda", dtype=_DTYPES[variant.amp]))
            if backend is not None:
                stack.enter_context(sdpa_kernel([backend]))
            yield
    return context


def _to_cuda(model: nn.Module, inputs: tuple, dtype: Optional[torch.dtype]) -> tuple[nn.Module, tuple]:
    dev = torch.device("cuda")
    model = model.to(dev) if dtype is None else model.to(dev, dtype)

    def move(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        return x.to(dev, dtype) if dtype is not None and x.is_floating_point() else x.to(dev)
    return model, tuple(move(x) for x in inputs)


def measure_cuda(model: nn.Module, inputs: tuple, variant: Variant) -> Side:
    """A real CUDA step of ``model`` (built on the CPU) under ``variant``; see the module docstring.
    The model, its batch and (compiled) dynamo's caches are dropped afterwards."""
    start = time.perf_counter()
    torch._dynamo.reset()
    try:
        saved, allocated, reserved = _measure(*_to_cuda(model, inputs, _DTYPES[variant.dtype] if variant.dtype else None),
                                              variant)
    finally:
        del model, inputs
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return Side(saved, allocated, allocated, reserved, time.perf_counter() - start)


def _measure(model: nn.Module, batch: tuple, variant: Variant) -> tuple[int, int, int]:
    """(saved bytes, rise of max allocated, rise of max reserved) of the step on the GPU."""
    step_fn: Any = torch.compile(model, backend="aot_eager") if variant.mode == "compiled" else model
    context = _context(variant)
    model.train()

    def step() -> None:
        model.zero_grad(set_to_none=True)
        out, loss = run_step(step_fn, batch, None, forward_context=context)
        del out, loss
        torch.cuda.synchronize()

    step()  # warm-up: workspaces, handles and (compiled) the compilation
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    step()
    allocated = torch.cuda.max_memory_allocated() - before
    rise_reserved = torch.cuda.max_memory_reserved() - reserved
    model.zero_grad(set_to_none=True)
    saved = measure_saved(step_fn, batch, None, forward_context=context)
    model.zero_grad(set_to_none=True)
    return saved, allocated, rise_reserved
