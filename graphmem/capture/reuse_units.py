"""Depth reuse for a chain of units (graphmem/capture/widen_units.py): the step with a checkpoint plan
applied, captured with its longest run of alike units cut to 5 and the other units kept, then
widened, as graphmem/capture/reuse.py does for a chain of alike blocks.

A checkpointed segment runs its blocks forward together and again, recomputed, right before their
backward, so the blocks of a segment are one unit; each block outside the segments is a unit of
its own. Units of one kind (``kinds``: a segment's length and policy, or a plain block) are alike
when the blocks are. The same check as reuse.py's decides, every time: the step is captured
with the run cut to 5 units and to 6, and the first capture widened to 6 units must equal the
second op for op, storage for storage, save for save (``signature``); if not, or if the chain
has no run long enough for the two short captures to cost less than the whole step, the whole
step is captured and ``Reused.why`` says why.

Known limitations: one run is cut (the others are captured whole), so a plan of several long
runs of different kinds (segments of one block, then of two) is captured whole when that is
cheaper; eager steps only (plans are: graphmem/planning/costs.py).
"""
from __future__ import annotations

from typing import Callable, Hashable, Optional, Sequence, Union

import torch.nn as nn

from graphmem.capture.call_paths import module_order
from graphmem.capture.reuse import DEPTH, Reused, blocks_alike, signature
from graphmem.capture.widen import NotReusable, widen
from graphmem.capture.widen_units import Layout
from graphmem.chains import Chain, find_chain, selected
from graphmem.stepgraph import StepGraph

# a plan's blocks carry their segment's forward, and the segment's blocks and original forwards it runs
# (graphmem/planning/apply.py): a unit's kind says what it runs
_PLAN_ATTRIBUTES = frozenset({"forward", "_graphmem_segment", "_graphmem_original"})


def layout_for(sizes: Sequence[int], kinds: Sequence[Hashable]) -> Union[Layout, str]:
    """The layout that cuts the longest run of alike units (same kind, same size) to ``DEPTH``, or
    why there is none worth capturing: the captures at 5 and 6 units must hold fewer blocks together
    than the whole chain."""
    best: Optional[tuple[int, int]] = None  # (first unit, units)
    first = 0
    for u in range(1, len(sizes) + 1):
        if u == len(sizes) or (kinds[u], sizes[u]) != (kinds[first], sizes[first]):
            if best is None or u - first > best[1]:
                best = (first, u - first)
            first = u
    if best is None:
        return "no units"
    total, (first, run) = sum(sizes), best
    short = total - (run - DEPTH) * sizes[first]  # blocks captured at 5 units (and one unit more at 6)
    if run <= DEPTH + 1 or 2 * short + sizes[first] >= total:
        return (f"the longest run of alike units ({run} of {sizes[first]} block{'s' if sizes[first] > 1 else ''}) is too "
                f"short: the captures at {DEPTH} and {DEPTH + 1} units would hold {2 * short + sizes[first]} blocks, "
                f"the step {total}")
    return Layout(tuple(sizes), first, run, DEPTH)


def capture_units(model: nn.Module, chain_path: str, sizes: Sequence[int], kinds: Sequence[Hashable],
                  capture_at: Callable[[], StepGraph]) -> Reused:
    """The step at full depth, the chain ``chain_path`` seen as units of ``sizes`` blocks of ``kinds``:
    widened from its longest run of alike units cut to 5 when the check at 6 passes, else captured."""
    chain = find_chain(model)
    if chain is None or chain.path != chain_path or chain.length != sum(sizes) or len(sizes) != len(kinds):
        return Reused(capture_at(), False, f"{chain_path} is not the model's chain of alike blocks")
    if not blocks_alike(model, chain, _PLAN_ATTRIBUTES):
        return Reused(capture_at(), False, "the blocks hold different settings")
    layout = layout_for(sizes, kinds)
    if isinstance(layout, str):
        return Reused(capture_at(), False, layout)
    try:
        return Reused(_widened(model, chain, layout, capture_at), True)
    except NotReusable as e:
        return Reused(capture_at(), False, str(e))


def _widened(model: nn.Module, chain: Chain, layout: Layout, capture_at: Callable[[], StepGraph]) -> StepGraph:
    """The step widened from the capture at ``layout``'s cut, checked against the capture one unit deeper."""
    deeper = Layout(layout.sizes, layout.first, layout.run, layout.kept + 1)
    with selected(model, chain, layout.captured_blocks()):
        small = capture_at()
    with selected(model, chain, deeper.captured_blocks()):
        check = capture_at()
        names_check = module_order(model)
    one_more = Layout(deeper.captured_sizes, layout.first, layout.kept + 1, layout.kept)  # the short capture, widened to 6
    if signature(widen(small, chain, one_more.k, one_more.n, names_check, one_more)) != signature(check):
        raise NotReusable("the widened graph differs from the capture")
    g = widen(small, chain, layout.k, layout.n, module_order(model), layout)
    more = layout.run - layout.kept
    keys = set(check.attention_backends) | set(small.attention_backends)
    counts = {key: small.attention_backends.get(key, 0) + more * (check.attention_backends.get(key, 0) -
                                                                   small.attention_backends.get(key, 0)) for key in keys}
    g.attention_backends = {key: v for key, v in counts.items() if v}
    return g
