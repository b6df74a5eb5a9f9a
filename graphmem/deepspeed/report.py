"""The report's lines for a DeepSpeed rank: what the engine holds before and after the step, by where
DeepSpeed keeps it (its ZeRO optimizer's attributes: graphmem/deepspeed/capture.py names them), the
flat partitions' padding, and the buffers the step makes (reduce buckets), at their largest; under CPU
offload the host (pinned) and host (pageable) bytes by owner (``host_bytes``); DeepSpeed's residual states in one
line (``residual``: flat partitions, reduce buckets and collective outputs, ZeRO-3's all-gathered parameters,
alignment padding, host bytes). They stay notes, not budget rows: the rows partition the peak by kind, and each of
these is inside one of them (the reduce buckets are the communication buffers row).

``zero_paper``: the ZeRO paper's model states per rank (Rajbhandari et al., "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", SC20, section 5 and Figure 1: with Ψ parameters over N_d
ranks, mixed-precision Adam holds 2Ψ of 16-bit parameters, 2Ψ of 16-bit gradients and KΨ of optimizer
states, K = 12: the fp32 master copy 4Ψ, momentum 4Ψ, variance 4Ψ; stage 1 splits the optimizer states
over N_d, stage 2 the gradients too, stage 3 the parameters too) beside what DeepSpeed's engine holds, as a
cross-check, not the answer. With fp32 training the parameters and gradients are 4Ψ each, and DeepSpeed keeps
an fp32 partition besides its fp32 parameters (the paper's fp32 case has none)."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Optional

import torch.nn as nn

from graphmem.deepspeed.config import DeepSpeedJob
from graphmem.deepspeed.engine import PAGEABLE, PINNED
from graphmem.passes.budget import COMMUNICATION, HOST, KIND_ROW, BudgetRow
from graphmem.passes.liveness import Liveness
from graphmem.stepgraph import StepGraph
from graphmem.units import fmt_bytes


def origin(name: str) -> str:
    """A held tensor's origin without its indices and its host placement: ``optimizer.bit16_groups_flat[0]``
    -> ``optimizer.bit16_groups_flat``; a parameter's own name stays."""
    for end in (PINNED, PAGEABLE):
        name = name[:-len(end)] if name.endswith(end) else name
    return re.sub(r"\[[^\]]*\]", "", name)


def held_by_origin(g: StepGraph, host: bool = False) -> dict[str, int]:
    """Bytes held before the step, by origin (largest first): the device's (the CUDA target's host bytes are
    ``host_lines``'), or with ``host`` the host's too."""
    out: dict[str, int] = {}
    for s in g.storages.values():
        if s.created < 0 and s.kind != "input" and (host or not s.host):
            out[origin(s.name)] = out.get(origin(s.name), 0) + s.nbytes + (s.host if host else 0)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def made_in_step(g: StepGraph, kind: str) -> dict[str, int]:
    """Storages of ``kind`` the step makes, by origin: their bytes."""
    out: dict[str, int] = {}
    for s in g.storages.values():
        if s.created >= 0 and s.kind == kind:
            out[origin(s.name)] = out.get(origin(s.name), 0) + s.nbytes
    return out


def with_own_notes(rows: tuple[BudgetRow, ...]) -> tuple[BudgetRow, ...]:
    """The budget's rows with the communication row's note saying what DeepSpeed's buffers are."""
    return tuple(dataclasses.replace(r, note="DeepSpeed's reduce buckets (ipg_buckets) and collective outputs, at the peak")
                 if r.name == COMMUNICATION else r for r in rows)


def engine_lines(g: StepGraph, lv: Liveness) -> tuple[str, ...]:
    """The lines of the module docstring."""
    held = held_by_origin(g)
    lines = [f"DeepSpeed holds before the step {fmt_bytes(lv.baseline_bytes)} (with the batch): "
             + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in held.items()),
             f"held after the step: {fmt_bytes(lv.end_bytes)}"]
    comm = made_in_step(g, "communication")
    if comm:
        lines.append("buffers DeepSpeed makes in the step (communication buffers row): "
                     + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in comm.items()))
    return tuple(lines) + host_lines(g, lv)


@dataclass(frozen=True)
class HostBytes:
    """What DeepSpeed keeps on the host under CPU offload (graphmem/deepspeed/engine.py ``host_tensors``:
    its offload device, pinned or pageable as DeepSpeed's ``pin_memory`` calls say), before and after the step."""

    before: tuple[int, int]  # (pinned, pageable) bytes held before the step
    after: tuple[int, int]  # (pinned, pageable) bytes held when the step ends
    owners: tuple[tuple[str, str, int], ...]  # (origin, "pinned" | "pageable", bytes) held when the step ends
    peak: Optional[int] = None  # the CUDA target: the most host bytes live at once (the CPU target: None, one memory)

    @property
    def total_after(self) -> int:
        return sum(self.after)


