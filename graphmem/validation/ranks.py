"""``graphmem.validate`` of a step split over ranks by PyTorch's own wrappers: the step the per-rank
analysis records on fake tensors (graphmem/distributed/capture.py) run for real in ``world_size``
CPU processes with the gloo backend (torch.multiprocessing.spawn, a file:// rendezvous in a
temporary directory), each rank wrapped by the same call (graphmem/distributed/wrappers.py
``apply_wrappers``: ``parallelize_module``, then ``fully_shard`` per unit, over meshes built by
graphmem/distributed/process_group.py ``device_meshes``), and compared rank by rank with
``graphmem.analyze(..., rank=r)``.

Each rank measures what graphmem/validation/measure.py measures on one device: the distinct
storages autograd saves in forward and loss (a DTensor's local shard; the model's parameters and
buffers excluded at each save, since FSDP2 registers the unsharded parameters during forward),
the bytes live before the step (rank r's local shards, buffers, the batch; with an optimizer, its
states before the later step) and the peak: those bytes plus the largest running sum of the CPU
allocator's events under torch.profiler. Every rank runs with the thread count the prediction
used (the CPU scratch rules depend on it: graphmem/oprules/).

Why the peak is measured as it is (tests/dist_truth.py found each): gloo's worker thread drops its
reference to a collective's Work, which holds the buffers, once it has run it, and a buffer whose
last reference dies there is freed on a thread the profiler does not watch: each collective is
waited on and held until gloo's thread has released its work (``_settle``,
graphmem/validation/settle.py: reference counts, no sleeps), so the last reference dies on the
rank's own thread, and a buffer the collective made and gloo's thread freed before that gets its
free at the end of the call. No free is missed, so one step (two with an optimizer) is measured,
once (``REPEATS``); a collective gloo's thread did not release is an error, not a guess.
Everything a step leaves is kept alive to the end (the allocator's profiler reporter,
c10/core/CPUAllocator.cpp, remembers blocks allocated while profiling: a block freed after one
profile would be reported in another's).

The tolerance is validate's (percent of the measured peak, default 1): the per-rank gaps measured
against real gloo jobs are the single-device ones, a few bytes (tests/distributed/test_distributed.py
SINGLE_GAP: 0 B, or 96 B for transformers' GPT-2's GELU scalars; tests/distributed/test_distributed_step.py
OPTIMIZER_GAP: 12 B in the for-loop AdamW's step), and the prediction is never above the real peak.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pickle
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.nn as nn

import graphmem.validation.measure as measure
from graphmem.api import analyze
from graphmem.capture.collector import quiet_gc
from graphmem.capture.hf import HFOptions
from graphmem.capture.load import load
from graphmem.capture.sac import through_hooks
from graphmem.capture.target import DTYPES, Target
from graphmem.distributed.fsdp import local
from graphmem.distributed.spec import Sharding, make_sharding
from graphmem.errors import GraphmemError, UsageError
from graphmem.report.live import Analysis
from graphmem.step.spec import ModelLike, Ranks, StepSpec, make_spec
from graphmem.training.batch import Batch, as_batch
from graphmem.training.loop import Session
from graphmem.training.spec import Training
from graphmem.training.step import LossFn, run_step
from graphmem.units import fmt_bytes
from graphmem.validation.profiler_log import without_profiler_log
from graphmem.validation.real import RAM_SHARE, available_memory, prepared, real_inputs
from graphmem.validation.result import Row, Validation, judge
from graphmem.validation.settle import PATIENCE, UNSETTLED, addresses, allocation_events, settle_collectives

REPEATS = 1  # wrapped models stepped per rank (the least peak of 3 was kept while frees were missed)
TRAINER_REPEATS = 3  # a Trainer's DDP ranks (trainer_ranks.py): the least peak of 3 (the Reducer's C++ collectives)
# the options that name the wrappers, with their defaults (graphmem.analyze's)
SHARDING: dict[str, Any] = {"world_size": 1, "rank": None, "fsdp": None, "reshard_after_forward": True,
                            "fsdp_param_dtype": None, "fsdp_reduce_dtype": None, "tp": 1, "sp": False,
                            "fsdp_no_sync": False, "loss_parallel": False}
# what validate does not run per rank, with their defaults: the formulas have no real wrapper, the rest is not run yet
UNSUPPORTED: dict[str, object] = {"zero": 0, "pp": 1, "schedule": "1f1b", "fsdp_offload": False, "parallel": None}


@dataclass(frozen=True)
class RankJob:
    """What each gloo rank needs to build and step the model, pickled to the spawned processes."""

    model: Union[str, bytes]  # a model file or preset (each rank builds it, as validate does) or a module, pickled
    hf: Optional[HFOptions]
    built: Optional[Target]  # load()'s target: a Hugging Face model's dtype and attention
    batch: Optional[bytes]  # the batch, pickled; None: each rank makes it for ``shape`` from the model file
    shape: tuple[int, ...]
    loss: Optional[LossFn]
    training: Training
    target: Target
    sharding: Sharding
    threads: int


def validate_ranks(model: ModelLike, given: Optional[Batch], shape: Optional[tuple[int, ...]], loss: Optional[LossFn],
                   hf: Optional[HFOptions], tol: float, options: dict[str, Any]) -> Validation:
    """The per-rank prediction (``graphmem.analyze(..., rank=r)``) of each rank ``options`` name (``rank``, else
    all of ``world_size``) beside a real gloo run of every rank; rows carry their rank."""
    refused = [k for k, d in UNSUPPORTED.items() if _set(options.get(k, d), d)]
    if refused or options.get("fsdp") not in (None, "fully_shard"):
        named = refused or [f"fsdp={options.get('fsdp')!r}"]
        raise UsageError(f"validate runs rank r's real step through fully_shard and parallelize_module only, not "
                         f"{', '.join(f'`{k}`' for k in named)} (`zero` and `fsdp='full'`/`'grad-op'` are formulas with "
                         "no wrapper to run; `pp`, `fsdp_offload` and a built `parallel` are not run for real yet): "
                         "drop it, or validate `fsdp='fully_shard'` or `tp`")
    if options.get("fsdp") is None and options.get("tp", 1) == 1:
        raise UsageError("nothing splits the step over ranks (no `fsdp='fully_shard'`, no `tp`): add one, "
                         "or drop `world_size`/`rank` to validate one device's step")
    sharding = _sharding(options)
    loop = {k: v for k, v in options.items() if k not in SHARDING and k not in UNSUPPORTED}
    spec = make_spec(model, given, input_shape=shape, loss=loss, hf=hf, device="cpu", parallel=Ranks(sharding), **loop)
    ranks = [options["rank"]] if options.get("rank") is not None else list(range(sharding.world_size))
    reports = {r: analyze(spec.replace(parallel=Ranks(dataclasses.replace(sharding, rank=r)))) for r in ranks}
    check_budget(reports, sharding.world_size)
    job = _job(spec, sharding, model, given, loss, hf, reports[ranks[0]])
    measured = run_ranks(job, sharding.world_size)  # (each rank drops kineto's log lines itself)
    return ranked(reports, measured, tol, _rows)


def ranked(reports: dict[int, Analysis], measured: list[dict[str, int]], tol: float,
           rows_of: Callable[[Analysis, dict[str, int], int], list[Row]]) -> Validation:
    """The Validation of each rank's report beside its measurement (``rows_of``: its rows), judged at ``tol``."""
    rows: list[Row] = []
    for r, report in reports.items():
        rows.extend(rows_of(report, measured[r], r))
    judged, reason = judge(tuple(rows), tol)
    first = next(iter(reports.values()))
    return Validation(first.model, "cpu", tuple(tuple(s) for s in first.input_shapes), tol, judged, reason, first)


