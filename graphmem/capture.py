"""Run ONE training step on fake tensors and record it as a StepGraph.

How: a TorchDispatchMode stacked on FakeTensorMode sees every aten op in the order eager
autograd runs it (forward, loss, backward), below autograd, so the saved set is exactly what
eager autograd saves. ``saved_tensors_hooks`` report which storage each grad_fn saves; the
packed handle's destruction is autograd releasing it. A weakref on each storage reports when
it is freed. Nothing real is allocated: parameters, buffers and inputs become fresh fake
tensors of the same shape/stride/dtype on the target device, and the user's module runs on
them through ``torch.func.functional_call`` (its own tensors are not touched).
"""
from __future__ import annotations

import contextlib
import re
import weakref
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.nn as nn
from torch.nn.utils.stateless import _reparametrize_module
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import CaptureError, DataDependentError, GraphmemError, UnsupportedOpError
from .cuda_rules import CudaRules
from .step import LossFn, default_loss, run_step
from .target import Target
from .stepgraph import OpNode, SaveEvent, StepGraph, Storage
from .train import Session, TrainStep, relabel_accumulation

_NODE = "_graphmem_node"  # attribute set on each fake tensor: the OpNode (or (OpNode, i)) that produced it
_TAG = "graphmem_module"  # key in grad_fn.metadata: module path of the forward op
_DONE = "graphmem_done"  # set in grad_fn.metadata by a post hook once the node has run
_ADD = torch.ops.aten.add.Tensor
_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)


_METADATA_OPS = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "is_nonzero")
    if hasattr(torch.ops.aten, name) and hasattr(getattr(torch.ops.aten, name), "default")
)


class _Packed:
    """What the pack hook returns; its destruction is autograd releasing the saved tensor."""

    __slots__ = ("tensor", "event", "cap")

    def __init__(self, tensor: torch.Tensor, event: SaveEvent, cap: "_Recorder") -> None:
        self.tensor = tensor
        self.event = event
        self.cap = cap

    def __del__(self) -> None:
        if not self.cap.closed:
            self.event.released_at = len(self.cap.ops) - 1


class _Mode(FakeTensorMode):
    """The fake mode itself records: one Python mode layer per op, as in a bare fake run.
    Only the outermost dispatch of each op is recorded (``depth``); what the fake mode runs
    inside it (decompositions) is the kernel's business, like a real kernel's internals."""

    def __init__(self, rec: "_Recorder") -> None:
        super().__init__(allow_non_fake_inputs=False)
        self.rec = rec

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        rec = self.rec
        if rec.depth or not rec.recording or func.namespace in ("prim", "profiler") or func in _METADATA_OPS:
            return super().__torch_dispatch__(func, types, args, kwargs)  # queries never allocate
        if func is _LAYER_NORM and rec.fp32_norm_stats and args[0].dtype in (torch.float16, torch.bfloat16):
            return rec.record(lambda f, a, k: _fp32_stats(super(_Mode, self).__torch_dispatch__(f, types, a, k)),
                              func, args, kwargs)
        return rec.record(lambda f, a, k: super(_Mode, self).__torch_dispatch__(f, types, a, k), func, args, kwargs)


_LAYER_NORM = torch.ops.aten.native_layer_norm.default


def _fp32_stats(out: tuple) -> tuple:
    """CUDA's LayerNorm kernel keeps mean and rstd in fp32 (its accumulation type) for 16-bit
    inputs, where the CPU kernel the CUDA target runs on keeps them in the input's dtype; the
    16-bit ones die inside the op, like a real kernel's scratch."""
    y, mean, rstd = out
    return y, mean.float(), rstd.float()


