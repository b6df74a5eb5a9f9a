"""Capture a deep model once per kind of block: record the step with the chain of identical
blocks cut to 5, then write the other blocks' ops, storages and save events by copying a
middle block's (renumbered, renamed, re-linked to its neighbours).

Why it is exact, and how that is checked every time: identical blocks run the same ops on the
same shapes, so block i's forward and backward are block 2's with the names and the links to
the neighbouring blocks shifted (the first two and last two blocks, which touch what is around
the chain, are their own). That premise is tested on the model itself before the copy is
trusted: the step is also captured with 6 blocks, and the 5-block capture widened to 6 must
equal it op for op, storage for storage, save for save (indices, sizes, lifetimes, module
paths). Blocks must also hold the same settings (no per-block index that changes what they
do: ``blocks_alike``). If anything differs, or the chain does not run block by block, graphmem
captures the whole depth as usual. Compiled mode (torch.compile's step) also compares the
compiled graphs (their count, graph breaks, the forward ops recomputed in backward, per
module) and checks that the partitioner's depth-dependent choices at a memory budget between 0
and 1 come out the same at full depth (graphmem/capture/partition_record.py); ``Reused.why``
says why reuse was not taken. Rank r's step through FSDP2 / DTensor (graphmem/distributed/capture.py)
is reused the same way: its collectives' process groups compare by size and rank. What no check short of a full capture can see: a parent
whose loop treats some later block differently (``if i == 40: ...``); ``analyze(reuse=False)``
or ``--no-reuse`` captures every block.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
import torch.nn as nn

from graphmem.capture.call_paths import module_order
from graphmem.capture.partition_record import not_periodic
from graphmem.capture.widen import NotReusable, widen
from graphmem.chains import Chain, find_chain, truncated
from graphmem.stepgraph import OpNode, StepGraph

DEPTH = 5  # blocks captured: the first, the second, a middle one (the template), the last two
MIN_LENGTH = 16  # shorter chains are captured whole (9 blocks captured would not pay)


def signature(g: StepGraph) -> tuple:
    """Everything the passes read, with storages named by creation order (not by id)."""
    order = {s.sid: n for n, s in enumerate(sorted(g.storages.values(), key=lambda s: (s.created, s.freed if s.freed is not None else 1 << 60, s.kind, s.name, s.module, s.nbytes)))}

    def ref(a: Any) -> Any:
        if isinstance(a, OpNode):
            return ("p", a.target) if a.op == "placeholder" else a.meta["index"]
        if isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], OpNode):
            return (ref(a[0]), a[1])
        if isinstance(a, list):
            return [ref(x) for x in a]
        if isinstance(a, torch.ScriptObject):  # a collective's process group (or reduce op), by what it is
            return _script_object(a)
        return a

    ops = tuple((str(op.target), op.meta["phase"], op.meta["module"], op.meta["bytes"], op.meta.get("recompute", False),
                 tuple((s, str(d), order[x]) for s, d, x in op.meta["outputs"]), repr(tuple(ref(a) for a in op.args)),
                 repr({k: ref(v) for k, v in op.kwargs.items()})) for op in g.ops)
    storages = tuple(sorted((order[s.sid], s.nbytes, s.kind, s.created, s.freed if s.freed is not None else -2, s.module,
                             s.name, s.dtype, s.shape, order.get(s.source, -1) if s.source is not None else -1,
                             order.get(s.owner, -1) if s.owner is not None else -1, s.cache_freed, s.stream, s.host)
                            for s in g.storages.values()))
    saves = tuple(sorted((order[e.sid], e.packed_at, e.released_at if e.released_at is not None else -2, e.module,
                          e.phase, e.shape, e.dtype, e.grad_fn) for e in g.saves))
    return (ops, storages, saves, tuple(sorted(g.phase_start.items())), tuple(sorted(order[x] for x in g.gradients)),
            tuple(sorted(g.module_inputs.items())), tuple(sorted(p.target for p in g.placeholders)))


def _script_object(a: torch.ScriptObject) -> tuple:
    """A c10d process group as its size and this rank's place in it (the widened graph keeps the
    short capture's group objects, the check's capture has its own); other script objects by type."""
    kind = a._type().qualified_name()
    if kind.endswith("c10d.ProcessGroup"):
        import torch.distributed as dist

        pg = dist.ProcessGroup.unbox(a)
        return kind, pg.size(), pg.rank()
    return (kind,)


_MODULE_STATE = {"_parameters", "_buffers", "_modules", "training", "_non_persistent_buffers_set"}
# transformers' index of a layer's KV cache entry, read only when a cache is passed
# (transformers/models/llama/modeling_llama.py LlamaAttention.forward, gpt2/modeling_gpt2.py
# GPT2Attention.forward); what a layer index changes in what a block computes is kept in other
# attributes (GPT-2's ``scaling``, a sliding window), which must still be equal
_CACHE_INDEX = {"layer_idx"}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
    if isinstance(a, dict) and isinstance(b, dict):  # hook tables and the like: same keys, alike values
        return len(a) == len(b) and all(type(x) is type(y) for x, y in zip(a.values(), b.values()))
    try:
        return bool(a == b)
    except Exception:
        return False


def blocks_alike(model: nn.Module, chain: Chain, ignore: frozenset[str] = frozenset()) -> bool:
    """Every block of the chain holds the same settings as block 1 (a block that knows its
    own index, e.g. a ``layer_id`` that changes what it does, is not copied); attributes named in
    ``ignore`` are not compared."""
    blocks = list(model.get_submodule(chain.path).children()) if chain.path else list(model.children())
    first = list(blocks[1].named_modules())
    for blk in blocks[1:]:
        mods = list(blk.named_modules())
        if [n for n, _ in mods] != [n for n, _ in first]:
            return False
        for (_, a), (_, b) in zip(first, mods):
            va = {k: v for k, v in vars(a).items() if k not in _MODULE_STATE and k not in _CACHE_INDEX and k not in ignore}
            vb = {k: v for k, v in vars(b).items() if k not in _MODULE_STATE and k not in _CACHE_INDEX and k not in ignore}
            if type(a) is not type(b) or va.keys() != vb.keys() or not all(_same(va[k], vb[k]) for k in va):
                return False
    return True


def reuses(train: Any) -> bool:
    """Whether depth reuse covers ``train``'s loop (graphmem/training/loop.py ``TrainStep``; None: no
    loop): graphmem's own loop of one micro-batch, its optimizer step included (each block's
    parameters' ops copied with the block, the foreach ops over every parameter widened:
    graphmem/capture/widen_optim.py). Not micro-batches (the blocks run once per micro-step), an
    optimizer stepped inside backward or activations offloaded by saved-tensor hooks."""
    if train is None:
        return True
    return train.external is None and train.micro_batches == 1 and not train.optimizer_in_backward \
        and not train.offload_activations


class Reused(NamedTuple):
    graph: StepGraph
    used: bool  # widened from the capture at depth 5
    why: str = ""  # why not, where the chain was long enough to try


def capture_reusing(model: nn.Module, capture_at: Callable[[], StepGraph]) -> Reused:
    """The step at full depth: widened from 5 blocks when the check passes, else captured."""
    chain = find_chain(model)
    if chain is None or chain.length < MIN_LENGTH or not blocks_alike(model, chain):
        return Reused(capture_at(), False)
    modules = module_order(model)
    try:
        with truncated(model, chain, DEPTH):
            small = capture_at()
        with truncated(model, chain, DEPTH + 1):
            check = capture_at()
        names_check = [name for name, _ in named_at(model, chain, DEPTH + 1)]
        widened = widen(small, chain, DEPTH, DEPTH + 1, names_check)
        if signature(widened) != signature(check):
            raise NotReusable("the widened graph differs from the capture")
        if compiled_signature(widened) != compiled_signature(check):
            raise NotReusable("the compiled graphs differ (the partition is not the same in every block)")
        if small.compiled is not None and check.compiled is not None:
            why = not_periodic(small.compiled.partitions, check.compiled.partitions, DEPTH, chain.length)
            if why is not None:
                raise NotReusable(why)
        g = widen(small, chain, DEPTH, chain.length, modules)
        per_block = {key: check.attention_backends.get(key, 0) - small.attention_backends.get(key, 0)
                     for key in set(check.attention_backends) | set(small.attention_backends)}
        g.attention_backends = {key: small.attention_backends.get(key, 0) + (chain.length - DEPTH) * v
                                for key, v in per_block.items() if small.attention_backends.get(key, 0) + (chain.length - DEPTH) * v}
        return Reused(g, True)
    except NotReusable as e:
        return Reused(capture_at(), False, str(e))


def compiled_signature(g: StepGraph) -> tuple:
    """Compiled mode: the graphs' counts, dynamo's graph breaks and the forward ops each backward
    graph recomputes, by module path (a widened step's stand for every block's)."""
    c = g.compiled
    if c is None:
        return ()
    redo = sorted((str(n.target), path) for cg in c.backward for n in cg.graph.graph.nodes
                  if n.op == "call_function" and n.meta.get("partitioner_tag") == "is_forward"
                  for path in c.paths(cg.modules.get(n, "")))
    return len(c.forward), len(c.backward), c.graph_breaks, tuple(redo)


def named_at(model: nn.Module, chain: Chain, k: int) -> list[tuple[str, nn.Module]]:
    with truncated(model, chain, k):  # shared modules under each name, as module_order
        return list(model.named_modules(remove_duplicate=False))
