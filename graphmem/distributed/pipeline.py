"""Pipeline parallelism: stage r's step as torch.distributed.pipelining's real schedules run it.

The model's chain of identical blocks (graphmem/chains.py) is split evenly over the stages
(``pp`` ranks, two virtual stages each for the interleaved schedule); stage 0 also runs the
model's own code before the first block (embeddings), the last stage the modules after the
last block (final norm, head) and the loss. Each stage is a ``PipelineStage`` on a submodule,
as users build them; rank r runs the real ``Schedule1F1B`` / ``ScheduleGPipe`` /
``ScheduleInterleaved1F1B`` ``step`` in this process on PyTorch's fake process group
(torch/testing/_internal/distributed/fake_pg.py: its send/recv complete at once and leave the
receive buffers as they are), on fake tensors, under graphmem's recorder. The step graph is
stage r's: its forward and backward of every micro-batch in the schedule's order, the
schedule's receive buffers, the loss and the merged output on the last stage.

Shapes are given to ``PipelineStage`` (``input_args``/``output_args``: its static mode, torch/
distributed/pipelining/stage.py ``PipelineStage.__init__``), so no metadata is exchanged.

Known limitations: the modules after the chain are applied in the order the model calls them,
one after another (checked: their output must have the model's output shape), so code the
model runs between them is not run; a stage after the first receives the block inputs other
than the hidden state (masks, rotary tables) computed once before the step, as torchtitan
precomputes them per stage; the batch's first tensor is the stage-0 input and the loss target.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.utils.stateless import _reparametrize_module

from graphmem.capture.autograd_tags import _tag_grad_fns, _tensors
from graphmem.capture.call_paths import module_names, module_order
from graphmem.capture.capture import marker
from graphmem.capture.fakes import Inputs, _fake_like, fake_batch, fake_state, forward_context
from graphmem.capture.hf_paths import real_paths
from graphmem.capture.recorder import _Recorder
from graphmem.capture.session import Recording
from graphmem.capture.target import Target
from graphmem.capture.values import Values
from graphmem.distributed.pipeline_stages import (
    Layout,
    Pipeline,
    block_inputs,
    build_schedule,
    make_pipeline,
    parent_tensors,
    probe,
    run_model,
    run_schedule,
    stage_loss,
)
from graphmem.fake_group import fake_group
from graphmem.stepgraph import StepGraph
from graphmem.training.batch import as_batch
from graphmem.training.loop import Session, TrainStep
from graphmem.training.optim import resolved_impl
from graphmem.training.step import LossFn

if TYPE_CHECKING:
    from torch.distributed.pipelining.stage import _PipelineStageBase

    from graphmem.distributed.pipeline_stages import Schedule
    from graphmem.passes.liveness import Liveness
    from graphmem.passes.saved import SavedSet


class _Held:
    """A work that holds its tensor until it is destroyed, as gloo's SendWork/RecvWork do
    (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp); the fake process group's FakeWork holds
    nothing, so without this a sent activation would die earlier than in a real run (the
    schedule keeps the last send's works until its next send: Schedule1F1B ``send_work``)."""

    def __init__(self, work: Optional[dist.Work], tensor: torch.Tensor) -> None:
        self.work, self.tensor = work, tensor

    def wait(self, *args: timedelta) -> bool:
        return self.work.wait(*args) if self.work is not None else True


@contextlib.contextmanager
def _works_hold_tensors() -> Iterator[None]:
    """Within: isend/irecv return works that hold their tensor; batch_isend_irecv issues them one
    by one (its path for a backend without coalescing, gloo's; torch/distributed/distributed_c10d.py)."""
    c10d = dist.distributed_c10d
    isend, irecv = c10d.isend, c10d.irecv

    def held(op: Callable[..., Optional[dist.Work]]) -> Callable[..., _Held]:
        def run(tensor: torch.Tensor, *args: object, **kwargs: object) -> _Held:
            return _Held(op(tensor, *args, **kwargs), tensor)
        return run

    def batch(ops: list[dist.P2POp]) -> list[object]:  # (each a _Held: the ops' isend/irecv are held's)
        return [op.op(op.tensor, op.peer, op.group, op.tag) for op in ops]

    patched = {"isend": held(isend), "irecv": held(irecv), "batch_isend_irecv": batch}
    originals = {name: getattr(c10d, name) for name in patched}
    for name, fn in patched.items():
        setattr(c10d, name, fn)
        setattr(dist, name, fn)
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(c10d, name, fn)
            setattr(dist, name, fn)


@dataclass(frozen=True)
class Segment:
    kind: str  # forward | loss | backward
    stage: int
    micro_batch: int
    first_op: int
    first_save: int


class StageGraph(StepGraph):
    """A stage's step interleaves micro-batches' forwards and backwards: an op's phase is its own."""

    def phase_of(self, index: int) -> str:
        return "before" if index < 0 else str(self.ops[min(index, self.num_ops - 1)].meta["phase"])


@dataclass(frozen=True)
class InFlight:
    """Micro-batches whose saved activations are held: at the peak and at most."""

    segments: tuple[Segment, ...]
    per_micro_batch: tuple[int, ...]  # saved bytes of each (stage, micro-batch) forward, in schedule order
    at_peak: int  # micro-batches (per stage) with activations held at the peak op
    bytes_at_peak: int
    most: int  # the most held at any op


def in_flight(g: StepGraph, segments: tuple[Segment, ...], peak: int) -> InFlight:
    owner: dict[int, tuple[int, int]] = {}  # save event index -> (stage, micro-batch)
    bounds = [s.first_save for s in segments] + [len(g.saves)]
    for seg, end in zip(segments, bounds[1:]):
        if seg.kind != "backward":
            for i in range(seg.first_save, end):
                owner[i] = (seg.stage, seg.micro_batch)
    per: dict[tuple[int, int], dict[int, int]] = {}
    for i, key in owner.items():
        e = g.saves[i]
        if g.storages[e.sid].kind not in ("parameter", "buffer"):
            per.setdefault(key, {})[e.sid] = g.storages[e.sid].nbytes

    def held(at: int) -> dict[tuple[int, int], set[int]]:
        out: dict[tuple[int, int], set[int]] = {}
        for i, key in owner.items():
            e = g.saves[i]
            if e.packed_at <= at and (e.released_at is None or e.released_at >= at) \
                    and g.storages[e.sid].kind not in ("parameter", "buffer"):
                out.setdefault(key, set()).add(e.sid)
        return out

    at = held(peak)
    starts = sorted({s.first_op for s in segments if s.kind == "backward"} | {g.num_ops - 1})
    most = max((len(held(i - 1)) for i in starts), default=0)  # holdings grow until a backward starts
    live_bytes = sum(g.storages[sid].nbytes for sid in set().union(*at.values()))
    return InFlight(segments, tuple(sum(v.values()) for v in per.values()), len(at), live_bytes, most)


def capture_stage(model: nn.Module, inputs: Inputs, loss: Optional[LossFn], target: Target,
                  plan: Pipeline, train: Optional[TrainStep] = None,
                  layout: Optional[Layout] = None) -> tuple[StageGraph, tuple[Segment, ...], Layout]:
    """Record rank ``plan.rank``'s step of the pipeline on fake tensors (see the module docstring);
    with ``train``'s optimizer, torch.optim's step over the stage's own parameters after the
    schedule (each rank steps its own stage's optimizer, as torchtitan does)."""
    context = forward_context(target, {}, contextlib.nullcontext)
    if layout is None:  # (the same for every rank of the pipeline: a caller capturing several passes it on)
        layout = probe(model, inputs, plan.micro_batches, target.param_dtype, context)
    # (a stage's recorder has never taken the CUDA target's recompute rules and fp32 norm statistics)
    rec = Recording(target, module_names(model), cuda_recorder_rules=False)
    segments: list[Segment] = []
    training = [(m, m.training) for m in model.modules()]
    try:
        for m in model.modules():
            m.training = True
        with fake_group(plan.rank, plan.pp), _works_hold_tensors():
            stage = _built(model, inputs, loss, plan, train, layout, rec, context)  # (held until the recorder closes)
            _phases(rec.cap, stage.schedule, stage.stages, segments, forward_context(target, {}, rec.cap.clearing_cache))
            with rec.hooks():
                grads, opt_start = _run_stage(rec, model, stage)
                g = _stage_graph(rec, segments, model, grads, stage.session, opt_start)
        return g, tuple(segments), layout
    finally:
        for m, was in training:
            m.training = was


@dataclass
class _Stage:
    """What rank r's stages run on, made before the step: the schedule and its stages, the stages' fake
    state (``state``; the parameters by name: ``fakes``, their storage ids: ``param_sid``), the model's own
    tensors its code reads (``root_state``), the stage's optimizer session and the batch."""

    schedule: Schedule
    stages: list[_PipelineStageBase]
    own: nn.ModuleList
    state: dict[str, torch.Tensor]
    fakes: dict[str, torch.Tensor]
    param_sid: dict[str, int]
    session: Optional[Session]
    root_state: dict[str, torch.Tensor]
    batch: torch.Tensor
    consts: tuple[tuple, dict]


def _built(model: nn.Module, inputs: Inputs, loss: Optional[LossFn], plan: Pipeline, train: Optional[TrainStep],
           layout: Layout, rec: Recording, context: Callable[[], ContextManager[object]]) -> _Stage:
    """The schedule and the stages' fake state, under the recording's fake mode (not recorded)."""
    cap, mode, target = rec.cap, rec.mode, rec.target
    device = torch.device("cpu")  # the CUDA target runs on fake CPU tensors (graphmem/capture/target.py)
    with mode:
        batch = as_batch(fake_batch(inputs, mode, device, target.param_dtype, mode.values).given).tensors()[0]
        consts = _consts(model, layout, batch, plan, target.param_dtype, context, mode.values)
        for i, t in enumerate(_tensors(consts)):  # held by the stage from before the step
            cap.preexisting(t, "external", f"stage constant {i} (the first block's inputs)")
        schedule, stages = build_schedule(model, layout, plan, stage_loss(model, loss), device, consts,
                                          batch.tensor_split(plan.micro_batches)[0])
        own = nn.ModuleList([s.submod for s in stages])
        for s in stages:
            cap.paths[id(s.submod)] = ("",)
        state, fakes, param_sid = _stage_state(model, own, cap, device, target.param_dtype)
        # the stage's optimizer, made before the step (its states are made by the step, lazily)
        session = Session(dataclasses.replace(train, micro_batches=1), fakes, target.device) \
            if train is not None and train.optimizer is not None else None
        root_state = {name: state[f"{k}.{attr}"] for k, s in enumerate(stages)  # the model's code reads them
                      for attr, name in parent_tensors(s).items()}
        if any(s.is_first or s.is_last for s in stages):
            cap.preexisting(batch, "input", "input")
    return _Stage(schedule, stages, own, state, fakes, param_sid, session, root_state, batch, consts)


def _run_stage(rec: Recording, model: nn.Module, stage: _Stage) -> tuple[list[int], Optional[int]]:
    """The schedule's step, then the stage's optimizer step if it has one, recorded: the gradients'
    storage ids and the first op of the optimizer step (None without one)."""
    opt_start = None
    with rec.running(type(model).__name__,
                     _reparametrize_module(stage.own, stage.state, tie_weights=True, strict=False, stack_weights=True),
                     _reparametrize_module(model, stage.root_state, strict=False, stack_weights=True),
                     real_paths(rec.mode.values)):
        out = run_schedule(stage.schedule, stage.stages, stage.batch)
        mark, grads = _mark_gradients(rec.cap, stage.param_sid, stage.fakes, stage.session, rec.target)
        del out
        if stage.session is not None:
            opt_start = len(rec.cap.ops)
            stage.session.optimizer_step(rec.cap.set_phase, mark, fake=True)
    return grads, opt_start


def _stage_state(model: nn.Module, own: nn.ModuleList, cap: _Recorder, device: torch.device,
                 dtype: Optional[torch.dtype]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, int]]:
    """The stages' own parameters and buffers as fakes, held by the recorder from before the step
    and named as in the model: the state to run them with, the parameters by name, and each
    parameter's storage id."""
    names = {id(t): n for n, t in [*model.named_parameters(remove_duplicate=False),
                                   *model.named_buffers(remove_duplicate=False)]}
    mine = dict([*own.named_parameters(remove_duplicate=False), *own.named_buffers(remove_duplicate=False)])
    param_sid: dict[str, int] = {}

    def held(t: torch.Tensor, kind: str, n: str) -> None:
        name = names.get(id(mine[n]), n)  # named as in the model
        cap.preexisting(t, kind, name)
        if kind == "parameter":
            param_sid[name] = cap.placeholders[-1].meta["storage"]
    state, seen = fake_state(own, device, dtype, held)
    fakes = {names.get(id(p), n): seen[id(p)] for n, p in own.named_parameters()}
    return state, fakes, param_sid


