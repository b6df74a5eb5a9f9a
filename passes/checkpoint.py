"""Checkpoint plans for a chain of blocks: the exact peak of a plan, and the cheapest plan
under a memory budget (dynamic program), its brute-force check, baselines and the frontier.

The model. A step over a chain of n blocks is a sequence of *pieces*, each a run of ops whose
effect on live memory is two numbers: ``high`` (the most bytes live above the level at its
start) and ``net`` (the level change across it). Which pieces occur depends only on how each
block is run (measured by graphmem/planning/costs.py from captures of the real step):

  forward     a stored block, the first block of a checkpointed segment, a later one
  backward    segments from the last to the first: a stored block's backward; a segment's
              backward ops up to the first saved tensor it needs, the segment's forward run
              again (keeping what backward needs; the last block's recompute stops early),
              then the blocks' backward (see ``Stage`` for every role)

plus fixed pieces before the chain (``before``), between its forward and its backward (the
head, loss and the head's backward: ``head`` up to the end of the forward context, then
``head_post``) and after (``after``). Stitching the pieces of a plan in order gives its peak
exactly (``evaluate``). This is Chen et al. 2016's segment view ("Training Deep Nets with
Sublinear Memory Cost") with the costs measured per piece instead of assumed, and a
stored/checkpointed choice per segment as in Rotor (Beaumont et al. 2019, "Optimal
checkpointing for heterogeneous chains").

Frees that land elsewhere than the piece that made them are the plan's own ``Piece(0, -bytes)``
(the pieces keep those bytes live):
- autocast's cast cache holds parameters' low-precision copies until its context exits: a
  checkpointed block's copies (nothing saves them) and a stored block's unsaved ones (biases)
  die at the forward's exit, in the head (``Stage.c_fwd``, ``c_first``, ``c_member``); in a
  segment's recompute, which torch.utils.checkpoint runs in one autocast context, the earlier
  blocks' unsaved copies die at the end of the last block's recompute (``c_re_*``);
- tensors made before the chain that only checkpointed segments keep (``ChainCosts.shared``)
  die after the lowest checkpointed segment's backward, or in the head without checkpoints;
- with gradient accumulation, later micro-steps (``ChainCosts.later``) run the same forward
  from a higher level, and the plan's peak is the larger of the two.

The program. After a segment's backward, everything it allocated is gone except its
gradients, whatever way it ran; so a block's forward+backward net effect ``h_i`` does not
depend on the plan (``ChainCosts.check`` proves it for the measured costs), and the level at
the start of segment a..b's backward is ``start + head.net + m_a + fwd_net(a..b) + H(>b)`` where
``m_a`` is what the forward of the blocks before a kept. Each segment therefore caps ``m_a``,
and a left-to-right program over (position, kept bytes) with Pareto pruning on
(kept bytes, recompute FLOPs) finds the cheapest plan under a budget exactly.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from graphmem.errors import PassError

Segment = tuple[int, int, bool]  # (first block, last block, checkpointed); stored => a == b


@dataclass(frozen=True)
class Piece:
    high: int  # most live bytes above the level at its start (>= 0)
    net: int  # level change across it

    def then(self, other: "Piece") -> "Piece":
        return Piece(max(self.high, self.net + other.high), self.net + other.net)


NOTHING = Piece(0, 0)
# a role no capture could show (its plan failed to run): the program never chooses it
UNMEASURED = Piece(1 << 60, 0)


@dataclass(frozen=True)
class Stage:
    """How one block's ops move memory in each role it can play, and its FLOPs.

    Stored: ``fwd``, ``bwd``. Checkpointed forward: ``fwd_first`` (the segment's first block:
    its input and, on the CPU, the stashed RNG state stay), ``fwd_member`` (later blocks).
    A segment of this block alone, in backward: ``one_pre`` (backward ops before the first
    saved tensor is needed), ``one_re`` (the recompute), ``one_post``. A longer segment a..b:
    ``pre`` (b), ``re_first`` (a), ``re_member`` (a+1..b-1), ``re_last`` (b; stops early once
    everything needed is back), ``post`` (b), ``bwd_member`` (b-1..a+1), ``bwd_first`` (a).
    """

    name: str
    fwd: Piece
    bwd: Piece
    fwd_first: Piece
    fwd_member: Piece
    one_pre: Piece
    one_re: Piece
    one_post: Piece
    pre: Piece
    re_first: Piece
    re_member: Piece
    re_last: Piece
    post: Piece
    bwd_member: Piece
    bwd_first: Piece
    flops: int  # forward FLOPs of the block
    one_re_flops: int  # FLOPs each recompute role runs (early stop may skip a last block's tail)
    re_first_flops: int
    re_member_flops: int
    re_last_flops: int
    # bytes of autocast cast-cache copies a role leaves to be freed later (0 without autocast):
    # forward roles at the forward context's exit, recompute roles at the end of the recompute
    c_fwd: int = 0
    c_first: int = 0
    c_member: int = 0
    c_re_first: int = 0
    c_re_member: int = 0


@dataclass(frozen=True)
class ChainCosts:
    stages: tuple[Stage, ...]
    base: int  # live bytes before the step (parameters, buffers, batch)
    before: Piece  # ops before the chain's forward
    head: Piece  # after the chain's forward, until the forward context exits (all of it without autocast)
    after: Piece  # after the chain's backward
    chain: str = ""  # module path of the chain
    head_post: Piece = NOTHING  # from the forward context's exit until the chain's backward starts
    # gradient accumulation: the pieces of micro-steps 2..k (their forward is this one's; their
    # backward adds into gradients that exist; ``later.base`` is the level they start at) and k
    later: Optional["ChainCosts"] = None
    micro_steps: int = 1
    # tensors made before the chain and passed to its blocks that no stored block saves (an
    # attention mask, rotary tables): without checkpoints they die in the head (``head_free``,
    # ``head_post_free``); a checkpointed segment keeps them as its inputs, so they die after
    # the lowest checkpointed segment's backward. The other pieces leave them live.
    shared: int = 0
    head_free: Piece = NOTHING
    head_post_free: Piece = NOTHING
    # tensors made before the chain that only its first block is given and does not save (the
    # chain's input, when block 0 casts it first): alive until the first segment's backward if
    # it is checkpointed, else dead in the head (``head_entry_free``, ``head_post_entry_free``:
    # the head when it is stored but another segment is checkpointed)
    entry: int = 0
    head_entry_free: Piece = NOTHING
    head_post_entry_free: Piece = NOTHING
    # whether the pieces compose: every role measured alike in every capture, ``check`` holds
    # and stitching gives each captured plan's peak. Without it the program is an estimate
    # (graphmem/planning/verify.py checks its plans by captures); ``problem`` says what disagreed.
    exact: bool = True
    problem: str = ""

    @property
    def n(self) -> int:
        return len(self.stages)

    def check(self) -> None:
        """The program's premise: a segment's forward+backward net effect is the same however
        it runs (the sum of its blocks' stored-mode effects); later micro-steps run the same
        forward."""
        if self.later is not None:
            self.later.check()
            for i, (s, s2) in enumerate(zip(self.stages, self.later.stages)):
                for role in ("fwd", "fwd_first", "fwd_member", "c_fwd", "c_first", "c_member"):
                    if getattr(s, role) != getattr(s2, role):
                        raise PassError(f"checkpoint: block {i}'s forward ({role}) differs between micro-steps; "
                                        "the chain's pieces do not compose")
        h = [s.fwd.net - s.c_fwd + s.bwd.net for s in self.stages]
        for a in range(self.n):
            for b in range(a, self.n):
                seg = (_forward((a, b, True), self.stages).net - _cached((a, b, True), self.stages)
                       + _backward((a, b, True), self.stages).net)
                if seg != sum(h[a:b + 1]):
                    raise PassError(
                        f"checkpoint: blocks {a}..{b} checkpointed change memory by {seg} B over the "
                        f"step but {sum(h[a:b + 1])} B stored; the chain's pieces do not compose")


def level_after(costs: ChainCosts) -> int:
    """Live bytes when the step (one micro-step) has run, whatever the plan: where the next
    micro-step starts."""
    h = sum(s.fwd.net - s.c_fwd + s.bwd.net for s in costs.stages)
    return (costs.base + costs.before.net + costs.head.net + costs.head_post.net - costs.shared - costs.entry + h
            + costs.after.net)


# -- plans ---------------------------------------------------------------------------------
def segments_of(n: int, checkpointed: Sequence[tuple[int, int]]) -> tuple[Segment, ...]:
    """The full segmentation: the checkpointed segments plus every other block stored."""
    out: list[Segment] = []
    i = 0
    for a, b in sorted(checkpointed):
        out.extend((j, j, False) for j in range(i, a))
        out.append((a, b, True))
        i = b + 1
    out.extend((j, j, False) for j in range(i, n))
    return tuple(out)


def _forward(seg: Segment, st: Sequence[Stage]) -> Piece:
    a, b, ck = seg
    if not ck:
        return st[a].fwd
    p = st[a].fwd_first
    for i in range(a + 1, b + 1):
        p = p.then(st[i].fwd_member)
    return p


def _cached(seg: Segment, st: Sequence[Stage]) -> int:
    """Bytes a segment's forward leaves in autocast's cache (freed at the forward's exit)."""
    a, b, ck = seg
    if not ck:
        return st[a].c_fwd
    return st[a].c_first + sum(st[i].c_member for i in range(a + 1, b + 1))


def _backward(seg: Segment, st: Sequence[Stage]) -> Piece:
    a, b, ck = seg
    if not ck:
        return st[a].bwd
    if a == b:
        return st[a].one_pre.then(st[a].one_re).then(st[a].one_post)
    p = st[b].pre.then(st[a].re_first)
    for i in range(a + 1, b):
        p = p.then(st[i].re_member)
    cleared = st[a].c_re_first + sum(st[i].c_re_member for i in range(a + 1, b))
    p = p.then(st[b].re_last).then(Piece(0, -cleared)).then(st[b].post)
    for i in range(b - 1, a, -1):
        p = p.then(st[i].bwd_member)
    return p.then(st[a].bwd_first)


def _recompute_flops(seg: Segment, st: Sequence[Stage]) -> int:
    a, b, ck = seg
    if not ck:
        return 0
    if a == b:
        return st[a].one_re_flops
    return st[a].re_first_flops + sum(st[i].re_member_flops for i in range(a + 1, b)) + st[b].re_last_flops


@dataclass(frozen=True)
class Evaluated:
    segments: tuple[Segment, ...]
    peak_bytes: int
    kept_bytes: int  # what the chain's forward leaves allocated for its backward
    recompute_flops: int

    @property
    def checkpointed(self) -> tuple[tuple[int, int], ...]:
        return tuple((a, b) for a, b, ck in self.segments if ck)


def evaluate(costs: ChainCosts, segments: Sequence[Segment]) -> Evaluated:
    """The exact peak of a plan: its pieces stitched in the order the step runs them (with
    micro-steps, the larger of the first's and the later ones' peaks; recompute in each)."""
    e = _evaluate(costs, segments)
    if costs.later is None:
        return e
    peak = max(e.peak_bytes, _evaluate(costs.later, segments).peak_bytes)
    return Evaluated(e.segments, peak, e.kept_bytes, e.recompute_flops * costs.micro_steps)


def _head(costs: ChainCosts, any_checkpointed: bool, first_checkpointed: bool) -> tuple[Piece, Piece]:
    """The head's two pieces for a plan: which tensors made before the chain die in it."""
    if not any_checkpointed and (costs.shared or costs.entry):
        return costs.head_free, costs.head_post_free
    if not first_checkpointed and costs.entry:
        return costs.head_entry_free, costs.head_post_entry_free
    return costs.head, costs.head_post


def _evaluate(costs: ChainCosts, segments: Sequence[Segment]) -> Evaluated:
    st = costs.stages
    if [i for a, b, _ in segments for i in range(a, b + 1)] != list(range(costs.n)):
        raise PassError(f"checkpoint: segments {list(segments)} do not cover blocks 0..{costs.n - 1} in order")
    level = peak = costs.base
    cached = sum(_cached(s, st) for s in segments)
    lowest = next((k for k, (_, _, ck) in enumerate(segments) if ck), None)  # the shared tensors' last holder
    first = bool(segments) and segments[0][2]  # the entry tensors' holder
    head, head_post = _head(costs, lowest is not None, first)
    back: list[Piece] = []
    for k in range(len(segments) - 1, -1, -1):
        back.append(_backward(segments[k], st))
        if k == lowest and costs.shared:
            back.append(Piece(0, -costs.shared))
        if k == 0 and first and costs.entry:
            back.append(Piece(0, -costs.entry))
    order = [costs.before, *(_forward(s, st) for s in segments), head, Piece(0, -cached), head_post, *back,
             costs.after]
    kept = -cached  # what survives the forward's exit
    for k, p in enumerate(order):
        peak = max(peak, level + p.high)
        level += p.net
        if 1 <= k <= len(segments):
            kept += p.net
    flops = sum(_recompute_flops(s, st) for s in segments)
    return Evaluated(tuple(segments), peak, kept, flops)


# -- the program -----------------------------------------------------------------------------
@dataclass
class _Tables:
    """Per (a, b): what checkpointing a..b needs below the budget, its forward nets, its FLOPs.

    The forward of a..b needs ``start + M_a + K_a + need_f <= budget`` and its backward
    ``start + M_a + need_b <= budget``, where ``M_a`` is what the blocks before a keep for
    backward and ``K_a`` what they left in autocast's cache (0 without autocast, when the two
    merge into ``need``)."""

    need_f: np.ndarray  # (n, n) int64, [a, b]; unused where a > b
    need_b: np.ndarray
    fnet: np.ndarray  # kept for backward (M)
    knet: np.ndarray  # left in the cache until the forward's exit (K)
    flops: np.ndarray
    stored_need_f: np.ndarray  # (n,) storing block a alone
    stored_need_b: np.ndarray
    stored_net: np.ndarray
    stored_knet: np.ndarray
    fixed: int  # the plan-independent part of the peak
    start: int  # level when the chain's forward starts
    end_f: int  # the head until the forward's exit: M + K <= budget - start - end_f
    end_b: int  # the head after it: M <= budget - start - end_b
    shared: int = 0  # ChainCosts.shared: a stored block's backward before any checkpointed one is that lower
    end_f_free: int = 0  # the head's constraints when no segment is checkpointed (with shared tensors)
    end_b_free: int = 0
    entry: int = 0  # ChainCosts.entry: lower in backward unless the first segment is checkpointed
    end_f_entry: int = 0  # the head's constraints when the first segment is stored, another checkpointed
    end_b_entry: int = 0
    cached: bool = field(init=False)
    need: np.ndarray = field(init=False)  # max(need_f, need_b): the constraint when nothing is cached
    stored_need: np.ndarray = field(init=False)
    need_by_end: np.ndarray = field(init=False)  # the same, [b, a]: contiguous rows for the program
    need_f_by_end: np.ndarray = field(init=False)
    need_b_by_end: np.ndarray = field(init=False)
    fnet_by_end: np.ndarray = field(init=False)
    knet_by_end: np.ndarray = field(init=False)
    flops_by_end: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.cached = bool(self.knet.any() or self.stored_knet.any())
        self.need = np.maximum(self.need_f, self.need_b)
        self.stored_need = np.maximum(self.stored_need_f, self.stored_need_b)
        for name in ("need", "need_f", "need_b", "fnet", "knet", "flops"):
            setattr(self, f"{name}_by_end", np.ascontiguousarray(getattr(self, name).T))


def tables(costs: ChainCosts) -> _Tables:
    t = _tables(costs)
    if costs.later is None:
        return t
    # later micro-steps keep what the first keeps (same forward) from a higher level: each
    # constraint is the stricter of the two, measured from the first's start
    t2 = _tables(costs.later)
    shift = t2.start - t.start
    if (t.shared, t.entry) != (t2.shared, t2.entry):
        raise PassError("checkpoint: the micro-steps pass the chain different tensors; the pieces do not compose")
    return _Tables(np.maximum(t.need_f, t2.need_f + shift), np.maximum(t.need_b, t2.need_b + shift), t.fnet, t.knet,
                   t.flops, np.maximum(t.stored_need_f, t2.stored_need_f + shift),
                   np.maximum(t.stored_need_b, t2.stored_need_b + shift), t.stored_net, t.stored_knet,
                   max(t.fixed, t2.fixed), t.start, max(t.end_f, t2.end_f + shift), max(t.end_b, t2.end_b + shift),
                   t.shared, max(t.end_f_free, t2.end_f_free + shift), max(t.end_b_free, t2.end_b_free + shift),
                   t.entry, max(t.end_f_entry, t2.end_f_entry + shift), max(t.end_b_entry, t2.end_b_entry + shift))


def _tables(costs: ChainCosts) -> _Tables:
    st, n = costs.stages, costs.n
    start = costs.base + costs.before.net
    head_net = costs.head.net + costs.head_post.net
    h = [s.fwd.net - s.c_fwd + s.bwd.net for s in st]
    later = [sum(h[b + 1:]) for b in range(n)]  # H(>b)
    need_f, need_b, fnet, knet, flops = (np.zeros((n, n), dtype=np.int64) for _ in range(5))
    back_high = np.zeros((n, n), dtype=np.int64)  # the backward piece's high, per segment
    sum_re = [0]
    for s in st:
        sum_re.append(sum_re[-1] + s.re_member_flops)
    for b in range(n):
        back_high[b, b] = _backward((b, b, True), st).high
        flops[b, b] = st[b].one_re_flops
        re_m, bw, cre = NOTHING, NOTHING, 0  # re_member(a+1..b-1), bwd_member(b-1..a+1), their cache
        for a in range(b - 1, -1, -1):
            back = st[b].pre.then(st[a].re_first).then(re_m).then(st[b].re_last) \
                .then(Piece(0, -(st[a].c_re_first + cre))).then(st[b].post).then(bw).then(st[a].bwd_first)
            back_high[a, b] = back.high
            flops[a, b] = st[a].re_first_flops + sum_re[b] - sum_re[a + 1] + st[b].re_last_flops
            re_m, bw, cre = st[a].re_member.then(re_m), bw.then(st[a].bwd_member), cre + st[a].c_re_member
    for a in range(n):
        fw, c = st[a].fwd_first, st[a].c_first
        for b in range(a, n):
            if b > a:
                fw, c = fw.then(st[b].fwd_member), c + st[b].c_member
            need_f[a, b] = fw.high
            need_b[a, b] = head_net + fw.net - c + later[b] + int(back_high[a, b])
            fnet[a, b], knet[a, b] = fw.net - c, c
    stored_need_f = np.array([s.fwd.high for s in st], dtype=np.int64)
    stored_need_b = np.array([head_net + s.fwd.net - s.c_fwd + later[i] + s.bwd.high for i, s in enumerate(st)],
                             dtype=np.int64)
    stored_net = np.array([s.fwd.net - s.c_fwd for s in st], dtype=np.int64)
    stored_knet = np.array([s.c_fwd for s in st], dtype=np.int64)
    fixed = max(costs.base, costs.base + costs.before.high,
                start + head_net - costs.shared - costs.entry + sum(h) + costs.after.high)
    free, entry = _head(costs, False, False), _head(costs, True, False)
    return _Tables(need_f, need_b, fnet, knet, flops, stored_need_f, stored_need_b, stored_net, stored_knet,
                   fixed, start, costs.head.high, costs.head.net + costs.head_post.high, costs.shared,
                   free[0].high, free[0].net + free[1].high, costs.entry, entry[0].high, entry[0].net + entry[1].high)


def _pareto(m: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Indices of the (m, c) pairs that no pair with smaller m (or equal m, earlier) beats on
    c: a superset of the Pareto set when m ties, so no state that matters is lost."""
    order = np.argsort(m, kind="stable")  # candidates arrive as sorted runs: timsort merges them
    cs = c[order]
    best = np.minimum.accumulate(cs)
    keep = np.empty(len(cs), dtype=bool)
    keep[0] = True
    np.less(cs[1:], best[:-1], out=keep[1:])
    return order[keep]


def _pareto3(m: np.ndarray, k: np.ndarray, c: np.ndarray) -> np.ndarray:
    """As ``_pareto`` over (m, k, c): the (m, c) Pareto set of each k, a superset of the 3-d
    Pareto set, so no state that matters is lost. (Also pruning across k, a state beaten on
    m and c by one with smaller k, removed nothing on llama-2-70b and cost more than it saved.)"""
    order = np.argsort(k, kind="stable")
    ks = k[order]
    groups = np.split(order, np.flatnonzero(ks[1:] != ks[:-1]) + 1)
    return np.concatenate([g[_pareto(m[g], c[g])] for g in groups])


def optimal(costs: ChainCosts, budget: int, t: Optional[_Tables] = None) -> Optional[Evaluated]:
    """The plan with the fewest recompute FLOPs whose peak is <= budget (None if none fits);
    among equally cheap plans, the one whose forward keeps the fewest bytes."""
    segs = program([t or tables(costs)], costs.n, budget)
    return None if segs is None else evaluate(costs, tuple((a, b, m > 0) for a, b, m in segs))


def program(modes: Sequence[_Tables], n: int, budget: int) -> Optional[list[tuple[int, int, int]]]:
    """The program over a chain whose checkpointed segments can run in several ways (``modes``:
    their tables; the stored blocks' and fixed parts are those of ``modes[0]``). Returns the
    segments (first, last, mode: 0 stored, k >= 1 checkpointed as ``modes[k - 1]``) of the
    cheapest plan under ``budget``, or None."""
    t = modes[0]
    if t.fixed > budget:
        return None
    room, ways, x, x0 = budget - t.start, len(modes) + 1, t.shared, t.entry
    cached = any(tk.cached for tk in modes)
    track = cached or x > 0 or x0 > 0
    # States (kept bytes m, cached bytes k, FLOPs c; f: a segment before is checkpointed, so the
    # shared tensors are still live; g: the first segment is, so the entry tensors are) after
    # each prefix of the chain, Pareto-pruned per (k, f, g), in flat arrays; a state remembers
    # its parent and its last segment (code a * ways + mode). Without autocast or such tensors
    # k, f and g stay 0 and one constraint per segment suffices.
    cap = 1024
    P, M, K, F, G, C = (np.zeros(cap, dtype=np.int64) for _ in range(6))
    parent, code = np.full(cap, -1, dtype=np.int64), np.full(cap, -1, dtype=np.int64)
    offsets = [0, 1]  # states of position k: [offsets[k], offsets[k+1])
    for end in range(1, n + 1):
        b, size = end - 1, offsets[-1]
        pv, mv, kv = P[:size], M[:size], K[:size]
        lo = offsets[b]
        parts = []
        for k, tk in enumerate(modes, 1):  # checkpoint a..b from a state at a
            if track:  # (the entry tensors are live in its backward if the first segment is checkpointed)
                g_new = G[:size] | (pv == 0)
                ok = (mv <= room - tk.need_b_by_end[b][pv] + x0 * (1 - g_new)) & \
                    (mv + kv <= room - tk.need_f_by_end[b][pv])
            else:
                ok = mv <= room - tk.need_by_end[b][pv]
            idx = np.nonzero(ok)[0]
            src = pv[idx]
            parts.append((idx, M[idx] + tk.fnet_by_end[b][src], K[idx] + tk.knet_by_end[b][src] if track else idx,
                          np.ones(len(idx), dtype=np.int64) if track else idx, g_new[idx] if track else idx,
                          C[idx] + tk.flops_by_end[b][src], src * ways + k))
        if track:  # store block b alone (the shared tensors are dead by its backward unless f, the entry ones unless g)
            fv, gv = F[lo:size], G[lo:size]
            ok = (mv[lo:] <= room - t.stored_need_b[b] + x * (1 - fv) + x0 * (1 - gv)) & \
                (mv[lo:] + kv[lo:] <= room - t.stored_need_f[b])
        else:
            ok = mv[lo:] <= room - t.stored_need[b]
        sidx = np.nonzero(ok)[0] + lo
        parts.append((sidx, M[sidx] + t.stored_net[b], K[sidx] + t.stored_knet[b] if track else sidx,
                      F[sidx] if track else sidx, G[sidx] if track else sidx, C[sidx],
                      np.full(len(sidx), b * ways, dtype=np.int64)))
        both, cm, ck, cf, cg, cc, ccode = (np.concatenate([p[i] for p in parts]) for i in range(7))
        if end == n:  # (untracked, ck, cf and cg hold placeholders: all are 0)
            if track:
                fits = np.where(cf == 0, (cm <= room - t.end_b_free) & (cm + ck <= room - t.end_f_free),
                                np.where(cg == 0, (cm <= room - t.end_b_entry) & (cm + ck <= room - t.end_f_entry),
                                         (cm <= room - t.end_b) & (cm + ck <= room - t.end_f)))
            else:
                fits = (cm <= room - t.end_b) & (cm <= room - t.end_f)
            both, cm, ck, cf, cg, cc, ccode = (a_[fits] for a_ in (both, cm, ck, cf, cg, cc, ccode))
        if track:  # group by what the constraints ahead depend on (f, g only when such tensors exist)
            key = ck * 4 + (cf * 2 if x or x0 else 0) + (cg if x0 else 0)
        keep = (_pareto3(cm, key, cc) if track else _pareto(cm, cc)) if len(cm) else both[:0]
        k = len(keep)
        while size + k > cap:
            cap *= 2
            P, M, K, F, G, C, parent, code = (np.resize(x_, cap) for x_ in (P, M, K, F, G, C, parent, code))
        P[size:size + k], M[size:size + k], C[size:size + k] = end, cm[keep], cc[keep]
        if track:
            K[size:size + k], F[size:size + k], G[size:size + k] = ck[keep], cf[keep], cg[keep]
        parent[size:size + k], code[size:size + k] = both[keep], ccode[keep]
        offsets.append(size + k)
    lo, hi = offsets[n], offsets[n + 1]
    if lo == hi:
        return None
    s = lo + int(np.lexsort((M[lo:hi], C[lo:hi]))[0])
    segs: list[tuple[int, int, int]] = []
    end = n
    while end > 0:
        a, mode = divmod(int(code[s]), ways)
        segs.append((a, end - 1, mode))
        end = a
        s = int(parent[s])
    return list(reversed(segs))


def optimal_many(costs: ChainCosts, budgets: Sequence[int], t: Optional[_Tables] = None) -> list[Optional[Evaluated]]:
    """``optimal`` for several budgets, sharing the tables."""
    t = t or tables(costs)
    return [optimal(costs, b, t) for b in budgets]


def brute_force(costs: ChainCosts, budget: int) -> Optional[Evaluated]:
    """Every segmentation, for testing ``optimal`` (exponential: small chains only)."""
    best: Optional[Evaluated] = None
    for plan in all_plans(costs.n):
        e = evaluate(costs, plan)
        if e.peak_bytes <= budget and (best is None or (e.recompute_flops, e.kept_bytes) < (best.recompute_flops, best.kept_bytes)):
            best = e
    return best


def all_plans(n: int) -> Iterator[tuple[Segment, ...]]:
    for cuts in itertools.product((False, True), repeat=max(n - 1, 0)):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        parts = [(bounds[i], bounds[i + 1] - 1) for i in range(len(bounds) - 1)]
        singles = [i for i, (a, b) in enumerate(parts) if a == b]
        for stored in itertools.product((False, True), repeat=len(singles)):
            flags = dict(zip(singles, stored))
            yield tuple((a, b, not flags.get(i, False)) for i, (a, b) in enumerate(parts))


# -- baselines and the frontier -----------------------------------------------------------------
def baselines(costs: ChainCosts) -> dict[str, Evaluated]:
    n = costs.n
    size = max(1, math.isqrt(n - 1) + 1 if n > 1 else 1)  # ceil(sqrt(n))
    return {
        "none": evaluate(costs, segments_of(n, [])),
        "every block": evaluate(costs, segments_of(n, [(i, i) for i in range(n)])),
        f"sqrt(n) segments ({size} blocks)": evaluate(
            costs, segments_of(n, [(a, min(a + size, n) - 1) for a in range(0, n, size)])),
    }


Solver = Callable[[int], Optional[Evaluated]]  # budget -> the cheapest plan that fits


def minimum_peak(costs: ChainCosts, t: Optional[_Tables] = None, solve: Optional[Solver] = None) -> int:
    """The smallest peak any plan reaches (bisection on the budget; the program, or ``solve``
    for plans with more ways to run a segment, decides)."""
    t = t or tables(costs)
    solve = solve or (lambda budget: optimal(costs, budget, t))
    lo = t.fixed
    hi = evaluate(costs, segments_of(costs.n, [(i, i) for i in range(costs.n)])).peak_bytes
    hi = min(hi, evaluate(costs, segments_of(costs.n, [])).peak_bytes)
    while lo < hi:
        mid = (lo + hi) // 2
        if solve(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    return lo


def frontier(costs: ChainCosts, points: int = 50, t: Optional[_Tables] = None,
             solve: Optional[Solver] = None) -> tuple[Evaluated, ...]:
    """Pareto-optimal plans (peak, recompute FLOPs) at ``points`` budgets from the smallest
    reachable peak to the peak without checkpointing, cheapest first."""
    t = t or tables(costs)
    solve = solve or (lambda budget: optimal(costs, budget, t))
    lo = minimum_peak(costs, t, solve)
    hi = evaluate(costs, segments_of(costs.n, [])).peak_bytes
    budgets = sorted({lo + (hi - lo) * k // max(points - 1, 1) for k in range(points)})
    found: dict[tuple[Segment, ...], Evaluated] = {}
    for e in map(solve, budgets):
        if e is not None:
            found[e.segments] = e
    plans = sorted(found.values(), key=lambda e: (e.recompute_flops, e.peak_bytes))
    out: list[Evaluated] = []
    for e in plans:  # drop plans another beats on both axes
        if not out or e.peak_bytes < out[-1].peak_bytes:
            out.append(e)
    return tuple(out)
