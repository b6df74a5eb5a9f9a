"""Selective (op-level) checkpointing: which ops of a checkpointed block keep their outputs,
as a ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` policy, and plans whose
segments run plainly checkpointed or under such a policy (passes/selective.py).

An op is named by its overload and its call index among that overload's calls in the block
(``("aten.addmm.default", 2)``: the block's third addmm), counted as the policy sees the ops
(torch.utils.checkpoint.SAC_IGNORED_OPS not counted); the count restarts at each block of a
segment, so one policy fits every block of a chain of identical blocks. The policy decides
during the forward; the recompute replays the decisions (PyTorch's SAC caches by the same
(op, index)).

Candidates: the block's ops with FLOPs (torch.utils.flop_counter's formulas; pointwise ops
have none, so keeping them would save nothing) that allocate their output, are not random
(a kept random op would not advance the generator in the recompute, shifting every later
random op) and whose output nothing changes in place later (SAC refuses that).
"""
from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass
from typing import ContextManager, Optional

import torch
from torch._ops import OpOverload
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    SelectiveCheckpointContext,
    create_selective_checkpoint_contexts,
)

from graphmem.analysis import AnalysisView, captured
from graphmem.chains import find_chain
from graphmem.errors import GraphmemError, UsageError
from graphmem.jsontypes import JSON
from graphmem.passes import selective as sel
from graphmem.passes.checkpoint import Evaluated
from graphmem.planning.planner import PlanError, Planner, measure_chain, op_flops
from graphmem.stepgraph import OpNode, StepGraph

LEVELS = 3  # selective levels measured by default


class _Session:
    """One checkpointed call: counts each overload's calls per block (see OpPolicy)."""

    def __init__(self, keep: frozenset[tuple[str, int]]) -> None:
        self.keep = keep
        self.seen: collections.Counter[OpOverload] = collections.Counter()

    def block(self) -> None:
        self.seen.clear()

    def decide(self, ctx: SelectiveCheckpointContext, op: OpOverload, *args: object, **kwargs: object) -> CheckpointPolicy:
        k = self.seen[op]
        self.seen[op] += 1
        return CheckpointPolicy.MUST_SAVE if (str(op), k) in self.keep else CheckpointPolicy.PREFER_RECOMPUTE

    def contexts(self) -> tuple[ContextManager[object], ContextManager[object]]:
        return create_selective_checkpoint_contexts(self.decide)


@dataclass(frozen=True)
class OpPolicy:
    """Keep the outputs of these ops of each block, recompute every other op.

    >>> from torch.utils.checkpoint import checkpoint
    >>> keep = OpPolicy(frozenset({("aten.addmm.default", 0)}))
    >>> block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    >>> x = torch.randn(2, 4, requires_grad=True)
    >>> y = checkpoint(block, x, use_reentrant=False, context_fn=keep.context_fn)  # one block per call
    """

    keep: frozenset[tuple[str, int]]
    name: str = ""

    def session(self) -> _Session:
        return _Session(self.keep)

    def context_fn(self) -> tuple[ContextManager[object], ContextManager[object]]:
        """``context_fn`` for ``torch.utils.checkpoint.checkpoint`` of one block (fresh counts)."""
        return self.session().contexts()

    def literal(self) -> str:
        return "{" + ", ".join(repr(k) for k in sorted(self.keep)) + "}"


# -- the block's ops -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockOp:
    key: tuple[str, int]  # (op overload, call index in the block)
    module: str  # path inside the block, "" for the block itself
    shape: tuple[int, ...]
    nbytes: int  # the output's bytes a kept op holds from the forward to the recompute
    flops: int  # what the recompute saves when it is kept
    why_not: str = ""  # why it cannot be kept ("" if it can)

    @property
    def label(self) -> str:
        op = self.key[0].split(".")[1] if self.key[0].count(".") >= 2 else self.key[0]
        return f"{self.module + ' ' if self.module else ''}{op}#{self.key[1]}"


def _storage(arg: object) -> Optional[int]:  # a recorded argument
    if isinstance(arg, tuple) and len(arg) == 2 and isinstance(arg[0], OpNode):
        node, i = arg
        positions = node.meta.get("positions")
        outs = node.meta.get("outputs", ())
        j = positions.index(i) if positions else i
        return outs[j][2] if j < len(outs) else None
    if isinstance(arg, OpNode):
        return arg.meta.get("storage")
    return None


def _storages(arg: object) -> list[int]:
    if isinstance(arg, (list, tuple)) and not (len(arg) == 2 and isinstance(arg[0], OpNode)):
        return [sid for x in arg for sid in _storages(x)]
    sid = _storage(arg)
    return [] if sid is None else [sid]


def _arguments(op: OpNode) -> dict[str, object]:
    schema = op.target._schema
    named = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    named.update({a.name: v for a, v in zip(schema.arguments, op.args)})
    named.update(op.kwargs)
    return named


def _written(op: OpNode) -> set[int]:
    """Storages an op changes in place."""
    out: set[int] = set()
    for a in op.target._schema.arguments:
        if a.alias_info is not None and a.alias_info.is_write:
            sid = _storage(_arguments(op).get(a.name))
            if sid is not None:
                out.add(sid)
    return out


