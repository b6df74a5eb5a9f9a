"""The fake process group: rank ``r`` of ``world_size`` ranks in this one process.

torch.distributed's own code (``fully_shard``, DTensor's ``parallelize_module``) runs under
PyTorch's fake backend (torch/testing/_internal/distributed/fake_pg.py: ``FakeStore`` and the
"fake" backend, whose collectives return at once and leave their outputs as allocated), so a
capture on fake tensors sees the buffers the wrappers allocate on rank ``r`` at any world size.

Known limitations: the fake backend does not move data, so anything whose shape depends on
received values is out of reach; one process group at a time (a process already running
torch.distributed is refused).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from graphmem.errors import UsageError


@dataclass(frozen=True)
class Meshes:
    """The device meshes of one rank: ``dp`` shards parameters (FSDP), ``tp`` splits layers."""

    world: DeviceMesh  # 1-D, or 2-D ("dp", "tp") when both are used
    dp: Optional[DeviceMesh]
    tp: Optional[DeviceMesh]


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int, tp: int = 1, fsdp: bool = True) -> Iterator[Meshes]:
    """Init the fake process group as ``rank`` of ``world_size``, build the CPU device mesh(es)
    (data parallel x tensor parallel, ``world_size // tp`` x ``tp``) and always destroy the group.

    >>> with fake_process_group(rank=3, world_size=8) as meshes:
    ...     meshes.dp.size()
    8
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if world_size < 1 or not 0 <= rank < world_size:
        raise UsageError(f"--rank {rank} is not one of the {world_size} ranks: use 0 to {world_size - 1}")
    if world_size % tp:
        raise UsageError(f"--world-size {world_size} is not a multiple of --tp {tp}: world = data parallel x tensor parallel")
    if dist.is_initialized():
        raise UsageError("torch.distributed is already initialized in this process; graphmem runs rank r "
                         "in a fake process group of its own: call analyze outside the distributed job")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        dp = world_size // tp
        if tp > 1 and fsdp and dp > 1:
            world = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
            yield Meshes(world, world["dp"], world["tp"])
        elif tp > 1:
            world = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
            yield Meshes(world, None, world)
        else:
            world = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
            yield Meshes(world, world, None)
    finally:
        dist.destroy_process_group()
        _clear_dtensor_caches()


def _clear_dtensor_caches() -> None:
    """DTensor caches sharding propagation by op schema (the C++ dispatch fast path's cache,
    torch/distributed/tensor/_dispatch.py), and a schema's meshes compare equal across ranks of one
    world (the same rank map and layout): a later rank would get output specs that hold this rank's
    sub-meshes, whose groups are destroyed here ("Could not resolve the process group")."""
    torch._C._clear_DTensor_sharding_propagator_cache()
