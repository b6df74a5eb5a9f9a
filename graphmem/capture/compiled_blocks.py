"""What compiles a model's regions inside a recorded step, shared by torchtitan jobs' compiled blocks
(graphmem/titan/compiled.py) and a Trainer's FSDP2 rank under ``torch_compile``
(graphmem/distributed/trainer_fsdp_compiled.py): graphmem's dynamo backend for code that dynamo compiles
while the step runs, and graphmem's module hooks standing aside while dynamo traces them."""
from __future__ import annotations

import contextlib
import gc
from typing import Any, Callable, Iterator, Optional
from unittest import mock

import torch
import torch.fx as fx
import torch.nn as nn

from graphmem.capture.compiled import _Backend
from graphmem.capture.compiled_cuda import graphs_unruled
from graphmem.capture.recorder import _Recorder
from graphmem.capture.target import Target


class _JobBackend(_Backend):
    """graphmem's backend for a job's compiled blocks: one compiled code serves every block
    (dynamo's guards do not specialize on the module), so a forward graph's nodes name modules
    inside the block, and the block running now (the recorder's innermost module,
    ``attributed``) prefixes them; a backward graph's nodes are left to the recorder.
    ``graph_pass``: what Inductor's post-grad passes do to each split graph that changes its ops
    (AsyncTP's micro-pipeline pass, graphmem/titan/async_tp.py), run before the graph is kept.
    ``tagged_backward``: a backward graph's nodes are prefixed too, by the module its autograd node was
    tagged with in forward (the block whose forward graph it pairs with; graphmem/capture/autograd_tags.py)."""

    graph_pass: Optional[Callable[[fx.GraphModule], object]] = None
    tagged_backward = False

    def _compiler(self, kind: str) -> Callable[[fx.GraphModule, list], Callable[[list], object]]:
        inner = super()._compiler(kind)

        def compile(gm: fx.GraphModule, example_inputs: list) -> Callable[[list], object]:
            if self.graph_pass is not None:
                self.graph_pass(gm)
            run = inner(gm, example_inputs)
            cg = self.graphs[-1]
            relative = dict(cg.modules)  # node -> path inside the block ("": the block itself)

            def prefixed(args: list) -> object:
                block = self.recorder.stack[-1] if kind == "forward" else _tagged() if self.tagged_backward else None
                # None in backward: the recorder's own attribution (recorder.py ``module_now``)
                cg.modules = {n: (f"{block}.{p}" if block and p else p or block)  # type: ignore[misc]
                              for n, p in relative.items()}
                return run(args)
            prefixed._boxed_call = True  # type: ignore[attr-defined]
            return prefixed
        return compile


def _tagged() -> Optional[str]:
    """The module the running autograd node was tagged with in forward (None: untagged)."""
    from graphmem.capture.autograd_tags import _TAG, node_metadata

    node = torch._C._current_autograd_node()
    return node_metadata(node).get(_TAG) if node is not None else None


def hooks_standing_aside(hook: Callable[..., object]) -> Callable[..., object]:
    """A global module hook that does nothing while dynamo traces it (inside a compiled block the
    hooks of its submodules are traced, never run; the graph's nodes name their modules)."""
    def call(*args: object) -> object:
        if torch.compiler.is_compiling():
            return None
        return hook(*args)
    return call


def attributed(root: nn.Module, backend: "_Backend | None", cap: _Recorder, target: Target) -> None:
    """Each compiled block of ``root`` runs between graphmem's module hooks (its own hooks are
    inside its compiled call, traced, never run), on the CUDA target with the eager CUDA rules
    lifted (its graphs carry them: graphmem/capture/compiled_cuda.py), and the backend learns
    the blocks' inner names."""
    if backend is None:
        return
    blocks = [m for m in root.modules() if getattr(m, "_compiled_call_impl", None) is not None]
    backend.names = frozenset(name for m in blocks for name, _ in m.named_modules())
    for m in blocks:
        m._compiled_call_impl = _between_hooks(m, m._compiled_call_impl, cap, target.device == "cuda")


def _between_hooks(module: nn.Module, call: Any, cap: _Recorder, cuda: bool) -> Callable[..., object]:
    def run(*args: object, **kwargs: object) -> object:
        cap.pre_hook(module, args)
        out = None
        try:
            with graphs_unruled() if cuda else contextlib.nullcontext():
                out = call(*args, **kwargs)
            return out
        finally:
            cap.post_hook(module, args, out)
    return run


@contextlib.contextmanager
def compiles_unrecorded(cap: _Recorder, collect: bool = False) -> Iterator[None]:
    """Dynamo's compilation of a frame (its tracing, AOTAutograd's joint graph and partition) is compile
    time, not the step: the recorder pauses while it runs. ``collect``: the cycles dynamo's tracing leaves,
    which hold the frame's tensors (a block's inputs), are collected before the frame runs, as a real step
    compiled before it is measured holds none of them."""
    from torch._dynamo import convert_frame

    kept_compile = convert_frame._compile

    def compile_unrecorded(*args: Any, **kwargs: Any) -> object:  # dynamo's own arguments, forwarded
        with cap.paused():
            try:
                return kept_compile(*args, **kwargs)
            finally:
                if collect:
                    gc.collect()

    with mock.patch.object(convert_frame, "_compile", compile_unrecorded):
        yield


__all__ = ["_JobBackend", "attributed", "compiles_unrecorded", "hooks_standing_aside"]