def _mark_gradients(cap: _Recorder, param_sid: dict[str, int], fakes: dict[str, torch.Tensor],
                    session: Optional[Session], target: Target
                    ) -> tuple[Callable[[str, list[tuple[str, torch.Tensor]]], None], list[int]]:
    """Mark the stage's gradients after the schedule ran; the marker (for the optimizer step) and
    the gradients' storage ids."""
    marked: dict[str, list[int]] = {}
    host_steps = session is not None and target.device == "cuda" and \
        resolved_impl(session.step.impl, target.device) != "fused"
    mark = marker(cap, param_sid, marked, host_steps)
    mark("gradient", [(n, p.grad) for n, p in fakes.items() if p.grad is not None])
    return mark, list(dict.fromkeys(marked.get("gradient", [])))


def _stage_graph(rec: Recording, segments: list[Segment], model: nn.Module, grads: list[int],
                 session: Optional[Session], opt_start: Optional[int]) -> StageGraph:
    """The recorded stage step as a graph; ``opt_start``: the first op of the optimizer step, if it ran."""
    # micro-batches' forwards and backwards interleave: each op keeps its own phase (StageGraph.phase_of);
    # phase_start says where the first backward begins
    n = len(rec.cap.ops)
    first_bwd = next((seg.first_op for seg in segments if seg.kind == "backward"), n)
    starts = {"forward": 0, "loss": first_bwd, "backward": first_bwd, "end": n}
    if opt_start is not None:  # (the optimizer step ran)
        starts = {**starts, "optimizer": opt_start}
    g = rec.graph(type(model).__name__, module_order(model), grads, StageGraph, starts, micro_steps=(),
                  train=session.step if session is not None else None)
    assert isinstance(g, StageGraph)
    return g


