"""A transformers ``Trainer``'s own training step, run on fake tensors (the capture) and on real ones
(graphmem/validation/measure.py) by the same runner.

graphmem's own loop (graphmem/training/loop.py) keeps the output referenced through backward and steps a torch.optim
optimizer it builds; a ``Trainer`` does neither: ``compute_loss`` returns only the loss (the logits die before
backward), the optimizer comes from ``args.optim``, gradients are clipped through accelerate, and the scheduler steps.
So the step is the Trainer's own code, called as ``Trainer._inner_training_loop`` / ``_run_epoch`` call it
(transformers 5.x ``transformers/trainer.py``; the line numbers below are 5.24's)::

    optimizer (create_optimizer), accelerator.prepare (model, optimizer), create_scheduler   # _prepare_for_training, 1741-1778
    batch_samples, num_items_in_batch = self.get_batch_samples(epoch_iterator, k, device)   # 1881
    for i, inputs in enumerate(batch_samples):                                              # 1892-1935
        with sync_context(): tr_loss_step = self.training_step(model, inputs, num_items_in_batch)
        nan/inf filter; self._tr_loss += tr_loss_step
    grad_norm = self._clip_grad_norm(model) if max_grad_norm > 0; self._get_grad_norm(model, grad_norm)  # 1937-1940
    self.optimizer.step(); self.lr_scheduler.step(); model.zero_grad()                      # 1943-1954

Phases are marked by wrapping ``trainer.compute_loss`` (forward, then loss once it returns) and
``trainer.accelerator.backward`` (backward), not by copies of them. Precision is accelerate's:
``accelerator.prepare_model`` wraps the model's forward in autocast when ``bf16``/``fp16`` ask for it (undone after
the runner's session). Gradient checkpointing is enabled as ``Trainer.train`` does (1502-1528) and disabled afterwards
if the step turned it on. On the CUDA target the step's device bindings go through the target
(graphmem/training/hf_trainer_cuda.py).

``torch_compile=True``: ``Trainer.create_accelerator_and_postprocess`` (806-864, ``_build_accelerator_args`` 791-802)
gives accelerate a ``TorchDynamoPlugin(backend=args.torch_compile_backend, mode=args.torch_compile_mode)``, and
``accelerator.prepare`` ends ``prepare_model`` with ``torch.compile(model, **dynamo_plugin.to_kwargs())`` (accelerate
1.15 ``accelerator.py`` 2068-2073, after the autocast wrapper). The real runs here step the module ``prepare_model``
returns; the capture steps a stand-in (``CompiledModel``) whose calls go to graphmem's compiled capture of the same
model (graphmem/capture/compiled.py), with the partition of the backend asked for (``inductor``:
graphmem/capture/inductor_partition.py).

Known limitations: a DDP, FSDP2 or DeepSpeed job one rank at a time; ``torch_compile`` with ``COMPILE_BACKENDS``,
default mode, CPU target only; callbacks and ``include_num_input_tokens_seen`` are not run; ``optimizers=``' scheduler
is ``args.lr_scheduler_type``'s; within an epoch the real loop keeps the previous step's gradient norm and last loss
(4 B each) into the next."""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Optional, Union

import torch
import torch.nn as nn

from graphmem.errors import UsageError
from graphmem.training.batch import as_batch
from graphmem.training.hf_trainer_cuda import cuda_step, foreach_as_real, mark_states, on_fake_cpu, pin_foreach
from graphmem.training.hf_trainer_ddp import ranks, wrap_ddp
from graphmem.training.loop import Mark, OnDevice, PlannedTrainer, TrainStep
from graphmem.training.optim import ScalarReads, state_tensors
from graphmem.training.step import LossFn

if TYPE_CHECKING:
    from transformers import Trainer


def is_trainer(obj: object) -> bool:
    """A ``transformers.Trainer`` (or a subclass: SFTTrainer, Seq2SeqTrainer), without importing transformers."""
    return any(c.__module__.startswith("transformers.") and c.__name__ == "Trainer" for c in type(obj).__mro__)


