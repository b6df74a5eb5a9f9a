"""transformers' real code paths on fake tensors.

transformers asks ``is_tracing(tensor)`` before reading a tensor's values, and counts a
FakeTensor as tracing (``transformers.utils.import_utils.is_fake_tensor``). Where its answer
changes memory, graphmem's capture would record a step the real run never takes:

- ``masking_utils.find_packed_sequence_indices``: without a KV cache and an attention mask (a
  training step with ``use_cache=False``, or under transformers' own gradient checkpointing,
  which turns the cache off), the real run finds the position ids are one sequence per row and
  returns None, so SDPA runs causal without a mask; on fake tensors it returns the packed-
  sequence ids and every layer gets a materialized (b, 1, s, s) mask: more saved bytes and a
  higher peak than the real step (98 KB on a 4-layer Llama at 2x32).

While a capture runs, ``find_packed_sequence_indices`` answers for fake position ids as the
real run does for the position ids transformers makes itself (``arange``: one sequence per
row, None). Position ids whose values graphmem knows (the caller's own, or
transformers' ``arange``: graphmem/capture/values.py) are read as the real run reads them.
Known limitation: packed position ids without values (given as meta tensors) are analyzed as
unpacked.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor

from graphmem.capture.values import Values, knowing


@contextlib.contextmanager
def real_paths(values: Optional[Values] = None) -> Iterator[None]:
    """Within: transformers (if imported) takes its real-run branches on fake tensors, and reads
    the values that ``values`` knows. Compiled mode runs without it (graphmem/capture/capture.py):
    the real compiled step never reads a mask or position ids (``is_tracing`` is true under
    dynamo), and dynamo's cached code guards on the functions it traced (here
    ``find_packed_sequence_indices.__code__``, read when a batch has no attention mask), so a
    replay under another function than the trace's runs eagerly, outside the compiled graphs."""
    known = values or Values()
    masking: Any = sys.modules.get("transformers.masking_utils")
    original: Any = getattr(masking, "find_packed_sequence_indices", None) if masking is not None else None

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> Optional[torch.Tensor]:
        if isinstance(position_ids, FakeTensor) and known.of(position_ids) is None:
            return None  # one sequence per row, as the real run finds for transformers' own position ids
        return original(position_ids)

    if original is not None:
        masking.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        with knowing(values) if values is not None else contextlib.nullcontext():
            yield
    finally:
        if original is not None:
            masking.find_packed_sequence_indices = original
