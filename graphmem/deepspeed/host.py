"""Host memory on the CUDA target: what of a DeepSpeed rank's step lives in the host's memory under CPU offload.

DeepSpeed runs here on its CPU accelerator (graphmem/deepspeed/capture.py), where the device and the host are one
memory: a real CPU run counts both, and so does the CPU target. On a GPU, ``offload_optimizer`` keeps the fp32
partitions, their gradients and the optimizer's states in host memory (pinned where DeepSpeed's ``pin_memory``
says: graphmem/deepspeed/engine.py ``name_host``), and the optimizer steps there (torch's optimizer over those host
partitions: deepspeed/runtime/zero/stage_1_and_2.py ``step`` with ``cpu_offload``, stage3.py ``_optimizer_step``);
what it makes from host tensors only (the states on the first step, the update's intermediates) is host memory
too, as a CPU kernel's outputs are. What moves between them are in-place copies into buffers DeepSpeed keeps on
each side (``copy_`` into ``temp_grad_buffer_for_gpu_offload``, ``offload_gradient_dict``, the 16-bit partitions):
no new storage.

``split_host`` moves those storages' bytes out of the device's figures (``Storage.host``; ``nbytes`` 0): every pass
over the step (liveness, the budget, the caching allocator's model, the device total) then counts the GPU's memory
only, and graphmem/deepspeed/report.py reports the host's. ZeRO-3's ``offload_param`` is not split here: its
gathers copy each host partition to the device first (``.to(device)``, partition_parameters.py ``_all_gather``),
a copy the CPU accelerator never makes (the partition is already on its device), so the CUDA target refuses it
(graphmem/deepspeed/config.py)."""
from __future__ import annotations

from graphmem.deepspeed.engine import PAGEABLE, PINNED
from graphmem.stepgraph import StepGraph, arg_sids


def host_sids(g: StepGraph) -> set[int]:
    """The storages of step ``g`` in host memory: those DeepSpeed keeps there (named by ``name_host``), and every
    storage an op makes from host storages only, in the order the ops ran."""
    host = {sid for sid, s in g.storages.items() if s.name.endswith((PINNED, PAGEABLE))}
    if not host:
        return host
    for op in g.ops:
        ins = arg_sids(op)
        if ins and all(i in host for i in ins):
            index = op.meta["index"]
            host.update(sid for _, _, sid in op.meta.get("outputs", ()) if g.storages[sid].created == index)
    return host


def split_host(g: StepGraph) -> StepGraph:
    """``g`` with its host storages' bytes moved out of the device's (``Storage.host``), in place."""
    for sid in host_sids(g):
        s = g.storages[sid]
        if not s.host:
            s.host, s.nbytes = s.nbytes, 0
    return g


__all__ = ["host_sids", "split_host"]
