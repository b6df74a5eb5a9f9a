"""``graphmem.analyze(job_config, world_size=N, rank=r)``: a torchtitan job's rank as a StepSpec
(graphmem/step/spec.py ``Job``), measured by graphmem/step/measure.py through graphmem/titan/capture.py.

>>> from graphmem.titan import load_job                       # doctest: +SKIP
>>> job = load_job("llama3_8b", ["--parallelism.data_parallel_shard_degree", "8"])  # doctest: +SKIP
>>> graphmem.analyze(job, world_size=8, rank=0, attention="sdpa").budget.peak_bytes  # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, TypedDict

import torch
import torch.nn as nn

from graphmem.capture.target import make_target
from graphmem.errors import UsageError
from graphmem.step.spec import Inputs, Job, StepSpec
from graphmem.titan.float8 import check_target, describe
from graphmem.titan.job import _torchtitan, on_cpu, synthetic_batches, with_sdpa
from graphmem.training.loop import TrainStep
from graphmem.training.spec import Training

if TYPE_CHECKING:
    from typing import Unpack

    from torchtitan.trainer import Trainer as TitanTrainer

    from graphmem.step.measure import Measured

OPTIONS = {"world_size", "rank", "device", "gpu", "attention"}


class JobOptions(TypedDict, total=False):
    """``job_spec``'s target options, as ``highest`` passes them on."""

    device: str
    gpu: str
    attention: Optional[str]


@dataclass(frozen=True)
class TitanStep(TrainStep):
    """torchtitan's ``Trainer.train_step`` as the report's budget names it."""

    max_norm: float = 0.0
    precision: str = ""
    checkpointing: str = ""

    @property
    def external(self) -> Optional[str]:
        return "torchtitan's loss_fn (del pred before backward)"

    def describe(self, device: str = "cpu") -> str:
        parts = [f"torchtitan Trainer.train_step: {self.optimizer}", f"clip_grad_norm_ {self.max_norm:g}",
                 f"{self.micro_batches} gradient accumulation steps" if self.micro_batches > 1 else "no accumulation",
                 self.precision]
        if self.checkpointing:
            parts.append(f"{self.checkpointing} activation checkpointing")
        return ", ".join(parts)

    def to_dict(self, device: str = "cpu") -> dict[str, object]:
        return {"loop": "torchtitan.Trainer", "optimizer": self.optimizer, "impl": None, "master_weights": False,
                "micro_batches": self.micro_batches, "max_grad_norm": self.max_norm, "precision": self.precision,
                "activation_checkpointing": self.checkpointing}


def job_spec(config: TitanTrainer.Config, world_size: Optional[int] = None, rank: int = 0, device: str = "cuda", gpu: str = "h100",
             attention: Optional[str] = None) -> StepSpec:
    """The StepSpec of rank ``rank`` of the torchtitan job ``config`` (a ``Trainer.Config``) over
    ``world_size`` ranks (default: the product of the job's parallel degrees). ``attention="sdpa"``
    swaps FlexAttention for SDPA is_causal (graphmem/titan/job.py ``with_sdpa``); ``device`` is the
    target whose kernel rules apply ("cuda", the default, or "cpu")."""
    _torchtitan()
    if attention not in (None, "flex", "sdpa"):
        raise UsageError(f"`attention={attention!r}` for a torchtitan job: use 'sdpa' (SDPA is_causal) or leave it "
                         "to the job (FlexAttention)")
    cfg = with_sdpa(config) if attention == "sdpa" else config
    world = world_size or _degrees(cfg)
    target = make_target(device=device, gpu=gpu)
    spec = cfg.model_spec
    name = f"torchtitan {spec.name} {spec.flavor}"
    t = cfg.training
    model = _meta_model(cfg)
    check_target(model, target.device)
    precision = ", ".join(p for p in (_precision(cfg), describe(model)) if p)
    step = TitanStep(_optimizer(cfg), micro_batches=max(t.global_batch_size // max(t.local_batch_size * _dp(cfg, world), 1), 1)
                     if t.global_batch_size > 0 else 1, max_norm=float(t.max_norm), precision=precision,
                     checkpointing=type(cfg.activation_checkpoint).__qualname__.split(".")[0])
    inputs = Inputs(lambda shape: synthetic_batches(cfg, 1)[0], (t.local_batch_size, t.seq_len))
    return StepSpec(name, model, inputs, None, target, Training(step, None), Job(cfg, world, rank), reuse=False)


def stage_ranks(config: TitanTrainer.Config, world_size: int) -> list[int]:
    """The first rank of each pipeline stage: torchtitan's mesh puts "pp" outermost
    (torchtitan/distributed/parallel_dims.py ``build_mesh``), so stage s's ranks start at
    s * world_size / pp; the ranks of one stage hold equal shards (FSDP2 pads every shard to the
    same size) and run the same step."""
    pp = max(config.parallelism.pipeline_parallel_degree, 1)
    return [s * (world_size // pp) for s in range(pp)]


def highest(config: TitanTrainer.Config, world_size: Optional[int] = None, rank: Optional[int] = None,
            **options: Unpack[JobOptions]) -> tuple[Measured, list[tuple[int, int]]]:
    """The measured step (graphmem/step/measure.py) of rank ``rank``, or (``rank=None``) of the rank with
    the highest later-steps peak among the pipeline stages' first ranks, and every analyzed rank's
    later-steps peak. ``graphmem.api.report_of`` makes its report."""
    from graphmem.step.measure import measure

    world = world_size or _degrees(config)
    ranks = [rank] if rank is not None else stage_ranks(config, world)
    measured = [measure(job_spec(config, world, r, **options)) for r in ranks]
    peaks = [(r, m.step.budget.rank.later_peak_bytes if m.step.budget is not None else m.step.peak_bytes)
             for r, m in zip(ranks, measured)]
    top = max(range(len(measured)), key=lambda i: peaks[i][1])
    return measured[top], peaks


def _degrees(cfg: TitanTrainer.Config) -> int:
    p = cfg.parallelism
    dp = p.data_parallel_shard_degree if p.data_parallel_shard_degree > 0 else 1
    # expert parallel borrows the data/context-parallel ranks (torchtitan/distributed/parallel_dims.py): no factor
    return p.data_parallel_replicate_degree * dp * p.tensor_parallel_degree * p.pipeline_parallel_degree * \
        p.context_parallel_degree


def _dp(cfg: TitanTrainer.Config, world: int) -> int:
    p = cfg.parallelism
    return max(world // (p.tensor_parallel_degree * p.pipeline_parallel_degree * p.context_parallel_degree), 1)


def _optimizer(cfg: TitanTrainer.Config) -> str:
    groups = getattr(cfg.optimizer, "param_groups", None) or []
    names = sorted({getattr(g, "optimizer_name", "?") for g in groups}) or [type(cfg.optimizer).__name__]
    return "/".join(names)


def _precision(cfg: TitanTrainer.Config) -> str:
    t = cfg.training
    if t.dtype == "bfloat16":
        return "bf16 parameters"
    return f"fp32 parameters, FSDP2 MixedPrecisionPolicy({t.mixed_precision_param}, {t.mixed_precision_reduce})"


def _meta_model(cfg: TitanTrainer.Config) -> nn.Module:
    """The job's model as torchtitan builds it before parallelizing: on meta (no memory)."""
    with on_cpu(), torch.device("meta"):
        return dataclasses.replace(cfg.model_spec.model).build()


__all__ = ["OPTIONS", "TitanStep", "highest", "job_spec", "stage_ranks"]
