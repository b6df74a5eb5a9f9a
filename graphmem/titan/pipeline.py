"""A torchtitan pipeline's stage metadata, inferred on one rank.

On a cluster, torch's ``PipelineStage`` infers what each stage receives and sends at the first
step: a vote over point-to-point messages picks dynamic inference, then every stage runs its
forward on the first micro-batch and sends its outputs' metadata to the next stage
(torch/distributed/pipelining/stage.py ``_forward_metadata_inference``). A fake process group
exchanges no data, so torch refuses that there unless each stage was given complete static
metadata (schedules.py ``_warmup_p2p``), and torchtitan gives none
(torchtitan/distributed/pipeline_parallel.py ``_pipeline_module_split``).

graphmem first infers every stage's inputs and outputs locally, in stage order, on the same first
micro-batch, outside the recording: stage 0 runs on its first micro-batch (the schedule's, or on a
rank without stage 0 the inputs torchtitan's ``post_dataloading_process`` made and did not pass),
each later stage on the previous one's output. A stage this rank holds runs as built; a stage
another rank holds is built the way torchtitan built this rank's (its own ``_split_module`` of the
whole model, then the job's ``parallelize_fn`` with the same arguments, ``to_empty``). Each local
stage gets those as static metadata (``_user_meta``, what its constructor's ``input_args`` /
``output_args`` fill). Then torch's own dynamic inference runs on this rank's stages, as on a
cluster's first step (``_exchanged``): each stage's forward and, where its inputs need grad, its
backward, with what another rank would send answered from the local inference; torch checks it
against the static metadata. Those ops are recorded as the first step's own
(``StepGraph.first_step_only``): later steps run without them and keep what they made (the
receive buffers), and their saves are not activations.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Union

import torch
import torch.nn as nn

from graphmem.capture.recorder import _Recorder

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining._utils import _StageBackwardMeta, _StageForwardMeta
    from torch.distributed.pipelining.schedules import _PipelineSchedule
    from torch.distributed.pipelining.stage import PipelineStage
    from torchtitan.trainer import Trainer


class _Seen:
    """What torchtitan's pipelining function was called with: the whole model (on meta), the
    module names of every stage, the device, the parallelize function and its arguments."""

    def __init__(self) -> None:
        self.whole: Optional[nn.Module] = None
        self.names: list[list[str]] = []
        self.device: Optional[torch.device] = None
        self.parallelize: Callable[..., nn.Module] | None = None
        self.kwargs: dict[str, object] = {}
        self.first: tuple | None = None  # the first micro-batch's arguments of stage 0
        self.outputs: dict[int, tuple] = {}  # stage index -> its outputs' metadata


@contextlib.contextmanager
def static_stages(cfg: Trainer.Config, cap: _Recorder) -> Iterator[None]:
    """Around the building and the step of the job ``cfg`` (a prepared ``Trainer.Config``):
    before the schedule's first step, each local pipeline stage gets its metadata (the module
    docstring) and torch's own inference runs, recorded as the first step's own ops."""
    from torch.distributed.pipelining.schedules import _PipelineSchedule
    from torchtitan.distributed import pipeline_parallel
    from torchtitan.trainer import Trainer

    spec = cfg.model_spec
    seen = _Seen()
    pipelining, split, init = spec.pipelining_fn, pipeline_parallel._pipeline_module_split, \
        _PipelineSchedule._initialize_pp_stages
    batch = Trainer.post_dataloading_process
    if pipelining is None:
        yield
        return

    def observed(model: nn.Module, *, parallelize_fn: Callable[..., nn.Module],
                 **kwargs: object) -> tuple[_PipelineSchedule, list[nn.Module], bool, bool]:
        def recorded(m: nn.Module, **pkw: object) -> nn.Module:
            seen.parallelize, seen.kwargs = parallelize_fn, pkw
            return parallelize_fn(m, **pkw)
        return pipelining(model, **{**kwargs, "parallelize_fn": recorded})

    def splitting(whole: nn.Module, pp_mesh: DeviceMesh, schedule: str, device: torch.device, names: list[list[str]],
                  *args: object, **kwargs: object) -> tuple[list[PipelineStage], list[nn.Module]]:
        seen.whole, seen.names, seen.device = whole, names, device
        return split(whole, pp_mesh, schedule, device, names, *args, **kwargs)

    def processed(trainer: Trainer, *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor, dict[str, object]]:
        out = batch(trainer, *args, **kwargs)  # (inputs, labels, extra_kwargs): stage 0 runs on inputs
        if seen.first is None:
            seen.first = (out[0],)
        return out

    def initialized(schedule: _PipelineSchedule, stages: list, args: object, kwargs: Optional[dict[str, object]],
                    *rest: Any, **kw: Any) -> object:  # the rest as this torch's _initialize_pp_stages takes them
        if seen.whole is None or not any(getattr(s, "_user_meta", None) is not None
                                         and s._user_meta.inputs is None for s in stages):
            return init(schedule, stages, args, kwargs, *rest, **kw)
        with cap.paused(), torch.random.fork_rng(devices=[]), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(_kept, _kept):
            _infer(seen, stages, args if any(s.is_first for s in stages) else seen.first, kwargs or {})
        start, phase = len(cap.ops), cap.phase
        cap.phase = "setup"  # its saves are not the step's activations (passes/saved.py counts forward and loss)
        try:
            with _exchanged(seen.outputs), _unhooked():
                return init(schedule, stages, args, kwargs, *rest, **kw)
        finally:
            cap.phase, cap.first_step_only = phase, (start, len(cap.ops))

    spec.pipelining_fn, pipeline_parallel._pipeline_module_split = observed, splitting
    _PipelineSchedule._initialize_pp_stages = initialized  # type: ignore[method-assign,assignment]
    Trainer.post_dataloading_process = processed  # type: ignore[method-assign]
    try:
        yield
    finally:
        spec.pipelining_fn, pipeline_parallel._pipeline_module_split = pipelining, split
        _PipelineSchedule._initialize_pp_stages = init  # type: ignore[method-assign]
        Trainer.post_dataloading_process = batch  # type: ignore[method-assign]


@contextlib.contextmanager
def _unhooked() -> Iterator[None]:
    """No saved-tensor hooks while torch infers the metadata: a stage whose inputs need no grad
    (stage 0) never runs its inference backward, and its graph must die when torch drops it in
    the cleanup, as it does without hooks; a pack hook that returns the tensor would hold each
    saved output through its own grad_fn, a cycle through C++ no collection frees. (Its saves are
    not the step's activations either.)"""
    stack = []
    while torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        stack.append(torch._C._autograd._top_saved_tensors_default_hooks(False))
        torch._C._autograd._pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(stack):
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


def _kept(t: torch.Tensor) -> torch.Tensor:
    """The inference forward's saves, outside the step's (its graph is dropped unused)."""
    return t


def _infer(seen: _Seen, stages: list, args: object, kwargs: dict[str, object]) -> None:
    """Run stages 0 .. the last local one in order on the first micro-batch (``args``,
    ``kwargs``, as the schedule passes them to every stage) and give each local stage its
    inputs and outputs as static metadata."""
    from torch.distributed.pipelining._utils import _StageMeta, extract_tensor_metas

    local = {s.stage_index: s for s in stages}
    inputs: tuple = args if isinstance(args, tuple) else (args,)
    for index in range(max(local) + 1):
        module = local[index].submod if index in local else _built(seen, index)
        out = module(*inputs, **kwargs)
        outputs = out if isinstance(out, tuple) else (out,)
        seen.outputs[index] = extract_tensor_metas(outputs) or ()
        stage = local.get(index)
        if stage is not None:
            grads = _grads_if_distributed(inputs, outputs)
            stage._user_meta = _StageMeta(
                inputs=extract_tensor_metas(inputs), outputs=extract_tensor_metas(outputs),
                input_grads=extract_tensor_metas(grads[0], allow_none=True) if grads else None,
                output_grads=extract_tensor_metas(grads[1], allow_none=True) if grads else None)
        inputs = outputs


@contextlib.contextmanager
def _exchanged(outputs: dict[int, tuple]) -> Iterator[None]:
    """torch's own dynamic inference on this rank's stages, as on a cluster's first step: each
    stage runs its forward and backward on the first micro-batch (stage.py
    ``_forward_metadata_inference``, ``_backward_metadata_inference``), what another rank's stage
    would send answered from the local inference (``outputs``), nothing sent; its ops are
    recorded as the first step's only (``first_step_only``), and torch checks them against the
    static metadata (``_validate_inferred_metadata``)."""
    from torch.distributed.pipelining._utils import InferenceMode, _StageBackwardMeta, _StageForwardMeta
    from torch.distributed.pipelining.schedules import _PipelineSchedule
    from torch.distributed.pipelining.stage import PipelineStage

    warmup, recv, send = _PipelineSchedule._warmup_p2p, PipelineStage._recv_meta, PipelineStage._send_meta

    def voted(schedule: _PipelineSchedule, stages: list[PipelineStage], *args: object, **kwargs: object) -> None:
        for st in stages:  # what the vote decides when some stage lacks static metadata
            st._inference_mode = InferenceMode.DYNAMIC

    def received(stage: PipelineStage, src_stage: int) -> Union[_StageForwardMeta, _StageBackwardMeta]:
        if src_stage < stage.stage_index:
            return _StageForwardMeta(forward_metas=outputs[src_stage])
        return _StageBackwardMeta(backward_metas=outputs[stage.stage_index])  # the next stage's input grads

    _PipelineSchedule._warmup_p2p = voted  # type: ignore[method-assign,assignment]
    PipelineStage._recv_meta, PipelineStage._send_meta = received, lambda *args: None  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        _PipelineSchedule._warmup_p2p = warmup  # type: ignore[method-assign]
        PipelineStage._recv_meta, PipelineStage._send_meta = recv, send  # type: ignore[method-assign]


def _grads_if_distributed(inputs: tuple, outputs: tuple) -> tuple[tuple, tuple] | None:
    """A DTensor's gradient has its layout (the backward of a redistribution keeps the
    placement it came with); plain tensors need no gradient metadata (torch derives it)."""
    from torch.distributed.tensor import DTensor

    if not any(isinstance(t, DTensor) for t in (*inputs, *outputs)):
        return None
    return (tuple(t if t.is_floating_point() else None for t in inputs),
            tuple(t if t.is_floating_point() else None for t in outputs))


def _built(seen: _Seen, index: int) -> nn.Module:
    """Stage ``index``, held by another rank, built as torchtitan builds a rank's stage."""
    from torchtitan.distributed.pipeline_parallel import _split_module

    if seen.parallelize is None:
        raise RuntimeError("torchtitan's pipelining function did not parallelize its stages")
    chunk = _split_module(seen.whole, seen.names[index])
    chunk = seen.parallelize(chunk, **seen.kwargs)
    chunk.to_empty(device=seen.device)
    return chunk




@contextlib.contextmanager
def stage_phases(trainer: Trainer, cap: _Recorder) -> Iterator[None]:
    """Phase marks for a pipelined step, whose micro-batches' forwards and backwards interleave
    as the schedule orders them: each stage's ``forward_one_chunk`` is a forward,
    ``backward_one_chunk`` / ``backward_weight_one_chunk`` a backward (torch/distributed/
    pipelining/stage.py); saves in a forward count, a recompute's in a backward do not."""
    schedule = getattr(trainer, "pp_schedule", None)
    stages = (getattr(schedule, "_stages", None) or [schedule._stage]) if schedule is not None else []
    for stage in stages:
        for name, phase in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward"),
                            ("backward_weight_one_chunk", "backward")):
            setattr(stage, name, _marked(getattr(stage, name), phase, cap))
    try:
        yield
    finally:
        for stage in stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                stage.__dict__.pop(name, None)


def _marked(method: Callable[..., object], phase: str, cap: _Recorder) -> Callable[..., object]:
    def call(*args: object, **kwargs: object) -> object:
        cap.set_phase(phase)
        return method(*args, **kwargs)
    return call


__all__ = ["stage_phases", "static_stages"]
