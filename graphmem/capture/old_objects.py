"""Python's cyclic garbage collector during graphmem's own work.

A capture (graphmem/capture/session.py ``Recording.running``) and a widening
(graphmem/capture/widen.py) make hundreds of thousands of small objects (fake tensors, ops, their
metadata) and keep most of them, and the passes between them make more; torch's own code leaves cyclic
garbage on each call (``tree_flatten``'s recursive helper: a function, its cells and their annotations).
CPython's collector then ran its full collections again and again over everything the process holds: the
model, the report's graphs, every lever's and plan's graph (~15 s of the 8B LoRA advice's ~90 s of CPU,
benchmarks/README.md ``--l4-lora``; 3.2 s of a Llama-2-70B DeepSpeed rank's 32 s). Three regions:

- ``quiet_gc``: a step as graphmem measures a real one (graphmem/validation/measure.py): the garbage from
  before collected first, the collector paused inside (reference counting still frees each tensor as it
  dies). Every recorded step runs under it too (``generation=1``): cyclic garbage is then freed where the
  real measured step frees it (after), not at whatever op the collector happened to run, and the recorder's
  growing graph is not traversed by collections inside the step. Its collection before is of the young
  generations only: garbage reachable from nothing the recorder names cannot change what it records.
- ``gc_paused``: no automatic collection inside (the front doors that capture: graphmem/api.py ``analyze``,
  graphmem/report/live.py; DeepSpeed's engine and its two recorded steps); the recorded steps' own
  collections of the young generations free the garbage made between them.
- ``old_objects_frozen``: the objects alive on entry moved to the collector's permanent generation
  (``gc.freeze``), as CPython's documentation suggests for a long-lived heap
  (https://docs.python.org/3/library/gc.html#gc.freeze), and back when the outermost region ends
  (``gc.unfreeze``): a full collection inside (DeepSpeed's own ``gc.collect()`` in ``defragment``) skips them.

Known limitations: process-wide, like the collector; cyclic garbage among frozen objects waits for
the outermost region's end (peak RSS of the 8B LoRA advice 1.37 -> 1.59 GiB). A process that froze objects
itself (``gc.get_freeze_count()`` > 0) or turned the collector off is left as it is by ``old_objects_frozen``;
``quiet_gc`` and ``gc_paused`` leave a collector that was off, off.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator

_depth = 0  # regions entered (0: the collector is as the process set it)


@contextlib.contextmanager
def old_objects_frozen() -> Iterator[None]:
    """Within: the objects alive on entry left out of the collector's scans, until the outermost region
    ends (see the module docstring). Also a decorator: ``@old_objects_frozen()``."""
    global _depth
    if _depth == 0 and (not gc.isenabled() or gc.get_freeze_count()):
        yield
        return
    _depth += 1
    gc.freeze()
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            gc.unfreeze()


@contextlib.contextmanager
def quiet_gc(generation: int = 2) -> Iterator[None]:
    """Python's cyclic collector quiet for a step, as graphmem measures a real one (graphmem/validation/
    measure.py): the garbage from before collected first (``gc.collect(generation)``), the collector paused
    inside (reference counting still frees each tensor as it dies). A recorded step runs under it too
    (``generation=1``): cyclic garbage is then freed where the real measured step frees it (after), not at
    whatever op the collector happened to run, and the recorder's growing graph is not traversed again by each
    full collection (6 of them, ~1.6 s of a Llama-2-7B ZeRO-3 rank's 12 s). Its collection before is of the young
    generations only: garbage reachable from nothing the recorder names cannot change what it records, and a
    full collection before each of a Llama-2-70B DeepSpeed rank's two steps costs ~0.5-0.9 s."""
    was = gc.isenabled()
    gc.collect(generation)
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic collector not run on its own inside (an explicit ``gc.collect()`` still runs: each recorded
    step's ``quiet_gc``): for graphmem's own work on a large step (``graphmem.analyze``; DeepSpeed's engine and its
    two recorded steps), where each automatic full collection traverses every recorded op again (~1 s at
    Llama-2-70B's 200,000: between the steps, in the allocator's replay after them)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
