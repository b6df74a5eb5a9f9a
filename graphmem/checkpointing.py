"""Deprecated since 0.2: ``import graphmem.checkpointing as gc`` as printed by ``plan.code()`` in
graphmem 0.1; the code lives in graphmem/planning/apply.py (``graphmem.planning``), and plans print
``graphmem.planning`` since. Removed in 0.3."""
import warnings

from graphmem.planning.apply import Applied, apply_segments, chain_blocks

warnings.warn("graphmem.checkpointing is deprecated since graphmem 0.2 and goes in 0.3: import graphmem.planning",
              DeprecationWarning, stacklevel=2)

__all__ = ["Applied", "apply_segments", "chain_blocks"]
