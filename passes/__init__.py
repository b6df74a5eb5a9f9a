"""Pure passes over a StepGraph: each takes the graph (and earlier results) and returns a
frozen result; none prints or writes onto the graph's nodes."""
from .allocator import AllocatorResult, allocator
from .liveness import LiveTensor, Liveness, liveness
from .modes import ModeComparison, ModuleModes, Recomputed, compare_modes, recomputed
from .notes import notes
from .saved import ModuleSaved, SavedSet, SavedTensor, saved

__all__ = ["AllocatorResult", "allocator", "LiveTensor", "Liveness", "liveness", "ModuleSaved", "SavedSet", "SavedTensor", "saved", "notes",
           "ModeComparison", "ModuleModes", "Recomputed", "compare_modes", "recomputed"]
