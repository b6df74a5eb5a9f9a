"""Notes: ops in the step whose real memory fake tensors cannot see (passes/oprules.py)."""
from __future__ import annotations

from graphmem.passes.oprules import NOTE_RULES
from graphmem.stepgraph import StepGraph


def notes(g: StepGraph) -> tuple[str, ...]:
    found: dict[str, None] = {}
    for node in g.ops:
        rule = NOTE_RULES.get((node.target, g.device))
        if rule is not None:
            found.setdefault(rule(node), None)
    return tuple(n for n in found if n)  # a rule returns "" for an op another rule covers
