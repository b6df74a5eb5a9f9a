"""Selective activation checkpointing's kept tensors, seen by the saved-tensor hooks like any save.

Under a selective policy (``torch.utils.checkpoint.create_selective_checkpoint_contexts``; torchtitan's
``SelectiveAC``, graphmem's own plans) the checkpointed forward keeps the outputs of the ops the policy
saves in a cache of its own until backward's recompute takes them back
(torch/utils/checkpoint.py ``_CachingTorchDispatchMode`` and ``_CachedTorchDispatchMode``): memory
held from forward to backward for backward, an activation like what autograd saves. That cache
passes through the saved-tensor hooks around the checkpoint only when ``checkpoint`` is called with
``respect_saved_tensors_hooks=True``; its default (None) bypasses them (with a FutureWarning: the
default is to flip), so the hooks that count saves, graphmem's recorder's and the real runs' that
check it, missed every tensor SAC keeps (torchtitan's llama3 8B: 24.5 GiB of ``aten.mm`` outputs
counted as temporaries).

``install(recording)`` makes the default mean True while a step is recorded (the fake mode of type
``recording`` is current) and inside ``through_hooks()`` (a real run that counts saves); an explicit
True or False is kept as given. Known limitations: told False, the kept tensors pass the hooks by,
in the capture as in a real step, and are not counted as saved (the peak holds them all the same);
hooks of the model's own inside the step (a ``save_on_cpu`` around a selectively checkpointed
block, with the default) then see SAC's cache as the default will have them see it, not as torch
2.14 bypasses them.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, TypedDict

import torch

_ATTRIBUTE = "respect_saved_tensors_hooks"  # set by torch.utils.checkpoint.checkpoint on its caching mode
_GIVEN = "_graphmem_respect_given"


class _State(TypedDict):
    recording: Optional[type]  # the recorder's fake mode type
    through: int  # ``through_hooks`` contexts open


_STATE: _State = {"recording": None, "through": 0}


class _Respect:
    """The caching mode's ``respect_saved_tensors_hooks``: as given, its default None read as True
    while saves are counted."""

    def __get__(self, obj: Optional[object], owner: Optional[type] = None) -> _Respect | Optional[bool]:
        if obj is None:
            return self
        given: Optional[bool] = obj.__dict__.get(_GIVEN)
        return True if given is None and _counting() else given

    def __set__(self, obj: object, value: Optional[bool]) -> None:
        obj.__dict__[_GIVEN] = value


def _counting() -> bool:
    if _STATE["through"]:
        return True
    recording = _STATE["recording"]
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    return recording is not None and isinstance(mode, recording)


def install(recording: Optional[type]) -> None:
    """Once per process: SAC's default reads True under a fake mode of type ``recording`` (the
    recorder's, graphmem/capture/__init__.py installs it; None: keep the type known) and inside
    ``through_hooks``; a no-op where this torch has no such option."""
    from torch.utils import checkpoint

    caching = getattr(checkpoint, "_CachingTorchDispatchMode", None)
    if caching is None or _ATTRIBUTE not in caching.__init__.__code__.co_names:
        return
    _STATE["recording"] = recording or _STATE["recording"]
    if not isinstance(vars(caching).get(_ATTRIBUTE), _Respect):
        setattr(caching, _ATTRIBUTE, _Respect())


@contextlib.contextmanager
def through_hooks() -> Iterator[None]:
    """A real step's SAC cache through the hooks that count its saves (graphmem/validation/)."""
    install(None)
    _STATE["through"] += 1
    try:
        yield
    finally:
        _STATE["through"] -= 1


__all__ = ["install", "through_hooks"]