class _Recorder:
    def __init__(self, paths: dict[int, str]) -> None:
        self.recording = False
        self.depth = 0
        self.placeholders: list[OpNode] = []
        self.ops: list[OpNode] = []
        self.storages: dict[int, Storage] = {}
        self.live: dict[int, Storage] = {}  # StorageImpl address -> live Storage
        self.refs: dict[int, weakref.ref] = {}
        self.saves: list[SaveEvent] = []
        self.paths = paths
        self.stack: list[str] = [""]
        self.module_inputs: dict[str, tuple[int, ...]] = {}  # first input shape of each module
        self.seq_start: list[int] = []  # autograd sequence number when each open module started
        self.phase = "forward"
        self.phase_start: dict[str, int] = {}
        self.closed = False
        self.recompute_rules: Optional[Callable[[], Any]] = None  # CUDA target: rules for recomputes
        self.recompute_ctx: Any = None
        self.fp32_norm_stats = False  # CUDA target: LayerNorm's mean/rstd in fp32 (see _fp32_stats)
        self.node_module: Optional[str] = None  # compiled mode: the module of the fx node running now

    # -- storages -----------------------------------------------------------------
    def storage(self, t: torch.Tensor, kind: str, name: str, created: int, module: str) -> Storage:
        st = t.untyped_storage()
        key = st._cdata
        s = self.live.get(key)
        if s is None:
            s = Storage(len(self.storages), st.nbytes(), kind, created, None, module, name,
                        str(t.dtype).replace("torch.", ""), tuple(t.shape))
            self.storages[s.sid] = s
            self.live[key] = s
            self.refs[s.sid] = weakref.ref(st, lambda _r, key=key, s=s: self._freed(key, s))
        return s

    def _freed(self, key: int, s: Storage) -> None:
        if self.closed:
            return
        s.freed = len(self.ops) - 1
        if self.live.get(key) is s:
            del self.live[key]

    def preexisting(self, t: torch.Tensor, kind: str, name: str) -> None:
        s = self.storage(t, kind, name, -1, "")
        node = OpNode("placeholder", name, (), {}, name.replace(".", "_"))
        self.placeholders.append(node)
        node.meta.update(shape=tuple(t.shape), dtype=t.dtype, storage=s.sid, kind=kind)
        setattr(t, _NODE, node)

    # -- ops ----------------------------------------------------------------------
    def _arg(self, a: Any) -> Any:
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
            return fn.metadata.get(_TAG, "") if fn is not None else ""
        return self.stack[-1]

    def record(self, call: Callable[[Any, tuple, dict], Any], func: Any, args: tuple, kwargs: Optional[dict]) -> Any:
        kwargs = kwargs or {}
        if func is _ADD and self.phase == "backward" and not kwargs and self._accumulates_inplace(args):
            func = torch.ops.aten.add_.Tensor  # what eager does for real tensors (see below)
        self.depth += 1
        try:
            out = call(func, args, kwargs)
        finally:
            self.depth -= 1
        index = len(self.ops)
        # torch.tensor(...) under the fake mode makes a real constant that lift_fresh turns into a
        # fake one: the lifted tensor is the allocation a real run makes, the constant is not
        node = OpNode("call_function", func, () if func in _LIFTS else tuple(self._arg(a) for a in args),
                      {k: self._arg(v) for k, v in kwargs.items()} if kwargs else {}, f"op{index}")
        self.ops.append(node)
        module = self.module_now()
        outs = out if isinstance(out, (tuple, list)) else (out,)
        metas = []
        new_bytes = 0
        for i, t in enumerate(outs):
            if not isinstance(t, torch.Tensor):
                continue
            s = self.storage(t, "activation", str(func), index, module)
            if s.created == index:
                new_bytes += s.nbytes
                if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor):
                    src = self.live.get(args[0].untyped_storage()._cdata)
                    s.source = src.sid if src is not None else None
            metas.append((tuple(t.shape), t.dtype, s.sid))
            if outs is out:
                setattr(t, _NODE, (node, i))
            else:
                setattr(t, _NODE, node)
        node.meta.update(index=index, phase=self.phase, module=module, outputs=tuple(metas),
                         bytes=new_bytes)
        if len(metas) != len(outs) and outs is out:  # some outputs are not tensors: where each tensor is
            node.meta["positions"] = tuple(i for i, t in enumerate(outs) if isinstance(t, torch.Tensor))
        if self.phase == "backward" and len(self.stack) > 1:
            node.meta["recompute"] = True  # a checkpointed segment's forward, run again
        if metas:
            node.meta.update(shape=metas[0][0], dtype=metas[0][1], storage=metas[0][2])
        return out

    def _accumulates_inplace(self, args: tuple) -> bool:
        """The engine sums gradients from several producers with ``old + new``; for a real
        tensor it does ``old.add_(new)`` instead when it holds the only reference to ``old``
        and its storage (torch/csrc/autograd/input_buffer.cpp, can_accumulate_inplace). Fake
        tensors are subclass-like, so the engine never takes that branch for them; graphmem
        takes it on their behalf so the timeline matches a real run. The engine's adds are
        the ones that run after the producing node's post hook fired."""
        fn = torch._C._current_autograd_node()
        if fn is None or not fn.metadata.get(_DONE):
            return False
        old, new = args
        if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)):
            return False
        uses, storage_uses = _unique_counts()
        return (old.shape == new.shape and old.dtype == new.dtype and _dense(old)
                and old._use_count() == uses
                and torch._C._storage_Use_Count(old.untyped_storage()._cdata) == storage_uses)

    # -- autograd hooks -----------------------------------------------------------
    def pack(self, t: torch.Tensor) -> _Packed:
        s = self.storage(t, "external", "saved", len(self.ops) - 1, self.stack[-1])
        ev = SaveEvent(s.sid, len(self.ops) - 1, None, self.stack[-1], self.phase,
                       tuple(t.shape), str(t.dtype).replace("torch.", ""))
        self.saves.append(ev)
        return _Packed(t, ev, self)

    @staticmethod
    def unpack(h: _Packed) -> torch.Tensor:
        if not h.event.grad_fn:
            fn = torch._C._current_autograd_node()
            h.event.grad_fn = fn.name() if fn is not None else ""
        return h.tensor

    # -- module paths -------------------------------------------------------------
    def pre_hook(self, module: nn.Module, args: Any) -> None:
        if self.phase == "backward" and len(self.stack) == 1 and self.recompute_rules is not None:
            # a checkpoint's recompute: on the CUDA target the device's rules (dropout kernel,
            # SDPA backend, autocast, which checkpoint re-enters) hold there as in forward
            self.recompute_ctx = self.recompute_rules()
            self.recompute_ctx.__enter__()
        path = self.paths.get(id(module), type(module).__name__)
        self.stack.append(path)
        if path not in self.module_inputs:
            first = next((a for a in _tensors(args)), None)
            self.module_inputs[path] = tuple(first.shape) if first is not None else ()
        self.seq_start.append(torch._C._autograd._get_sequence_nr())

    def post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        path = self.stack.pop()
        start = self.seq_start.pop()
        if len(self.stack) == 1 and self.recompute_ctx is not None:
            ctx, self.recompute_ctx = self.recompute_ctx, None
            ctx.__exit__(None, None, None)
        if self.phase == "forward":
            _tag_grad_fns(output, path, start)

    def set_phase(self, phase: str) -> None:
        # The loss's autograd nodes stay untagged: their backward ops belong to the root ("").
        self.phase = phase
        self.phase_start[phase] = len(self.ops)
        self.stack = [""]
        self.seq_start = []


