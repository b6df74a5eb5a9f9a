"""A torchtitan job's ``torch.compile`` regions, compiled as the job compiles them, partitioned as
Inductor partitions them.

With ``compile.enable`` and ``"model"`` in ``compile.components``, torchtitan compiles each
transformer block, ``fullgraph=True``, with the job's ``compile.backend``
(torchtitan/distributed/compile.py ``apply_compile``). graphmem hands torchtitan its own dynamo
backend in place of the backend's name (graphmem/capture/compiled.py ``_Backend``): AOTAutograd
partitioned as the named backend partitions (Inductor: its decompositions, joint-graph passes and
min-cut partitioner, graphmem/capture/inductor_partition.py; ``aot_eager``: the min-cut
partitioner), and no code generated: the forward and backward graphs run node by node on graphmem's fake tensors,
so their ops are the step's ops and what the compiled forward saves for backward is the step's
saved set. Dynamo's own tracing and AOTAutograd's compilation run outside the recording (compile
time, not the step), and graphmem's module hooks stand aside while dynamo traces through them.
Inductor's fusions are not modelled: a fused kernel's intermediates never exist, so a compiled
block's temporaries are at most those of its graph's ops (the saved set is the partition's).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Iterator

import torch
import torch.nn as nn

from graphmem.capture.aot_settings import partition_config, unlogged
from graphmem.capture.compiled import _Backend
from graphmem.capture.compiled_blocks import _JobBackend, attributed, compiles_unrecorded, hooks_standing_aside
from graphmem.capture.compiled_cuda import example_values_ruled
from graphmem.capture.recorder import _Recorder
from graphmem.capture.target import Target
from graphmem.errors import UsageError
from graphmem.titan.async_tp import async_tp_state, graph_pass, runs_pass

if TYPE_CHECKING:
    from torchtitan.trainer import Trainer


def compiles_model(cfg: Trainer.Config) -> bool:
    """Whether the job compiles its model's blocks (torchtitan's ``compile`` config)."""
    c = cfg.compile
    return bool(getattr(c, "enable", False)) and "model" in getattr(c, "components", ())


@contextlib.contextmanager
def compiled_regions(cfg: Trainer.Config, cap: _Recorder, target: Target, backends: dict[str, int]) -> Iterator[_Backend | None]:
    """Around the job's build and step: graphmem's backend as the job's compile backend, dynamo's
    compilation unrecorded. Yields the backend (None when the job compiles nothing), whose
    ``names`` the caller sets once the model exists."""
    if not compiles_model(cfg):
        yield None
        return
    kept_backend = cfg.compile.backend
    # the job's backend decides the partition: Inductor's (its decompositions and joint-graph passes,
    # graphmem/capture/inductor_partition.py) or aot_eager's; any other is refused where the job names it
    named = kept_backend if isinstance(kept_backend, str) else "aot_eager"
    if named not in ("inductor", "aot_eager"):
        raise UsageError(f"the job compiles with `compile.backend={named!r}`: graphmem partitions as 'inductor' or "
                         "'aot_eager' do; set one of them")
    if target.device == "cpu" and runs_pass(cfg):
        raise UsageError("the job enables `compile.enable_async_tensor_parallel`, whose fused ops run on CUDA's "
                         "symmetric memory only: analyze it with `device='cuda'`")
    backend = _JobBackend(frozenset(), dataclasses.replace(target, compile_backend=named), backends)
    backend.recorder, backend.replaying = cap, True  # one pass: each graph runs on the step's fake tensors
    backend.graph_pass = graph_pass(cfg)  # AsyncTP with Inductor: its micro-pipeline pass (async_tp.py)
    cfg.compile.backend = backend  # torchtitan passes it to ``module.compile(backend=...)``
    try:
        with compiles_unrecorded(cap), partition_config(target.memory_budget), unlogged(), \
                example_values_ruled(target), flex_regions_decided(named, backend), async_tp_state():
            yield backend
    finally:
        cfg.compile.backend = kept_backend
        torch._dynamo.reset()  # the job's compiled code, guarded on this capture's objects, goes with it


@contextlib.contextmanager
def flex_regions_decided(named: str, backend: _Backend) -> Iterator[None]:
    """torchtitan's ``apply_compile`` hands the job's backend to ``_maybe_regional_inductor_backend``
    (torchtitan/distributed/compile.py), which, for a model with FlexAttention, keeps 'inductor',
    wraps 'aot_eager' in ``regional_inductor`` (the flex regions lowered by Inductor, the rest
    partitioned as aot_eager partitions) and refuses any other backend. It is asked with the job's
    backend name, so its refusal and its flag that marks the flex regions stand as in the real job,
    and graphmem's backend, which partitions as that name does, compiles the blocks."""
    try:
        from torchtitan.distributed import compile as titan_compile
    except ImportError:  # a torchtitan without the hook: nothing to decide
        yield
        return
    decide = getattr(titan_compile, "_maybe_regional_inductor_backend", None)
    if decide is None:
        yield
        return

    def decided(model: nn.Module, _backend: object) -> _Backend:  # the job's backend, answered as graphmem's
        decide(model, named)
        return backend

    titan_compile._maybe_regional_inductor_backend = decided
    try:
        yield
    finally:
        titan_compile._maybe_regional_inductor_backend = decide


__all__ = ["attributed", "compiled_regions", "compiles_model", "hooks_standing_aside"]
