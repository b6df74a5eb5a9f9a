"""Liveness: the live interval of every storage, the memory timeline and the peak.

A storage is live during op i when ``created <= i <= freed`` (``freed`` is the op after which
it was released; storages alive when the step ends stay live to the last op; storages that
existed before the step are live from op 0). Live bytes during op i is the sum over those
storages, which counts op i's inputs, its outputs and everything still held for later.
"""
from __future__ import annotations

from dataclasses import dataclass

from graphmem.errors import PassError
from graphmem.stepgraph import StepGraph


@dataclass(frozen=True)
class LiveTensor:
    sid: int
    nbytes: int
    kind: str
    name: str
    module: str
    shape: tuple[int, ...]
    dtype: str
    created: int
    freed: int | None


@dataclass(frozen=True)
class Liveness:
    intervals: dict[int, tuple[int, int]]  # sid -> (first op live, last op live), inclusive
    timeline: tuple[int, ...]  # live bytes during each op
    baseline_bytes: int  # live before the first op (parameters, buffers, inputs)
    end_bytes: int  # live when the step ends
    peak_bytes: int
    peak_index: int  # op index of the peak; -1 if nothing in the step exceeds the baseline
    peak_phase: str
    live_at_peak: tuple[LiveTensor, ...]  # largest first


def liveness(g: StepGraph) -> Liveness:
    n = g.num_ops
    diff = [0] * (n + 1)
    intervals: dict[int, tuple[int, int]] = {}
    baseline = end = 0
    for s in g.storages.values():
        start = max(s.created, 0)
        stop = n - 1 if s.freed is None else s.freed
        if s.created < 0 and (s.freed is None or s.freed >= 0 or n == 0):
            baseline += s.nbytes
        if s.freed is None:
            end += s.nbytes
        if stop < start:  # freed before any op ran
            continue
        intervals[s.sid] = (start, stop)
        diff[start] += s.nbytes
        diff[stop + 1] -= s.nbytes
    timeline = []
    live = 0
    for i in range(n):
        live += diff[i]
        if live < 0:
            raise PassError(f"liveness: negative live bytes at op {i} ({g.ops[i].name})")
        timeline.append(live)
    peak_index = max(range(n), key=timeline.__getitem__, default=-1)
    peak = timeline[peak_index] if n else baseline
    if peak <= baseline:
        peak, peak_index = baseline, -1
    at = max(peak_index, 0)
    live_at_peak = tuple(sorted(
        (LiveTensor(s.sid, s.nbytes, s.kind, s.name, s.module, s.shape, s.dtype, s.created, s.freed)
         for s in g.storages.values()
         if s.sid in intervals and intervals[s.sid][0] <= at <= intervals[s.sid][1]
         and (peak_index >= 0 or s.created < 0)),
        key=lambda t: (-t.nbytes, t.sid)))
    return Liveness(intervals, tuple(timeline), baseline, end, peak, peak_index,
                    g.phase_of(peak_index), live_at_peak)
