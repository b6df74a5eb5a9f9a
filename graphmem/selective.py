"""Compatibility: ``from graphmem.selective import OpPolicy`` as printed by ``plan.code()`` in
graphmem 0.1; the code lives in graphmem/planning/selective.py (``graphmem.planning``)."""
from graphmem.planning.selective import OpPolicy

__all__ = ["OpPolicy"]
