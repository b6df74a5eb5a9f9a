"""``measure(spec)``: the one function that captures a StepSpec's step (graphmem/step/spec.py), and the
only place that dispatches on its parallel setting. ``graphmem.analyze``, advise's levers and the
re-captures behind plans, formulas and fits all come through here.

- ``Single`` / ``Formula``: the single-device step (``capture_step`` through ``step_graph``, which the
  re-captures also ask, each for a changed spec); the formulas' per-rank budget over it (passes/budget.py);
- ``Ranks``: rank r through PyTorch's wrappers (graphmem/step/captured.py ``capture_rank_step``), with the per-rank formula
  over the single-device step beside it (graphmem/distributed/view.py);
- ``Stages``: pipeline rank r under torch's schedule (``capture_stage_step``);
- ``TrainerDDP``: rank r of a Trainer's DDP job, the Trainer's own step with torch's DDP around the model;
- ``Job``: rank r of a torchtitan job, built and stepped by the job's own code (graphmem/titan/);
- ``DeepSpeedJob``: rank r of a DeepSpeed job through DeepSpeed's own engine (graphmem/deepspeed/);
  ``TrainerDeepSpeed``: the same through a Trainer and accelerate (graphmem/deepspeed/trainer_capture.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import torch.nn as nn

from graphmem.capture.capture import StepRunner, capture
from graphmem.capture.fakes import Inputs
from graphmem.capture.reuse import capture_reusing, reuses
from graphmem.capture.reuse_compiled import CompiledReused, compiled_reusing
from graphmem.deepspeed.config import DeepSpeedJob
from graphmem.deepspeed.trainer import TrainerDeepSpeed
from graphmem.distributed.pipeline_stages import Layout, Pipeline
from graphmem.distributed.tensor_parallel import tp_engine
from graphmem.distributed.view import RankView, rank_view
from graphmem.passes import liveness, notes, saved
from graphmem.passes.allocator import AllocatorResult
from graphmem.passes.budget import Parallel
from graphmem.passes.device_rows import device_rows
from graphmem.passes.later_steps import later_steps_peak
from graphmem.passes.run_memory import RunMemory, run_memory
from graphmem.step.captured import Captured, capture_rank_step, capture_stage_step, passes_over
from graphmem.step.spec import Formula, Job, Parallelism, Ranks, Single, Stages, StepSpec
from graphmem.stepgraph import StepGraph
from graphmem.training.hf_trainer_ddp import TrainerDDP
from graphmem.training.hf_trainer_fsdp import TrainerShards
from graphmem.training.loop import TrainStep
from graphmem.training.spec import Training, prepare, units_of


@dataclass(frozen=True)
class Measured:
    """A spec's captured step and what its parallel setting adds to the report."""

    spec: StepSpec
    step: Captured
    notes: tuple[str, ...] = ()  # the setting's own lines (depth reuse not taken, the rank's view)
    scope: Union[RankView, Pipeline, None] = None  # the rank a per-rank or pipeline-stage step is (a RankScope)
    split: Optional[Layout] = None  # a pipeline's split, probed once and passed on to the other ranks

    @property
    def loss_name(self) -> str:
        """How the loss was made, for the report's header."""
        if isinstance(self.spec.parallel, Stages):
            return "pipeline stage loss"
        if self.spec.training.train.external is not None:  # a trainer's own step and loss
            return self.spec.training.train.external
        if self.spec.loss is not None:
            return getattr(self.spec.loss, "__qualname__", "custom")
        if self.scope is not None:
            return "default"
        return ("default (the model's own loss if its output has one, else the output if scalar, else the sum of "
                "floating outputs)")

    @property
    def by_formula(self) -> bool:
        """The per-rank figures are the formulas' over the single-device step (no rank captured)."""
        return isinstance(self.spec.parallel, Formula)

    def memory(self, overrides: Optional[dict[str, int]] = None, first: Optional[AllocatorResult] = None) -> RunMemory:
        """The run's memory of the step (passes/run_memory.py): the exact first and later peaks (the
        per-rank table's when the step has one), on the CUDA target the allocator model's and the
        device rows for the job's process groups. ``first``: the first step's allocator result, when
        already computed."""
        step = self.step
        g, b = step.graph, step.budget
        first_bytes = b.rank.peak_bytes if b is not None else step.liveness.peak_bytes
        later_bytes = b.rank.later_peak_bytes if b is not None else later_steps_peak(g, step.liveness)
        rows = device_rows(step.target.capability, process_groups(self.spec.parallel), overrides) \
            if step.target.device == "cuda" else ()
        return run_memory(g, first_bytes, later_bytes, rows, first, self.by_formula)

    @property
    def recapturable(self) -> bool:
        """Plans, formulas and fits capture this step again at other sizes: one device's step, in
        graphmem's own loop, only."""
        return self.scope is None and self.spec.training.train.external is None


