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

from graphmem.capture.autograd_tags import _tensors
from graphmem.distributed.pipeline_stages import (
    Pipeline,
    block_inputs,
    build_schedule,
    probe,
    run_model,
    run_schedule,
    stage_loss,
)
from graphmem.training.optim import make_optimizer, state_tensors
from graphmem.validation.measure import _allocation_events, _storage_bytes


def _rank(rank: int, build: Callable[[], tuple[nn.Module, Any, Any]], pp: int, schedules: tuple[str, ...],
          micro_batches: int, store: str, out: str, optimizer: str | None = None) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=pp)
    try:
        torch.manual_seed(0)
        model, batch, loss = build()
        model.train()
        results = {s: _measure(model, batch, loss, Pipeline(pp, rank, s, micro_batches), optimizer) for s in schedules}
        with open(out, "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


_MARK = 987_653  # bytes of a marker allocated between two profiled steps (no step allocates this size here)


def _profiled_peaks(step: Callable[[], None], steps: int) -> list[int]:
    """Each of ``steps`` steps' highest bytes allocated above where the first started (the CPU
    allocator's events, one profile over all of them, so what a step keeps for the next, the
    optimizer's states and the schedule's receive buffers, counts in the later ones); a marker
    allocation between steps tells them apart."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for i in range(steps):
            if i:
                mark = torch.empty(_MARK, dtype=torch.uint8)
                del mark
            step()
    running, highs, skip = 0, [0], 0
    for _, size in _allocation_events(prof):
        if size == _MARK and skip == 0:  # the next step starts; its free follows
            highs.append(running)
            skip = 1
            continue
        if size == -_MARK and skip == 1:
            skip = 0
            continue
        running += size
        highs[-1] = max(highs[-1], running)
    assert len(highs) == steps, "the marker allocation was not seen between the steps"
    return highs


def _measure(model: nn.Module, batch: torch.Tensor, loss: Any, plan: Pipeline,
             optimizer: str | None = None) -> dict[str, int]:
    """One schedule's first step on this rank: its peak (profiled), then its saved bytes (a second step).
    With ``optimizer`` (a name of graphmem/training/optim.py, torch's default implementation on the
    CPU), each step ends with the stage's optimizer step and ``zero_grad``, and a second step,
    profiled with the first, gives the later steps' peak ("later"; "states": the optimizer's bytes)."""
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
    opt = make_optimizer(optimizer, "auto", list(own.parameters()), "cpu") if optimizer else None

    def step() -> None:
        run_schedule(schedule, stages, batch)
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)

    dist.barrier()
    highs = _profiled_peaks(step, 2 if opt is not None else 1)
    result = {"baseline": baseline, "peak": baseline + highs[0]}
    if opt is not None:
        result.update(states=_storage_bytes([t for _, _, t in state_tensors(opt)])[1], later=baseline + highs[1])
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
    return {"saved": sum(saved.values()), **result}


def _spawned(index: int, build: Any, pp: int, schedules: tuple[str, ...], micro_batches: int, store: str,
             folder: str, optimizer: str | None) -> None:
    _rank(index, build, pp, schedules, micro_batches, store, os.path.join(folder, f"rank{index}.json"), optimizer)


def measure_pipeline(build: Callable[[], tuple[nn.Module, Any, Any]], pp: int, schedules: tuple[str, ...],
                     micro_batches: int, folder: str, optimizer: str | None = None) -> dict[str, list[dict[str, int]]]:
    """Each schedule's per-rank measured {saved, peak, baseline}, one spawn for all: ``build()``
    returns (model, batch, loss) and must be a module-level function (it is pickled into the
    spawned processes)."""
    store = os.path.join(folder, "store")
    mp.spawn(_spawned, args=(build, pp, schedules, micro_batches, store, folder, optimizer), nprocs=pp, join=True)
    ranks = []
    for r in range(pp):
        with open(os.path.join(folder, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    return {s: [ranks[r][s] for r in range(pp)] for s in schedules}
