"""Ground truth for per-rank captures: a REAL multi-process CPU step with gloo
(torch.multiprocessing.spawn), each rank measuring what graphmem/validation/measure.py measures
on one device: the distinct storages autograd saves in forward and loss (parameters excluded:
under FSDP2 the registered parameters during forward are the unsharded ones, so they are read
at each save), and the peak from the CPU allocator's events under torch.profiler, plus the bytes
live before the step (rank r's shards, buffers, the batch)."""
from __future__ import annotations

import os
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile

from graphmem.distributed.fsdp import local, shard
from graphmem.distributed.process_group import Meshes
from graphmem.distributed.spec import Sharding
from graphmem.training.batch import as_batch
from graphmem.training.step import LossFn, run_step
from graphmem.validation.measure import _allocation_events


def _keys(tensors: list[torch.Tensor]) -> dict[int, int]:
    return {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}


def _step(model: nn.Module, batch: Any, loss_fn: LossFn | None) -> tuple[int, int]:
    """(saved bytes, peak bytes) of one real step of the wrapped ``model`` on this rank."""
    saved: dict[int, int] = {}
    phase = ["forward"]

    def pack(t: torch.Tensor) -> torch.Tensor:
        params = _keys([local(p) for p in model.parameters()] + [local(b) for b in model.buffers()])
        st = t.untyped_storage()
        if phase[0] != "backward" and st._cdata not in params:
            saved[st._cdata] = st.nbytes()
        return t

    baseline = sum(_keys([local(p) for p in model.parameters()] + [local(b) for b in model.buffers()]
                         + list(as_batch(batch).tensors())).values())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, loss = run_step(model, batch, loss_fn, lambda p: phase.__setitem__(0, p))
    del out, loss
    running = high = 0
    for _, size in _allocation_events(prof):
        running += size
        high = max(high, running)
    return sum(saved.values()), baseline + high


def _worker(rank: int, world_size: int, init: str, build: Callable[[], nn.Module], make_batch: Callable[[], Any],
            loss_fn: LossFn | None, sharding: Sharding, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        model = build()
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
        shard(model, sharding, Meshes(mesh, mesh, None))
        batch = make_batch()
        model.train()
        saved, peak = _step(model, batch, loss_fn)
        torch.save({"saved": saved, "peak": peak}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def measure_ranks(build: Callable[[], nn.Module], make_batch: Callable[[], Any], loss_fn: LossFn | None,
                  sharding: Sharding) -> list[dict[str, int]]:
    """{"saved", "peak"} of each rank of a real gloo run (``build``/``make_batch``/``loss_fn``
    must be picklable: module-level functions)."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        out = os.path.join(tmp, "result")
        mp.spawn(_worker, args=(sharding.world_size, init, build, make_batch, loss_fn, sharding, out),
                 nprocs=sharding.world_size, join=True)
        return [torch.load(f"{out}.{r}") for r in range(sharding.world_size)]
