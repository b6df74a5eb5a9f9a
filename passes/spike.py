"""What makes a peak a spike: the temporaries live at an op, grouped by the op that made them,
with when the first was made and when the last was freed (the op after which it died).

A temporary is a storage made during the step that is none of the model's state (parameters,
buffers, gradients, optimizer states, master copies), not the batch and not saved for backward:
an op's output or a library's intermediate. At an optimizer peak these are the optimizer's own
intermediates, e.g. torch.optim's foreach Adam computing ``exp_avg_sq.sqrt()`` for every
parameter at once (``aten._foreach_sqrt``) before ``_foreach_addcdiv_`` uses it; a spike of
the size of the parameters that exists only inside ``optimizer.step()``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from graphmem.passes.liveness import Liveness
from graphmem.stepgraph import StepGraph

STATE = frozenset({"parameter", "buffer", "input", "gradient", "optimizer state", "master", "gradient copy"})


@dataclass(frozen=True)
class Temporaries:
    """The storages made by one op (``made_by``) live at the op asked about."""

    made_by: str
    nbytes: int
    count: int
    first_made: int  # op index of the first
    last_freed: Optional[int]  # op index after which the last one died (None: alive at the step's end)
    freed_by: str  # the op at last_freed ("" when None)
    phase: str  # of first_made
    freed_phase: str = ""  # of last_freed


def temporaries_at(g: StepGraph, lv: Liveness, index: int, saved_sids: frozenset[int], top: int = 5,
                   ) -> tuple[Temporaries, ...]:
    """The largest groups of temporaries live during op ``index``, largest first."""
    groups: dict[str, list[int]] = {}
    for sid, (a, b) in lv.intervals.items():
        s = g.storages[sid]
        if a <= index <= b and s.created >= 0 and s.kind not in STATE and sid not in saved_sids and s.nbytes:
            groups.setdefault(s.name, []).append(sid)
    out = []
    for name, sids in groups.items():
        stores = [g.storages[sid] for sid in sids]
        freed = [s.freed for s in stores]
        last = None if any(f is None for f in freed) else max(f for f in freed if f is not None)
        first = min(s.created for s in stores)
        out.append(Temporaries(name, sum(s.nbytes for s in stores), len(stores), first, last,
                               str(g.ops[last].target) if last is not None and last < len(g.ops) else "",
                               g.phase_of(first), g.phase_of(last) if last is not None else ""))
    out.sort(key=lambda t: -t.nbytes)
    return tuple(out[:top])
