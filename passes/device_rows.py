"""What ``nvidia-smi`` shows on a GPU beyond the step's own tensors: one row per item, each with
its bytes, its source and whether it is an estimate (a figure that depends on the GPU, the driver
or the topology and cannot be derived from source). Pure: it reads no device and no environment.

Rows (graphmem/report/__init__.py's device total is the run's max reserved plus these):

- ``cuda_context``: the CUDA context with torch's kernels loaded. Not derivable from source (the
  driver, the GPU and which kernels a run touches decide it): an estimate, overridable.
  ``CUDA_MODULE_LOADING=LAZY`` (the default from CUDA 12.2 on, opt-in from 11.7) loads a kernel
  when it first runs; ``EAGER`` loads every kernel of every library at start.
- ``cublas_workspace``: torch gives each (device, stream) that runs a cuBLAS call one workspace,
  allocated through the caching allocator (so ``torch.cuda.memory_reserved()`` holds it; the
  step's fake tensors do not): pytorch/pytorch aten/src/ATen/cuda/CublasHandlePool.cpp,
  ``parseChosenWorkspaceSize``: ``4096 * 8 * 1024`` B (32 MiB) on compute capability 9.x, 10.x
  and 12.x, ``4096 * 1024 * 2 + 16 * 1024 * 8`` B (``:4096:2:16:8``) below; ``CUBLAS_WORKSPACE_CONFIG``
  (``:SIZE_KiB:COUNT`` pairs) replaces it. cuBLASLt shares it (``getCUDABlasLtWorkspace``: the
  workspaces are unified unless ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=0``). Forward and backward run
  on one stream, so one workspace.
- ``cudnn_workspace``: cuDNN's scratch is requested per call through the caching allocator and
  freed when the call returns; where graphmem has a kernel rule for it (graphmem/oprules/) it is
  in the step as the "workspace" kind already, so this row is 0 B unless overridden.
- ``nccl``: one row per process group the job creates (NCCL makes one communicator per group on
  its first collective). Per channel and peer connection NCCL allocates one buffer per protocol
  (nccl src/init.cc ``computeBuffSizes``): Simple ``DEFAULT_BUFFSIZE`` 4 MiB (``NCCL_BUFFSIZE``),
  LL128 ``120 * 640 * 8 * 8`` B, LL ``8 * 512 * 8 * 16`` B: 9,633,792 B. The channel count is chosen
  by NCCL's topology search: an estimate.
- ``torch_distributed``: ProcessGroupNCCL's own device memory beyond the communicators' buffers
  and the collectives' tensors (which the step counts, the "communication" kind).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

MiB = 1 << 20
CUBLAS_WORKSPACE_HOPPER = 4096 * 8 * 1024  # CublasHandlePool.cpp parseChosenWorkspaceSize: sm 9.x/10.x/12.x
CUBLAS_WORKSPACE_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8  # ":4096:2:16:8" below
NCCL_SIMPLE = 1 << 22  # DEFAULT_BUFFSIZE (NCCL_BUFFSIZE)
NCCL_LL128 = 120 * 640 * 8 * 8  # NCCL_LL128_ELEMS_PER_THREAD * NCCL_LL128_MAX_NTHREADS * NCCL_STEPS * 8
NCCL_LL = 8 * 512 * 8 * 16  # NCCL_LL_LINES_PER_THREAD * NCCL_LL_MAX_NTHREADS * NCCL_STEPS * 16
NCCL_PER_CONNECTION = NCCL_SIMPLE + NCCL_LL128 + NCCL_LL
NCCL_CHANNELS = 16  # an estimate: NCCL's topology search picks 2..MAXCHANNELS (32) rings per communicator
NCCL_PEERS = 2  # the ring's previous and next rank
CONTEXT_LAZY = 512 * MiB  # an estimate: torch's context with lazy module loading
CONTEXT_EAGER = 900 * 1000 * 1000  # an estimate: a user's nvidia-smi reading with torch loaded (A100-80GB)

NAMES = ("cuda_context", "cublas_workspace", "cudnn_workspace", "nccl", "torch_distributed")


@dataclass(frozen=True)
class DeviceRow:
    """One item of device memory outside the step's tensors."""

    name: str  # one of NAMES ("nccl" rows: "nccl <group>")
    bytes: int
    source: str  # where the figure comes from
    estimate: bool  # True: a published or typical figure, not derived from source
    overridden: bool = False  # the user's own figure (``overheads=`` / ``--overhead``)


