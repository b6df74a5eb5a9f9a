"""The recorder: a fake mode that records every op of the step (graphmem/capture/capture.py runs it).

``_Mode`` is the FakeTensorMode itself, recording the outermost dispatch of each op into a
``_Recorder``: OpNodes in eager order, storages (weakrefs tell when each is freed), autograd's
save/release events (saved_tensors_hooks; the packed handle dying is the release), module
paths (global module hooks in forward, grad_fn tags in backward), and eager's in-place
gradient accumulation, which the engine never does for tensor subclasses.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, ContextManager, Iterator, Optional, Sequence

import torch
import torch.nn as nn
from torch._ops import HigherOrderOperator, OpOverload
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from graphmem.capture.autograd_tags import (
    _ADD,
    _DONE,
    _TAG,
    _dense,
    _tag_grad_fns,
    _tensors,
    _unique_counts,
    engine_phase,
    node_metadata,
)
from graphmem.capture.call_paths import call_path
from graphmem.capture.subclasses import all_real, inner_tensors, wrapped
from graphmem.capture.target import GPUS
from graphmem.capture.values import NO_ANSWER, Values
from graphmem.capture.wrapped_numbers import WrappedNumbers
from graphmem.oprules import kernel_rule, scratch, workspace_outputs
from graphmem.stepgraph import OpNode, SaveEvent, Storage

_NODE = "_graphmem_node"  # attribute set on each fake tensor: the OpNode (or (OpNode, i)) that produced it
_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)


_METADATA_OPS = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "is_nonzero")
    if hasattr(torch.ops.aten, name) and hasattr(getattr(torch.ops.aten, name), "default")
)


class _Packed:
    """What the pack hook returns; its destruction is autograd releasing the saved tensor."""

    __slots__ = ("tensor", "events", "cap")

    def __init__(self, tensor: torch.Tensor, events: list[SaveEvent], cap: "_Recorder") -> None:
        self.tensor = tensor
        self.events = events  # one per storage: a tensor subclass (DTensor) saves its inner tensors' storages
        self.cap = cap

    def __del__(self) -> None:
        if not self.cap.closed:
            for event in self.events:
                event.released_at = len(self.cap.ops) - 1


class _Mode(FakeTensorMode):
    """The fake mode itself records: one Python mode layer per op, as in a bare fake run.
    Only the outermost dispatch of each op is recorded (``depth``); what the fake mode runs
    inside it (decompositions) is the kernel's business, like a real kernel's internals."""

    def __init__(self, rec: "_Recorder") -> None:
        super().__init__(allow_non_fake_inputs=False)
        self.rec = rec
        self.values = Values()  # the batch's values (graphmem/capture/values.py)
        # while set, what a read of a tensor's value as a Python number returns (``.item()`` of a
        # count or a loss that only scales arithmetic and logs: graphmem/titan/capture.py); in the
        # fake mode itself, not a mode above it, so dynamo still compiles inside (it skips frames
        # under a non-infra dispatch mode)
        self.scalar_answer: Optional[Callable[[torch.Tensor], object]] = None

    def __deepcopy__(self, memo: dict) -> "_Mode":
        """One mode per capture: ``copy.deepcopy`` of a module holding fake tensors (torch's
        pipeline split copies the whole model per stage, torch/distributed/pipelining) copies each
        tensor's ``__dict__``, ``fake_mode`` included (torch/_tensor.py ``__deepcopy__``); the copies
        must stay in this mode, as FakeCopyMode keeps them (torch/_subclasses/fake_tensor.py)."""
        return self

    def __torch_dispatch__(self, func: OpOverload | HigherOrderOperator, types: Sequence[type], args: Any = (), kwargs: Any = None) -> object:
        if func is _LOCAL_SCALAR and self.scalar_answer is not None:
            return self.scalar_answer(args[0])
        answer = self.values.read(func, args, kwargs)
        if answer is not NO_ANSWER:  # a data-dependent read of the batch: the real step's answer
            return answer
        if self.rec.depth or self.rec.real_bookkeeping:
            return self._dispatch(func, types, args, kwargs)
        out = self._dispatch(func, types, args, kwargs)
        self.values.propagate(func, args, kwargs, out)
        return out

    def _dispatch(self, func: OpOverload | HigherOrderOperator, types: Sequence[type], args: tuple = (), kwargs: Any = None) -> object:
        rec = self.rec
        if rec.real_bookkeeping and all_real(args, kwargs):  # while wrappers are set up: ops on real tensors (a
            with unset_fake_temporarily():  # DeviceMesh's rank layout when FSDP composes with TP) run for real
                return func(*args, **(kwargs or {}))
        if isinstance(func, HigherOrderOperator):  # (FlexAttention's): its fake rule's own ops are recorded
            return super().__torch_dispatch__(func, types, args, kwargs)  # type: ignore[arg-type]
        if rec.depth or not rec.recording or func.namespace in ("prim", "profiler") or func in _METADATA_OPS \
                or wrapped(types):  # queries never allocate; a DTensor's op comes back as its local ops
            return super().__torch_dispatch__(func, types, args, kwargs)
        if func is _LAYER_NORM and rec.fp32_norm_stats and args[0].dtype in (torch.float16, torch.bfloat16):
            return rec.record(lambda f, a, k: _fp32_stats(super(_Mode, self).__torch_dispatch__(f, types, a, k)),
                              func, args, kwargs)
        rule = kernel_rule(func, rec.device)
        if rule is not None:  # the real kernel's behaviour where the fake kernel's differs (graphmem/oprules/)
            # the rule makes its new tensors under ``self`` (the mode is off inside its own dispatch)
            return rec.record(lambda f, a, k: rule(lambda *a2, **k2: super(_Mode, self).__torch_dispatch__(f, types, a2, k2),
                                                   a, k, self), func, args, kwargs)
        return rec.record(lambda f, a, k: super(_Mode, self).__torch_dispatch__(f, types, a, k), func, args, kwargs)


_LAYER_NORM = torch.ops.aten.native_layer_norm.default
_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default


def _fp32_stats(out: Any) -> tuple:
    """CUDA's LayerNorm kernel keeps mean and rstd in fp32 (its accumulation type) for 16-bit
    inputs, where the CPU kernel the CUDA target runs on keeps them in the input's dtype; the
    16-bit ones die inside the op, like a real kernel's scratch."""
    y, mean, rstd = out
    return y, mean.float(), rstd.float()


