"""PyTorch's own wrappers applied to a model as a ``Sharding`` names them, in one place: the
per-rank capture (graphmem/distributed/capture.py, on a fake copy under the fake process group)
and ``graphmem.validate``'s real gloo ranks (graphmem/validation/ranks.py) both call
``apply_wrappers``, so the step validate runs for real is the one the analysis recorded."""
from __future__ import annotations

import contextlib

import torch.nn as nn

from graphmem.distributed.chunks import lazy_chunks
from graphmem.distributed.fsdp import shard
from graphmem.distributed.process_group import Meshes
from graphmem.distributed.spec import Sharding
from graphmem.distributed.tensor_parallel import parallelize


def apply_wrappers(model: nn.Module, sharding: Sharding, meshes: Meshes, fake: bool = False) -> None:
    """Split ``model`` in place: DTensor's ``parallelize_module`` over ``meshes.tp`` first (tensor
    parallel), then ``fully_shard`` (FSDP2) per unit over ``meshes.dp``. ``fake``: the model's
    tensors are fake, and FSDP2 chunks only what it reads (graphmem/distributed/chunks.py)."""
    if sharding.tp > 1:
        parallelize(model, sharding, meshes)
    if sharding.fsdp:
        with lazy_chunks() if fake else contextlib.nullcontext():
            shard(model, sharding, meshes)
