"""Compiled mode, for depth reuse: the glue around AOTAutograd's graphs, cut block by block.

Between the chain's forward and its backward, and after the backward, a compiled step runs ops
that belong to no module but refer to every block: the forward graph's outputs for backward
(transposes and detaches of each block's tensors, in block order or reversed), the backward's
detaches of each block's parameters, and the gradients handed back as ``.grad``
(graphmem/capture/hand_back.py). Each such op allocates nothing and takes all its tensors from one
block (its "owner"); runs of them repeat block by block, so the widen (graphmem/capture/widen.py)
copies them per block like the blocks' own ops. Anything else there, owned by no single block,
is copied once.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from graphmem.stepgraph import OpNode, StepGraph

Region = tuple[str, Optional[int], int, int]  # (kind, block or None, first op, last op)


class NotBlockByBlock(Exception):
    """The glue does not repeat block by block."""


def _owner(op: OpNode, owner_of: Callable[[OpNode], Optional[int]]) -> Optional[int]:
    """The one block all of a zero-byte, module-less op's tensor arguments come from (None: none)."""
    if op.meta.get("module") or op.meta.get("bytes") or op.meta.get("scratch"):
        return None
    owners = [owner_of(a[0] if isinstance(a, tuple) and len(a) == 2 else a) for a in op.args
              if isinstance(a, OpNode) or (isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], OpNode))]
    return owners[0] if owners and owners[0] is not None and all(o == owners[0] for o in owners) else None


def _ref(a: object) -> Optional[OpNode]:
    node = a[0] if isinstance(a, tuple) and len(a) == 2 else a
    return node if isinstance(node, OpNode) else None


def _users(g: StepGraph, first: int, last: int) -> dict[int, list[int]]:
    """Ops first..last -> the indices of the ops that take their outputs."""
    out: dict[int, list[int]] = {}
    for i, op in enumerate(g.ops):
        for a in op.args:
            node = _ref(a)
            if node is not None and node.op != "placeholder" and first <= node.meta["index"] <= last:
                out.setdefault(node.meta["index"], []).append(i)
    return out


def cut(g: StepGraph, name: str, first: int, last: int, block_at: list[Optional[int]], labels: list[Optional[int]],
        block_of: Callable[[str], Optional[int]], final: bool = False) -> tuple[list[Region], dict[str, int]]:
    """Ops first..last cut into plain stretches (copied once) and sections (each block's run of
    glue, blocks in order (+1) or reversed (-1)). ``block_at``: the block of each op so far
    (None outside the blocks), filled in for the glue; ``labels``: the block of each op's
    module (a backward graph's recomputed forward ops carry their block's); ``final``: the labels
    are every op's block already (the optimizer step's: graphmem/capture/widen_optim.py). Returns
    the regions in order and each section's direction."""
    def owner_of(a: OpNode) -> Optional[int]:
        if a.op == "placeholder":
            return block_of(a.target) if isinstance(a.target, str) else None
        return block_at[a.meta["index"]]

    users = _users(g, first, last)
    runs: list[list[Any]] = []  # [block, first, last]
    for i in range(first, last + 1):
        j = labels[i] if labels[i] is not None or final else _owner(g.ops[i], owner_of)
        if j is None and not final and not any(_ref(a) for a in g.ops[i].args):  # made from nothing (zeros) for one block's use
            seen = {block_at[u] for u in users.get(i, ())}
            j = seen.pop() if len(seen) == 1 else None
        block_at[i] = j
        if runs and runs[-1][0] == j:
            runs[-1][2] = i
        else:
            runs.append([j, i, i])
    regions: list[Region] = []
    directions: dict[str, int] = {}
    for j, s, e in runs:
        kind = f"{name}{len(regions)}"
        prev = regions[-1] if regions else None
        if j is None:
            regions.append((kind, None, s, e))
            continue
        if prev is not None and prev[1] is not None and abs(prev[1] - j) == 1 and \
                directions.get(prev[0], j - prev[1]) == j - prev[1]:
            directions[prev[0]] = j - prev[1]  # the section goes on
            regions.append((prev[0], j, s, e))
        else:
            regions.append((kind, j, s, e))
    return regions, directions


def expand(regions: list[Region], directions: dict[str, int], copies: Callable[[int], list[int]]) -> list[tuple[str, Optional[int]]]:
    """The (kind, block) order of the widened stretch: each section over every block its
    blocks become."""
    out: list[tuple[str, Optional[int]]] = []
    seen: set[str] = set()
    for kind, j, _, _ in regions:
        if j is None:
            out.append((kind, None))
            continue
        if kind in seen:
            continue
        seen.add(kind)
        blocks = sorted(b for k2, j2, _, _ in regions if k2 == kind and j2 is not None for b in copies(j2))
        if kind not in directions and len(blocks) > 1:
            raise NotBlockByBlock(f"one block's glue stands for {len(blocks)} blocks in no known order")
        out += [(kind, b) for b in (reversed(blocks) if directions.get(kind, 1) < 0 else blocks)]
    return out


def absorb(runs: list[list[int]]) -> list[list[int]]:
    """Runs [block, first, last] with a run of a far block inside another block's (x, y, x with
    y not x's neighbour: a value the compiler made once for all blocks, recomputed where the
    first user needs it) merged into that block's."""
    out: list[list[int]] = []
    for run in runs:
        if len(out) >= 2 and out[-2][0] == run[0] and abs(out[-1][0] - run[0]) > 1:
            out.pop()
            out[-1][2] = run[2]
        else:
            out.append(list(run))
    return out
