"""``graphmem.validate`` of a DeepSpeed job (``deepspeed=config``): each rank's prediction (``graphmem.analyze(...,
deepspeed=config, world_size=N, rank=r)``, DeepSpeed's engine on fake tensors) beside real DeepSpeed on ``world_size``
CPU processes over gloo (torch.multiprocessing.spawn, a file:// rendezvous, the launcher's environment,
``DS_ACCELERATOR=cpu``: DeepSpeed's CPU accelerator). Each rank builds the model and batch as validate does on one
device (seed 0), hands ``deepspeed.initialize`` the torch optimizer graphmem's capture hands it
(graphmem/training/optim.py ``make_optimizer``) and the config with its ``"auto"`` values resolved as the capture
resolves them (graphmem/deepspeed/config.py ``resolved``), and runs the capture's loop for real
(graphmem/deepspeed/capture.py ``micro_steps``: the config's micro-steps of forward, loss, ``engine.backward``,
``engine.step``), twice: the second step is the later steps'.

Measured per step, as graphmem/validation/ranks.py measures a wrapped rank: the distinct storages autograd saves
in forward and loss (the module's parameters at that moment excluded: ZeRO-3's gathered ones), the bytes alive
before the step (every tensor alive in the process, by ``gc``: what DeepSpeed's engine keeps wherever it keeps it,
the batch, but not what existed before the job nor the previous step's output, kept alive for the profiler), the
bytes alive after it, and the peak: the bytes before plus the largest running sum of the CPU allocator's events,
DeepSpeed's collectives settled on the rank's own thread (graphmem/validation/settle.py). One patch, as in the
capture: ``deepspeed.comm.torch.build_shm_op`` returns None (DeepSpeed JIT-compiles a shared-memory all-reduce for
``inference_all_reduce`` only, never in a training step; it needs a compiler). The rows are exact but the peaks,
within validate's tolerance (measured equal to the byte: tests/distributed/test_deepspeed.py)."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import io
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import torch.nn as nn

from graphmem.api import analyze
from graphmem.capture.hf import HFOptions
from graphmem.capture.target import Target
from graphmem.deepspeed.config import make_job, resolved
from graphmem.deepspeed.trainer import deepspeed_of
from graphmem.errors import UsageError
from graphmem.noise import quiet_third_party
from graphmem.report.live import Analysis
from graphmem.step.spec import ModelLike, make_spec
from graphmem.training.batch import Batch, as_batch
from graphmem.training.step import LossFn
from graphmem.validation.profiler_log import without_profiler_log
from graphmem.validation.ranks import (
    Saves,
    built_for_real,
    check_budget,
    pickled,
    profiled,
    ranked,
    run_ranks,
    sources,
)
from graphmem.validation.result import Row, Validation
from graphmem.validation.settle import UNSETTLED, addresses, allocation_events, settle_collectives

# DeepSpeed's collectives beyond torch.distributed's usual ones (deepspeed/comm/torch.py calls them by these names)
_MORE = ("reduce", "all_reduce_coalesced")


@dataclass(frozen=True)
class _Job:
    """What each gloo rank needs, pickled to the spawned processes."""

    model: Union[str, bytes]  # a model file or preset (each rank builds it) or a module, pickled
    hf: Optional[HFOptions]
    built: Optional[Target]  # load()'s target: a Hugging Face model's dtype and attention, as the prediction built it
    batch: Optional[bytes]  # the batch, pickled; None: each rank makes it for ``shape`` from the model file
    shape: tuple[int, ...]
    loss: Optional[LossFn]
    optimizer: Optional[str]
    impl: str
    config: dict[str, Any]  # the config, its "auto" values resolved
    threads: int


def validate_deepspeed(model: ModelLike, given: Optional[Batch], shape: Optional[tuple[int, ...]],
                       loss: Optional[LossFn], hf: Optional[HFOptions], tol: float, options: dict[str, Any]) -> Validation:
    """Each rank ``options`` name (``rank``, else all of ``world_size``) predicted and run for real (the module
    docstring); rows carry their rank."""
    world_size, rank = options.get("world_size", 1), options.get("rank")
    loop = {k: v for k, v in options.items() if k not in ("world_size", "rank", "deepspeed")}
    job = make_job(options["deepspeed"], world_size, 0)
    spec = make_spec(model, given, input_shape=shape, loss=loss, hf=hf, device="cpu", parallel=job, **loop)
    ranks = [rank] if rank is not None else list(range(world_size))
    reports = {r: analyze(spec.replace(parallel=make_job(job.config, world_size, r))) for r in ranks}
    check_budget(reports, world_size)
    train = spec.training.train
    source, batch = sources(spec, model, given)
    if loss is not None:
        pickled(loss, "`loss`")  # (a one-line refusal here, not a traceback from the spawn)
    first = next(iter(as_batch(batch).tensors()), None) if batch is not None else None
    micro = int(first.shape[0]) if first is not None and first.dim() else spec.shape[0]
    config = resolved(make_job(copy.deepcopy(job.config), world_size, 0), spec.module, micro)
    built = reports[ranks[0]].step.target if reports[ranks[0]].step is not None else None
    real = _Job(source, hf, built, None if batch is None else pickled(batch, "the inputs"), spec.shape, loss,
                train.optimizer, train.impl, config, torch.get_num_threads())
    return ranked(reports, run_ranks(real, world_size, _rank_main), tol, _rows)


def validate_deepspeed_trainer(model: nn.Module, training_args: object, inputs: object,
                               input_shape: Union[str, tuple, list, None], tol: float, world_size: int,
                               rank: Optional[int], trainer_class: Optional[type] = None) -> Validation:
    """A Trainer whose ``training_args`` name ``deepspeed``: each rank's prediction (the Trainer built per rank,
    accelerate running DeepSpeed: graphmem/deepspeed/trainer_capture.py) beside the real Trainer on ``world_size``
    gloo CPU processes, each building it from the same class and arguments (graphmem/deepspeed/trainer.py
    ``build_ds_trainer``) and stepping it with the runner the capture runs (``DeepSpeedRunner``: the Trainer's
    ``training_step``, accelerate's backward into ``engine.backward`` and ``engine.step``, clipping, the scheduler),
    twice; measured as the module docstring says."""
    from transformers import Trainer, TrainingArguments

    from graphmem.frontends.trainer_deepspeed import deepspeed_trainer_spec

    if not isinstance(training_args, TrainingArguments):
        raise UsageError(f"`training_args` is {type(training_args).__name__}, not transformers.TrainingArguments")

    ranks = [rank] if rank is not None else list(range(world_size))
    specs = {r: deepspeed_trainer_spec(model, training_args, inputs, input_shape, world_size, r, trainer_class)
             for r in ranks}  # (each rank's own job: its padding and partitions)
    reports = {r: analyze(s) for r, s in specs.items()}
    spec = specs[ranks[0]]
    p = deepspeed_of(trainer_class or Trainer, training_args, world_size, ranks[0])  # (the spec's recipe)
    check_budget(reports, world_size)
    # (the CLI's file reader parses into a local subclass of TrainingArguments, which cannot be pickled: its first
    # importable base, whose DeepSpeed Trainer places the model on no device either)
    args_class = next(c for c in p.args_class.__mro__ if "<locals>" not in c.__qualname__)
    job = _TrainerJob(pickled(model, "the model"), pickled(spec.inputs.captured, "the inputs"),
                      dataclasses.replace(p, args_class=args_class), torch.get_num_threads())
    return ranked(reports, run_ranks(job, world_size, _trainer_rank_main), tol, _rows)


@dataclass(frozen=True)
class _TrainerJob:
    model: bytes
    batch: bytes
    recipe: Any  # the TrainerDeepSpeed: the Trainer's class, its arguments' class and fields
    threads: int


def _rows(report: Analysis, m: dict[str, int], rank: int) -> list[Row]:
    from graphmem.passes import liveness

    lv = liveness(report.step)
    rows = [Row("saved for backward", report.activation_bytes, m["saved"], "exact", None, rank),
            Row("before the step", lv.baseline_bytes, m["before"], "exact", None, rank),
            Row("after the step", lv.end_bytes, m["after"], "exact", None, rank),
            Row("peak", report.peak_bytes, m["peak"], "tolerance", None, rank)]
    if report.budget is not None:
        rows.append(Row("peak (later steps)", report.budget.rank.later_peak_bytes, m["later"], "tolerance", None, rank))
    return rows


def _rank_main(rank: int, job: _Job, world_size: int, init: str, out: str) -> None:
    _ranked(rank, world_size, init, out, job.threads, lambda: _measure(job))


def _ranked(rank: int, world_size: int, init: str, out: str, threads: int, measure: Callable[[], dict[str, int]]) -> None:
    """A spawned rank: the launcher's environment (torchrun's, and DeepSpeed's CPU accelerator), the gloo job, its
    collectives settled; ``measure``'s figures written for the parent."""
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29500")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    torch.set_num_threads(threads)
    UNSETTLED[0] = 0
    settle_collectives(_MORE)
    try:
        with without_profiler_log(), quiet_third_party():  # (DeepSpeed's calls of torch's deprecated names)
            result = measure()
        torch.save({**result, "unsettled": UNSETTLED[0]}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _trainer_rank_main(rank: int, job: _TrainerJob, world_size: int, init: str, out: str) -> None:
    _ranked(rank, world_size, init, out, job.threads, lambda: _measure_trainer(job, rank))


def _measure_trainer(job: _TrainerJob, rank: int) -> dict[str, int]:
    import accelerate.utils.deepspeed  # noqa: F401
    import transformers.integrations.deepspeed  # noqa: F401
    from transformers import Trainer  # noqa: F401  (its imports' module-level tensors: not the rank's)

    from graphmem.deepspeed.trainer import DeepSpeedRunner, build_ds_trainer

    before_job = _before_job()
    torch.manual_seed(0)
    model = torch.load(io.BytesIO(job.model), weights_only=False)
    batch = torch.load(io.BytesIO(job.batch), weights_only=False)
    trainer = build_ds_trainer(job.recipe.at_rank(rank), model.train())
    runner = DeepSpeedRunner(trainer)
    with runner.session():
        runner.prepare()
        assert runner.engine is not None
        module = runner.engine.module
        # (the Trainer's loop drops each step's loss: tr_loss, which it keeps, is the runner's)
        return _two_steps(module, before_job, lambda saves: runner.run(module, batch, None, saves.set_phase, contextlib.nullcontext),
                          output_held=False)


def _measure(job: _Job) -> dict[str, int]:
    import deepspeed

    from graphmem.deepspeed.capture import micro_steps
    from graphmem.training.optim import make_optimizer

    before_job = _before_job()
    torch.manual_seed(0)
    module, batch, loss = built_for_real(job.model, job.hf, job.built, job.batch, job.shape, job.loss)
    optimizer = make_optimizer(job.optimizer, job.impl, [p for p in module.parameters() if p.requires_grad], "cpu") \
        if job.optimizer is not None else None
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=job.config)
    del module, optimizer
    return _two_steps(engine.module, before_job,
                      lambda saves: micro_steps(engine, batch, loss, contextlib.nullcontext, saves.set_phase, lambda: None))


def _before_job() -> set[int]:
    """What the imports left alive (not the rank's), DeepSpeed's inference-only op unbuilt (the module docstring)."""
    import deepspeed  # noqa: F401

    comm: Any = sys.modules["deepspeed.comm.torch"]
    comm.build_shm_op = lambda: None
    return set(_alive())


def _two_steps(module: nn.Module, before_job: set[int], step: Callable[[Saves], object],
               output_held: bool = True) -> dict[str, int]:
    """Two steps measured (the module docstring): the first's figures, the second's peak; ``output_held``: the
    step's output and loss are alive when it ends (a user's loop; a Trainer's drops them)."""
    kept: list[object] = []
    result: dict[str, int] = {}
    for i in range(2):
        before = _held(before_job, kept)
        saves = Saves(module)
        with profiled(saves) as prof:
            out = step(saves)
        after = _held(before_job, kept if output_held else [*kept, out])
        kept.append(out)  # (the previous step's output, alive until the next one returns; left out of the bytes held)
        high = running = 0
        for _, size in allocation_events(prof, set(_alive())):
            running += size
            high = max(high, running)
        if i == 0:
            result.update(saved=sum(saves.saved.values()), before=before, peak=before + high, after=after)
        else:
            result.update(later=before + high)
    return result


def _alive() -> dict[int, int]:
    """Every tensor's storage alive in this process, by address (meta tensors aside): its bytes."""
    out: dict[int, int] = {}
    for t in gc.get_objects():
        # (by type: isinstance reads an object's __class__, and torch.distributed.reduce_op's warns it is deprecated)
        if issubclass(type(t), torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            out[st.data_ptr()] = st.nbytes()
    return out


def _held(before_job: set[int], kept: list[object]) -> int:
    """The bytes alive now that the job holds: not what existed before it, nor the kept outputs' (walked through
    their attributes: transformers' outputs hold a cache object)."""
    gc.collect()
    skip = before_job | _walked(kept)
    return sum(n for a, n in _alive().items() if a not in skip)


def _walked(kept: list[object]) -> set[int]:
    found: set[int] = set()
    todo, seen = list(kept), set()
    while todo:
        o = todo.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            found |= addresses([o])
        elif isinstance(o, dict):
            todo.extend(o.values())
        elif isinstance(o, (list, tuple)):
            todo.extend(o)
        elif hasattr(o, "__dict__") and not isinstance(o, (nn.Module, type)):
            todo.extend(vars(o).values())
    return found


__all__ = ["validate_deepspeed", "validate_deepspeed_trainer"]
