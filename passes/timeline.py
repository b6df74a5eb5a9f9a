"""The memory timeline split by category: what the live bytes during each op are made of.

Categories (each storage belongs to exactly one, for its whole live interval):

- ``parameters``:  parameters and buffers (model state, live before the step)
- ``gradients``:   the final ``.grad`` tensors, from the backward op that makes each one
- ``optimizer``:   optimizer states and fp32 master copies (graphmem/training/loop.py)
- ``activations``: the storages saved for backward (what ``activation_bytes`` counts, the saved
  batch included), from the forward op that makes them to the backward op that frees them
- ``communication``: collective buffers of the distributed wrappers (graphmem/distributed/): FSDP2's
  all-gather buffers and the unsharded parameters copied out of them, reduce-scatter inputs
  and outputs (until the output becomes the sharded gradients)
- ``workspace``:   kernel scratch, live inside one op (graphmem/oprules/registry.py); a workspace the
  kernel returns and autograd saves (oneDNN LSTM) counts under ``activations``
- ``other``:       everything else: inputs that are not saved, temporaries, the output and the
  loss, intermediate gradients during backward

The categories add up to ``Liveness.timeline`` at every op, and during the last op before
backward the ``activations`` band equals ``activation_bytes`` (everything saved is still held).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Iterable

from graphmem.passes.liveness import Liveness
from graphmem.passes.saved import SavedTensor
from graphmem.stepgraph import StepGraph, Storage

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "communication", "workspace", "other")


@dataclass(frozen=True)
class CategoryTimeline:
    by_category: dict[str, tuple[int, ...]]  # category -> live bytes during each op (CATEGORIES order)
    category_of: dict[int, str]  # sid -> category, for every storage live during the step

    def at(self, index: int) -> dict[str, int]:
        """Live bytes of each category during op ``index``."""
        return {c: series[index] for c, series in self.by_category.items()}


def _category(s: Storage, saved_sids: set[int]) -> str:
    if s.kind in ("parameter", "buffer"):
        return "parameters"
    if s.kind == "gradient":
        return "gradients"
    if s.kind in ("optimizer state", "master"):
        return "optimizer"
    if s.sid in saved_sids:  # (a collective's output autograd saves, as sequence parallel's all-gather: an activation)
        return "activations"
    if s.kind in ("communication", "gathered parameter"):
        return "communication"
    if s.kind == "workspace":
        return "workspace"
    return "other"


def category_timeline(g: StepGraph, lv: Liveness, saved: Iterable[SavedTensor]) -> CategoryTimeline:
    """Split ``lv.timeline`` by category; ``saved`` is ``SavedSet.tensors`` (or ``Report.saved``)."""
    n = g.num_ops
    saved_sids = {t.sid for t in saved}
    diff = {c: [0] * (n + 1) for c in CATEGORIES}
    category_of: dict[int, str] = {}
    for sid, (start, stop) in lv.intervals.items():
        s = g.storages[sid]
        c = category_of[sid] = _category(s, saved_sids)
        diff[c][start] += s.nbytes
        diff[c][stop + 1] -= s.nbytes
    by_category = {c: tuple(accumulate(d[:n])) for c, d in diff.items()}  # running sums
    return CategoryTimeline(by_category, category_of)
