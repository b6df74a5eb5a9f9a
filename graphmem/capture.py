"""Run ONE training step on fake tensors and record it as a StepGraph.

How: the fake mode itself (graphmem/recorder.py) sees every aten op in the order eager
autograd runs it (forward, loss, backward), below autograd, so the saved set is exactly what
eager autograd saves. ``saved_tensors_hooks`` report which storage each grad_fn saves; the
packed handle's destruction is autograd releasing it. A weakref on each storage reports when
it is freed. Nothing real is allocated: parameters, buffers and inputs become fresh fake
tensors of the same shape/stride/dtype on the target device, swapped into the user's module
for the step (torch.nn.utils.stateless, as ``torch.func.functional_call`` does, but through
backward too, where checkpointed segments run their forward again); its own tensors are not
touched.
"""
from __future__ import annotations

import contextlib
import re
from typing import Any, Callable, ContextManager, Iterator, Optional, Union

import torch
import torch.nn as nn
from torch.nn.utils.stateless import _reparametrize_module
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)

from .errors import CaptureError, DataDependentError, GraphmemError, UnsupportedOpError
from .checkpointing import segment_scope
from .cuda_rules import CudaRules
from .step import LossFn, default_loss, run_step
from .target import Target
from .stepgraph import StepGraph
from .optim import resolved_impl
from .train import Session, TrainStep, relabel_accumulation
from .recorder import _Mode, _Recorder, _rng_states, _tag_grad_fns, _unique_counts

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


def forward_context(target: Target, used: dict[str, int],
                    clearing: Callable[[], ContextManager[Any]] = contextlib.nullcontext) -> Callable[[], Any]:
    """What wraps forward and loss for the target: CPU autocast / SDPA backend, or CUDA rules
    (``clearing`` wraps their cast cache's emptying)."""
    if target.device == "cuda":
        rules = CudaRules(target, used, clearing)  # it counts the SDPA backends it picks into ``used``
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


@contextlib.contextmanager
def _cache_clears(cap: _Recorder) -> Iterator[None]:
    """Mark what CPU autocast's cache clears free (``torch.autocast.__exit__`` calls
    ``torch.clear_autocast_cache`` when the outermost context exits, in forward and in a
    checkpoint's recompute)."""
    clear = torch.clear_autocast_cache

    def marked() -> None:
        with cap.clearing_cache():
            clear()

    torch.clear_autocast_cache = marked  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.clear_autocast_cache = clear  # type: ignore[assignment]


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
    cap.device = target.device
    if target.device == "cuda":
        cap.recompute_rules = lambda: CudaRules(target, backends, cap.clearing_cache)
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
        # torch.optim keeps the step counters of its for-loop and foreach implementations on the host
        # (torch/optim/adam.py _init_group: torch.tensor(0.0) unless fused or capturable); fused keeps
        # them on the parameters' device. The CUDA target runs on fake CPU tensors, so say which.
        host_steps = target.device == "cuda" and train is not None and \
            resolved_impl(train.impl, target.device) != "fused"
        mark = _marker(cap, seen, model, marked, host_steps)  # before the step swaps the fake parameters into the module
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
                    _rng_states(cap, target.device == "cpu"), _cache_clears(cap), \
                    segment_scope(cap.recompute_scope):
                cap.recording = True
                context = forward_context(target, backends, cap.clearing_cache)
                if session is None:
                    out, loss = run_step(forward, fake_inputs, tagged_loss, cap.set_phase, context)
                else:
                    out, loss = session.run(forward, fake_inputs, tagged_loss, cap.set_phase, context, mark, fake=True)
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
                         train=train if session is not None else None, micro_steps=tuple(cap.micro_steps))
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
            marked: dict[str, list[int]], host_steps: bool = False) -> Callable[[str, list[tuple[str, torch.Tensor]]], None]:
    """Sets the kind of the storages the training step names (gradients, optimizer states, fp32
    gradient copies) and the parameter each belongs to (``Storage.owner``: its storage id).
    ``host_steps``: scalar ``step`` states live in host memory, so they take no device bytes."""
    param_sid = {name: cap.live[seen[id(p)].untyped_storage()._cdata].sid for name, p in model.named_parameters()}

    def mark(kind: str, named: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in named:
            s = cap.storage(t, kind, kind, len(cap.ops) - 1, "")
            s.kind = kind
            if kind != "gradient":
                s.name = f"{name} ({kind})"
            if host_steps and kind == "optimizer state" and name.endswith(":step") and t.numel() <= 1:
                s.nbytes, s.name = 0, f"{name} (optimizer state, host memory)"
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
