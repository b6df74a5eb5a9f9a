"""The cyclic garbage collector spared the objects that were alive before a burst of work.

A capture (graphmem/capture/session.py ``Recording.running``) and a widening
(graphmem/capture/widen.py) make hundreds of thousands of small objects (fake tensors, ops, their
metadata) and keep most of them, and the passes between them make more; CPython's collector then runs
its full collections again and again over everything the process holds: the model, the report's graphs,
every lever's and plan's graph. On the 8B LoRA advice (benchmarks/README.md ``--l4-lora``) that was
~15 s of ~90 s of CPU. Within ``old_objects_frozen`` (the front doors that capture: graphmem/api.py
``analyze``, graphmem/report/live.py; and each capture and widening inside them) the objects alive on
entry are moved to the collector's permanent generation (``gc.freeze``), as CPython's documentation
suggests for a long-lived heap (https://docs.python.org/3/library/gc.html#gc.freeze), and back when the
outermost region ends (``gc.unfreeze``). The young generations are collected as before, so a reference
cycle made inside a capture (one holding a fake tensor, whose storage's end the recorder writes when
the collector frees it) is freed as it would be; only the full collections skip the old objects.

Known limitations: process-wide, like the collector; cyclic garbage among frozen objects waits for
the outermost region's end. A process that froze objects itself (``gc.get_freeze_count()`` > 0) or
turned the collector off is left as it is.
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
