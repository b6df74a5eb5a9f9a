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

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from graphmem.errors import UsageError
from graphmem.fake_group import fake_group


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
    if world_size % tp:
        raise UsageError(f"`world_size={world_size}` is not a multiple of `tp={tp}`: world = data parallel x tensor parallel")
    with fake_group(rank, world_size):
        try:
            yield device_meshes(world_size, tp, fsdp)
        finally:
            _forget_meshes()


def device_meshes(world_size: int, tp: int = 1, fsdp: bool = True) -> Meshes:
    """The CPU device mesh(es) over the initialized process group: data parallel x tensor parallel
    (``world_size // tp`` x ``tp``) when both split, else one dimension. The fake group's capture
    and validate's real gloo ranks (graphmem/validation/ranks.py) build them here, the same way."""
    dp = world_size // tp
    if tp > 1 and fsdp and dp > 1:
        world = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        return Meshes(world, world["dp"], world["tp"])
    if tp > 1:
        world = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
        return Meshes(world, None, world)
    world = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    return Meshes(world, world, None)


def _forget_meshes() -> None:
    """Clear DTensor's caches keyed by device mesh (torch/distributed/tensor/debug/__init__.py names
    ``_clear_sharding_prop_cache`` the way to clear the sharding propagation caches): a DeviceMesh compares equal to any mesh of the
    same layout (torch/distributed/device_mesh.py ``__eq__``), so a later group's step would be
    handed specs holding this group's meshes, whose process groups no longer resolve (analyze at
    rank 5, then at rank 6, of a tensor-parallel step failed with "Could not resolve the process group")."""
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._redistribute import _gen_transform_infos
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()  # the Python and the C++ fast path's caches
    _gen_transform_infos.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()
