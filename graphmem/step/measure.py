"""``measure(spec)``: the one function that captures a StepSpec's step (graphmem/step/spec.py), and the
only place that dispatches on its parallel setting. ``graphmem.analyze``, advise's levers and the
re-captures behind plans, formulas and fits all come through here.

- ``Single`` / ``Formula``: the single-device step (graphmem/step/recapture.py ``capture_step``); the
  formulas' per-rank budget over it (passes/budget.py);
- ``Ranks``: rank r through PyTorch's wrappers (``capture_rank_step``), with the per-rank formula
  over the single-device step beside it (graphmem/distributed/view.py);
- ``Stages``: pipeline rank r under torch's schedule (``capture_stage_step``);
- ``Job``: rank r of a torchtitan job, built and stepped by the job's own code (graphmem/titan/);
- ``DeepSpeedJob``: rank r of a DeepSpeed job through DeepSpeed's own engine (graphmem/deepspeed/).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from graphmem.capture.capture import capture
from graphmem.capture.reuse import capture_reusing, reuses
from graphmem.deepspeed.config import DeepSpeedJob
from graphmem.distributed.pipeline_stages import Layout
from graphmem.distributed.tensor_parallel import tp_engine
from graphmem.distributed.view import rank_view
from graphmem.passes import liveness, notes, saved
from graphmem.passes.device_rows import device_rows
from graphmem.passes.later_steps import later_steps_peak
from graphmem.passes.run_memory import RunMemory, run_memory
from graphmem.step.recapture import Captured, capture_rank_step, capture_stage_step, capture_step
from graphmem.step.spec import Formula, Job, Ranks, Single, Stages, StepSpec
from graphmem.training.hf_trainer_fsdp import TrainerShards
from graphmem.training.spec import units_of


@dataclass(frozen=True)
class Measured:
    """A spec's captured step and what its parallel setting adds to the report."""

    spec: StepSpec
    step: Captured
    notes: tuple[str, ...] = ()  # the setting's own lines (depth reuse not taken, the rank's view)
    scope: Any = None  # the rank a per-rank or pipeline-stage step is (graphmem/report/__init__.py's RankScope)
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

    def memory(self, overrides: Optional[dict[str, int]] = None, first: Any = None) -> RunMemory:
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
    if isinstance(p, (Single, Formula)):
        step = capture_step(spec.module, make, spec.loss, spec.target, spec.training, spec.reuse, p.formula)
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
    raise AssertionError(f"unknown parallel setting {p!r}")  # StepSpec refuses any other where it is built


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


def _rank(spec: StepSpec, p: Ranks, make: Any) -> Measured:
    """Rank r's step through the real wrappers, with the per-rank formula over the single-device
    step beside it (graphmem/distributed/view.py)."""
    step = capture_rank_step(spec.module, make, spec.loss, spec.target, p.sharding, spec.training, spec.reuse)
    g, module = step.graph, step.module
    slow = (f"depth reuse not taken ({step.reuse_note}): every block was captured",) if step.reuse_note else ()
    train = spec.training.train if spec.training.train.active else None
    single_at: Any = lambda: capture(module, make, spec.loss, step.target, train=train)  # noqa: E731
    single = capture_reusing(module, single_at)[0] if spec.reuse and reuses(train) else single_at()
    view = rank_view(g, step.liveness, step.saved, p.sharding, (single, liveness(single), saved(single)),
                     units_of(module), tp_engine(module))
    if step.budget is not None:
        step = dataclasses.replace(step, budget=dataclasses.replace(step.budget, whose=view.describe()))
    return Measured(spec, step, notes(g) + slow + view.lines(), view)


def _job(spec: StepSpec, p: Job) -> Measured:
    """Rank r of a torchtitan job, built and stepped by the job's own code (graphmem/titan/capture.py);
    the whole step's table over rank r's graph (its shards, its optimizer states)."""
    from graphmem.titan.capture import capture_job
    from graphmem.training.spec import step_budget

    g = capture_job(p.config, p.world_size, p.rank, spec.target)
    g.train = spec.training.train
    lv, sv = liveness(g), saved(g)
    budget = step_budget(g, lv, sv, spec.training, spec.module, (), p.describe())
    step = Captured(g, lv, sv, budget, spec.module, (), spec.target)
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
    from graphmem.training.spec import step_budget

    g = capture_trainer_rank(spec.module, spec.inputs.captured, spec.target, p)
    g.train = spec.training.train
    lv, sv = liveness(g), saved(g)
    training = dataclasses.replace(spec.training, train=g.train)
    budget = step_budget(g, lv, sv, training, spec.module, (), p.describe())
    step = Captured(g, lv, sv, budget, spec.module, (), spec.target)
    return Measured(spec, step, notes(g))


def _deepspeed(spec: StepSpec, p: DeepSpeedJob) -> Measured:
    """Rank r of a DeepSpeed job through its own engine (graphmem/deepspeed/capture.py): the whole step's
    table over rank r's graph, DeepSpeed's held tensors by where it keeps them beside it."""
    from graphmem.deepspeed.capture import capture_engine
    from graphmem.deepspeed.report import engine_lines, paper_check
    from graphmem.training.spec import step_budget

    g = capture_engine(spec.module, spec.inputs.captured, spec.loss, spec.target, p, spec.training.train)
    lv, sv = liveness(g), saved(g)
    budget = step_budget(g, lv, sv, spec.training, spec.module, (), p.describe())
    # the second step captured after an unrecorded first: what DeepSpeed keeps and frees across steps as it does
    later = capture_engine(spec.module, spec.inputs.captured, spec.loss, spec.target, p, spec.training.train, warm=True)
    lv_later = liveness(later)
    budget = dataclasses.replace(budget, rank=dataclasses.replace(
        budget.rank, later_peak_bytes=lv_later.peak_bytes, later_peak_index=lv_later.peak_index,
        later_peak_phase=lv_later.peak_phase if lv_later.peak_index >= 0 else "before the step"))
    step = Captured(g, lv, sv, budget, spec.module, (), spec.target)
    return Measured(spec, step, notes(g) + (p.describe(),) + engine_lines(g, lv, p)
                    + paper_check(spec.module, p, g, spec.training.train.optimizer, budget.rank.rows))


def process_groups(parallel: Any) -> tuple[tuple[str, int], ...]:
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
    elif isinstance(parallel, TrainerShards):
        dims = (("world", parallel.world_size),)
    elif isinstance(parallel, DeepSpeedJob):
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


__all__ = ["Measured", "measure", "measure_ranks", "process_groups"]
