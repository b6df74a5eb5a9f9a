"""Depth reuse for compiled captures with ONE compilation: where the partition is made block by
block, the chain is compiled at depth 6 only, not at 5 and 6 (graphmem/capture/reuse.py).

Why: compiling is most of a compiled analysis (dynamo's trace, AOTAutograd's joint graph, the
min-cut partitioner: ~0.3 s of CPU per GPT-2 XL block here, docs/compiled.md), and it grows with
the blocks compiled. The scheme of reuse.py compiles 5 + 6 = 11 blocks; this one compiles 6, and
checks what the second compilation checked with two cheaper captures:

1. The step itself repeats with the depth: the EAGER step captured at depth 5 and widened to 6
   equals the eager capture at 6 (eager depth reuse, reuse.py, which costs a fraction of a
   compilation; its step at full depth is the eager analysis that compiled mode puts beside the
   compiled one, so it is not captured twice). Dynamo traces that same Python code, and
   AOTAutograd's joint graph is its ops decomposed one by one. Where the eager step does not
   repeat, reuse.py's two compilations decide.
2. The compiled step repeats block by block: the depth-6 compiled capture with its block 3
   rewritten as a copy of block 2 (``widen(g, chain, 6, 6)``: block 2 is the template of every
   inner block, graphmem/capture/widen.py) equals the capture itself, op for op, storage for
   storage, save for save, and in the forward ops each backward graph recomputes, per module.
   Block 3 is the first inner block whose neighbours are inner blocks: the partitioner cut it as
   it cut block 2.

Then the depth-6 compiled capture is widened to full depth. This holds where the partitioner
cuts each block on its own: at activation memory budget 1 (torch's default: one min cut) and
0. Between 0 and 1 the partitioner compares cuts of the whole step with the budget and may run a
knapsack over every block (graphmem/capture/partition_record.py): that needs the partitions at
two depths, so reuse.py's two compilations run. So does the CUDA target, whose SDPA backend
counts per block come from the compilations at 5 and 6.

Known limitations: as in reuse.py, a parent whose loop treats some later block differently
(``if i == 40: ...``) is seen only by a full capture (``reuse=False``).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Optional

import torch.nn as nn

from graphmem.capture.call_paths import module_order
from graphmem.capture.reuse import (
    DEPTH,
    MIN_LENGTH,
    blocks_alike,
    capture_reusing,
    compiled_signature,
    named_at,
    signature,
)
from graphmem.capture.target import Target
from graphmem.capture.widen import NotReusable, widen
from graphmem.chains import find_chain, truncated
from graphmem.stepgraph import StepGraph


def block_local(target: Target) -> bool:
    """The partitioner cuts each block on its own at this target's budget (1 or 0), on the CPU target."""
    from torch._functorch import config

    budget = target.memory_budget if target.memory_budget is not None else config.activation_memory_budget
    return budget in (0, 1) and target.device == "cpu"


class CompiledReused(NamedTuple):
    graph: StepGraph
    used: bool  # widened from a compilation at depth 6 (or 5 and 6)
    why: str = ""  # why not, where the chain was long enough to try
    eager: Optional[StepGraph] = None  # the eager step at full depth, where the eager check captured it


def compiled_reusing(model: nn.Module, capture_at: Callable[[Target], StepGraph], target: Target) -> CompiledReused:
    """The compiled step at full depth (``capture_at(target)`` captures the model as it is now):
    widened from one compilation at depth 6 when both checks pass, from two (reuse.py) where the
    partition is not made block by block or the eager step does not repeat, else captured
    whole. The eager check is eager depth reuse itself, so its step at full depth comes back
    too (``eager``: the eager analysis beside the compiled one need not capture it again)."""
    if not block_local(target):
        return CompiledReused(*capture_reusing(model, lambda: capture_at(target)))
    chain = find_chain(model)
    if chain is None or chain.length < MIN_LENGTH or not blocks_alike(model, chain):
        return CompiledReused(capture_at(target), False)
    eager_target = dataclasses.replace(target, mode="eager")
    eager = capture_reusing(model, lambda: capture_at(eager_target))  # captured at 5 and 6, checked, widened
    if not eager.used:  # (2 compilations then, as before this scheme)
        return CompiledReused(*capture_reusing(model, lambda: capture_at(target)), eager=eager.graph)
    k = DEPTH + 1
    names = [name for name, _ in named_at(model, chain, k)]
    try:
        with truncated(model, chain, k):
            g = capture_at(target)
        differs = "a compiled block differs from its neighbour's copy"
        try:
            copied = widen(g, chain, k, k, names)  # block 3 written as a copy of block 2
        except NotReusable as e:
            raise NotReusable(f"{differs} ({e})") from None
        if signature(copied) != signature(g):
            raise NotReusable(differs)
        if compiled_signature(copied) != compiled_signature(g):
            raise NotReusable("the compiled graphs differ (the partition is not the same in every block)")
        return CompiledReused(widen(g, chain, k, chain.length, module_order(model)), True,
                              eager=eager.graph)
    except NotReusable as e:
        return CompiledReused(capture_at(target), False, str(e), eager.graph)
