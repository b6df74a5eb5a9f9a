"""Rank r's step of a Trainer whose TrainingArguments name ``deepspeed``, on fake tensors.

In rank r's launcher environment, inside graphmem's fake process group, the Trainer is built around a fake
copy of the model (graphmem/deepspeed/trainer.py ``build_ds_trainer``) and its own
``_prepare_for_training`` runs accelerate's ``_prepare_deepspeed`` -> ``deepspeed.initialize`` under the patches
that let DeepSpeed's engine run on fake tensors (graphmem/deepspeed/engine.py ``engine_on_fake``, ``staying``).
What the engine then holds is the step's baseline, each tensor named by where DeepSpeed keeps it (as
graphmem/deepspeed/capture.py names them); the step is the Trainer's own (``DeepSpeedRunner``: ``training_step``
-> ``accelerator.backward`` -> ``engine.backward`` and ``engine.step``), recorded as a rank's step
(graphmem/distributed/capture.py). ``warm``: the job's first step runs unrecorded and the second is recorded
from what the engine and the Trainer (``_tr_loss``) hold after it: the later steps' peak.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from graphmem.capture.autograd_tags import _tag_grad_fns
from graphmem.capture.call_paths import module_order
from graphmem.capture.capture import marker
from graphmem.capture.fakes import fake_batch, forward_context
from graphmem.capture.session import Recording
from graphmem.capture.target import Target
from graphmem.deepspeed.capture import _gathered, kind_of
from graphmem.deepspeed.engine import Pins, engine_on_fake, held_tensors, name_host, naming_buckets, staying
from graphmem.deepspeed.trainer import DeepSpeedRunner, TrainerDeepSpeed, build_ds_trainer, deepspeed_rank
from graphmem.distributed.capture import rank_placeholders, rank_running
from graphmem.distributed.fsdp import fake_copy
from graphmem.fake_group import fake_group
from graphmem.stepgraph import StepGraph
from graphmem.training.loop import relabel_accumulation


def capture_trainer_engine(module: nn.Module, inputs: Any, target: Target, p: TrainerDeepSpeed,
                           warm: bool = False) -> StepGraph:
    """Record rank ``p.rank``'s first Trainer step (``warm``: its second) under DeepSpeed (the module docstring)."""
    with deepspeed_rank(p.rank, p.world_size), fake_group(p.rank, p.world_size):
        rec = Recording(target)
        cap, fake_mode = rec.cap, rec.mode
        pins: Pins = []  # what DeepSpeed pins under CPU offload (graphmem/deepspeed/engine.py)
        with fake_mode, engine_on_fake(fake_mode, pins):
            wrapped = fake_copy(module, None)  # DeepSpeed casts to bf16 itself (its config)
            trainer = build_ds_trainer(p, wrapped)
        cuda = target.device == "cuda"  # (the CUDA target: its kernel rules, torch.optim's CUDA pick off the host)
        rules = forward_context(target, rec.backends, cap.clearing_cache) if cuda else None
        runner = DeepSpeedRunner(trainer, rules=rules, foreach=cuda and not p.job.offloads("offload_optimizer"))
        with runner.session():
            with fake_mode, engine_on_fake(fake_mode, pins):
                with staying(wrapped):
                    runner.prepare()
                if warm:  # the first step, unrecorded; its loss dropped as the loop drops it
                    batch = fake_batch(inputs, fake_mode, torch.device("cpu"), target.param_dtype, fake_mode.values)
                    runner.rules = forward_context(target, {}) if cuda else None  # (its SDPA picks not the step's)
                    runner.run(wrapped, batch, None, lambda phase: None, lambda: _null(), fake=True)
                    runner.rules = rules
                for path, t in held_tensors(runner.engine) + [("_tr_loss", t) for t in runner.held_tensors()]:
                    if t.untyped_storage().nbytes():
                        cap.preexisting(t, kind_of(path), path)
                param_sid, fake_inputs = rank_placeholders(cap, fake_mode, wrapped, inputs, target)
                name_host(cap, runner.engine, pins)  # (CPU offload: what DeepSpeed keeps on the host)
            return _run(rec, runner, wrapped, fake_inputs, param_sid, pins)


def _run(rec: Recording, runner: DeepSpeedRunner, wrapped: nn.Module, fake_inputs: Any,
         param_sid: dict[str, int], pins: Pins) -> StepGraph:
    cap = rec.cap
    def tagged_loss(out: Any, inputs: Any) -> Any:
        if isinstance(out, torch.Tensor):
            _tag_grad_fns(out, "")  # the loss's nodes belong to the root
        return out

    gathered = nn.modules.module.register_module_forward_hook(lambda m, a, o: _gathered(cap, m))
    try:
        with rec.hooks():
            with rank_running(rec, wrapped, engine_on_fake(rec.mode, pins)), naming_buckets(cap, runner.engine):
                marked: dict[str, list[int]] = {}
                runner.run(wrapped, fake_inputs, tagged_loss, cap.set_phase, lambda: _null(),
                           marker(cap, param_sid, marked), fake=True)
                relabel_accumulation(cap.ops, cap.saves, cap.phase_start)  # the last micro-step's saves are the step's
                name_host(cap, runner.engine, pins)  # (after the step, as on the direct engine path)
            return rec.graph(type(wrapped).__name__, module_order(wrapped), marked.get("gradient", []))
    finally:
        gathered.remove()


def _null() -> Any:
    import contextlib

    return contextlib.nullcontext()


__all__ = ["capture_trainer_engine"]
