"""Which module made each autograd node, and when the engine may add a gradient in place.

In backward no module hook runs: ``_tag_grad_fns`` labels the autograd nodes a module's forward
created with its path (the recorder reads the running node's tag, graphmem/capture/recorder.py),
and a post hook marks each node as run, so the recorder can tell the engine's own gradient sums
from the model's adds. ``_unique_counts`` calibrates, once per process on a tiny real step, the
reference counts a gradient held only by the engine shows inside a dispatch mode (the condition
of the engine's in-place accumulation, torch/csrc/autograd/input_buffer.cpp).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch._ops import OpOverload
from torch.autograd.graph import Node
from torch.utils._python_dispatch import TorchDispatchMode

_TAG = "graphmem_module"  # key in grad_fn.metadata: module path of the forward op
_DONE = "graphmem_done"  # set in grad_fn.metadata by a post hook once the node has run
_ADD = torch.ops.aten.add.Tensor


def engine_phase(phase: str) -> str:
    """The phase of the op running now, as autograd runs it: an op the engine runs for a node is
    backward's, even while the step is in its forward or its loss (a loss that runs backward on its
    own chunks before the step's ``loss.backward()``: torchtitan's ChunkedLossWrapper)."""
    if phase in ("forward", "loss") and torch._C._current_autograd_node() is not None:
        return "backward"
    return phase


def node_metadata(fn: Any) -> dict:  # a torch.autograd.graph.Node
    """An autograd node's metadata dict (a property; torch's stubs call it a method)."""
    return fn.metadata


def _dense(t: torch.Tensor) -> bool:
    return bool(torch._prims_common.is_non_overlapping_and_dense_or_false(t))


_COUNTS: list[tuple[int, int]] = []


class _Probe(TorchDispatchMode):
    """Reads the reference counts a uniquely held gradient shows inside a dispatch mode."""

    def __torch_dispatch__(self, func: OpOverload, types: Sequence[type], args: tuple = (),
                           kwargs: Optional[dict] = None) -> object:
        fn = torch._C._current_autograd_node()
        if func is _ADD and fn is not None and node_metadata(fn).get(_DONE) and not _COUNTS:
            _COUNTS.append((args[0]._use_count(), torch._C._storage_Use_Count(args[0].untyped_storage()._cdata)))
        return func(*args, **(kwargs or {}))


def _unique_counts() -> tuple[int, int]:
    """Calibrated once per process on a tiny real step: ``y * y`` sends two fresh gradients to
    ``y``'s producer, and the first is held only by the engine's input buffer."""
    if not _COUNTS:
        x = torch.ones(2, requires_grad=True)
        with _Probe():
            y = x.exp()
            loss = (y * y).sum()
            _tag_grad_fns(loss, "")
            loss.backward()
        if not _COUNTS:
            _COUNTS.append((-1, -1))  # never matches: the out-of-place sum is kept
    return _COUNTS[0]


def _tag_grad_fns(output: object, path: str, start: int = 0) -> None:
    """Label the autograd nodes a module created with its path (innermost module wins:
    inner modules finish, and tag, first; the walk passes through nodes already tagged,
    since the module's own ops may lie behind an inner module's (``x = self.a(x); x = x.exp();
    self.b(x)``), and stops at nodes created before the module started, whose sequence number
    is below ``start``), and add a post hook that marks each node as run (see
    _accumulates_inplace): a node left untagged would also have no hook, and the engine's
    gradient sums after it would look like the model's adds."""
    todo = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
    seen: set[Node] = set()
    while todo:
        fn = todo.pop()
        if fn in seen or fn._sequence_nr() < start:
            continue
        seen.add(fn)
        md = node_metadata(fn)
        if _TAG in md:  # an inner module's node: the module's own nodes may lie behind it
            todo.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
            continue
        md[_TAG] = path
        if getattr(getattr(fn, "_forward_cls", None), "boxed_grads_call", False):
            # a hook would make the engine hand this node its grads in a tuple it holds until
            # the node returns, where it otherwise passes a list the node frees as it goes
            # (AOTAutograd's compiled backward); the node marks itself done (graphmem/capture/compiled.py)
            pass
        else:
            fn.register_hook(lambda grad_inputs, grad_outputs, md=md: md.__setitem__(_DONE, True))
        for nxt, _ in fn.next_functions:
            if nxt is not None:
                todo.append(nxt)


def _tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return []

