"""A Trainer whose TrainingArguments name ``deepspeed``, as one rank of an N-process job builds and steps it:
accelerate runs DeepSpeed (``Accelerator.prepare`` -> ``_prepare_deepspeed`` -> ``deepspeed.initialize``), the
Trainer's own code around it (transformers 5.24 ``trainer.py``, accelerate 1.15; line numbers are theirs).

What a launched CPU rank does, and so what is done here, nothing set by hand:

- ``TrainingArguments.__post_init__`` (training_args.py 1705-1715) builds ``HfTrainerDeepSpeedConfig(deepspeed)``,
  resolves its ``"auto"`` values from the arguments (``trainer_config_process``) and hands it to accelerate's
  ``DeepSpeedPlugin``; ``_setup_devices`` (1886-1903) sets ``ACCELERATE_USE_DEEPSPEED`` for ``PartialState``,
  which, with ``LOCAL_RANK`` set, joins DeepSpeed's communication backend (``deepspeed.comm.init_distributed``:
  the process group already initialized, gloo in a real rank, graphmem's fake group here) and reads
  ``DistributedType.DEEPSPEED``. On a machine without an accelerator accelerate finds no backend
  (``_prepare_backend`` gives ``None``: gloo is only chosen with ``use_cpu``, and ``use_cpu`` turns DeepSpeed
  off, state.py 974), so its ``num_processes`` is 1 while DeepSpeed's engine sees the whole group: a config's
  ``train_batch_size: "auto"`` then resolves to 1 x the micro-batch and DeepSpeed's batch assertion refuses it
  (``check_args``); without ``train_batch_size`` DeepSpeed derives it from the world size.
- ``Trainer._prepare_for_training`` (1715-1800), called as ``train()`` calls it: ``deepspeed_init`` (the
  config finalized with the model's hidden size, ``create_optimizer``: AdamW by default, or accelerate's
  ``DummyOptim`` for a config's own optimizer), then ``accelerator.prepare(model, optimizer)``, whose
  ``_prepare_deepspeed`` calls ``deepspeed.initialize``; the engine is ``trainer.model_wrapped``.
- each micro-step ``training_step`` calls ``accelerator.backward``: ``DeepSpeedEngineWrapper.backward`` runs
  ``engine.backward`` and, on the accumulation boundary, ``engine.step`` (clipping, the optimizer step, zero
  grad); the Trainer's ``optimizer.step()`` is then accelerate's no-op ``DeepSpeedOptimizerWrapper.step``,
  and ``_clip_grad_norm`` reads the engine's norm. Micro-steps never run under ``no_sync`` (trainer.py 1904).

Known limitations: the CPU target, eager mode; what graphmem/deepspeed/config.py refuses for a DeepSpeed
config is refused here too (its checks run on the arguments' config).
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, ContextManager, Iterator, Optional

import torch
import torch.nn as nn

from graphmem.deepspeed.config import DeepSpeedJob, SpecView
from graphmem.errors import UsageError
from graphmem.passes.budget import Parallel
from graphmem.training.hf_trainer import TrainerRunner
from graphmem.training.hf_trainer_cuda import bf16_check_answered, pin_foreach
from graphmem.training.loop import Mark
from graphmem.training.step import LossFn

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine
    from transformers import Trainer, TrainingArguments


@dataclass(frozen=True)
class TrainerDeepSpeed:
    """Rank ``rank`` of a Trainer's DeepSpeed job over ``world_size`` processes: the Trainer is built per rank,
    from its class, its arguments' class and their fields (``deepspeed`` among them)."""

    trainer_class: type = field(compare=False)
    args_class: type = field(compare=False)
    fields: dict[str, object] = field(compare=False, repr=False)
    job: DeepSpeedJob  # its config as the arguments fill it, the world size and the rank (compared by them)
    formula = Parallel()  # DeepSpeed's engine splits the step itself: no formula over it

    @property
    def world_size(self) -> int:
        return self.job.world_size

    @property
    def rank(self) -> int:
        return self.job.rank

    @property
    def stage(self) -> int:
        """The config's ZeRO stage."""
        return self.job.stage

    def at_rank(self, rank: int) -> "TrainerDeepSpeed":
        """The same job's rank ``rank``."""
        return dataclasses.replace(self, job=dataclasses.replace(self.job, rank=rank))

    def describe(self) -> str:
        return f"DeepSpeed ZeRO-{self.stage} (accelerate), rank {self.rank} of {self.world_size}"

    def check(self, spec: SpecView) -> None:
        if spec.target.mode == "compiled":
            raise UsageError("a Trainer's DeepSpeed rank runs in eager mode: drop `mode='compiled'`")
        if spec.target.device == "cuda":
            self.job.check_cuda()


