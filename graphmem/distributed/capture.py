"""Rank r's training step through PyTorch's own distributed wrappers, on fake tensors.

A fake copy of the model (graphmem/distributed/fsdp.py) is wrapped under the fake process group
(graphmem/distributed/process_group.py) by ``parallelize_module`` (tensor parallel) and
``fully_shard`` (FSDP2), then one step runs under the recording fake mode
(graphmem/capture/recorder.py) as graphmem/capture/capture.py runs a single-device step. The
recorder sees what runs below DTensor's and FSDP's Python code: local-shard aten ops, FSDP's
copy-in/copy-out ops, and the c10d collectives of the fake backend (which leave their outputs
allocated, as a real collective does). The graph's storages are rank r's: local shards, not
global DTensor sizes.

``train`` runs the whole step as graphmem/training/loop.py's Session runs it on one device:
micro-batches (with FSDP2's gradient sync after each, or after the last only: ``Sharding.no_sync``),
then torch.optim over the wrapped model's DTensor parameters, so the optimizer's states are rank
r's local shards (``zeros_like`` of each local chunk), recorded by the single-device marker.

A deep chain is captured at depth 5 and widened (graphmem/capture/reuse.py, checked at depth 6
each time; graphmem/api.py passes this capture to it), when the step has no optimizer or
micro-batches (as on one device: those phases are not block-shaped).

Known limitations: eager mode only (no --mode compiled);
fp32 master weights are the single-device recipe (FSDP2's is its MixedPrecisionPolicy), fused SGD
and Adafactor do not run on DTensors (refused by graphmem/distributed/spec.py make_sharding).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, ContextManager, Optional

import torch
import torch.nn as nn

from graphmem.capture.autograd_tags import _tag_grad_fns
from graphmem.capture.call_paths import module_names, module_order
from graphmem.capture.capture import marker
from graphmem.capture.fakes import Inputs, fake_batch, forward_context
from graphmem.capture.hf_paths import real_paths
from graphmem.capture.recorder import _Mode, _Recorder
from graphmem.capture.session import Hook, Recording
from graphmem.capture.target import Target
from graphmem.distributed.fsdp import fake_copy, local, unsharded_grads, watching
from graphmem.distributed.process_group import fake_process_group
from graphmem.distributed.spec import Sharding
from graphmem.distributed.tensor_parallel import step_context
from graphmem.distributed.wrappers import apply_wrappers
from graphmem.stepgraph import StepGraph
from graphmem.training.batch import Batch
from graphmem.training.loop import Session, TrainStep, relabel_accumulation
from graphmem.training.optim import resolved_impl
from graphmem.training.step import LossFn, default_loss, run_step


def capture_rank(model: nn.Module, inputs: Inputs, loss_fn: Optional[LossFn], target: Target,
                 sharding: Sharding, train: Optional[TrainStep] = None) -> StepGraph:
    """Record rank ``sharding.rank``'s step of ``model`` wrapped as ``sharding`` says; ``train``
    (graphmem/training/loop.py) adds micro-batches and the torch.optim step over the wrapped
    model's parameters (DTensors: the optimizer's states are rank r's local shards), as the
    single-device capture runs them (graphmem/capture/capture.py).

    >>> import torch, graphmem
    >>> from graphmem.distributed import capture_rank, make_sharding
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    >>> g = capture_rank(net, (torch.randn(8, 64),), None, graphmem.Target("cpu"), make_sharding(4, 1, fsdp=True))
    >>> g.storages[g.placeholders[0].meta["storage"]].shape   # rank 1's shard of the first weight
    (16, 64)
    """
    with fake_process_group(sharding.rank, sharding.world_size, sharding.tp, sharding.fsdp) as meshes:
        rec = Recording(target)
        cap = rec.cap
        with rec.mode:
            wrapped = fake_copy(model, target.param_dtype)
            cap.real_bookkeeping = True  # the meshes' own tensors are real
            apply_wrappers(wrapped, sharding, meshes, fake=True)  # the same call as validate's real ranks
            cap.real_bookkeeping = False
            param_sid, fake_inputs = rank_placeholders(cap, rec.mode, wrapped, inputs, target)
            # torch.optim over the DTensor parameters (its states are made by the step, lazily)
            session = Session(traced(train, sharding), dict(wrapped.named_parameters()), target.device) \
                if train is not None and train.active else None
        return _run(rec, wrapped, fake_inputs, loss_fn, param_sid, session, sharding)


def _run(rec: Recording, wrapped: nn.Module, fake_inputs: Batch, loss_fn: Optional[LossFn], param_sid: dict[str, int],
         session: Optional[Session], sharding: Sharding) -> StepGraph:
    def tagged_loss(out: object, inputs: object) -> torch.Tensor:  # (handed on to the loss)
        loss = (loss_fn or default_loss)(out, inputs)
        if isinstance(loss, torch.Tensor):
            _tag_grad_fns(loss, "")  # the loss's nodes belong to the root
        return loss

    cap, target = rec.cap, rec.target
    with rec.hooks():
        # loss_parallel() around loss and backward when the logits stay split
        with rank_running(rec, wrapped, step_context(sharding)):
            context = forward_context(target, rec.backends, cap.clearing_cache)
            marked: dict[str, list[int]] = {}
            # the CUDA target keeps torch.optim's for-loop/foreach step counters on the host
            host_steps = session is not None and target.device == "cuda" and \
                resolved_impl(session.step.impl, target.device) != "fused"
            names = {name: param_sid[name] for name, _ in wrapped.named_parameters()}
            mark = marker(cap, names, marked, host_steps, local)  # rank r's shards (DTensors' local tensors)
            if session is None:
                out, loss = run_step(wrapped, fake_inputs, tagged_loss, cap.set_phase, context)
                mark("gradient", [(n, p.grad) for n, p in wrapped.named_parameters() if p.grad is not None])
            else:
                out, loss = session.run(wrapped, fake_inputs, tagged_loss, cap.set_phase, context, mark, fake=True,
                                        micro_step=_gradient_sync(cap, wrapped, sharding))
                relabel_accumulation(cap.ops, cap.saves, cap.phase_start)
            gradients = marked.get("gradient", [])
        return rec.graph(type(wrapped).__name__, module_order(wrapped), gradients,
                         train=session.step if session is not None else None)


def rank_placeholders(cap: _Recorder, fake_mode: _Mode, wrapped: nn.Module, inputs: Inputs,
                      target: Target) -> tuple[dict[str, int], Batch]:
    """Rank r's parameters and buffers (their local shards) and the fake batch as ``cap``'s placeholders,
    under ``fake_mode`` (here and graphmem/distributed/trainer_fsdp.py): the storage id of each parameter
    and buffer by name, and the batch."""
    cap.paths = module_names(wrapped)
    sids = {}
    for kind, named in (("parameter", wrapped.named_parameters()), ("buffer", wrapped.named_buffers())):
        for name, t in named:
            cap.preexisting(local(t), kind, name)
            sids[name] = cap.placeholders[-1].meta["storage"]
    fake_inputs = fake_batch(inputs, fake_mode, torch.device("cpu"), target.param_dtype, fake_mode.values)
    for name, x in fake_inputs.named():
        if isinstance(x, torch.Tensor):
            cap.preexisting(x, "input", name)
    return sids, fake_inputs


def rank_running(rec: Recording, wrapped: nn.Module, *more: ContextManager[object],
                 saved: Optional[tuple[Hook, Hook]] = None) -> ContextManager[None]:
    """What a rank's step runs under (here, graphmem/distributed/trainer_fsdp.py and graphmem/deepspeed/capture.py):
    the recording's own (graphmem/capture/session.py; ``saved``: other (pack, unpack) hooks), then transformers'
    real paths, FSDP's watched collectives and the engine's ``more``."""
    return rec.running(type(wrapped).__name__, real_paths(rec.mode.values), watching(rec.cap), *more, saved=saved)


def traced(train: TrainStep, sharding: Sharding) -> TrainStep:
    """The micro-steps the capture runs: two, as on one device (3..k repeat the second), except
    under ``no_sync``, where the first makes the unsharded gradients, the middle ones add to them
    and only the last reduce-scatters: three (4..k repeat the second)."""
    if sharding.no_sync and train.micro_batches > 2:
        return dataclasses.replace(train, trace_micro_steps=3)
    return train


def _gradient_sync(cap: _Recorder, wrapped: nn.Module, sharding: Sharding) -> Callable[[int, int], None]:
    """Before micro-step i of n: FSDP2 reduce-scatters after every micro-batch (its default), or,
    under ``no_sync``, after the last only (``FSDPModule.set_requires_gradient_sync``); the
    unsharded gradients the earlier micro-steps left are named."""

    def before(i: int, runs: int) -> None:
        if sharding.no_sync and sharding.fsdp:
            for grad in unsharded_grads(wrapped):
                cap.relabel(grad, "gradient", "unsharded gradient, accumulated without sync (set_requires_gradient_sync)")
            wrapped.set_requires_gradient_sync(i == runs - 1)  # type: ignore[operator]
    return before
