"""Random chains for the checkpoint planner's tests.

A chain's pieces must compose (ChainCosts.check): every segment's forward+backward net is the
sum of its blocks' stored-mode nets h. With w_b = fwd_member + pre + re_last + post - h (the
last block's extra), u_i = fwd_member + re_member + bwd_member - h (an inner block's) and
v_a = fwd_first + re_first + bwd_first - h (the first block's), a segment a..b composes iff
v_a + sum(u) + w_b = 0 for all a < b, i.e. v_a = -w_(a+1) and u_i = w_i - w_(i+1); a single
block segment needs one_pre + one_re + one_post = h - fwd_first. The highs are free.

With ``cached`` (autocast's cast cache), each forward role also holds c bytes until the forward
exits and each earlier recompute role c' bytes until its segment's recompute ends: added to
those pieces' nets, they leave the relations above as they are (the plan frees them).
"""
from __future__ import annotations

import random
from dataclasses import replace

from graphmem.passes.checkpoint import ChainCosts, Piece, Stage


def piece(r: random.Random, net: int, spread: int = 400) -> Piece:
    return Piece(max(0, net) + r.randint(0, spread), net)

def _stage(r: random.Random, i: int, A: int, h: int, F: int, Mm: int, w: int, w_next: int) -> Stage:
    """One block whose nets satisfy the relations above; highs random."""
    p1, re1 = r.randint(-20, 20), r.randint(50, 900)
    pre, rl = r.randint(-20, 20), r.randint(50, 900)
    rf, rm = r.randint(100, 900), r.randint(100, 900)
    post = w + h - Mm - pre - rl                  # w_b = fwd_member + pre + re_last + post - h
    bm = (w - w_next) + h - Mm - rm               # u_i = fwd_member + re_member + bwd_member - h
    bf = -w_next + h - F - rf                     # v_a = fwd_first + re_first + bwd_first - h
    f = r.randint(1, 100)
    return Stage(f"b{i}", piece(r, A), piece(r, h - A), piece(r, F), piece(r, Mm),
                 piece(r, p1, 60), piece(r, re1), piece(r, h - F - p1 - re1),
                 piece(r, pre, 60), piece(r, rf), piece(r, rm), piece(r, rl), piece(r, post),
                 piece(r, bm), piece(r, bf), f, r.randint(1, f), r.randint(1, f), f, r.randint(1, f))

def _holding(r: random.Random, st: Stage) -> Stage:
    """``st`` with random cast-cache bytes held by its forward and earlier-recompute roles."""
    held = {f"c_{role}": r.choice([0, r.randint(1, 300)]) for role in ("fwd", "first", "member", "re_first", "re_member")}
    pieces = {"fwd": "c_fwd", "fwd_first": "c_first", "fwd_member": "c_member", "re_first": "c_re_first",
              "re_member": "c_re_member"}
    grown = {}
    for role, key in pieces.items():
        p = getattr(st, role)
        grown[role] = Piece(p.high + held[key] + r.randint(0, 50), p.net + held[key])
    return replace(st, **grown, **held)


def rand_chain(r: random.Random, n: int, homogeneous: bool = False, cached: bool = False,
               shared: bool = False) -> ChainCosts:
    """n blocks, all different, or all alike (``homogeneous``), as a real chain of blocks;
    ``cached``: with autocast's deferred cache frees; ``shared``: with tensors made before the
    chain that only checkpointed segments keep (freed in the head without checkpoints), and
    maybe entry tensors only the first segment keeps when checkpointed."""
    w = [r.randint(-100, 100) for _ in range(n + 1)]
    seed = r.random()
    if homogeneous:
        w = [w[0]] * (n + 1)
    st = []
    for i in range(n):
        rs = random.Random(seed) if homogeneous else r
        A, h, F, Mm = rs.randint(100, 1000), rs.randint(0, 300), rs.randint(10, 120), rs.randint(-60, 60)
        stage = _stage(rs, i, A, h, F, Mm, w[i], w[i + 1])
        st.append(_holding(rs, stage) if cached else stage)
    costs = ChainCosts(tuple(st), r.randint(0, 1000), piece(r, r.randint(0, 100)),
                       piece(r, r.randint(-50, 100)), piece(r, r.randint(-100, 0)))
    if cached:
        costs = replace(costs, head_post=piece(r, r.randint(-80, 80)))
    if shared:
        x = r.randint(1, 400)
        x0 = r.choice([0, r.randint(1, 300)])  # the chain's input, given to block 0 only
        costs = replace(costs, shared=x, entry=x0,
                        head_free=Piece(r.randint(max(0, costs.head.net - x - x0), costs.head.high + 50),
                                        costs.head.net - x - x0),
                        head_post_free=piece(r, costs.head_post.net),
                        head_entry_free=Piece(r.randint(max(0, costs.head.net - x0), costs.head.high + 50),
                                              costs.head.net - x0),
                        head_post_entry_free=piece(r, costs.head_post.net))
    return costs


def rand_micro(r: random.Random, n: int, k: int = 3) -> ChainCosts:
    """A chain run as k micro-steps: the first's pieces, and the later ones' (same forward
    pieces and recompute FLOPs, their own backward, starting higher: gradients exist)."""
    first = rand_chain(r, n)
    w = [r.randint(-100, 100) for _ in range(n + 1)]
    later = []
    for i, s in enumerate(first.stages):
        s2 = _stage(r, i, s.fwd.net, r.randint(0, 300), s.fwd_first.net, s.fwd_member.net, w[i], w[i + 1])
        later.append(replace(s2, fwd=s.fwd, fwd_first=s.fwd_first, fwd_member=s.fwd_member, flops=s.flops,
                             one_re_flops=s.one_re_flops, re_first_flops=s.re_first_flops,
                             re_member_flops=s.re_member_flops, re_last_flops=s.re_last_flops))
    rest = ChainCosts(tuple(later), first.base + r.randint(0, 600), piece(r, r.randint(0, 100)),
                      piece(r, r.randint(-50, 100)), piece(r, r.randint(-100, 0)))
    return replace(first, later=rest, micro_steps=k)
