"""Python numbers an op takes as tensors ("wrapped numbers"), on the CPU target in eager mode.

``x * 0.5`` calls ``aten::mul.Tensor(Tensor self, Tensor other)``: Python's argument parser turns
the float into a 0-dim float64 tensor marked as a wrapped number (torch/csrc/utils/
python_arg_parser.cpp ``scalar_to_tensor``; int64 for an int, complex128 for a complex, bool for a
bool), allocated by the CPU allocator like any tensor, and freed when the call returns. If the
op's autograd node saves it (``MulBackward0`` keeps ``other`` to scale ``self``'s gradient,
``DivBackward0`` likewise: tools/autograd/derivatives.yaml), it lives until that node runs in
backward. Fake tensors never see it: a dispatch mode receives the Python number back
(``__torch_dispatch__`` unwraps wrapped numbers), and saved-tensor hooks are not called for it, so
saved bytes are unchanged while the real step's peak holds it.

Here each such argument of an op the recorder records becomes an 8 B (or 1/16 B) storage of that
op, and where the op's node saved it (read from the node itself: ``_saved_<argument>`` is a
0-dim tensor that is not fake, the saved tensor itself) it lives until that tensor dies: a
``weakref.finalize`` on it fires when autograd releases the node's saved variables, after the node
ran in backward or with its graph (a branch no backward runs; a checkpoint's recomputed forward,
whose nodes never run and die when the recomputed tensors are used). Found
from the real steps' allocation events by their parent ops: GPT-2's GELU ``0.5 * x`` (24 B a
block), peft LoRA's ``* scaling`` (8 B an adapted linear), a MoE router's ``* route_scale``
(8 B a layer), AdamW's ``/ bias_correction2_sqrt`` (8 B, and its 4 B float32 cast, for the moment
of the division).

Only on the CPU target and in eager mode: on a GPU a wrapped number is a host tensor (device
memory never holds it), and a compiled graph's backward keeps no autograd node per op.
"""
from __future__ import annotations

import functools
import weakref
from typing import Callable, Optional, Protocol

import torch
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import FakeTensor
from torch.autograd.graph import Node

from graphmem.oprules.scalars import WRAPPED, cast_bytes
from graphmem.stepgraph import OpNode, Storage


class _Recording(Protocol):
    """What of the recorder (graphmem/capture/recorder.py ``_Recorder``) the wrapped numbers read and add to."""

    device: str
    node_module: Optional[str]
    storages: dict[int, Storage]
    stream: Callable[[], str]
    phase: str
    stack: list[str]
    closed: bool
    ops: list[OpNode]


def _numbers(func: OpOverload, args: tuple, kwargs: dict) -> list[tuple[str, object]]:
    """(argument name, value) of each Python number given where the schema takes a Tensor."""
    found = []
    for i, name in _tensor_arguments(func):
        value = args[i] if i < len(args) else kwargs.get(name)
        if type(value) in WRAPPED:
            found.append((name, value))
    return found


@functools.cache
def _tensor_arguments(func: OpOverload) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument ``func``'s schema types as a Tensor (read once an op)."""
    schema = getattr(func, "_schema", None)
    return () if schema is None else tuple((i, a.name) for i, a in enumerate(schema.arguments) if str(a.type) == "Tensor")


def _cast(args: tuple, value: object) -> int:
    """Bytes of the wrapped number's cast to the op's common dtype: TensorIterator promotes its
    inputs by making copies in the common dtype (aten/src/ATen/TensorIterator.cpp
    ``compute_types``, ``promote_inputs_to_common_dtype_``, which the binary ops that take
    numbers as tensors set), a CPU scalar too (AdamW's ``/ bias_correction2_sqrt`` on float32
    states: 4 B more for the moment of the division, measured); torch's promotion read without
    dispatching (graphmem/oprules/scalars.py)."""
    tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return cast_bytes(tensor.dtype, value) if tensor is not None else 0


def _saved(fn: Node, name: str) -> Optional[torch.Tensor]:
    """The wrapped number autograd node ``fn`` holds as argument ``name`` (None if it holds none)."""
    try:
        value = getattr(fn, f"_saved_{name}")
    except (AttributeError, RuntimeError):  # not saved, or released
        return None
    if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor) and value.dim() == 0:
        return value
    return None


class WrappedNumbers:
    """The recorder's wrapped numbers (the module docstring)."""

    def __init__(self, rec: _Recording) -> None:
        self.rec = rec
        # the last op's output, its numbers, and whether it ran in a checkpoint's recompute
        self.pending: Optional[tuple[weakref.ref[torch.Tensor], list[tuple[str, Storage]], bool]] = None

    def seen(self, func: OpOverload, args: tuple, kwargs: dict, out: object, index: int, module: str) -> None:
        """Op ``index`` ran (outermost dispatch): its wrapped numbers, live for the op."""
        self.resolve()
        rec = self.rec
        if rec.device != "cpu" or rec.node_module is not None:
            return
        made = []
        for name, value in _numbers(func, args, kwargs):
            wrapped = WRAPPED[type(value)]
            dtype, nbytes = str(wrapped).replace("torch.", ""), wrapped.itemsize
            s = Storage(len(rec.storages), nbytes, "activation", index, index, module,
                        f"wrapped number ({type(value).__name__} as a 0-d {dtype} tensor) of {func}", dtype, (),
                        stream=rec.stream())
            rec.storages[s.sid] = s
            made.append((name, s))
            cast = _cast(args, value)
            if cast:  # for the moment of the op
                c = Storage(len(rec.storages), cast, "activation", index, index, module,
                            f"wrapped number's cast to the common dtype of {func}", "uint8", (cast,), stream=rec.stream())
                rec.storages[c.sid] = c
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        if made and isinstance(first, torch.Tensor) and torch.is_grad_enabled():
            self.pending = (weakref.ref(first), made, rec.phase == "backward" and len(rec.stack) > 1)

    def resolve(self) -> None:
        """The autograd node is attached to the last op's output once the op returns: those of
        its wrapped numbers the node saved live until the node releases them."""
        if self.pending is None:
            return
        ref, made, again = self.pending
        self.pending = None
        t = ref()
        # a view's grad_fn may be regenerated under a lock the autograd kernel of the op running now
        # already holds (torch/csrc/autograd/variable.cpp ``VariableHooks::grad_fn``): read from inside
        # that op's dispatch, it would deadlock; an in-place op on a view keeps its number unseen (the
        # 8 B under the real peak that all numbers were before)
        fn = t.grad_fn if t is not None and not t._is_view() else None
        if fn is None:
            return
        for name, s in made:
            value = _saved(fn, name)
            if value is not None:
                s.freed = None
                # a checkpoint's recomputed node never runs: its number dies with the recomputed
                # graph when the recompute ends, as autocast's cache dies when its context exits
                # (checkpoint plans read both the same way: graphmem/planning/pieces.py ``Cut.cleared``)
                s.cache_freed = again
                weakref.finalize(value, self._died, s)

    def _died(self, s: Storage) -> None:
        if s.freed is None and not self.rec.closed:
            s.freed = max(len(self.rec.ops) - 1, s.created)

__all__ = ["WrappedNumbers"]
