"""The CPU generator's states that torch.utils.checkpoint stashes: real memory fake tensors never see,
recorded into the step (graphmem/capture/recorder.py's recorder)."""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

import torch

if TYPE_CHECKING:
    from graphmem.capture.recorder import _Recorder


@contextlib.contextmanager
def rng_states(cap: "_Recorder", counted: bool) -> Iterator[None]:
    """torch.utils.checkpoint stashes the CPU generator's state (a real 5,056-byte uint8
    tensor, made without dispatch, so fake tensors never see it) per checkpointed call and
    copies it again around each recompute. On the CPU target that is step memory: record it.
    (On the CUDA target the stashed states live in host memory.)"""
    if not counted:
        yield
        return
    original = torch.get_rng_state

    def get_rng_state() -> torch.Tensor:
        t = original()
        if cap.recording and not cap.closed:  # allocated between the last op and the next
            cap.storage(t, "external", "cpu rng state", len(cap.ops), cap.module_now())
        return t

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = original
