"""A Trainer whose TrainingArguments ask for FSDP, as one rank of an N-process job builds it: accelerate's
own FSDP2 code wraps the model (``fsdp2_prepare_model``) and switches the optimizer's parameters
(``Accelerator._prepare_fsdp2``), called by the runner where ``Trainer._prepare_for_training`` calls it.

What decides FSDP in a launched job, and what is set by hand here (accelerate 1.15, transformers 5.24):

- ``TrainingArguments._process_fsdp_args`` (training_args.py 2775-2885) turns ``fsdp``/``fsdp_config``
  into ``fsdp_plugin_args`` (``version`` 2 by default, the auto-wrap policy, ``reshard_after_forward``);
  ``Trainer.create_accelerator_and_postprocess`` (trainer.py 851-859) builds
  ``FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)`` and hands it to ``Accelerator``.
- ``Trainer.__init__`` (trainer.py 472-478) raises "Using fsdp only works in distributed training" unless
  ``args.parallel_mode`` is DISTRIBUTED, which ``PartialState`` decides from the torchrun environment
  (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) and torch.distributed: so the Trainer is built
  with that environment set (``torchrun_env``), inside graphmem's fake process group in the analysis
  (graphmem/fake_group.py: accelerate's ``PartialState`` finds it initialized, state.py 284-285, and
  uses it), in a gloo process group in the real ranks (graphmem/validation/trainer_ranks.py).
- ``AcceleratorState.__init__`` (state.py 985-1015) sets ``distributed_type = FSDP``, calls
  ``fsdp_plugin.set_mixed_precision(mixed_precision)`` (bf16/fp16: the MixedPrecisionPolicy) and
  keeps the plugin only where the process group's device is an accelerator (MULTI_GPU, MULTI_XPU,
  ...): on CPUs (MULTI_CPU) it drops the plugin and the job runs DDP. ``as_fsdp_job`` sets those three
  by hand, as that branch would, and ``Trainer.is_fsdp_enabled`` (trainer.py 875, read from the state
  right after). Nothing else is set by hand: ``Accelerator.is_fsdp2`` (accelerator.py 752, state.py
  1104) then reads true, ``Accelerator.prepare`` goes to ``_prepare_fsdp2`` (accelerator.py 1553-1554),
  and the Trainer's own code does the rest. Accelerate's ``native_amp`` (autocast around forward) is
  left as it is: ``_prepare_fsdp2`` never calls ``prepare_model``, so FSDP2 runs without autocast; the
  MixedPrecisionPolicy casts.
- ``PartialState`` sets ``torch.set_num_threads`` on MULTI_CPU when OMP_NUM_THREADS is unset (state.py
  266-282): the environment names the current thread count, so the CPU kernels' scratch rules stay
  the analysis's (graphmem/oprules/).

Accelerate's states are process-wide singletons (``PartialState``, ``AcceleratorState``, ``GradientState``:
``SharedDict``s), and the Accelerator sets ``ACCELERATE_USE_FSDP`` in the environment (accelerator.py
397): ``torchrun_env`` puts the environment, the states and the thread count back as they were after.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Protocol

import torch
import torch.nn as nn

from graphmem.errors import UsageError
from graphmem.passes.budget import Parallel
from graphmem.training.hf_trainer import TrainerRunner

if TYPE_CHECKING:
    from transformers import Trainer, TrainingArguments

# what the fake rank's environment names; nothing connects to it (the fake group is initialized first)
FAKE_MASTER = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def torchrun_env(rank: int, world_size: int, master: dict[str, str]) -> dict[str, str]:
    """The environment ``torchrun`` gives rank ``rank``, and OMP_NUM_THREADS at this process's thread count."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": str(torch.get_num_threads()), **master}


