"""A recorded step runs as graphmem measures a real one: cyclic garbage from before collected first, Python's
collector paused inside (graphmem/capture/session.py ``quiet_gc``), and ``graphmem.analyze`` pauses its automatic
collections for its own work (``gc_paused``), restoring the collector's state after."""
from __future__ import annotations

import gc
import weakref

import torch
import torch.nn as nn

import graphmem


class _Cycle:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


class _Watching(nn.Module):
    """A linear layer that notes, each time it runs, whether the collector is on and whether a cycle made before
    the step is still alive."""

    def __init__(self, before: "weakref.ref[_Cycle]") -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.before = before
        self.seen: list[tuple[bool, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((gc.isenabled(), self.before() is not None))
        return self.fc(x).relu()


def test_a_step_is_recorded_with_the_collector_paused_after_one_collection() -> None:
    """GIVEN cyclic garbage made just before ``graphmem.analyze`` and a model that watches the collector
    WHEN its step is recorded
    THEN the garbage is gone when the forward runs (collected before the step), the collector is off inside, and on
    again afterwards; a collector the caller turned off stays off."""
    cycle = _Cycle()
    model = _Watching(weakref.ref(cycle))
    del cycle
    assert model.before() is not None and gc.isenabled()
    graphmem.analyze(model, (torch.randn(4, 8),))
    assert model.seen and all(seen == (False, False) for seen in model.seen)
    assert gc.isenabled()
    gc.disable()
    try:
        graphmem.analyze(model, (torch.randn(4, 8),))
        assert not gc.isenabled()
    finally:
        gc.enable()
