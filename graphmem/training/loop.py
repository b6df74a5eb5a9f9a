"""The whole training step: micro-batches, then the optimizer step, then ``zero_grad``.

One definition shared by the fake capture (graphmem/capture/capture.py) and the real measurement
(graphmem/validation/measure.py), like graphmem/training/step.py for forward/loss/backward, so predicted and
measured numbers describe the same loop::

    for i in range(micro_batches):                 # each runs the given input shape
        out = model(*args, **kwargs); loss = loss_fn(out, inputs) / micro_batches; loss.backward()
    optimizer.step(); optimizer.zero_grad(set_to_none=True)

As in a plain Python loop, the previous micro-step's ``out`` and ``loss`` stay referenced
until reassigned, and the last ones until the step ends. Gradients accumulate in ``.grad``
across micro-steps (AccumulateGrad adds in place). With ``master_weights`` (the mixed
precision recipe of ZeRO, Rajbhandari et al. 2020, section 3: 16-bit parameters and
gradients, an fp32 master copy of the parameters, fp32 optimizer states) the optimizer runs
on the fp32 masters: each master's ``.grad`` is an fp32 copy of the 16-bit gradient, made
during the step; after it the masters are copied back into the 16-bit parameters and both
sets of gradients are released. (Loss scaling changes scalars only and is left out.)

The loop options of real trainers (graphmem/training/loop_options.py) change this loop where those
trainers change it: ``release_output`` drops ``out`` before backward, ``clip_grad_norm`` runs
``clip_grad_norm_`` before ``optimizer.step()``, ``optimizer_in_backward`` steps per-parameter
optimizers from post-accumulate-grad hooks instead, ``offload_activations`` moves the forward's
saves to host memory through saved-tensor hooks.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ContextManager, Optional, Protocol

import torch

from graphmem.errors import UsageError
from graphmem.training.loop_options import PLAIN, InBackward, Observe, Offload, check_loop_options, clip
from graphmem.training.loop_options import describe as describe_loop_options
from graphmem.training.optim import (
    OPTIMIZERS,
    ScalarReads,
    check_optimizer,
    describe_impl,
    held_tensors,
    make_optimizer,
    state_tensors,
)
from graphmem.training.step import LossFn, default_loss, run_step

if TYPE_CHECKING:
    from transformers import TrainingArguments

Mark = Callable[[str, list[tuple[str, torch.Tensor]]], None]  # (kind, [(name, tensor)])


class OnDevice(Protocol):
    """What a trainer's step runner reads of the target it runs for (graphmem/capture/target.py ``Target``)."""

    @property
    def device(self) -> str: ...


class LoopRunner(Protocol):
    """A trainer's own step in ``Session.run``'s signature (graphmem/training/hf_trainer.py ``TrainerRunner``)."""

    def run(self, forward: Callable[..., object], inputs: object, loss_fn: Optional[LossFn],
            on_phase: Callable[[str], None], forward_context: Callable[[], ContextManager[object]],
            mark: Mark = ..., fake: bool = ...) -> tuple[object, torch.Tensor]: ...


class PlannedTrainer(Protocol):
    """What graphmem/training/hf_trainer.py's ``trainer_step`` reads of a transformers Trainer: a built one, or
    (a Trainer built per rank) its arguments alone."""

    @property
    def args(self) -> TrainingArguments: ...

    @property
    def optimizer(self) -> Optional[torch.optim.Optimizer]: ...


