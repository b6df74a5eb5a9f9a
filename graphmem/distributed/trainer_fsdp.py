"""Rank r's step of a Trainer whose TrainingArguments ask for FSDP, on fake tensors.

In rank r's torchrun environment, inside graphmem's fake process group (graphmem/fake_group.py), the
Trainer is built around a fake copy of the model (graphmem/distributed/fsdp.py ``fake_copy``: the
user's model is left untouched), set up as an FSDP job (graphmem/training/hf_trainer_fsdp.py
``build_trainer``, the lines of accelerate and transformers that decide it named there), and
accelerate's own ``Accelerator.prepare(model, optimizer)`` shards it (``FsdpRunner.prepare``: its
``fsdp2_prepare_model`` and optimizer-parameter switch) before the recording starts, so the step's
parameters are rank r's local shards. Then the Trainer's own step runs as on one device
(graphmem/training/hf_trainer.py ``TrainerRunner``) under the recording fake mode, with FSDP2's
storage resizes and collective buffers told to the recorder (graphmem/distributed/fsdp.py
``watching``: the all-gather and reduce-scatter buffers are kind "communication", the budget's
"communication buffers" row). The batch is copied to ``cpu:0`` by the Trainer's ``_prepare_input``
as on any MULTI_CPU rank (graphmem/training/hf_trainer_ddp.py ``copied_inputs``).
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ContextManager, Iterator, Optional

import torch
import torch.nn as nn

from graphmem.capture.autograd_tags import _tag_grad_fns
from graphmem.capture.call_paths import module_order
from graphmem.capture.capture import marker
from graphmem.capture.compiled_blocks import hooks_standing_aside
from graphmem.capture.fakes import Inputs
from graphmem.capture.recorder import _Recorder
from graphmem.capture.session import Recording
from graphmem.capture.target import Target
from graphmem.distributed.capture import rank_placeholders, rank_running
from graphmem.distributed.fsdp import fake_copy, local, unsharded_grads
from graphmem.distributed.trainer_fsdp_compiled import compiled_as_accelerate, hooks_unseen, named_within, units_entered
from graphmem.fake_group import fake_group
from graphmem.stepgraph import StepGraph
from graphmem.training.batch import Batch
from graphmem.training.hf_trainer_ddp import copied_inputs
from graphmem.training.hf_trainer_fsdp import FsdpRunner, TrainerShards, build_trainer, launched_here
from graphmem.training.loop import relabel_accumulation

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import Trainer


def capture_trainer_rank(module: nn.Module, inputs: Inputs, target: Target, p: TrainerShards) -> StepGraph:
    """Record rank ``p.rank``'s first Trainer step (the module docstring); the graph's storages are rank r's."""
    with launched_here(p.rank, p.world_size), fake_group(p.rank, p.world_size):
        rec = Recording(target)
        cap, fake_mode = rec.cap, rec.mode
        try:
            with fake_mode:
                wrapped = fake_copy(module, target.param_dtype)
                cap.real_bookkeeping = True  # the meshes' own tensors are real
                trainer = build_trainer(p.trainer_class, wrapped, p.args_class, p.fields, place=False)
            runner = FsdpRunner(trainer, trace_micro_steps=3)  # (under no_sync: the first, a middle, the last)
            with runner.session(), compiled_as_accelerate(trainer.args, cap, target, rec.backends) as compiled:
                with fake_mode, _real_meshes():
                    runner.prepare()  # accelerate's _prepare_fsdp2 (graphmem/training/hf_trainer_fsdp.py)
                    cap.real_bookkeeping = False
                    param_sid, fake_inputs = rank_placeholders(cap, fake_mode, wrapped, inputs, target)
                    named_within(compiled, wrapped, runner.compiled, cap)  # (torch_compile: trainer_fsdp_compiled.py)
                return _run(rec, runner, wrapped, fake_inputs, param_sid)
        finally:
            cap.real_bookkeeping = False
            from graphmem.distributed.process_group import _forget_meshes

            _forget_meshes()


