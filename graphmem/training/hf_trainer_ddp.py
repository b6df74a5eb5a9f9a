"""A Trainer's step as one rank of a DDP job runs it: torch's own ``DistributedDataParallel`` around
the model, under PyTorch's fake process group (as graphmem/distributed/process_group.py opens it),
on the capture's fake tensors.

Launched on N processes (torchrun / accelerate launch, ``use_cpu=True`` on gloo), the Trainer's
accelerator is MULTI_CPU / MULTI_GPU and ``accelerator.prepare_model`` ends with
``DistributedDataParallel(model, **self.ddp_handler.to_kwargs())`` (accelerate 1.15
``accelerator.py`` 2058-2060; the handler's kwargs are the Trainer's ``_build_accelerator_args``,
transformers 5.24 ``trainer.py`` 749-766: ``find_unused_parameters`` = not gradient checkpointing for
a PreTrainedModel unless ``ddp_find_unused_parameters`` says, ``ddp_bucket_cap_mb``,
``ddp_broadcast_buffers``, ``ddp_static_graph``); micro-steps but the last run under
``accelerator.no_sync(model)``, which is DDP's ``no_sync``. The analysis process is one process
with no distributed state, so accelerate wraps nothing: the runner wraps the same way here.

What DDP's C++ Reducer does is recorded as the real job runs it: the flat gradient buckets it
allocates at construction (reducer.cpp ``initialize_buckets``) and holds for the job (made while
the recorder is paused, so they are tensors from before the step, named "DDP gradient bucket",
kind "communication" as FSDP2's collective buffers, where the all-reduce takes them), the gradients copied into them in the last micro-step,
the buckets copied back into ``.grad`` after the all-reduce, and, with ``find_unused_parameters``,
its used-parameter maps. Two things differ from a real job: the cross-rank
shape check at construction (``_verify_param_shape_across_processes``, which reads the
parameters' values) is skipped, and the all-reduce goes through a comm hook that runs the same
in-place ``all_reduce`` of the bucket and hands the bucket back (the fake backend's work has no
result for the built-in hook to read: torch/csrc/distributed/c10d/FakeProcessGroup.hpp
``FakeWork::getFuture``). With a hook, the Reducer copies a gradient into its bucket with
``copy_`` where the built-in path multiplies by 1/N into it (``mul.out``, reducer.cpp
``mark_variable_ready_dense``): the same bytes held, less the 8 B scalar tensor ``mul.out`` wraps 1/N in for the moment of each copy.

``torch_compile``: ``prepare_model`` compiles last, over the DDP it made (accelerate 1.15
``accelerator.py`` 2058-2073: ``torch.compile(DistributedDataParallel(model))``). Dynamo skips DDP's
forward, which calls the model inside ``_inside_ddp_forward``; there dynamo (torch/_dynamo/convert_frame.py
``CatchErrorsWrapper``, while ``torch._dynamo.config.optimize_ddp`` is "ddp_optimizer", the default)
hands the model's graph to DDPOptimizer (torch/_dynamo/backends/distributed.py), which splits it where
the parameters' bytes, counted from the output back, fill a bucket (1 MiB first, then
``bucket_cap_mb``) and compiles each piece with the user's backend: AOTAutograd partitions each piece
on its own, so what is saved and the temporaries differ from one whole graph. The capture wraps the
same way: DDP around the capture's compiled call of the model (``CompiledModel``,
graphmem/training/hf_trainer.py; graphmem's backend where the user's goes, graphmem/capture/compiled.py),
so dynamo's own DDPOptimizer splits it and each piece gets the backend's partition. The ranks' thread
count is accelerate's (``rank_threads``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Optional, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from graphmem.errors import UsageError
from graphmem.fake_group import fake_group
from graphmem.passes.budget import Parallel

if TYPE_CHECKING:
    from transformers import Trainer

BUCKET = "DDP gradient bucket"


class _Training(Protocol):
    @property
    def train(self) -> object: ...  # graphmem/training/hf_trainer.py TrainerStep for a Trainer's step


class Trained(Protocol):
    """What ``TrainerDDP.check`` reads of the StepSpec (graphmem/step/spec.py): the loop its Trainer runs."""

    @property
    def training(self) -> _Training: ...


@dataclass(frozen=True)
class TrainerDDP:
    """Rank ``rank`` of a Trainer launched on ``world_size`` processes without FSDP or DeepSpeed: accelerate's
    ``DistributedDataParallel`` around the model, run by the Trainer's step (graphmem/training/hf_trainer.py
    TrainerRunner wraps it as ``prepare_model`` does: ``wrap_ddp``). The step is rank r's own (its batch, DDP's
    buckets), so no formula splits it; on the CUDA target the job's one process group gets its NCCL rows."""

    world_size: int = 2
    rank: int = 0
    formula = Parallel()  # DDP replicates the step: each rank's is captured whole, no formula over it

    def describe(self) -> str:
        return f"DDP (accelerate), rank {self.rank} of {self.world_size}"

    def check(self, spec: Trained) -> None:
        """The Trainer's step runs as this rank (graphmem/frontends/trainer.py builds both from one world size)."""
        train = spec.training.train
        if (getattr(train, "world_size", None), getattr(train, "rank", None)) != (self.world_size, self.rank):
            raise UsageError(f"a Trainer's DDP rank {self.rank} of {self.world_size} needs the Trainer's step built for "
                             "it: build the spec with graphmem.analyze(trainer, world_size=..., rank=...)")