@dataclass(frozen=True)
class TrainerStep(TrainStep):
    """The Trainer's loop as the report's budget names it (``describe``, ``to_dict``)."""

    max_grad_norm: float = 0.0
    precision: str = "fp32"  # fp32 | bf16 autocast | fp16 autocast
    checkpointing: bool = False
    scheduler: str = ""
    compiled: str = ""  # the torch_compile_backend when args.torch_compile
    world_size: int = 1  # > 1: rank ``rank`` of a DDP job (graphmem/training/hf_trainer_ddp.py)
    rank: int = 0
    fsdp: bool = False  # the job is accelerate's FSDP2 (graphmem/training/hf_trainer_fsdp.py), not DDP
    deepspeed: str = ""  # the job is accelerate's DeepSpeed, so named (graphmem/deepspeed/trainer.py)
    # the transformers.Trainer whose step this is (a live object: not in the report's JSON)
    trainer: Optional[PlannedTrainer] = field(default=None, compare=False, repr=False, metadata={"json": False})

    @property
    def external(self) -> Optional[str]:
        return "the Trainer's compute_loss"

    def runner(self, target: Optional[OnDevice] = None) -> ContextManager[TrainerRunner]:
        """The Trainer's own step (``TrainerRunner``) on ``target``'s device, the trainer restored after."""
        device = getattr(target, "device", "cpu")
        return TrainerRunner(self.trainer, world_size=self.world_size, rank=self.rank, device=device).session()

    def describe(self, device: str = "cpu") -> str:
        parts = [f"transformers Trainer's loop: optim {self.optimizer}",
                 f"clip_grad_norm {self.max_grad_norm:g}" if self.max_grad_norm > 0 else "grad norm not clipped",
                 f"{self.micro_batches} gradient accumulation steps" if self.micro_batches > 1 else "no accumulation",
                 self.precision]
        if self.checkpointing:
            parts.append("gradient checkpointing")
        if self.scheduler:
            parts.append(f"{self.scheduler} lr scheduler")
        if self.compiled:
            parts.append(f"torch.compile ({self.compiled})")
        if self.world_size > 1 or self.deepspeed:
            wrapper = self.deepspeed or ("FSDP2 (accelerate)" if self.fsdp else "DistributedDataParallel")
            parts.append(f"{wrapper}, rank {self.rank} of {self.world_size}")
        return ", ".join(parts)

    def to_dict(self, device: str = "cpu") -> dict[str, object]:
        job = {"world_size": self.world_size, "rank": self.rank}
        return {"loop": "transformers.Trainer", "optimizer": self.optimizer, "impl": None, "master_weights": False,
                "micro_batches": self.micro_batches, "max_grad_norm": self.max_grad_norm, "precision": self.precision,
                "gradient_checkpointing": self.checkpointing, "lr_scheduler": self.scheduler, "torch_compile":
                self.compiled or None, "ddp": job if self.world_size > 1 and not (self.fsdp or self.deepspeed) else None,
                "fsdp2": job if self.fsdp else None, **({"deepspeed": {"engine": self.deepspeed, **job}} if self.deepspeed else {})}


def trainer_step(trainer: PlannedTrainer, world_size: int = 1, rank: int = 0) -> TrainerStep:
    """What ``trainer.args`` asks of the loop; ``world_size`` > 1: as rank ``rank`` of a DDP job."""
    args = trainer.args
    precision = "bf16 autocast" if args.bf16 else "fp16 autocast" if args.fp16 else "fp32"
    optim = getattr(args.optim, "value", args.optim)
    if trainer.optimizer is not None:
        optim = f"{type(_inner(trainer.optimizer)).__name__} (given)"
    scheduler = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    return TrainerStep(str(optim), micro_batches=args.gradient_accumulation_steps, max_grad_norm=float(args.max_grad_norm),
                       precision=precision, checkpointing=bool(args.activation_checkpointing), scheduler=str(scheduler),
                       compiled=str(args.torch_compile_backend) if args.torch_compile else "", world_size=world_size,
                       rank=rank, trainer=trainer)


