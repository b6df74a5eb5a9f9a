"""Where each op of a widened step comes from: a capture of a chain cut to k identical blocks is
cut into regions (prefix, forward of each block, head, backward of each block, tail), and each
block of the n-block step takes a captured block as its template (blocks 0 and 1 and the last
two are their own, every other block copies block 2); ``Widen.index`` maps a template's op to
its position in the widened step. graphmem/capture/widen.py writes the widened graph.
"""
from __future__ import annotations

from typing import Optional

from graphmem.capture.glue import NotBlockByBlock, Region, absorb, cut, expand
from graphmem.capture.widen_optim import OptimizerBlocks
from graphmem.capture.widen_units import Layout, block_copies  # (block_copies: compiled.py's)
from graphmem.chains import Chain
from graphmem.stepgraph import StepGraph


class NotReusable(Exception):
    """The widened graph would not be the model's own: capture at full depth instead."""


class Regions:
    """A capture cut into: prefix, F0..F(k-1), head, B(k-1)..B0, tail (each a range of ops), by the
    chain's units (``layout``; default: each block a unit). A unit that is a checkpointed segment
    recomputes its forward right before its backward: with ``recomputed``, that is part of its
    backward region; without, a recompute inside the blocks refuses the reuse."""

    def __init__(self, g: StepGraph, chain: Chain, k: int, layout: Optional[Layout] = None, recomputed: bool = False) -> None:
        prefix = f"{chain.path}." if chain.path else ""
        self.layout = layout if layout is not None else Layout.blocks(k, k)
        self.prefix, self.k = prefix, self.layout.k
        k = self.k
        back = g.phase_start.get("backward", g.num_ops)
        labels = [self.block_of(op.meta.get("module", "")) for op in g.ops]
        if not recomputed and any(op.meta.get("recompute") and labels[i] is not None for i, op in enumerate(g.ops)):
            raise NotReusable("checkpointed")  # (a checkpointed head or loss, outside the blocks, is copied once)
        fwd = [i for i in range(back) if labels[i] is not None]
        bwd = [i for i in range(back, g.num_ops) if labels[i] is not None]
        if not fwd or not bwd:
            raise NotReusable("no block ops")
        self.regions: list[tuple[str, Optional[int], int, int]] = []
        starts: list[tuple[int, int]] = []
        for i in fwd:
            if not starts or starts[-1][0] != labels[i]:
                starts.append((labels[i], i))  # type: ignore[arg-type]
        if [b for b, _ in starts] != list(range(k)):
            raise NotReusable("forward not block by block")
        for n, (b, s) in enumerate(starts):
            self.regions.append(("F", b, s, starts[n + 1][1] - 1 if n + 1 < len(starts) else fwd[-1]))
        runs: list[list[int]] = []
        for i in range(bwd[0], bwd[-1] + 1):
            if labels[i] is None or (runs and runs[-1][0] == labels[i]):
                runs[-1][2] = i
            else:
                runs.append([labels[i], i, i])  # type: ignore[list-item]
        if g.compiled is not None:  # a backward graph may first recompute forward values of every block: glue
            runs = absorb(runs)[-k:]
        head = ("head", None, fwd[-1] + 1, runs[0][1] - 1)
        if [r[0] for r in runs] != list(reversed(range(k))):
            raise NotReusable("backward not block by block")
        self.regions += [("B", b, s, e) for b, s, e in runs]
        opt = g.phase_start.get("optimizer", g.num_ops)  # the optimizer step: cut by the blocks its tensors are
        if opt <= bwd[-1]:
            raise NotReusable("the optimizer steps inside backward")
        tail = ("tail", None, bwd[-1] + 1, opt - 1)
        # the glue around the blocks, cut block by block (graphmem/capture/glue.py): compiled mode's
        # outputs for backward and hand-back; FSDP2's lazy init viewing every block's shards (prefix),
        # its final callback viewing every block's gradients (tail)
        block_at: list[Optional[int]] = [None] * g.num_ops
        for _, blk, s, e in self.regions:
            block_at[s:e + 1] = [blk] * (e - s + 1)
        self.prefix_regions, d0 = cut(g, "prefix", 0, fwd[0] - 1, block_at, labels, self.block_of)
        self.head, d1 = cut(g, "head", head[2], head[3], block_at, labels, self.block_of)
        self.tail, d2 = cut(g, "tail", tail[2], tail[3], block_at, labels, self.block_of)
        self.optim_blocks = OptimizerBlocks(g, opt, block_at, self.block_of)
        for i, label in self.optim_blocks.labels.items():
            labels[i] = label
        self.optim, d3 = cut(g, "optim", opt, g.num_ops - 1, block_at, labels, self.block_of, final=True)
        self.directions: dict[str, int] = {**d0, **d1, **d2, **d3}
        self.regions += self.prefix_regions + self.head + self.tail + self.optim
        self.blocks = {(kind, blk): (s, e) for kind, blk, s, e in self.regions}
        self.where: list[tuple[str, Optional[int], int]] = [("", None, 0)] * g.num_ops  # op -> (kind, block, pos)
        for kind, blk, s, e in self.regions:
            for i in range(s, e + 1):
                self.where[i] = (kind, blk, i - s)

    def block_of(self, path: str) -> Optional[int]:
        if not path.startswith(self.prefix):
            return None
        head = path[len(self.prefix):].split(".", 1)[0]
        return self.layout.unit_of(int(head)) if head.isdigit() else None

    def region(self, kind: str, block: Optional[int]) -> tuple[int, int]:
        try:
            return self.blocks[(kind, block)]
        except KeyError:
            raise NotReusable(f"no region {kind}{block}") from None


