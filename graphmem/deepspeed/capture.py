"""Rank r's step of a DeepSpeed job through DeepSpeed's own engine, on fake tensors.

Under the fake process group (graphmem/fake_group.py) and the recording fake mode, a fake copy of
the model (graphmem/distributed/fsdp.py ``fake_copy``: the user's module is untouched) is handed to
``deepspeed.initialize(model=..., optimizer=..., config=...)`` with the job's config (its ``"auto"``
values resolved: graphmem/deepspeed/config.py); DeepSpeed's engine flattens, partitions and pads the
parameters as on rank r (its ZeRO optimizer reads the fake group's rank and size). What the engine
holds then is the step's baseline, each tensor named by where DeepSpeed keeps it
(graphmem/deepspeed/engine.py ``held_tensors``). The step is the user's:
``loss = loss_fn(engine(batch)); engine.backward(loss); engine.step()``, ``gradient_accumulation_steps`` times,
recorded as a rank's step (graphmem/distributed/capture.py: the same placeholders, hooks, recording context
and graph). The later steps' peak is the second step's, recorded from the same engine by a recorder of its own
(``capture_engine_steps``): one ``initialize`` for both.

Known limitations: eager mode, the CPU target's gloo rules or the CUDA target's;
DeepSpeed's patches to run on fake tensors are listed in graphmem/deepspeed/engine.py.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from graphmem.capture.autograd_tags import _tag_grad_fns
from graphmem.capture.call_paths import module_order
from graphmem.capture.capture import marker
from graphmem.capture.collector import gc_paused
from graphmem.capture.fakes import fake_batch, forward_context
from graphmem.capture.recorder import _NODE, _Mode, _Recorder
from graphmem.capture.session import Recording
from graphmem.capture.target import Target
from graphmem.deepspeed.config import DeepSpeedJob, resolved
from graphmem.deepspeed.engine import Pins, engine_on_fake, held_tensors, launched, name_host, naming_buckets, staying
from graphmem.deepspeed.views import DEVICE, device_of, fast_view, valueless_view
from graphmem.distributed.capture import rank_placeholders, rank_running
from graphmem.distributed.fsdp import fake_copy
from graphmem.errors import UsageError, one_line
from graphmem.fake_group import fake_group
from graphmem.stepgraph import StepGraph
from graphmem.training.batch import as_batch
from graphmem.training.loop import TrainStep, relabel_accumulation
from graphmem.training.optim import make_optimizer
from graphmem.training.step import LossFn, default_loss

# where DeepSpeed keeps a tensor (an attribute of its ZeRO optimizers: deepspeed/runtime/zero/stage_1_and_2.py
# DeepSpeedZeroOptimizer, stage3.py DeepSpeedZeroOptimizer_Stage3) -> the budget's kind
_KINDS = (("optimizer.state", "optimizer state"), ("fp32", "master"), ("ipg", "communication"),
          ("bucket", "communication"), ("grad", "gradient"), ("bit16", "parameter"), ("fp16", "parameter"),
          ("ds_tensor", "parameter"), ("module.", "parameter"))


class _EngineMode(_Mode):
    """The recording fake mode, asking whether CUDA is available once: ``import deepspeed`` sets
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (deepspeed/__init__.py), after which each ``torch.cuda.is_available()``
    loads NVML again (a ctypes ``dlopen``: torch/cuda/__init__.py ``_raw_device_count_nvml``), and
    FakeTensorMode asks it on each entry and each op its cache misses (``avoid_device_init``): 23,002
    loads, 4-5 % of a Llama-2-7B ZeRO-3 analysis. The answer does not change within a capture. DeepSpeed's
    slices and views, and the device queries C++ makes of fake tensors, are answered without FakeTensorMode's
    per-op machinery where its answer could be nothing else (graphmem/deepspeed/views.py)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No dynamo wrapper around this mode's ``__torch_dispatch__`` (torch/utils/_python_dispatch.py
        ``TorchDispatchMode.__init_subclass__`` wraps it in ``torch._disable_dynamo``, which saves and restores
        the frame evaluator on every call, ~1.5 µs, 5 calls a slice): a DeepSpeed step is captured eagerly,
        with no frame dynamo evaluates."""
        return False

    def __init__(self, rec: _Recorder) -> None:
        super().__init__(rec)
        self._avoid = bool(_Mode.avoid_device_init.fget(self))  # type: ignore[attr-defined]

    @property
    def avoid_device_init(self) -> bool:
        return self._avoid

    def dispatch(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """DeepSpeed's slices and views of a fake tensor by the meta kernel (graphmem/deepspeed/views.py), the
        rest as FakeTensorMode dispatches it."""
        out = fast_view(self, func, args, kwargs)
        return out if out is not None else super().dispatch(func, types, args, kwargs)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """The recorder's dispatch (``_Mode.__torch_dispatch__``), but a fake tensor's device answered as FakeTensorMode
        answers it and a view of a tensor without values recorded without the values' propagation, which has
        nothing to do there (graphmem/deepspeed/views.py ``device_of``, ``valueless_view``)."""
        if func is DEVICE:
            device = device_of(args)
            if device is not None:
                return device
        if valueless_view(func, args, kwargs):
            rec = self.rec
            if rec.recording and not rec.depth and not rec.real_bookkeeping:  # (``_Mode._dispatch``'s checks: no
                return rec.record(self._view, func, args, kwargs)  # view has a kernel rule or a wrapper subclass)
            return self._dispatch(func, types, args, kwargs)
        return _RECORDERS_DISPATCH(self, func, types, args, kwargs)

    def _view(self, func: Any, args: Any, kwargs: Any) -> Any:
        """A view recorded: the meta kernel's answer (``fast_view``), else FakeTensorMode's own dispatch."""
        out = fast_view(self, func, args, kwargs)
        return out if out is not None else _FAKE_DISPATCH(self, func, (FakeTensor,), args, kwargs)


# (the recorder's own, unwrapped: torch wraps each mode's ``__torch_dispatch__`` to keep dynamo out,
# torch/utils/_python_dispatch.py ``TorchDispatchMode.__init_subclass__``; ``_EngineMode``'s is not)
_FAKE_DISPATCH = FakeTensorMode.__torch_dispatch__
_RECORDERS_DISPATCH = getattr(_Mode.__dict__["__torch_dispatch__"], "__wrapped__", _Mode.__dict__["__torch_dispatch__"])


def kind_of(path: str) -> str:
    """The kind of a held tensor by the path DeepSpeed keeps it at (``_KINDS``), else "buffer"."""
    return next((kind for key, kind in _KINDS if key in path), "buffer")


def capture_engine(module: nn.Module, inputs: Any, loss_fn: Optional[LossFn], target: Target, job: DeepSpeedJob,
                   train: TrainStep, warm: bool = False) -> StepGraph:
    """Record rank ``job.rank``'s first step of ``module`` under DeepSpeed's engine (the module docstring),
    or with ``warm`` its second: the first then runs unrecorded (``_warm_step``), and what the engine holds
    after it is the second's baseline. (``capture_engine_steps`` records both from one engine.)"""
    return _engine_steps(module, inputs, loss_fn, target, job, train, (False, True) if warm else (True,))[0]


