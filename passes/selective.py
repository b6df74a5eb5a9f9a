"""Selective (op-level) checkpointing for a chain of blocks: which ops' outputs a checkpointed
block keeps, and plans whose segments each run in one of several ways.

Within a checkpointed block, PyTorch's selective checkpointing
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``) keeps the outputs of the ops
a policy names and recomputes the rest in backward. Keeping an op's output costs its bytes from
the forward until the recompute reaches it and saves exactly that op's FLOPs (the recompute
still runs every other op, the ones that compute its inputs included). Choosing the ops is a
0/1 knapsack: ``knapsack`` gives every Pareto-optimal set (bytes kept, FLOPs saved), exactly;
``levels`` picks a few of them at evenly spaced byte targets. Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models") recompute the attention core
and keep the projections: the knapsack arrives there when the core's outputs (b·h·s² each)
cost more bytes per FLOP than the linear layers' (b·s·d).

A selective level is one more way a checkpointed segment can run, with its own measured pieces
(passes/checkpoint_model.py's ``Stage``): ``Modes`` holds the chain's costs under plain
checkpointing (level 0) and under each level. Stored blocks and the pieces around the chain
run the same in every level, and a segment's forward+backward net effect is the same however
it runs (``Modes.check``), so the program of passes/checkpoint_program.py stays exact with one
transition per (segment, level): ``optimal`` equals ``brute_force`` over every segmentation
and every level of every checkpointed segment (tests). A plan's segments are (first, last,
mode): mode 0 stored, 1 plain checkpointing, 1 + k level k.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Iterator, Optional, Sequence

from graphmem.errors import PassError
from graphmem.passes.checkpoint import (
    ChainCosts,
    Evaluated,
    Tables,
    all_plans,
    evaluate,
    frontier,
    minimum_peak,
    program,
    tables,
)

ModalSegment = tuple[int, int, int]  # (first block, last block, mode)


# -- which ops to keep -------------------------------------------------------------------------------
def knapsack(items: Sequence[tuple[int, int]]) -> list[tuple[int, int, frozenset[int]]]:
    """Every Pareto-optimal subset of ``items`` (bytes, FLOPs): for each, no subset keeps fewer
    bytes and saves at least as many FLOPs. Sorted by bytes; the empty set first. Exact: the
    list of (bytes, FLOPs) pairs is pruned after each item (Nemhauser-Ullmann)."""
    front: list[tuple[int, int, frozenset[int]]] = [(0, 0, frozenset())]
    for i, (w, v) in enumerate(items):
        if w < 0 or v < 0:
            raise PassError(f"selective: item {i} has negative bytes or FLOPs ({w}, {v})")
        if v == 0:
            continue  # keeping it saves nothing
        merged = sorted(front + [(b + w, f + v, s | {i}) for b, f, s in front], key=lambda x: (x[0], -x[1]))
        front = []
        for b, f, s in merged:
            if not front or f > front[-1][1]:
                front.append((b, f, s))
    return front


def best_within(front: Sequence[tuple[int, int, frozenset[int]]], cap: int) -> tuple[int, int, frozenset[int]]:
    """The subset of a ``knapsack`` front saving the most FLOPs within ``cap`` bytes."""
    return max((x for x in front if x[0] <= cap), key=lambda x: (x[1], -x[0]))


def levels(items: Sequence[tuple[int, int]], count: int) -> list[frozenset[int]]:
    """Up to ``count`` distinct non-empty item sets: the knapsack's best within k/count of the
    bytes of keeping every item worth keeping, k = 1..count (the last keeps them all)."""
    if count < 1:
        raise PassError("selective: the number of levels must be at least 1")
    front = knapsack(items)
    total = front[-1][0]
    out: list[frozenset[int]] = []
    for k in range(1, count + 1):
        chosen = best_within(front, total * k // count)[2]
        if chosen and chosen not in out:
            out.append(chosen)
    return out


# -- plans over several ways to run a segment ----------------------------------------------------------
@dataclass(frozen=True)
class Modes:
    """The chain's costs under plain checkpointing (``levels[0]``) and each selective level."""

    levels: tuple[ChainCosts, ...]

    @property
    def n(self) -> int:
        return self.levels[0].n

    @property
    def plain(self) -> ChainCosts:
        return self.levels[0]

    def check(self) -> None:
        """Every level composes, and runs stored blocks and the ops around the chain alike."""
        base = self.plain
        for k, c in enumerate(self.levels):
            c.check()
            if _around(c) != _around(base):
                raise PassError(f"selective: level {k} changes the ops around the chain; the levels do not compose")
            pairs = list(zip(c.stages, base.stages))
            if c.later is not None and base.later is not None:
                pairs += list(zip(c.later.stages, base.later.stages))
            for i, (s, s0) in enumerate(pairs):
                if (s.fwd, s.bwd, s.flops, s.c_fwd) != (s0.fwd, s0.bwd, s0.flops, s0.c_fwd):
                    raise PassError(f"selective: level {k} changes stored block {i % self.n}; the levels do not compose")

    def mixed(self, segments: Sequence[ModalSegment]) -> ChainCosts:
        """The chain whose block i plays its roles as its segment's mode runs it (in every
        micro-step)."""
        mode = {i: max(m - 1, 0) for a, b, m in segments for i in range(a, b + 1)}
        if sorted(mode) != list(range(self.n)) or any(m > len(self.levels) for _, _, m in segments):
            raise PassError(f"selective: segments {list(segments)} are not a plan of {self.n} blocks in "
                            f"{len(self.levels)} modes")
        later = None
        if self.plain.later is not None:
            later = replace(self.plain.later, stages=tuple(
                self.levels[mode[i]].later.stages[i] for i in range(self.n)))  # type: ignore[union-attr]
        return replace(self.plain, stages=tuple(self.levels[mode[i]].stages[i] for i in range(self.n)), later=later)

    def tables(self) -> list[Tables]:
        return [tables(c) for c in self.levels]


