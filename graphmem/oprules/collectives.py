"""Scratch rules for the collectives on the CPU target, where torch.distributed runs gloo
(graphmem/oprules/registry.py: live during the op only, counted in the peak).

Read from torch/csrc/distributed/c10d/ProcessGroupGloo.cpp:

- ``_allgather_base`` chunks the output and runs the allgather work, which gathers into one
  flat temporary the size of the whole output (``flatOutputTensor``) and copies it out into the
  chunks: the output's bytes, freed when the work ends;
- ``_reduce_scatter_base`` (``reduce_scatter_tensor_coalesced``) clones the input
  (``buffers.push_back(inputTensors[i].clone())``), all-reduces the clone and copies this rank's
  chunk into the output: the input's bytes, freed with the work.

DTensor's redistributions run the functional collectives (``_c10d_functional.*``), which
allocate their output and call the same process-group methods: the same scratch. On the CUDA
target the collectives are NCCL's, which gather and reduce in place: no rule.

A kernel rule: ``_c10d_functional.wait_tensor`` returns its input (the collective's output,
now complete: torch/csrc/distributed/c10d/Functional.cpp, ``wait_tensor``), where the fake
kernel makes a new tensor.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from graphmem.oprules.registry import Run, Scratch, register_kernel, register_scratch

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode

_c10d = torch.ops.c10d
_functional = torch.ops._c10d_functional


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@register_scratch(_c10d._allgather_base_.default, _functional.all_gather_into_tensor.default,
                  source="torch/csrc/distributed/c10d/ProcessGroupGloo.cpp _allgather_base (flatOutputTensor)")
def _gloo_allgather(args: tuple, kwargs: dict, out: object) -> list[Scratch]:
    output = out if isinstance(out, torch.Tensor) else args[0]  # functional: its output; c10d: the output argument
    return [Scratch(_nbytes(output), "gloo all-gather's flat output temporary (ProcessGroupGloo.cpp)")]


@register_scratch(_c10d._reduce_scatter_base_.default, _functional.reduce_scatter_tensor.default,
                  source="torch/csrc/distributed/c10d/ProcessGroupGloo.cpp reduce_scatter_tensor_coalesced")
def _gloo_reduce_scatter(args: tuple, kwargs: dict, out: object) -> list[Scratch]:
    inp = args[0] if isinstance(out, torch.Tensor) else args[1]  # functional: (input, ...); c10d: (output, input, ...)
    return [Scratch(_nbytes(inp), "gloo reduce-scatter's clone of the input (ProcessGroupGloo.cpp "
                                  "reduce_scatter_tensor_coalesced)")]


@register_kernel(_functional.wait_tensor.default, source="torch/csrc/distributed/c10d/Functional.cpp wait_tensor")
def _wait_tensor(run: Run, args: tuple, kwargs: dict, mode: FakeTensorMode) -> torch.Tensor:
    return args[0]
