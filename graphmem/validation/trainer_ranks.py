"""``graphmem.validate(trainer, world_size=N)``: each rank's prediction (``graphmem.analyze(trainer,
world_size=N, rank=r)``, graphmem/training/hf_trainer_ddp.py) beside a REAL job of N CPU processes
over gloo (torch.multiprocessing.spawn), each rank rebuilding the same Trainer as a ``torchrun`` job
builds it: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the
environment, which accelerate's PartialState reads when the TrainingArguments (``use_cpu=True``) set
up their device, so the accelerator is MULTI_CPU over gloo and ``accelerator.prepare_model`` wraps the
model in ``DistributedDataParallel`` itself (accelerate 1.15 ``accelerator.py`` 2058-2060). What each
rank gets: the Trainer's class and its TrainingArguments' class (importable by name) with the
arguments' init fields, the model pickled (as graphmem/validation/ranks.py pickles a module) and the
batch the prediction used, pickled.

Each rank measures what the one-process Trainer validation measures (graphmem/validation/trainer.py,
graphmem/validation/measure.py with the Trainer's own step, ``TrainerRunner``) on a Trainer of its own
per figure (a fresh DDP: its first step, or a later one after one unmeasured step), with one
difference of order: ``prepare_model`` runs before the profiled step, not inside it. It moves the
model to ``accelerator.device`` (``cpu:0`` on a MULTI_CPU job; ``Tensor.to`` from ``cpu`` copies every
parameter, whose old storage then dies unseen by the allocator's profiler reporter), so the model is
moved first, and ``prepare_model`` then runs under its own profile: what it allocates and still holds
(DDP's Reducer's flat gradient buckets, reducer.cpp ``initialize_buckets``, and with
``find_unused_parameters`` its used-parameter maps), the net of the allocator's events there, is held
before and through the step, as the prediction holds the buckets. DDP's constructor's own collectives
(the shape check and the broadcast of rank 0's parameters) run right after that profile, not inside
it (``_deferred_sync``): their buffers may die on gloo's thread, unseen. The gathers accelerate calls
(``get_batch_samples``' token count) are waited on and held until gloo's thread has released them, so
their buffers die on the rank's own thread (graphmem/validation/settle.py); DDP's all-reduce runs in
place on the Reducer's buckets, in C++, out of Python's reach (a 4 B block of one of its small
collectives was seen to die unseen in one run of two: tests/zero_truth.py). A free the profiler
misses only raises the running sum: each peak is the least of ``TRAINER_REPEATS`` runs. Saved and
before-step bytes must match exactly; the peaks within validate's
tolerance (measured gaps: docs/trainer.md).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import os
import socket
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
import torch.nn as nn

from graphmem.api import analyze
from graphmem.capture.collector import quiet_gc
from graphmem.errors import GraphmemError, UsageError
from graphmem.report.live import Analysis
from graphmem.step.spec import UserInputs
from graphmem.training.batch import as_batch
from graphmem.validation.profiler_log import without_profiler_log
from graphmem.validation.ranks import TRAINER_REPEATS, check_budget, pickled
from graphmem.validation.result import Row, Validation, judge
from graphmem.validation.settle import PATIENCE, UNSETTLED, settle_collectives

if TYPE_CHECKING:
    from transformers import Trainer, TrainingArguments


@dataclass(frozen=True)
class TrainerJob:
    """What each gloo rank needs to rebuild the Trainer and step it, pickled to the spawned processes."""

    trainer_class: tuple[str, str]  # (module, qualified name)
    args_class: tuple[str, str]
    args: dict[str, object]  # the TrainingArguments' init fields
    model: bytes  # the model, pickled
    batch: bytes  # the batch the prediction used, pickled
    threads: int  # the prediction's thread count (the CPU scratch rules depend on it: graphmem/oprules/)
    compiled: bool = False  # torch_compile: each rank compiles before it measures (``_measure_rank``)
    fsdp: bool = False  # the arguments ask for FSDP: accelerate's FSDP2 job (graphmem/validation/trainer_fsdp.py)


def validate_trainer_ranks(trainer: Any, inputs: Optional[UserInputs], world_size: int, rank: Optional[int], tol: float) -> Validation:
    """Each rank's (``rank``, else all ``world_size``) prediction beside the real gloo job; rows carry their rank."""
    job = trainer_job(trainer, inputs)
    ranks = [rank] if rank is not None else list(range(world_size))
    reports = {r: analyze(trainer, inputs, world_size=world_size, rank=r) for r in ranks}
    check_budget(reports, world_size)
    measured = run_trainer_ranks(job, world_size)
    rows: list[Row] = []
    # Inductor's fused kernels lower a compiled step's peak below its graphs run op by op (graphmem/validation/trainer.py)
    peak = "info" if trainer.args.torch_compile and trainer.args.torch_compile_backend == "inductor" else "tolerance"
    for r, report in reports.items():
        rows.extend(_rows(report, measured[r], r, peak))
    judged, reason = judge(tuple(rows), tol)
    shapes = tuple(tuple(x.shape) for x in as_batch(inputs).tensors())
    return Validation(reports[ranks[0]].model, "cpu", shapes, tol, judged, reason, reports[ranks[0]])


