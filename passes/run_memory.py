"""The run's memory: what ``torch.cuda.max_memory_allocated()/max_memory_reserved()`` read after a
few steps, and what ``nvidia-smi`` shows beside it (DESIGN.md, "the run's memory").

- The **first step** starts with the parameters, buffers and batch; the optimizer makes its states
  during it. **Later steps** hold the states from their start (passes/later_steps.py).
- Allocated bytes: on the CPU target, the step's live bytes (exact); on the CUDA target, the
  caching-allocator model's block bytes (passes/allocator.py: requests rounded to 512 B, unsplit
  blocks whole), as ``torch.cuda.max_memory_allocated`` counts them.
- Reserved bytes: on the CUDA target, the allocator model's segments, for the first step
  (``allocator``) and for the first two steps through one cache (``later_steps_events``: the
  states kept, the cache kept); elsewhere there is no caching allocator to model and reserved is
  allocated.
- The **device total**: the run's max reserved plus the rows outside the step's tensors
  (passes/device_rows.py); the CPU target has none.

>>> import torch, graphmem
>>> net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
>>> m = graphmem.analyze(net, (torch.randn(8, 16),), optimizer="adam").memory
>>> m.later_allocated - m.first_allocated >= 0, m.device_total == m.run_max_allocated
(True, True)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from graphmem.errors import UsageError
from graphmem.passes.allocator import AllocatorResult, allocator, later_steps_events, simulate
from graphmem.passes.device_rows import DeviceRow
from graphmem.passes.later_steps import later_steps_peak
from graphmem.stepgraph import StepGraph

if TYPE_CHECKING:
    from graphmem.passes.budget import Parallel

FIGURES = ("allocated", "reserved", "device")


@dataclass(frozen=True)
class RunMemory:
    """One rank's memory over a run: first step, later steps, the run's maximum, the device total."""

    first_allocated: int  # the first step's max allocated
    first_reserved: int  # the first step's max reserved
    later_allocated: int  # the later steps' max allocated (optimizer states from the start)
    later_reserved: int  # the later steps' max reserved (the first step's cache kept)
    reserved_from: str  # how reserved was found (the allocator model, or "= allocated" and why)
    rows: tuple[DeviceRow, ...] = ()  # outside the step's tensors (CUDA target)

    @property
    def run_max_allocated(self) -> int:
        """What ``torch.cuda.max_memory_allocated()`` reads after a few steps."""
        return max(self.first_allocated, self.later_allocated)

    @property
    def run_max_reserved(self) -> int:
        """What ``torch.cuda.max_memory_reserved()`` reads after a few steps."""
        return max(self.first_reserved, self.later_reserved)

    @property
    def overhead_bytes(self) -> int:
        return sum(r.bytes for r in self.rows)

    @property
    def device_total(self) -> int:
        """The run's max reserved plus the rows: what nvidia-smi shows for the process at most."""
        return self.run_max_reserved + self.overhead_bytes

    def figure(self, name: str) -> int:
        """The named figure a verdict compares: "allocated", "reserved" or "device"."""
        if name not in FIGURES:
            raise UsageError(f"figure must be one of {', '.join(FIGURES)}, not {name!r}")
        return {"allocated": self.run_max_allocated, "reserved": self.run_max_reserved,
                "device": self.device_total}[name]

    def to_dict(self) -> dict[str, object]:
        return {"first_step": {"max_allocated": self.first_allocated, "max_reserved": self.first_reserved},
                "later_steps": {"max_allocated": self.later_allocated, "max_reserved": self.later_reserved},
                "run_max": {"allocated": self.run_max_allocated, "reserved": self.run_max_reserved},
                "reserved_from": self.reserved_from,
                "device_total": {"bytes": self.device_total,
                                 "rows": [{"name": r.name, "bytes": r.bytes, "source": r.source, "estimate": r.estimate,
                                           "overridden": r.overridden} for r in self.rows],
                                 "overrides": {r.name: r.bytes for r in self.rows if r.overridden}}}


def run_memory(g: StepGraph, first_allocated: int, later_allocated: int, rows: tuple[DeviceRow, ...] = (),
               first: Optional[AllocatorResult] = None, per_rank_formula: bool = False) -> RunMemory:
    """The pass: ``g``'s run memory from its exact first and later peaks (passes/liveness.py,
    passes/budget.py); on the CUDA target the allocator model replaces both by its own figures,
    except under a per-rank formula (the captured step is not the rank's: no allocator to replay).
    ``first``: the first step's allocator result, when already computed."""
    if g.device != "cuda":
        return RunMemory(first_allocated, first_allocated, later_allocated, later_allocated,
                         "= allocated: the CPU target has no caching allocator to model", ())
    if per_rank_formula:
        return RunMemory(first_allocated, first_allocated, later_allocated, later_allocated,
                         "= allocated: the per-rank formula splits the single-device step; the allocator model "
                         "replays captured steps only (analyze the rank through the wrappers for it)", rows)
    one = first if first is not None else allocator(g)
    two = simulate(later_steps_events(g))  # the first two steps through one cache
    return RunMemory(one.max_allocated, one.max_reserved, two.max_allocated, two.max_reserved,
                     "the caching-allocator model (passes/allocator.py) over the first step, and over the first two "
                     "steps through one cache for the later steps", rows)


def step_memory(g: StepGraph, rows: tuple[DeviceRow, ...] = (), parallel: Optional[Parallel] = None) -> RunMemory:
    """``run_memory`` of a step captured again (a plan applied, another size), with the report's
    device ``rows``; under a per-rank formula ``parallel`` (passes/budget.py Parallel), its rank's peaks."""
    from graphmem.passes.budget import Parallel, budget
    from graphmem.passes.liveness import liveness
    from graphmem.passes.saved import saved

    lv = liveness(g)
    if parallel is not None and parallel != Parallel():
        rank = budget(g, lv, saved(g), parallel)
        return run_memory(g, rank.peak_bytes, rank.later_peak_bytes, rows, per_rank_formula=True)
    return run_memory(g, lv.peak_bytes, later_steps_peak(g, lv), rows)


def default_figure(device: str) -> str:
    """The figure a verdict compares unless told: the device total on the CUDA target; on the CPU
    target, allocated (no caching allocator, no device rows: all three are equal there)."""
    return "device" if device == "cuda" else "allocated"


def figure_for(device: str, figure: Optional[str]) -> str:
    """``figure`` checked, or the default for the target ``device`` (``default_figure``)."""
    if figure is None:
        return default_figure(device)
    if figure not in FIGURES:
        raise UsageError(f"figure must be one of {', '.join(FIGURES)}, not {figure!r}")
    return figure


FIGURE_NAMES = {"allocated": "run max allocated", "reserved": "run max reserved", "device": "device total"}

__all__ = ["FIGURES", "FIGURE_NAMES", "RunMemory", "default_figure", "figure_for", "run_memory", "step_memory"]
