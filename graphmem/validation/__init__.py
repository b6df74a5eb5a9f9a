"""Real runs: one training step on the CPU (or a GPU) measured beside the prediction
(validate.py; its rows and verdicts: result.py), each rank of a fully_shard/parallelize_module job
run for real over gloo (ranks.py), and the measurement code (measure.py: saved_tensors_hooks,
allocator events)."""
from graphmem.validation.result import Row, Validation, ValidationError
from graphmem.validation.validate import validate

__all__ = ["validate", "Validation", "ValidationError", "Row"]