@dataclass(frozen=True)
class TrainStep:
    optimizer: Optional[str] = None  # sgd | momentum | adam | adamw | adafactor | adam8bit | adamw8bit | paged_adamw8bit
    impl: str = "auto"  # auto | foreach | forloop | fused
    master_weights: bool = False  # fp32 master copy of 16-bit parameters (the 16-psi recipe)
    micro_batches: int = 1  # gradient accumulation steps
    trace_micro_steps: int = 2  # micro-steps the fake capture runs: 3..k repeat step 2 exactly
    release_output: bool = False  # drop the model's output before backward, keep only the loss (HF Trainer, torchtune)
    clip_grad_norm: Optional[float] = None  # clip_grad_norm_(params, this) before the optimizer step; None: no clipping
    clip_foreach: bool = True  # clip_grad_norm_(foreach=...): one _foreach_norm over all gradients, or one norm each
    optimizer_in_backward: bool = False  # per-parameter optimizers stepped from post-accumulate-grad hooks
    offload_activations: bool = False  # forward's saved tensors to host memory and back (save_on_cpu's hooks)

    @property
    def active(self) -> bool:
        return self.optimizer is not None or self.micro_batches > 1 or self.release_output or self.offload_activations

    @property
    def external(self) -> Optional[str]:
        """The loop's owner when it is not graphmem's own (a trainer's step: its plans and formulas are not
        captured again by graphmem's loop), as the report's loss line names it; None for graphmem's loop."""
        return None

    def runner(self, target: Optional[OnDevice] = None) -> ContextManager[Optional[LoopRunner]]:
        """The step runner that replaces graphmem's loop (a trainer's own step: graphmem/training/hf_trainer.py's
        TrainerStep), entered around a capture; None: graphmem's loop (``Session``) runs."""
        return contextlib.nullcontext(None)

    @property
    def loop_options(self) -> tuple[str, ...]:
        """The loop options set, as analyze's keywords name them (graphmem/training/loop_options.py)."""
        return tuple(name for name, on in (("release_output", self.release_output),
                                           ("clip_grad_norm", self.clip_grad_norm is not None),
                                           ("optimizer_in_backward", self.optimizer_in_backward),
                                           ("offload_activations", self.offload_activations)) if on)

    def describe(self, device: str = "cpu") -> str:
        parts = []
        if self.optimizer:
            parts.append(f"{self.optimizer} ({describe_impl(self.optimizer, self.impl, device)})")
        if self.master_weights:
            parts.append("fp32 master weights")
        if self.micro_batches > 1:
            parts.append(f"{self.micro_batches} micro-batches")
        parts += describe_loop_options(self.release_output, self.clip_grad_norm, self.clip_foreach,
                                       self.optimizer_in_backward, self.offload_activations)
        return ", ".join(parts)

    def to_dict(self, device: str = "cpu") -> dict[str, object]:
        return {"optimizer": self.optimizer, "impl": describe_impl(self.optimizer, self.impl, device) if self.optimizer else None,
                "master_weights": self.master_weights, "micro_batches": self.micro_batches,
                "release_output": self.release_output, "clip_grad_norm": self.clip_grad_norm,
                "clip_foreach": self.clip_foreach if self.clip_grad_norm is not None else None,
                "optimizer_in_backward": self.optimizer_in_backward, "offload_activations": self.offload_activations}


def make_train_step(optimizer: Optional[str] = None, impl: str = "auto", master_weights: bool = False,
                    micro_batches: int = 1, dtype: Optional[str] = None, release_output: bool = False,
                    clip_grad_norm: Optional[float] = None, clip_foreach: bool = True,
                    optimizer_in_backward: bool = False, offload_activations: bool = False) -> TrainStep:
    """Check the options against each other and name the fix when they do not fit."""
    check_optimizer(optimizer, impl)
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise UsageError(f"micro-batches must be a positive integer, got {micro_batches!r}")
    if master_weights and optimizer is None:
        raise UsageError("`master_weights` keeps an fp32 copy for the optimizer: add `optimizer='adam'` (or another)")
    if master_weights and dtype not in ("bf16", "fp16"):
        raise UsageError("`master_weights` needs 16-bit parameters: add `dtype='bf16'` or `dtype='fp16'` "
                         "(with `amp` the parameters are already fp32)")
    check_loop_options(optimizer, micro_batches, master_weights, release_output, clip_grad_norm, clip_foreach,
                       optimizer_in_backward, offload_activations)
    return TrainStep(optimizer, impl, master_weights, micro_batches, release_output=release_output,
                     clip_grad_norm=None if clip_grad_norm is None else float(clip_grad_norm),
                     clip_foreach=clip_foreach, optimizer_in_backward=optimizer_in_backward,
                     offload_activations=offload_activations)


