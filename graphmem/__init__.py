"""graphmem: exact activation memory of a PyTorch training step, from fake tensors.

>>> import graphmem
>>> report = graphmem.analyze("gpt2", input_shape=(1, 128))   # doctest: +SKIP
>>> report.activation_bytes, report.peak_bytes                 # doctest: +SKIP
"""
from .api import analyze
from .capture import capture
from .ci import assert_activation_bytes
from .errors import (CaptureError, DataDependentError, GraphmemError, ModelLoadError, PassError,
                     UnsupportedOpError, UsageError)
from .load import parse_shape
from .report import Report
from .stepgraph import StepGraph
from .validate import validate

__all__ = ["analyze", "capture", "parse_shape", "Report", "StepGraph", "GraphmemError", "UsageError",
           "ModelLoadError", "CaptureError", "DataDependentError", "UnsupportedOpError", "PassError",
           "assert_activation_bytes", "validate"]
__version__ = "0.1.0"
