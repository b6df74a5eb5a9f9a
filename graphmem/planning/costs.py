"""A chain's pieces, measured: which captures of the step to take, and the checks that their
pieces (cut at block boundaries into the roles of passes/checkpoint_model.py's model by
graphmem/planning/pieces.py) compose.

Captures of a few plans on fake tensors (nothing checkpointed, every block its own segment,
the whole chain one segment, pairs) show every block in every role it can play; each capture
is cut into pieces at block boundaries, and a role measured twice must agree. A chain of
identical blocks is captured at depth 4 and its interior block stands for all the others;
the stitched peak of the plan without checkpointing must equal the report's own peak, or the
captures are repeated at full depth.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional, Sequence

import torch.nn as nn

from graphmem.analysis import AnalysisView, captured
from graphmem.chains import Chain, find_chain, truncated
from graphmem.errors import GraphmemError, PassError
from graphmem.passes.budget import later_steps_peak, made_states
from graphmem.passes.checkpoint import ChainCosts, Piece, Segment, evaluate, level_after, segments_of
from graphmem.planning.apply import SegmentPolicy, apply_segments, chain_blocks
from graphmem.planning.pieces import Cut, PlanError, assemble, cut_roles, shared_keys, tails
from graphmem.stepgraph import StepGraph

__all__ = ["DEPTH", "PlanError", "chain_costs", "measure_chain", "stage_chain"]

DEPTH = 4  # blocks captured for a chain of identical blocks (first, two interior, last)


def _plans(k: int) -> list[tuple[str, list[tuple[int, int]]]]:
    """Plans that show every block of k in every role it can play."""
    plans = [("no checkpoints", []), ("every block", [(i, i) for i in range(k)]), ("one segment", [(0, k - 1)])]
    even = [(a, a + 1) for a in range(0, k - 1, 2)]
    odd = [(a, a + 1) for a in range(1, k - 1, 2)]
    plans += [(f"pairs {s[0][0]}", s) for s in (even, odd) if s and s != [(0, k - 1)]]
    if k == 2:  # the first block stored below a checkpointed one (pairs 1 shows it for k >= 3)
        plans.append(("last block", [(1, 1)]))
    return plans


def _entry_plan(plans: Sequence[tuple[str, tuple[Segment, ...], Cut]]) -> Optional[Cut]:
    """A capture whose first block is stored and another checkpointed."""
    return next((cut for _, segs, cut in plans if not segs[0][2] and any(ck for _, _, ck in segs)), None)


def chain_costs(model: nn.Module, chain: Chain, capture_at: Callable[[], StepGraph], depth: Optional[int],
                policy: Optional[SegmentPolicy] = None,
                micro_steps: int = 1) -> ChainCosts:
    """The chain's pieces from captures (at ``depth`` blocks, or the full chain); with a
    selective ``policy`` (graphmem/planning/selective.py), every checkpointed segment runs under it.
    A step of ``micro_steps`` micro-batches is captured as two (the second stands for the
    later ones): the costs then carry the second's pieces as ``later``."""
    k = chain.length if depth is None else min(depth, chain.length)
    names = [path for path, _ in chain_blocks(model, chain.path)][:k]
    # one (found roles, fixed pieces, starting level) per micro-step traced: the first, and
    # the second standing for every later one (graphmem/training/loop.py traces two)
    disagree: list[str] = []
    captured = _captures(model, chain, capture_at, k, names, policy, disagree)
    counts = {len(cut.windows()) for _, _, cut in captured}
    if len(counts) != 1:
        raise PlanError("the step ran a different number of micro-steps when its blocks were checkpointed")
    kept = [shared_keys(captured[0][2], captured[1][2], w) for w in range(counts.pop())]
    # given to every block (kept by any checkpointed segment) or to the first only: the first
    # block stored, another checkpointed, tells them apart
    disc = _entry_plan(captured)
    by_others = [shared_keys(captured[0][2], disc, w) if disc is not None else set() for w in range(len(kept))]
    entry = [k - o for k, o in zip(kept, by_others)]
    shared = [k - e for k, e in zip(kept, entry)]
    # per micro-step: found roles, fixed pieces, starting level
    steps: list[tuple[dict[tuple[int, str], tuple[Piece, int, int]], list, list]] = [({}, [], []) for _ in shared]
    free_heads: list[tuple[Piece, Piece]] = []
    entry_heads: list[tuple[Piece, Piece]] = []
    peaks: list[tuple[str, tuple[Segment, ...], int]] = []
    for n, (what, segs, cut) in enumerate(captured):
        cut.share(kept)
        for (found, fixed, starts), window in zip(steps, cut.windows()):
            pieces, real_head = cut_roles(cut, k, segs, what, found, window, disagree)
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
    made = [replace(assemble(found, fixed[0], starts[0], names, chain.path), shared=sum(n for _, n in keys_w),
                    head_free=free[0], head_post_free=free[1], entry=sum(n for _, n in keys_e),
                    head_entry_free=first[0], head_post_entry_free=first[1])
            for (found, fixed, starts), keys_w, keys_e, free, first
            in zip(steps, shared, entry, free_heads, entry_heads)]
    costs = made[0]
    if len(made) > 1:
        if made[1].base != level_after(made[0]):
            disagree.append("the second micro-step does not start where the first ends")
        costs = replace(costs, later=made[1], micro_steps=micro_steps)
    return _checked(costs, peaks, disagree)


def _captures(model: nn.Module, chain: Chain, capture_at: Callable[[], StepGraph], k: int, names: list[str],
              policy: Optional[SegmentPolicy], disagree: list[str]) -> list[tuple[str, tuple[Segment, ...], Cut]]:
    """Each of ``_plans(k)`` captured on the chain truncated to k blocks: (plan, its segments,
    the capture cut at block boundaries). A plan that cannot run is left out, its reason added
    to ``disagree``."""
    captured: list[tuple[str, tuple[Segment, ...], Cut]] = []
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
        captured.append((what, segments_of(k, ck), Cut(g, names)))
    return captured


def _checked(costs: ChainCosts, peaks: list[tuple[str, tuple[Segment, ...], int]], disagree: list[str]) -> ChainCosts:
    """The costs, marked inexact (with the first problem) unless they pass ``ChainCosts.check``
    and the stitched peak of every captured plan equals its captured peak."""
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


def measure_chain(report: AnalysisView, policy: Optional[SegmentPolicy] = None) -> tuple[ChainCosts, int]:
    """The chain costs of a report's model (captures at depth 4 when the blocks are identical,
    else at full depth) and the depth captured; checkpointed segments run under ``policy``."""
    source = report.source
    if source is None:
        raise PlanError("this report has no model to re-run (no tensor inputs); checkpoint plans need one")
    if getattr(report.target, "mode", "eager") != "eager":
        raise PlanError("checkpoint plans are made for eager steps: under torch.compile the partitioner already "
                        "chooses what to recompute (the report lists it); to trade recompute for memory there, sweep "
                        "its activation memory budget (`memory_budget=1,0.8,0.5,0.2`), or plan with `mode='eager'`")
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
                        "modules): selective plans apply one policy to every block; plan without `selective`")
    capture_at = source.capture
    # plans are for every step: after the first, the optimizer states live from the start
    step, lv = captured(report)
    states, peak = made_states(step), later_steps_peak(step, lv)
    if chain.length > DEPTH and "," not in chain.path:
        try:
            costs = _widen(chain_costs(model, chain, capture_at, DEPTH, policy, micro), chain.length,
                           report.baseline_bytes + states,
                           tails(step, [p for p, _ in chain_blocks(model, chain.path)]))
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

