"""Dynamo's code cache, read to tell which frames a compiled capture added (graphmem/capture/compiled.py
clears them after, so the user's own torch.compile cache is left as it was)."""
from __future__ import annotations

import types


def compiled_codes() -> list[types.CodeType]:
    """The code objects dynamo has seen (converted frames, input and output)."""
    from torch._dynamo import convert_frame

    out = []
    for tracker in (convert_frame.input_codes, convert_frame.output_codes):
        for ref in list(tracker.seen):
            code = ref()
            if code is not None:
                out.append(code)
    return out


def cache_entries(code: types.CodeType) -> int:
    """How many compiled entries dynamo caches for ``code``."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(code))


def cache_sizes() -> dict[int, int]:
    return {id(code): cache_entries(code) for code in compiled_codes()}


def guard_failure(code: types.CodeType, f_locals: dict[str, object]) -> str:
    """Why no cached entry of ``code`` runs for a frame with ``f_locals``: the first guard that fails
    in the newest entry (dynamo's own text: the guard and the source line it came from), or "" when
    one entry's guards pass or ``code`` has none. ``torch._dynamo.run`` runs a frame whose guards
    all fail eagerly, without a word (no recompile to report)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    entries = _debug_get_cache_entry_list(code)
    if not entries or any(e.guard_manager.check(f_locals) for e in entries):
        return ""
    parts = entries[0].guard_manager.check_verbose(f_locals).verbose_code_parts
    return " ".join(str(parts[0]).split()) if parts else "a guard failed"
