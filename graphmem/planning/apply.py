"""Apply a checkpoint plan to a module: real ``torch.utils.checkpoint`` (non-reentrant) segments.

A segment ``(a, b)`` of a block chain (``model.<chain>[a..b]``) runs as one checkpointed
function: the forward keeps only the segment's input, backward runs blocks a..b forward again
and then their backward. The blocks are not wrapped or renamed: the first block's ``forward``
is replaced (on the instance) by one that checkpoints blocks a..b, and blocks a+1..b pass
their input through when the parent calls them, so ``state_dict`` keys, parameters, hooks and
optimizers are untouched and ``remove()`` restores the module exactly.

Segments longer than one block assume what chains of blocks do: the parent calls the blocks in
order, each on the previous one's output with the same extra arguments
(``x = block(x, *args)``), and uses only the last output.

A segment may run under a selective policy (graphmem/planning/selective.py ``OpPolicy``): anything with
``session()`` returning an object with ``block()`` (called before each block of the segment)
and ``contexts()`` (the ``context_fn`` of ``torch.utils.checkpoint``: a fresh pair from
``create_selective_checkpoint_contexts``), made once per checkpointed call.
"""
from __future__ import annotations

import contextlib
import inspect
import threading
import types
from typing import Any, Callable, ContextManager, Hashable, Optional, Protocol, Sequence, TypedDict, cast

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from graphmem.capture.recompute import recompute_scope
from graphmem.errors import UsageError

_STATE = threading.local()


class SegmentSession(Protocol):
    """One checkpointed call of a segment under a selective policy (selective.py ``_Session``)."""

    def block(self) -> None:
        """Called before each block of the segment."""
        ...

    def contexts(self) -> tuple[ContextManager[object], ContextManager[object]]:
        """``checkpoint``'s ``context_fn``: a fresh pair from ``create_selective_checkpoint_contexts``."""
        ...


class SegmentPolicy(Protocol):
    """A segment's selective policy (selective.py ``OpPolicy``): a session per checkpointed call."""

    def session(self) -> SegmentSession: ...


class PlanPolicy(SegmentPolicy, Protocol):
    """A segment's selective policy as a plan names and writes it (graphmem.planning.OpPolicy)."""

    @property
    def name(self) -> str: ...

    def literal(self) -> str:
        """The kept ops as a Python set literal."""
        ...


def _inside() -> bool:
    return getattr(_STATE, "depth", 0) > 0


class Applied:
    """What ``apply_segments`` changed; ``remove()`` undoes it."""

    def __init__(self, blocks: list[nn.Module], switched: Optional[list[nn.Module]] = None) -> None:
        self._blocks = blocks
        self._switched = switched or []  # blocks whose transformers checkpointing was turned off

    def remove(self) -> None:
        for blk in self._blocks:
            if "forward" in vars(blk) and getattr(blk.forward, "_graphmem_checkpoint", False):
                del blk.forward
                vars(blk).pop(_SEGMENT, None)
                vars(blk).pop(_ORIGINAL, None)
        for blk in self._switched:
            blk.gradient_checkpointing = True  # type: ignore[assignment]  # a flag, not a submodule
        self._blocks, self._switched = [], []

    def __enter__(self) -> "Applied":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class _Respect(TypedDict, total=False):
    respect_saved_tensors_hooks: bool


# SAC's cached tensors go through the saved-tensor hooks around the step (graphmem's capture,
# measure_saved) like any saved tensor, where this torch has the opt-in (older ones bypass them)
_RESPECT: _Respect = ({"respect_saved_tensors_hooks": True}
                      if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters else {})


def _runner(blocks: list[nn.Module], session: Optional[SegmentSession]) -> Callable[..., object]:
    def run(x: object, *args: object, **kwargs: object) -> object:  # x: the chain's activation
        _STATE.depth = getattr(_STATE, "depth", 0) + 1
        scope = recompute_scope()
        try:
            with scope() if scope is not None else contextlib.nullcontext():
                for blk in blocks:  # through __call__: hooks fire, module paths stay right
                    if session is not None:
                        session.block()  # the policy counts op calls per block
                    x = blk(x, *args, **kwargs)
            return x
        finally:
            _STATE.depth -= 1
    return run


