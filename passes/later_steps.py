"""The later steps' peak on one device: the first step creates the optimizer states lazily,
in the optimizer phase; from the second step on they exist from the start (the previous
step's outputs released), so a later step's live bytes at each op are the traced step's plus
the states not yet created at that op. (The ops of a later step are the first step's minus the
state creation: torch.optim's ``_init_group`` only adds states.) passes/budget.py gives the
same per rank; it re-exports these names.
"""
from __future__ import annotations

from graphmem.passes.liveness import Liveness
from graphmem.stepgraph import StepGraph

__all__ = ["later_steps_peak", "later_steps_peak_at", "made_states"]


def made_states(g: StepGraph) -> int:
    """Bytes of the optimizer states the traced (first) step makes: every later step holds them
    from its start."""
    return sum(s.nbytes for s in g.storages.values() if s.kind == "optimizer state" and s.created >= 0)


def later_steps_peak(g: StepGraph, lv: Liveness) -> int:
    """The peak of every step after the first (on one device): each op's live bytes plus the
    optimizer states the first step has not made yet at that op. Never below ``lv.peak_bytes``;
    equal to it when the step has no optimizer."""
    return later_steps_peak_at(g, lv)[0]


def later_steps_peak_at(g: StepGraph, lv: Liveness) -> tuple[int, int]:
    """``later_steps_peak`` and the op where it happens (``lv.peak_index`` when no op of a later
    step goes above the first step's peak)."""
    pending = [0] * (g.num_ops + 1)
    for s in g.storages.values():
        if s.kind == "optimizer state" and s.created >= 0:
            pending[0] += s.nbytes
            pending[s.created] -= s.nbytes
    extra, peak, at = 0, lv.peak_bytes, lv.peak_index
    for i, live in enumerate(lv.timeline[:g.num_ops]):
        extra += pending[i]
        if live + extra > peak:
            peak, at = live + extra, i
    return peak, at