def host_bytes(g: StepGraph) -> HostBytes:
    """The host bytes of rank r's step ``g`` (its storages named by graphmem/deepspeed/engine.py ``name_host``; on
    the CUDA target, their bytes are ``Storage.host``: graphmem/deepspeed/host.py), and on the CUDA target the most
    host bytes live at once, the host temporaries of the optimizer's step included."""
    before, after = [0, 0], [0, 0]
    owners: dict[tuple[str, str], int] = {}
    for s in g.storages.values():
        where = 0 if s.name.endswith(PINNED) else 1 if s.name.endswith(PAGEABLE) else None
        if where is None:
            continue
        if s.created < 0:
            before[where] += s.host or s.nbytes
        if s.freed is None:
            after[where] += s.host or s.nbytes
            key = (origin(s.name), ("pinned", "pageable")[where])
            owners[key] = owners.get(key, 0) + (s.host or s.nbytes)
    return HostBytes((before[0], before[1]), (after[0], after[1]),
                     tuple((o, w, b) for (o, w), b in sorted(owners.items(), key=lambda kv: -kv[1])), _host_peak(g))


def _host_peak(g: StepGraph) -> Optional[int]:
    """The most bytes in host memory at once over the step, where the step's host storages are split from the
    device's (the CUDA target), else None (the CPU target: one memory, the report's own peak)."""
    host = [s for s in g.storages.values() if s.host]
    if not host:
        return None
    diff = [0] * (g.num_ops + 2)
    for s in host:
        diff[max(s.created, 0)] += s.host
        diff[(g.num_ops if s.freed is None else s.freed) + 1] -= s.host
    live = peak = 0
    for d in diff:
        live += d
        peak = max(peak, live)
    return peak


def host_lines(g: StepGraph, lv: Liveness) -> tuple[str, ...]:
    """One line where the job offloads to the CPU: host (pinned) and host (pageable) bytes before and after the
    step, their owners, and the rest (the accelerator's); on the CUDA target, outside the device's figures, with
    the host's own peak."""
    h = host_bytes(g)
    if not any(h.before + h.after):
        return ()
    owners = ", ".join(f"{o} {fmt_bytes(b)} ({w})" for o, w, b in h.owners)
    if h.peak is not None:
        return (f"host memory (DeepSpeed's CPU offload; outside the GPU's figures above): before the step host (pinned) "
                f"{fmt_bytes(h.before[0])}, host (pageable) {fmt_bytes(h.before[1])}; when it ends host (pinned) "
                f"{fmt_bytes(h.after[0])}, host (pageable) {fmt_bytes(h.after[1])}; at most "
                f"{fmt_bytes(h.peak)} at once (the optimizer's step on the host included); on the host: {owners}",)
    return (f"host memory (DeepSpeed's CPU offload; inside the figures above, which count the CPU's bytes alike): "
            f"before the step host (pinned) {fmt_bytes(h.before[0])}, host (pageable) {fmt_bytes(h.before[1])}, "
            f"the rest {fmt_bytes(lv.baseline_bytes - sum(h.before))} (with the batch); when it ends host (pinned) "
            f"{fmt_bytes(h.after[0])}, host (pageable) {fmt_bytes(h.after[1])}, the rest "
            f"{fmt_bytes(lv.end_bytes - h.total_after)}; on the host: {owners}",)


# DeepSpeed's flat partitions (stage_1_and_2.py: the 16-bit flat buffer and this rank's fp32 partition; stage3.py:
# the 16-bit partitions, on the host under offload_param, the fp32 partitions and the flat gradient partitions)
_FLAT = ("optimizer.bit16_groups_flat", "optimizer.single_partition_of_fp32_groups", "optimizer.lp_param_buffer",
         "optimizer.fp16_partitioned_groups_flat", "optimizer.param_groups_fp16_flat_cpu_memory",
         "optimizer.fp32_partitioned_groups_flat", "optimizer.grad_partitions_flat_buffer")


@dataclass(frozen=True)
class Residual:
    """DeepSpeed's residual states on rank r (what its engine keeps or makes beside the model states' tensors
    as the paper counts them): its flat partitions, its reduce buckets and collective outputs and ZeRO-3's
    all-gathered parameters (the most live at once, and at the peak), its alignment padding, its host bytes."""

    flat: tuple[tuple[str, int], ...]  # the flat partitions held when the step ends, by origin
    buckets: int  # kind "communication": the most bytes live at once
    buckets_at_peak: int
    gathered: int  # kind "gathered parameter" (ZeRO-3's all-gathered parameters, prefetched ones too)
    gathered_at_peak: int
    padding: tuple[tuple[str, int], ...]  # DeepSpeed's alignment padding on this rank (``padding``): (what, bytes)
    host: HostBytes


