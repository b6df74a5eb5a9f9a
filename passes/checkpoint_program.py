"""The checkpoint program: the cheapest plan (fewest recompute FLOPs) for a chain of blocks
under a memory budget, exactly, over the model of passes/checkpoint_model.py.

After a segment's backward, everything it allocated is gone except its gradients, whatever
way it ran; so a block's forward+backward net effect ``h_i`` does not depend on the plan
(``ChainCosts.check`` proves it for the measured costs), and the level at the start of segment
a..b's backward is ``start + head.net + m_a + fwd_net(a..b) + H(>b)`` where ``m_a`` is what the
forward of the blocks before a kept. Each segment therefore caps ``m_a``, and a left-to-right
program over (position, kept bytes) with Pareto pruning on (kept bytes, recompute FLOPs) finds
the cheapest plan under a budget exactly (``tables`` holds each segment's caps, ``program``
runs it; passes/selective.py runs it with several ways per segment).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from graphmem.errors import PassError
from graphmem.passes.checkpoint_model import (
    NOTHING,
    ChainCosts,
    Evaluated,
    Piece,
    backward_piece,
    evaluate,
    head_pieces,
)


@dataclass
class Tables:
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


def tables(costs: ChainCosts) -> Tables:
    t = _tables(costs)
    if costs.later is None:
        return t
    # later micro-steps keep what the first keeps (same forward) from a higher level: each
    # constraint is the stricter of the two, measured from the first's start
    t2 = _tables(costs.later)
    shift = t2.start - t.start
    if (t.shared, t.entry) != (t2.shared, t2.entry):
        raise PassError("checkpoint: the micro-steps pass the chain different tensors; the pieces do not compose")
    return Tables(np.maximum(t.need_f, t2.need_f + shift), np.maximum(t.need_b, t2.need_b + shift), t.fnet, t.knet,
                   t.flops, np.maximum(t.stored_need_f, t2.stored_need_f + shift),
                   np.maximum(t.stored_need_b, t2.stored_need_b + shift), t.stored_net, t.stored_knet,
                   max(t.fixed, t2.fixed), t.start, max(t.end_f, t2.end_f + shift), max(t.end_b, t2.end_b + shift),
                   t.shared, max(t.end_f_free, t2.end_f_free + shift), max(t.end_b_free, t2.end_b_free + shift),
                   t.entry, max(t.end_f_entry, t2.end_f_entry + shift), max(t.end_b_entry, t2.end_b_entry + shift))


def _tables(costs: ChainCosts) -> Tables:
    st, n = costs.stages, costs.n
    start = costs.base + costs.before.net
    head_net = costs.head.net + costs.head_post.net
    h = [s.net for s in st]
    later = [sum(h[b + 1:]) for b in range(n)]  # H(>b)
    need_f, need_b, fnet, knet, flops = (np.zeros((n, n), dtype=np.int64) for _ in range(5))
    back_high = np.zeros((n, n), dtype=np.int64)  # the backward piece's high, per segment
    sum_re = [0]
    for s in st:
        sum_re.append(sum_re[-1] + s.re_member_flops)
    for b in range(n):
        back_high[b, b] = backward_piece((b, b, True), st).high
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
    free, entry = head_pieces(costs, False, False), head_pieces(costs, True, False)
    return Tables(need_f, need_b, fnet, knet, flops, stored_need_f, stored_need_b, stored_net, stored_knet,
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


def optimal(costs: ChainCosts, budget: int, t: Optional[Tables] = None) -> Optional[Evaluated]:
    """The plan with the fewest recompute FLOPs whose peak is <= budget (None if none fits);
    among equally cheap plans, the one whose forward keeps the fewest bytes."""
    segs = program([t or tables(costs)], costs.n, budget)
    return None if segs is None else evaluate(costs, tuple((a, b, m > 0) for a, b, m in segs))


def program(modes: Sequence[Tables], n: int, budget: int) -> Optional[list[tuple[int, int, int]]]:
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
        parts: list[tuple[np.ndarray, ...]] = []
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
        parts.append(_stored(t, b, room, track, x, x0, lo, size, (M, K, F, G, C), ways))
        both, cm, ck, cf, cg, cc, ccode = (np.concatenate([p[i] for p in parts]) for i in range(7))
        if end == n:  # (untracked, ck, cf and cg hold placeholders: all are 0)
            fits = _fits_end(t, room, track, cm, ck, cf, cg)
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
    return _backtrack(M, C, parent, code, offsets[n], offsets[n + 1], n, ways)

def _stored(t: Tables, b: int, room: int, track: bool, x: int, x0: int, lo: int, size: int,
            states: tuple[np.ndarray, ...], ways: int) -> tuple[np.ndarray, ...]:
    """``program``'s states that store block ``b`` alone, from the states at ``b`` (``lo`` to ``size``): the shared
    tensors are dead by its backward unless f, the entry ones unless g."""
    M, K, F, G, C = states
    mv, kv = M[lo:size], K[lo:size]
    if track:
        fv, gv = F[lo:size], G[lo:size]
        ok = (mv <= room - t.stored_need_b[b] + x * (1 - fv) + x0 * (1 - gv)) & (mv + kv <= room - t.stored_need_f[b])
    else:
        ok = mv <= room - t.stored_need[b]
    sidx = np.nonzero(ok)[0] + lo
    return (sidx, M[sidx] + t.stored_net[b], K[sidx] + t.stored_knet[b] if track else sidx,
            F[sidx] if track else sidx, G[sidx] if track else sidx, C[sidx], np.full(len(sidx), b * ways, dtype=np.int64))



def _fits_end(t: Tables, room: int, track: bool, cm: np.ndarray, ck: np.ndarray, cf: np.ndarray,
              cg: np.ndarray) -> np.ndarray:
    """Which states after the last block also fit the ops after the chain: with the shared
    tensors live unless a segment before was checkpointed (f), the entry ones unless the first
    segment was (g)."""
    if track:
        return np.where(cf == 0, (cm <= room - t.end_b_free) & (cm + ck <= room - t.end_f_free),
                        np.where(cg == 0, (cm <= room - t.end_b_entry) & (cm + ck <= room - t.end_f_entry),
                                 (cm <= room - t.end_b) & (cm + ck <= room - t.end_f)))
    return (cm <= room - t.end_b) & (cm <= room - t.end_f)


def _backtrack(M: np.ndarray, C: np.ndarray, parent: np.ndarray, code: np.ndarray, lo: int, hi: int, n: int,
               ways: int) -> Optional[list[tuple[int, int, int]]]:
    """The segments of the cheapest final state in [lo, hi) (the fewest FLOPs, then the fewest
    kept bytes), followed back through the parents; None if there is none."""
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


def optimal_many(costs: ChainCosts, budgets: Sequence[int], t: Optional[Tables] = None) -> list[Optional[Evaluated]]:
    """``optimal`` for several budgets, sharing the tables."""
    t = t or tables(costs)
    return [optimal(costs, b, t) for b in budgets]