def _consts(model: nn.Module, layout: Layout, batch: torch.Tensor, plan: Pipeline, dtype: Optional[torch.dtype],
            context: Callable[[], ContextManager[object]], values: Optional[Values] = None) -> tuple[tuple, dict]:
    """The first block's inputs besides the hidden state, for stages after the first: the model's
    code before the chain run once before the step (unrecorded) on fake copies of its tensors,
    reading the batch's ``values`` as the stage's step does (graphmem/capture/values.py: no causal
    mask where the real run skips it)."""
    if plan.stages == (0,):
        return (), {}
    state: dict[str, torch.Tensor] = {}
    for path in (*layout.prologue, *layout.parents):
        holder = model.get_submodule(path)
        recurse = path not in layout.parents
        for name, t in [*holder.named_parameters(recurse=recurse), *holder.named_buffers(recurse=recurse)]:
            state[f"{path}.{name}".lstrip(".")] = _fake_like(t, torch.device("cpu"), dtype)
    mb = batch.tensor_split(plan.micro_batches)[0]
    with torch.no_grad(), _reparametrize_module(model, state, tie_weights=True, strict=False, stack_weights=True), \
            real_paths(values), context():
        args, kwargs = block_inputs(model, layout.chain, lambda: run_model(model, mb))
    return args[1:], kwargs


