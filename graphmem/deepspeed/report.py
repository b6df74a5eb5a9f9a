"""The report's lines for a DeepSpeed rank: what the engine holds before and after the step, by where
DeepSpeed keeps it (its ZeRO optimizer's attributes: graphmem/deepspeed/capture.py names them), the
flat partitions' padding, and the buffers the step makes (reduce buckets), at their largest."""
from __future__ import annotations

import re

from graphmem.deepspeed.config import DeepSpeedJob
from graphmem.passes.liveness import Liveness
from graphmem.stepgraph import StepGraph
from graphmem.units import fmt_bytes


def origin(name: str) -> str:
    """A held tensor's origin without its indices: ``optimizer.bit16_groups_flat[0]`` ->
    ``optimizer.bit16_groups_flat``; a parameter's own name stays."""
    return re.sub(r"\[[^\]]*\]", "", name)


def held_by_origin(g: StepGraph) -> dict[str, int]:
    """Bytes held before the step, by origin (largest first)."""
    out: dict[str, int] = {}
    for s in g.storages.values():
        if s.created < 0 and s.kind != "input":
            out[origin(s.name)] = out.get(origin(s.name), 0) + s.nbytes
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def made_in_step(g: StepGraph, kind: str) -> dict[str, int]:
    """Storages of ``kind`` the step makes, by origin: their bytes."""
    out: dict[str, int] = {}
    for s in g.storages.values():
        if s.created >= 0 and s.kind == kind:
            out[origin(s.name)] = out.get(origin(s.name), 0) + s.nbytes
    return out


def engine_lines(g: StepGraph, lv: Liveness, job: DeepSpeedJob) -> tuple[str, ...]:
    """The lines of the module docstring."""
    held = held_by_origin(g)
    lines = [f"DeepSpeed holds before the step {fmt_bytes(lv.baseline_bytes)} (with the batch): "
             + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in held.items()),
             f"held after the step: {fmt_bytes(lv.end_bytes)}"]
    comm = made_in_step(g, "communication")
    if comm:
        lines.append("buffers DeepSpeed makes in the step (communication buffers row): "
                     + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in comm.items()))
    return tuple(lines)


__all__ = ["engine_lines", "held_by_origin", "made_in_step", "origin"]
