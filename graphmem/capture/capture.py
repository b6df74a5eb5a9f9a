"""Run ONE training step on fake tensors and record it as a StepGraph.

How: the fake mode itself (graphmem/capture/recorder.py) sees every aten op in the order eager
autograd runs it (forward, loss, backward), below autograd, so the saved set is exactly what
eager autograd saves. ``saved_tensors_hooks`` report which storage each grad_fn saves; the
packed handle's destruction is autograd releasing it. A weakref on each storage reports when
it is freed. Nothing real is allocated: parameters, buffers and inputs become fresh fake
tensors of the same shape/stride/dtype on the target device, swapped into the user's module
for the step (torch.nn.utils.stateless, as ``torch.func.functional_call`` does, but through
backward too, where checkpointed segments run their forward again); its own tensors are not
touched. The one exception: ops on the real batch whose outputs are no larger than its integer
tensors (a mask, ids) also run for real beside their fakes, so a data-dependent read answers as
in the real step (graphmem/capture/values.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import torch.nn as nn
from torch.nn.utils.stateless import _reparametrize_module

from graphmem.capture.autograd_tags import _tag_grad_fns
from graphmem.capture.call_paths import module_names, module_order
from graphmem.capture.compiled import CompiledStep, compiled_context
from graphmem.capture.compiled_blocks import hooks_standing_aside
from graphmem.capture.compiled_per_block import compiling_blocks
from graphmem.capture.fakes import Inputs, fake_batch, fake_state, forward_context
from graphmem.capture.hand_back import hand_back_in_order
from graphmem.capture.hf_paths import real_paths
from graphmem.capture.recompute import segment_scope
from graphmem.capture.recorder import _Mode, _Recorder
from graphmem.capture.session import Recording
from graphmem.capture.target import BLOCKS, Target
from graphmem.errors import UsageError
from graphmem.stepgraph import StepGraph
from graphmem.training.batch import Batch
from graphmem.training.loop import Session, TrainStep, relabel_accumulation
from graphmem.training.loop_options import OFFLOADED
from graphmem.training.optim import HOST_STATE, resolved_impl
from graphmem.training.step import LossFn, default_loss, run_step

StepRunner = Callable[..., Any]  # Session.run's signature: (forward, batch, loss_fn, on_phase, context, mark, fake=)


def capture(
    model: nn.Module,
    inputs: Inputs,
    loss_fn: Optional[LossFn] = None,
    device: Union[str, torch.device, Target] = "cpu",
    train: Optional[TrainStep] = None,
    runner: Optional[StepRunner] = None,
) -> StepGraph:
    """Record one training step of ``model`` on fake tensors.

    ``inputs`` is a tuple of tensors, a dict of keyword inputs or ``(args, kwargs)`` (real, meta
    or fake: only their shapes and dtypes are used), or a zero-argument callable returning one run under the fake mode with the fake device as the
    default device (so ``torch.randint(...)`` inside it makes fake tensors). ``device`` is a
    device name or a Target (graphmem/capture/target.py); the CUDA target runs on fake CPU tensors
    with CUDA's rules applied.
    ``train`` (graphmem/training/loop.py) adds micro-batches and the optimizer step
    with ``zero_grad`` after backward, in phase "optimizer". ``runner`` runs the whole step in its
    place: a callable with Session.run's signature (graphmem/training/loop.py; a transformers
    Trainer's step: graphmem/training/hf_trainer.py), given the fake batch, the phase and mark callbacks.
    """
    target = device if isinstance(device, Target) else Target(str(torch.device(device).type))
    if target.mode == "compiled" and train is not None and train.loop_options:
        raise UsageError(f"{', '.join(train.loop_options)} run around compiled blocks, as torchtune compiles: use "
                         "mode='compiled-blocks' (each block and the loss compiled), or mode='eager'")
    rec = Recording(target, module_names(model))
    training = [(m, m.training) for m in model.modules()]
    compiled: Optional[CompiledStep] = None
    try:
        for m in model.modules():  # train mode (set directly: an exported module refuses .train())
            m.training = True
        if target.mode == "compiled":  # torch.compile's step, traced once on its own fake tensors
            compiled = CompiledStep.trace(model, inputs, loss_fn, target, rec.backends, runner)
        step = _prepare(model, inputs, target, train, rec.cap, rec.mode)  # before the step swaps the fake parameters in
        # compiled blocks: the hooks stand aside while dynamo traces a block (its graphs' nodes name its modules);
        # compiled: no module hooks, modules come from the graphs' node metadata
        with rec.hooks(hooks_standing_aside if target.mode == BLOCKS else lambda h: h, install=compiled is None):
            with compiling_blocks(model, loss_fn, rec.cap, target, rec.backends) if target.mode == BLOCKS \
                    else contextlib.nullcontext(loss_fn) as step_loss:
                # ``kept``: the step's output, loss and context, alive (as the fake state) until the recorder closes
                gradient_sids, kept = _run(model, step_loss, rec, runner, compiled, step)
            return _step_graph(model, train, rec, compiled, step, gradient_sids)
    finally:
        if compiled is not None:
            compiled.close()
        for m, was in training:
            m.training = was


@dataclass
class _Prepared:
    """What the step runs on: the fake state and batch, the optimizer session, the marker."""

    state: dict[str, torch.Tensor]  # the fake parameters and buffers, by name
    seen: dict[int, torch.Tensor]  # id(real tensor) -> its fake
    inputs: Batch
    session: Optional[Session]
    mark: Callable[[str, list[tuple[str, torch.Tensor]]], None]
    marked: dict[str, list[int]]  # kind -> the storage ids mark() named


def _prepare(model: nn.Module, inputs: Inputs, target: Target, train: Optional[TrainStep], cap: _Recorder,
             fake_mode: _Mode) -> _Prepared:
    device = torch.device("cpu")  # see graphmem/capture/target.py for why the CUDA target runs here
    dtype = target.param_dtype
    with fake_mode:
        state, seen = fake_state(model, device, dtype, cap.preexisting)
        fake_inputs = fake_batch(inputs, fake_mode, device, dtype, fake_mode.values)
        for name, x in fake_inputs.named():
            if isinstance(x, torch.Tensor):
                cap.preexisting(x, "input", name)
        session = _session(train, model, seen, cap, target.device)
    marked: dict[str, list[int]] = {}
    # torch.optim keeps the step counters of its for-loop and foreach implementations on the host
    # (torch/optim/adam.py _init_group: torch.tensor(0.0) unless fused or capturable); fused keeps
    # them on the parameters' device. The CUDA target runs on fake CPU tensors, so say which.
    host_steps = target.device == "cuda" and train is not None and \
        resolved_impl(train.impl, target.device) != "fused"
    mark = _marker(cap, seen, model, marked, host_steps)
    return _Prepared(state, seen, fake_inputs, session, mark, marked)


def _run(model: nn.Module, loss_fn: Optional[LossFn], rec: Recording, runner: Optional[StepRunner],
         compiled: Optional[CompiledStep], step: _Prepared) -> tuple[list[int], tuple[object, ...]]:
    """Run the step under the fake mode, recording it: the storage ids of the gradients it leaves,
    and what the caller keeps until the recorder closes (the output, the loss and the context: their
    frees come after the step)."""
    cap, target = rec.cap, rec.target

    def forward(*args: object, **kwargs: object) -> object:
        if compiled is not None:
            return compiled.replay(cap, args, kwargs)
        return model(*args, **kwargs)

    def tagged_loss(out: object, inputs: object) -> torch.Tensor:
        loss = (loss_fn or default_loss)(out, inputs)
        if isinstance(loss, torch.Tensor):
            _tag_grad_fns(loss, "")  # the loss's nodes (and any left untagged) belong to the root
        return loss

    session, mark = step.session, step.mark
    # the fake parameters stay in the module through backward: checkpointed
    # segments (torch.utils.checkpoint) run their forward again there
    with rec.running(type(model).__name__,
                     _reparametrize_module(model, step.state, tie_weights=True, strict=False, stack_weights=True),
                     segment_scope(cap.recompute_scope),
                     real_paths(rec.mode.values) if compiled is None else contextlib.nullcontext()):
        context = forward_context(target, rec.backends, cap.clearing_cache) if compiled is None \
            else compiled_context(target, cap.clearing_cache)
        if runner is not None:  # a trainer's own step (graphmem/training/hf_trainer.py)
            out, loss = runner(forward, step.inputs, tagged_loss, cap.set_phase, context, mark, fake=True)
        elif session is not None:  # graphmem's loop (graphmem/training/loop.py)
            out, loss = session.run(forward, step.inputs, tagged_loss, cap.set_phase, context, mark, fake=True,
                                    observe=(cap.pack_as, cap.unpack))
        else:
            out, loss = run_step(forward, step.inputs, tagged_loss, cap.set_phase, context)
        if runner is not None or session is not None:
            relabel_accumulation(cap.ops, cap.saves, cap.phase_start)
        gradient_sids = list(dict.fromkeys(step.marked.get("gradient", []) + [
            _gradient(cap, p) for p in step.seen.values() if p.grad is not None]))
        for sid in gradient_sids:  # the op that made it stays its name; it lives on as a .grad
            cap.storages[sid].kind = "gradient"
    return gradient_sids, (out, loss, context)


def _step_graph(model: nn.Module, train: Optional[TrainStep], rec: Recording, compiled: Optional[CompiledStep],
                step: _Prepared, gradient_sids: list[int]) -> StepGraph:
    cap = rec.cap
    if compiled is not None:
        compiled.check_replayed()
        hand_back_in_order(cap.ops, cap.storages, cap.saves, gradient_sids)
    return rec.graph(type(model).__name__, module_order(model), gradient_sids,
                     module_inputs=compiled.module_inputs if compiled is not None else cap.module_inputs,
                     compiled=compiled.summary() if compiled is not None else None,
                     train=train if step.session is not None else None)


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
    # what the optimizers hold from their construction on, where it is on the target's device (bitsandbytes'
    # quantization maps: made on the CPU in Optimizer8bit.__init__, copied to a CUDA device only by a parameter's
    # 8-bit init_state; an optimizer_in_backward optimizer of a small parameter never uses its pair, yet holds it)
    for i, t in enumerate(session.held_tensors()):
        if t.device.type == torch.device(device).type and t.untyped_storage()._cdata not in cap.live:
            cap.preexisting(t, "external", f"optimizer's held tensor {i} (bitsandbytes quantization map)")
    return session


def _marker(cap: _Recorder, seen: dict[int, torch.Tensor], model: nn.Module,
            marked: dict[str, list[int]], host_steps: bool = False) -> Callable[[str, list[tuple[str, torch.Tensor]]], None]:
    """Sets the kind of the storages the training step names (gradients, optimizer states, fp32
    gradient copies) and the parameter each belongs to (``Storage.owner``: its storage id).
    ``host_steps``: scalar ``step`` states live in host memory, so they take no device bytes."""
    param_sid = {name: cap.live[seen[id(p)].untyped_storage()._cdata].sid for name, p in model.named_parameters()}
    return marker(cap, param_sid, marked, host_steps)


def marker(cap: _Recorder, param_sid: dict[str, int], marked: dict[str, list[int]], host_steps: bool = False,
           view: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> Callable[[str, list[tuple[str, torch.Tensor]]], None]:
    """``_marker`` given each parameter's storage id by name; ``view`` maps a named tensor to the
    one whose storage is held (a DTensor's local shard: graphmem/distributed/capture.py)."""

    def mark(kind: str, named: list[tuple[str, torch.Tensor]]) -> None:
        host = kind == HOST_STATE  # a runner's own step says which states are in host memory
        kind = "optimizer state" if host else kind
        for name, t in named:
            s = cap.storage(view(t), kind, kind, len(cap.ops) - 1, "")
            s.kind = kind
            if kind != "gradient":
                s.name = f"{name} ({kind})"
            if host or (host_steps and kind == "optimizer state" and name.endswith(":step") and t.numel() <= 1):
                s.nbytes, s.name = 0, f"{name} (optimizer state, host memory)"
            if kind == OFFLOADED:  # a saved tensor's host copy: no device bytes (graphmem/training/loop_options.py)
                s.nbytes, s.name = 0, name
            owner = param_sid.get(name.split(":")[0])
            if kind == "gradient" and s.owner is not None and owner is not None and s.owner != owner:
                s.owners = (*(s.owners or (s.owner,)), owner)  # one flat buffer, several parameters' gradients
            else:
                s.owner = owner
            marked.setdefault(kind, []).append(s.sid)
    return mark
