"""AsyncTP's fused ops on the CUDA target (graphmem/titan/async_tp.py puts them in the graphs):
what their CUDA implementations allocate beyond their outputs, and the symmetric-memory workspace.

Read from torch 2.14.1 torch/distributed/_symmetric_memory/__init__.py, whose CUDA kernels are
Python (registered with ``torch.library.impl(lib, ..., "CUDA")``); the fake kernel is the
``Meta`` fallback, whose outputs (the gathered A, the matmul outputs, the reduce-scattered
output) have the CUDA implementation's shapes, dtypes and layouts, so only what the CUDA code
allocates and frees inside the op is added here, as scratch (live during the op only).

``symm_mem.fused_all_gather_matmul`` (``_fused_all_gather_matmul``; the native path needs
``TORCH_SYMM_MEM_ENABLE_NATIVE_ASYNC_TP`` set, not modelled):

- gather dim not last (``_fused_all_gather_matmul_impl``): ``A_shard.movedim(gather_dim,
  0).flatten(0, -2)`` copies the shard when that is not a view (the pass restrides the operand
  so it is); ``A_flat = new_empty(rows * group, K)`` is the gathered A: the output A with
  ``return_A``, else scratch; the outputs ``new_empty(rows * group, N)`` are the outputs;
- gather dim last (``_fused_all_gather_matmul_last_gather_dim_impl``): ``A_flat_out`` (rows *
  group, K) is always scratch (with ``return_A`` the output A is a ``torch.cat`` of its chunks);
- ``_multimem_all_gather_matmul`` (gather dim 0, no ``return_A``, contiguous shard, at most 2048
  gathered rows, a GPU with multicast, as an NVSwitch H100): A is a buffer of the symmetric
  workspace itself, the outputs ``torch.matmul``'s: no scratch.

``symm_mem.fused_matmul_reduce_scatter`` (``_fused_matmul_reduce_scatter_impl``): the stacked
partials ``new_empty(rows, N)`` in A's dtype (all ranks' chunks of A @ B, reduced by
``reduce_partials`` into the output), and the copy of A when ``flatten`` cannot view it.

The workspace: ``get_symm_mem_workspace(group, min_size)`` keeps one buffer per process group,
grown to the largest ``min_size`` asked (the shard's bytes for an all-gather matmul, twice an
output chunk's for a matmul reduce-scatter, the gathered A for the multimem path), allocated by
``_SymmetricMemory.empty_strided_p2p``: ``SymmetricMemoryAllocator::alloc()``
(torch/csrc/distributed/c10d/symm_mem/SymmetricMemory.hpp; CUDA: CUDASymmetricMemory.cu maps
its own physical memory with the driver's ``cuMemCreate``), not the CUDA caching allocator, so it
is in neither max allocated nor max reserved; each allocation also holds a signal pad
(``_SymmetricMemory.signal_pad_size``, 9,216 B by default, CUDASymmetricMemoryTypes.hpp).
``workspace_line`` reports it apart.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Optional, Union

import torch
from torch._ops import OpOverload

from graphmem.oprules.registry import RecordedOp, Run, Scratch, register_kernel, register_scratch

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.distributed_c10d import GroupName



def _op(name: str) -> Optional[OpOverload]:
    try:
        import torch.distributed._symmetric_memory  # noqa: F401  (defines the symm_mem library)
    except ImportError:
        return None
    packet = getattr(torch.ops.symm_mem, name, None)
    return getattr(packet, "default", None) if packet is not None else None


AG_MM, MM_RS = _op("fused_all_gather_matmul"), _op("fused_matmul_reduce_scatter")
SOURCE = "torch/distributed/_symmetric_memory/__init__.py"
MULTIMEM_ROWS = 2048  # _should_use_multimem_all_gather_matmul: local_M * group size <= 2048


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _group_size(name: GroupName) -> int:
    import torch.distributed.distributed_c10d as c10d

    return c10d._get_group_size_by_name(name)


def _flatten_copies(t: torch.Tensor) -> bool:
    """``t.flatten(0, -2)`` makes a copy: its leading dimensions cannot be viewed as one."""
    return t.dim() > 2 and not _viewable(t)


def _viewable(t: torch.Tensor) -> bool:
    """The leading dimensions of ``t`` (all but the last) view as one: each stride is the next's
    extent, dimensions of size 1 aside (``flatten`` then returns a view)."""
    expected = None
    for size, stride in reversed([d for d in zip(t.shape[:-1], t.stride()[:-1]) if d[0] != 1]):
        if expected is not None and stride != expected:
            return False
        expected = stride * size
    return True


def ag_path(shard_shape: tuple[int, ...], gather_dim: int, return_a: bool, contiguous: bool, group: int) -> str:
    """Which CUDA implementation ``_fused_all_gather_matmul`` takes (module docstring)."""
    gather_dim = gather_dim % len(shard_shape)
    if gather_dim == len(shard_shape) - 1:
        return "last"
    if not return_a and contiguous and gather_dim == 0 and math.prod(shard_shape[:-1]) * group <= MULTIMEM_ROWS:
        return "multimem"
    return "rows"


@register_scratch(AG_MM, devices=("cuda",), source=f"{SOURCE} _fused_all_gather_matmul_impl, "
                  "_fused_all_gather_matmul_last_gather_dim_impl, _multimem_all_gather_matmul")
def _all_gather_matmul(args: tuple, kwargs: dict, out: object) -> list[Scratch]:
    a_shard, gather_dim, group = args[0], args[2], args[3]
    return_a, size = kwargs.get("return_A", True), _group_size(group)
    path = ag_path(tuple(a_shard.shape), gather_dim, return_a, a_shard.is_contiguous(), size)
    gathered = _nbytes(a_shard.shape, a_shard.dtype) * size
    if path == "multimem":
        return []
    if path == "last":
        return [Scratch(gathered, "fused all-gather matmul's gathered A_flat_out (_symmetric_memory "
                                  "_fused_all_gather_matmul_last_gather_dim_impl)")]
    found = []
    if _flatten_copies(a_shard.movedim(gather_dim, 0)):
        found.append(Scratch(_nbytes(a_shard.shape, a_shard.dtype), "fused all-gather matmul's copy of the shard "
                                                                     "(A_shard.movedim(gather_dim, 0).flatten)"))
    if not return_a:
        found.append(Scratch(gathered, "fused all-gather matmul's gathered A_flat (_fused_all_gather_matmul_impl)"))
    return found


@register_kernel(AG_MM, devices=("cuda",), source=f"{SOURCE} _fused_all_gather_matmul_impl (outputs, unflatten); "
                 "torch/_inductor/ir.py FlexibleLayout (the pointwise kernels that read them)")
def _outputs_as_read(run: Run, args: tuple, kwargs: dict, mode: FakeTensorMode) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The matmul outputs laid out contiguously, A as the CUDA implementation lays it out. Both
    are ``(group, rows, ...)``-ordered on the GPU (``unflatten`` moves the gathered dimension
    back, so with a gather dim past 0, as sequence parallel's, and a batch over 1 they are not
    contiguous). Their bytes are the same either way; the layout decides only what copies the
    graph's next ops make. Inductor's pointwise kernels, which read the matmul outputs (SwiGLU,
    RoPE, the backward's), index any layout and write contiguous (flexible-layout) buffers,
    where eager ops run on fake tensors keep the permuted order and copy it at the next reshape:
    copies the compiled job never makes. A is reshaped to 2-D for the weight gradient's matmul
    and for the saved input, which Inductor copies as well (a view it cannot express by strides,
    realized for an extern kernel or a graph output), so it keeps the GPU's layout."""
    a, outs = run(*args, **kwargs)
    with mode:
        return a, [torch.empty(c.shape, dtype=c.dtype, device=c.device) for c in outs]


