"""Dynamo's code cache, read to tell which frames a compiled capture added (graphmem/capture/compiled.py
clears them after, so the user's own torch.compile cache is left as it was)."""
from __future__ import annotations

from typing import Any


def compiled_codes() -> list[Any]:
    """The code objects dynamo has seen (converted frames, input and output)."""
    from torch._dynamo import convert_frame

    out = []
    for tracker in (convert_frame.input_codes, convert_frame.output_codes):
        for ref in list(tracker.seen):
            code = ref()
            if code is not None:
                out.append(code)
    return out


def cache_entries(code: Any) -> int:
    """How many compiled entries dynamo caches for ``code``."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(code))


def cache_sizes() -> dict[int, int]:
    return {id(code): cache_entries(code) for code in compiled_codes()}