def capture_engine_steps(module: nn.Module, inputs: Any, loss_fn: Optional[LossFn], target: Target,
                         job: DeepSpeedJob, train: TrainStep) -> tuple[StepGraph, StepGraph]:
    """The first step and the second, recorded one after the other from one engine: the second's recorder
    starts from what the engine holds after the first, as ``capture_engine(warm=True)`` starts from what it
    holds after an unrecorded first step (tests/distributed/test_deepspeed.py checks the two equal, op for op; the ops
    DeepSpeed's gradient hooks run on the AccumulateGrad nodes it keeps are named by the module, as in the first
    step, where an unrecorded first step left them the root's ""), for one ``deepspeed.initialize`` and two
    steps instead of two and three."""
    first, later = _engine_steps(module, inputs, loss_fn, target, job, train, (True, True))
    return first, later


def _engine_steps(module: nn.Module, inputs: Any, loss_fn: Optional[LossFn], target: Target, job: DeepSpeedJob,
                  train: TrainStep, recorded: tuple[bool, ...]) -> list[StepGraph]:
    """One engine, then a step per entry of ``recorded``: a StepGraph for each True (a recorder of its own),
    the step run unrecorded for each False."""
    graphs: list[StepGraph] = []
    with gc_paused(), launched(job.rank, job.world_size), fake_group(job.rank, job.world_size):
        import deepspeed

        rec = Recording(target)
        fake_mode = rec.mode = _EngineMode(rec.cap)
        pins: Pins = []  # what DeepSpeed pins (graphmem/deepspeed/engine.py)
        with fake_mode, engine_on_fake(fake_mode, pins):
            wrapped = fake_copy(module, None)  # DeepSpeed casts to bf16/fp16 itself (its config)
            config = resolved(job, module, _micro_batch(inputs))
            # (torch.optim's pick for the target's tensors: the step's TrainStep says "forloop" where DeepSpeed's
            # CPU offload steps host partitions, graphmem/step/measure.py ``_host_stepped``)
            optimizer = make_optimizer(train.optimizer, train.impl, [p for p in wrapped.parameters() if p.requires_grad],
                                       target.device) if train.optimizer is not None else None
            with staying(wrapped):
                engine = _initialized(deepspeed, wrapped, optimizer, config)
        del wrapped, optimizer  # (the engine holds them)
        for record in recorded:
            if not record:
                with fake_mode, engine_on_fake(fake_mode, pins):
                    _warm_step(engine, inputs, loss_fn, target, fake_mode)
                continue
            if graphs:  # a fresh recorder on the same fake mode; the tensors the last one named are unnamed (``_forget``)
                rec = Recording(target)
                rec.mode, fake_mode.rec = fake_mode, rec.cap
                _forget()
            graphs.append(_recorded(rec, engine, inputs, loss_fn, train, pins))
    return graphs


