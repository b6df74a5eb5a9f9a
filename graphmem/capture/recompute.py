"""The context a checkpointed segment's run is given: graphmem's capture wraps every segment's
forward and recompute (graphmem/planning/apply.py runs them) so the recompute sees the
context torch.utils.checkpoint gives it (autocast, CUDA rules) and the recorder can tell it."""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, ContextManager, Iterator, Optional

_STATE = threading.local()


@contextlib.contextmanager
def segment_scope(scope: Callable[[], ContextManager[object]]) -> Iterator[None]:
    """While active, every checkpointed segment's run (forward and recompute) is wrapped in
    ``scope()``: graphmem's capture uses it to give a recompute the context torch gives it."""
    was = getattr(_STATE, "scope", None)
    _STATE.scope = scope
    try:
        yield
    finally:
        _STATE.scope = was


def recompute_scope() -> Optional[Callable[[], ContextManager[object]]]:
    """The scope a segment's run enters now, if a capture set one."""
    return getattr(_STATE, "scope", None)
