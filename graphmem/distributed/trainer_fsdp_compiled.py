"""A Trainer's FSDP2 rank with ``torch_compile``: the model compiled as accelerate compiles it, on the
capture's fake tensors, its graphs partitioned as the named backend partitions them.

accelerate 1.15 ``Accelerator._prepare_fsdp2`` (accelerator.py 1700-1710) compiles BEFORE it shards:
``model = torch.compile(model, **dynamo_plugin.to_kwargs())`` (after the auto-wrap policy and
activation checkpointing), then ``fsdp2_prepare_model`` runs ``fully_shard`` on the layers, the
embedding, the tail and last on that ``OptimizedModule`` itself, the root unit; the Trainer steps it
(transformers 5.24 trainer.py 1783-1786). Dynamo does not trace FSDP2's hooks: torch 2.14 wraps
``FSDPState._pre_forward`` and ``_post_forward`` in ``torch._dynamo.disable`` (torch/distributed/fsdp/
_fully_shard/_fsdp_state.py, ``_dynamo_disable`` in _fsdp_common.py: "skipping FSDP hooks"), so each
unit's hooks are a graph break and run eagerly, unsharding and resharding as in an eager step, and the
model's code between them is compiled in pieces (counted on the real gloo rank of the tiny Llama:
6 graphs, 6 breaks at the disabled hooks). The config ``skip_fsdp_hooks`` of older releases is gone; ``skip_fsdp_guards`` (default True)
only spares guards on FSDP-managed modules.

The capture lets dynamo do the same: accelerate's own ``torch.compile`` call, given graphmem's backend in
place of the named one (graphmem/capture/compiled_blocks.py ``_JobBackend``, as for torchtitan's blocks: AOTAutograd partitioned as
``aot_eager`` or Inductor partitions, no code generated, each graph run node by node on the step's
fake tensors), compiling during the recorded step on the capture's fake tensors with dynamo's own
tracing unrecorded, graphmem's module hooks standing aside while dynamo traces through them. Inductor's
fusions are not modelled (its peak is shown beside the real one without a verdict, as for DDP).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
import torch.nn as nn

from graphmem.capture.aot_settings import partition_config, unlogged
from graphmem.capture.compiled_blocks import _JobBackend
from graphmem.capture.compiled_cuda import example_values_ruled
from graphmem.capture.recorder import _Recorder
from graphmem.capture.session import Hook
from graphmem.capture.target import Target
from graphmem.errors import GraphmemError

if TYPE_CHECKING:
    from torch._dynamo.types import ConvertFrameReturn
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from transformers import TrainingArguments


@contextlib.contextmanager
def compiled_as_accelerate(args: TrainingArguments, cap: _Recorder, target: Target,
                           backends: dict[str, int]) -> Iterator[Optional[_JobBackend]]:
    """Around the Trainer's prepare and step: accelerate's ``torch.compile`` given graphmem's backend,
    dynamo's compilation unrecorded. Yields the backend (None without ``torch_compile``), whose
    ``names`` ``named_within`` sets once the model exists."""
    if not args.torch_compile:
        yield None
        return
    from torch._dynamo import convert_frame

    named = str(args.torch_compile_backend)
    backend = _JobBackend(frozenset(), dataclasses.replace(target, compile_backend=named), backends)
    backend.recorder, backend.replaying = cap, True  # one pass: each graph runs on the step's fake tensors
    backend.tagged_backward = True  # (a unit's backward graph: named from the unit its forward ran in)
    kept_compile, kept_frame = torch.compile, convert_frame._compile

    def compile_ours(model: Optional[Callable[..., object]] = None, **kwargs: Any) -> Callable[..., object]:  # (torch.compile's options)
        kwargs.pop("backend", None)  # (the plugin's: ``torch_compile_backend``, transformers trainer.py 791-802)
        return kept_compile(model, backend=backend, **kwargs)

    def compile_unrecorded(*a: Any, **kw: Any) -> ConvertFrameReturn:  # (dynamo's own arguments)
        with cap.paused():
            try:
                return kept_frame(*a, **kw)
            finally:  # dynamo's tracing leaves cycles that hold the frame's tensors: gone before the frame runs
                gc.collect()

    torch.compile, convert_frame._compile = compile_ours, compile_unrecorded  # type: ignore[assignment]
    # an empty cache: a model class's forward is one code object, and entries other compiles left on it
    # count toward dynamo's recompile_limit, past which it runs the frame eagerly without a word
    torch._dynamo.reset()
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with partition_config(target.memory_budget), unlogged(), example_values_ruled(target), \
                torch._dynamo.config.patch(run_gc_after_compile=False):
            yield backend
        if not backend.graphs:
            raise GraphmemError("dynamo compiled none of the model's graphs in the Trainer's step (it ran them "
                                "eagerly), so there is no compiled step to predict: drop `torch_compile`")
    finally:
        if was:
            gc.enable()
        torch.compile, convert_frame._compile = kept_compile, kept_frame  # type: ignore[assignment]
        torch._dynamo.reset()  # the compiled code, guarded on this capture's objects, goes with it


@contextlib.contextmanager
def units_entered(cap: _Recorder, compiled: bool) -> Iterator[None]:
    """Each FSDP unit's forward on the recorder's module stack from its unshard (``FSDPParamGroup.pre_forward``)
    to its reshard (``post_forward``): both run eagerly inside FSDP2's disabled hooks, while the unit's own
    ``__call__`` (graphmem's module hooks with it) may be traced by dynamo, which then resumes inside the
    unit's forward, a graph whose modules are named from the unit (``named_within``). A unit already entered
    through graphmem's hooks (its call run eagerly) is not entered twice. Eager steps: nothing changes."""
    if not compiled:
        yield
        return
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from graphmem.capture.call_paths import call_path

    kept_pre, kept_post = FSDPParamGroup.pre_forward, FSDPParamGroup.post_forward
    entered: list[bool] = []

    def pre_forward(group: FSDPParamGroup, module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]
                    ) -> tuple[tuple[object, ...], dict[str, object]]:
        names = cap.paths.get(id(module))
        fresh = bool(names) and cap.stack[-1] != call_path(names, cap.stack)  # type: ignore[arg-type]
        if fresh:
            cap.pre_hook(module, args)
        entered.append(fresh)
        return kept_pre(group, module, args, kwargs)

    def post_forward(group: FSDPParamGroup, module: nn.Module, input: tuple[object, ...], output: object) -> object:
        if entered.pop():  # (left before the reshard, as graphmem's post hook runs before FSDP2's)
            cap.post_hook(module, input, output)
        return kept_post(group, module, input, output)

    FSDPParamGroup.pre_forward, FSDPParamGroup.post_forward = pre_forward, post_forward  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        FSDPParamGroup.pre_forward, FSDPParamGroup.post_forward = kept_pre, kept_post  # type: ignore[method-assign]


