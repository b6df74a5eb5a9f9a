"""Ops outside the blocks that work over several blocks at once (the foreach optimizer step's
``torch._foreach_*`` over every parameter, graphmem/capture/widen_optim.py): copied once into the
widened step, with each list argument and the outputs widened run by run: a captured block's
run of elements stands for every block that block becomes (graphmem/capture/widen_map.py
``block_copies``), in the list's own order of blocks."""
from __future__ import annotations

from typing import Any, Callable, Optional

from graphmem.capture.widen_map import NotReusable, Regions
from graphmem.stepgraph import OpNode, StepGraph, Storage

Expanded = list[tuple[Any, Optional[int], Optional[int]]]  # (template item, block it becomes, captured block)


class Spans:
    """The widened outputs of the ops outside the blocks, and where each of their template
    outputs lands (its position in the op's outputs, its place in the numbering of storages)."""

    def __init__(self, g: StepGraph, r: Regions, copies: Callable[[Optional[int]], list[Optional[int]]],
                 owner: Callable[[Storage], Optional[int]]) -> None:
        self.g, self.r, self.copies, self.owner = g, r, copies, owner
        self.outputs: dict[int, Expanded] = {}
        self.pos: dict[tuple[int, int, Optional[int]], int] = {}
        self._rank: dict[tuple[int, Optional[int]], int] = {}
        self._extra: dict[int, int] = {}
        start = g.phase_start.get("optimizer", g.num_ops)  # (the glue elsewhere is cut block by block: glue.py)
        for u in range(start, g.num_ops):
            outs = g.ops[u].meta["outputs"]
            if r.where[u][1] is not None or len(outs) < 2 or all(self.owner(g.storages[x]) is None for _, _, x in outs):
                continue
            self._widen_outputs(u, outs)

    def _widen_outputs(self, u: int, outs: tuple) -> None:
        g = self.g
        items = list(enumerate(outs))
        new = self._runs(items, lambda it: self.owner(g.storages[it[1][2]]))
        self.outputs[u] = [(item, b, j) for (_, item), b, j in new]
        first: dict[int, int] = {}
        for n, ((i, (_, _, x)), b, _) in enumerate(new):
            self.pos[(u, i, b)] = n
            first.setdefault(x, i)
        made = [x for _, _, x in outs if g.storages[x].created == u]
        # the capture numbers an op's storages in the order of its outputs, or the reverse: as the template does
        down = len(made) > 1 and made[0] > made[-1]
        seen: set[tuple[int, Optional[int]]] = set()
        extra = 0
        for n, ((_, (_, _, x)), b, _) in enumerate(new):
            if g.storages[x].created == u and (x, b) not in seen:
                seen.add((x, b))
                self._rank[(x, b)] = -n if down else n
                extra += g.storages[x].nbytes
        self._extra[u] = extra - sum(g.storages[x].nbytes for x in set(made))

    def _runs(self, items: list, block: Callable[[Any], Optional[int]]) -> Expanded:
        """Items in runs of one block each; each run of block j once per block j becomes, the
        blocks in the order the runs go (up or down)."""
        runs: list[tuple[Optional[int], list]] = []
        for it in items:
            j = block(it)
            if runs and runs[-1][0] == j:
                runs[-1][1].append(it)
            else:
                runs.append((j, [it]))
        order = [j for j, _ in runs if j is not None]
        down = len(order) > 1 and order[0] > order[-1]
        if order != sorted(order, reverse=down) or len(set(order)) != len(order):
            raise NotReusable("a list over the blocks is not in block order")
        out: Expanded = []
        for j, run in runs:
            blocks = self.copies(j)
            for b in (reversed(blocks) if down else blocks):
                out += [(it, b, j) for it in run]
        return out

    def over_blocks(self, a: list) -> bool:
        """Whether a list refers to a block that stands for several (else it is copied as it is)."""
        return any(len(self.copies(self._block_of_item(x))) > 1 for x in a)

    def widened(self, a: list, guide: Optional[list] = None) -> Expanded:
        """A list argument of an op outside the blocks, widened; a list of numbers as long as the
        op's list of tensors (``guide``: torch.optim's per-parameter scalars) alike."""
        if guide is not None and a is not guide and len(a) == len(guide) and \
                not any(isinstance(x, (OpNode, tuple)) for x in a):
            blocks = [self._block_of_item(x) for x in guide]
            return [(a[i], b, j) for i, b, j in self._runs(list(range(len(a))), blocks.__getitem__)]
        return self._runs(a, self._block_of_item)

    def _block_of_item(self, a: Any) -> Optional[int]:
        if isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], OpNode):
            return self.owner(self.g.storages[a[0].meta["outputs"][a[1]][2]])
        if isinstance(a, OpNode):
            if a.op == "placeholder":
                return self.r.block_of(a.target) if isinstance(a.target, str) else None
            outs = a.meta["outputs"]
            return self.owner(self.g.storages[outs[0][2]]) if outs else None
        return None

    def position(self, node: OpNode, i: int, b: Optional[int]) -> int:
        """Output i of template op ``node``, as block b's, in the widened op's outputs."""
        if node.op == "placeholder":
            return i
        return self.pos.get((node.meta["index"], i, b), i)

    def rank(self, sid: int, b: Optional[int]) -> tuple[int, int]:
        """Where a made storage falls among those made by the same op (the numbering's key)."""
        if (sid, b) in self._rank:
            return self._rank[(sid, b)], 0
        return sid, -1 if b is None else b

    def extra_bytes(self, u: int) -> int:
        """The bytes op u allocates beyond the template's: its outputs for the copied blocks."""
        return self._extra.get(u, 0)