def deepspeed_of(trainer_class: type, args: TrainingArguments, world_size: int, rank: Optional[int]) -> TrainerDeepSpeed:
    """The per-rank Trainer's recipe, its DeepSpeed config checked as graphmem/deepspeed/config.py checks one
    (one-line errors: NVMe offload, fp16 on this CPU, an unknown key, an ``"auto"`` nothing resolves). CPU offload
    runs as on the direct engine path (graphmem/deepspeed/engine.py ``host_tensors``): the Trainer's torch
    optimizer steps the host partitions where the config sets ``zero_force_ds_cpu_optimizer: false``, else
    DeepSpeed's own refusal is the one line."""
    from graphmem.deepspeed.config import check_torch_optimizer_offload, make_job

    if args.fp16:  # TrainingArguments' fp16 sets the config's fp16.enabled (trainer_config_process)
        raise UsageError("fp16 with DeepSpeed (`fp16=True` in the TrainingArguments) is not run on DeepSpeed's CPU "
                         "accelerator: use bf16=True or fp32")
    # the config as TrainingArguments filled its "auto" values from themselves (trainer_config_process: bf16,
    # batch sizes, accumulation, clipping); those of the model's hidden size stay "auto" until the engine is built
    filled = getattr(getattr(args, "hf_deepspeed_config", None), "config", None)
    job = make_job(filled if isinstance(filled, dict) else args.deepspeed, world_size, rank)
    if "optimizer" not in job.config:  # the Trainer's torch optimizer (``create_optimizer``)
        check_torch_optimizer_offload(job.config)
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    return TrainerDeepSpeed(trainer_class, type(args), fields, job)


@contextlib.contextmanager
def deepspeed_rank(rank: int, world_size: int) -> Iterator[None]:
    """Rank ``rank``'s launcher environment for DeepSpeed (graphmem/deepspeed/engine.py ``launched``: DeepSpeed's
    globals put back after) and accelerate's (graphmem/training/hf_trainer_fsdp.py ``launched_here``), and
    transformers' global DeepSpeed config (``HfDeepSpeedConfig`` sets a weak reference that
    ``is_deepspeed_zero3_enabled`` reads, which would make later model loads in this process ZeRO-3's) as it was."""
    import transformers.integrations.deepspeed as hf_ds

    from graphmem.deepspeed.engine import launched
    from graphmem.training.hf_trainer_fsdp import launched_here

    kept = hf_ds._hf_deepspeed_config_weak_ref
    try:
        with launched(rank, world_size), launched_here(rank, world_size):
            yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = kept


def build_ds_trainer(p: TrainerDeepSpeed, model: nn.Module) -> Trainer:
    """The Trainer around ``model`` as rank ``p.rank`` builds it (fresh TrainingArguments: their device setup
    is cached per object), inside ``deepspeed_rank`` and the rank's process group."""
    with bf16_by_deepspeed():
        trainer = p.trainer_class(model=model, args=p.args_class(**p.fields))
    if not trainer.is_deepspeed_enabled:
        raise UsageError(f"the Trainer's accelerator is {trainer.accelerator.distributed_type.value}, not DeepSpeed: "
                         "set `deepspeed` in its TrainingArguments and leave `use_cpu` unset (it turns DeepSpeed off)")
    return trainer


@contextlib.contextmanager
def bf16_by_deepspeed() -> Iterator[None]:
    """TrainingArguments' bf16 check answered yes while a DeepSpeed job's arguments are built. The check
    (transformers training_args.py ``_validate_args``: "Your setup doesn't support bf16/gpu" unless
    ``is_torch_bf16_gpu_available()`` or ``use_cpu``) asks for a GPU for torch's autocast; a DeepSpeed job's bf16 is
    DeepSpeed's bf16 engine instead (``bf16.enabled`` filled from ``args.bf16``: integrations/deepspeed.py
    ``trainer_config_process``; the model cast and the optimizer wrapped by DeepSpeed), which DeepSpeed's CPU
    accelerator runs (deepspeed/accelerator/cpu_accelerator.py ``is_bf16_supported``: True), and ``use_cpu``, the
    check's way out, turns DeepSpeed off. The arguments were valid where the user built them (a GPU machine)."""
    with bf16_check_answered(True):
        yield