def _sharding(options: dict[str, Any]) -> Sharding:
    """The wrappers the options name, always through them (``tp`` without ``rank`` would otherwise be
    Megatron's formula in graphmem.analyze, which has no real run); checked by make_sharding."""
    o = {k: options.get(k, d) for k, d in SHARDING.items()}
    return make_sharding(o["world_size"], o["rank"] or 0, o["fsdp"] == "fully_shard", o["reshard_after_forward"],
                         o["fsdp_param_dtype"], o["fsdp_reduce_dtype"], False, o["tp"], o["sp"], o["fsdp_no_sync"],
                         None, o["loss_parallel"])  # (the loop is checked with it where the spec is built)


def _set(value: object, default: object) -> bool:
    """Whether an option is set away from its default (``True == 1``, so the type counts too)."""
    return type(value) is not type(default) or value != default


def _rows(report: Analysis, m: dict[str, int], rank: int) -> list[Row]:
    rows = [Row("saved for backward", report.activation_bytes, m["saved"], "exact", None, rank),
            Row("before the step", report.baseline_bytes, m["baseline"], "exact", None, rank),
            Row("peak", report.peak_bytes, m["peak"], "tolerance", None, rank)]
    if "later" in m and report.budget is not None:
        b = report.budget.rank
        rows += [Row("optimizer states", b.row("optimizer states").size, m["states"], "exact", None, rank),
                 Row("peak (later steps)", b.later_peak_bytes, m["later"], "tolerance", None, rank)]
    return rows