def most_live(g: StepGraph, lv: Liveness, kind: str) -> tuple[int, int]:
    """The most bytes of storages of ``kind`` live during any op of the step (or before it), and at the peak."""
    diff = [0] * (g.num_ops + 1)
    before = 0
    for sid, (a, b) in lv.intervals.items():
        s = g.storages[sid]
        if s.kind == kind:
            diff[a] += s.nbytes
            diff[b + 1] -= s.nbytes
            before += s.nbytes if s.created < 0 else 0
    live, most, at_peak = 0, before, 0
    for i in range(g.num_ops):
        live += diff[i]
        most = max(most, live)
        at_peak = live if i == lv.peak_index else at_peak
    return most, at_peak


def padding(module: nn.Module, job: DeepSpeedJob) -> tuple[tuple[str, int], ...]:
    """DeepSpeed's alignment padding on rank r, by its own rules, for one parameter group of every trained
    parameter of ``module``: stage 1 and 2 pad the group's flat buffer to a multiple of 2 N_d elements
    (deepspeed/runtime/zero/stage_1_and_2.py, ``nccl_start_alignment_factor`` 2 x the world size; every rank holds
    the whole 16-bit flat buffer) and the padding falls in the last partitions (``groups_padding``: this rank's part
    of it, which its fp32 partition holds too); stage 3 pads each parameter to a multiple of N_d on the last rank
    (partition_parameters.py ``_padding_size``; stage3.py ``groups_padding``: only ``rank == partition_count - 1``).
    (What, bytes) each: the 16-bit parameters' and the fp32 partition's."""
    numels = [p.numel() for p in module.parameters() if p.requires_grad]
    n, r, psi = job.world_size, job.rank, sum(numels)
    e = 2 if job.config.get("bf16", {}).get("enabled") is True else 4
    if job.stage in (1, 2):
        flat = -(-psi // (2 * n)) * 2 * n
        part = flat // n
        mine = part if psi <= r * part else max(0, (r + 1) * part - psi)  # stage_1_and_2.py's three cases
        return (("16-bit flat buffer", e * (flat - psi)), ("fp32 partition", 4 * mine))
    if job.stage == 3:
        mine = sum((n - k % n) % n for k in numels) if r == n - 1 else 0
        return (("16-bit partitions", e * mine), ("fp32 partitions", 4 * mine))
    return ()


def residual(g: StepGraph, lv: Liveness, module: nn.Module, job: DeepSpeedJob) -> Residual:
    """Rank r's residual states (``Residual``) in its step ``g`` of ``module``."""
    flat: dict[str, int] = {}
    for s in g.storages.values():
        if s.freed is None and origin(s.name) in _FLAT:  # (not the fp32 partitions' .grad)
            flat[origin(s.name)] = flat.get(origin(s.name), 0) + s.nbytes + s.host
    return Residual(tuple(flat.items()), *most_live(g, lv, "communication"), *most_live(g, lv, "gathered parameter"),
                    padding(module, job), host_bytes(g))


def _live_at(lv: Liveness, sid: int, index: int) -> bool:
    a, b = lv.intervals.get(sid, (1, 0))
    return a <= max(index, 0) <= b


def residual_rows(g: StepGraph, lv: Liveness, r: Residual) -> tuple[BudgetRow, ...]:
    """The budget's detail rows for DeepSpeed's residual states (``Budget.details``), each under the row whose bytes
    it details: each flat partition on the device under its kind's row, the alignment padding under the
    parameters' and master copies' rows, the reduce buckets under the communication buffers', ZeRO-3's all-gathered
    parameters under the temporaries', and the host bytes under host memory (the CUDA target: outside the GPU's
    figures; the CPU target: inside the rows, one memory). "size" is what is held when the step ends (the buckets and
    gathered parameters: the most live at once), "live at the peak" at the step's peak."""
    rows: list[BudgetRow] = []
    flat: dict[str, list[int]] = {}  # origin -> [kind row, bytes when the step ends, bytes at the peak]
    for s in g.storages.values():
        o = origin(s.name)
        if o in _FLAT and s.freed is None and s.nbytes:
            row = flat.setdefault(o, [KIND_ROW.get(s.kind, "buffers"), 0, 0])
            row[1] += s.nbytes
            row[2] += s.nbytes if _live_at(lv, s.sid, lv.peak_index) else 0
    rows += [BudgetRow(f"flat partition {o.removeprefix('optimizer.')}", b, at, "DeepSpeed's flat partition", within)
             for o, (within, b, at) in flat.items()]
    offloaded = {o for o, w, _ in r.host.owners}
    for what, b in r.padding:
        within = "master copies" if what.startswith("fp32") else "parameters"
        on_host = r.host.peak is not None and any(o in offloaded for o in _MASTER) and within == "master copies"
        rows.append(BudgetRow(f"alignment padding ({what})", b, 0 if on_host else b,
                              "DeepSpeed's alignment padding, by its own rules",
                              HOST if on_host else within))
    rows.append(BudgetRow("reduce buckets and collective outputs", r.buckets, r.buckets_at_peak,
                          "DeepSpeed's ipg buckets and collective outputs, the most live at once", COMMUNICATION))
    if r.gathered:
        rows.append(BudgetRow("all-gathered parameters", r.gathered, r.gathered_at_peak,
                              "ZeRO-3's gathered (and prefetched) parameters, the most live at once; in activations "
                              "where a layer saves its weight", "temporaries"))
    h = r.host
    if any(h.before + h.after):
        for i, where in enumerate(("pinned", "pageable")):
            at = sum(s.host or s.nbytes for s in g.storages.values() if s.name.endswith((PINNED, PAGEABLE)[i])
                     and _live_at(lv, s.sid, lv.peak_index))
            owners = ", ".join(f"{o} {fmt_bytes(b)}" for o, w, b in h.owners if w == where)
            rows.append(BudgetRow(f"host ({where})", h.after[i], at,
                                  ("outside the GPU's figures" if h.peak is not None else "inside the rows above (one "
                                   "memory on the CPU)") + (f": {owners}" if owners else ""), HOST))
        if h.peak is not None:
            rows.append(BudgetRow("host (at most at once)", h.peak, 0, "the host's own peak, the optimizer's step on "
                                  "the host included", HOST))
    return tuple(rows)


def residual_lines(r: Residual) -> tuple[str, ...]:
    """One line: the residual states, each by what DeepSpeed keeps it as."""
    parts = [f"flat partitions {fmt_bytes(sum(b for _, b in r.flat))} ("
             + ", ".join(f"{k} {fmt_bytes(b)}" for k, b in r.flat) + ")"] if r.flat else []
    parts.append(f"reduce buckets and collective outputs {fmt_bytes(r.buckets)} at most at once "
                 f"({fmt_bytes(r.buckets_at_peak)} at the peak)")
    if r.gathered:
        parts.append(f"all-gathered parameters (prefetched ones too) {fmt_bytes(r.gathered)} at most at once "
                     f"({fmt_bytes(r.gathered_at_peak)} at the peak)")
    if r.padding:
        parts.append("alignment padding " + ", ".join(f"{k} {fmt_bytes(b)}" for k, b in r.padding))
    if any(r.host.after):
        parts.append(f"host (pinned) {fmt_bytes(r.host.after[0])}, host (pageable) {fmt_bytes(r.host.after[1])} "
                     "when the step ends")
    return ("DeepSpeed's residual states on this rank (inside the rows above): " + "; ".join(parts),)


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


_ADAM = ("adam", "adamw", "adamw_torch", "adamw_torch_fused")  # graphmem's names, and a Trainer's torch AdamW's (optim)


def paper_check(module: nn.Module, job: DeepSpeedJob, g: StepGraph, optimizer: Optional[str],
                rows: tuple[BudgetRow, ...]) -> tuple[str, ...]:
    """The report's cross-check line for rank r's step ``g`` (``rows``: its budget's rows), where the paper's
    accounting applies: Adam over every parameter of ``module`` under ZeRO 1-3; else none."""
    params = list(module.parameters())
    if job.stage == 0 or optimizer not in _ADAM or not all(q.requires_grad for q in params):
        return ()
    states = next((r.size for r in rows if r.name == "optimizer states"), 0)  # (the device's)
    states += sum(s.host for s in g.storages.values() if s.kind == "optimizer state" and s.freed is None)
    return paper_lines(zero_paper(sum(q.numel() for q in params), job, held_by_origin(g, host=True), states))


def paper_lines(rows: tuple[PaperRow, ...]) -> tuple[str, ...]:
    """One line: each state as the paper's bytes and the engine's, the difference named."""
    def one(r: PaperRow) -> str:
        gap = "" if r.difference == 0 else \
            f" ({'+' if r.difference > 0 else '-'}{fmt_bytes(abs(r.difference))}: {r.why})"
        return f"{r.name}: paper {fmt_bytes(r.paper)}, DeepSpeed {fmt_bytes(r.engine)}{gap}"
    return ("the ZeRO paper's model states per rank beside DeepSpeed's engine (a cross-check): "
            + "; ".join(one(r) for r in rows),)


__all__ = ["HostBytes", "PaperRow", "Residual", "engine_lines", "host_bytes", "host_lines", "most_live", "padding", "residual", "residual_lines", "residual_rows", "with_own_notes", "held_by_origin", "made_in_step", "origin", "paper_check", "paper_lines",
           "zero_paper"]