class Session:
    """One model's optimizer (and fp32 masters) for ``step``; built before the step runs, so
    the masters exist before it, like the parameters (state is created lazily by the step)."""

    def __init__(self, step: TrainStep, params: dict[str, torch.Tensor], device: str) -> None:
        self.step = step
        self.device = device
        self.params = {n: p for n, p in params.items() if p.requires_grad}
        self.masters: dict[str, torch.Tensor] = {}
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.in_backward: Optional[InBackward] = None
        self.offload = Offload(params) if step.offload_activations else None
        if step.optimizer is None:
            return
        if step.master_weights:
            with torch.no_grad():
                self.masters = {n: p.detach().float().requires_grad_(True) for n, p in self.params.items()}
        targets = list((self.masters or self.params).values())
        if not targets:
            raise UsageError("no parameter requires grad, so the optimizer has nothing to update; "
                             "unfreeze some parameters or drop `optimizer`")
        if step.optimizer_in_backward:
            self.in_backward = InBackward(step.optimizer, step.impl, self.params, device)
        else:
            self.optimizer = make_optimizer(step.optimizer, step.impl, targets, device)

    @property
    def host_bytes(self) -> int:
        """Bytes the offloading hooks moved to host memory so far (0 without offloading)."""
        return self.offload.host_bytes if self.offload is not None else 0

    def held_tensors(self) -> list[torch.Tensor]:
        """What the loop keeps from one step to the next besides the states (as the Trainer's runner says):
        what its optimizers hold from their construction on (bitsandbytes' quantization maps:
        graphmem/training/optim.py held_tensors), per-parameter optimizers included."""
        opts = list(self.in_backward.optimizers.values()) if self.in_backward is not None else \
            [self.optimizer] if self.optimizer is not None else []
        return [t for opt in opts for t in held_tensors(opt)]

    def state_tensors(self) -> list[tuple[torch.Tensor, str, torch.Tensor]]:
        """(parameter, state name, tensor) of every optimizer state, per-parameter optimizers included."""
        if self.in_backward is not None:
            return self.in_backward.states()
        return state_tensors(self.optimizer) if self.optimizer is not None else []

    def run(self, forward: Callable[..., object], inputs: object, loss_fn: Optional[LossFn],
            on_phase: Callable[[str], None], forward_context: Callable[[], ContextManager[object]],
            mark: Mark = lambda kind, named: None, fake: bool = False,
            micro_step: Callable[[int, int], None] = lambda i, runs: None,
            observe: Observe = PLAIN) -> tuple[object, torch.Tensor]:
        """Micro-steps, then the optimizer step. ``mark`` is told which tensors are gradients,
        optimizer states and fp32 gradient copies while they exist; ``fake`` runs only
        ``trace_micro_steps`` micro-steps (see _micro_steps) and answers ``.item()``;
        ``micro_step(i, runs)`` is called before micro-step i of the ``runs`` run (FSDP2's
        gradient sync for the last one only: graphmem/distributed/capture.py); ``observe``: the
        caller's own saved-tensor hooks, told of each save when offloading replaces them."""
        k = self.step.micro_batches
        base = loss_fn or default_loss
        scaled: LossFn = base if k == 1 else (lambda out, inp: base(out, inp) / k)
        runs = min(k, self.step.trace_micro_steps) if fake else k
        out: object = None
        loss: Optional[torch.Tensor] = None
        phase = ["forward"]

        def told(p: str) -> None:
            phase[0] = p
            on_phase(p)

        with contextlib.ExitStack() as stack:
            if self.in_backward is not None:
                stack.enter_context(self.in_backward.hooks(mark, fake))
            if self.offload is not None:
                stack.enter_context(self.offload.hooks(phase, self.device, mark, fake, observe))
            for i in range(runs):
                micro_step(i, runs)
                out, loss = run_step(forward, inputs, scaled, told, forward_context, self.step.release_output)
        mark("gradient", [(n, p.grad) for n, p in self.params.items() if p.grad is not None])
        self.optimizer_step(on_phase, mark, fake)
        assert loss is not None  # runs >= 1 micro-steps
        return out, loss

    def optimizer_step(self, on_phase: Callable[[str], None], mark: Mark = lambda kind, named: None,
                       fake: bool = False) -> None:
        """The optimizer's step over the gradients the step left (then ``zero_grad``), in phase
        "optimizer", gradients clipped first with ``clip_grad_norm``; nothing without an optimizer
        (or with the optimizer in backward). A pipeline rank calls it after its schedule
        (graphmem/distributed/pipeline.py)."""
        if self.optimizer is None:
            return
        on_phase("optimizer")
        if self.step.clip_grad_norm is not None:  # after the last backward, before the step (HF Trainer, torchtitan)
            clip(list(self.params.values()), self.step.clip_grad_norm, self.step.clip_foreach)
        with ScalarReads() if fake else contextlib.nullcontext():
            self._optimizer_step(mark)

    def _optimizer_step(self, mark: Mark) -> None:
        assert self.optimizer is not None
        names = {id(t): n for n, t in (self.masters or self.params).items()}
        with torch.no_grad():
            if self.masters:
                for n, m in self.masters.items():
                    g = self.params[n].grad
                    m.grad = None if g is None else g.float()  # fp32 copy of the 16-bit gradient
                mark("gradient copy", [(n, m.grad) for n, m in self.masters.items() if m.grad is not None])
            self.optimizer.step()
            mark("optimizer state", [(f"{names.get(id(p), '?')}:{key}", t) for p, key, t in state_tensors(self.optimizer)])
            if self.masters:
                for n, m in self.masters.items():
                    self.params[n].copy_(m)
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.params.values():
            p.grad = None


def relabel_accumulation(ops: list, saves: list, phase_start: dict[str, int]) -> None:
    """Ops and saves of the micro-steps before the last belong to phase "accumulate": the
    forward/loss/backward phases name the last micro-step, whose saved set is the step's
    activations (each micro-step saves the same)."""
    start = phase_start.get("forward", 0)
    if start == 0:
        return
    for node in ops[:start]:
        node.meta["phase"] = "accumulate"
    for e in saves:
        # autograd saves an op's inputs before the op runs, so the last micro-step's first op packs
        # them at ``start - 1``; the earlier micro-steps' packs are all before their backward's ops
        if e.packed_at < start - 1:
            e.phase = "accumulate"
    phase_start["accumulate"] = 0


__all__ = ["LoopRunner", "OnDevice", "PlannedTrainer", "TrainStep", "Session", "make_train_step", "relabel_accumulation", "OPTIMIZERS"]