class DeepSpeedRunner(TrainerRunner):
    """The Trainer's step (graphmem/training/hf_trainer.py) with ``_prepare_for_training``'s DeepSpeed branch
    run once before it (``prepare``) and the engine as the module each micro-step calls. ``engine.step``
    (inside ``accelerator.backward`` on the boundary) starts the optimizer phase: the gradients DeepSpeed
    holds then are marked, its optimizer's states after."""

    def __init__(self, trainer: Trainer, trace_micro_steps: int = 2,
                 rules: Optional[Callable[[], ContextManager[object]]] = None, foreach: bool = False) -> None:
        """``rules``: the CUDA target's kernel rules around each ``compute_loss`` (graphmem/capture/fakes.py
        ``forward_context``; DeepSpeed's bf16 is its engine's cast, not autocast); ``foreach``: the inner torch
        optimizer pinned to foreach, torch.optim's pick for CUDA tensors (not under CPU offload: host partitions)."""
        super().__init__(trainer, trace_micro_steps, launched=trainer.accelerator)  # (the process group is the caller's)
        self.engine: Optional[DeepSpeedEngine] = None
        self.rules, self.foreach = rules, foreach

    def prepare(self) -> None:
        """``Trainer._prepare_for_training`` (deepspeed_init, accelerator.prepare, create_scheduler), as train() calls it."""
        t = self.trainer
        t.optimizer, t.lr_scheduler, t._created_lr_scheduler = None, None, False
        self.engine, _ = t._prepare_for_training(max(t.args.max_steps, 1), None, None)
        if self.foreach:
            pin_foreach(inner_optimizer(self.engine))

    @property
    def optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The torch optimizer inside DeepSpeed's ZeRO optimizer (over its flat fp32 partitions)."""
        return inner_optimizer(self.engine) if self.started else None

    def _start(self, forward: Optional[Callable[..., object]] = None) -> None:
        if self.engine is None:
            self.prepare()
        self.ddp = self.engine  # what the micro-steps call (trainer.model_wrapped)
        self.tr_loss = torch.tensor(0.0, device=self.trainer.args.device)  # _inner_training_loop 1645
        self.started = True

    def _run(self, forward: Callable[..., object], inputs: object, loss_fn: Optional[LossFn],
             on_phase: Callable[[str], None], mark: Mark, fake: bool,
             rules: Callable[[], ContextManager[object]]) -> tuple[object, torch.Tensor]:
        if self.engine is None:
            self.prepare()
        now = [""]

        def phase(name: str) -> None:  # (the optimizer phase begins in engine.step, not again after backward)
            if name != now[0]:
                now[0] = name
                on_phase(name)

        with _stepping(self.engine, phase, mark):
            return super()._run(forward, inputs, loss_fn, phase, mark, fake, self.rules or rules)

    def _optimizer_step(self, mark: Mark) -> None:
        """What ``_run_epoch`` runs after the boundary's backward (1937-1954), over the engine (``model`` there):
        the engine's norm read, accelerate's no-op optimizer step, the scheduler, the engine's ``zero_grad``."""
        t, engine = self.trainer, self.engine
        assert engine is not None  # (prepared in _run, before the first micro-step)
        grad_norm = t._clip_grad_norm(engine) if t.args.max_grad_norm > 0 else None
        t._get_grad_norm(engine, grad_norm=grad_norm)
        t.optimizer.step()
        if not t.accelerator.optimizer_step_was_skipped and \
                not isinstance(t.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            t.lr_scheduler.step()
        engine.zero_grad()


def inner_optimizer(engine: DeepSpeedEngine) -> torch.optim.Optimizer:
    """The torch optimizer DeepSpeed's ZeRO optimizer steps (``engine.optimizer.optimizer``), else the engine's."""
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


@contextlib.contextmanager
def _stepping(engine: DeepSpeedEngine, on_phase: Callable[[str], None], mark: Mark) -> Iterator[None]:
    """``engine.step`` on the accumulation boundary: the gradients DeepSpeed holds marked, the optimizer phase
    begun; the optimizer's states marked after (graphmem/deepspeed/capture.py names them the same way)."""
    from graphmem.deepspeed.capture import kind_of
    from graphmem.deepspeed.engine import held_tensors

    step = engine.step

    def stepped(*args: object, **kwargs: object) -> object:
        boundary = engine.is_gradient_accumulation_boundary()
        if boundary:
            mark("gradient", [(p, t) for p, t in held_tensors(engine) if kind_of(p) == "gradient"])
            on_phase("optimizer")
        out = step(*args, **kwargs)
        if boundary:
            states = inner_optimizer(engine).state
            mark("optimizer state", [(f"{i}:{k}", v) for i, s in enumerate(states.values()) for k, v in s.items()
                                     if isinstance(v, torch.Tensor)])
        return out

    engine.step = stepped
    try:
        yield
    finally:
        del engine.step


__all__ = ["DeepSpeedRunner", "TrainerDeepSpeed", "bf16_by_deepspeed", "build_ds_trainer", "deepspeed_of", "deepspeed_rank",
           "inner_optimizer"]
