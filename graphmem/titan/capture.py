"""Rank r's step of a torchtitan job, run by torchtitan's own code on fake tensors.

Under the fake process group (torch's fake backend, rank r of the job's world size), in the
recording fake mode (graphmem/capture/recorder.py), torchtitan's ``Trainer.__init__`` builds the
job as it does on a cluster: the model on meta, its ``parallelize_fn`` / ``pipelining_fn``
(FSDP2, TP, PP, CP, EP, activation checkpointing, compile as configured), ``to_empty`` and
``init_weights`` (fake here), the optimizers and LR schedulers. Then ``Trainer.train_step``
runs one step: the batch fetched per micro-step, ``forward_backward_step`` (the loss with its
``del pred``, ``loss.backward()``), ``clip_grad_norm_``, ``optimizers.step()`` and the scheduler.

What graphmem adds is only observation: phases (the loss function's call starts "loss", the
backward's first node "backward", ``clip_grad_norm_`` "optimizer"), the gradients and optimizer
states named when they exist, FSDP2's storage resizes (graphmem/distributed/fsdp.py ``watching``).
The job's data, metrics and checkpointing are replaced as graphmem/titan/job.py says. A pipeline's
stages get the metadata torch infers over point-to-point messages on a cluster, inferred on this
rank instead (graphmem/titan/pipeline.py), and its phases follow the schedule: each stage's
micro-batch forward and backward, interleaved as the schedule runs them.

The job's compiled blocks (``compile.enable``) compile with graphmem's own dynamo backend
(graphmem/titan/compiled.py): AOTAutograd's min-cut partition, graphs run op by op. Known
limitations: FlexAttention, which torchtitan always compiles, runs through the eager
``flex_attention`` higher-order op, whose forward/backward keep what the compiled function keeps
(query, key, value, output and the fp32 logsumexp; torch/_higher_order_ops/flex_attention.py;
the op's eager autograd also keeps ``max_scores``, which the compiled one does not: ``_saved_as_compiled``);
``create_block_mask`` runs outside the recording, its BlockMask held as an input.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake

from graphmem.capture.autograd_tags import _tag_grad_fns, _unique_counts
from graphmem.capture.call_paths import module_names, module_order
from graphmem.capture.capture import marker
from graphmem.capture.cuda_rules import CudaRules
from graphmem.capture.recorder import _Mode, _Recorder
from graphmem.capture.session import Recording
from graphmem.capture.target import Target
from graphmem.distributed.fsdp import local, watching
from graphmem.distributed.pipeline import _works_hold_tensors
from graphmem.errors import GraphmemError, UsageError
from graphmem.fake_group import kept_excepthook
from graphmem.stepgraph import StepGraph
from graphmem.titan.compiled import attributed, compiled_regions, hooks_standing_aside
from graphmem.titan.job import on_cpu, prepared, synthetic_batches
from graphmem.titan.moe import balanced_routing
from graphmem.titan.pipeline import stage_phases, static_stages
from graphmem.training.optim import ScalarReads, state_tensors

if TYPE_CHECKING:
    from torch._ops import OpOverload
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.trainer import Trainer


def capture_job(config: Trainer.Config, world_size: int, rank: int, target: Target) -> StepGraph:
    """Record rank ``rank``'s first training step of the torchtitan job ``config`` (a
    ``Trainer.Config``) over ``world_size`` ranks; the graph's storages are rank r's."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not 0 <= rank < world_size:
        raise UsageError(f"`rank={rank}` is not one of the job's {world_size} ranks: use 0 to {world_size - 1}")
    if dist.is_initialized():
        raise UsageError("torch.distributed is already initialized in this process; graphmem runs the job's rank "
                         "in a fake process group of its own: call analyze outside the distributed job")
    cfg = prepared(config)
    _unique_counts()
    with kept_excepthook():  # init_process_group's [rank r] traceback prefix, not left behind
        dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
        try:
            with on_cpu(), _compiled_eagerly(target):
                return _capture(cfg, target)
        finally:
            dist.destroy_process_group()
            from graphmem.distributed.process_group import _forget_meshes

            _forget_meshes()


