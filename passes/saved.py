"""The saved-for-backward set: which storages autograd keeps from the forward pass (and loss)
for backward, deduplicated by storage, with categories, module attribution and lifetimes.

activation_bytes = bytes of the distinct storages saved during forward and loss, not counting
the model's parameters and buffers (a view counts as its base storage; under FSDP2 the unsharded
parameters it all-gathers are parameters too: graphmem/distributed/fsdp.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from graphmem.stepgraph import StepGraph, Storage

CATEGORIES = ("activation", "input", "autocast copy", "workspace", "other")


@dataclass(frozen=True)
class SavedTensor:
    sid: int
    op: str  # the op that created the storage ("input" for the batch)
    module: str  # module path of the creating op ("" = the root); for the batch: the first saver
    shape: tuple[int, ...]  # of the storage's creating tensor
    dtype: str
    bytes: int
    category: str
    created: int  # forward op index that allocated it (-1: existed before the step)
    released: int | None  # backward op index after which autograd released it; None: never
    saved_by: tuple[str, ...]  # grad_fn names that saved it


@dataclass(frozen=True)
class ModuleSaved:
    path: str
    activation_bytes: int  # this module and its children
    self_bytes: int  # created by ops directly in this module
    count: int  # saved storages in the subtree


@dataclass(frozen=True)
class SavedSet:
    tensors: tuple[SavedTensor, ...]  # largest first
    activation_bytes: int
    by_category: dict[str, int]
    modules: tuple[ModuleSaved, ...]  # named_modules() order, root first
    parameter_bytes_saved: int  # parameters/buffers autograd saved (not counted above)


def _category(s: Storage, storages: dict[int, Storage]) -> str:
    if s.kind == "input":
        return "input"
    if s.source is not None and storages[s.source].kind in ("parameter", "buffer"):
        return "autocast copy"  # a forward cast of a weight (what autocast caches and saves)
    if s.kind in ("activation", "communication"):  # (a collective's output saved for backward is an activation)
        return "activation"
    if s.kind == "workspace":
        return "workspace"  # a kernel's workspace it keeps for backward (oneDNN LSTM; graphmem/oprules/rnn.py)
    return "other"


def _parents(path: str) -> list[str]:
    parts = path.split(".") if path else []
    return [""] + [".".join(parts[: i + 1]) for i in range(len(parts))]


def saved(g: StepGraph) -> SavedSet:
    first: dict[int, int] = {}  # sid -> index of its first save event
    released: dict[int, int | None] = {}
    saved_by: dict[int, list[str]] = {}
    for i, e in enumerate(g.saves):
        if e.phase not in ("forward", "loss"):  # double backward; earlier micro-steps save the same again
            continue
        first.setdefault(e.sid, i)
        prev = released.get(e.sid, -1)
        released[e.sid] = None if prev is None or e.released_at is None else max(prev, e.released_at)
        if e.grad_fn and e.grad_fn not in saved_by.setdefault(e.sid, []):
            saved_by[e.sid].append(e.grad_fn)
    tensors = []
    param_bytes = 0
    for sid, i in first.items():
        s = g.storages[sid]
        if s.kind in ("parameter", "buffer", "gathered parameter"):  # (FSDP2's unsharded parameter: a parameter)
            param_bytes += s.nbytes
            continue
        made_by_op = s.created >= 0
        tensors.append(SavedTensor(
            sid, s.name if made_by_op else s.kind, s.module if made_by_op else g.saves[i].module,
            s.shape, s.dtype, s.nbytes, _category(s, g.storages), s.created, released[sid],
            tuple(saved_by.get(sid, ()))))
    tensors.sort(key=lambda t: (-t.bytes, t.created, t.sid))
    by_category = {c: 0 for c in CATEGORIES}
    subtree: dict[str, int] = {}
    own: dict[str, int] = {}
    count: dict[str, int] = {}
    for t in tensors:
        by_category[t.category] += t.bytes
        own[t.module] = own.get(t.module, 0) + t.bytes
        for p in _parents(t.module):
            subtree[p] = subtree.get(p, 0) + t.bytes
            count[p] = count.get(p, 0) + 1
    paths = list(dict.fromkeys([*g.modules, *sorted(subtree)]))
    modules = tuple(ModuleSaved(p, subtree.get(p, 0), own.get(p, 0), count.get(p, 0)) for p in paths)
    return SavedSet(tuple(tensors), sum(t.bytes for t in tensors), by_category, modules, param_bytes)
