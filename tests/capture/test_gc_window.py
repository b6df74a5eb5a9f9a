"""A recorded step runs as graphmem measures a real one, Python's collector paused inside (graphmem/capture/
collector.py ``quiet_gc``), and ``graphmem.analyze`` pauses its automatic collections for its own work
(``gc_paused``), restoring the collector's state after."""
from __future__ import annotations

import gc

import torch
import torch.nn as nn

import graphmem


class _Watching(nn.Module):
    """A linear layer that notes, each time it runs, whether the collector is on."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(gc.isenabled())
        return self.fc(x).relu()


def test_a_step_is_recorded_with_the_collector_paused() -> None:
    """GIVEN a model that watches the collector
    WHEN its step is recorded by ``graphmem.analyze``
    THEN the collector is off inside, and on again afterwards; a collector the caller turned off
    stays off."""
    model = _Watching()
    assert gc.isenabled()
    graphmem.analyze(model, (torch.randn(4, 8),))
    assert model.seen and not any(model.seen)
    assert gc.isenabled()
    gc.disable()
    try:
        graphmem.analyze(model, (torch.randn(4, 8),))
        assert not gc.isenabled()
    finally:
        gc.enable()
