"""Rank r's training step through PyTorch's own distributed wrappers, on fake tensors.

A fake copy of the model (graphmem/distributed/fsdp.py) is wrapped under the fake process group
(graphmem/distributed/process_group.py) by ``parallelize_module`` (tensor parallel) and
``fully_shard`` (FSDP2), then one step runs under the recording fake mode
(graphmem/capture/recorder.py) as graphmem/capture/capture.py runs a single-device step. The
recorder sees what runs below DTensor's and FSDP's Python code: local-shard aten ops, FSDP's
copy-in/copy-out ops, and the c10d collectives of the fake backend (which leave their outputs
allocated, as a real collective does). The graph's storages are rank r's: local shards, not
global DTensor sizes.

A deep chain is captured at depth 5 and widened (graphmem/capture/reuse.py, checked at depth 6
each time; graphmem/api.py passes this capture to it).

Known limitations: eager mode only (no --mode compiled), no optimizer step or micro-batches yet.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from graphmem.capture.capture import _cache_clears
from graphmem.capture.cuda_rules import CudaRules
from graphmem.capture.fakes import Inputs, fake_batch, forward_context, translate_error
from graphmem.capture.hf_paths import real_paths
from graphmem.capture.recorder import _Mode, _Recorder, _rng_states, _tag_grad_fns, _unique_counts
from graphmem.capture.target import Target
from graphmem.distributed.chunks import lazy_chunks
from graphmem.distributed.fsdp import fake_copy, local, shard, watching
from graphmem.distributed.process_group import fake_process_group
from graphmem.distributed.spec import Sharding
from graphmem.distributed.tensor_parallel import parallelize
from graphmem.errors import GraphmemError
from graphmem.stepgraph import StepGraph
from graphmem.training.step import LossFn, default_loss, run_step


def capture_rank(model: nn.Module, inputs: Inputs, loss_fn: Optional[LossFn], target: Target,
                 sharding: Sharding) -> StepGraph:
    """Record rank ``sharding.rank``'s step of ``model`` wrapped as ``sharding`` says.

    >>> import torch, graphmem
    >>> from graphmem.distributed import capture_rank, make_sharding
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    >>> g = capture_rank(net, (torch.randn(8, 64),), None, graphmem.Target("cpu"), make_sharding(4, 1, fsdp=True))
    >>> g.storages[g.placeholders[0].meta["storage"]].shape   # rank 1's shard of the first weight
    (16, 64)
    """
    _unique_counts()  # calibrate before entering the fake mode
    with fake_process_group(sharding.rank, sharding.world_size, sharding.tp, sharding.fsdp) as meshes:
        cap = _Recorder({})
        cap.device = target.device
        backends: dict[str, int] = {}
        if target.device == "cuda":
            cap.recompute_rules = lambda: CudaRules(target, backends, cap.clearing_cache)
            cap.fp32_norm_stats = True
        fake_mode = _Mode(cap)
        with fake_mode:
            wrapped = fake_copy(model, target.param_dtype)
            cap.real_bookkeeping = True  # the meshes' own tensors are real
            if sharding.tp > 1:
                parallelize(wrapped, sharding, meshes)
            if sharding.fsdp:
                with lazy_chunks():  # (only the chunks FSDP2 reads: graphmem/distributed/chunks.py)
                    shard(wrapped, sharding, meshes)
            cap.real_bookkeeping = False
            cap.paths = {id(m): name for name, m in wrapped.named_modules()}
            param_sid = {}
            for kind, named in (("parameter", wrapped.named_parameters()), ("buffer", wrapped.named_buffers())):
                for name, t in named:
                    cap.preexisting(local(t), kind, name)
                    param_sid[id(t)] = cap.placeholders[-1].meta["storage"]
            fake_inputs = fake_batch(inputs, fake_mode, torch.device("cpu"), target.param_dtype)
            for name, x in fake_inputs.named():
                if isinstance(x, torch.Tensor):
                    cap.preexisting(x, "input", name)
        return _run(cap, fake_mode, wrapped, fake_inputs, loss_fn, target, backends, param_sid)


def _run(cap: _Recorder, fake_mode: _Mode, wrapped: nn.Module, fake_inputs: Any, loss_fn: Optional[LossFn],
         target: Target, backends: dict[str, int], param_sid: dict[int, int]) -> StepGraph:
    handles = [nn.modules.module.register_module_forward_pre_hook(cap.pre_hook),
               nn.modules.module.register_module_forward_hook(cap.post_hook, always_call=True)]

    def tagged_loss(out: Any, inputs: Any) -> torch.Tensor:
        loss = (loss_fn or default_loss)(out, inputs)
        if isinstance(loss, torch.Tensor):
            _tag_grad_fns(loss, "")  # the loss's nodes belong to the root
        return loss

    try:
        try:
            with fake_mode, torch.autograd.graph.saved_tensors_hooks(cap.pack, cap.unpack), \
                    _rng_states(cap, target.device == "cpu"), _cache_clears(cap), real_paths(), watching(cap):
                cap.recording = True
                context = forward_context(target, backends, cap.clearing_cache)
                out, loss = run_step(wrapped, fake_inputs, tagged_loss, cap.set_phase, context)
                gradients = []
                for p in wrapped.parameters():
                    if p.grad is not None:  # rank r's shard of the gradient (a DTensor's local tensor)
                        s = cap.storage(local(p.grad), "gradient", "grad", len(cap.ops) - 1, "")
                        s.kind, s.owner = "gradient", param_sid[id(p)]
                        gradients.append(s.sid)
        except GraphmemError:
            raise
        except Exception as e:  # a one-line error that names the fix
            raise translate_error(e, cap, type(wrapped).__name__) from e
        phase_start = dict(cap.phase_start)
        phase_start["end"] = len(cap.ops)
        return StepGraph(cap.placeholders, cap.ops, cap.storages, cap.saves, phase_start, target.device,
                         list(dict.fromkeys(gradients)), type(wrapped).__name__,
                         [name for name, _ in wrapped.named_modules()], cap.module_inputs, target, backends)
    finally:
        cap.closed = True  # before the fake tensors die with this frame: those frees are after the step
        for h in handles:
            h.remove()
