"""The StepGraph: one training step as a torch.fx.Graph plus autograd's save/release events.

Every recorded op is a ``call_function`` node whose ``meta`` holds:
``index`` (op index, 0-based, in the order eager autograd ran it), ``phase``
("forward", "loss", "backward"; with graphmem/training/loop.py also "accumulate" for earlier
micro-steps and "optimizer"), ``module`` (dotted module path, "" for the root),
``outputs`` (a tuple of ``(shape, dtype, storage id)`` per output tensor), ``shape`` and
``dtype`` (of the first output), ``storage`` (its storage id) and ``bytes`` (bytes of the
storages this op allocated). Tensors that exist before the step (parameters, buffers, the
batch) are placeholders. Views and in-place ops resolve to their base storage: they allocate
nothing and their outputs carry the base's storage id.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.fx as fx

from graphmem.errors import PassError

PHASES = ("accumulate", "forward", "loss", "backward", "optimizer")  # accumulate/optimizer: graphmem/training/loop.py


class OpNode:
    """One recorded op (or placeholder), cheap to make during capture; ``StepGraph.graph``
    turns them into torch.fx nodes with the same ``meta`` on first use. An argument that is
    a tensor refers to the OpNode that made it, or ``(OpNode, i)`` for output i of a
    multi-output op."""

    __slots__ = ("op", "target", "args", "kwargs", "meta", "name")

    def __init__(self, op: str, target: Any, args: tuple, kwargs: dict, name: str) -> None:
        self.op, self.target, self.args, self.kwargs, self.name = op, target, args, kwargs, name
        self.meta: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"OpNode({self.name}: {self.target})"


def arg_sids(op: OpNode) -> list[int]:
    """The storage of each tensor argument of ``op`` (lists flattened; -1 where an argument's storage is unknown)."""
    out: list[int] = []

    def walk(a: object) -> None:
        if isinstance(a, OpNode):
            out.append(a.meta["storage"] if "storage" in a.meta else -1)
        elif isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], OpNode):
            outs = a[0].meta.get("outputs", ())
            positions = a[0].meta.get("positions")
            i = positions.index(a[1]) if positions is not None and a[1] in positions else a[1]
            out.append(outs[i][2] if isinstance(i, int) and i < len(outs) else -1)
        elif isinstance(a, list):
            for x in a:
                walk(x)

    for a in (*op.args, *op.kwargs.values()):
        walk(a)
    return out


@dataclass
class Storage:
    """One storage (allocation) seen during the step."""

    sid: int
    nbytes: int
    kind: str  # "parameter" | "buffer" | "input" | "activation" (made by an op) | "external"
    created: int  # op index that allocated it; -1 if it existed before the step
    freed: Optional[int]  # dead after this op index; None if still alive when the step ends
    module: str  # module path of the creating op ("" for the root / before the step)
    name: str  # parameter/buffer/input name, or the creating op
    dtype: str
    shape: tuple[int, ...]
    source: Optional[int] = None  # for a copy (aten._to_copy) made in forward: the source storage
    owner: Optional[int] = None  # gradient / optimizer state / master copy: the parameter's storage id
    # a gradient storage several parameters' gradients are views of (FSDP2's flat reduce-scatter
    # output, graphmem/distributed/capture.py): all their storage ids (``owner`` is the first)
    owners: tuple[int, ...] = ()
    cache_freed: bool = False  # its last reference was autocast's cast cache, dropped when a context exited
    # the stream current when it was allocated: "default", or one of FSDP2's own (graphmem/distributed/
    # fsdp.py ``watching``); the CUDA caching allocator keeps each stream's free blocks apart (passes/allocator.py)
    stream: str = "default"
    # bytes it holds in the host's memory, not the device's (the CUDA target's offloaded tensors: DeepSpeed's CPU
    # offload, graphmem/deepspeed/host.py); ``nbytes`` is then 0, what it takes of the device
    host: int = 0


@dataclass
class SaveEvent:
    """Autograd saved a tensor (pack hook) and later released it."""

    sid: int
    packed_at: int  # index of the last op recorded when the pack hook ran
    released_at: Optional[int]  # index of the last op recorded when autograd released it
    module: str  # module active when it was saved
    phase: str
    shape: tuple[int, ...]
    dtype: str
    grad_fn: str = ""  # the backward node that used it (known once unpacked)


