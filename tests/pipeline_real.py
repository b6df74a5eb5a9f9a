"""Ground truth for graphmem/distributed/pipeline.py: the same pipeline run for real on the CPU,
one process per rank with gloo (torch.multiprocessing.spawn), each rank measuring its own step:
saved bytes with saved_tensors_hooks, the peak from the CPU allocator's events under the
profiler (as graphmem/validation/measure.py measures a single step)."""
from __future__ import annotations

import json
import os
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

from graphmem.capture.recorder import _tensors
from graphmem.distributed.pipeline_stages import (
    Pipeline,
    block_inputs,
    build_schedule,
    probe,
    run_model,
    run_schedule,
    stage_loss,
)
from graphmem.validation.measure import _allocation_events, _storage_bytes


def _rank(rank: int, build: Callable[[], tuple[nn.Module, Any, Any]], pp: int, schedules: tuple[str, ...],
          micro_batches: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=pp)
    try:
        torch.manual_seed(0)
        model, batch, loss = build()
        model.train()
        results = {s: _measure(model, batch, loss, Pipeline(pp, rank, s, micro_batches)) for s in schedules}
        with open(out, "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


def _measure(model: nn.Module, batch: torch.Tensor, loss: Any, plan: Pipeline) -> dict[str, int]:
    """One schedule's first step on this rank: its peak (profiled), then its saved bytes (a second step)."""
    layout = probe(model, (batch,), plan.micro_batches)
    mb = batch.tensor_split(plan.micro_batches)[0]
    consts: Any = ((), {})
    if plan.stages != (0,):
        with torch.no_grad():
            args, kwargs = block_inputs(model, layout.chain, lambda: run_model(model, mb))
            consts = (args[1:], kwargs)
    schedule, stages = build_schedule(model, layout, plan, stage_loss(model, loss), torch.device("cpu"), consts, mb)
    own = nn.ModuleList([s.submod for s in stages])
    own.zero_grad(set_to_none=True)
    held = [*own.parameters(), *own.buffers()]
    excluded = _storage_bytes(held)[0]  # saved bytes count everything else (the batch: "input", constants: "other")
    held += _tensors(consts)
    if any(s.is_first or s.is_last for s in stages):
        held.append(batch)
    baseline = _storage_bytes(held)[1]
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        losses = run_schedule(schedule, stages, batch)
    del losses
    running = high = 0
    for _, size in _allocation_events(prof):
        running += size
        high = max(high, running)
    saved: dict[int, int] = {}
    keep: list[torch.Tensor] = []  # keeps saved storages alive so no address is reused while counting

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st._cdata not in excluded:
            saved[st._cdata] = st.nbytes()
            keep.append(t)
        return t

    own.zero_grad(set_to_none=True)
    dist.barrier()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run_schedule(schedule, stages, batch)
    own.zero_grad(set_to_none=True)
    return {"saved": sum(saved.values()), "peak": baseline + high, "baseline": baseline}


def _spawned(index: int, build: Any, pp: int, schedules: tuple[str, ...], micro_batches: int, store: str,
             folder: str) -> None:
    _rank(index, build, pp, schedules, micro_batches, store, os.path.join(folder, f"rank{index}.json"))


def measure_pipeline(build: Callable[[], tuple[nn.Module, Any, Any]], pp: int, schedules: tuple[str, ...],
                     micro_batches: int, folder: str) -> dict[str, list[dict[str, int]]]:
    """Each schedule's per-rank measured {saved, peak, baseline}, one spawn for all: ``build()``
    returns (model, batch, loss) and must be a module-level function (it is pickled into the
    spawned processes)."""
    store = os.path.join(folder, "store")
    mp.spawn(_spawned, args=(build, pp, schedules, micro_batches, store, folder), nprocs=pp, join=True)
    ranks = []
    for r in range(pp):
        with open(os.path.join(folder, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    return {s: [ranks[r][s] for r in range(pp)] for s in schedules}