def measure(spec: StepSpec) -> Measured:
    """Capture ``spec``'s step (no real allocation) and run the passes on it."""
    p = spec.parallel
    make = spec.inputs.captured
    if isinstance(p, (Single, Formula, TrainerDDP)):  # (a Trainer's DDP rank: its own step, DDP run by its runner)
        step = capture_step(spec, p.formula)
        if isinstance(p, TrainerDDP) and step.budget is not None:  # the budget is that rank's, so named
            step = dataclasses.replace(step, budget=dataclasses.replace(step.budget, whose=p.describe()))
        slow = (f"depth reuse not taken ({step.reuse_note}): every block was compiled and captured",) \
            if step.reuse_note and spec.target.mode == "compiled" else ()
        return Measured(spec, step, notes(step.graph) + slow)
    if isinstance(p, Ranks):
        return _rank(spec, p, make)
    if isinstance(p, Stages):
        step, found, split = capture_stage_step(spec.module, make, spec.loss, spec.target, spec.training,
                                                p.pipeline, p.split)
        return Measured(spec, step, found, p.pipeline, split)
    if isinstance(p, Job):
        return _job(spec, p)
    if isinstance(p, TrainerShards):  # a Trainer's FSDP2 rank, wrapped by accelerate's own code
        return _trainer_shards(spec, p)
    if isinstance(p, DeepSpeedJob):  # rank r through DeepSpeed's engine
        return _deepspeed(spec, p)
    if isinstance(p, TrainerDeepSpeed):  # a Trainer's DeepSpeed rank, through accelerate (graphmem/deepspeed/trainer_capture.py)
        return _deepspeed(spec, p)
    raise AssertionError(f"unknown parallel setting {p!r}")  # StepSpec refuses any other where it is built


def step_graph(spec: StepSpec, module: Optional[nn.Module] = None, train: Optional[TrainStep] = None,
               runner: Optional[StepRunner] = None, reuse: bool = False, one_compilation: bool = True) -> CompiledReused:
    """``spec``'s step on one device captured as a StepGraph, without the passes: what ``measure`` and the
    captures again behind plans, formulas, fits, memory budgets and the eager twin ask, each a changed spec
    (``spec.at(shape)``, ``spec.with_target(...)``). ``module``: the module run (default ``spec.module``; a
    capture again runs the one the first capture ran, LoRA applied); ``train``: graphmem's loop
    (graphmem/training/loop.py); ``runner``: a trainer's own step in its place. ``reuse``: a deep chain
    captured at depth 5 and widened (graphmem/capture/reuse.py), in compiled mode from one compilation
    (graphmem/capture/reuse_compiled.py) unless not ``one_compilation``; the answer says why not, if not."""
    m = spec.module if module is None else module
    make, loss, target = spec.inputs.captured, spec.loss, spec.target

    def at() -> StepGraph:
        return capture(m, make, loss, target, train=train, runner=runner)
    if not reuse:
        return CompiledReused(at(), False)
    if target.mode == "compiled" and one_compilation:  # (the loop's phases are not block-shaped: no train here)
        return compiled_reusing(m, lambda t: capture(m, make, loss, t), target)
    return CompiledReused(*capture_reusing(m, at))


