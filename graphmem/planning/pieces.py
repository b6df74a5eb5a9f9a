"""A capture cut into a chain's pieces: the step's ops labelled by the chain block they ran in
(and whether in a recompute), cut at block boundaries into the roles of
passes/checkpoint_model.py (``Cut``, ``cut_roles``), the tensors made before the chain that
only checkpointed segments keep (``shared_keys``), and the roles assembled into ``ChainCosts``
(``assemble``). graphmem/planning/costs.py chooses the captures and checks that the pieces
compose.
"""
from __future__ import annotations

from typing import Optional, Sequence

from graphmem.errors import GraphmemError
from graphmem.passes.checkpoint import NOTHING, UNMEASURED, ChainCosts, Piece, Stage
from graphmem.planning.flops import op_flops
from graphmem.stepgraph import OpNode, StepGraph


class PlanError(GraphmemError):
    """No checkpoint plan can be made or none fits."""


class Cut:
    """One capture's live bytes per op (``during`` it, ``after`` it) and each op's chain label;
    ``piece`` reads any run of ops off them."""

    def __init__(self, g: StepGraph, blocks: Sequence[str]) -> None:
        self.g = g
        n = g.num_ops
        created, freed = [0] * (n + 1), [0] * (n + 1)
        self.base = 0
        for s in g.storages.values():  # as passes/liveness.py: live during op i if created <= i <= freed
            # every step after the first holds the optimizer states from its start: plans are
            # for those steps (passes/later_steps.py, later_steps_peak), so the states count as made before
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


def cut_roles(cut: Cut, k: int, segs: Sequence[tuple[int, int, bool]], what: str,
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


def shared_keys(plain: Cut, every: Cut, window: int) -> set[tuple[int, int]]:
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


def assemble(found: dict[tuple[int, str], tuple[Piece, int, int]], fixed: tuple[Piece, Piece, Piece, Piece],
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


def tails(g: StepGraph, blocks: Sequence[str]) -> list[Piece]:
    """The ``after`` piece of each micro-step in a capture of the whole model: what runs after
    the chain's backward (the optimizer step's states and temporaries grow with the depth)."""
    cut = Cut(g, blocks)
    out = []
    for window in cut.windows():
        runs = cut.regions(window)[2]
        out.append(cut.piece(runs[-1][2] + 1, window[2] - 1))
    return out