def check_budget(reports: dict[int, Analysis], world_size: int) -> None:
    """All ranks run on this machine: refuse a job whose predicted peaks exceed half the available RAM."""
    per_rank = max(max(r.peak_bytes, r.budget.rank.later_peak_bytes if r.budget is not None else 0)
                   for r in reports.values())
    needed, budget = world_size * per_rank, int(available_memory() * RAM_SHARE)
    if needed > budget:
        raise UsageError(f"a real step on {world_size} ranks needs about {fmt_bytes(needed)} on this machine, over the "
                         f"safety budget of {fmt_bytes(budget)} ({RAM_SHARE:.0%} of the available RAM): validate a "
                         "smaller `input_shape` or configuration")


def pickled(what: object, name: str) -> bytes:
    buf = io.BytesIO()
    try:
        torch.save(what, buf)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise UsageError(f"the gloo ranks get {name} pickled, and it is not picklable ({type(e).__name__}): define it "
                         "(its class) at module level of an importable module, or give the model file") from None
    return buf.getvalue()


def sources(spec: StepSpec, model: ModelLike, given: Optional[Batch]) -> tuple[Union[str, bytes], Optional[Batch]]:
    """What each spawned rank builds the model and batch from: a module pickled (and the batch the analysis made for
    the shape, an HF model's own, made for real here, seed 0), or the model file or preset (each rank makes the batch
    from it when none is given)."""
    batch: Optional[Batch] = given
    if isinstance(model, nn.Module):
        source: Union[str, bytes] = pickled(model, "the model")
        if batch is None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                batch = as_batch(spec.inputs.make(spec.shape))
    else:
        spec_name = os.fspath(model)
        source = os.path.abspath(spec_name) if os.path.exists(spec_name) else spec_name
    return source, batch


def _job(spec: StepSpec, sharding: Sharding, model: ModelLike, given: Optional[Batch], loss: Optional[LossFn], hf: Optional[HFOptions],
         report: Analysis) -> RankJob:
    source, batch = sources(spec, model, given)
    if loss is not None:
        pickled(loss, "`loss`")
    built = report.step.target if report.step is not None else None
    return RankJob(source, hf, built, None if batch is None else pickled(batch, "the inputs"), spec.shape, loss,
                   spec.training, spec.target, sharding, torch.get_num_threads())