class Relabels(Protocol):
    """The capture's recorder as the comm hook uses it (graphmem/capture/recorder.py ``relabel``)."""

    def relabel(self, t: torch.Tensor, kind: str, name: str) -> None: ...


def ddp_kwargs(trainer: Trainer) -> dict[str, Any]:
    """What accelerate hands DistributedDataParallel for this Trainer (the module docstring)."""
    handler = trainer.accelerator.ddp_handler
    return handler.to_kwargs() if handler is not None else {}


def wrap_ddp(trainer: Trainer, model: nn.Module, compiled: bool = False) -> nn.Module:
    """``DistributedDataParallel(model, **kwargs)`` over the fake process group, built on the fake
    parameters the capture swapped in, outside the recorded step (its buckets are held before it).
    ``compiled``: ``model`` is the capture's compiled call of the model (``torch_compile``: the module
    docstring), whose fake parameters are made parameters as dynamo sees them."""
    from torch._guards import detect_fake_mode
    from torch.nn.parallel import DistributedDataParallel
    from torch.nn.parallel import distributed as ddp_module

    mode = detect_fake_mode()
    rec = getattr(mode, "rec", None)
    if compiled:
        as_parameters(model)
    verify = ddp_module._verify_param_shape_across_processes
    ddp_module._verify_param_shape_across_processes = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        with rec.paused() if rec is not None else contextlib.nullcontext():
            ddp = DistributedDataParallel(model, **ddp_kwargs(trainer))
    finally:
        ddp_module._verify_param_shape_across_processes = verify  # type: ignore[assignment]
    ddp.register_comm_hook(rec, _all_reduce)
    return ddp


def as_parameters(model: nn.Module) -> None:
    """The capture's fake parameters (plain fake tensors in the module's ``_parameters``) marked as
    ``nn.Parameter`` for ``isinstance``, as PyTorch marks its own fakes of parameters
    (torch/_subclasses/meta_utils.py ``r._is_param = True``): dynamo copies the mark to the graph's
    placeholders, and DDPOptimizer counts a placeholder's bytes into a bucket only when it is a
    parameter (torch/_dynamo/backends/distributed.py ``add_param_args``)."""
    for p in model.parameters():
        p._is_param = True  # type: ignore[attr-defined]


def _all_reduce(rec: Optional[Relabels], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The built-in hook's in-place all-reduce of the bucket, the bucket handed back at once (the
    values are fake: the 1/N scaling is left out)."""
    buffer = bucket.buffer()
    if rec is not None:
        rec.relabel(buffer, "communication", f"{BUCKET} {bucket.index()}")
    dist.all_reduce(buffer)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buffer)
    return fut


# DistributedDataParallel.register_comm_hook reads the hook's annotations through inspect.signature,
# which keeps this module's postponed (string) annotations as strings: the objects it compares with
_all_reduce.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]})


@contextlib.contextmanager
def ranks(trainer: Trainer, world_size: int, rank: int) -> Iterator[None]:
    """The fake process group of ``world_size`` ranks as ``rank``, and the Trainer's inputs copied as
    on a MULTI_CPU job (``copied_inputs``); nothing for one process."""
    if world_size == 1:
        yield
        return
    with fake_group(rank, world_size), copied_inputs(trainer), rank_threads(world_size):
        yield


@contextlib.contextmanager
def rank_threads(world_size: int) -> Iterator[None]:
    """The thread count a rank of a MULTI_CPU job runs with: accelerate's PartialState sets it to this
    machine's physical cores over the local world size (here ``world_size``: the ranks on this machine),
    at least 1, unless ``OMP_NUM_THREADS`` is set (accelerate 1.15 ``state.py`` 267-278); the CPU kernels'
    per-thread scratch follows it (graphmem/oprules/flash_attention.py: measured, a compiled Trainer's
    later steps peak in flash attention's backward, whose buffers on 2 ranks of a 2-core machine are
    one thread's, 2,048 B fewer than the analysis process's two threads)."""
    import os

    import psutil

    if int(os.environ.get("OMP_NUM_THREADS") or 0) != 0:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, int((psutil.cpu_count(logical=False) or 1) / world_size)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def copied_inputs(trainer: Any) -> Iterator[None]:
    """On a MULTI_CPU job accelerate's device is ``cpu:0`` (``PartialState.set_device``), and the
    Trainer's ``_prepare_input`` (transformers 5.24 ``trainer.py`` 2369-2385) moves each batch tensor
    there: ``Tensor.to`` from ``cpu`` to ``cpu:0`` copies (``aten::_to_copy``; measured in the real
    gloo job, tests/trainer_truth.py: the later steps' peak read 768 B, the batch, above the capture
    without it). The fake tensors cannot be on ``cpu:0`` beside the ``cpu`` parameters (FakeTensor's
    device check), so the copy is a ``clone``: the same bytes, alive as long."""
    prepare = trainer._prepare_input

    def moved(data: object) -> object:
        out = prepare(data)
        return out.clone() if isinstance(out, torch.Tensor) else out

    trainer._prepare_input = moved
    try:
        yield
    finally:
        del trainer._prepare_input


__all__ = ["BUCKET", "TrainerDDP", "as_parameters", "copied_inputs", "ddp_kwargs", "rank_threads", "ranks", "wrap_ddp"]
