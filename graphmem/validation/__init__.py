"""Real runs: one training step on the CPU (or a GPU) measured beside the prediction
(validate.py), and the measurement code (measure.py: saved_tensors_hooks, allocator events)."""
from graphmem.validation.validate import Row, Validation, ValidationError, validate

__all__ = ["validate", "Validation", "ValidationError", "Row"]
