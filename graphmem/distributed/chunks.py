"""FSDP2's sharding at large world sizes, without making every rank's chunk.

``fully_shard`` cuts each parameter into ``world_size`` chunks (``_chunk_with_empty``,
torch/distributed/fsdp/_fully_shard/_fsdp_common.py: ``torch.chunk``, then ``new_empty(0)``
until there are ``world_size``) and reads two of them: this rank's and chunk 0, whose size is
the padded one (_fsdp_param.py, ``_init_sharded_param`` and
``_init_sharded_post_forward_param_metadata``). On fake tensors each chunk is an op through the
fake mode: at world 1024 a 64-row weight makes 64 views and 960 empty tensors, and the setup of
a 4-block Llama took 16 s. ``lazy_chunks`` hands FSDP2 a sequence that makes a chunk when it is
read, the same tensor ``torch.chunk`` makes (chunk i is ``narrow(dim, i * c, min(c, n - i * c))``
with ``c = ceil(n / chunks)``: aten's chunk and split, torch/_refs/__init__.py ``chunk``), and an
empty tensor past the last one. Only during the setup of the fake copy
(graphmem/distributed/capture.py); the real runs of tests/dist_truth.py keep torch's own.

Known limitations: a dimension of size 0 goes to torch's own function (aten special-cases it).
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Callable, Iterator, Union, overload

import torch


class _Chunks(Sequence):
    """``torch.chunk(tensor, n, dim)`` padded with empty tensors to ``n``, made on demand."""

    def __init__(self, tensor: torch.Tensor, n: int, dim: int) -> None:
        self.tensor, self.n, self.dim = tensor, n, dim
        size = tensor.size(dim)
        self.step = -(-size // n)
        self.made = -(-size // self.step)  # how many torch.chunk returns
        self.memo: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.n

    @overload
    def __getitem__(self, i: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, i: slice) -> list[torch.Tensor]: ...

    def __getitem__(self, i: Union[int, slice]) -> Union[torch.Tensor, list[torch.Tensor]]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(i)
        if i not in self.memo:
            if i < self.made:
                start = i * self.step
                self.memo[i] = self.tensor.narrow(self.dim, start, min(self.step, self.tensor.size(self.dim) - start))
            else:
                self.memo[i] = self[0].new_empty(0)
        return self.memo[i]


def _chunk_lazily(original: Callable[[torch.Tensor, int, int], list[torch.Tensor]]) -> Any:  # (poses as it)
    def chunk_with_empty(tensor: torch.Tensor, num_chunks: int, dim: int) -> Any:
        if tensor.size(dim) == 0:
            return original(tensor, num_chunks, dim)
        return _Chunks(tensor, num_chunks, dim)
    return chunk_with_empty


@contextlib.contextmanager
def lazy_chunks() -> Iterator[None]:
    """While fully_shard sets up: FSDP2's chunking makes only the chunks it reads."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    original = _fsdp_param._chunk_with_empty
    _fsdp_param._chunk_with_empty = _chunk_lazily(original)
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty = original
