"""Collectives settled for the profiler in a real gloo rank (graphmem/validation/ranks.py).

torch.profiler (``profile_memory=True``) records the CPU allocator's events of the profiled thread
only. gloo's worker thread holds each collective's Work, which holds the tensors passed to it and
the buffers the collective made (ProcessGroupGloo's reduce-scatter works on a clone of its input:
``aten::clone`` inside ``c10d::_reduce_scatter_base_``), and drops it once it has run it: a buffer
whose last reference dies there is freed unseen, and the measured peak reads high by a random
amount. No profiler event says when gloo's thread let go. So, in a spawned rank process only:

- each collective FSDP2 and DTensor call is waited on at once and held until every tensor passed
  to it is back at its reference count from before the call (the Work that held them is gone): no
  sleeps, and no buffer's last reference dies on gloo's thread after the call returns;
- a buffer made inside a settled call (the ``SETTLED`` profiler range) and freed on gloo's thread
  before the call was settled is still unseen: ``allocation_events`` puts its free at the end of
  that call.

``UNSETTLED`` counts the collectives gloo's thread did not release within ``PATIENCE`` seconds.
"""
from __future__ import annotations

import bisect
import os
import time
from typing import Any, Callable, Iterable, Optional

import torch

PATIENCE = 30.0  # seconds a collective may take to be released before it counts as unsettled
SETTLED = "graphmem.settled"  # the profiler range around each settled collective
# FSDP2's (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py) and the others a wrapped step may call
COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_reduce", "all_gather", "all_gather_into_tensor",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast")
UNSETTLED = [0]  # collectives not released within PATIENCE in this process


class _Done:
    """The work handed back for ``async_op=True``: the collective is already settled."""

    def wait(self, *_: object) -> bool:
        return True


def _until_released(tensors: list[torch.Tensor], counts: list[int]) -> None:
    """Yield the CPU (gloo's thread must run on a loaded machine) until each tensor's reference count
    is back at ``counts``; past ``PATIENCE`` count the collective in ``UNSETTLED``."""
    deadline = time.monotonic() + PATIENCE
    for t, c in zip(tensors, counts):
        while t._use_count() > c:  # type: ignore[attr-defined]
            if time.monotonic() > deadline:
                UNSETTLED[0] += 1
                return
            os.sched_yield()


def _settled(collective: Callable) -> Callable:
    def call(*args: object, async_op: bool = False, **kwargs: object) -> Optional[_Done]:
        tensors = [t for a in (*args, *kwargs.values())
                   for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, torch.Tensor)]
        counts = [t._use_count() for t in tensors]  # type: ignore[attr-defined]
        with torch.profiler.record_function(SETTLED):
            work = collective(*args, async_op=True, **kwargs)
            if work is not None:  # (None: this rank is not in the group)
                work.wait()
            del work
            _until_released(tensors, counts)
        return _Done() if async_op else None
    return call


def _settled_functional(wait: Callable) -> Callable:
    """funcol's ``_maybe_wrap_tensor``, which every functional collective calls on its fresh output
    while it still holds its input: the output waited on at once and held until this call is its
    only holder (the Work, which held the input too, is gone)."""

    def call(tensor: torch.Tensor) -> torch.Tensor:
        with torch.profiler.record_function(SETTLED):
            out = wait(tensor)
            _until_released([tensor], [1])
        return out
    return call


def _inside(collective: Callable) -> Callable:
    """A collective whose buffers are made and dropped in C++ (DistributedDataParallel's
    ``_broadcast_coalesced`` flattens the module's states into one it broadcasts, its parameter check
    all-gathers a metadata tensor): no reference to wait on, so it runs inside the ``SETTLED`` range
    and ``allocation_events`` puts an unseen free of such a buffer at the call's end."""

    def call(*args: object, **kwargs: object) -> object:
        with torch.profiler.record_function(SETTLED):
            return collective(*args, **kwargs)
    return call


def settle_collectives(more: tuple[str, ...] = ()) -> None:
    """Settle the ``COLLECTIVES`` of torch.distributed (and ``more`` of them), DDP's C++ ones and the functional
    ones in this process."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    for name in (*COLLECTIVES, *more):
        setattr(dist, name, _settled(getattr(dist, name)))
    for name in ("_broadcast_coalesced", "_verify_params_across_processes"):
        setattr(dist, name, _inside(getattr(dist, name)))
    funcol._maybe_wrap_tensor = _settled_functional(funcol.wait_tensor)


def addresses(tensors: Iterable[object]) -> set[int]:
    """Storage addresses of the tensors (a DTensor's local shard) in nested lists, tuples and dicts."""
    from torch.distributed.tensor import DTensor

    found: set[int] = set()
    todo = list(tensors)
    while todo:
        t = todo.pop()
        if isinstance(t, dict):
            todo.extend(t.values())
        elif isinstance(t, (list, tuple)):
            todo.extend(t)
        elif isinstance(t, torch.Tensor):
            found.add((t._local_tensor if isinstance(t, DTensor) else t).untyped_storage().data_ptr())
    return found


def _allocations(prof: Any) -> tuple[list[tuple[int, int, int, int]], list[int]]:
    """(time, size, address, end of the settled call it was made in, -2 in a functional collective's
    launch, else -1) of each allocator event, and the end of every settled call, both in time order."""
    from torch._C._profiler import _EventType

    allocs: list[tuple[int, int, int, int]] = []
    ends: list[int] = []
    todo = [(e, -1, False) for e in prof.profiler.kineto_results.experimental_event_tree()]
    while todo:
        e, end, collective = todo.pop()
        if e.name == SETTLED:
            end = e.end_time_ns
            ends.append(end)
        collective = collective or e.name.startswith(("c10d::", "_c10d_functional::"))
        if e.tag == _EventType.Allocation:
            allocs.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr,
                           end if end >= 0 or not collective else -2))
        todo.extend((c, end, collective) for c in e.children)
    return sorted(allocs), sorted(ends)


def allocation_events(prof: Any, held: set[int]) -> list[tuple[int, int]]:
    """The allocator's events of a profiled window in time order, (time, size), frees negative, with
    the frees gloo's thread made put where the call was settled: a block made inside a settled call
    (or inside a functional collective's launch, settled by the wait that follows it) whose free
    the profiler did not see and which is not alive after the window (``held``: storage addresses)
    died by the end of that call. Only the last block at an address can be the held one: an earlier
    block there died unseen before the address was reused."""
    allocs, ends = _allocations(prof)
    found = [(t, size) for t, size, _, _ in allocs]
    for i, (t, size, ptr, end) in enumerate(allocs):
        if end == -2:
            later = bisect.bisect_left(ends, t)
            end = ends[later] if later < len(ends) else -1
        if size <= 0 or end < 0:
            continue
        after = next((a for a in allocs[i + 1:] if a[2] == ptr), None)
        if after is None and ptr in held:
            continue
        if after is None or after[1] > 0:  # its free was never seen
            found.append((min(end, after[0]) if after else end, -size))
    return sorted(found)