def _around(c: ChainCosts) -> tuple:
    """What every way of running the chain shares: the pieces around it, per micro-step."""
    own = (c.n, c.base, c.before, c.head, c.head_post, c.after, c.micro_steps, c.shared, c.head_free, c.head_post_free,
           c.entry, c.head_entry_free, c.head_post_entry_free)
    return own + (_around(c.later) if c.later is not None else ())


def evaluate_modes(modes: Modes, segments: Sequence[ModalSegment]) -> Evaluated:
    """The exact peak of a plan whose checkpointed segments each run in a mode (segments keep
    their modes in the result)."""
    for a, b, m in segments:
        if m == 0 and a != b:
            raise PassError(f"selective: stored segment {a}..{b} has more than one block")
    return evaluate(modes.mixed(segments), tuple(segments))  # type: ignore[arg-type]  # mode ints


def optimal(modes: Modes, budget: int, ts: Optional[Sequence[Tables]] = None) -> Optional[Evaluated]:
    """The plan with the fewest recompute FLOPs under ``budget``, each checkpointed segment in
    its best mode (None if none fits)."""
    segs = program(ts or modes.tables(), modes.n, budget)
    return None if segs is None else evaluate_modes(modes, segs)


def all_modal_plans(n: int, count: int) -> Iterator[tuple[ModalSegment, ...]]:
    """Every plan of n blocks with ``count`` ways to run a checkpointed segment."""
    for plan in all_plans(n):
        ck = [i for i, (_, _, c) in enumerate(plan) if c]
        for ways in itertools.product(range(1, count + 1), repeat=len(ck)):
            mode = dict(zip(ck, ways))
            yield tuple((a, b, mode.get(i, 0)) for i, (a, b, _) in enumerate(plan))


def brute_force(modes: Modes, budget: int) -> Optional[Evaluated]:
    """Every plan in every mode, for testing ``optimal`` (small chains only)."""
    best: Optional[Evaluated] = None
    for plan in all_modal_plans(modes.n, len(modes.levels)):
        e = evaluate_modes(modes, plan)
        if e.peak_bytes <= budget and (best is None or (e.recompute_flops, e.kept_bytes) < (best.recompute_flops, best.kept_bytes)):
            best = e
    return best


def modal_minimum_peak(modes: Modes, ts: Optional[Sequence[Tables]] = None) -> int:
    ts = ts or modes.tables()
    return minimum_peak(modes.plain, ts[0], lambda budget: optimal(modes, budget, ts))


def modal_frontier(modes: Modes, points: int = 50, ts: Optional[Sequence[Tables]] = None) -> tuple[Evaluated, ...]:
    ts = ts or modes.tables()
    return frontier(modes.plain, points, ts[0], lambda budget: optimal(modes, budget, ts))


def every_block(modes: Modes, mode: int) -> Evaluated:
    """Every block its own checkpointed segment, all in one mode (1: plain)."""
    return evaluate_modes(modes, [(i, i, mode) for i in range(modes.n)])


__all__ = ["Modes", "ModalSegment", "knapsack", "best_within", "levels", "evaluate_modes", "optimal",
           "brute_force", "all_modal_plans", "modal_minimum_peak", "modal_frontier", "every_block"]