def hooks_unseen(cap: _Recorder, compiled: Optional[nn.Module]) -> tuple[Hook, Hook]:
    """The recorder's saved-tensor hooks, kept from dynamo under ``torch_compile``: autograd calls them from
    a compiled frame's eager code, where dynamo would compile them as frames of their own (the real rank's
    measuring hook likewise, graphmem/validation/trainer_fsdp_rank.py); the model's graphs are the same either
    way, and the capture's tensors are not held by dynamo's compiled frames of graphmem's code."""
    if compiled is None:
        return cap.pack, cap.unpack
    return torch._dynamo.disable(cap.pack), torch._dynamo.disable(cap.unpack)


def named_within(backend: Optional[_JobBackend], model: nn.Module, compiled: Optional[nn.Module], cap: _Recorder) -> None:
    """Dynamo names a graph's modules from its frame's ``self``: the model for its own forward, an FSDP
    unit for a forward dynamo starts inside the unit after its eager hooks; ``_JobBackend`` prefixes them
    with the module running then. The backend learns every module's names under every module, and the
    ``OptimizedModule`` (the root FSDP unit, called first) is named as the model, the root ``""``."""
    if backend is None:
        return
    backend.names = frozenset(name for m in model.modules() for name, _ in m.named_modules())
    if compiled is not None:
        cap.paths[id(compiled)] = ("",)


__all__ = ["compiled_as_accelerate", "hooks_unseen", "named_within", "units_entered"]
