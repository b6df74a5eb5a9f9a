"""Depth reuse through the optimizer step: which block each op of phase "optimizer" works for.

The optimizer step (graphmem/training/loop.py) runs after backward, outside every module, so its
ops carry no module path. What ties an op to a block is its tensors: a parameter is its block's;
a gradient, an optimizer state or a master copy has the parameter as its ``owner``
(graphmem/capture/recorder.py marks them); a temporary is the block of the op that made it. An op
whose tensors are all one block's (torch.optim's for-loop step, one parameter at a time; the
states' ``zeros_like`` and step counters, made per parameter in both implementations) is labelled
with that block and copied per block like the blocks' own ops (graphmem/capture/glue.py's
sections). An op over several blocks (the foreach step's ``torch._foreach_*`` over every
parameter at once) is copied once, its lists and its outputs widened block run by block run
(graphmem/capture/widen.py ``Spans``). The check at depth k + 1 (graphmem/capture/reuse.py)
compares the result with a capture, as for the rest of the step.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from graphmem.stepgraph import OpNode, StepGraph


def tensor_sids(a: Any) -> list[int]:
    """The storages an argument refers to (lists flattened)."""
    if isinstance(a, list):
        return [s for x in a for s in tensor_sids(x)]
    if isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], OpNode):
        return [a[0].meta["outputs"][a[1]][2]]
    if isinstance(a, OpNode):
        if a.op == "placeholder":
            return [a.meta["storage"]]
        outs = a.meta["outputs"]
        return [outs[0][2]] if outs else []
    return []


class OptimizerBlocks:
    """Labels of the optimizer phase's ops (``labels[i]``: a block, or None for an op over
    several blocks or none) and the block of each storage such an op makes per list element."""

    def __init__(self, g: StepGraph, start: int, block_at: list[Optional[int]],
                 block_of: Callable[[str], Optional[int]]) -> None:
        self.g, self.block_at, self.block_of = g, block_at, block_of
        self.made_for: dict[int, Optional[int]] = {}  # storage made by an op over several blocks -> its block
        self.labels: dict[int, Optional[int]] = {}
        for i in range(start, g.num_ops):
            op = g.ops[i]
            outs = [x for _, _, x in op.meta["outputs"]]
            blocks = {self.storage_block(s) for a in (*op.args, *op.kwargs.values()) for s in tensor_sids(a)}
            made = [x for x in outs if g.storages[x].created == i]
            lists = [a for a in op.args if isinstance(a, list) and len(a) == len(outs)]
            if len(blocks) > 1 and lists and made:  # a foreach op's output i is element i's
                for x, el in zip(outs, lists[0]):
                    sids = tensor_sids(el)
                    self.made_for[x] = self.storage_block(sids[0]) if sids else None
            blocks |= {self.storage_block(x) for x in outs if g.storages[x].owner is not None or x not in made}
            label = blocks.pop() if len(blocks) == 1 else None
            self.labels[i] = label
            block_at[i] = label

    def storage_block(self, sid: int) -> Optional[int]:
        st = self.g.storages[sid]
        if st.owner is not None and st.owner != sid:
            return self.storage_block(st.owner)
        if st.created < 0:
            return self.block_of(st.name)
        if sid in self.made_for:
            return self.made_for[sid]
        return self.block_at[st.created] if st.created < len(self.block_at) else None