def _run(rec: Recording, runner: FsdpRunner, wrapped: nn.Module, fake_inputs: Batch, param_sid: dict[str, int]) -> StepGraph:
    def tagged_loss(out: torch.Tensor, inputs: object) -> torch.Tensor:  # (the Trainer's loss)
        if isinstance(out, torch.Tensor):
            _tag_grad_fns(out, "")  # the loss's nodes belong to the root
        return out

    cap = rec.cap
    # (graphmem/distributed/capture.py: a rank's recording, as capture_rank's; the hooks standing aside
    # while dynamo traces through a module under torch_compile: graphmem/distributed/trainer_fsdp_compiled.py)
    with rec.hooks(hooks_standing_aside):
        with rank_running(rec, wrapped, _on_cpu(runner.trainer), copied_inputs(runner.trainer),
                          _named_unsharded(cap, runner.trainer), units_entered(cap, runner.compiled is not None),
                          saved=hooks_unseen(cap, runner.compiled)):
            marked: dict[str, list[int]] = {}
            mark = marker(cap, param_sid, marked, False, local)  # rank r's shards (DTensors' local tensors)
            runner.run(wrapped, fake_inputs, tagged_loss, cap.set_phase, lambda: _null(), mark, fake=True)
            relabel_accumulation(cap.ops, cap.saves, cap.phase_start)
            gradients = marked.get("gradient", [])
        return rec.graph(type(wrapped).__name__, module_order(wrapped), gradients)


@contextlib.contextmanager
def _named_unsharded(cap: _Recorder, trainer: Any) -> Iterator[None]:  # a Trainer: its training_step replaced
    """Before each micro-step, the unsharded gradients the earlier ones left named "gradient": under
    accelerate's ``no_sync`` (accelerator.py 1166-1171: ``set_requires_gradient_sync(False)`` for an
    FSDP2 model, every micro-batch but the last) FSDP2 keeps them whole on the rank until the last one
    reduce-scatters (graphmem/distributed/capture.py names them the same way)."""
    step = trainer.training_step

    def named(*args: object, **kwargs: object) -> torch.Tensor:
        for grad in unsharded_grads(trainer.model):
            cap.relabel(grad, "gradient", "unsharded gradient, accumulated without sync (accelerate's no_sync)")
        return step(*args, **kwargs)

    trainer.training_step = named
    try:
        yield
    finally:
        del trainer.training_step


@contextlib.contextmanager
def _on_cpu(trainer: Trainer) -> Iterator[None]:
    """``args.device`` read as ``cpu`` in the step. On the rank it is ``cpu:0`` (accelerate's
    ``PartialState.set_device``), the same memory, but a fake tensor on ``cpu:0`` cannot meet the ``cpu``
    shards (FakeTensor's device check): the batch's copy there is ``copied_inputs``' clone, as for DDP,
    and the step's scalars (``_tr_loss``, the token count) are made on ``cpu``. ``device`` reads the
    cached ``_setup_devices`` (transformers training_args.py), set here and put back after."""
    args = trainer.args
    kept = args.__dict__.get("_setup_devices")
    args.__dict__["_setup_devices"] = torch.device("cpu")
    try:
        yield
    finally:
        args.__dict__["_setup_devices"] = kept


@contextlib.contextmanager
def _real_meshes() -> Iterator[None]:
    """fully_shard's default mesh (``_init_default_mesh``: ``init_device_mesh`` over the whole group, which
    ``fsdp2_prepare_model`` asks for by passing no mesh) built of real tensors, as on a rank: its rank
    layout is read with ``tolist()``, which a fake tensor cannot answer."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.fsdp._fully_shard import _fully_shard

    made = _fully_shard._init_default_mesh

    def real(mesh_dim_names: Optional[tuple[str, ...]] = None) -> DeviceMesh:
        with unset_fake_temporarily():
            return made(mesh_dim_names)

    _fully_shard._init_default_mesh = real
    try:
        with _pointers():
            yield
    finally:
        _fully_shard._init_default_mesh = made


@contextlib.contextmanager
def _pointers() -> Iterator[None]:
    """A fake tensor's ``data_ptr()`` as a real one tells tensors apart: its storage's identity plus its
    offset. ``Accelerator._prepare_fsdp2`` maps the optimizer's old parameters to the sharded ones by
    ``data_ptr`` (accelerator.py 1718-1766, ``_get_named_parameters`` and
    ``fsdp2_switch_optimizer_parameters``); a fake tensor's is 0 for all (torch/_subclasses/fake_tensor.py),
    which would map every parameter to one shard."""
    from torch._subclasses.fake_tensor import FakeTensor

    def data_ptr(t: torch.Tensor) -> int:
        return int(t.untyped_storage()._cdata) + int(t.storage_offset()) * t.element_size()

    FakeTensor.data_ptr = data_ptr  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        del FakeTensor.data_ptr


def _null() -> ContextManager[None]:
    return contextlib.nullcontext()


__all__ = ["capture_trainer_rank"]