def capture_step(spec: StepSpec, formula: Parallel = Parallel()) -> Captured:
    """Capture one training step of ``spec``'s module (LoRA applied from its training) and run the
    passes, with the per-rank budget of ``formula`` (passes/budget.py) over it: a ``Single`` or
    ``Formula`` step."""
    training, target = spec.training, spec.target
    prepared, lora_layers = prepare(spec.module, training, target.param_dtype)
    if training.keeps_dtypes(spec.module):  # 4-bit weights, peft's fp32 adapters (graphmem/training/spec.py)
        spec = spec.with_target(dtype=None)
    with training.train.runner(spec.target) as runner:  # a trainer's own step, or None: graphmem's loop
        # a deep chain of identical blocks is captured at depth 5 and widened (checked at depth 6), in
        # eager and compiled mode; in eager mode with the optimizer step too, not micro-batches (reuse.py reuses)
        reuse = spec.reuse and (not training.train.active or (
            spec.target.mode != "compiled" and runner is None and reuses(training.train)))
        reused = step_graph(spec, prepared, None if runner is not None else training.train,
                            runner.run if runner is not None else None, reuse)
    return passes_over(reused.graph, training if training.requested or formula != Parallel() else None, prepared,
                       spec.target, lora_layers, layout=formula, reuse_note=reused.why, eager=reused.eager)


def measure_ranks(spec: StepSpec) -> list[Measured]:
    """Every pipeline rank's step for a pipeline (the split probed once, for rank 0, and passed
    on); the spec's own step otherwise."""
    p = spec.parallel
    if not isinstance(p, Stages):
        return [measure(spec)]
    out: list[Measured] = []
    for r in range(p.pipeline.pp):
        plan = dataclasses.replace(p.pipeline, rank=r)
        out.append(measure(spec.replace(parallel=Stages(plan, out[0].split if out else None))))
    return out


def _rank(spec: StepSpec, p: Ranks, make: Inputs) -> Measured:
    """Rank r's step through the real wrappers, with the per-rank formula over the single-device
    step beside it (graphmem/distributed/view.py)."""
    step = capture_rank_step(spec.module, make, spec.loss, spec.target, p.sharding, spec.training, spec.reuse)
    g, module = step.graph, step.module
    slow = (f"depth reuse not taken ({step.reuse_note}): every block was captured",) if step.reuse_note else ()
    train = spec.training.train if spec.training.train.active else None
    # the same step on one device (the module the rank ran, LoRA applied)
    single = _single_step(spec.replace(parallel=Single(), target=step.target), module, train,
                          spec.reuse and (train is None or (step.target.mode != "compiled" and reuses(train))))
    view = rank_view(g, step.liveness, step.saved, p.sharding, (single, liveness(single), saved(single)),
                     units_of(module), tp_engine(module))
    if step.budget is not None:
        step = dataclasses.replace(step, budget=dataclasses.replace(step.budget, whose=view.describe()))
    return Measured(spec, step, notes(g) + slow + view.lines(), view)


# (spec, module id, loop, reuse) -> (the module, kept alive so its id is not reused; the single-device step)
_SINGLE_STEPS: ContextVar[Optional[dict[tuple, tuple[nn.Module, StepGraph]]]] = ContextVar("single_steps", default=None)


@contextlib.contextmanager
def single_steps_once() -> Iterator[None]:
    """Within it, the single-device step that rank r's capture puts beside its own (``_rank``, for the per-rank
    formula's cross-check) is captured once per spec and module: advise's FSDP2 rows (resharded after forward
    or not) differ in the wrapping only, and capture the same step on one device."""
    token = _SINGLE_STEPS.set({})
    try:
        yield
    finally:
        _SINGLE_STEPS.reset(token)


def _single_step(spec: StepSpec, module: nn.Module, train: Optional[TrainStep], reuse: bool) -> StepGraph:
    """``spec``'s step on one device on ``module`` (``step_graph``), captured once within ``single_steps_once``."""
    memo = _SINGLE_STEPS.get()
    key = (spec, id(module), train, reuse)
    if memo is not None and key in memo:
        return memo[key][1]
    g = step_graph(spec, module, train, reuse=reuse).graph
    if memo is not None:
        memo[key] = (module, g)
    return g


