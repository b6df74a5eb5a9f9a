"""graphmem: exact activation memory of a PyTorch training step, from fake tensors.

>>> import graphmem
>>> report = graphmem.analyze("gpt2", input_shape=(1, 128))   # doctest: +SKIP
>>> report.activation_bytes, report.peak_bytes                 # doctest: +SKIP

The public names are loaded on first use (PEP 562), so the command line answers ``--help``
and usage errors without importing torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from graphmem.errors import (
    CaptureError,
    DataDependentError,
    GraphmemError,
    ModelLoadError,
    PassError,
    UnsupportedOpError,
    UsageError,
)

if TYPE_CHECKING:
    from graphmem import capture
    from graphmem.api import analyze
    from graphmem.capture.load import parse_shape
    from graphmem.ci import assert_activation_bytes, assert_peak_bytes
    from graphmem.frontends.door import spec_for
    from graphmem.report import Report
    from graphmem.report.live import Analysis
    from graphmem.step.spec import StepSpec, make_spec
    from graphmem.stepgraph import StepGraph
    from graphmem.validation.validate import validate

_LAZY = {"analyze": "graphmem.api", "parse_shape": "graphmem.capture.load",
         "assert_activation_bytes": "graphmem.ci", "assert_peak_bytes": "graphmem.ci", "Report": "graphmem.report", "Analysis": "graphmem.report.live",
         "StepGraph": "graphmem.stepgraph",
         "validate": "graphmem.validation.validate", "StepSpec": "graphmem.step.spec", "make_spec": "graphmem.step.spec",
         "spec_for": "graphmem.frontends.door"}

__all__ = ["analyze", "capture", "parse_shape", "Report", "Analysis", "StepGraph", "GraphmemError", "UsageError",
           "ModelLoadError", "CaptureError", "DataDependentError", "UnsupportedOpError", "PassError",
           "assert_activation_bytes", "assert_peak_bytes", "validate", "StepSpec", "make_spec", "spec_for"]
__version__ = "0.3.0"


def __getattr__(name: str) -> Any:
    if name == "capture":  # the package graphmem/capture/, callable as the capture function
        return importlib.import_module("graphmem.capture")
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'graphmem' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