class _Recorder:
    def __init__(self, paths: dict[int, tuple[str, ...]]) -> None:
        self.recording = False
        self.depth = 0
        self.placeholders: list[OpNode] = []
        self.ops: list[OpNode] = []
        self.storages: dict[int, Storage] = {}
        self.live: dict[int, Storage] = {}  # StorageImpl address -> live Storage
        self.refs: dict[int, weakref.ref] = {}
        self.saves: list[SaveEvent] = []
        self.paths = paths  # id(module) -> its names (graphmem/capture/call_paths.py: which one is called)
        self.stack: list[str] = [""]
        self.module_inputs: dict[str, tuple[int, ...]] = {}  # first input shape of each module
        self.seq_start: list[int] = []  # autograd sequence number when each open module started
        self.phase = "forward"
        self.phase_start: dict[str, int] = {}
        self.closed = False
        self.recompute_rules: Optional[Callable[[], ContextManager[object]]] = None  # CUDA target: rules for recomputes
        self.recompute_ctx: Optional[ContextManager[object]] = None
        self.scoped = False  # recompute_ctx spans a whole checkpointed segment
        self.micro_steps: list[tuple[int, int]] = []  # (forward start, backward start) per micro-step
        self.first_step_only: Optional[tuple[int, int]] = None  # ops only the first step runs (StepGraph)
        self.fp32_norm_stats = False  # CUDA target: LayerNorm's mean/rstd in fp32 (see _fp32_stats)
        self.node_module: Optional[str] = None  # compiled mode: the module of the fx node running now
        self.clearing = False  # inside an autocast cache clear (see ``clearing_cache``)
        self.device = "cpu"  # the target device: which kernel and scratch rules hold (graphmem/oprules/)
        self.gpu = "h100"  # the CUDA target's GPU (Target.gpu), for the scratch rules that depend on it
        self.real_bookkeeping = False  # (graphmem/distributed/capture.py, while fully_shard / parallelize_module set up)
        self.on_op: Optional[Callable[[OpOverload, tuple, dict, object], None]] = None  # told of each recorded op (func, args, kwargs, out)
        self.stream: Callable[[], str] = lambda: "default"  # the current stream's name (FSDP2's: distributed/fsdp.py)
        self.wrapped_numbers = WrappedNumbers(self)  # Python numbers taken as tensors (graphmem/capture/wrapped_numbers.py)

    # -- storages -----------------------------------------------------------------
    def storage(self, t: torch.Tensor, kind: str, name: str, created: int, module: str) -> Storage:
        st = t.untyped_storage()
        key = st._cdata
        s = self.live.get(key)
        if s is None:
            s = Storage(len(self.storages), st.nbytes(), kind, created, None, module, name,
                        str(t.dtype).replace("torch.", ""), tuple(t.shape), stream=self.stream())
            self.storages[s.sid] = s
            self.live[key] = s
            self.refs[s.sid] = weakref.ref(st, lambda _r, key=key, s=s: self._freed(key, s))  # type: ignore[misc]
        return s

    def _freed(self, key: int, s: Storage) -> None:
        if self.closed or s.freed is not None:  # (already released by a storage resize)
            return
        s.freed = len(self.ops) - 1
        if self.clearing:
            s.cache_freed = True
        if self.live.get(key) is s:
            del self.live[key]

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Ops run here are not the step's (a library's shape propagation on fake tensors)."""
        was, self.recording = self.recording, False
        try:
            yield
        finally:
            self.recording = was

    def released(self, t: torch.Tensor) -> None:
        """``t``'s storage is about to be resized to 0 bytes (``UntypedStorage.resize_(0)``, as
        FSDP2 frees an unsharded parameter): its allocation ends here, though the storage object
        lives on; a later resize back is a new allocation (``storage`` records it then)."""
        s = self.live.pop(t.untyped_storage()._cdata, None)
        if s is not None and self.recording and not self.closed:
            s.freed = len(self.ops) - 1

    def relabel(self, t: torch.Tensor, kind: str, name: str) -> None:
        """Give ``t``'s live storage a kind and name (a collective's buffer, a gathered parameter)."""
        s = self.live.get(t.untyped_storage()._cdata)
        if s is not None:
            s.kind, s.name = kind, name

    @contextlib.contextmanager
    def clearing_cache(self) -> Iterator[None]:
        """Storages freed inside mark themselves ``cache_freed``: autocast's cast cache (or the
        CUDA rules' copy of it) held their last reference; checkpoint plans need to know."""
        was, self.clearing = self.clearing, True
        try:
            yield
        finally:
            self.clearing = was

    def preexisting(self, t: torch.Tensor, kind: str, name: str) -> None:
        s = self.storage(t, kind, name, -1, "")
        node = OpNode("placeholder", name, (), {}, name.replace(".", "_"))
        self.placeholders.append(node)
        node.meta.update(shape=tuple(t.shape), dtype=t.dtype, storage=s.sid, kind=kind)
        setattr(t, _NODE, node)

    # -- ops ----------------------------------------------------------------------
    def _arg(self, a: object) -> object:
        if isinstance(a, torch.Tensor):
            node = getattr(a, _NODE, None)
            if node is None:  # a tensor made outside the recorded step (e.g. a constant)
                self.preexisting(a, "external", f"external_{len(self.storages)}")
                node = getattr(a, _NODE)
            return node
        if isinstance(a, (list, tuple)):
            return [self._arg(x) for x in a]
        return a

    def module_now(self) -> str:
        if self.node_module is not None:
            return self.node_module
        if self.phase == "backward" and len(self.stack) == 1:  # (a deeper stack: a checkpoint's recompute)
            fn = torch._C._current_autograd_node()
            return node_metadata(fn).get(_TAG, "") if fn is not None else ""
        return self.stack[-1]

    def record(self, call: Callable[[OpOverload, tuple, dict], Any], func: OpOverload, args: tuple, kwargs: Optional[dict]) -> object:
        kwargs, phase = kwargs or {}, engine_phase(self.phase)
        if func is _ADD and phase == "backward" and not kwargs and self._accumulates_inplace(args):
            func = torch.ops.aten.add_.Tensor  # what eager does for real tensors (see below)
        self.depth += 1
        try:
            out = call(func, args, kwargs)
        finally:
            self.depth -= 1
        index = len(self.ops)
        # torch.tensor(...) under the fake mode makes a real constant that lift_fresh turns into a
        # fake one: the lifted tensor is the allocation a real run makes, the constant is not
        node = OpNode("call_function", func, () if func in _LIFTS else tuple([self._arg(a) for a in args]),
                      {k: self._arg(v) for k, v in kwargs.items()} if kwargs else {}, f"op{index}")
        self.ops.append(node)
        module = self.module_now()
        multi = isinstance(out, (tuple, list))
        outs = out if multi else (out,)
        if multi and any(isinstance(t, (tuple, list)) for t in outs):  # a list inside the outputs, flattened
            outs = tuple(x for t in outs for x in (t if isinstance(t, (tuple, list)) else (t,)))  # (symm_mem's (A, [C]))
        metas = []
        new_bytes = 0
        for i, t in enumerate(outs):
            if not isinstance(t, torch.Tensor):
                continue
            s = self.live.get(t.untyped_storage()._cdata) or self.storage(t, "activation", str(func), index, module)
            if s.created == index:
                new_bytes += s.nbytes
                if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor):
                    src = self.live.get(args[0].untyped_storage()._cdata)
                    s.source = src.sid if src is not None else None
            metas.append((tuple(t.shape), t.dtype, s.sid))
            if multi:
                setattr(t, _NODE, (node, i))
            else:
                setattr(t, _NODE, node)
        node.meta.update(index=index, phase=phase, module=module, outputs=tuple(metas),
                         bytes=new_bytes)
        if len(metas) != len(outs) and multi:  # some outputs are not tensors: where each tensor is
            node.meta["positions"] = tuple(i for i, t in enumerate(outs) if isinstance(t, torch.Tensor))
        if self.phase == "backward" and len(self.stack) > 1:
            node.meta["recompute"] = True  # a checkpointed segment's forward, run again
        if metas:
            node.meta.update(shape=metas[0][0], dtype=metas[0][1], storage=metas[0][2])
        for i in workspace_outputs(func):  # a kernel's workspace, returned as an output
            if i < len(outs) and isinstance(outs[i], torch.Tensor) and outs[i].numel():
                ws = self.storages[self.live[outs[i].untyped_storage()._cdata].sid]
                if ws.created == index:
                    ws.kind, ws.name = "workspace", f"{func} workspace"
        found = scratch(func, self.device, args, kwargs, out, GPUS[self.gpu])
        for sc in found:  # allocated and freed inside the kernel: live during this op only
            s = Storage(len(self.storages), sc.nbytes, "workspace", index, index, module, f"{func} scratch: {sc.what}",
                        "uint8", (sc.nbytes,), stream=self.stream())
            self.storages[s.sid] = s
        if found:
            node.meta["scratch"] = sum(sc.nbytes for sc in found)
        self.wrapped_numbers.seen(func, args, kwargs, out, index, module)
        if self.on_op is not None:
            self.on_op(func, args, kwargs, out)
        return out

    def _accumulates_inplace(self, args: tuple) -> bool:
        """The engine sums gradients from several producers with ``old + new``; for a real
        tensor it does ``old.add_(new)`` instead when it holds the only reference to ``old``
        and its storage (torch/csrc/autograd/input_buffer.cpp, can_accumulate_inplace). Fake
        tensors are subclass-like, so the engine never takes that branch for them; graphmem
        takes it on their behalf so the timeline matches a real run. The engine's adds are
        the ones that run after the producing node's post hook fired."""
        fn = torch._C._current_autograd_node()
        if fn is None or not node_metadata(fn).get(_DONE):
            return False
        old, new = args
        if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)):
            return False
        uses, storage_uses = _unique_counts()
        return (old.shape == new.shape and old.dtype == new.dtype and _dense(old)
                and old._use_count() == uses  # type: ignore[attr-defined]
                and torch._C._storage_Use_Count(old.untyped_storage()._cdata) == storage_uses)

    # -- autograd hooks -----------------------------------------------------------
    def pack(self, t: torch.Tensor) -> _Packed:
        return self.pack_as(t, t)

    def pack_as(self, t: torch.Tensor, kept: torch.Tensor) -> _Packed:
        """``t`` saved for backward, ``kept`` held in its place (its host copy when the loop
        offloads activations: graphmem/training/loop_options.py); the save is ``t``'s."""
        events = []
        for inner in inner_tensors(t):  # what holds memory: a DTensor's local shard, not its global wrapper
            s = self.storage(inner, "external", "saved", len(self.ops) - 1, self.stack[-1])
            events.append(SaveEvent(s.sid, len(self.ops) - 1, None, self.stack[-1], self.phase,
                                    tuple(inner.shape), str(inner.dtype).replace("torch.", "")))
        self.saves.extend(events)
        return _Packed(kept, events, self)

    @staticmethod
    def unpack(h: _Packed) -> torch.Tensor:
        for event in h.events:
            if not event.grad_fn:
                fn = torch._C._current_autograd_node()
                event.grad_fn = fn.name() if fn is not None else ""
        return h.tensor

    # -- module paths -------------------------------------------------------------
    @contextlib.contextmanager
    def recompute_scope(self) -> Iterator[None]:
        """Around a whole checkpointed segment run by graphmem/planning/apply.py: in a recompute
        on the CUDA target, one rules context for all its blocks, as torch.utils.checkpoint
        runs the segment in one autocast context (its cast cache lives until the end)."""
        if self.phase != "backward" or self.recompute_rules is None or self.recompute_ctx is not None:
            yield
            return
        ctx = self.recompute_ctx = self.recompute_rules()
        self.scoped = True
        ctx.__enter__()
        try:
            yield
        finally:
            self.recompute_ctx, self.scoped = None, False
            ctx.__exit__(None, None, None)

    def pre_hook(self, module: nn.Module, args: tuple) -> None:
        if self.phase == "backward" and len(self.stack) == 1 and self.recompute_rules is not None \
                and self.recompute_ctx is None:
            # a checkpoint's recompute: on the CUDA target the device's rules (dropout kernel,
            # SDPA backend, autocast, which checkpoint re-enters) hold there as in forward
            self.recompute_ctx = self.recompute_rules()
            self.recompute_ctx.__enter__()
        names = self.paths.get(id(module))
        path = call_path(names, self.stack) if names else type(module).__name__
        self.stack.append(path)
        if path not in self.module_inputs:
            first = next((a for a in _tensors(args)), None)
            self.module_inputs[path] = tuple(first.shape) if first is not None else ()
        self.seq_start.append(torch._C._autograd._get_sequence_nr())

    def post_hook(self, module: nn.Module, args: tuple, output: object) -> None:
        path = self.stack.pop()
        start = self.seq_start.pop()
        if len(self.stack) == 1 and self.recompute_ctx is not None and not self.scoped:
            ctx, self.recompute_ctx = self.recompute_ctx, None
            ctx.__exit__(None, None, None)
        if self.phase == "forward":
            _tag_grad_fns(output, path, start)

    def set_phase(self, phase: str) -> None:
        # The loss's autograd nodes stay untagged: their backward ops belong to the root ("").
        self.wrapped_numbers.resolve()  # the last op's numbers, before this phase's ops are counted
        self.phase = phase
        self.phase_start[phase] = len(self.ops)
        if phase == "forward":
            self.micro_steps.append((len(self.ops), -1))
        elif phase == "backward" and self.micro_steps:
            self.micro_steps[-1] = (self.micro_steps[-1][0], len(self.ops))
        self.stack, self.seq_start = [""], []
