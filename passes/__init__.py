"""Pure passes over a StepGraph: each takes the graph (and earlier results) and returns a
frozen result; none prints or writes onto the graph's nodes."""
from graphmem.passes.allocator import AllocatorResult, allocator
from graphmem.passes.liveness import Liveness, LiveTensor, liveness
from graphmem.passes.modes import ModeComparison, ModuleModes, Recomputed, compare_modes, recomputed
from graphmem.passes.notes import notes
from graphmem.passes.saved import ModuleSaved, SavedSet, SavedTensor, saved

__all__ = ["AllocatorResult", "allocator", "LiveTensor", "Liveness", "liveness", "ModuleSaved", "SavedSet", "SavedTensor", "saved", "notes",
           "ModeComparison", "ModuleModes", "Recomputed", "compare_modes", "recomputed"]
