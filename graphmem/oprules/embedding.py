"""The embedding's backward on the CPU (aten/src/ATen/native/Embedding.cpp): a dense copy of a
strided output gradient.
"""
from __future__ import annotations

from graphmem.oprules.registry import Scratch, aten_op, register_scratch


@register_scratch(aten_op("embedding_dense_backward"), source="aten/src/ATen/native/Embedding.cpp embedding_dense_backward_cpu")
def _embedding_backward(args: tuple, kwargs: dict, out: object) -> list[Scratch]:
    """aten/src/ATen/native/Embedding.cpp ``embedding_dense_backward_cpu``:
    ``grad_.contiguous().view({numel, d})``, a dense copy of a strided output gradient."""
    grad = args[0]
    return [] if grad.is_contiguous() else [Scratch(grad.numel() * grad.dtype.itemsize, "grad.contiguous()")]
