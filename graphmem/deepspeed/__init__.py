"""DeepSpeed jobs per rank, through DeepSpeed's own engine on fake tensors (docs/deepspeed.md):
``DeepSpeedJob`` (the config and the rank, checked: graphmem/deepspeed/config.py) and ``capture_engine``
(graphmem/deepspeed/capture.py)."""
from graphmem.deepspeed.config import DeepSpeedJob, make_job

__all__ = ["DeepSpeedJob", "make_job"]
