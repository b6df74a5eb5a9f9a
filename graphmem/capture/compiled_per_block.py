"""``mode="compiled-blocks"``: each block of the model's chain and the loss compiled, the rest of the step
eager, as torchtune's memory-optimized recipes run (torchtune/training/_compile.py ``compile_model`` calls
``m.compile(backend=...)`` on each transformer layer, ``compile_loss`` compiles the loss) and torchtitan
compiles its blocks (torchtitan/distributed/compile.py ``apply_compile``).

How: the blocks are compiled as the real step compiles them (``module.compile``: ``blocks_compiled``, which
the ground truth runs too) with graphmem's dynamo backend in place of the backend's name
(graphmem/capture/compiled_blocks.py ``_JobBackend``, shared with torchtitan's compiled blocks and the FSDP2
Trainer rank): AOTAutograd's joint graph split by PyTorch's min-cut partitioner (after Inductor's
decompositions and joint-graph passes with ``compile_backend="inductor"``), no code generated. Dynamo compiles
during the recorded step, on the capture's fake tensors, its own tracing unrecorded (``compiles_unrecorded``),
graphmem's module hooks standing aside while it traces; each forward and backward graph then runs node by node
on the step's fake tensors, so what AOTAutograd's ``CompiledFunction`` saves for backward is the step's saved set.

The loop stays in Python around the compiled regions (graphmem/training/loop.py), as in torchtune:

- ``release_output``: the model's output (made by the eager head after the last block) is dropped before
  backward; nothing in the compiled regions changes.
- ``optimizer_in_backward``: each parameter's post-accumulate-grad hook steps its optimizer. A block's
  gradients come out of its compiled backward (one autograd node returning them all), then each parameter's
  AccumulateGrad runs and its hook fires: the optimizers step between compiled backward graphs.
- ``offload_activations``: ``saved_tensors_hooks`` in Python are not inlined into the compiled graphs (torch 2.14
  inlines only hooks that are ``fx.GraphModule`` s, torch/_functorch/_aot_autograd/utils.py
  ``saved_tensors_hooks_are_inlineable``), so they apply to what ``CompiledFunction.forward`` saves with
  ``ctx.save_for_backward`` (runtime_wrappers.py ``_AutogradSavedState.save_from_forward``): the partitioner's
  saved set, moved to the host and back. Measured on real CPU steps of the bundled GPT-2
  (tests/compiled/test_compiled_loop.py): eager saves 226,164 B and the hooks move 210,560 B; with compiled blocks
  201,588 B and 185,984 B, 24,576 B less of each.
- 8-bit optimizers (bitsandbytes): the optimizer step runs eagerly after the compiled backward, as any optimizer.

Known limitations: only the chain's blocks and a loss function given as ``loss`` are compiled (a model's own
loss, computed inside its forward, runs eagerly with the rest of the forward, as torchtune's recipes compute
their loss outside the model); one device (no ``rank``/``pp``); tensors ``CompiledFunction`` keeps without a
version check (``ctx._tensors_no_vc_check``: AOTAutograd's invoke_subgraph regions) bypass saved-tensor hooks
in torch and here alike.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch
import torch.nn as nn

from graphmem.capture.aot_settings import partition_config, unlogged
from graphmem.capture.compiled_blocks import _JobBackend, attributed, compiles_unrecorded
from graphmem.capture.compiled_cuda import example_values_ruled
from graphmem.capture.recorder import _Recorder
from graphmem.capture.target import Target
from graphmem.chains import find_chain
from graphmem.errors import CaptureError, UsageError
from graphmem.training.step import LossFn


def chain_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks ``mode="compiled-blocks"`` compiles: the model's chain of repeated blocks (graphmem/chains.py)."""
    chain = find_chain(model)
    if chain is None:
        raise UsageError(f"{type(model).__name__} has no chain of repeated blocks (a ModuleList or Sequential of "
                         "identical layers) to compile one by one: use `mode='compiled'` (the whole model)")
    return list(model.get_submodule(chain.path).children())


@contextlib.contextmanager
def blocks_compiled(model: nn.Module, loss_fn: Optional[LossFn], backend: str | Callable[..., object] = "aot_eager"
                    ) -> Iterator[Optional[LossFn]]:
    """Each block of ``model``'s chain compiled with ``backend`` (``module.compile``, as torchtune does), and
    ``loss_fn`` (None: the model's own loss, run in its forward) compiled too; yields the loss to call.

    >>> with blocks_compiled(model, loss) as compiled_loss:          # doctest: +SKIP
    ...     measure_peak(model, inputs, compiled_loss, train=make_train_step("adamw", offload_activations=True))
    """
    blocks = chain_blocks(model)
    torch._dynamo.reset()  # entries other compiles left on Module._call_impl count toward its recompile limit
    try:
        for m in blocks:
            m.compile(backend=backend)
        yield torch.compile(loss_fn, backend=backend) if loss_fn is not None else None
    finally:
        for m in blocks:
            m._compiled_call_impl = None
        torch._dynamo.reset()


@contextlib.contextmanager
def compiling_blocks(model: torch.nn.Module, loss_fn: Optional[LossFn], cap: _Recorder, target: Target,
                     backends: dict[str, int]) -> Iterator[Optional[LossFn]]:
    """Around the recorded step: the chain's blocks and ``loss_fn`` compiled with graphmem's backend,
    partitioned as ``target.compile_backend`` partitions; yields the loss to call (None: the model's own)."""
    backend = _JobBackend(frozenset(), target, backends)
    backend.recorder, backend.replaying = cap, True  # one pass: each graph runs on the step's fake tensors
    with compiles_unrecorded(cap, collect=True), partition_config(target.memory_budget), unlogged(), example_values_ruled(target), \
            blocks_compiled(model, loss_fn, backend) as compiled_loss:
        attributed(model, backend, cap, target)
        yield compiled_loss
        if not any(g.kind == "forward" for g in backend.graphs):
            raise CaptureError(f"dynamo compiled none of {type(model).__name__}'s blocks (it ran them eagerly), so "
                               "there is no compiled step to predict: check torch._dynamo.explain on one block, or "
                               "use `mode='eager'`")


__all__ = ["blocks_compiled", "chain_blocks", "compiling_blocks"]