@register_scratch(MM_RS, devices=("cuda",), source=f"{SOURCE} _fused_matmul_reduce_scatter_impl")
def _matmul_reduce_scatter(args: tuple, kwargs: dict, out: object) -> list[Scratch]:
    a, b, scatter_dim = args[0], args[1], args[3] % args[0].dim()
    rows = math.prod(a.shape[:-1])
    found = [Scratch(rows * b.shape[1] * a.dtype.itemsize, "fused matmul reduce-scatter's stacked partials "
                                                           "(_fused_matmul_reduce_scatter_impl)")]
    flat = a if scatter_dim == a.dim() - 1 else a.movedim(scatter_dim, 0)
    if _flatten_copies(flat):
        found.append(Scratch(_nbytes(a.shape, a.dtype), "fused matmul reduce-scatter's copy of A (flatten)"))
    return found


def workspace_bytes(ops: Iterable[RecordedOp]) -> int:
    """The symmetric-memory workspace one TP group's buffer grows to over the recorded ``ops``
    (``get_symm_mem_workspace``'s largest ``min_size``), with its signal pad; 0 without fused ops."""
    from torch._C._distributed_c10d import _SymmetricMemory

    need = 0
    for node in ops:
        if node.target is AG_MM:
            shape, dtype = _meta(node.args[0])
            outs = node.meta["outputs"]  # (A,) + Cs, or Cs alone without return_A
            return_a = node.kwargs.get("return_A", True)
            group = math.prod(outs[-1][0][:-1]) // max(math.prod(shape[:-1]), 1)
            # the pass restrides the shard so that movedim(gather_dim, 0) is contiguous (async_tp.py)
            multimem = ag_path(shape, node.args[2], return_a, True, group) == "multimem"
            need = max(need, _nbytes(shape, dtype) * (group if multimem else 1))
        elif node.target is MM_RS:
            shape, dtype, _ = node.meta["outputs"][0]
            need = max(need, 2 * _nbytes(shape, dtype))
    return need + int(_SymmetricMemory.signal_pad_size) if need else 0


def _meta(arg: Union[RecordedOp, tuple[RecordedOp, int]]) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of a recorded argument: an OpNode, or (OpNode, i) for output i."""
    if isinstance(arg, tuple):
        node, i = arg
        positions = node.meta.get("positions")
        shape, dtype, _ = node.meta["outputs"][positions.index(i) if positions else i]
        return shape, dtype
    return arg.meta["shape"], arg.meta["dtype"]


def workspace_line(ops: Iterable[RecordedOp]) -> tuple[str, ...]:
    """The report's line for the workspace (outside max allocated and max reserved), or none."""
    need = workspace_bytes(ops)
    if not need:
        return ()
    size = f"{need / 2 ** 30:.2f} GiB" if need >= 2 ** 30 else f"{need / 2 ** 20:.2f} MiB" if need >= 2 ** 20 \
        else f"{need / 2 ** 10:.2f} KiB"
    return (f"symmetric memory workspace: {size} for the TP group (AsyncTP's fused ops; allocated by "
            "the symmetric-memory allocator, torch/csrc/distributed/c10d/symm_mem/SymmetricMemory.hpp, outside the "
            "CUDA caching allocator: not in max allocated or max reserved; the driver rounds it up to its "
            "allocation granularity)",)


__all__ = ["AG_MM", "MM_RS", "ag_path", "workspace_bytes", "workspace_line"]