@contextlib.contextmanager
def _rng_states(cap: "_Recorder", counted: bool) -> Iterator[None]:
    """torch.utils.checkpoint stashes the CPU generator's state (a real 5,056-byte uint8
    tensor, made without dispatch, so fake tensors never see it) per checkpointed call and
    copies it again around each recompute. On the CPU target that is step memory: record it.
    (On the CUDA target the stashed states live in host memory.)"""
    if not counted:
        yield
        return
    original = torch.get_rng_state

    def get_rng_state() -> torch.Tensor:
        t = original()
        if cap.recording and not cap.closed:  # allocated between the last op and the next
            cap.storage(t, "external", "cpu rng state", len(cap.ops), cap.module_now())
        return t

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = original


def _dense(t: torch.Tensor) -> bool:
    return bool(torch._prims_common.is_non_overlapping_and_dense_or_false(t))


_COUNTS: list[tuple[int, int]] = []


class _Probe(TorchDispatchMode):
    """Reads the reference counts a uniquely held gradient shows inside a dispatch mode."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        fn = torch._C._current_autograd_node()
        if func is _ADD and fn is not None and fn.metadata.get(_DONE) and not _COUNTS:
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


def _tag_grad_fns(output: Any, path: str, start: int = 0) -> None:
    """Label the autograd nodes a module created with its path (innermost module wins:
    inner modules finish, and tag, first; the walk stops at nodes already tagged and at
    nodes created before the module started, whose sequence number is below ``start``),
    and add a post hook that marks each node as run (see _accumulates_inplace)."""
    todo = []
    for t in _tensors(output):
        if t.grad_fn is not None:
            todo.append(t.grad_fn)
    while todo:
        fn = todo.pop()
        md = fn.metadata
        if _TAG in md or fn._sequence_nr() < start:
            continue
        md[_TAG] = path
        fn.register_hook(lambda grad_inputs, grad_outputs, md=md: md.__setitem__(_DONE, True))
        for nxt, _ in fn.next_functions:
            if nxt is not None:
                todo.append(nxt)


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return []


Inputs = Union[tuple, Callable[[], tuple]]


def _fake_like(t: torch.Tensor, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Same shape/strides; floating tensors take the target's parameter dtype if one is set."""
    dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
    fake = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=dtype, device=device)
    return fake.requires_grad_(t.requires_grad) if t.is_floating_point() else fake