@dataclass
class StepGraph:
    placeholders: list[OpNode]  # parameters, buffers, inputs (and external tensors)
    ops: list[OpNode]  # recorded ops; index = op index
    storages: dict[int, Storage]
    saves: list[SaveEvent]
    phase_start: dict[str, int]  # first op index of each phase; "end" = number of ops
    device: str
    gradients: list[int] = field(default_factory=list)  # storage ids of the final .grad tensors
    root: str = ""  # class name of the model
    modules: list[str] = field(default_factory=list)  # module paths, named_modules() order
    module_inputs: dict[str, tuple[int, ...]] = field(default_factory=dict)  # first input's shape
    target: Any = None  # graphmem.capture.Target
    attention_backends: dict[str, int] = field(default_factory=dict)  # CUDA target: SDPA kernel -> calls
    compiled: Any = None  # compiled mode: graphmem.capture.compiled.CompiledGraphs (the forward/backward fx graphs)
    train: Any = None  # graphmem.training.loop.TrainStep when micro-batches / an optimizer step were traced
    micro_steps: tuple[tuple[int, int], ...] = ()  # (forward start, backward start) of each traced micro-step
    # ops [start, end) only the first step runs (a pipeline's metadata inference: graphmem/titan/pipeline.py);
    # later steps run without them, and keep what they made that outlives the step
    first_step_only: Optional[tuple[int, int]] = None

    _graph: Optional[fx.Graph] = field(default=None, repr=False, compare=False)

    @property
    def graph(self) -> fx.Graph:
        """The step as a torch.fx.Graph: placeholders, then every op in execution order (a
        multi-output op's outputs are ``operator.getitem`` nodes), each with the op's meta."""
        if self._graph is None:
            g = fx.Graph()
            made: dict[int, fx.Node] = {}
            items: dict[tuple[int, int], fx.Node] = {}

            def ref(a: Any) -> Any:
                if isinstance(a, OpNode):
                    return made[id(a)]
                if isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], OpNode):
                    key = (id(a[0]), a[1])
                    if key not in items:
                        items[key] = g.call_function(operator.getitem, (made[id(a[0])], a[1]))
                    return items[key]
                if isinstance(a, list):
                    return [ref(x) for x in a]
                return a

            for p in self.placeholders:
                made[id(p)] = g.placeholder(p.name)
                made[id(p)].meta.update(p.meta)
            for op in self.ops:
                node = g.create_node("call_function", op.target, tuple(ref(a) for a in op.args),
                                     {k: ref(v) for k, v in op.kwargs.items()})
                node.meta.update(op.meta)
                made[id(op)] = node
            self._graph = g
        return self._graph

    @property
    def num_ops(self) -> int:
        return len(self.ops)

    def phase_of(self, index: int) -> str:
        """The phase op ``index`` ran in, as the recorder named it (autograd's engine running it:
        backward, even inside the loss); from ``phase_start`` where an op has no phase of its own."""
        if index < 0:
            return "before"
        if index < self.num_ops and "phase" in self.ops[index].meta:
            return str(self.ops[index].meta["phase"])
        phase = "forward"
        for p in PHASES:
            if self.phase_start.get(p, self.num_ops) <= index:
                phase = p
        return phase

    def check(self) -> None:
        """Raise PassError if the graph and event tables disagree (tests call this)."""
        n = self.num_ops
        for i, node in enumerate(self.ops):
            if node.meta.get("index") != i:
                raise PassError(f"StepGraph.check: node {node.name} has index {node.meta.get('index')}, expected {i}")
            for _, _, sid in node.meta["outputs"]:
                if sid not in self.storages:
                    raise PassError(f"StepGraph.check: node {node.name} outputs unknown storage {sid}")
        for s in self.storages.values():
            if not -1 <= s.created < n:
                raise PassError(f"StepGraph.check: storage {s.sid} created at {s.created}, outside [-1, {n})")
            if s.freed is not None and not s.created <= s.freed < n:
                raise PassError(f"StepGraph.check: storage {s.sid} ({s.name}) freed at {s.freed} before created at {s.created}")
            if s.nbytes < 0:
                raise PassError(f"StepGraph.check: storage {s.sid} has negative size")
        for e in self.saves:
            if e.sid not in self.storages:
                raise PassError(f"StepGraph.check: save event of unknown storage {e.sid}")
            if e.released_at is not None and e.released_at < e.packed_at:
                raise PassError(f"StepGraph.check: storage {e.sid} released at {e.released_at} before saved at {e.packed_at}")
