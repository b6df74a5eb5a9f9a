"""A chain's pieces, measured: captures of the step cut at block boundaries into the roles
of passes/checkpoint_model.py's model.

Captures of a few plans on fake tensors (nothing checkpointed, every block its own segment,
the whole chain one segment, pairs) show every block in every role it can play; each capture
is cut into pieces at block boundaries, and a role measured twice must agree. A chain of
identical blocks is captured at depth 4 and its interior block stands for all the others;
the stitched peak of the plan without checkpointing must equal the report's own peak, or the
captures are repeated at full depth.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn
from torch.utils.flop_counter import flop_registry

from graphmem.chains import Chain, find_chain, truncated
from graphmem.errors import GraphmemError, PassError
from graphmem.passes.budget import later_steps_peak, made_states
from graphmem.passes.checkpoint import (
    NOTHING,
    UNMEASURED,
    ChainCosts,
    Piece,
    Stage,
    evaluate,
    level_after,
    segments_of,
)
from graphmem.planning.apply import apply_segments, chain_blocks
from graphmem.stepgraph import OpNode, StepGraph

DEPTH = 4  # blocks captured for a chain of identical blocks (first, two interior, last)


class PlanError(GraphmemError):
    """No checkpoint plan can be made or none fits."""


# -- FLOPs ---------------------------------------------------------------------------------------
def _meta(x: Any) -> Any:
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
    outs: tuple[Any, ...] = tuple(torch.empty(s, dtype=d, device="meta") for s, d, _ in node.meta.get("outputs", ()))
    positions = node.meta.get("positions")
    if positions and list(positions) != list(range(len(outs))):  # outputs that are None (a conv's unneeded grad_input)
        full: list[Any] = [None] * (max(positions) + 1)
        for p, t in zip(positions, outs):
            full[p] = t
        outs = tuple(full)
    out = outs[0] if len(outs) == 1 else outs
    return int(formula(*(_meta(a) for a in node.args), **{k: _meta(v) for k, v in node.kwargs.items()}, out_val=out))


# -- cutting a capture into pieces -------------------------------------------------------------------
class _Cut:
    def __init__(self, g: StepGraph, blocks: Sequence[str]) -> None:
        self.g = g
        n = g.num_ops
        created, freed = [0] * (n + 1), [0] * (n + 1)
        self.base = 0
        for s in g.storages.values():  # as passes/liveness.py: live during op i if created <= i <= freed
            # every step after the first holds the optimizer states from its start: plans are
            # for those steps (passes/budget.py, later_steps_peak), so the states count as made before
            if s.created < 0 or s.kind == "optimizer state":
                if s.freed is not None and s.freed < 0:
                    continue
                self.base += s.nbytes
            elif s.created < n and (s.freed is None or s.freed >= s.created):
                created[s.created] += s.nbytes
            else:
                continue
            if s.freed is not None:
                freed[s.freed] += s.nbytes
        self.during, self.after = [], []
        level = self.base
        for i in range(n):
            level += created[i]
            self.during.append(level)
            level -= freed[i]
            self.after.append(level)
        index = {path: j for j, path in enumerate(blocks)}  # block module path -> its place in the chain
        self.labels = [self._label(op, index) for op in g.ops]
        self.shared: list[tuple[int, int]] = []  # (freed at, bytes) of the shared tensors (``share``)
        # (created, freed, bytes) of what died when autocast's cast cache was cleared
        self.cleared = [(s.created, s.freed, s.nbytes) for s in g.storages.values()
                        if s.cache_freed and s.created >= 0 and s.freed is not None]

    @staticmethod
    def _label(op: OpNode, index: dict[str, int]) -> Optional[tuple[int, bool]]:
        """(the chain block the op ran in, whether in a recompute), or None outside the chain."""
        path = op.meta.get("module", "")
        while path:
            if path in index:
                return index[path], bool(op.meta.get("recompute"))
            path = path.rpartition(".")[0]
        return None

    def piece(self, start: int, end: int, real: bool = False) -> Piece:
        """Ops start..end inclusive (empty if end < start). The shared tensors (see
        ``share``) stay live in it unless ``real``: the plan frees them where it frees them."""
        if end < start:
            return NOTHING
        level = self.after[start - 1] if start > 0 else self.base
        net, high = self.after[end] - level, max(self.during[start:end + 1])
        frees = sorted((f, n) for f, n in self.shared if start <= f <= end) if not real else []
        if frees:  # still live after their free, to the piece's end
            net += sum(n for _, n in frees)
            high, add, j = 0, 0, 0
            for i in range(start, end + 1):
                while j < len(frees) and frees[j][0] < i:
                    add, j = add + frees[j][1], j + 1
                high = max(high, self.during[i] + add)
        return Piece(max(0, high - level), net)

    def share(self, keys: Sequence[set[tuple[int, int]]]) -> None:
        """Mark as shared the storages of micro-step w made at op ``created`` (counted from the
        micro-step's start) with ``nbytes``, for each (created, nbytes) in ``keys[w]``."""
        self.shared = [(s.freed, s.nbytes) for (lo, _, hi), k in zip(self.windows(), keys)
                       for s in self.g.storages.values()
                       if lo <= s.created < hi and (s.created - lo, s.nbytes) in k and s.freed is not None]

    def held(self, start: int, end: int) -> int:
        """Bytes ops start..end made that outlive them only in autocast's cache (a later clear frees them)."""
        return sum(n for c, f, n in self.cleared if start <= c <= end < f)

    def piece_holding(self, start: int, end: int, since: int, real: bool = False) -> Piece:
        """``piece``, but what a clear inside frees of the bytes ops since..start-1 left in the
        cache stays live: the plan frees those bytes itself (their amount depends on the plan)."""
        p = self.piece(start, end, real)
        return Piece(p.high, p.net + sum(n for c, f, n in self.cleared if since <= c < start <= f <= end))

    def flops(self, start: int, end: int) -> int:
        return sum(op_flops(op) for op in self.g.ops[start:end + 1])

    def windows(self) -> list[tuple[int, int, int]]:
        """(start, backward start, end) of each micro-step traced (one without micro-batches)."""
        steps = self.g.micro_steps or ((0, self.g.phase_start.get("backward", self.g.num_ops)),)
        return [(0 if k == 0 else f, b, steps[k + 1][0] if k + 1 < len(steps) else self.g.num_ops)
                for k, (f, b) in enumerate(steps)]

    def regions(self, window: tuple[int, int, int]) -> tuple[list[tuple[int, int, int]], tuple[int, int],
                                                              list[tuple[tuple[int, bool], int, int]]]:
        """In a micro-step's ``window``: forward pieces per block, the head's range, backward
        runs (label, start, end); the forward's context exits after the head's last op before
        its backward."""
        lo, back, hi = window
        fwd = [i for i in range(lo, back) if self.labels[i] is not None]
        bwd = [i for i in range(back, hi) if self.labels[i] is not None]
        if not fwd or not bwd:
            raise PlanError("the chain's blocks run no ops in the step; nothing to checkpoint")
        starts: list[tuple[int, int]] = []
        for i in fwd:
            block = self.labels[i][0]  # type: ignore[index]
            if not starts or starts[-1][0] != block:
                starts.append((block, i))
        forward = [(blk, s, (starts[k + 1][1] - 1 if k + 1 < len(starts) else fwd[-1]))
                   for k, (blk, s) in enumerate(starts)]
        runs: list[tuple[tuple[int, bool], int, int]] = []
        for i in range(bwd[0], bwd[-1] + 1):
            lab = self.labels[i]
            if lab is None or (runs and runs[-1][0] == lab):
                runs[-1] = (runs[-1][0], runs[-1][1], i)
            else:
                runs.append((lab, i, i))
        return forward, (fwd[-1] + 1, bwd[0] - 1), runs


def _roles(cut: _Cut, k: int, segs: Sequence[tuple[int, int, bool]], what: str,
           found: dict[tuple[int, str], tuple[Piece, int, int]],
           window: tuple[int, int, int], disagree: list[str]) -> tuple[tuple[Piece, Piece, Piece, Piece], tuple[Piece, Piece]]:
    """Cut one capture (plan ``segs`` over k blocks) into (block, role) pieces with their
    FLOPs and the bytes they leave in autocast's cache, added to ``found`` (a role measured
    twice in two ways keeps the first and is said in ``disagree``: the pieces are then an
    estimate); returns the fixed pieces around the chain (before, the head until the
    forward's context exits and after it, after) and the head's two with the shared tensors
    freed where they die."""
    forward, head, runs = cut.regions(window)
    if [blk for blk, _, _ in forward] != list(range(k)):
        raise PlanError(f"the chain's blocks ran in the order {[blk for blk, _, _ in forward][:8]} in forward, "
                        "not one after another; graphmem plans checkpoints for chains run block by block")
    ranges: list[tuple[int, str, int, int]] = []
    for a, b, ck in segs:
        for i in range(a, b + 1):
            role = "fwd" if not ck else "fwd_first" if i == a else "fwd_member"
            ranges.append((i, role, forward[i][1], forward[i][2]))
    pattern: list[tuple[int, bool, str, int]] = []  # (label block, recompute, role, role block)
    for a, b, ck in reversed(segs):
        if not ck:
            pattern.append((a, False, "bwd", a))
        elif a == b:
            pattern += [(a, False, "one_pre", a), (a, True, "one_re", a), (a, False, "one_post", a)]
        else:
            pattern += [(b, False, "pre", b), (a, True, "re_first", a),
                        *((i, True, "re_member", i) for i in range(a + 1, b)),
                        (b, True, "re_last", b), (b, False, "post", b),
                        *((i, False, "bwd_member", i) for i in range(b - 1, a, -1)), (a, False, "bwd_first", a)]
    todo = list(runs)
    for blk, rec, role, who in pattern:
        if todo and todo[0][0] == (blk, rec):
            _, s, e = todo.pop(0)
            ranges.append((who, role, s, e))
        elif role in ("one_pre", "pre") and todo and todo[0][0][1]:
            ranges.append((who, role, 0, -1))  # it needed a saved tensor at once
        else:
            raise PlanError(f"the chain's backward ({what}) ran its blocks in the order "
                            f"{[r[0] for r in runs][:10]}, not one after another; graphmem cannot plan "
                            "checkpoints for it")
    if todo:
        raise PlanError(f"the chain's backward ({what}) ran more ops than its blocks' roles explain")
    lo, back, hi = window
    for who, role, s, e in ranges:
        # a segment's recompute runs in one autocast context: its last block's clear frees
        # what the earlier blocks' recomputes left in the cache
        p = cut.piece_holding(s, e, back) if role == "re_last" else cut.piece(s, e)
        got = (p, cut.flops(s, e) if role in _FLOPS else 0, cut.held(s, e) if role in _HOLD else 0)
        if found.setdefault((who, role), got) != got:
            disagree.append(f"block {who} moves memory differently as {role} in two plans "
                            f"({found[(who, role)][0]} vs {got[0]})")
    exit_at = min(max(back - 1, head[0] - 1), head[1])  # the forward's context exits after this op
    return ((cut.piece(lo, forward[0][1] - 1), cut.piece_holding(head[0], exit_at, forward[0][1]),
             cut.piece(exit_at + 1, head[1]), cut.piece(runs[-1][2] + 1, hi - 1)),
            (cut.piece_holding(head[0], exit_at, forward[0][1], real=True), cut.piece(exit_at + 1, head[1], real=True)))


def _shared(plain: _Cut, every: _Cut, window: int) -> set[tuple[int, int]]:
    """(created, bytes) of the tensors made before the chain (op counted from the micro-step's
    start) that die in the head when no block is checkpointed but in the chain's backward when
    every block is: only checkpointed segments keep them (an attention mask, rotary tables
    passed to each block; or the chain's input, given to the first block only)."""
    forward, head, _ = plain.regions(plain.windows()[window])
    lo = plain.windows()[window][0]
    died_in_head = {(s.created - lo, s.nbytes) for s in plain.g.storages.values()
                    if lo <= s.created < forward[0][1] and s.freed is not None and head[0] <= s.freed <= head[1]}
    lo2 = every.windows()[window][0]
    runs = every.regions(every.windows()[window])[2]
    return {(s.created - lo2, s.nbytes) for s in every.g.storages.values()
            if s.created >= lo2 and (s.created - lo2, s.nbytes) in died_in_head and s.freed is not None
            and runs[0][1] <= s.freed <= runs[-1][2]}


_FLOPS = ("fwd", "one_re", "re_first", "re_member", "re_last")
_HOLD = {"fwd": "c_fwd", "fwd_first": "c_first", "fwd_member": "c_member", "re_first": "c_re_first",
         "re_member": "c_re_member"}  # roles whose cache bytes a later clear frees: Stage's field
_SEGMENT_ROLES = ("pre", "re_first", "re_member", "re_last", "post", "bwd_member", "bwd_first")
_ROLES = ("fwd", "bwd", "fwd_first", "fwd_member", "one_pre", "one_re", "one_post", "pre", "re_first",
          "re_member", "re_last", "post", "bwd_member", "bwd_first")


def _plans(k: int) -> list[tuple[str, list[tuple[int, int]]]]:
    """Plans that show every block of k in every role it can play."""
    plans = [("no checkpoints", []), ("every block", [(i, i) for i in range(k)]), ("one segment", [(0, k - 1)])]
    even = [(a, a + 1) for a in range(0, k - 1, 2)]
    odd = [(a, a + 1) for a in range(1, k - 1, 2)]
    plans += [(f"pairs {s[0][0]}", s) for s in (even, odd) if s and s != [(0, k - 1)]]
    if k == 2:  # the first block stored below a checkpointed one (pairs 1 shows it for k >= 3)
        plans.append(("last block", [(1, 1)]))
    return plans


def _entry_plan(plans: Sequence[tuple[str, Any, "_Cut"]]) -> Optional["_Cut"]:
    """A capture whose first block is stored and another checkpointed."""
    return next((cut for _, segs, cut in plans if not segs[0][2] and any(ck for _, _, ck in segs)), None)


def chain_costs(model: nn.Module, chain: Chain, capture_at: Any, depth: Optional[int], policy: Any = None,
                micro_steps: int = 1) -> ChainCosts:
    """The chain's pieces from captures (at ``depth`` blocks, or the full chain); with a
    selective ``policy`` (graphmem/planning/selective.py), every checkpointed segment runs under it.
    A step of ``micro_steps`` micro-batches is captured as two (the second stands for the
    later ones): the costs then carry the second's pieces as ``later``."""
    k = chain.length if depth is None else min(depth, chain.length)
    names = [path for path, _ in chain_blocks(model, chain.path)][:k]
    # one (found roles, fixed pieces, starting level) per micro-step traced: the first, and
    # the second standing for every later one (graphmem/training/loop.py traces two)
    captured: list[tuple[str, Any, _Cut]] = []
    disagree: list[str] = []
    for n, (what, ck) in enumerate(_plans(k)):
        try:
            with truncated(model, chain, k if k < chain.length else None), \
                    apply_segments(model, chain.path, ck, [policy] * len(ck) if policy is not None else None):
                g = capture_at()
        except GraphmemError as e:
            if n < 2:  # no checkpoints, every block: the roles every plan needs
                raise
            # a plan that cannot run (longer segments of blocks the parent does not call as
            # x = block(x, ...)): its roles stay unmeasured, and the program never uses them
            disagree.append(f"the plan '{what}' could not be captured ({e})")
            continue
        captured.append((what, segments_of(k, ck), _Cut(g, names)))
    counts = {len(cut.windows()) for _, _, cut in captured}
    if len(counts) != 1:
        raise PlanError("the step ran a different number of micro-steps when its blocks were checkpointed")
    kept = [_shared(captured[0][2], captured[1][2], w) for w in range(counts.pop())]
    # given to every block (kept by any checkpointed segment) or to the first only: the first
    # block stored, another checkpointed, tells them apart
    disc = _entry_plan(captured)
    by_others = [_shared(captured[0][2], disc, w) if disc is not None else set() for w in range(len(kept))]
    entry = [k - o for k, o in zip(kept, by_others)]
    shared = [k - e for k, e in zip(kept, entry)]
    # per micro-step: found roles, fixed pieces, starting level
    steps: list[tuple[dict[tuple[int, str], tuple[Piece, int, int]], list, list]] = [({}, [], []) for _ in shared]
    free_heads: list[tuple[Piece, Piece]] = []
    entry_heads: list[tuple[Piece, Piece]] = []
    peaks: list[tuple[str, Any, int]] = []
    for n, (what, segs, cut) in enumerate(captured):
        cut.share(kept)
        for (found, fixed, starts), window in zip(steps, cut.windows()):
            pieces, real_head = _roles(cut, k, segs, what, found, window, disagree)
            if pieces not in fixed:
                fixed.append(pieces)
            if n == 0:  # no checkpoints: the shared and entry tensors die in the head
                free_heads.append(real_head)
            if cut is disc:  # the first block stored: the entry tensors die in the head
                entry_heads.append(real_head)
            start = cut.after[window[0] - 1] if window[0] > 0 else cut.base
            if start not in starts:
                starts.append(start)
        peaks.append((what, segs, max([cut.base, *cut.during])))
    if any(len(fixed) != 1 or len(starts) != 1 for _, fixed, starts in steps):
        disagree.append("the ops around the chain change when its blocks are checkpointed")
    if disc is None:
        entry_heads = free_heads
    made = [replace(_costs(found, fixed[0], starts[0], names, chain.path), shared=sum(n for _, n in keys_w),
                    head_free=free[0], head_post_free=free[1], entry=sum(n for _, n in keys_e),
                    head_entry_free=first[0], head_post_entry_free=first[1])
            for (found, fixed, starts), keys_w, keys_e, free, first
            in zip(steps, shared, entry, free_heads, entry_heads)]
    costs = made[0]
    if len(made) > 1:
        if made[1].base != level_after(made[0]):
            disagree.append("the second micro-step does not start where the first ends")
        costs = replace(costs, later=made[1], micro_steps=micro_steps)
    try:
        costs.check()
    except PassError as e:
        disagree.append(str(e))
    for what, segs, want in peaks:
        got = evaluate(costs, segs).peak_bytes
        if got != want:
            disagree.append(f"the pieces do not add up ({what}: {got} B stitched, {want} B captured)")
    if disagree:
        return replace(costs, exact=False, problem=disagree[0])
    return costs


def _costs(found: dict[tuple[int, str], tuple[Piece, int, int]], fixed: tuple[Piece, Piece, Piece, Piece],
           base: int, names: Sequence[str], path: str) -> ChainCosts:
    stages = []
    for j, name in enumerate(names):
        pieces = {role: found.get((j, role), (UNMEASURED if role in _SEGMENT_ROLES else NOTHING, 0, 0))
                  for role in _ROLES}
        stages.append(Stage(name, **{role: p for role, (p, _, _) in pieces.items()},
                            flops=pieces["fwd"][1], one_re_flops=pieces["one_re"][1],
                            re_first_flops=pieces["re_first"][1], re_member_flops=pieces["re_member"][1],
                            re_last_flops=pieces["re_last"][1],
                            **{field: pieces[role][2] for role, field in _HOLD.items()}))
    before, head, head_post, after = fixed
    return ChainCosts(tuple(stages), base, before, head, after, path, head_post)


def _tails(g: StepGraph, blocks: Sequence[str]) -> list[Piece]:
    """The ``after`` piece of each micro-step in a capture of the whole model: what runs after
    the chain's backward (the optimizer step's states and temporaries grow with the depth)."""
    cut = _Cut(g, blocks)
    out = []
    for window in cut.windows():
        runs = cut.regions(window)[2]
        out.append(cut.piece(runs[-1][2] + 1, window[2] - 1))
    return out


def _widen(costs: ChainCosts, n: int, base: int, tails: Sequence[Piece]) -> ChainCosts:
    """A depth-4 chain of identical blocks, widened to n blocks (interior blocks alike), with
    the ``after`` pieces of the whole model; a later micro-step's too, starting where the
    widened first one ends."""
    st = costs.stages
    interior = [replace(s, name="") for s in st[1:-1]]
    if any(s != interior[0] for s in interior):
        raise PlanError("interior blocks differ")
    prefix = st[0].name[:-1]
    middle = [replace(st[1], name=f"{prefix}{i}") for i in range(1, n - 1)]
    last = replace(st[-1], name=f"{prefix}{n - 1}")
    wide = replace(costs, stages=(st[0], *middle, last), base=base, later=None, after=tails[0])
    if costs.later is None:
        return wide
    return replace(wide, later=_widen(costs.later, n, level_after(wide), tails[1:]))


def stage_chain(model: nn.Module) -> Optional[Chain]:
    """The most blocks that ModuleLists / Sequentials hold, alone or as a run of siblings (a ResNet's layer1..layer4: their blocks
    differ, and the program plans heterogeneous chains measured at full depth). Whether the
    model really runs them one after another, each on the previous output, the captures check."""
    def container(m: nn.Module) -> bool:
        return isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 0

    best: Optional[Chain] = None
    for path, parent in model.named_modules():
        runs: list[list[tuple[str, int]]] = [[(path, len(parent))]] if container(parent) else []
        current: list[tuple[str, int]] = []  # consecutive container children
        for name, child in parent.named_children():
            if container(child):
                current.append((f"{path}.{name}" if path else name, len(child)))
            else:
                runs.append(current)
                current = []
        runs.append(current)
        for run in runs:
            total = sum(n for _, n in run)
            if total >= 2 and (best is None or total > best.length):
                best = Chain(",".join(p for p, _ in run), total)
    return best


def measure(report: Any, policy: Any = None) -> tuple[ChainCosts, int]:
    """The chain costs of a report's model (captures at depth 4 when the blocks are identical,
    else at full depth) and the depth captured; checkpointed segments run under ``policy``."""
    source = report.source
    if source is None:
        raise PlanError("this report has no model to re-run (no tensor inputs); checkpoint plans need one")
    if getattr(report.target, "mode", "eager") == "compiled":
        raise PlanError("checkpoint plans are made for eager steps: under torch.compile the partitioner already "
                        "chooses what to recompute (the report lists it); to trade recompute for memory there, sweep "
                        "its activation memory budget (--memory-budget 1,0.8,0.5,0.2), or plan with --mode eager")
    micro = source.train.micro_batches if source.train is not None else 1
    model = source.module
    chain = find_chain(model)  # identical blocks (captured at depth 4), unless unlike ones make a longer chain
    stages = stage_chain(model) if policy is None else None
    if stages is not None and (chain is None or stages.length > chain.length):
        chain = stages
    if chain is None:
        raise PlanError(f"{report.model} has no chain of blocks to checkpoint (an nn.ModuleList/Sequential of >= 2 "
                        "modules, or several run one after another)" if policy is None else
                        f"{report.model} has no chain of identical blocks (an nn.ModuleList/Sequential of >= 2 like "
                        "modules): selective plans apply one policy to every block; plan without --selective")
    capture_at = source.capture
    # plans are for every step: after the first, the optimizer states live from the start
    states, peak = made_states(report.step), later_steps_peak(report.step, report.liveness)
    if chain.length > DEPTH and "," not in chain.path:
        try:
            costs = _widen(chain_costs(model, chain, capture_at, DEPTH, policy, micro), chain.length,
                           report.baseline_bytes + states,
                           _tails(report.step, [p for p, _ in chain_blocks(model, chain.path)]))
            # pieces that do not compose at depth 4 (a KV cache keeping stored blocks' keys) would
            # not at full depth either: the widened chain is the estimate, captures check its plans
            if evaluate(costs, segments_of(chain.length, [])).peak_bytes == peak:
                return costs, DEPTH
        except PlanError:
            pass
    try:
        costs = chain_costs(model, chain, capture_at, None, policy, micro)
    except (PlanError, PassError) as e:
        raise PlanError(f"the blocks of {chain.path} ({chain.length}) do not compose as a checkpoint chain: {e}. "
                        "graphmem plans chains of blocks whose output lives the same whether or not they are "
                        "checkpointed (residual blocks); a block ending in an in-place op whose output only the "
                        "next op uses (a ResNet's last block), or a Sequential of single layers, is not one") from e
    got = evaluate(costs, segments_of(chain.length, [])).peak_bytes
    if got != peak and costs.exact:
        costs = replace(costs, exact=False, problem=f"the chain's pieces give a peak of {got} B without checkpoints, "
                                                    f"the report {peak} B")
    return costs, chain.length