def run_ranks(job: Any, world_size: int, rank_main: Optional[Callable[..., None]] = None) -> list[dict[str, int]]:
    """Each rank's measurement (see ``_measure_rank``) from one real gloo job of ``world_size`` processes:
    ``rank_main(rank, job, world_size, init, out)`` in each (default ``_rank_main``: the wrappers' job; a DeepSpeed
    job's, graphmem/validation/deepspeed_ranks.py), each writing its figures and ``"unsettled"`` to ``out.{rank}``."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init, out = f"file://{os.path.join(tmp, 'store')}", os.path.join(tmp, "result")
        try:
            mp.spawn(rank_main or _rank_main, args=(job, world_size, init, out), nprocs=world_size, join=True)
        except mp.ProcessRaisedException as e:
            last = [line for line in str(e).strip().splitlines() if line.strip()][-1]
            raise GraphmemError(f"the real gloo run failed on a rank: {last}") from None
        except mp.ProcessExitedException as e:
            raise GraphmemError(f"a gloo rank exited with {e.exit_code} (out of memory?)") from None
        measured = [torch.load(f"{out}.{r}") for r in range(world_size)]
    for r, m in enumerate(measured):
        unsettled = m.pop("unsettled")
        if unsettled:
            raise GraphmemError(f"rank {r}: gloo's thread did not release {unsettled} collective(s) within "
                                f"{PATIENCE:.0f} s, so their frees may be unseen: rerun on a less loaded machine")
    return measured


def _rank_main(rank: int, job: RankJob, world_size: int, init: str, out: str) -> None:
    """A spawned rank: join the gloo job, step and measure, write the result for the parent."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    torch.set_num_threads(job.threads)  # (a spawned process: it ends with the job)
    _settle()
    try:
        with without_profiler_log():
            result = _measure_rank(job, dataclasses.replace(job.sharding, rank=rank))
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _settle() -> None:
    """Every collective FSDP2 and DTensor call (torch.distributed's, the functional ones) waited on,
    then held until gloo's thread has released its work: the last reference to their buffers then
    dies on this rank's profiled thread, not gloo's (graphmem/validation/settle.py; the module's
    docstring). ``UNSETTLED`` counts those not released. In a spawned rank process only; it ends
    with the job."""
    UNSETTLED[0] = 0
    settle_collectives()


def _measure_rank(job: RankJob, sharding: Sharding) -> dict[str, int]:
    """Rank ``sharding.rank``'s peaks (the least over ``REPEATS`` fresh wrapped models), saved and before-step bytes."""
    from graphmem.distributed.process_group import device_meshes
    from graphmem.distributed.wrappers import apply_wrappers

    meshes = device_meshes(sharding.world_size, sharding.tp, sharding.fsdp)
    kept: list[object] = []
    runs = []
    for _ in range(REPEATS):
        model, batch, loss_fn = _real(job)
        apply_wrappers(model, sharding, meshes)  # the call the per-rank capture makes
        runs.append(_steps(model, batch, loss_fn, job, sharding, kept))
    result = dict(runs[0])
    for key in ("peak", "later"):
        if key in result:
            result[key] = min(r[key] for r in runs)
    return {**result, "unsettled": UNSETTLED[0]}


def _real(job: RankJob) -> tuple[nn.Module, Batch, Optional[LossFn]]:
    """The model (its dtype, LoRA, quantization as the spec says), batch and loss, built for real on this rank."""
    module, batch, loss = built_for_real(job.model, job.hf, job.built, job.batch, job.shape, job.loss)
    return prepared(module, job.training, job.target).train(), batch, loss


def built_for_real(model: Union[str, bytes], hf: Optional[HFOptions], built: Optional[Target], batch: Optional[bytes],
                   shape: tuple[int, ...], loss: Optional[LossFn]) -> tuple[nn.Module, Batch, Optional[LossFn]]:
    """A spawned rank's model (in training mode), batch and loss (``sources``'), built for real as validate builds
    them on one device (seed 0): the module unpickled, or the file or preset loaded for ``built`` (load()'s target:
    a Hugging Face model's dtype and attention); the batch unpickled, or made for ``shape`` from the model file."""
    torch.manual_seed(0)
    if isinstance(model, bytes):
        module, loaded = torch.load(io.BytesIO(model), weights_only=False), None
    else:
        loaded = load(model, device="cpu", target=built, options=hf)
        module, loss = loaded.module, loss or loaded.loss
    if batch is not None:
        return module.train(), as_batch(torch.load(io.BytesIO(batch), weights_only=False)), loss
    if loaded is None:  # (``sources`` pickles a batch with every module)
        raise UsageError("give the inputs (or `input_shape`) for the real ranks")
    return module.train(), real_inputs(loaded, shape, torch.device("cpu")), loss