# arguments through which a block writes into a key/value cache (Hugging Face's ``Cache``): a
# checkpointed block gets None / False, as transformers' own gradient checkpointing gives it,
# because its recompute would write into the cache a second time (longer keys than the mask).
# transformers 5.24 renamed the blocks' ``past_key_values`` to ``cache`` (deprecate_kwarg in
# transformers/models/gpt2/modeling_gpt2.py); a plain ``cache`` argument is taken only when it holds a Cache.
_CACHE_ARGS = {"past_key_values": None, "past_key_value": None, "layer_past": None, "cache": None, "use_cache": False}


def _writes_cache(name: str, value: object) -> bool:
    if value is None or value is False:
        return False
    return name != "cache" or hasattr(value, "get_seq_length")  # transformers' Cache classes


def _without_cache(forward: Callable[..., object], args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """``args`` / ``kwargs`` of a call of ``forward`` (after its first argument) with the cache
    arguments that hold something replaced by ``_CACHE_ARGS``; unchanged if there are none.
    (``kwargs`` are the block's own, of any type: they go on through ``checkpoint``'s ``**kwargs``.)"""
    try:
        sig = inspect.signature(forward)
    except (TypeError, ValueError):
        return args, kwargs
    if not set(_CACHE_ARGS) & set(sig.parameters):
        return args, kwargs
    try:
        bound = sig.bind(None, *args, **kwargs)
    except TypeError:
        return args, kwargs
    changed = False
    for name, value in _CACHE_ARGS.items():
        if _writes_cache(name, bound.arguments.get(name)):
            bound.arguments[name] = value
            changed = True
    if not changed:
        return args, kwargs
    return tuple(bound.args[1:]), dict(bound.kwargs)


# A patched block finds its segment's blocks and their forwards through its own attributes, not a closure: a
# deepcopy of the model (an optimizer's copy, an EMA model, graphmem.validate's real step) then runs its own
# blocks (the copy's attributes point at the copied blocks and at forwards bound to them), not the original's.
_SEGMENT, _ORIGINAL = "_graphmem_segment", "_graphmem_original"


def _segment_forward(policy: Optional[SegmentPolicy] = None) -> Callable[..., object]:
    def head(self: nn.Module, x: object, *args: object, **kwargs: Any) -> object:
        blocks, originals = vars(self)[_SEGMENT]
        if _inside():
            return originals[0](x, *args, **kwargs)
        args, kwargs = _without_cache(originals[0], args, kwargs)
        if policy is None:
            return checkpoint(_runner(blocks, None), x, *args, use_reentrant=False, **kwargs)
        session = policy.session()
        return checkpoint(_runner(blocks, session), x, *args, use_reentrant=False, context_fn=session.contexts,
                          **_RESPECT, **kwargs)

    head._graphmem_checkpoint = True  # type: ignore[attr-defined]
    return head


def _member_forward() -> Callable[..., object]:
    def member(self: nn.Module, x: object, *args: object, **kwargs: object) -> object:
        if _inside():
            return vars(self)[_ORIGINAL](x, *args, **kwargs)
        return x  # the segment's first block already ran this one, checkpointed

    member._graphmem_checkpoint = True  # type: ignore[attr-defined]
    return member


def chain_blocks(model: nn.Module, chain: str) -> list[tuple[str, nn.Module]]:
    """The blocks of ``chain`` with their paths: the children of a ModuleList/Sequential, or of
    several run one after another, named with commas (``"layer1,layer2,layer3,layer4"``)."""
    out: list[tuple[str, nn.Module]] = []
    for holder in chain.split(","):
        try:
            m = model.get_submodule(holder)
        except AttributeError as e:
            raise UsageError(f"the model has no module {holder!r} to checkpoint") from e
        out += [(f"{holder}.{name}" if holder else name, child) for name, child in m.named_children()]
    return out


def apply_segments(model: nn.Module, chain: str, segments: Sequence[tuple[int, int]],
                   policies: Optional[Sequence[Optional[SegmentPolicy]]] = None) -> Applied:
    """Checkpoint ``model.<chain>[a..b]`` for each ``(a, b)`` in ``segments`` (inclusive;
    ``chain`` may name several holders run in order, see ``chain_blocks``, and a segment may
    span them); ``policies[i]`` (None: plain checkpointing) is segment i's selective policy."""
    policies = list(policies) if policies is not None else [None] * len(segments)
    if len(policies) != len(segments):
        raise UsageError(f"{len(policies)} policies for {len(segments)} segments: give one per segment (None: all recomputed)")
    blocks = [m for _, m in chain_blocks(model, chain)]
    used: set[int] = set()
    for a, b in segments:  # all checks first: a refused plan changes nothing
        if not (0 <= a <= b < len(blocks)):
            raise UsageError(f"segment {a}..{b} is outside {chain} (blocks 0..{len(blocks) - 1})")
        if used & set(range(a, b + 1)):
            raise UsageError(f"segment {a}..{b} overlaps another segment")
        used |= set(range(a, b + 1))
        if any(getattr(m.forward, "_graphmem_checkpoint", False) for m in blocks[a:b + 1]):
            raise UsageError(f"{chain}.{a} is already checkpointed by graphmem; remove() that plan first")
    # the plan replaces transformers' own checkpointing (gradient_checkpointing_enable()) of the
    # chain's layers; remove() turns it back on
    switched = [m for m in blocks if hf_checkpointed(m)]
    for m in switched:
        m.gradient_checkpointing = False  # type: ignore[assignment]
    changed: list[nn.Module] = []
    for (a, b), policy in zip(segments, policies):
        members = blocks[a:b + 1]
        originals = [m.forward for m in members]
        vars(members[0])[_SEGMENT] = (members, originals)  # plain attributes (nn.Module registers no submodule)
        members[0].forward = types.MethodType(_segment_forward(policy), members[0])
        for m, orig in zip(members[1:], originals[1:]):
            vars(m)[_ORIGINAL] = orig
            m.forward = types.MethodType(_member_forward(), m)
        changed.extend(members)
    return Applied(changed, switched)


def hf_checkpointed(block: nn.Module) -> bool:
    """Whether transformers' gradient checkpointing is on for this layer (a
    ``GradientCheckpointingLayer`` after ``model.gradient_checkpointing_enable()``)."""
    return vars(block).get("gradient_checkpointing") is True and hasattr(block, "_gradient_checkpointing_func")


def plan_units(n: int, segments: Sequence[tuple[int, int]],
               policies: Optional[Sequence[Optional[SegmentPolicy]]] = None) -> tuple[list[int], list[Hashable]]:
    """A chain of n blocks with ``segments`` checkpointed, as units (graphmem/capture/reuse_units.py): the
    blocks of each unit and its kind. A segment is one unit (its blocks run forward together and are
    recomputed together), of its length and policy; every other block is a unit of its own."""
    pols = list(policies) if policies is not None else [None] * len(segments)
    starts = {a: (b, p) for (a, b), p in zip(segments, pols)}
    sizes: list[int] = []
    kinds: list[Hashable] = []
    i = 0
    while i < n:
        if i not in starts:
            sizes.append(1)
            kinds.append("stored")
            i += 1
            continue
        b, p = starts[i]
        try:
            hash(p)
        except TypeError:  # (a policy that cannot be a key is its own kind)
            policy: Hashable = id(p)
        else:
            policy = cast(Hashable, p)
        sizes.append(b - i + 1)
        kinds.append(("checkpointed", b - i + 1, policy))
        i = b + 1
    return sizes, kinds