@contextlib.contextmanager
def launched_here(rank: int, world_size: int) -> Iterator[None]:
    """Rank ``rank``'s torchrun environment in this process, accelerate's states fresh for it; the
    environment, the states and the thread count restored after (the module docstring)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    states = [(cls, dict(cls._shared_state)) for cls in (PartialState, AcceleratorState, GradientState)]
    env, threads = dict(os.environ), torch.get_num_threads()
    os.environ.update(torchrun_env(rank, world_size, FAKE_MASTER))
    for cls, _ in states:
        cls._shared_state.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(env)
        for cls, kept in states:
            cls._shared_state.clear()
            cls._shared_state.update(kept)
        torch.set_num_threads(threads)


def build_trainer(trainer_class: type, model: nn.Module, args_class: type, fields: dict[str, object], place: bool = True
                  ) -> Any:
    """The Trainer as a launched rank builds it (fresh TrainingArguments: their device setup is cached
    per object), set up as accelerate sets up an FSDP job (``as_fsdp_job``). ``place=False`` (the
    analysis's fake copy): ``Trainer.__init__`` leaves the model where it is instead of
    ``model.to(args.device)`` (trainer.py 504; ``cpu:0`` on a MULTI_CPU rank, a copy of every parameter,
    which fully_shard's shards replace before the step: nothing of it is held in the step), through
    ``place_model_on_device``, the property TrainingArguments documents for overriding."""
    if not place:
        args_class = dataclasses.make_dataclass(args_class.__name__, [], bases=(args_class,),
                                                namespace={"place_model_on_device": property(lambda self: False)})
    return as_fsdp_job(trainer_class(model=model, args=args_class(**fields)))


def as_fsdp_job(trainer: Trainer) -> Trainer:
    """What ``AcceleratorState.__init__`` sets for FSDP where the group's device is an accelerator
    (state.py 1010-1015), set on this CPU rank (the module docstring); the Trainer's flag read after."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    args, state = trainer.args, trainer.accelerator.state
    if args.fsdp_plugin_args is None or state.distributed_type != DistributedType.MULTI_CPU:
        raise UsageError(f"the Trainer's accelerator is {state.distributed_type.value} with "
                         f"{'no' if args.fsdp_plugin_args is None else 'an'} FSDP plugin: build it with `fsdp` in its "
                         "TrainingArguments, launched on several CPU processes")
    plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)  # trainer.py 851-855
    if plugin.fsdp_version != 2:
        raise UsageError("graphmem runs accelerate's FSDP2 (`fsdp_config={'version': 2}`, the default); FSDP1 is "
                         "deprecated in transformers: set version 2")
    if plugin.activation_checkpointing or plugin.cpu_offload.__class__.__name__ == "CPUOffloadPolicy" \
            or plugin.cpu_ram_efficient_loading:
        raise UsageError("fsdp_config's `activation_checkpointing`, `cpu_offload` and `cpu_ram_efficient_loading` are "
                         "not run per rank yet: drop them (the Trainer's `activation_checkpointing` works)")
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    trainer.is_fsdp_enabled = True
    return trainer


class FsdpRunner(TrainerRunner):
    """The Trainer's step (graphmem/training/hf_trainer.py) with ``Trainer._prepare_for_training``'s
    FSDP2 branch (trainer.py 1717-1787): ``create_optimizer`` over the whole parameters, then
    ``accelerator.prepare(model, optimizer)``, which runs ``_prepare_fsdp2``: ``fsdp2_prepare_model``
    (fully_shard per auto-wrapped layer, the embedding, the tail [final norm, LM head] and the root;
    the fp32 upcast of trainable 16-bit parameters under mixed precision) and
    ``fsdp2_switch_optimizer_parameters`` (the optimizer over the DTensor shards). ``prepare`` runs it
    once, before the step (the capture holds the shards as the step's parameters; a real rank
    measures from there); the scheduler and ``_tr_loss`` are made at the first run, as for DDP.
    With ``torch_compile`` it returns torch.compile's ``OptimizedModule`` around the model, itself
    the root FSDP unit; the steps call it (``compiled``), as the Trainer does (trainer.py 1783-1786).
    Micro-steps but the last run under ``accelerator.no_sync(model)``, which for FSDP2 is
    ``set_requires_gradient_sync(False)`` (accelerator.py 1166-1171): the unsharded gradients stay on the
    rank until the last micro-batch reduce-scatters them. The capture traces three micro-steps then
    (the first, a middle one, the last; 4..k repeat the middle: graphmem/distributed/trainer_fsdp.py)."""

    def __init__(self, trainer: Trainer, trace_micro_steps: int = 2) -> None:
        super().__init__(trainer, trace_micro_steps, launched=trainer.accelerator)  # (the fake group is the caller's)
        self.prepared = False

    def prepare(self) -> None:
        """create_optimizer and ``accelerator.prepare(model, optimizer)`` (trainer.py 1741, 1771)."""
        t = self.trainer
        t.optimizer, t.lr_scheduler, t._created_lr_scheduler = None, None, False
        t.create_optimizer()
        model, t.optimizer = t.accelerator.prepare(t.model, t.optimizer)
        if getattr(model, "_orig_mod", model) is not self.model:  # (torch_compile: the OptimizedModule around it)
            raise UsageError(f"accelerate's FSDP2 prepare returned {type(model).__name__}, not the model wrapped in place")
        t.model = t.model_wrapped = model  # trainer.py 1783-1786
        if t.args.torch_compile:  # the module the steps call: torch.compile's, fully_shard'ed as the root unit
            self.compiled = model
        self.prepared = True

    def _start(self, forward: Optional[Callable[..., object]] = None) -> None:
        """The rest of ``_prepare_for_training`` once ``prepare`` has run: the scheduler, ``_tr_loss``
        (``forward``: graphmem's compiled call, never given here: under ``torch_compile`` accelerate's
        ``_prepare_fsdp2`` compiles the model itself, before fully_shard, graphmem/distributed/trainer_fsdp_compiled.py)."""
        t = self.trainer
        if not self.prepared:
            self.prepare()
        t.create_scheduler(num_training_steps=max(t.args.max_steps, 1), optimizer=t.optimizer)
        self.tr_loss = torch.tensor(0.0, device=t.args.device)  # _inner_training_loop 1645
        self.started = True


class _Target(Protocol):
    @property
    def mode(self) -> str: ...

    @property
    def device(self) -> str: ...


class Targeted(Protocol):
    """What ``TrainerShards.check`` reads of the StepSpec (graphmem/step/spec.py): its target's mode and device."""

    @property
    def target(self) -> _Target: ...


@dataclass(frozen=True)
class TrainerShards:
    """Rank ``rank`` of a Trainer's FSDP2 job over ``world_size`` processes: the Trainer is built per rank
    (in one process its FSDP arguments are refused), from its class, its arguments' class and their fields."""

    trainer_class: type = field(compare=False)
    args_class: type = field(compare=False)
    fields: dict[str, object] = field(compare=False, repr=False)
    world_size: int = 2
    rank: int = 0
    formula = Parallel()  # accelerate's wrapping splits the step itself: no formula over it

    def describe(self) -> str:
        return f"FSDP2 (accelerate), rank {self.rank} of {self.world_size}"

    def check(self, spec: Targeted) -> None:
        if spec.target.mode == "compiled" or spec.target.device != "cpu":
            raise UsageError("a Trainer's FSDP2 rank runs on the CPU target and compiles as its TrainingArguments say: "
                             "drop `mode='compiled'` (set `torch_compile` in them), set `use_cpu=True`")


def shards_of(trainer_class: type, model: nn.Module, args: TrainingArguments, world_size: int, rank: Optional[int]) -> TrainerShards:
    """The per-rank Trainer's recipe: its arguments' init fields (rebuilt per rank: their device setup is cached)."""
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    return TrainerShards(trainer_class, type(args), fields, world_size, rank or 0)


__all__ = ["FAKE_MASTER", "FsdpRunner", "TrainerShards", "as_fsdp_job", "build_trainer", "launched_here", "shards_of",
           "torchrun_env"]