def device_rows(capability: tuple[int, int], groups: tuple[tuple[str, int], ...] = (),
                overrides: Optional[Mapping[str, int]] = None, lazy_loading: bool = True) -> tuple[DeviceRow, ...]:
    """The rows for one process on a GPU of compute ``capability`` in a job whose process
    groups are ``groups`` ((name, ranks) each; groups of one rank make no communicator),
    ``overrides`` (row name -> bytes; "nccl" sets every communicator's) replacing the figures."""
    o = dict(overrides or {})
    rows = [_context(lazy_loading), _cublas(capability),
            DeviceRow("cudnn_workspace", 0, "per call through the caching allocator, freed on return: in the step "
                      "where graphmem/oprules has the kernel's rule (the \"workspace\" kind)", False)]
    per = NCCL_CHANNELS * NCCL_PEERS * NCCL_PER_CONNECTION
    for name, size in groups:
        if size > 1:
            rows.append(DeviceRow(f"nccl {name}", per, f"communicator of {size} ranks: {NCCL_CHANNELS} channels "
                                  f"(estimate: NCCL's topology search picks them) x {NCCL_PEERS} ring peers x "
                                  f"{NCCL_PER_CONNECTION:,} B (nccl src/init.cc computeBuffSizes: Simple NCCL_BUFFSIZE "
                                  f"4 MiB + LL128 {NCCL_LL128:,} B + LL {NCCL_LL:,} B)", True))
    if any(size > 1 for _, size in groups):
        rows.append(DeviceRow("torch_distributed", 0, "ProcessGroupNCCL allocates its collectives' tensors through the "
                              "caching allocator (in the step, the \"communication\" kind); the rest is host memory",
                              False))
    return tuple(_override(r, o) for r in rows)


def _context(lazy: bool) -> DeviceRow:
    if lazy:
        return DeviceRow("cuda_context", CONTEXT_LAZY, "estimate: the CUDA context with kernels loaded as first run "
                         "(CUDA_MODULE_LOADING=LAZY, the default from CUDA 12.2); it varies with the GPU, the driver "
                         "and the kernels used: read nvidia-smi after torch.cuda.init() and override cuda_context", True)
    return DeviceRow("cuda_context", CONTEXT_EAGER, "estimate: every kernel loaded at start (CUDA_MODULE_LOADING=EAGER); "
                     "a user's nvidia-smi reading with torch loaded on an A100-80GB, about 900 MB", True)


def _cublas(capability: tuple[int, int]) -> DeviceRow:
    big = capability[0] in (9, 10, 12)
    size = CUBLAS_WORKSPACE_HOPPER if big else CUBLAS_WORKSPACE_DEFAULT
    return DeviceRow("cublas_workspace", size, "one per (device, stream) running cuBLAS/cuBLASLt, through the caching "
                     "allocator (pytorch aten/src/ATen/cuda/CublasHandlePool.cpp parseChosenWorkspaceSize: "
                     + ("4096*8 KiB on sm 9.x/10.x/12.x" if big else ":4096:2:16:8 below sm 9.0")
                     + "; CUBLAS_WORKSPACE_CONFIG changes it)", False)


def _override(row: DeviceRow, overrides: dict[str, int]) -> DeviceRow:
    key = "nccl" if row.name.startswith("nccl ") else row.name
    if key not in overrides:
        return row
    return DeviceRow(row.name, overrides[key], f"given (overheads={{'{key}': ...}}); was {row.bytes:,} B: {row.source}",
                     False, True)


def check_overrides(names: Mapping[str, object]) -> Optional[str]:
    """The first override name that names no row (None when all do)."""
    return next((k for k in names if k not in NAMES), None)


__all__ = ["DeviceRow", "NAMES", "device_rows", "check_overrides"]