class Saves:
    """saved_tensors_hooks counting the distinct storages saved in forward and loss (a DTensor's local
    shard), the model's parameters and buffers as registered at that moment excluded."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.phase, self.saved = model, "forward", {}  # type: ignore[var-annotated]

    def set_phase(self, phase: str) -> None:
        if phase == "forward":  # a later micro-step: the last one's saved set is the step's
            self.saved.clear()
        self.phase = phase

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = local(t).untyped_storage()
        if self.phase in ("forward", "loss") and st._cdata not in _storages(_held(self.model)):
            self.saved[st._cdata] = st.nbytes()
        return t


def _held(model: nn.Module) -> list[torch.Tensor]:
    return [local(t) for t in (*model.parameters(), *model.buffers())]


def _storages(tensors: list[torch.Tensor]) -> dict[int, int]:
    return {local(t).untyped_storage()._cdata: local(t).untyped_storage().nbytes() for t in tensors}


def _steps(model: nn.Module, batch: Batch, loss_fn: Optional[LossFn], job: RankJob, sharding: Sharding,
           kept: list[object]) -> dict[str, int]:
    """One real step (two with an optimizer: the later one starts with its states) of the wrapped model:
    the loop the capture runs (graphmem/training/loop.py), FSDP2's gradient sync as the spec says."""
    from graphmem.distributed.tensor_parallel import step_context

    train = job.training.train if job.training.train.active else None
    session = Session(train, dict(model.named_parameters()), "cpu") if train is not None else None
    context = measure._autocast(DTYPES[job.target.amp] if job.target.amp else None)
    saves, result = Saves(model), dict[str, int]()

    def sync(i: int, runs: int) -> None:
        if sharding.no_sync and sharding.fsdp:
            model.set_requires_gradient_sync(i == runs - 1)  # type: ignore[operator]

    states = lambda: [t for _, _, t in session.state_tensors()] if session is not None else []  # noqa: E731
    for i in range(2 if session is not None and session.optimizer is not None else 1):
        masters = list(session.masters.values()) if session is not None else []
        baseline = sum(_storages(_held(model) + list(batch.tensors()) + masters + states()).values())
        with profiled(saves) as prof, step_context(sharding):
            if session is None:
                out, loss = run_step(model, batch, loss_fn, saves.set_phase, context)
            else:
                out, loss = session.run(model, batch, loss_fn, saves.set_phase, context, micro_step=sync)
        held = addresses([*_held(model), *(p.grad for p in model.parameters() if p.grad is not None),
                          *batch.tensors(), *masters, *states(), out, loss])
        kept.append((out, loss))  # freed after profiling would confuse the next profile (see the module's docstring)
        record(result, i, prof, held, saves, baseline, states())
    kept.append((model, batch, session))
    return result


@contextlib.contextmanager
def profiled(saves: Saves, pack: Optional[Callable[[torch.Tensor], object]] = None
             ) -> Iterator[torch.profiler.profile]:
    """Around one real step on a rank (here and graphmem/validation/trainer_fsdp_rank.py): the CPU
    profiler's memory events (yielded), ``saves`` counting what is saved (through ``pack`` where given:
    its pack hook wrapped), garbage collection held off."""
    with quiet_gc(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                     profile_memory=True) as prof, \
            torch.autograd.graph.saved_tensors_hooks(pack or saves.pack, lambda t: t), through_hooks():
        yield prof


def record(result: dict[str, int], i: int, prof: torch.profiler.profile, held: set[int], saves: Saves, baseline: int,
           states: list[torch.Tensor]) -> None:
    """Step ``i``'s figures into ``result``: its peak is ``baseline`` plus the largest running sum of the
    profile's allocation events (``held``: the addresses alive after it); the first step's saved and
    before-step bytes, or the later step's optimizer ``states``."""
    high = running = 0
    for _, size in allocation_events(prof, held):
        running += size
        high = max(high, running)
    if i == 0:
        result.update(saved=sum(saves.saved.values()), baseline=baseline, peak=baseline + high)
    else:
        result.update(later=baseline + high, states=sum(_storages(states).values()))
