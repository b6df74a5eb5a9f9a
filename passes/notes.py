"""Notes: ops in the step whose real memory fake tensors cannot see (graphmem/oprules/: the note rules)."""
from __future__ import annotations

from graphmem.oprules import note_rule
from graphmem.oprules.symm_mem import workspace_line
from graphmem.stepgraph import StepGraph


def notes(g: StepGraph) -> tuple[str, ...]:
    found: dict[str, None] = {}
    for node in g.ops:
        rule = note_rule(node.target, g.device)
        if rule is not None:
            found.setdefault(rule(node), None)
    # a rule returns "" for an op another rule covers; AsyncTP's workspace is held outside the allocator
    return tuple(n for n in found if n) + workspace_line(g.ops)
