"""PyTorch's fake process group as rank ``r`` of ``world_size`` in this one process.

The fake backend (torch/testing/_internal/distributed/fake_pg.py: ``FakeStore`` and the "fake"
backend) returns from every collective at once and leaves its outputs as allocated, so torch's
own distributed code (DDP's Reducer, FSDP2, DTensor, a pipeline schedule's p2p) runs on the
capture's fake tensors as rank ``r`` would. It sits below graphmem/training/ and
graphmem/distributed/, which both open it (the latter with device meshes on top:
graphmem/distributed/process_group.py).
"""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import torch.distributed as dist

from graphmem.errors import UsageError


@contextlib.contextmanager
def fake_group(rank: int, world_size: int) -> Iterator[None]:
    """The fake process group as ``rank`` of ``world_size``, always destroyed after; a process that
    already runs torch.distributed is refused in one line."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if world_size < 1 or not 0 <= rank < world_size:
        raise UsageError(f"`rank={rank}` is not one of the {world_size} ranks: use 0 to {world_size - 1}")
    if dist.is_initialized():
        raise UsageError("torch.distributed is already initialized in this process; graphmem runs rank r "
                         "in a fake process group of its own: call analyze outside the distributed job")
    with kept_excepthook():
        dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
        try:
            yield
        finally:
            dist.destroy_process_group()


@contextlib.contextmanager
def kept_excepthook() -> Iterator[None]:
    """``sys.excepthook`` as it was before the block: ``init_process_group`` wraps it to prefix each
    traceback line with ``[rank{r}]:`` and ``destroy_process_group`` leaves the wrapper
    (torch/distributed/distributed_c10d.py ``_distributed_excepthook``), so after graphmem's fake
    ranks every traceback in the process carried one prefix per group graphmem opened."""
    hook = sys.excepthook
    try:
        yield
    finally:
        sys.excepthook = hook


__all__ = ["fake_group", "kept_excepthook"]
