"""A step's setting (target, training spec, input shape, loss, module) and the captures of its
changes: every lever's peak is a capture of the changed step (graphmem/recapture.py's
``capture_step``, what ``graphmem.analyze`` runs), never an estimate.

Captures are cached by what the capture depends on. A setting with ``sharding`` (FSDP2's
``fully_shard`` over ranks) is rank r's step captured through torch.distributed's own wrappers
under a fake process group (graphmem/recapture.py ``capture_rank_step``, what ``graphmem.analyze
--rank``/``--fsdp`` runs). The formulas' parallel layout (``training.parallel``: ZeRO over ranks)
is not part of the key: passes/budget.py turns one captured step into a per-rank budget, so a
ZeRO lever costs no capture."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch.nn as nn

from graphmem.capture.target import Target
from graphmem.distributed.pipeline import Pipeline, make_pipeline
from graphmem.distributed.spec import Sharding, make_sharding
from graphmem.errors import UsageError, no_source
from graphmem.passes import saved
from graphmem.planning.planner import step_flops
from graphmem.recapture import Captured, capture_rank_step, capture_stage_step, capture_step
from graphmem.training.spec import Training, make_training, step_budget
from graphmem.training.step import LossFn


@dataclass(frozen=True)
class Setting:
    """Everything a capture of the step is made from."""

    target: Target
    training: Training
    shape: tuple[int, ...]  # the first input's shape (the batch the inputs are made at)
    loss: Optional[LossFn]
    module: nn.Module  # before LoRA (the training spec adds adapters)
    sharding: Optional[Sharding] = None  # rank r's step through fully_shard (None: one device, or the formulas)
    pipeline: Optional[Pipeline] = None  # pipeline stages over ranks (its rank is ignored: every rank is captured)

    def replace(self, **changes: Any) -> "Setting":
        return dataclasses.replace(self, **changes)

    def with_train(self, **changes: Any) -> "Setting":
        return self.replace(training=dataclasses.replace(
            self.training, train=dataclasses.replace(self.training.train, **changes)))

    def with_target(self, **changes: Any) -> "Setting":
        return self.replace(target=dataclasses.replace(self.target, **changes))

    @property
    def key(self) -> tuple:
        """What the capture depends on (not the parallel layout: see the module docstring)."""
        return (self.target, self.training.train, self.training.lora, self.training.quantization, self.shape,
                self.loss, self.module, self.sharding, self.pipeline)


def base_setting(report: Any) -> Setting:
    """The setting ``report`` was captured with."""
    source = report.source
    if source is None:
        raise no_source(report.sharding)
    training = source.training or make_training(source.target.dtype)
    return Setting(source.asked_target, training, tuple(source.base_shape), source.loss, source.original)


class Measurer:
    """Captures settings (once each), starting from the report's own capture."""

    def __init__(self, report: Any, tick: Optional[Callable[[], None]] = None) -> None:
        self.source = report.source
        self.base = base_setting(report)
        self.tick = tick or (lambda: None)
        self.captures = 0  # captures run (the report's own is not counted)
        step = report.step
        lora = report.budget.lora_layers if report.budget is not None else ()
        self._stage_cache: dict[tuple, list[Captured]] = {}
        self._cache: dict[tuple, Captured] = {
            self.base.key: Captured(step, report.liveness, saved(step), report.budget, self.source.module, lora,
                                    self.source.target)}

    def captured(self, setting: Setting) -> Captured:
        """The step of ``setting``, captured (or taken from the cache), its budget per rank."""
        if setting.sharding is not None:
            return self._rank(setting, setting.sharding)
        if setting.pipeline is not None:
            return max(self._stages(setting, setting.pipeline), key=step_peak)
        cached = self._cache.get(setting.key)
        if cached is None:
            make = self.source.make
            cached = capture_step(setting.module, lambda: make(setting.shape), setting.loss, setting.target,
                                  setting.training, reuse=self.source.reuse)
            self._cache[setting.key] = cached
            self.captures += 1
            self.tick()
        if cached.budget is not None and cached.budget.training == setting.training:
            return cached
        if not setting.training.requested:
            return dataclasses.replace(cached, budget=None)
        g = cached.graph  # same step, another parallel layout: passes/budget.py's per-rank formulas
        plan = step_budget(g, cached.liveness, cached.saved, setting.training, cached.module, cached.lora_layers)
        return dataclasses.replace(cached, budget=plan)

    def _rank(self, setting: Setting, sharding: Sharding) -> Captured:
        """Rank r's step through fully_shard (captured once per setting); the options are checked
        together with the training step first (graphmem/distributed/spec.py: what it refuses is a
        GraphmemError the lever's row reports)."""
        cached = self._cache.get(setting.key)
        if cached is None:
            s = sharding
            if setting.pipeline is not None:
                raise UsageError("fully_shard with pipeline stages is not modelled: one or the other")
            if setting.training.parallel.world_size > 1:
                raise UsageError(f"the step is already split by the formulas ({setting.training.parallel.describe()})")
            make_sharding(s.world_size, s.rank, s.fsdp, s.reshard_after_forward, s.param_dtype, s.reduce_dtype,
                          s.offload, s.tp, s.sp, s.no_sync, setting.training)
            make = self.source.make
            cached = capture_rank_step(setting.module, lambda: make(setting.shape), setting.loss, setting.target,
                                       sharding, setting.training, reuse=self.source.reuse)
            self._cache[setting.key] = cached
            self.captures += 1
            self.tick()
        return cached

    def _stages(self, setting: Setting, plan: Pipeline) -> list[Captured]:
        """Every pipeline rank's step (its stages, its optimizer), captured once per setting."""
        key = setting.key
        cached = self._stage_cache.get(key)
        if cached is None:
            make = self.source.make
            cached, layout = [], None
            for r in range(plan.pp):  # the split is probed once, for rank 0, and passed on
                step, _, layout = capture_stage_step(setting.module, lambda: make(setting.shape), setting.loss,
                                                     setting.target, setting.training,
                                                     make_pipeline(plan.pp, r, plan.schedule, plan.micro_batches), layout)
                cached.append(step)
            self._stage_cache[key] = cached
            self.captures += 1
            self.tick()
        return cached

    def peak(self, setting: Setting) -> int:
        return step_peak(self.captured(setting))

    def flops(self, setting: Setting) -> int:
        """FLOPs of the step's recorded ops (planning/planner.py's ``step_flops``)."""
        return step_flops(self.captured(setting).graph)


def step_peak(step: Captured) -> int:
    """The highest peak of any training step: the first, or a later one, whose optimizer states
    exist before it starts (passes/budget.py's ``later_peak_bytes``), per rank."""
    if step.budget is None:
        return step.liveness.peak_bytes
    return max(step.budget.peak_bytes, step.budget.rank.later_peak_bytes)