def _rows(report: Analysis, m: dict[str, int], rank: int, peak: str = "tolerance") -> list[Row]:
    """The one-process Trainer validation's rows (graphmem/validation/trainer.py), for one rank."""
    budget = report.budget
    assert budget is not None
    return [Row("saved for backward", report.activation_bytes, m["saved"], "exact", None, rank),
            Row("before the step", report.baseline_bytes, m["baseline"], "exact", None, rank),
            Row("optimizer states", budget.row("optimizer states").size, m["states"], "exact", None, rank),
            Row("peak", budget.peak_bytes, m["peak"], peak, None, rank),
            Row("peak (later steps)", budget.rank.later_peak_bytes, m["later"], peak, None, rank)]


def _importable(cls: type) -> Optional[tuple[str, str]]:
    """(module, qualified name) when importing that name gives ``cls`` back, else None."""
    name = cls.__qualname__
    if "<locals>" in name:
        return None
    try:
        found: object = importlib.import_module(cls.__module__)
        for part in name.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return None
    return (cls.__module__, name) if found is cls else None


def _args_class(args: TrainingArguments) -> Optional[tuple[str, str]]:
    """The arguments' class, or the nearest importable base with the same fields (graphmem/frontends/trainer.py's
    ``InPlace`` only overrides ``place_model_on_device``, which a model built on the CPU does not need)."""
    fields = [f.name for f in dataclasses.fields(args)]
    for cls in type(args).__mro__:
        if dataclasses.is_dataclass(cls) and [f.name for f in dataclasses.fields(cls)] == fields:
            named = _importable(cls)
            if named is not None:
                return named
    return None


