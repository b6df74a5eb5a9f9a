"""The public entry point: ``graphmem.analyze``."""
from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch
import torch.nn as nn

from graphmem.passes import liveness, notes, saved

from .capture import capture
from .errors import UsageError
from .load import Loaded, load, make_inputs, parse_shape
from .report import Report
from .step import LossFn

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
) -> Report:
    """Analyze one training step (forward, loss, backward) on fake tensors.

    ``model`` is an nn.Module (real, or built under ``torch.device("meta")``), a path to a
    model file, or a preset name. Give ``inputs`` (a tensor or tuple of tensors; only shapes
    and dtypes are used) or ``input_shape``. Nothing real is allocated and the module is left
    as it was.

    >>> import torch, graphmem
    >>> net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    >>> report = graphmem.analyze(net, (torch.randn(8, 16),))
    >>> report.activation_bytes          # input (512 B) + ReLU output (1024 B), saved for backward
    1536
    """
    loaded = load(os.fspath(model)) if isinstance(model, (str, os.PathLike)) else None
    if loaded is None:
        if not isinstance(model, nn.Module):
            raise UsageError(f"model must be an nn.Module, a model file or a preset name, not {type(model).__name__}")
        loaded = Loaded(type(model).__name__, model, None, None)
    if inputs is None:
        if input_shape is None:
            raise UsageError("no inputs: pass example inputs or input_shape=(batch, ...) / --input-shape 32x1024")
        shape = _shape_of(input_shape)
        make: Any = lambda: make_inputs(loaded, shape)
    else:
        make = inputs if isinstance(inputs, tuple) else (inputs,)
    loss_fn = loss or loaded.loss
    g = capture(loaded.module, make, loss_fn, device)
    shapes = tuple(g.storages[n.meta["storage"]].shape for n in g.placeholders if n.meta.get("kind") == "input")
    loss_name = "default (output if scalar, else sum of floating outputs)" if loss_fn is None else getattr(loss_fn, "__qualname__", "custom")
    return Report.build(g, liveness(g), saved(g), loaded.name, shapes, loss_name, notes(g))
