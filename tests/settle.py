"""Settling gloo's collectives for the profiler, shared by the real multi-process truth harnesses
(tests/dist_truth.py, tests/zero_truth.py, tests/trainer_truth.py, tests/titan_truth.py).

torch.profiler (``profile_memory=True``) records the CPU allocator's events of the thread that runs
the profiled code only (its profiling state is that thread's). gloo's worker thread holds each
collective's Work, which holds the tensors passed to it and any buffer the collective made (gloo's
reduce-scatter works on a clone of its input, ``aten::clone`` inside ``c10d::_reduce_scatter_base_``,
ProcessGroupGloo's reduce_scatter_tensor_coalesced), and drops it once it has run it. A buffer whose
last reference dies there is freed unseen, and the measured running sum stays too high by that
buffer, a random amount from run to run. No profiler event says when gloo's thread let go (the Work
is done before it does), and ``_ExperimentalConfig(profile_all_threads=True)`` records no allocator
events at all in torch 2.14 (tried). So each collective is settled deterministically, without sleeps:

- ``settled``: a c10d collective waited on at once, then held until every tensor passed to it is back
  at its reference count from before the call (``until_released``): the Work, which held them, is gone,
  so no buffer's last reference dies on gloo's thread after the call returns;
- ``settled_functional``: the same for funcol's functional collectives (``_maybe_wrap_tensor``);
- ``events``: a buffer made inside a settled call and freed on gloo's thread before the call was
  settled is still unseen; its free is put at the end of that call (the ``SETTLED`` profiler range).

Each counts the collectives not released within ``PATIENCE`` seconds (``unsettled``): a harness
that returns results asserts none was.
"""
from __future__ import annotations

import bisect
import os
import time
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._C._profiler import _EventType
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

PATIENCE = 30.0  # seconds a collective may take to be released before it counts as unsettled
SETTLED = "truth.settled"  # the profiler's range around each settled collective
# what FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py), accelerate's gather and
# spmd_types (torchtitan's SPMD backend: expert parallel's token exchange over lists of chunks) call
COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_reduce", "all_to_all", "all_to_all_single",
               "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor")


class Done:
    """The work handed back for ``async_op=True`` after the collective was settled."""

    def wait(self, *_: Any) -> bool:
        return True


def until_released(tensors: list[torch.Tensor], counts: list[int], unsettled: list[int]) -> None:
    """Wait until each tensor is held only as before the collective: gloo's worker thread then has
    dropped the work (which held them), so no buffer's last reference dies on that thread. The wait
    yields the CPU, so that gloo's thread runs on a loaded machine; past ``PATIENCE`` it counts one
    unsettled collective in ``unsettled[0]``."""
    deadline = time.monotonic() + PATIENCE
    for t, c in zip(tensors, counts):
        while t._use_count() > c:  # type: ignore[attr-defined]
            if time.monotonic() > deadline:
                unsettled[0] += 1
                return
            os.sched_yield()


def settled(collective: Callable, unsettled: list[int]) -> Callable:
    """A c10d collective waited on at once and held until its work is released (see above)."""

    def call(*args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        tensors = [t for a in (*args, *kwargs.values())
                   for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, torch.Tensor)]
        counts = [t._use_count() for t in tensors]  # type: ignore[attr-defined]
        with record_function(SETTLED):
            work = collective(*args, async_op=True, **kwargs)
            if work is not None:  # (None: this rank is not in the group)
                work.wait()
            del work
            until_released(tensors, counts, unsettled)
        return Done() if async_op else None
    return call


def settled_functional(wait: Callable, unsettled: list[int]) -> Callable:
    """funcol's ``_maybe_wrap_tensor`` (called by each functional collective while its input is
    still held): the fresh output waited on at once, then held until this call is its only holder
    (the work, which also holds the input, is gone)."""

    def call(tensor: torch.Tensor) -> torch.Tensor:
        with record_function(SETTLED):
            out = wait(tensor)
            until_released([tensor], [1], unsettled)
        return out
    return call


def settled_inside(collective: Callable) -> Callable:
    """A collective whose buffers are made and dropped in C++: DDP's ``dist._broadcast_coalesced``
    (torch/nn/parallel/distributed.py, torch/distributed/utils.py ``_sync_module_states``) flattens
    the tensors into a buffer it broadcasts and copies back (torch/csrc/distributed/c10d/comm.cpp),
    and that buffer may die on gloo's thread: ZeRO-1's second DistributedDataParallel in one process
    read +657,752 B (the flattened parameters) held once built. No reference to it can be waited
    on; run inside the ``SETTLED`` range, its unseen free is put at the end of the call (``events``)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        with record_function(SETTLED):
            return collective(*args, **kwargs)
    return call


def settle(names: Iterable[str] = COLLECTIVES) -> list[int]:
    """Settle the named ``torch.distributed`` collectives, DDP's C++ ones and every
    functional one in this (spawned rank) process; the list counts the unsettled ones (see above)."""
    unsettled = [0]
    for name in names:
        setattr(dist, name, settled(getattr(dist, name), unsettled))
    dist._broadcast_coalesced = settled_inside(dist._broadcast_coalesced)
    # (DDP's parameter-shape check all-gathers a small metadata tensor in C++ the same way: +24 B seen)
    dist._verify_params_across_processes = settled_inside(dist._verify_params_across_processes)
    funcol._maybe_wrap_tensor = settled_functional(funcol.wait_tensor, unsettled)
    return unsettled


def addresses(tensors: Iterable[Any]) -> set[int]:
    """The storage addresses of the tensors (a DTensor's local shard) in nested lists, tuples and
    dicts (a transformers ModelOutput is one): what is held after a profiled window."""
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


def events(prof: Any, held: set[int]) -> list[tuple[int, int]]:
    """The allocator's events of a profiled window in time order, (time, size), frees negative,
    with the frees gloo's thread made where they happened. A block allocated inside a settled
    collective (``SETTLED``), or inside a functional collective's launch (settled by the wait that
    follows it), whose free is unseen and which is not held after the window (``held``: storage
    addresses), was freed by the time the collective was settled: its free is put there (FSDP2's
    first peak read +93,568 B on one torchtitan rank of four in one run, FSDP x TP's +32,768 B
    through a functional collective). Held is told by address, so only the last block at an address
    can be the held one: an earlier one there died unseen (FSDP x TP's first peak read +16,384 B on
    one rank in about one run of ten, a reduce-scatter clone's address taken later in the step by an
    optimizer state)."""
    allocs: list[tuple[int, int, int, int]] = []  # (time, size, ptr, end of the settled call or -1)
    ends: list[int] = []  # every settled call's end
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
    allocs.sort()
    ends.sort()
    found = [(t, size) for t, size, _, _ in allocs]
    for i, (t, size, ptr, end) in enumerate(allocs):
        if end == -2:  # a functional collective's launch: settled by the wait that follows it
            later = bisect.bisect_left(ends, t)
            end = ends[later] if later < len(ends) else -1
        if size <= 0 or end < 0:
            continue
        after = next((a for a in allocs[i + 1:] if a[2] == ptr), None)
        if after is None and ptr in held:  # alive after the window, held
            continue
        if after is None or after[1] > 0:  # never freed where the profiler saw it
            found.append((min(end, after[0]) if after else end, -size))
    return sorted(found)


def high(prof: Any, held: set[int]) -> int:
    """The largest running sum of ``events`` (allocations positive, frees negative)."""
    running = top = 0
    for _, size in events(prof, held):
        running += size
        top = max(top, running)
    return top