# torch_compile_backend values whose partition graphmem's compiled capture makes (graphmem/capture/compiled.py)
COMPILE_BACKENDS = ("inductor", "aot_eager")


def check_trainer(trainer: Trainer, launched: bool = False) -> None:
    """Refuse, in one line naming the fix, what the runner does not run (``launched``: a rank of a real
    multi-process job, graphmem/validation/trainer_ranks.py, where the Trainer sees its world size)."""
    if trainer.model is None:
        raise UsageError("the Trainer has no model: pass model= (or model_init=) to transformers.Trainer before analyze")
    args = trainer.args
    if args.torch_compile and args.torch_compile_backend not in COMPILE_BACKENDS:
        raise UsageError(f"torch_compile_backend={args.torch_compile_backend!r}: graphmem predicts the partition of "
                         f"{' or '.join(COMPILE_BACKENDS)}; set `torch_compile_backend` to one of them")
    if args.torch_compile and args.torch_compile_mode not in (None, "default"):
        raise UsageError(f"torch_compile_mode={args.torch_compile_mode!r}: graphmem runs the default mode's compile; "
                         "leave `torch_compile_mode` unset")
    if args.device.type not in ("cpu", "cuda"):
        raise UsageError(f"the Trainer runs on {args.device.type}; graphmem runs a Trainer's step on the CPU or CUDA "
                         "target: set use_cpu=True in its TrainingArguments, or analyze it with `device='cuda'`")
    if (trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled or trainer.args.world_size > 1) and not launched:
        raise UsageError("the Trainer is set up for several processes (DeepSpeed, FSDP or DDP): pass `world_size`/"
                         "`rank` for one rank's step, or analyze the model with `fsdp`/`zero`/`rank` for per-rank memory")


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    """accelerate's AcceleratedOptimizer wraps the torch optimizer as ``.optimizer``."""
    while type(optimizer).__name__ == "AcceleratedOptimizer":
        optimizer = optimizer.optimizer
    return optimizer


