"""Compiled mode: the gradients AOTAutograd's backward hands back, written in parameter order.

AOTAutograd's compiled backward is one autograd node that returns every parameter's gradient
at once; the engine then runs each parameter's AccumulateGrad node, which stores the gradient
as ``.grad`` without a copy (``new_grad.detach()``, torch/csrc/autograd/functions/accumulate_grad.h
``accumulateGrad``). Every AccumulateGrad node has the same priority in the engine's ready queue
(sequence number UINT64_MAX, torch/csrc/autograd/engine.cpp ``CompareNodeTaskTime``), so they
run in the queue's heap order: an order of no meaning that changes with the number of
parameters. graphmem writes these ops in parameter order instead. They allocate and free
nothing (a detach is a view of the gradient), so no number graphmem reports changes; the order
only makes the hand-back repeat block by block, which depth reuse needs
(graphmem/capture/widen.py).
"""
from __future__ import annotations

from typing import Collection

import torch

from graphmem.stepgraph import OpNode, SaveEvent, Storage


def _hands_back(op: OpNode, gradients: Collection[int]) -> bool:
    outs = op.meta.get("outputs", ())
    return (op.target is torch.ops.aten.detach.default and op.meta.get("phase") == "backward"
            and op.meta.get("module") == "" and len(outs) == 1 and outs[0][2] in gradients)


def hand_back_start(ops: list[OpNode], gradients: Collection[int]) -> int:
    """The first op of the trailing run that stores gradients as ``.grad`` (len(ops): none)."""
    wanted = set(gradients)
    start = len(ops)
    while start > 0 and _hands_back(ops[start - 1], wanted):
        start -= 1
    return start


def hand_back_in_order(ops: list[OpNode], storages: dict[int, Storage], saves: list[SaveEvent],
                       gradients: list[int]) -> None:
    """Reorder the trailing hand-back run of ``ops`` (in place) by the gradients' order in
    ``gradients`` (parameter order); left as it is if anything happens between its ops."""
    start, end = hand_back_start(ops, gradients), len(ops)
    if end - start < 2:
        return
    events = {i for st in storages.values() for i in (st.created, st.freed)} | \
        {i for e in saves for i in (e.packed_at, e.released_at)}
    if any(i is not None and start <= i < end - 1 for i in events):
        return  # something is allocated, freed, saved or released between them: the order matters
    if any(_made_at(a) >= start for op in ops[start:] for a in op.args):
        return
    rank = {sid: n for n, sid in enumerate(gradients)}
    run = sorted(ops[start:end], key=lambda op: rank[op.meta["outputs"][0][2]])
    for i, op in enumerate(run, start):
        op.meta["index"], op.name = i, f"op{i}"
        ops[i] = op


def _made_at(a: object) -> int:
    """The index of the op an argument refers to (-1: not an op's output)."""
    node = a[0] if isinstance(a, tuple) and len(a) == 2 else a
    return node.meta.get("index", -1) if isinstance(node, OpNode) else -1
