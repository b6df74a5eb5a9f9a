"""Report -> the predicted step as a PyTorch memory snapshot (``torch.cuda.memory._snapshot()``
format), for PyTorch's own viewers: drag the pickle onto https://pytorch.org/memory_viz, or run
``python -m torch.cuda._memory_viz trace_plot step.pickle -o step.html``.

What the snapshot says, and how it maps the prediction:

- ``device_traces[0]`` is what ``torch.cuda.memory._record_memory_history()`` would record if it
  were switched on just before the step: for every op, in order, an ``alloc`` for each storage
  the op makes, then ``free_requested`` + ``free_completed`` for each storage released after it.
- State that exists before the step (parameters, buffers, the batch) is *not* allocated in the
  trace, as in a real recording: what is still live at the end is an ``active_allocated`` block
  of the segment, what the step frees has a free without an alloc. The viewers draw both as
  allocated from the start. So the running sum of the trace peaks at
  ``report.peak_bytes - report.baseline_bytes``, and with the pre-existing state the viewer's
  maximum is ``report.peak_bytes``, exact to the byte (sizes are the exact storage sizes).
- Addresses are fake and deterministic: a bump allocator from ``BASE_ADDRESS`` in allocation
  order, each block rounded up to 512 B as the CUDA caching allocator does. Addresses are never
  reused, so the one segment's size is the sum of every block of the step, not a prediction of
  reserved memory.
- Frames are not Python frames: the first names the op (or the tensor made before the step) with
  its category, as ``forward:12:aten.addmm.default [activations]`` (phase, op index, op); the rest
  are the module path from the innermost module out, as ``block.fc:0:forward``.
"""
from __future__ import annotations

import pickle
from typing import TypedDict

from graphmem.render.plot import report_timeline
from graphmem.report import Report
from graphmem.report.live import Analysis
from graphmem.stepgraph import Storage

BASE_ADDRESS = 0x7F0000000000
ALIGN = 512  # the CUDA caching allocator's block granularity


class Frame(TypedDict):
    filename: str
    line: int
    name: str


class TraceEvent(TypedDict):
    """One entry of ``device_traces`` (torch/cuda/_memory_viz.py reads these keys)."""

    action: str  # alloc, free_requested, free_completed
    addr: int
    size: int
    stream: int
    frames: list[Frame]


class Block(TypedDict):
    address: int
    size: int
    requested_size: int
    state: str  # active_allocated, inactive
    frames: list[Frame]


class Segment(TypedDict):
    device: int
    address: int
    total_size: int
    stream: int
    segment_type: str
    segment_pool_id: tuple[int, int]
    is_expandable: bool
    allocated_size: int
    active_size: int
    requested_size: int
    frames: list[Frame]
    blocks: list[Block]


class Snapshot(TypedDict):
    """What ``torch.cuda.memory._snapshot()`` returns (the keys its viewer reads)."""

    segments: list[Segment]
    device_traces: list[list[TraceEvent]]


def _rounded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _frames(s: Storage, category: str, phase: str) -> list[Frame]:
    parts = s.module.split(".") if s.module else []
    modules = [".".join(parts[:i]) for i in range(len(parts), 0, -1)] + ["(model)"]  # innermost first
    op = Frame(filename=phase, line=max(s.created, 0), name=f"{s.name} [{category}]")
    return [op] + [Frame(filename=m, line=0, name="forward") for m in modules]


def memory_snapshot(report: Report) -> Snapshot:
    """The snapshot dict (``segments``, ``device_traces``) of the report's step.

    >>> import torch, graphmem
    >>> from graphmem.render.snapshot import memory_snapshot
    >>> net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    >>> snap = memory_snapshot(graphmem.analyze(net, (torch.randn(8, 16),)))
    >>> sorted(snap)
    ['device_traces', 'segments']
    """
    category_of = report_timeline(report, "to write a memory snapshot").category_of
    assert isinstance(report, Analysis)  # report_timeline checked
    g, lv = report.step, report.liveness
    # storages live during the step, in allocation order (before the step first); empty ones get no block
    order = sorted((g.storages[sid] for sid in lv.intervals if g.storages[sid].nbytes > 0),
                   key=lambda s: (s.created, s.sid))
    address: dict[int, int] = {}
    frames: dict[int, list[Frame]] = {}
    allocs: dict[int, list[Storage]] = {}
    frees: dict[int, list[Storage]] = {}
    top = BASE_ADDRESS
    for s in order:
        address[s.sid], top = top, top + _rounded(s.nbytes)
        frames[s.sid] = _frames(s, category_of[s.sid], g.phase_of(s.created))
        if s.created >= 0:
            allocs.setdefault(s.created, []).append(s)
        if s.freed is not None:
            frees.setdefault(s.freed, []).append(s)

    def event(action: str, s: Storage) -> TraceEvent:
        return {"action": action, "addr": address[s.sid], "size": s.nbytes, "stream": 0, "frames": frames[s.sid]}

    trace: list[TraceEvent] = []
    for i in range(g.num_ops):
        trace += [event("alloc", s) for s in allocs.get(i, ())]
        for s in frees.get(i, ()):
            trace += [event("free_requested", s), event("free_completed", s)]
    return {"segments": _segments(order, address, frames, top), "device_traces": [trace]}


def _segments(order: list[Storage], address: dict[int, int], frames: dict[int, list[Frame]],
              top: int) -> list[Segment]:
    """One segment holding every block; what is live at the end of the step is allocated."""
    if top == BASE_ADDRESS:
        return []
    blocks: list[Block] = []
    for s in order:
        size = _rounded(s.nbytes)
        if s.freed is None:
            blocks.append({"address": address[s.sid], "size": size, "requested_size": s.nbytes,
                           "state": "active_allocated", "frames": frames[s.sid]})
        elif blocks and blocks[-1]["state"] == "inactive":
            blocks[-1]["size"] += size
        else:
            blocks.append({"address": address[s.sid], "size": size, "requested_size": 0,
                           "state": "inactive", "frames": []})
    allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    return [{"device": 0, "address": BASE_ADDRESS, "total_size": top - BASE_ADDRESS, "stream": 0,
             "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
             "allocated_size": allocated, "active_size": allocated,
             "requested_size": sum(b["requested_size"] for b in blocks),
             "frames": [], "blocks": blocks}]


def snapshot_bytes(report: Report) -> bytes:
    """The pickle of :func:`memory_snapshot`, as ``torch.cuda.memory._dump_snapshot`` writes it.
    Protocol 4: the browser viewer's unpickler reads protocols 2 to 4."""
    return pickle.dumps(memory_snapshot(report), protocol=4)