def _job(spec: StepSpec, p: Job) -> Measured:
    """Rank r of a torchtitan job, built and stepped by the job's own code (graphmem/titan/capture.py);
    the whole step's table over rank r's graph (its shards, its optimizer states)."""
    from graphmem.titan.capture import capture_job
    g = capture_job(p.config, p.world_size, p.rank, spec.target)
    g.train = spec.training.train
    step = passes_over(g, spec.training, spec.module, spec.target, (), p.describe())
    routing = ("expert parallel: each rank's routed tokens read as split evenly over the expert-parallel ranks "
               "(balanced routing, graphmem/titan/moe.py); ranks that receive more under uneven routing hold more",) \
        if getattr(p.config.parallelism, "expert_parallel_degree", 1) > 1 else ()
    cp = getattr(p.config.parallelism, "context_parallel_degree", 1)
    context = (f"context parallel: each rank holds 1/{cp} of every sequence (torchtitan's load balancer's "
               "chunks); attention is torch's context parallel (SDPA: ring attention; FlexAttention: keys and "
               "values all-gathered), run per rank on fake tensors",) if cp > 1 else ()
    return Measured(spec, step, notes(g) + (p.describe(),) + routing + context)


def _trainer_shards(spec: StepSpec, p: TrainerShards) -> Measured:
    """A Trainer's FSDP2 rank, wrapped by accelerate's own code (graphmem/distributed/trainer_fsdp.py): the passes and the whole step's
    table over rank r's own graph (its shards, its optimizer states)."""
    from graphmem.distributed.trainer_fsdp import capture_trainer_rank

    g = capture_trainer_rank(spec.module, spec.inputs.captured, spec.target, p)
    g.train = spec.training.train
    training = dataclasses.replace(spec.training, train=g.train)
    return Measured(spec, passes_over(g, training, spec.module, spec.target, (), p.describe()), notes(g))


def _deepspeed(spec: StepSpec, p: Union[DeepSpeedJob, TrainerDeepSpeed]) -> Measured:
    """Rank r of a DeepSpeed job through its own engine (graphmem/deepspeed/capture.py), or through a Trainer
    and accelerate (``TrainerDeepSpeed``: graphmem/deepspeed/trainer_capture.py): the whole step's table over
    rank r's graph, DeepSpeed's held tensors by where it keeps them beside it."""
    from graphmem.deepspeed.capture import capture_engine_steps
    from graphmem.deepspeed.host import split_host
    from graphmem.deepspeed.report import (
        engine_lines,
        paper_check,
        residual,
        residual_lines,
        residual_rows,
        with_own_notes,
    )
    from graphmem.deepspeed.trainer_capture import capture_trainer_engine

    # the second step recorded after the first: what DeepSpeed keeps and frees across steps as it does (one engine
    # records both; a Trainer's second is recorded after an unrecorded first)
    training = _host_stepped(spec, p)
    if isinstance(p, TrainerDeepSpeed):
        g = capture_trainer_engine(spec.module, spec.inputs.captured, spec.target, p)
        later = capture_trainer_engine(spec.module, spec.inputs.captured, spec.target, p, warm=True)
    else:
        g, later = capture_engine_steps(spec.module, spec.inputs.captured, spec.loss, spec.target, p, training.train)
    if spec.target.device == "cuda":  # what CPU offload keeps in host memory leaves the GPU's figures
        g, later = split_host(g), split_host(later)
    g.train = training.train
    first = passes_over(g, training, spec.module, spec.target, (), p.describe())
    lv, budget = first.liveness, first.budget
    assert budget is not None  # (a training spec was given)
    lv_later = liveness(later)
    budget = dataclasses.replace(budget, rank=dataclasses.replace(
        budget.rank, rows=with_own_notes(budget.rank.rows), later_peak_bytes=lv_later.peak_bytes,
        later_peak_index=lv_later.peak_index,
        later_peak_phase=lv_later.peak_phase if lv_later.peak_index >= 0 else "before the step",
        # the model's parameters, not the flat buffers DeepSpeed keeps them in (whose gradients have no single owner)
        parameters=sum(q.numel() for q in spec.module.parameters()),
        trainable=sum(q.numel() for q in spec.module.parameters() if q.requires_grad)))
    # the residual states (their own detail rows) and the ZeRO paper's cross-check read the job's config (a Trainer's
    # is its arguments')
    job = p if isinstance(p, DeepSpeedJob) else p.job
    res = residual(g, lv, spec.module, job)
    budget = dataclasses.replace(budget, rank=dataclasses.replace(budget.rank, details=residual_rows(g, lv, res)))
    own = residual_lines(res) + paper_check(spec.module, job, g, spec.training.train.optimizer, budget.rank.rows)
    step = dataclasses.replace(first, budget=budget)
    cpu_param_offload = ("offload_param: analyzed on the CPU target, DeepSpeed's CPU run (the CUDA target does not "
                         "model ZeRO-3's host-to-device copy of each partition before its all-gather yet)",) \
        if spec.target.device == "cpu" and job.offloads("offload_param") else ()
    return Measured(spec, step, notes(g) + (p.describe(),) + engine_lines(g, lv) + own + cpu_param_offload)