class TrainerRunner:
    """The Trainer's step with graphmem/training/loop.py Session's ``run`` signature (the capture's
    and the measurement's step runner). The optimizer is made on the first run, over the parameters
    the model holds then (the fake ones in the capture), and kept for later runs (warm steps)."""

    masters: dict[str, torch.Tensor] = {}  # no fp32 master copies (accelerate's autocast keeps none)

    def __init__(self, trainer: Any, trace_micro_steps: int = 2, world_size: int = 1, rank: int = 0,
                 launched: Any = None, device: str = "cpu") -> None:
        check_trainer(trainer, launched=launched is not None)
        self.cuda = device == "cuda"  # the CUDA target (graphmem/training/hf_trainer_cuda.py)
        self.deferred = contextlib.ExitStack()  # the CUDA target's accelerate prepare_model, made in the first run
        self.trainer, self.model = trainer, trainer.model
        self.world_size, self.rank = world_size, rank
        self.launched = launched  # in a real rank: the DistributedDataParallel accelerate's prepare_model made
        self.ddp: Any = None  # DistributedDataParallel around the model, world_size > 1
        self.given = _inner(trainer.optimizer) if trainer.optimizer is not None else None
        self.names = {id(p): n for n, p in self.model.named_parameters()}  # the given optimizer's parameters by name
        self.trace_micro_steps = trace_micro_steps
        self.tr_loss: Optional[torch.Tensor] = None
        self.started = False
        self.compiled: Optional[nn.Module] = None  # accelerate's torch.compile of the model, in a session

    def restart(self) -> None:
        """The next run is a first step again: a new optimizer (no states yet) and ``_tr_loss``."""
        self.started, self.tr_loss, self.ddp = False, None, None

    @property
    def optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The torch optimizer the step runs (inside accelerate's wrapper), once made."""
        return _inner(self.trainer.optimizer) if self.started else None

    host_bytes = 0  # no activation offloading in the Trainer's loop

    def state_tensors(self) -> list[tuple[torch.Tensor, str, torch.Tensor]]:
        """(parameter, state name, tensor) of every optimizer state, as graphmem's Session gives them."""
        return state_tensors(self.optimizer) if self.optimizer is not None else []

    def held_tensors(self) -> list[torch.Tensor]:
        """What the loop keeps from one step to the next besides the optimizer: ``_tr_loss``."""
        return [self.tr_loss] if self.tr_loss is not None else []

    @contextlib.contextmanager
    def session(self) -> Iterator["TrainerRunner"]:
        """The trainer as it was (optimizer, scheduler, accelerate's lists, gradient checkpointing) after the runs."""
        t, acc = self.trainer, self.trainer.accelerator
        kept = (t.optimizer, t.lr_scheduler, t._created_lr_scheduler, list(acc._optimizers), list(acc._schedulers),
                list(acc._models))
        enabled = _enable_checkpointing(t)
        try:
            # (a real rank's model was prepared by accelerate already: ``launched``, DDP or torch.compile over it)
            with ranks(t, self.world_size, self.rank), on_fake_cpu(t) if self.cuda else contextlib.nullcontext(), self.deferred, \
                    _prepared(t, self.model) if self.launched is None and not self.cuda else contextlib.nullcontext(self.launched) as prepared:
                self.compiled = prepared if t.args.torch_compile else None
                yield self
        finally:
            self.compiled = None
            t.optimizer, t.lr_scheduler, t._created_lr_scheduler = kept[0], kept[1], kept[2]
            acc._optimizers[:], acc._schedulers[:], acc._models[:] = kept[3], kept[4], kept[5]
            if enabled:
                self.model.activation_checkpointing_disable()
            self.started, self.ddp = False, None

    def _start(self, forward: Optional[Callable[..., object]] = None) -> None:
        """Trainer._prepare_for_training (1741-1778): create_optimizer, accelerator.prepare, create_scheduler;
        ``forward``: the capture's compiled call, which DDP wraps as accelerate compiles over DDP."""
        t = self.trainer
        t.optimizer, t.lr_scheduler, t._created_lr_scheduler = None, None, False
        if self.given is not None:  # optimizers=(opt, ...): the same class and groups over the step's parameters
            current = dict(self.model.named_parameters())
            groups = [{**{k: v for k, v in g.items() if k != "params"},
                       "params": [current[self.names[id(p)]] for p in g["params"]]} for g in self.given.param_groups]
            t.optimizer = type(self.given)(groups, **self.given.defaults)
        else:
            t.create_optimizer()
        if self.cuda:  # the implementation torch.optim picks for CUDA tensors
            pin_foreach(t.optimizer)
        t.optimizer = t.accelerator.prepare_optimizer(t.optimizer)
        if self.launched is not None:  # a real rank: accelerate wrapped the model before the step
            self.ddp = self.launched
        elif self.world_size > 1:  # accelerate's prepare_model on N processes (graphmem/training/hf_trainer_ddp.py)
            self.ddp = wrap_ddp(t, self.model) if forward is None else wrap_ddp(t, CompiledModel(self.model, forward), compiled=True)
        t.create_scheduler(num_training_steps=max(t.args.max_steps, 1), optimizer=t.optimizer)
        self.tr_loss = torch.tensor(0.0, device=t.args.device)  # _inner_training_loop 1645
        self.started = True

    def run(self, forward: Callable[..., object], inputs: object, loss_fn: Optional[LossFn],
            on_phase: Callable[[str], None], forward_context: Callable[[], ContextManager[object]],
            mark: Mark = lambda kind, named: None, fake: bool = False,
            micro_step: Callable[[int, int], None] = lambda i, runs: None) -> tuple[object, torch.Tensor]:
        """One optimizer step of the Trainer (the module docstring). The Trainer calls its model itself,
        under accelerate's autocast (``forward_context`` is not used); with ``torch_compile`` it calls
        ``forward`` (the capture's, wrapped as ``CompiledModel``) where ``fake``, else the module
        accelerate compiled. ``loss_fn`` (the capture's) is handed each micro-step's loss to label its
        autograd nodes; ``fake`` runs ``trace_micro_steps`` micro-steps (3..k repeat 2) and answers
        ``.item()``. A step cut short (the compiled trace stops at backward) leaves no optimizer behind."""
        try:
            prepare = None if self.started else functools.partial(_prepared, self.trainer, self.model)
            with foreach_as_real(fake), cuda_step(forward_context, self.deferred, prepare) if self.cuda \
                    else contextlib.nullcontext(contextlib.nullcontext) as rules:
                return self._run(forward, inputs, loss_fn, on_phase, mark, fake, rules)
        except BaseException:
            self.restart()
            raise

    def _run(self, forward: Callable[..., object], inputs: object, loss_fn: Optional[LossFn],
             on_phase: Callable[[str], None], mark: Mark, fake: bool,
             rules: Callable[[], ContextManager[object]]) -> tuple[object, torch.Tensor]:
        t, model, k = self.trainer, self.model, self.trainer.args.gradient_accumulation_steps
        with _phases(t, on_phase, loss_fn, rules):
            compiled_ddp = fake and t.args.torch_compile and self.world_size > 1  # graphmem/training/hf_trainer_ddp.py
            if not self.started:  # (bitsandbytes' optimizers read their quantization maps' values: any will do)
                with ScalarReads() if fake else contextlib.nullcontext():
                    self._start(forward if compiled_ddp else None)
            if compiled_ddp:  # this run's compiled call (the trace's, then the replay's) inside DDP
                self.ddp.module.compiled_forward = forward
            stepped = self.ddp if self.ddp is not None else model if not t.args.torch_compile \
                else CompiledModel(model, forward) if fake and not t.is_fsdp_enabled else self.compiled  # (FSDP2: compiled in prepare)
            assert stepped is not None, "a compiled Trainer's real step runs inside the runner's session"
            batch = dict(as_batch(inputs).kwargs)
            # the k micro-batches are prefetched (1881): each one its own tensors, as the dataloader yields them
            batches = [batch] + [{n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in batch.items()}
                                 for _ in range(k - 1)]
            samples, num_items = t.get_batch_samples(iter(batches), k, t.args.device)
            t.current_gradient_accumulation_steps = len(samples)
            loss = self._micro_steps(stepped, samples, num_items, min(k, self.trace_micro_steps) if fake else k, fake)
            mark("gradient", [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None])
            on_phase("optimizer")
            with ScalarReads() if fake else contextlib.nullcontext():
                self._optimizer_step(mark)
        return None, loss

    def _micro_steps(self, model: nn.Module, samples: list, num_items: Union[torch.Tensor, int, None], runs: int, fake: bool) -> torch.Tensor:
        """_run_epoch's inner loop (1892-1935) over ``model`` (compiled with ``torch_compile``; DeepSpeed: no no_sync, 1904)."""
        t = self.trainer
        assert self.tr_loss is not None
        tr_loss_step: Any = None
        for i, inputs in enumerate(samples[:runs]):
            last = i == len(samples) - 1 or i == runs - 1
            t.accelerator.gradient_state._set_sync_gradients(last)
            sync: Callable[[], ContextManager[object]] = contextlib.nullcontext if last or t.is_deepspeed_enabled else self.ddp.no_sync if self.ddp is not None \
                else functools.partial(t.accelerator.no_sync, model=model)  # (accelerate's no_sync is DDP's on N processes)
            with sync():
                tr_loss_step = t.training_step(model, inputs, num_items)
            with ScalarReads() if fake else contextlib.nullcontext():
                bad = t.args.logging_nan_inf_filter and bool(torch.isnan(tr_loss_step) or torch.isinf(tr_loss_step))
            if not bad:
                self.tr_loss += tr_loss_step
        return tr_loss_step

    def _optimizer_step(self, mark: Mark) -> None:
        """Clipping, the optimizer and scheduler steps, ``model.zero_grad()`` (1937-1954)."""
        t, model = self.trainer, self.model
        grad_norm = t._clip_grad_norm(model) if t.args.max_grad_norm > 0 else None
        _norm = t._get_grad_norm(model, grad_norm=grad_norm)  # a 0-dim tensor, held to the step's end (1937-1958)
        t.optimizer.step()
        mark_states(mark, model, _inner(t.optimizer), self.cuda)
        if not t.accelerator.optimizer_step_was_skipped and \
                not isinstance(t.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            t.lr_scheduler.step()
        model.zero_grad()


def _enable_checkpointing(trainer: Any) -> bool:
    """Trainer.train's activation checkpointing (1502-1528) when the model does not have it yet."""
    args, model = trainer.args, trainer.model
    if not args.activation_checkpointing or getattr(model, "is_activation_checkpointing", True):
        return False
    kwargs = dict(args.activation_checkpointing_kwargs or {})
    every_n_layers = kwargs.pop("every_n_layers", 1)
    offload = kwargs.pop("offload", False)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None,
                                          every_n_layers=every_n_layers, offload=offload)
    return True


class CompiledModel(nn.Module):
    """What the capture's Trainer steps in place of accelerate's ``torch.compile(model)`` (an
    ``OptimizedModule``): calls go to ``forward`` (graphmem's compiled trace or replay of the model);
    parameters, ``train()`` and ``zero_grad()`` are the model's, held as ``_orig_mod`` as the
    ``OptimizedModule`` holds it."""

    def __init__(self, model: nn.Module, forward: Callable[..., object]) -> None:
        super().__init__()
        self._orig_mod = model
        self.compiled_forward = forward

    def forward(self, *args: object, **kwargs: object) -> object:
        return self.compiled_forward(*args, **kwargs)


@contextlib.contextmanager
def _prepared(trainer: Trainer, model: nn.Module) -> Iterator[nn.Module]:
    """accelerate's ``prepare_model`` (autocast around forward, outputs back to fp32 under bf16/fp16; last, ``torch.compile``
    under ``torch_compile``), yielding the module it returns, undone afterwards so the user's model is left as it was."""
    acc = trainer.accelerator
    # FSDP2: ``_prepare_fsdp2`` never calls prepare_model (no autocast; its MixedPrecisionPolicy casts)
    if not (acc.native_amp or trainer.args.torch_compile) or hasattr(model, "_original_forward") or trainer.is_fsdp_enabled:
        yield model
        return
    before = dict(model.__dict__)
    prepared = acc.prepare_model(model, device_placement=False)
    try:
        yield prepared
    finally:  # forward, _original_forward, _is_accelerate_prepared back as they were
        for key in set(model.__dict__) - set(before):
            del model.__dict__[key]
        model.__dict__.update({k: v for k, v in before.items() if k in ("forward",)})


@contextlib.contextmanager
def _phases(trainer: Any, on_phase: Callable[[str], None], loss_fn: Optional[LossFn],
            rules: Callable[[], ContextManager[object]] = contextlib.nullcontext) -> Iterator[None]:
    """Phase marks around the Trainer's ``compute_loss`` (in ``rules()``) and accelerate's ``backward``."""
    compute_loss, backward = trainer.compute_loss, trainer.accelerator.backward

    def marked_loss(*args: object, **kwargs: object) -> object:
        on_phase("forward")
        with rules():
            out = compute_loss(*args, **kwargs)
        on_phase("loss")
        if loss_fn is not None:
            loss_fn(out[0] if isinstance(out, tuple) else out, None)  # the capture labels the loss's nodes
        return out

    def marked_backward(loss: torch.Tensor, **kwargs: object) -> object:
        on_phase("backward")
        return backward(loss, **kwargs)

    own = "compute_loss" in trainer.__dict__
    trainer.compute_loss, trainer.accelerator.backward = marked_loss, marked_backward
    try:
        yield
    finally:
        if own:
            trainer.compute_loss = compute_loss
        else:
            del trainer.compute_loss
        del trainer.accelerator.backward


__all__ = ["COMPILE_BACKENDS", "CompiledModel", "TrainerRunner", "TrainerStep", "check_trainer", "is_trainer", "trainer_step"]