def trainer_job(trainer: Trainer, inputs: object) -> TrainerJob:
    """What the ranks rebuild the Trainer from; a Trainer that cannot be rebuilt in another process is
    refused in one line naming what to change."""
    trainer_class, args_class = _importable(type(trainer)), _args_class(trainer.args)
    if trainer_class is None:
        raise UsageError(f"each gloo rank rebuilds the Trainer by its class, and {type(trainer).__qualname__} is not "
                         "importable by name: define it at module level of an importable module")
    if args_class is None:
        raise UsageError(f"each gloo rank rebuilds the TrainingArguments by their class, and "
                         f"{type(trainer.args).__qualname__} is not importable by name: define it at module level of an "
                         "importable module, or use transformers.TrainingArguments")
    if trainer.optimizer is not None:
        raise UsageError("each gloo rank rebuilds the Trainer from its model and TrainingArguments, not from objects "
                         "given to it: drop `optimizers=` and name the optimizer with `optim` in the TrainingArguments")
    if getattr(trainer, "compute_loss_func", None) is not None:
        raise UsageError("each gloo rank rebuilds the Trainer from its model and TrainingArguments, not from objects "
                         "given to it: drop `compute_loss_func`, or override compute_loss in an importable subclass")
    args = {f.name: getattr(trainer.args, f.name) for f in dataclasses.fields(trainer.args) if f.init}
    pickled(args, "the TrainingArguments")
    return TrainerJob(trainer_class, args_class, args, pickled(trainer.model, "the model"),
                      pickled(inputs, "the inputs"), torch.get_num_threads(), bool(trainer.args.torch_compile))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_trainer_ranks(job: TrainerJob, world_size: int) -> list[dict[str, int]]:
    """Each rank's measurement (``_measure_rank``) from one real gloo job of ``world_size`` processes."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        try:
            mp.spawn(_rank_main, args=(job, world_size, _free_port(), out), nprocs=world_size, join=True)
        except mp.ProcessRaisedException as e:
            last = [line for line in str(e).strip().splitlines() if line.strip()][-1]
            raise GraphmemError(f"the real gloo run failed on a rank: {last}") from None
        except mp.ProcessExitedException as e:
            raise GraphmemError(f"a gloo rank exited with {e.exit_code} (out of memory?)") from None
        return [torch.load(f"{out}.{r}") for r in range(world_size)]


def _rank_main(rank: int, job: TrainerJob, world_size: int, port: int, out: str) -> None:
    """A spawned rank: a torchrun rank's environment, the measurement, the result written for the parent."""
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(job.threads)  # (a spawned process: it ends with the job)
    if job.fsdp:  # accelerate's PartialState leaves the thread count as it is (graphmem/training/hf_trainer_fsdp.py)
        os.environ["OMP_NUM_THREADS"] = str(job.threads)
    settle_collectives()
    try:
        with without_profiler_log():
            result = _measure_rank(job, world_size)
        torch.save(result, f"{out}.{rank}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _named(where: tuple[str, str]) -> Any:
    """The object a (module, qualified name) pair names."""
    found: object = importlib.import_module(where[0])
    for part in where[1].split("."):
        found = getattr(found, part)
    return found


def _rebuild(job: TrainerJob) -> Any:
    """The Trainer as this rank of the job builds it (its arguments set up the gloo process group)."""
    named = _named
    torch.manual_seed(0)
    model = torch.load(io.BytesIO(job.model), weights_only=False)
    return named(job.trainer_class)(model=model, args=named(job.args_class)(**job.args))


def _measure_rank(job: TrainerJob, world_size: int) -> dict[str, int]:
    """This rank's figures: the first step's least peak and before-step bytes (a free the profiler misses only
    raises either), saved and state bytes, over ``TRAINER_REPEATS`` fresh Trainers, and a later step's least
    peak over as many (each after one unmeasured step)."""
    if job.fsdp:
        from graphmem.validation.trainer_fsdp_rank import measure_fsdp_rank

        result = measure_fsdp_rank(job, _named)
        if UNSETTLED[0]:
            raise GraphmemError(f"gloo's thread did not release {UNSETTLED[0]} collective(s) within {PATIENCE:.0f} s: "
                                "the machine is too loaded to measure; run validate again on a quieter one")
        return result
    kept: list[object] = []
    if job.compiled:  # compiled by a Trainer of its own (as measure_trainer compiles first): the measured steps
        _measured(job, world_size, 0, kept)  # run dynamo's cached code (its guards do not name the model object)
    first = [_measured(job, world_size, 0, kept) for _ in range(TRAINER_REPEATS)]
    later = [_measured(job, world_size, 1, kept) for _ in range(TRAINER_REPEATS)]
    result = dict(first[0])
    result["peak"], result["baseline"] = min(r["peak"] for r in first), min(r["baseline"] for r in first)
    result["later"] = min(r["peak"] for r in later)
    if UNSETTLED[0]:
        raise GraphmemError(f"gloo's thread did not release {UNSETTLED[0]} collective(s) within {PATIENCE:.0f} s: "
                            "the machine is too loaded to measure; run validate again on a quieter one")
    return result


@contextlib.contextmanager
def _deferred_sync() -> Iterator[list[Callable[[], object]]]:
    """DDP's constructor's collectives (torch/nn/parallel/distributed.py: ``_verify_param_shape_across_processes``,
    then ``_sync_module_states``, whose coalesced broadcast buffers may die on gloo's thread, unseen by the
    profiler: measured, rank 1 once read the whole 107,168 B flat buffer as held) recorded, to be run by the
    caller in the same order once the profile is over: they only check shapes and copy rank 0's values in
    (every rank's model is the same pickle here), and hold nothing afterwards."""
    import torch.nn.parallel.distributed as ddp_module

    names = ("_verify_param_shape_across_processes", "_sync_module_states")
    originals = {n: getattr(ddp_module, n) for n in names}
    calls: list[Callable[[], object]] = []

    def recorder(name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: calls.append(lambda: originals[name](*args, **kwargs))

    for n in names:
        setattr(ddp_module, n, recorder(n))
    try:
        yield calls
    finally:
        for n in names:
            setattr(ddp_module, n, originals[n])


def _held_by_ddp(prof: Any, model: nn.Module) -> int:
    """What ``prepare_model`` allocated and still holds, less the model's copies on ``cpu:0`` (the blocks of
    the parameters' and buffers' storages now: made there, each original's free unseen): DDP's buckets and
    used-parameter maps."""
    from torch._C._profiler import _EventType

    live: dict[int, int] = {}
    todo = list(prof.profiler.kineto_results.experimental_event_tree())
    events = []
    while todo:
        e = todo.pop()
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr))
        todo.extend(e.children)
    for _, size, ptr in sorted(events):
        if size > 0:
            live[ptr] = size
        else:
            live.pop(ptr, None)
    moved = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    return sum(size for ptr, size in live.items() if ptr not in moved)