def _phases(cap: _Recorder, schedule: Any, stages: list[Any], segments: list[Segment],
            context: Callable[[], ContextManager[object]]) -> None:
    """Tell the recorder each forward, loss and backward of a micro-batch as the schedule runs
    it (wrapping this rank's own stage and schedule objects; ``schedule`` and ``stages``: a Schedule
    and its PipelineStages, typed Any as their methods are replaced on the instances)."""
    def mark(kind: str, stage: int, mb: int) -> None:
        cap.set_phase(kind)
        segments.append(Segment(kind, stage, mb, len(cap.ops), len(cap.saves)))

    for st in stages:
        fwd, bwd = st.forward_one_chunk, st.backward_one_chunk

        def forward_one_chunk(mb: int, *a: object, _f: Callable[..., object] = fwd, _s: _PipelineStageBase = st,
                              **k: object) -> object:
            mark("forward", _s.stage_index, mb)
            with context():
                return _f(mb, *a, **k)

        def backward_one_chunk(mb: int, *a: object, _f: Callable[..., object] = bwd, _s: _PipelineStageBase = st,
                               **k: object) -> object:
            mark("backward", _s.stage_index, mb)
            return _f(mb, *a, **k)

        st.forward_one_chunk, st.backward_one_chunk = forward_one_chunk, backward_one_chunk
    compute = schedule._compute_loss

    def compute_loss(output: torch.Tensor, target: torch.Tensor, *a: object, **k: object) -> torch.Tensor:
        last = segments[-1]
        mark("loss", last.stage, last.micro_batch)
        loss = compute(output, target, *a, **k)
        _tag_grad_fns(loss, "")
        return loss

    schedule._compute_loss = compute_loss