def block_ops(step: StepGraph, prefix: str, block: int) -> list[BlockOp]:
    """The forward ops with FLOPs of block ``prefix + block``, each with what keeping it costs
    and saves, in the order they run."""
    here = f"{prefix}{block}"

    def inside(op: OpNode) -> bool:
        path = op.meta.get("module", "")
        return op.meta.get("phase") == "forward" and (path == here or path.startswith(here + "."))

    first = next((i for i, op in enumerate(step.ops) if inside(op)), None)
    if first is None:
        return []
    stop = next((i for i in range(first, step.num_ops) if not inside(step.ops[i])), step.num_ops)
    ops = [op for op in step.ops[first:stop] if isinstance(op.target, torch._ops.OpOverload)]  # its first run
    after = itertools.takewhile(lambda op: op.meta.get("phase") in ("forward", "loss"), step.ops[stop:])
    escapes = {sid for op in after for a in (*op.args, *op.kwargs.values()) for sid in _storages(a)}
    seen: collections.Counter[str] = collections.Counter()
    out: list[BlockOp] = []
    for i, op in enumerate(ops):
        if op.target in SAC_IGNORED_OPS:
            continue
        name = str(op.target)
        key = (name, seen[name])
        seen[name] += 1
        flops = op_flops(op)
        if flops == 0:
            continue
        sid = op.meta.get("storage")
        why = ""
        if op.target._schema.is_mutable:
            why = "in place"
        elif not op.meta.get("bytes"):
            why = "a view"
        elif torch.Tag.nondeterministic_seeded in op.target.tags and _arguments(op).get("dropout_p", 1) != 0:
            why = "random"
        elif any(sid in _written(nxt) for nxt in ops[i + 1:]):
            why = "changed in place later"
        elif sid in escapes:  # kept, it would live as long as the later use needs: pieces would not compose
            why = "used after the block"
        module = op.meta.get("module", "")[len(here) + 1:]
        out.append(BlockOp(key, module, tuple(op.meta.get("shape", ())), int(op.meta.get("bytes", 0)), flops, why))
    return out


@dataclass(frozen=True)
class Levels:
    """The selective levels of a chain: the representative block's ops and what each keeps."""

    block: str
    ops: tuple[BlockOp, ...]
    policies: tuple[OpPolicy, ...]

    def kept(self, policy: OpPolicy) -> tuple[int, int]:
        """(bytes kept, recompute FLOPs saved) per block by the knapsack's account."""
        ops = [o for o in self.ops if o.key in policy.keep]
        return sum(o.nbytes for o in ops), sum(o.flops for o in ops)

    def to_dict(self) -> dict[str, JSON]:
        return {"block": self.block,
                "ops": [{"op": o.key[0], "index": o.key[1], "module": o.module, "shape": list(o.shape),
                         "bytes": o.nbytes, "flops": o.flops, "keepable": not o.why_not,
                         **({"why_not": o.why_not} if o.why_not else {})} for o in self.ops],
                "levels": [{"name": p.name, "keep": [list(k) for k in sorted(p.keep)],
                            "bytes_per_block": self.kept(p)[0], "flops_saved_per_block": self.kept(p)[1]}
                           for p in self.policies]}


def choose_levels(step: StepGraph, prefix: str, block: int, count: int) -> Levels:
    ops = block_ops(step, prefix, block)
    items = [(o.nbytes, 0 if o.why_not else o.flops) for o in ops]
    sets = sel.levels(items, count)
    policies = tuple(OpPolicy(frozenset(ops[i].key for i in s), f"L{k}") for k, s in enumerate(sets, 1))
    return Levels(f"{prefix}{block}", tuple(ops), policies)


# -- plans ---------------------------------------------------------------------------------------------------
class SelectivePlanner(Planner):
    """Plans whose checkpointed segments each run plainly or under one of ``count`` selective
    levels, every level measured from captures like plain checkpointing."""

    def __init__(self, report: AnalysisView, plain: Planner, count: int = LEVELS) -> None:
        """``plain``: the report's plain planner, whose measured costs this one shares."""
        if count < 1:
            raise UsageError("the number of selective levels must be at least 1")
        super().__init__(report, (plain.costs, plain.depth))
        chain = find_chain(report.source.module)
        if chain is None or chain.path != self.costs.chain:
            raise PlanError(f"selective plans apply one op policy to every block of a chain of identical blocks; "
                            f"{self.costs.chain or 'the chain'} holds unlike blocks (graphmem plans it at full depth); "
                            "plan without selective")
        prefix = f"{chain.path}." if chain.path else ""
        self.levels = choose_levels(captured(report)[0], prefix, 1 if chain.length > 2 else 0, count)
        costs = [self.costs]
        for policy in self.levels.policies:
            try:
                level, _ = measure_chain(report, policy)
            except GraphmemError as e:
                raise PlanError(f"selective level {policy.name} (keeping {len(policy.keep)} ops per block) cannot be "
                                f"measured: {e}; plan without `selective`") from e
            costs.append(level)
        self.modes = sel.Modes(tuple(costs))
        self._problem = next((c.problem for c in costs if not c.exact), "")
        try:
            self.modes.check()
        except Exception as e:  # the levels do not compose: the program's plans are estimates, captures decide
            self._problem = self._problem or f"selective checkpointing: {e}"
        self.mode_tables = self.modes.tables()

    @property
    def exact(self) -> bool:
        return not self._problem

    @property
    def problem(self) -> str:
        return self._problem

    def _optimal(self, budget: int) -> Optional[Evaluated]:
        return sel.optimal(self.modes, budget, self.mode_tables)

    def minimum_peak(self) -> int:
        return sel.modal_minimum_peak(self.modes, self.mode_tables)

    def _frontier(self, points: int = 50) -> tuple[Evaluated, ...]:
        return tuple(sel.modal_frontier(self.modes, points, self.mode_tables))

    def _baselines(self) -> dict[str, Evaluated]:
        out = super()._baselines()
        for k, policy in enumerate(self.levels.policies, 2):
            out[f"every block, selective {policy.name}"] = sel.every_block(self.modes, k)
        return out

    def _policies(self, e: Evaluated) -> tuple[Optional[OpPolicy], ...]:
        pol = (None, *self.levels.policies)
        return tuple(pol[int(m) - 1] for _, _, m in e.segments if m)
