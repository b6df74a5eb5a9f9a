"""Per-rank memory from PyTorch's own distributed code, run in one process on fake tensors.

``capture_rank`` records rank r's step with ``fully_shard`` (FSDP2) and/or DTensor
``parallelize_module`` (tensor/sequence parallel) under the fake process group
(``fake_process_group``); ``Sharding`` / ``make_sharding`` hold the options. See docs/distributed.md.
Pipeline stages: ``analyze_stage`` in graphmem/distributed/pipeline.py (docs/pipeline.md).
"""
from graphmem.distributed.capture import capture_rank
from graphmem.distributed.process_group import fake_process_group
from graphmem.distributed.spec import Sharding, make_sharding, wants_wrappers

__all__ = ["capture_rank", "fake_process_group", "Sharding", "make_sharding", "wants_wrappers"]