def _recorded(rec: Recording, engine: Any, inputs: Any, loss_fn: Optional[LossFn], train: TrainStep,
              pins: Pins) -> StepGraph:
    """The step recorded from what the engine holds now: its held tensors, each named by where DeepSpeed keeps
    it, are the baseline (``held_tensors``), then the parameters and the batch, and what DeepSpeed keeps on the host
    (``name_host``)."""
    cap, fake_mode = rec.cap, rec.mode
    with fake_mode, engine_on_fake(fake_mode, pins):
        held = held_tensors(engine)
        for path, t in held:
            if t.untyped_storage().nbytes():
                cap.preexisting(t, kind_of(path), path)
        del held
        param_sid, fake_inputs = rank_placeholders(cap, fake_mode, engine.module, inputs, rec.target)
        name_host(cap, engine, pins)
    return _run(rec, engine, fake_inputs, loss_fn, param_sid, train, pins)


def _forget() -> None:
    """The recorder's name of every fake tensor alive (``_NODE``, the op or placeholder that made it) taken off:
    to the next recorder, a tensor the last step made and DeepSpeed keeps without ``held_tensors`` finding
    it is one made outside its step, as the same tensor made by an unrecorded step is (``_Recorder._arg``)."""
    for o in gc.get_objects():
        # (by type: isinstance reads an object's __class__, and torch.distributed.reduce_op's warns it is deprecated)
        if issubclass(type(o), FakeTensor) and _NODE in vars(o):
            delattr(o, _NODE)


def _initialized(deepspeed: Any, model: nn.Module, optimizer: Any, config: dict[str, Any]) -> Any:
    """``deepspeed.initialize``'s engine; DeepSpeed's own refusal of the job (its config checks raise
    AssertionError or ValueError, e.g. an optimizer outside its ZeRO-tested list) as one line."""
    try:
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    except (AssertionError, ValueError) as e:
        raise UsageError(f"DeepSpeed's initialize refuses this job: {one_line(e) or type(e).__name__}") from None
    return engine


def _warm_step(engine: Any, inputs: Any, loss_fn: Optional[LossFn], target: Target, fake_mode: _Mode) -> None:
    """The job's first step (``micro_steps``), run on fake tensors and not recorded; its output and loss
    dropped, as a loop drops them. What DeepSpeed keeps from it (the optimizer states, ZeRO-3's persistent
    parameters gathered again after the step: deepspeed/runtime/zero/stage3.py ``_post_step``) is what the
    next step starts with."""
    batch = fake_batch(inputs() if callable(inputs) else inputs, fake_mode, torch.device("cpu"), target.param_dtype,
                       fake_mode.values)  # (the SDPA backends it picks are counted in the recorded step)
    micro_steps(engine, batch, loss_fn, forward_context(target, {}), lambda name: None, lambda: None)