def fake_state(model: nn.Module, device: torch.device, dtype: Optional[torch.dtype],
               on_new: Callable[[torch.Tensor, str, str], None] = lambda t, kind, name: None,
               ) -> tuple[dict[str, torch.Tensor], dict[int, torch.Tensor]]:
    """Fresh fake parameters and buffers by name (tied ones stay one tensor), run under a fake
    mode; ``on_new(tensor, kind, name)`` is told of each distinct one."""
    state: dict[str, torch.Tensor] = {}
    seen: dict[int, torch.Tensor] = {}
    for kind, named in (("parameter", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):
        for name, p in named:
            if id(p) not in seen:
                seen[id(p)] = _fake_like(p, device, dtype)
                on_new(seen[id(p)], kind, name)
            state[name] = seen[id(p)]
    return state, seen


def fake_batch(inputs: "Inputs", fake_mode: FakeTensorMode, device: torch.device,
               dtype: Optional[torch.dtype]) -> tuple:
    """The step's inputs as fake tensors of ``fake_mode`` (run under it)."""
    with torch.device(device):
        raw = inputs() if callable(inputs) else inputs
    if not isinstance(raw, (tuple, list)):
        raw = (raw,)
    return tuple(
        (x if fake_mode is getattr(x, "fake_mode", None) and (dtype is None or not x.is_floating_point())
         else _fake_like(x, device, dtype))
        if isinstance(x, torch.Tensor) else x
        for x in raw
    )


def forward_context(target: Target, used: dict[str, int]) -> Callable[[], Any]:
    """What wraps forward and loss for the target: CPU autocast / SDPA backend, or CUDA rules."""
    if target.device == "cuda":
        rules = CudaRules(target, used)  # it counts the SDPA backends it picks into ``used``
        return lambda: rules

    def cpu() -> Any:
        from contextlib import ExitStack

        from torch.nn.attention import SDPBackend, sdpa_kernel

        stack = ExitStack()
        if target.amp_dtype is not None:
            stack.enter_context(torch.autocast("cpu", dtype=target.amp_dtype))
        if target.attention in ("flash", "math"):
            backend = SDPBackend.FLASH_ATTENTION if target.attention == "flash" else SDPBackend.MATH
            stack.enter_context(sdpa_kernel(backend))
        return stack
    return cpu


def capture(
    model: nn.Module,
    inputs: Inputs,
    loss_fn: Optional[LossFn] = None,
    device: Union[str, torch.device, Target] = "cpu",
    train: Optional[TrainStep] = None,
) -> StepGraph:
    """Record one training step of ``model`` on fake tensors.

    ``inputs`` is a tuple of tensors (real, meta or fake: only their shapes and dtypes are
    used) or a zero-argument callable run under the fake mode with the fake device as the
    default device (so ``torch.randint(...)`` inside it makes fake tensors). ``device`` is a
    device name or a Target (graphmem/target.py); the CUDA target runs on fake CPU tensors
    with CUDA's rules applied.
    ``train`` (graphmem/train.py) adds micro-batches and the optimizer step
    with ``zero_grad`` after backward, in phase "optimizer".
    """
    target = device if isinstance(device, Target) else Target(str(torch.device(device).type))
    device = torch.device("cpu")  # see graphmem/target.py for why the CUDA target runs here
    dtype = target.param_dtype
    backends: dict[str, int] = {}
    _unique_counts()  # calibrate before entering the fake mode
    paths = {id(m): name for name, m in model.named_modules()}
    cap = _Recorder(paths)
    if target.device == "cuda":
        cap.recompute_rules = lambda: CudaRules(target, backends)
        cap.fp32_norm_stats = True
    fake_mode = _Mode(cap)
    training = [(m, m.training) for m in model.modules()]
    handles = []
    compiled: Any = None
    try:
        for m in model.modules():  # train mode (set directly: an exported module refuses .train())
            m.training = True
        if target.mode == "compiled":  # torch.compile's step, traced once on its own fake tensors
            from .compiled import CompiledStep

            compiled = CompiledStep.trace(model, inputs, loss_fn, target)
        with fake_mode:
            state, seen = fake_state(model, device, dtype, cap.preexisting)
            fake_inputs = fake_batch(inputs, fake_mode, device, dtype)
            for i, x in enumerate(fake_inputs):
                if isinstance(x, torch.Tensor):
                    cap.preexisting(x, "input", f"input_{i}")
            session = _session(train, model, seen, cap, target.device)
        marked: dict[str, list[int]] = {}
        mark = _marker(cap, seen, model, marked)  # before the step swaps the fake parameters into the module
        handles = [] if compiled is not None else [  # compiled: modules come from the graphs' node metadata
            nn.modules.module.register_module_forward_pre_hook(cap.pre_hook),
            nn.modules.module.register_module_forward_hook(cap.post_hook, always_call=True),  # also when a recompute stops early
        ]

        def forward(*args: Any) -> Any:
            if compiled is not None:
                return compiled.replay(cap, args)
            return model(*args)

        def tagged_loss(out: Any, inputs: tuple) -> torch.Tensor:
            loss = (loss_fn or default_loss)(out, inputs)
            if isinstance(loss, torch.Tensor):
                _tag_grad_fns(loss, "")  # the loss's nodes (and any left untagged) belong to the root
            return loss

        try:
            # the fake parameters stay in the module through backward: checkpointed
            # segments (torch.utils.checkpoint) run their forward again there
            with fake_mode, torch.autograd.graph.saved_tensors_hooks(cap.pack, cap.unpack), \
                    _reparametrize_module(model, state, tie_weights=True, strict=False), \
                    _rng_states(cap, target.device == "cpu"):
                cap.recording = True
                if session is None:
                    out, loss = run_step(forward, fake_inputs, tagged_loss, cap.set_phase, forward_context(target, backends))
                else:
                    out, loss = session.run(forward, fake_inputs, tagged_loss, cap.set_phase,
                                            forward_context(target, backends), mark, fake=True)
                    relabel_accumulation(cap.ops, cap.saves, cap.phase_start)
                gradient_sids = list(dict.fromkeys(marked.get("gradient", []) + [
                    _gradient(cap, p) for p in seen.values() if p.grad is not None]))
                for sid in gradient_sids:  # the op that made it stays its name; it lives on as a .grad
                    cap.storages[sid].kind = "gradient"
        except GraphmemError:
            raise
        except Exception as e:  # translate into a one-line error that names the fix
            raise _translate(e, cap, type(model).__name__) from e
        phase_start = dict(cap.phase_start)
        phase_start["end"] = len(cap.ops)
        if compiled is not None:
            compiled.check_replayed()
        return StepGraph(cap.placeholders, cap.ops, cap.storages, cap.saves, phase_start, target.device,
                         gradient_sids, type(model).__name__, [name for name, _ in model.named_modules()],
                         compiled.module_inputs if compiled is not None else cap.module_inputs, target, backends,
                         compiled=compiled.summary() if compiled is not None else None,
                         train=train if session is not None else None)
    finally:
        cap.closed = True  # before out/loss/state die with this frame: those frees are after the step
        if compiled is not None:
            compiled.close()
        for h in handles:
            h.remove()
        for m, was in training:
            m.training = was


def _gradient(cap: _Recorder, p: torch.Tensor) -> int:
    assert p.grad is not None
    s = cap.storage(p.grad, "gradient", "grad", len(cap.ops) - 1, "")
    s.owner = cap.live[p.untyped_storage()._cdata].sid
    return s.sid


def _session(train: Optional[TrainStep], model: nn.Module, seen: dict[int, torch.Tensor], cap: _Recorder,
             device: str) -> Optional[Session]:
    """The optimizer (and fp32 masters, placeholders like the parameters) for ``train``."""
    if train is None or not train.active:
        return None
    named = {name: seen[id(p)] for name, p in model.named_parameters()}
    session = Session(train, named, device)
    for name, m in session.masters.items():
        cap.preexisting(m, "master", f"{name} (fp32 master)")
        cap.storages[cap.placeholders[-1].meta["storage"]].owner = cap.live[named[name].untyped_storage()._cdata].sid
    return session


def _marker(cap: _Recorder, seen: dict[int, torch.Tensor], model: nn.Module,
            marked: dict[str, list[int]]) -> Callable[[str, list[tuple[str, torch.Tensor]]], None]:
    """Sets the kind of the storages the training step names (gradients, optimizer states, fp32
    gradient copies) and the parameter each belongs to (``Storage.owner``: its storage id)."""
    param_sid = {name: cap.live[seen[id(p)].untyped_storage()._cdata].sid for name, p in model.named_parameters()}

    def mark(kind: str, named: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in named:
            s = cap.storage(t, kind, kind, len(cap.ops) - 1, "")
            s.kind = kind
            if kind != "gradient":
                s.name = f"{name} ({kind})"
            s.owner = param_sid.get(name.split(":")[0])
            marked.setdefault(kind, []).append(s.sid)
    return mark


def _translate(e: Exception, cap: _Recorder, root: str) -> GraphmemError:
    where = f"module {cap.stack[-1]!r}" if cap.stack[-1] else f"{root}.forward"
    if cap.phase == "backward":
        where = "backward"
    elif cap.phase == "loss":
        where = "the loss"
    if isinstance(e, DataDependentOutputException):
        return DataDependentError(
            f"{where} reads tensor values ({e.func}), which fake tensors do not have; graphmem "
            "analyzes without running real data: replace .item()/.tolist()/value-dependent "
            "`if` with shape-based code or Python constants"
        )
    if isinstance(e, DynamicOutputShapeException):
        return DataDependentError(
            f"{where} calls {e.func}, whose output shape depends on tensor values (e.g. "
            "torch.nonzero or boolean-mask indexing); use a fixed-shape form such as "
            "torch.where(mask, x, 0) or a mask multiply"
        )
    if isinstance(e, UnsupportedOperatorException):
        return UnsupportedOpError(
            f"operator {e.func} (in {where}) has no fake-tensor implementation; register one "
            "with torch.library.register_fake, or replace the op"
        )
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    fake_impl = re.search(r"no fake impl registered for <CustomOpDef\((\S+)\)>", msg)
    if fake_impl:
        return UnsupportedOpError(
            f"custom op {fake_impl.group(1)} (in {where}) has no fake-tensor implementation; add one "
            f"with @{fake_impl.group(1).split('::')[-1]}.register_fake (torch.library.register_fake), "
            "returning an empty tensor of the output's shape"
        )
    return CaptureError(
        f"{where} raised {type(e).__name__}: {msg} (while running the {cap.phase} on fake "
        "tensors); check that the input shape fits the model, or rerun with --debug for the traceback"
    )
