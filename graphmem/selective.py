"""Deprecated since 0.2: ``from graphmem.selective import OpPolicy`` as printed by ``plan.code()`` in
graphmem 0.1; the code lives in graphmem/planning/selective.py (``graphmem.planning``), and plans
print ``graphmem.planning`` since. Removed in 0.3."""
import warnings

from graphmem.planning.selective import OpPolicy

warnings.warn("graphmem.selective is deprecated since graphmem 0.2 and goes in 0.3: import graphmem.planning",
              DeprecationWarning, stacklevel=2)

__all__ = ["OpPolicy"]
