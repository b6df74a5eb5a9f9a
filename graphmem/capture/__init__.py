"""Capture: one training step of a model on fake tensors, recorded as a StepGraph.

load.py (model files, presets, default inputs) · target.py (device, dtypes, autocast, SDPA
backend, mode) · cuda_rules.py (the CUDA target's memory rules on fake CPU tensors) ·
fakes.py (fake state and batch) · recorder.py (the fake mode that records ops, storages,
saves, frees, module paths) · capture.py (the step) · compiled.py (torch.compile's step) ·
reuse.py (deep chains captured at depth 5, checked at depth 6) · widen.py (the copy) ·
recompute.py (the context a checkpointed segment's recompute runs in) · sac.py (what selective
checkpointing keeps, seen as saved).
"""
import sys
import types
from typing import Any

from graphmem.capture.capture import capture
from graphmem.capture.load import Loaded, load, make_inputs, parse_shape
from graphmem.capture.recorder import _Mode
from graphmem.capture.reuse import capture_reusing
from graphmem.capture.sac import install
from graphmem.capture.target import Target, make_target
from graphmem.stepgraph import StepGraph

install(_Mode)  # what selective checkpointing keeps, seen as saved while a step is recorded (sac.py)

__all__ = ["capture", "capture_reusing", "Loaded", "load", "make_inputs",
           "parse_shape", "Target", "make_target"]


class _CallablePackage(types.ModuleType):
    """``graphmem.capture(model, inputs)`` stays the capture function it was before this
    package existed: the package, called, captures."""

    def __call__(self, *args: Any, **kwargs: Any) -> StepGraph:  # capture's own arguments
        return capture(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
