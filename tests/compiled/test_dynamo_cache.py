"""graphmem/capture/dynamo_cache.py ``guard_failure``: why ``torch._dynamo.run`` (run-only, as the
compiled replay calls it: graphmem/capture/compiled.py) would run a frame eagerly instead of its
cached code. The compiled replay names it when a forward graph did not run."""
from __future__ import annotations

from typing import Any

import torch
from torch._dynamo.eval_frame import reset_code

from graphmem.capture.dynamo_cache import guard_failure


def _scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _shift(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def _step(x: torch.Tensor) -> torch.Tensor:
    return _scale(x).sin()


def test_a_function_swapped_after_the_trace_is_the_failing_guard() -> None:
    """As transformers' ``find_packed_sequence_indices`` was, patched around the replay only: the
    cached code guards on the traced function's code object, so the replay ran eagerly."""
    global _scale
    x = torch.ones(3)
    compiled: Any = torch.compile(_step, backend="eager", dynamic=False)
    traced = _scale
    try:
        assert torch.equal(compiled(x), _step(x))
        assert guard_failure(_step.__code__, {"x": x}) == ""  # the same frame: the cached code runs
        assert guard_failure(_step.__code__, {"x": torch.ones(4)}) != ""  # another shape (dynamic=False)
        _scale = _shift
        reason = guard_failure(_step.__code__, {"x": x})
        assert "_scale" in reason and "__code__" in reason, reason
        assert torch.equal(torch._dynamo.run(_step)(x), (x + 1).sin())  # run-only: eager, the new function
    finally:
        _scale = traced
        reset_code(_step.__code__)


def test_a_code_object_without_cached_entries_has_no_failure() -> None:
    assert guard_failure(_shift.__code__, {"x": torch.ones(2)}) == ""
