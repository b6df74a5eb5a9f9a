"""Widen a capture of a chain cut to k identical blocks into the step with n blocks: each
block's ops, storages and save events are a captured block's, renumbered, renamed and
re-linked to their neighbours (the check that this is exact lives in graphmem/capture/reuse.py).

The capture is cut into regions (prefix, forward of each block, head, backward of each block,
tail); the first two and last two blocks are their own templates (they touch what is around
the chain), every other block copies block 2. The prefix, head and tail are cut block by block
where their ops belong to one block each (graphmem/capture/glue.py): compiled mode's outputs for
backward and hand-back, FSDP2's lazy init viewing every block's shards and its final callback
viewing every block's gradient (per-rank captures, graphmem/distributed/capture.py).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from graphmem.capture.widen_map import NotReusable, Regions, Widen
from graphmem.capture.widen_spans import Spans
from graphmem.capture.widen_units import Layout
from graphmem.chains import Chain
from graphmem.stepgraph import OpNode, SaveEvent, StepGraph, Storage

__all__ = ["NotReusable", "widen"]


def widen(g: StepGraph, chain: Chain, k: int, n: int, modules: list[str], layout: Optional[Layout] = None) -> StepGraph:
    """The step of the model with n blocks, from its capture with k identical blocks; with ``layout``
    (graphmem/capture/widen_units.py), the chain's units as captured (k) and widened (n) instead, a unit
    that is a checkpointed segment recomputed before its backward."""
    lay = layout if layout is not None else Layout.blocks(k, n)
    w = _Copier(g, Regions(g, chain, lay.k, lay, recomputed=layout is not None), lay.n)
    storages = w.storages()
    placeholders = w.placeholders()
    ops = w.ops()
    phase_start = {p: (w.index(i, None, None) or 0 if i < g.num_ops else w.total) for p, i in g.phase_start.items()}
    compiled = dataclasses.replace(g.compiled, widened=(w.prefix, k, n)) if g.compiled is not None else None
    at = lambda i: w.index(i, None, None) or 0 if i < g.num_ops else w.total  # noqa: E731
    return StepGraph(placeholders, ops, storages, w.saves(), phase_start, g.device, w.gradients(), g.root, modules,
                     w.module_inputs(), g.target, dict(g.attention_backends), compiled=compiled, train=g.train,
                     micro_steps=tuple((at(a), at(b)) for a, b in g.micro_steps),
                     first_step_only=None if g.first_step_only is None else
                     (at(g.first_step_only[0]), at(g.first_step_only[1])))


class _Copier(Widen):
    """Writes the widened graph: storages numbered as a full capture numbers them, then
    placeholders, ops (their arguments re-linked), saves, gradients and module inputs."""

    def __init__(self, g: StepGraph, r: Regions, n: int) -> None:
        super().__init__(g, r, n)
        self.prefix = r.prefix
        # placeholders in the order a full capture makes them (block by block), then storages:
        # the pre-existing ones in that order, the others by the op that made them
        runs: list[tuple[Optional[int], list[OpNode]]] = []
        for p in g.placeholders:
            j = r.block_of(p.target) if isinstance(p.target, str) else None
            if runs and runs[-1][0] == j:
                runs[-1][1].append(p)
            else:
                runs.append((j, [p]))
        self.planned: list[tuple[OpNode, Optional[int], Optional[int]]] = [
            (p, b, j) for j, run in runs for b in self.copies(j) for p in run]
        self.sid_of: dict[tuple[int, Optional[int]], int] = {}
        for p, b, _ in self.planned:
            self.sid_of.setdefault((p.meta["storage"], b), len(self.sid_of))
        self.made_for = r.optim_blocks.made_for  # storages an op over several blocks made, one per block
        self.spans = Spans(g, r, self.copies, self.owner)
        made = sorted(((self.index(st.created, b, j), *self.spans.rank(st.sid, b), st, b, j)
                       for st in g.storages.values() if st.created >= 0
                       for j in [self.owner(st)] for b in self.copies(j)), key=lambda x: x[:3])
        for *_, st, b, _ in made:
            self.sid_of[(st.sid, b)] = len(self.sid_of)
        self.by_name = {st.name: st.sid for st in g.storages.values() if st.created < 0}
        self.ph_of: dict[tuple[str, Optional[int]], OpNode] = {}  # (template name, block) -> placeholder
        self.new_ops: list[OpNode] = [None] * self.total  # type: ignore[list-item]
        self.guide: Optional[list] = None  # the op's first list of tensors: its lists of numbers widen alike

    def owner_of_index(self, u: int) -> Optional[int]:
        return self.r.where[u][1] if 0 <= u < self.nops else None

    def owner(self, st: Storage) -> Optional[int]:
        """The captured block a storage belongs to: a block's parameter, or made by its op (or for
        it, by an op over several blocks: a foreach optimizer step's)."""
        if st.sid in self.made_for:
            return self.made_for[st.sid]
        return self.r.block_of(st.name) if st.created < 0 else self.owner_of_index(st.created)

    def same_storage(self, tsid: int, j: int, b: int) -> int:
        """Template storage of block j as the one at the same place of block b's template."""
        g, t = self.g, self.template(b)
        st = g.storages[tsid]
        if j == t:
            return tsid
        if st.created < 0:
            other = self.by_name.get(self.as_captured(st.name, j, t))
            if other is None:
                raise NotReusable("a parameter has no counterpart")
            return other
        u = self.same_op(st.created, b)
        mine = [x for _, _, x in g.ops[st.created].meta["outputs"]]
        theirs = [x for _, _, x in g.ops[u].meta["outputs"]]
        if tsid not in mine or len(mine) != len(theirs):
            raise NotReusable("a storage no op made")
        return theirs[mine.index(tsid)]

    def sid(self, template_sid: int, ctx_b: Optional[int], ctx_j: Optional[int]) -> int:
        j = self.owner(self.g.storages[template_sid])
        b = self.block(j, ctx_b, ctx_j)
        if b is not None:
            template_sid = self.same_storage(template_sid, j, b)  # type: ignore[arg-type]
        try:
            return self.sid_of[(template_sid, b)]
        except KeyError:
            raise NotReusable("a storage has no counterpart") from None

    def storages(self) -> dict[int, Storage]:
        out: dict[int, Storage] = {}
        for (tsid, b), new in sorted(self.sid_of.items(), key=lambda x: x[1]):
            st = self.g.storages[tsid]
            j = self.owner(st)
            out[new] = Storage(
                new, st.nbytes, st.kind, self.index(st.created, b, j), self.freed_at(st.freed, b, j),  # type: ignore[arg-type]
                self.renamed(st.module, j, b), self.renamed(st.name, j, b) if st.created < 0 or st.owner is not None else st.name,
                st.dtype, st.shape, self.sid(st.source, b, j) if st.source is not None else None,
                self.sid(st.owner, b, j) if st.owner is not None else None,
                tuple(self.sid(o, b, j) for o in st.owners), st.cache_freed, st.stream, st.host)
        return out

    def freed_at(self, u: Optional[int], b: Optional[int], j: Optional[int]) -> Optional[int]:
        """Where a storage dies in the widened step. Dead after the step's last op is also what the
        recorder writes for a free after it (``zero_grad(set_to_none=True)`` dropping every
        gradient, graphmem/training/loop.py): the widened step's last op, whichever block that
        op works for (a for-loop optimizer's last parameter is the last block's under LoRA)."""
        if u is not None and u == self.nops - 1:
            return self.total - 1
        return self.index(u, b, j)

    def placeholders(self) -> list[OpNode]:
        out: list[OpNode] = []
        for p, b, j in self.planned:
            name = self.renamed(p.target, j, b)
            q = OpNode("placeholder", name, (), {}, name.replace(".", "_"))
            q.meta.update(p.meta, storage=self.sid(p.meta["storage"], b, j))
            out.append(q)
            self.ph_of[(p.target, b)] = q
        return out

    def twin(self, kind: str, t: Optional[int], pos: int) -> Optional[OpNode]:
        """The op at the same place of a neighbouring captured block: where both refer to the
        same op of a third block, that op is shared (e.g. a causal mask the compiler computed
        once), not the neighbour's."""
        if t is None:
            return None
        for t2 in (t + 1, t - 1):
            if (kind, t2) in self.r.blocks:
                s2, e2 = self.r.region(kind, t2)
                if s2 + pos <= e2:
                    return self.g.ops[s2 + pos]
        return None

    def arg(self, a: Any, ctx_b: Optional[int], ctx_j: Optional[int], other: Any = None) -> Any:
        """An op argument re-linked: placeholders and ops of the same or another block."""
        if isinstance(a, OpNode):
            if a.op == "placeholder":
                j = self.r.block_of(a.target) if isinstance(a.target, str) else None
                b = self.block(j, ctx_b, ctx_j)
                name = self.as_captured(a.target, j, self.template(b)) if b is not None else a.target
                q = self.ph_of.get((name, b))
                if q is None:
                    raise NotReusable("a placeholder has no counterpart")
                return q
            shared = other is a or (isinstance(other, tuple) and other[0] is a)
            if shared and self.r.where[a.meta["index"]][1] != ctx_j:
                return self.new_ops[self.index(a.meta["index"], None, None)]  # type: ignore[index]
            return self.new_ops[self.index(a.meta["index"], ctx_b, ctx_j)]  # type: ignore[index]
        if isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], OpNode):
            o = other[0] if isinstance(other, tuple) and len(other) == 2 else None
            return (self.arg(a[0], ctx_b, ctx_j, o), self.spans.position(a[0], a[1], ctx_b))
        if isinstance(a, list) and ctx_j is None and (self.spans.over_blocks(a) or
                                                      (self.guide is not None and self.spans.over_blocks(self.guide))):
            # outside the blocks: a list over the blocks widens with them (the foreach optimizer step's)
            return [self.arg(x, b, j) for x, b, j in self.spans.widened(a, self.guide)]
        if isinstance(a, list):
            others = other if isinstance(other, list) and len(other) == len(a) else [None] * len(a)
            return [self.arg(x, ctx_b, ctx_j, y) for x, y in zip(a, others)]
        return a

    def ops(self) -> list[OpNode]:
        g, ops = self.g, self.new_ops
        for kind, b, t in self.order:
            s, e = self.r.region(kind, t)
            base = self.start[(kind, b)]
            for u in range(s, e + 1):
                op = g.ops[u]
                i = base + u - s
                tw = self.twin(kind, t, u - s)
                self.guide = None if t is not None else next(  # (read only outside the blocks: ``arg``)
                    (a for a in op.args if isinstance(a, list) and any(isinstance(x, (OpNode, tuple)) for x in a)), None)
                targs = tw.args if tw is not None and len(tw.args) == len(op.args) else (None,) * len(op.args)
                node = OpNode(op.op, op.target, tuple(self.arg(a, b, t, o) for a, o in zip(op.args, targs)),
                              {key: self.arg(v, b, t, tw.kwargs.get(key) if tw is not None else None)
                               for key, v in op.kwargs.items()}, f"op{i}")
                meta = dict(op.meta)
                meta["index"] = i
                meta["module"] = self.renamed(op.meta.get("module", ""), t, b)
                if t is None and u in self.spans.outputs:  # an op over several blocks: its outputs widen too
                    meta["outputs"] = tuple((shape, dtype, self.sid(x, b2, j2))
                                            for (shape, dtype, x), b2, j2 in self.spans.outputs[u])
                    meta["bytes"] = op.meta["bytes"] + self.spans.extra_bytes(u)
                else:
                    meta["outputs"] = tuple((shape, dtype, self.sid(x, b, t)) for shape, dtype, x in op.meta["outputs"])
                if "storage" in meta:
                    meta["storage"] = meta["outputs"][0][2]
                node.meta = meta
                ops[i] = node
        return ops

    def saves(self) -> list[SaveEvent]:
        g, k = self.g, self.k
        out: list[SaveEvent] = []
        by_block: dict[Optional[int], list[SaveEvent]] = {}
        for ev in g.saves:
            j = self.r.block_of(ev.module)  # (packed_at is the op before the saving one: maybe the block before)
            if j is None and g.compiled is not None:  # AOTAutograd's runtime saves every block's tensors at once
                out += self.saved_at_once(ev)
                continue
            by_block.setdefault(j if j is not None else self.owner_of_index(ev.packed_at), []).append(ev)
        for j, evs in by_block.items():
            neighbour = by_block.get(j + 1 if j is not None and j + 1 < k else (j - 1 if j is not None else None), [])
            for n_ev, ev in enumerate(evs):
                mate = neighbour[n_ev] if len(neighbour) == len(evs) else None
                common = mate is not None and mate.sid == ev.sid and self.owner(g.storages[ev.sid]) != j  # a shared tensor
                for b in self.copies(j):
                    out.append(SaveEvent(self.sid(ev.sid, None, None) if common else self.sid(ev.sid, b, j),
                                         self.index(ev.packed_at, b, j), self.index(ev.released_at, b, j),  # type: ignore[arg-type]
                                         self.renamed(ev.module, j, b), ev.phase, ev.shape, ev.dtype, ev.grad_fn))
        out.sort(key=lambda e: e.packed_at)
        return out

    def saved_at_once(self, ev: SaveEvent) -> list[SaveEvent]:
        """A save made outside the blocks (compiled mode: the compiled forward's outputs, saved
        by AOTAutograd's runtime after the graph): one per block its storage's block becomes,
        at the same point of the step."""
        j = self.owner(self.g.storages[ev.sid])
        at, until = self.index(ev.packed_at, None, None), self.index(ev.released_at, None, None)
        return [SaveEvent(self.sid(ev.sid, b, j), at, until, ev.module, ev.phase, ev.shape, ev.dtype,  # type: ignore[arg-type]
                          ev.grad_fn) for b in self.copies(j)]

    def gradients(self) -> list[int]:
        grad_runs: list[tuple[Optional[int], list[int]]] = []  # the template's order, block by block
        for x in self.g.gradients:
            j = self.owner(self.g.storages[x])
            if grad_runs and grad_runs[-1][0] == j:
                grad_runs[-1][1].append(x)
            else:
                grad_runs.append((j, [x]))
        return [self.sid_of[(x, b)] for j, run in grad_runs for b in self.copies(j) for x in run]

    def module_inputs(self) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        for path, shape in self.g.module_inputs.items():
            j = self.r.block_of(path)
            if j is None:
                out[path] = shape
            else:
                for b in self.copies(j):
                    out[self.renamed(path, j, b)] = shape
        return out
