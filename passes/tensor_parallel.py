"""Which tensors tensor parallelism divides, derived from the step's graph (Megatron-LM's
scheme: Shoeybi et al. 2019; activation accounting: Korthikanti et al. 2022, Table 2).

A linear op (mm/addmm/... with a parameter, or a cast of one, as an operand) whose activation
operand is not sharded is **column-parallel**: its output is split over the t ranks (the
sharded mark starts there: qkv, fc1, gate/up). Marks flow through every op to its outputs.
A linear whose activation operand carries the mark is **row-parallel** (proj, fc2, down):
its output is all-reduced, whole on every rank, and the mark stops. The same rule holds in
backward: ``grad @ W`` of a column-parallel W is a partial sum (all-reduced, whole), of a
row-parallel W it is split. The weights of both kinds (and the column-parallel biases) are
split, so are their gradients and optimizer states.

**stream**: storages computed from the step's inputs. With sequence parallelism the tensors
outside the tensor-parallel regions (LayerNorm, dropout, residual) are split along the
sequence, so every stream tensor of forward and backward is divided by t, except the batch
of token ids (integers; the vocab-parallel embedding needs all of them on every rank).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch

from graphmem.stepgraph import OpNode, StepGraph

_LINEAR = {getattr(torch.ops.aten, n).default for n in ("mm", "addmm", "bmm", "baddbmm", "_addmm_activation", "linear")
           if hasattr(torch.ops.aten, n)}
_BIAS_FIRST = {getattr(torch.ops.aten, n).default for n in ("addmm", "baddbmm", "_addmm_activation")}


@dataclass(frozen=True)
class TPMarks:
    sharded: frozenset[int]  # storage ids split over the tensor-parallel ranks
    stream: frozenset[int]  # storage ids computed from the inputs
    column: tuple[int, ...]  # op indices of column-parallel linears (forward and backward)
    row: tuple[int, ...]  # op indices of row-parallel linears
    weights: frozenset[int]  # parameter storage ids split over the ranks


def _sid(a: object) -> Optional[int]:
    if isinstance(a, OpNode):
        return a.meta.get("storage")
    if isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], OpNode):
        outs = a[0].meta.get("outputs", ())
        return outs[a[1]][2] if a[1] < len(outs) else None
    return None


def _sids(args: Iterable[object]) -> Iterator[int]:
    for a in args:
        if isinstance(a, list):
            yield from _sids(a)
        else:
            sid = _sid(a)
            if sid is not None:
                yield sid


def tp_marks(g: StepGraph) -> TPMarks:
    """Propagate the sharded and stream marks through the step in execution order."""
    def param_of(sid: int) -> Optional[int]:
        s = g.storages[sid]
        if s.kind == "parameter":
            return sid
        if s.source is not None and g.storages[s.source].kind == "parameter":
            return s.source  # autocast's copy of a weight
        return None

    sharded: set[int] = set()
    stream = {s.sid for s in g.storages.values() if s.kind == "input"}
    weights: set[int] = set()
    column: list[int] = []
    row: list[int] = []
    for node in g.ops:
        outs = [sid for _, _, sid in node.meta.get("outputs", ())]
        if not outs:
            continue
        args = list(node.args) + list(node.kwargs.values())
        ins = list(_sids(args))
        if any(s in stream for s in ins):
            stream.update(outs)
        if node.target in _LINEAR:
            bias = _sid(node.args[0]) if node.target in _BIAS_FIRST and node.args else None
            if node.target is torch.ops.aten.linear.default and len(node.args) > 2:
                bias = _sid(node.args[2])
            operands = [s for s in ins if s != bias]
            mats = [s for s in operands if param_of(s) is not None]
            acts = [s for s in operands if param_of(s) is None]
            if mats and acts:
                split = [*mats, *([bias] if bias is not None else [])]
                if any(s in sharded for s in acts):  # row-parallel: all-reduced output, bias whole
                    row.append(node.meta["index"])
                    split = mats
                else:  # column-parallel: split output, weight and bias
                    column.append(node.meta["index"])
                    sharded.update(outs)
                weights.update(p for p in (param_of(s) for s in split) if p is not None)
                sharded.update(split)
                continue
        lists = [a for a in args if isinstance(a, list) and a and len(a) == len(outs) and len(outs) > 1]
        if lists:  # foreach ops: output j follows element j of each list
            for j, sid in enumerate(outs):
                if any(_sid(lst[j]) in sharded for lst in lists):
                    sharded.add(sid)
        elif any(s in sharded or s in weights for s in ins):
            sharded.update(outs)
    return TPMarks(frozenset(sharded), frozenset(stream), tuple(column), tuple(row), frozenset(weights))