def _micro_batch(inputs: Any) -> int:
    """The batch's first dimension (``train_micro_batch_size_per_gpu`` when the config says "auto")."""
    batch = as_batch(inputs() if callable(inputs) else inputs)
    first = next(iter(batch.tensors()), None)
    return int(first.shape[0]) if first is not None and first.dim() else 1


def _run(rec: Recording, engine: Any, fake_inputs: Any, loss_fn: Optional[LossFn], param_sid: dict[str, int],
         train: TrainStep, pins: Pins) -> StepGraph:
    module, cap, target, backends = engine.module, rec.cap, rec.target, rec.backends
    gathered = nn.modules.module.register_module_forward_hook(lambda m, a, o: _gathered(cap, m))
    with rec.hooks(), _removed(gathered):
        with rank_running(rec, module, engine_on_fake(rec.mode, pins)), naming_buckets(cap, engine):
            marked: dict[str, list[int]] = {}
            mark = marker(cap, param_sid, marked)
            out = micro_steps(engine, as_batch(fake_inputs), loss_fn,  # (alive until the step ends, as in a loop)
                               lambda: forward_context(target, backends, cap.clearing_cache)(), cap.set_phase,
                               lambda: mark("gradient", [(p, t) for p, t in held_tensors(engine)
                                                         if kind_of(p) == "gradient"]))
            relabel_accumulation(cap.ops, cap.saves, cap.phase_start)  # the last micro-step's saves are the step's
            states = engine.optimizer.optimizer.state if hasattr(engine.optimizer, "optimizer") else {}
            mark("optimizer state", [(f"{i}:{k}", v) for i, s in enumerate(states.values()) for k, v in s.items()
                                     if isinstance(v, torch.Tensor)])
            name_host(cap, engine, pins)  # (CPU offload: what DeepSpeed keeps on the host, after the step)
        graph = rec.graph(type(module).__name__, module_order(module), marked.get("gradient", []), train=train)
    del out  # freed after ``cap`` is closed (``rec.hooks``): the output and loss are alive when the step ends
    return graph


def micro_steps(engine: Any, batch: Any, loss_fn: Optional[LossFn], context: Callable[[], Any],
                 phase: Callable[[str], None], reduced: Callable[[], None]) -> tuple[Any, Any]:
    """One optimizer step as a user's loop runs it: the config's ``gradient_accumulation_steps`` micro-steps of
    ``out = engine(batch); loss = loss_fn(out); engine.backward(loss); engine.step()``, the engine stepping
    the optimizer on the last (deepspeed/runtime/engine.py ``is_gradient_accumulation_boundary``); the
    previous micro-step's output held until the next one returns. ``phase`` names each part; ``reduced``
    runs after the last backward (the gradients are then DeepSpeed's partitions). The last output and loss."""
    k = int(engine.gradient_accumulation_steps())
    for i in range(k):
        with context():
            phase("forward")
            out = batch.call(engine)
            phase("loss")
            loss = (loss_fn or default_loss)(out, batch.given)
            _tag_grad_fns(loss, "")  # the loss's nodes belong to the root
        phase("backward")
        engine.backward(loss)
        if i == k - 1:
            reduced()
            phase("optimizer")
        engine.step()
    return out, loss


def _gathered(cap: _Recorder, m: nn.Module) -> None:
    """ZeRO-3's gathered parameters named as FSDP2's are ("gathered parameter": parameters, not activations,
    where a linear saves its weight): after a module's forward (torch runs the global forward hooks before
    the module's own, so before DeepSpeed's post-forward hook releases them: deepspeed/runtime/zero/
    parameter_offload.py ``_post_forward_module_hook``) each of its parameters' storage is the all-gather's output."""
    for p in m.parameters(recurse=False):
        if p.untyped_storage().nbytes() and hasattr(p, "ds_tensor") and cap.recording:
            cap.relabel(p, "gathered parameter", "all-gather output (unsharded parameter)")


@contextlib.contextmanager
def _removed(handle: Any) -> Iterator[None]:
    try:
        yield
    finally:
        handle.remove()


__all__ = ["capture_engine", "capture_engine_steps", "kind_of", "micro_steps"]
