"""Python's cyclic garbage collector during graphmem's own work.

A capture (graphmem/capture/session.py ``Recording.running``) and a widening
(graphmem/capture/widen.py) make hundreds of thousands of small objects (fake tensors, ops, their
metadata) and keep most of them, and the passes between them make more; torch's own code leaves cyclic
garbage on each call (``tree_flatten``'s recursive helper: a function, its cells and their annotations).
CPython's collector then ran its full collections again and again over everything the process holds: the
model, the report's graphs, every lever's and plan's graph (~15 s of the 8B LoRA advice's ~90 s of CPU,
benchmarks/README.md ``--l4-lora``; 3.2 s of a Llama-2-70B DeepSpeed rank's 32 s). Two regions:

- ``quiet_gc``: a step as graphmem measures a real one (graphmem/validation/measure.py): the garbage from
  before collected first, the collector paused inside (reference counting still frees each tensor as it
  dies). Garbage collected inside a profiled window lowered the measured peak: the CPU allocator's profiler
  reporter (c10/core/CPUAllocator.cpp, ProfiledCPUMemoryReporter) reports the free of every block allocated
  while any profile ran (tests/planning/test_zoo_plans.py on T5: 427,776 B under, after other tests). Every recorded step runs under it too (``generation=1``): cyclic garbage is then freed where the
  real measured step frees it (after), not at whatever op the collector happened to run, and the recorder's
  growing graph is not traversed by collections inside the step. Its collection before is of the young
  generations only: garbage reachable from nothing the recorder names cannot change what it records.
- ``gc_paused``: no automatic collection inside (graphmem/api.py ``analyze``; DeepSpeed's engine and its two
  recorded steps); the recorded steps' own collections of the young generations free the garbage made between
  them. Not the report's answers (advise, plan, fit: graphmem/report/live.py), which capture dozens of steps: what a
  step's collection finds alive goes to the oldest generation, and with no full collection each capture's graph
  stayed there after it died (GPT-2's advice: 4.14 GiB peak RSS, tests/advise/test_advise_robust.py
  ``test_advise_peak_rss_stays_under_2_gib``).

Not taken: ``gc.freeze`` of the objects alive before a front door's work (tried: the collector's full collections
then skip them). Frozen, what became garbage inside waited for a full collection after the front door, and an object
a library reaches through a weak reference stayed alive: after an analysis a DeepSpeed validation built its model
under ZeRO-3's ``deepspeed.zero.Init`` (tests/distributed/test_deepspeed.py ``test_cli_validates_a_deepspeed_config``);
frozen at a recorded step's start, the buffers DeepSpeed's own ``gc.collect()`` frees there were not (the later peak
32,752 B under real DeepSpeed's: ``test_cpu_offload_matches_real_deepspeed``).

Known limitations: process-wide, like the collector; cyclic garbage made inside a front door waits for the next
recorded step's collection or the door's end. ``quiet_gc`` and ``gc_paused`` leave a collector that was off, off.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def quiet_gc(generation: int = 2) -> Iterator[None]:
    """The garbage from before collected (``gc.collect(generation)``), then the collector paused inside
    (``gc_paused``): a step measured for real (the full collection) or recorded (``generation=1``), as the
    module docstring says."""
    gc.collect(generation)
    with gc_paused():
        yield


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
