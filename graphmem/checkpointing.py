"""Compatibility: ``import graphmem.checkpointing as gc`` as printed by ``plan.code()`` in
graphmem 0.1; the code lives in graphmem/planning/apply.py (``graphmem.planning``)."""
from graphmem.planning.apply import Applied, apply_segments, chain_blocks

__all__ = ["Applied", "apply_segments", "chain_blocks"]