class Widen:
    def __init__(self, g: StepGraph, r: Regions, n: int) -> None:
        self.layout = r.layout
        self.g, self.r, self.n, self.k = g, r, self.layout.n, r.k
        self.nops = g.num_ops
        # synthesized regions in order: (kind, block, template block)
        order = self.glue(r.prefix_regions)
        order += [("F", b, self.template(b)) for b in range(n)]
        order += self.glue(r.head)
        order += [("B", b, self.template(b)) for b in reversed(range(n))]
        order += self.glue(r.tail)
        order += self.glue(r.optim)
        self.order = order
        self.start: dict[tuple[str, Optional[int]], int] = {}
        pos = 0
        for kind, b, t in order:
            s, e = r.region(kind, t)
            self.start[(kind, b)] = pos
            pos += e - s + 1
        self.total = pos

    def glue(self, regions: list[Region]) -> list[tuple[str, Optional[int], Optional[int]]]:
        try:
            stretch = expand(regions, self.r.directions, self.layout.copies)
        except NotBlockByBlock as e:
            raise NotReusable(str(e)) from None
        return [(kind, b, None if b is None else self.template(b)) for kind, b in stretch]

    def template(self, b: int) -> int:
        """The captured block (unit) that block b copies: the ends and their neighbours are their own
        (they touch what is around the chain), every other block copies block 2, whose
        neighbours are blocks like it (graphmem/capture/widen_units.py ``Layout.template``)."""
        return self.layout.template(b)

    def renamed(self, path: str, j: Optional[int], b: Optional[int]) -> str:
        """A module path of captured unit j as widened unit b's."""
        return self.layout.rename(path, self.r.prefix, j, b)

    def as_captured(self, path: str, j: Optional[int], t: Optional[int]) -> str:
        """A module path of captured unit j as captured unit t's."""
        return self.layout.rename(path, self.r.prefix, j, t, captured=True)

    def copies(self, j: Optional[int]) -> list[Optional[int]]:
        """The blocks that captured block j becomes."""
        return [None] if j is None else list[Optional[int]](self.layout.copies(j))

    def block(self, j: Optional[int], ctx_b: Optional[int], ctx_j: Optional[int]) -> Optional[int]:
        """The synthesized block that template block j is, seen from template block ctx_j
        written as block ctx_b (None: outside the chain)."""
        if j is None:
            return None
        if j == ctx_j:  # (the common case: a block's own op or storage)
            return ctx_b
        if ctx_j is None or (min(j, ctx_j) <= 1 and max(j, ctx_j) >= self.k - 2 and abs(j - ctx_j) >= 3):
            # (a first block seen from a last one or back: a value made once and used by every
            # block, as a compiled graph's shared causal mask, lives from the first user to the
            # last; the check at depth k + 1 sees whether that is what happened)
            mine = self.copies(j)
            if len(mine) != 1:
                raise NotReusable("an interior block is referred to from outside the chain")
            return mine[0]
        b = ctx_b + (j - ctx_j)  # type: ignore[operator]
        if not 0 <= b < self.n:
            raise NotReusable("a block refers to a block that has no counterpart")
        return b

    def same_op(self, u: int, b: int) -> int:
        """Template op u (of some block) as the op at the same place of block b's template."""
        kind, j, pos = self.r.where[u]
        t = self.template(b)
        if j == t:
            return u
        s, e = self.r.region(kind, t)
        if s + pos > e or self.g.ops[s + pos].target != self.g.ops[u].target:
            raise NotReusable("blocks differ")
        return s + pos

    def index(self, u: Optional[int], ctx_b: Optional[int], ctx_j: Optional[int]) -> Optional[int]:
        if u is None or u < 0:
            return u
        if u >= self.nops:  # made after the last op (nothing follows)
            return self.total + (u - self.nops)
        kind, j, pos = self.r.where[u]
        b = self.block(j, ctx_b, ctx_j)
        if b is not None:
            u = self.same_op(u, b)
            pos = self.r.where[u][2]
        return self.start[(kind, b)] + pos


__all__ = ["NotReusable", "Regions", "Widen", "block_copies", "rename"]


def rename(path: str, prefix: str, j: Optional[int], b: Optional[int]) -> str:
    if j is None or b is None or j == b:
        return path
    old = f"{prefix}{j}"
    if path == old or path.startswith(old + "."):
        return f"{prefix}{b}" + path[len(old):]
    return path