@dataclass(frozen=True)
class StageStep:
    """What graphmem.analyze builds rank r's Report from."""

    graph: StageGraph
    liveness: Liveness
    saved: SavedSet
    notes: tuple[str, ...]
    in_flight: InFlight
    blocks: tuple[tuple[int, int], ...]  # blocks [a, b) of each of this rank's stages
    layout: Layout  # the model's split (probed once; the same for every rank)


def analyze_stage(model: nn.Module, inputs: Inputs, loss: Optional[LossFn], target: Target,
                  plan: Pipeline, train: Optional[TrainStep] = None, layout: Optional[Layout] = None) -> StageStep:
    """Rank ``plan.rank``'s step graph, saved set, peak and micro-batches in flight (``train``:
    with its optimizer's step over the stage's parameters)."""
    from graphmem.passes import liveness, notes, saved

    g, segments, layout = capture_stage(model, inputs, loss, target, plan, train, layout)
    lv, sv = liveness(g), saved(g)
    flight = in_flight(g, segments, lv.peak_index)
    bounds = layout.bounds(plan.pp * plan.virtual)
    blocks = tuple(bounds[s] for s in plan.stages)
    where = ", ".join(f"stage {s} ({layout.chain.path}.{a}..{b - 1})" for s, (a, b) in zip(plan.stages, blocks))
    line = (f"{plan.describe()}, {where}: at the peak {flight.at_peak} micro-batches' activations held "
            f"({flight.bytes_at_peak:,} B), at most {flight.most}; forwards and backwards interleave from op "
            f"{g.phase_start['backward']} (each op's phase is its own)")
    return StageStep(g, lv, sv, (line, *notes(g)), flight, blocks, layout)


__all__ = ["Pipeline", "make_pipeline", "analyze_stage", "capture_stage", "StageStep", "InFlight"]