def _capture(cfg: Trainer.Config, target: Target) -> StepGraph:
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.trainer import Trainer

    dims = ParallelDims.from_config(cfg.parallelism, torch.distributed.get_world_size())
    dims.build_mesh()  # outside the fake mode: a DeviceMesh's rank layout is real

    class Job(Trainer):
        def init_distributed(self) -> ParallelDims:  # the fake process group is up; its meshes built above
            return dims

    import torchtitan.distributed.utils as dist_utils

    determinism = dist_utils.set_determinism

    def seeded(*args: object, **kwargs: object) -> None:  # its seed broadcast is of real tensors
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            return determinism(*args, **kwargs)

    rec = Recording(target)
    with static_stages(cfg, rec.cap), compiled_regions(cfg, rec.cap, target, rec.backends) as compiled:
        trainer, root, batches, param_sid = _built(cfg, rec.cap, rec.mode, Job, seeded)
        attributed(root, compiled, rec.cap, target)
        return _run(rec, trainer, root, batches, param_sid)


def _built(cfg: Trainer.Config, cap: _Recorder, fake_mode: _Mode, job: type[Trainer],
           seeded: Callable[..., None]) -> tuple:
    """torchtitan's ``Trainer.__init__`` on fake tensors, the model's parameters and buffers and
    the step's batches held as the graph's inputs."""
    import torchtitan.distributed.utils as dist_utils

    determinism = dist_utils.set_determinism
    with fake_mode, _masks_paused(cap), _no_peak_flops():
        cap.real_bookkeeping = True  # the meshes, the seed broadcast: real tensors, run for real
        try:
            dist_utils.set_determinism = seeded
            with _InitReads():
                trainer = job(cfg)
        except GraphmemError:
            raise
        except Exception as e:
            raise UsageError(f"torchtitan could not build the job on rank {torch.distributed.get_rank()}: "
                             f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
        finally:
            cap.real_bookkeeping = False
            dist_utils.set_determinism = determinism
        root = nn.ModuleList(trainer.model_parts)
        cap.paths = module_names(root)
        param_sid: dict[str, int] = {}
        for kind, named in (("parameter", root.named_parameters()), ("buffer", root.named_buffers())):
            for name, t in named:
                cap.preexisting(local(t), kind, name)
                param_sid[name] = cap.placeholders[-1].meta["storage"]
        # what one train_step fetches: its accumulation steps x pipeline micro-batches, as the Trainer counted them
        batches = synthetic_batches(cfg, trainer.gradient_accumulation_steps * trainer.num_pipeline_parallel_microbatches)
        for i, (inputs, labels) in enumerate(batches):
            for name, t in (*inputs.items(), ("labels", labels)):
                cap.preexisting(t, "input", f"batch{i}.{name}")
    return trainer, root, batches, param_sid


def _run(rec: Recording, trainer: Trainer, root: nn.Module, batches: list, param_sid: dict[str, int]) -> StepGraph:
    cap = rec.cap
    with rec.hooks(hooks_standing_aside):
        marked: dict[str, list[int]] = {}
        mark = marker(cap, param_sid, marked, False, local)
        with rec.running("the torchtitan job", watching(cap), _observed(trainer, root, cap, mark),
                         stage_phases(trainer, cap), _works_hold_tensors(), balanced_routing(),
                         _target_rules(rec.target, rec.backends, cap), _masks_paused(cap)):
            cap.set_phase("forward")
            with _step_reads(rec.mode):  # the token count and loss it reads scale arithmetic and logs only
                trainer.train_step(iter(batches))
        return rec.graph("torchtitan job", module_order(root), marked.get("gradient", []))


@contextlib.contextmanager
def _no_peak_flops() -> Iterator[None]:
    """The Trainer's MFU figure, which it only logs, without its lookup: torchtitan's
    ``get_peak_flops`` runs ``lspci`` (its stderr straight to the terminal where lspci cannot read
    the PCI bus) and warns about the device name (torchtitan/tools/utils.py); the A100 figure it
    falls back to is returned."""
    import torchtitan.tools.utils as titan_utils

    lookup = titan_utils.get_peak_flops
    titan_utils.get_peak_flops = lambda device_name: 312e12  # its fallback (torchtitan/tools/utils.py)
    try:
        yield
    finally:
        titan_utils.get_peak_flops = lookup


@contextlib.contextmanager
def _step_reads(mode: _Mode) -> Iterator[None]:
    """``.item()`` during the step answered as ``ScalarReads`` answers it (a bool True, a float
    1.0, an int 1), by the fake mode itself: a mode above it would make dynamo skip the job's
    compiled blocks."""
    mode.scalar_answer = _answer
    try:
        yield
    finally:
        mode.scalar_answer = None


def _answer(t: torch.Tensor) -> Union[bool, float, int]:
    return True if t.dtype == torch.bool else 1.0 if t.is_floating_point() else 1


class _InitReads(ScalarReads):
    """``.item()`` of a fake tensor while the job is built: ``init_weights`` draws values
    (``trunc_normal_``'s rejection loop asks ``mask.any()``; DTensor's RNG reads its offsets) that
    never decide a size; a bool reads False so rejection loops end, a number 1. A real tensor's
    read runs for real: a DeviceMesh sliced while the job is built (spmd_types' FSDP storage mesh,
    torchtitan/distributed/parallel_dims.py ``get_optional_mesh``) picks this rank's row of its
    rank layout by an index read under ``unset_fake_temporarily`` (torch/distributed/
    device_mesh.py ``_get_mesh_tensor_from_full_mesh``); answered 1, a pipeline's stage 0 got
    the row of the ranks of stage 1, and its parameters came out empty (DTensor's
    ``from_local`` on a mesh without this rank)."""

    def __torch_dispatch__(self, func: OpOverload, types: Sequence[type], args: tuple = (),
                           kwargs: Optional[dict] = None) -> object:
        if func is torch.ops.aten._local_scalar_dense.default and not is_fake(args[0]):
            return func(*args, **(kwargs or {}))
        if func is torch.ops.aten._local_scalar_dense.default and args[0].dtype == torch.bool:
            return False
        return super().__torch_dispatch__(func, types, args, kwargs)


@contextlib.contextmanager
def _target_rules(target: Target, backends: dict[str, int], cap: _Recorder) -> Iterator[None]:
    """The CUDA target's kernel rules around the step (the CPU target needs none)."""
    if target.device == "cuda":
        with CudaRules(target, backends, cap.clearing_cache):
            yield
    else:
        yield


@contextlib.contextmanager
def _observed(trainer: Trainer, root: nn.Module, cap: _Recorder,
              mark: Callable[[str, list[tuple[str, torch.Tensor]]], None]) -> Iterator[None]:
    """Phase marks and names around torchtitan's own calls (instance attributes, removed after):
    the loss function (each micro-step's forward ends where it is called; its result's grad_fn
    starts backward), ``clip_grad_norm_`` (the optimizer phase; the gradients named), the
    optimizers' ``step`` (their states named)."""
    import torchtitan.distributed.utils as dist_utils

    loss_fn, clip, step = trainer.loss_fn, dist_utils.clip_grad_norm_, trainer.optimizers.step
    names = {id(p): n for n, p in root.named_parameters()}

    def loss(*args: object, **kwargs: object) -> Union[torch.Tensor, tuple]:
        if cap.phase == "backward":
            cap.set_phase("forward")  # the next micro-step
        cap.set_phase("loss")
        out = loss_fn(*args, **kwargs)
        value = out[0] if isinstance(out, tuple) else out
        if isinstance(value, torch.Tensor) and value.grad_fn is not None:
            _tag_grad_fns(value, "")
            value.grad_fn.register_prehook(lambda grads: cap.set_phase("backward"))
        return out

    def clipped(parameters: Iterable[torch.Tensor], *args: object, **kwargs: object) -> torch.Tensor:
        parameters = list(parameters)
        mark("gradient", [(names.get(id(p), "?"), p.grad) for p in parameters if p.grad is not None])
        cap.set_phase("optimizer")
        return clip(parameters, *args, **kwargs)

    def stepped(*args: object, **kwargs: object) -> Optional[float]:  # OptimizersContainer.step
        out = step(*args, **kwargs)
        for opt in getattr(trainer.optimizers, "optimizers", [trainer.optimizers]):
            mark("optimizer state", [(f"{names.get(id(p), '?')}:{key}", v) for p, key, v in state_tensors(opt)])
        return out

    trainer.loss_fn, dist_utils.clip_grad_norm_, trainer.optimizers.step = loss, clipped, stepped
    try:
        yield
    finally:
        trainer.loss_fn, dist_utils.clip_grad_norm_ = loss_fn, clip
        del trainer.optimizers.step


@contextlib.contextmanager
def _compiled_eagerly(target: Target) -> Iterator[None]:
    """torchtitan's always-compiled FlexAttention and ``create_block_mask`` as their eager
    functions (the module docstring). FlexAttention refuses a backward on CPU tensors
    (torch/nn/attention/flex_attention.py ``_validate_device``): on the CUDA target, whose fake
    tensors are CPU tensors, that check is the real device's (CUDA has the backward); on the CPU
    target the refusal stands, in one line."""
    import torch.nn.attention.flex_attention as flex
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention
    from torchtitan.models.common import attention

    kept = attention.FlexAttention._compiled_flex_attn, attention._compiled_create_block_mask, flex._validate_device, \
        flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG, cp_attention._compiled_create_block_mask

    def on_target(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if target.device == "cpu" and (query.requires_grad or key.requires_grad or value.requires_grad):
            raise UsageError("the job's FlexAttention has no backward on the CPU (torch/nn/attention/flex_attention.py): "
                             "analyze it with `device='cuda'`, or swap it for SDPA with `attention='sdpa'`")

    _fake_rules_for(_Mode)
    _saved_as_compiled()
    attention.FlexAttention._compiled_flex_attn = staticmethod(flex.flex_attention)  # type: ignore[assignment]
    attention._compiled_create_block_mask = flex.create_block_mask
    # context parallel shards a BlockMask by building each rank's own with a create_block_mask it
    # compiles once (torch/distributed/tensor/experimental/_context_parallel/_attention.py
    # ``_create_cp_block_mask``): Inductor's code run on fake tensors' storage crashed the process
    cp_attention._compiled_create_block_mask = flex.create_block_mask  # type: ignore[assignment]
    flex._validate_device = on_target
    flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True  # the higher-order op itself (eager flex_attention wraps it in dynamo)
    try:
        yield
    finally:
        attention.FlexAttention._compiled_flex_attn, attention._compiled_create_block_mask, flex._validate_device, \
            flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG, cp_attention._compiled_create_block_mask = kept


def _saved_as_compiled() -> None:
    """The eager higher-order op's autograd saves its ``max_scores`` output (the sixth value,
    ``FlexAttentionAutogradOp.forward``, torch/_higher_order_ops/flex_attention.py), which its
    backward unpacks and never passes on (``flex_attention_backward`` takes query, key, value,
    out and logsumexp). torchtitan runs the op compiled, and AOTAutograd's partition keeps only
    what the backward graph reads, so the compiled function saves no ``max_scores`` (the job's
    compiled blocks measure it so: one fp32 (batch, heads, seq) tensor a layer fewer than the
    eager op). It is saved as None here (installed once; a no-op outside that forward)."""
    import importlib

    hop = importlib.import_module("torch._higher_order_ops.flex_attention")  # the module (the package's name is the op)
    if getattr(hop.save_values_for_backward, "_graphmem", False):
        return
    save = hop.save_values_for_backward

    def saved(ctx: torch.autograd.function.FunctionCtx, args: tuple) -> None:
        if type(ctx).__name__.startswith("FlexAttentionAutogradOp") and len(args) > 5:
            args = (*args[:5], None, *args[6:])  # max_scores: unread by the backward
        save(ctx, args)

    saved._graphmem = True  # type: ignore[attr-defined]
    hop.save_values_for_backward = saved  # type: ignore[attr-defined]


def _fake_rules_for(mode: type) -> None:
    """FlexAttention's higher-order ops find their fake-tensor rule by the mode's exact type
    (torch/_ops.py ``HigherOrderOperator.dispatch``): give graphmem's recording fake mode
    FakeTensorMode's rules (registered once)."""
    from torch._higher_order_ops.flex_attention import flex_attention, flex_attention_backward
    from torch._subclasses.fake_tensor import FakeTensorMode

    for hop in (flex_attention, flex_attention_backward):
        if mode not in hop.python_key_table:
            hop.py_impl(mode)(hop.python_key_table[FakeTensorMode])


@contextlib.contextmanager
def _masks_paused(cap: _Recorder) -> Iterator[None]:
    """``create_block_mask`` outside the recording, in the Trainer's build and in its step:
    eagerly it evaluates the mask at every (query, key) pair, which the compiled function the job
    runs does blockwise; its BlockMask's tensors are counted from their first use in the step.
    torchtitan's builder and context parallel's (each rank's shard of the mask) alike."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention
    from torch.nn.attention.flex_attention import BlockMask
    from torchtitan.models.common import attention

    kept, kept_cp = attention._compiled_create_block_mask, cp_attention._compiled_create_block_mask

    # build: create_block_mask; context parallel's module attribute is typed None until its first compile
    def pausing(build: Any) -> Callable[..., BlockMask]:
        def paused(*args: object, **kwargs: object) -> BlockMask:
            with cap.paused():
                return build(*args, **kwargs)
        return paused

    attention._compiled_create_block_mask = pausing(kept)
    cp_attention._compiled_create_block_mask = pausing(kept_cp)  # type: ignore[assignment]  # context parallel
    try:
        yield
    finally:
        attention._compiled_create_block_mask, cp_attention._compiled_create_block_mask = kept, kept_cp


__all__ = ["capture_job"]