def _host_stepped(spec: StepSpec, p: Union[DeepSpeedJob, TrainerDeepSpeed]) -> Training:
    """The step's training, its optimizer's implementation as torch.optim picks it for the tensors it steps: under
    DeepSpeed's ``offload_optimizer`` on the CUDA target, host partitions (``forloop``, the CPU's pick), not the GPU's."""
    job = p if isinstance(p, DeepSpeedJob) else p.job
    train = spec.training.train
    if spec.target.device != "cuda" or train.impl != "auto" or not job.offloads("offload_optimizer"):
        return spec.training
    return dataclasses.replace(spec.training, train=dataclasses.replace(train, impl="forloop"))


def deepspeed_job(spec: StepSpec) -> Optional[DeepSpeedJob]:
    """The DeepSpeed job whose rank ``spec``'s step is, if it is one (advise's config levers:
    graphmem/advise/deepspeed_levers.py)."""
    return spec.parallel if isinstance(spec.parallel, DeepSpeedJob) else None


def process_groups(parallel: Parallelism) -> tuple[tuple[str, int], ...]:
    """The process groups a rank of the job creates, (name, ranks) each: each gets an NCCL
    communicator on its first collective (passes/device_rows.py). A one-dimensional job uses the
    default group; a two-dimensional one (data x tensor parallel) a group per dimension."""
    dims: tuple[tuple[str, int], ...] = ()
    if isinstance(parallel, (Formula, Ranks)):
        p = parallel.formula if isinstance(parallel, Formula) else parallel.sharding
        dims = (("data parallel", p.world_size // p.tp), ("tensor parallel", p.tp))
    elif isinstance(parallel, Stages):
        dims = (("pipeline", parallel.pipeline.pp),)
    elif isinstance(parallel, Job):
        dims = _job_groups(parallel)
    elif isinstance(parallel, (TrainerDDP, TrainerShards)):
        dims = (("world", parallel.world_size),)
    elif isinstance(parallel, (DeepSpeedJob, TrainerDeepSpeed)):
        dims = (("world", parallel.world_size),)
    return tuple((n, d) for n, d in dims if d > 1)


def _job_groups(job: Job) -> tuple[tuple[str, int], ...]:
    """A torchtitan job's mesh dimensions (ParallelismConfig's degrees; dp_shard -1: the ranks left)."""
    c = job.config.parallelism
    given = (("dp_replicate", c.data_parallel_replicate_degree), ("tp", c.tensor_parallel_degree),
             ("pp", c.pipeline_parallel_degree), ("cp", c.context_parallel_degree), ("ep", c.expert_parallel_degree))
    dims = [(n, int(d)) for n, d in given if d > 1]
    shard = int(c.data_parallel_shard_degree)
    if shard == -1:
        rest = job.world_size
        for n, d in dims:
            if n != "ep":  # expert parallel borrows from the data-parallel ranks
                rest //= d
        shard = rest
    return tuple(dims) + ((("dp_shard", shard),) if shard > 1 else ())


__all__ = ["Measured", "deepspeed_job", "measure", "measure_ranks", "process_groups"]
