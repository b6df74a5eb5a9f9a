"""Eager vs compiled, side by side: saved bytes per module in both modes, and the forward ops
that AOTAutograd's min-cut partitioner recomputes in backward instead of saving.

``recomputed`` reads the compiled backward graphs: a backward node tagged ``is_forward`` by the
partitioner is a forward op it copied into backward (torch/_functorch/partitioners.py). Views
(outputs that alias an input's storage) and ``getitem`` cost nothing and are left out.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Protocol, Sequence

import torch
from torch.utils.flop_counter import flop_registry

from graphmem.jsontypes import JSON
from graphmem.passes.saved import SavedSet
from graphmem.stepgraph import StepGraph


@dataclass(frozen=True)
class Recomputed:
    op: str  # aten op, e.g. "aten.native_dropout.default"
    module: str  # module path of the forward op ("" = the root)
    shape: tuple[int, ...]  # of its (first) output
    dtype: str
    bytes: int  # bytes of its outputs
    flops: int = 0  # its FLOPs by torch.utils.flop_counter's formulas (0 for ops without one)


@dataclass(frozen=True)
class ModuleModes:
    path: str
    eager_bytes: int  # saved by this module and its children, eager
    compiled_bytes: int  # the same, compiled


@dataclass(frozen=True)
class ModeComparison:
    eager_bytes: int
    compiled_bytes: int
    modules: tuple[ModuleModes, ...]  # named_modules() order, root first
    recomputed: tuple[Recomputed, ...]  # largest first
    recomputed_bytes: int
    forward_graphs: int
    backward_graphs: int
    graph_breaks: tuple[str, ...]
    memory_budget: Optional[float] = None  # activation_memory_budget the partition ran with (None: torch's default)

    @property
    def recomputed_flops(self) -> int:
        return sum(r.flops for r in self.recomputed)

    def to_dict(self) -> dict[str, JSON]:
        """JSON-ready: exact integers."""
        return {
            "eager_activation_bytes": self.eager_bytes,
            "compiled_activation_bytes": self.compiled_bytes,
            "forward_graphs": self.forward_graphs,
            "backward_graphs": self.backward_graphs,
            "graph_breaks": list(self.graph_breaks),
            "modules": [{"path": m.path, "eager_bytes": m.eager_bytes, "compiled_bytes": m.compiled_bytes}
                        for m in self.modules],
            "memory_budget": self.memory_budget,
            "recomputed_bytes": self.recomputed_bytes,
            "recomputed_flops": self.recomputed_flops,
            "recomputed": [{"op": r.op, "module": r.module, "shape": list(r.shape), "dtype": r.dtype, "bytes": r.bytes,
                            "flops": r.flops} for r in self.recomputed],
        }


class _Graph(Protocol):
    """One compiled graph: graphmem/capture/compiled.py CompiledGraph."""

    @property
    def graph(self) -> torch.fx.GraphModule: ...

    @property
    def modules(self) -> dict[torch.fx.Node, str]: ...


class CompiledSteps(Protocol):
    """What ``recomputed`` reads of graphmem/capture/compiled.py CompiledGraphs (a StepGraph's ``compiled``)."""

    @property
    def backward(self) -> Sequence[_Graph]: ...

    def paths(self, path: str) -> Iterable[str]: ...


def _bytes(val: object) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(_bytes(v) for v in val)
    return 0


def _first(val: object) -> Optional[torch.Tensor]:
    if isinstance(val, (list, tuple)):
        return next((v for v in val if isinstance(v, torch.Tensor)), None)
    return val if isinstance(val, torch.Tensor) else None


def _is_view(n: torch.fx.Node) -> bool:
    """The op's output aliases an input: by its schema, or (``_unsafe_view``) by its storage."""
    schema = getattr(n.target, "_schema", None)
    if schema is not None and any(r.alias_info is not None for r in schema.returns):
        return True
    out = _first(n.meta.get("val"))
    if out is None:
        return False
    key = out.untyped_storage()._cdata
    return any(isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].untyped_storage()._cdata == key
               for a in n.all_input_nodes)


_aten = torch.ops.aten
# CPU kernels the flop counter has no entry for, counted by their CUDA twin's formula (as
# graphmem/planning/costs.py does for a recorded op)
_SAME_AS = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _aten._scaled_dot_product_flash_attention,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _aten._scaled_dot_product_flash_attention_backward,
}


def node_flops(n: torch.fx.Node) -> int:
    """FLOPs of one fx node by torch.utils.flop_counter's formulas, from its inputs' and output's
    fake values (``meta["val"]``); 0 when the op has no formula."""
    packet = getattr(n.target, "overloadpacket", None)
    formula = flop_registry.get(_SAME_AS.get(packet, packet))  # type: ignore[arg-type]
    if formula is None:
        return 0

    def val(a: Any) -> Any:
        if isinstance(a, (list, tuple)):
            return type(a)(val(x) for x in a)
        return a.meta.get("val") if hasattr(a, "meta") else a
    return int(formula(*val(n.args), **{k: val(v) for k, v in n.kwargs.items()}, out_val=n.meta.get("val")))


def recomputed(compiled: CompiledSteps) -> tuple[Recomputed, ...]:
    """Forward ops the partitioner placed in the backward graphs of ``compiled``
    (graphmem.capture.compiled.CompiledGraphs), largest output first."""
    out = []
    for g in compiled.backward:
        for n in g.graph.graph.nodes:
            if (n.op != "call_function" or n.meta.get("partitioner_tag") != "is_forward"
                    or n.target is operator.getitem or _is_view(n)):
                continue
            first = _first(n.meta.get("val"))
            flops = node_flops(n)
            for path in compiled.paths(g.modules.get(n, "")):  # a widened step: each block that copies it
                out.append(Recomputed(str(n.target), path, tuple(first.shape) if first is not None else (),
                                      str(first.dtype).replace("torch.", "") if first is not None else "",
                                      _bytes(n.meta.get("val")), flops))
    # largest first; ties by module path (block 2 before block 10) and op, so a widened step
    # (graphmem/capture/widen.py) lists them as the full capture does
    return tuple(sorted(out, key=lambda r: (-r.bytes, _path_key(r.module), r.op)))


def _path_key(path: str) -> tuple:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split("."))


def compare_modes(g: StepGraph, compiled: SavedSet, eager: SavedSet) -> ModeComparison:
    """``g`` and ``compiled``: the compiled-mode capture and its saved set; ``eager``: the saved
    set of the same step in eager mode."""
    if g.compiled is None:
        raise ValueError("compare_modes needs a compiled-mode StepGraph (Target(mode='compiled'))")
    eager_by = {m.path: m.activation_bytes for m in eager.modules}
    compiled_by = {m.path: m.activation_bytes for m in compiled.modules}
    paths = list(dict.fromkeys([*g.modules, *eager_by, *compiled_by]))
    modules = tuple(ModuleModes(p, eager_by.get(p, 0), compiled_by.get(p, 0)) for p in paths)
    redo = recomputed(g.compiled)
    return ModeComparison(eager.activation_bytes, compiled.activation_bytes, modules, redo,
                          sum(r.bytes for r in redo), len(g.compiled.forward), len(g.compiled.backward),
                          tuple(g.compiled.graph_breaks), g.target.memory_budget if g.target is not None else None)


__all__ = ["ModeComparison", "ModuleModes", "Recomputed", "compare_modes", "node_flops", "recomputed"]
