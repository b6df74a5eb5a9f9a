"""graphmem: exact activation memory of a PyTorch training step, from fake tensors.

>>> import graphmem
>>> report = graphmem.analyze("gpt2", input_shape=(1, 128))   # doctest: +SKIP
>>> report.activation_bytes, report.peak_bytes                 # doctest: +SKIP
"""
from graphmem.api import analyze
from graphmem.capture.capture import capture
from graphmem.capture.load import parse_shape
from graphmem.ci import assert_activation_bytes
from graphmem.errors import (
                     CaptureError,
                     DataDependentError,
                     GraphmemError,
                     ModelLoadError,
                     PassError,
                     UnsupportedOpError,
                     UsageError,
)
from graphmem.report import Report
from graphmem.stepgraph import StepGraph
from graphmem.validation.validate import validate

__all__ = ["analyze", "capture", "parse_shape", "Report", "StepGraph", "GraphmemError", "UsageError",
           "ModelLoadError", "CaptureError", "DataDependentError", "UnsupportedOpError", "PassError",
           "assert_activation_bytes", "validate"]
__version__ = "0.1.0"
