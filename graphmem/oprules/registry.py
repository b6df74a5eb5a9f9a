"""The one registry of per-op rules: where a real kernel's memory differs from what its fake (meta)
kernel shows, keyed by aten (or library) overload and by the target device ("cpu", "cuda") the
rule holds for. Each decorator refuses duplicates (as torch/utils/flop_counter.py's
``register_flop_formula``) and takes the ``source``, the kernel file and function the rule was
read from. Three kinds:

- **kernel rules** (``register_kernel``) replace the fake kernel of an op whose meta kernel
  refuses what the real kernel accepts or returns a tensor of the wrong size (``aten._grouped_mm``
  on fp32, the oneDNN RNN workspace, ``wait_tensor``); ``workspace_outputs`` names the outputs
  that are kernel workspaces (their storages are of kind "workspace");
- **scratch rules** (``register_scratch``) give the bytes a kernel allocates and frees inside one
  op; the recorder adds each as a storage of kind "workspace" live during that op only, so it
  counts in the peak (passes/timeline.py shows it as its own category);
- **note rules** (``register_note``) flag an op whose real memory graphmem has no rule for; the
  report carries the note (passes/notes.py), so nobody mistakes the number for the whole truth.

The rules live in one module per kernel family (graphmem/oprules/__init__.py lists them), each
derived from the kernel's source and tested against real CPU runs where the kernel runs here
(tests/oprules/test_workspace*.py). Sizes that depend on the thread count use ``torch.get_num_threads()``
of the analyzing process: a CPU prediction is for a run with as many threads.
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, TypeVar

import torch
from torch._ops import OpOverload

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode


@dataclass(frozen=True)
class Scratch:
    """Bytes one kernel allocates and frees inside an op."""

    nbytes: int
    what: str  # e.g. "flash attention buffers (FlashAttentionKernel.cpp)"


class RecordedOp(Protocol):
    """What the note rules and the workspace line read of a recorded op (graphmem/stepgraph.py's
    ``OpNode``, which this layer sits below)."""

    @property
    def target(self) -> object: ...
    @property
    def args(self) -> tuple: ...
    @property
    def kwargs(self) -> dict: ...
    @property
    def meta(self) -> dict[str, Any]: ...


Run = Callable[..., Any]  # the fake kernel: run(*args, **kwargs)
KernelRule = Callable[[Run, tuple, dict, "FakeTensorMode"], object]  # (run, args, kwargs, fake mode to make new tensors under)
ScratchRule = Callable[..., list[Scratch]]  # (args, kwargs, out), or (args, kwargs, out, capability) when per_gpu
NoteRule = Callable[[RecordedOp], str]  # (the op's recorded node) -> the note, or "" where another rule covers the op


@dataclass(frozen=True)
class Rule:
    """One registered rule: what it is, the op and target device it holds for, the function, and
    the kernel source (file and function) it was derived from."""

    kind: str  # "kernel", "scratch" or "note"
    op: OpOverload
    device: str
    fn: Callable[..., Any]
    source: str
    family: str  # the module of graphmem/oprules/ that registers it
    per_gpu: bool = False  # a scratch rule told the target GPU's compute capability (Target.capability)


# keyed by the op (an OpOverload); looked up with whatever target a recorded node has
RULES: dict[tuple[str, Hashable, str], Rule] = {}  # (kind, op, device) -> rule
WORKSPACE_OUTPUTS: dict[Hashable, tuple[int, ...]] = {}  # op -> output positions that are kernel workspaces


def aten_op(name: str, overload: str = "default") -> Optional[OpOverload]:
    """``torch.ops.aten.<name>.<overload>``, or None where this torch has no such op (its rule is skipped)."""
    packet = getattr(torch.ops.aten, name, None)
    return getattr(packet, overload, None) if packet is not None else None


_F = TypeVar("_F", bound=Callable[..., object])


def _register(kind: str, ops: tuple[Optional[OpOverload], ...], devices: tuple[str, ...], source: str,
              per_gpu: bool = False) -> Callable[[_F], _F]:
    if not source.strip():
        raise RuntimeError(f"a {kind} rule must name its kernel source (file and function)")

    def wrap(fn: _F) -> _F:
        for op in ops:
            if op is None:
                continue
            for d in devices:
                if (kind, op, d) in RULES:
                    raise RuntimeError(f"a {kind} rule for {op} on {d} is already registered")
                RULES[(kind, op, d)] = Rule(kind, op, d, fn, source, fn.__module__.rpartition(".")[2], per_gpu)
        return fn
    return wrap


def register_kernel(*ops: Optional[OpOverload], source: str, devices: tuple[str, ...] = ("cpu", "cuda"),
                    workspace_outputs: tuple[int, ...] = ()) -> Callable[[KernelRule], KernelRule]:
    """Register ``fn(run, args, kwargs, mode) -> outputs`` in place of the fake kernel of ``ops``
    (``run`` is the fake kernel; new tensors are made under ``with mode:``)."""
    def wrap(fn: KernelRule) -> KernelRule:
        _register("kernel", ops, devices, source)(fn)
        if workspace_outputs:
            WORKSPACE_OUTPUTS.update((op, workspace_outputs) for op in ops if op is not None)
        return fn
    return wrap


def register_scratch(*ops: Optional[OpOverload], source: str, devices: tuple[str, ...] = ("cpu",),
                     per_gpu: bool = False) -> Callable[[ScratchRule], ScratchRule]:
    """Register ``fn(args, kwargs, out) -> [Scratch]``: what ``ops`` allocate inside the kernel;
    ``per_gpu``: ``fn(args, kwargs, out, capability)``, told the target GPU's compute capability."""
    return _register("scratch", ops, devices, source, per_gpu)


def register_note(*ops: Optional[OpOverload], source: str, devices: tuple[str, ...] = ("cpu", "cuda")) -> Callable[[NoteRule], NoteRule]:
    """Register ``fn(node) -> str``: the report's note for ``ops`` on ``devices``."""
    return _register("note", ops, devices, source)


def find(kind: str, op: Hashable, device: str) -> Optional[Rule]:
    return RULES.get((kind, op, device))
