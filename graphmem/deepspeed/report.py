"""The report's lines for a DeepSpeed rank: what the engine holds before and after the step, by where
DeepSpeed keeps it (its ZeRO optimizer's attributes: graphmem/deepspeed/capture.py names them), the
flat partitions' padding, and the buffers the step makes (reduce buckets), at their largest.

``zero_paper``: the ZeRO paper's model states per rank (Rajbhandari et al., "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", SC20, section 5 and Figure 1: with Ψ parameters over N_d
ranks, mixed-precision Adam holds 2Ψ of 16-bit parameters, 2Ψ of 16-bit gradients and KΨ of optimizer
states, K = 12: the fp32 master copy 4Ψ, momentum 4Ψ, variance 4Ψ; stage 1 splits the optimizer states
over N_d, stage 2 the gradients too, stage 3 the parameters too) beside what DeepSpeed's engine holds, as a
cross-check, not the answer. With fp32 training the parameters and gradients are 4Ψ each, and DeepSpeed keeps
an fp32 partition besides its fp32 parameters (the paper's fp32 case has none)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

import torch.nn as nn

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


@dataclass(frozen=True)
class PaperRow:
    """One model state per rank: the paper's bytes, what DeepSpeed's engine holds, and why they may differ."""

    name: str
    paper: int
    engine: int
    why: str  # what the difference is, when there is one

    @property
    def difference(self) -> int:
        return self.engine - self.paper


# where DeepSpeed keeps each state of rank r (its ZeRO optimizers' attributes; stage 1 and 2:
# deepspeed/runtime/zero/stage_1_and_2.py, stage 3: deepspeed/runtime/zero/stage3.py)
_PARAMETERS = ("optimizer.bit16_groups_flat", "optimizer.lp_param_buffer")
_MASTER = ("optimizer.single_partition_of_fp32_groups", "optimizer.fp32_partitioned_groups_flat")
# DeepSpeed pads what it partitions: stage 1 and 2 pad each group's flat buffer to a multiple of 2 N_d elements
# (stage_1_and_2.py: nccl_start_alignment_factor 2 x the world size, "aligned_numel"), stage 3 each parameter to
# a multiple of N_d elements (partition_parameters.py ``_padding_size``)
_PADDING = "DeepSpeed's alignment padding"


def zero_paper(psi: int, job: DeepSpeedJob, held: dict[str, int], states: int) -> tuple[PaperRow, ...]:
    """The paper's model states of one rank (``psi`` parameters, all trained, Adam) beside the engine's:
    ``held`` the bytes held before the step by origin (``held_by_origin``), ``states`` the optimizer
    states' bytes after the first step (momentum, variance and step counters: the budget's row)."""
    n, stage = job.world_size, job.stage
    e = 2 if job.config.get("bf16", {}).get("enabled") is True else 4  # the engine's parameter and gradient dtype
    master = "fp32 master partition (4Ψ/N_d)" if e == 2 else "fp32 partition (kept by DeepSpeed in fp32 training too)"
    return (PaperRow(f"{e * 8}-bit parameters ({e}Ψ{'/N_d' if stage == 3 else ''})",
                     e * psi // n if stage == 3 else e * psi, sum(held.get(k, 0) for k in _PARAMETERS), _PADDING),
            PaperRow(master, 4 * psi // n if e == 2 else 0, sum(held.get(k, 0) for k in _MASTER),
                     _PADDING if e == 2 else "none in the paper's fp32 accounting"),
            PaperRow("Adam momentum and variance (8Ψ/N_d)", 8 * psi // n, states,
                     "the step counters (4 B a parameter group) and " + _PADDING))


def paper_check(module: nn.Module, job: DeepSpeedJob, g: StepGraph, optimizer: Optional[str], rows: Any
                ) -> tuple[str, ...]:
    """The report's cross-check line for rank r's step ``g`` (``rows``: its budget's rows), where the paper's
    accounting applies: Adam over every parameter of ``module`` under ZeRO 1-3; else none."""
    params = list(module.parameters())
    if job.stage == 0 or optimizer not in ("adam", "adamw") or not all(q.requires_grad for q in params):
        return ()
    states = next((r.size for r in rows if r.name == "optimizer states"), 0)
    return paper_lines(zero_paper(sum(q.numel() for q in params), job, held_by_origin(g), states))


def paper_lines(rows: tuple[PaperRow, ...]) -> tuple[str, ...]:
    """One line: each state as the paper's bytes and the engine's, the difference named."""
    def one(r: PaperRow) -> str:
        gap = "" if r.difference == 0 else \
            f" ({'+' if r.difference > 0 else '-'}{fmt_bytes(abs(r.difference))}: {r.why})"
        return f"{r.name}: paper {fmt_bytes(r.paper)}, DeepSpeed {fmt_bytes(r.engine)}{gap}"
    return ("the ZeRO paper's model states per rank beside DeepSpeed's engine (a cross-check): "
            + "; ".join(one(r) for r in rows),)


__all__ = ["PaperRow", "engine_lines", "held_by_origin", "made_in_step", "origin", "paper_check", "paper_lines",
           "zero_paper"]
