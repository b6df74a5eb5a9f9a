"""FLOPs of one recorded op (a StepGraph's OpNode) by torch.utils.flop_counter's formulas: the
recompute cost of a checkpoint plan (graphmem/planning/pieces.py, graphmem/planning/planner.py)
and of a selective level's ops (graphmem/planning/selective.py).

Known limitations: an op the flop counter has no formula for counts 0 (elementwise ops, and CPU
kernels without a CUDA twin in ``_SAME_AS``).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.utils.flop_counter import flop_registry

from graphmem.stepgraph import OpNode


def _meta(x: object) -> object:  # a recorded argument, its OpNodes as meta tensors
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], OpNode):
        positions = x[0].meta.get("positions")
        shape, dtype, _ = x[0].meta["outputs"][positions.index(x[1]) if positions else x[1]]
        return torch.empty(shape, dtype=dtype, device="meta")
    if isinstance(x, OpNode):
        if x.op == "placeholder":
            return torch.empty(x.meta["shape"], dtype=x.meta["dtype"], device="meta")
        shape, dtype, _ = x.meta["outputs"][0]
        return torch.empty(shape, dtype=dtype, device="meta")
    if isinstance(x, list):
        return [_meta(a) for a in x]
    return x


_aten = torch.ops.aten
# CPU kernels the flop counter has no entry for, counted by their CUDA twin's formula (same
# arguments up front: query, key, value / grad_out, query, key, value)
_SAME_AS = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _aten._scaled_dot_product_flash_attention,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _aten._scaled_dot_product_flash_attention_backward,
}


def op_flops(node: OpNode) -> int:
    """FLOPs of one recorded op by torch.utils.flop_counter's formulas (0 if it has none)."""
    packet = getattr(node.target, "overloadpacket", None)
    formula = flop_registry.get(_SAME_AS.get(packet, packet))  # type: ignore[arg-type]
    if formula is None:
        return 0
    outs: tuple[Optional[torch.Tensor], ...] = tuple(torch.empty(s, dtype=d, device="meta") for s, d, _ in node.meta.get("outputs", ()))
    positions = node.meta.get("positions")
    if positions and list(positions) != list(range(len(outs))):  # outputs that are None (a conv's unneeded grad_input)
        full: list[Optional[torch.Tensor]] = [None] * (max(positions) + 1)
        for p, t in zip(positions, outs):
            full[p] = t
        outs = tuple(full)
    out = outs[0] if len(outs) == 1 else outs
    return int(formula(*(_meta(a) for a in node.args), **{k: _meta(v) for k, v in node.kwargs.items()}, out_val=out))