def _measured(job: TrainerJob, world_size: int, warm_steps: int, kept: list[object]) -> dict[str, int]:
    """One fresh Trainer's step (after ``warm_steps`` unmeasured ones), measured as on one device
    (graphmem/validation/measure.py ``measure_peak`` with the Trainer's runner), DDP made by accelerate."""
    import graphmem.validation.measure as measure
    from graphmem.training.hf_trainer import TrainerRunner

    trainer = _rebuild(job)
    acc = trainer.accelerator
    if acc.distributed_type.value != "MULTI_CPU" or acc.num_processes != world_size:
        raise GraphmemError(f"the rebuilt Trainer's accelerator is {acc.distributed_type.value} on {acc.num_processes} "
                            f"processes, not MULTI_CPU on {world_size}")
    batch, model = torch.load(io.BytesIO(job.batch), weights_only=False), trainer.model
    with quiet_gc(), _deferred_sync() as calls, \
            torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        ddp = acc.prepare_model(model)
    held = _held_by_ddp(prof, model)
    for call in calls:  # DDP's initial shape check and broadcast, after the window (``_deferred_sync``)
        call()
    inner = getattr(ddp, "_orig_mod", ddp)  # torch_compile: torch.compile over DDP (accelerate 1.15 accelerator.py 2068-2073)
    if type(inner).__name__ != "DistributedDataParallel":
        raise GraphmemError(f"accelerate's prepare_model returned {type(inner).__name__}, not DistributedDataParallel")
    with TrainerRunner(trainer, launched=ddp).session() as runner:
        with torch.random.fork_rng():
            m = measure.measure_peak(model, batch, runner=runner, warm_steps=warm_steps)
    kept.append((trainer, ddp, batch))  # freed after profiling would confuse the next profile (ranks.py)
    return {"saved": m.saved_bytes, "baseline": m.baseline_bytes + held, "peak": m.peak_bytes + held,
            "states": m.state_bytes, "held": held}


__all__ = ["TrainerJob", "run_trainer_ranks", "trainer_job", "validate_trainer_ranks"]
