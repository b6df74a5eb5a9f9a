"""Why rank r's real step peaks above the per-rank formula: the gap, cause by cause.

The formula (passes/budget.py: ZeRO/FSDP sharding and Korthikanti's tensor/sequence-parallel
split over the single-device step) and the rank's own step (graphmem/distributed/capture.py, the
real wrappers) each have a peak. This pass sorts the tensors live at the rank's peak into causes
and sets each beside what the formula counts for the same cause at its peak (its budget rows);
the differences add up to the gap exactly (the formula's per-row rounding up goes to "other").

Causes (``GapCause.key``):

- ``parameters``: the local shards (and buffers). FSDP2 pads dim 0 of every parameter to a multiple
  of the data-parallel size (torch/distributed/fsdp/_fully_shard/_fsdp_param.py,
  ``_init_sharded_param``); the formula divides exactly.
- ``gradients``: the sharded gradients made so far.
- ``optimizer states``: the optimizer's states (and fp32 masters), the rank's shards.
- ``gathered``: the unsharded parameters FSDP2 copied out of its all-gathers; the formula counts
  the root unit, the running unit and, in backward, the prefetched one.
- ``all-gather buffers``: FSDP2's flat all-gather buffers (``fsdp.all_gather_copy_in``) still
  live, e.g. the next unit's, prefetched while this one runs; the formula counts none.
- ``reduce-scatter buffers``: reduce-scatter inputs (``fsdp.chunk_cat``) FSDP2 keeps until the
  next reduce-scatter, and outputs not yet gradients; the formula counts none.
- ``unsharded gradients``: gradients FSDP2 holds whole until their unit's reduce-scatter (its
  post-backward packs them all with ``fsdp.chunk_cat``; the root's wait for the end of backward);
  the formula counts a gradient whole only during the op that makes it.
- ``redistribute outputs``: what DTensor's all-gathers brought in (and the rest of its collectives'
  outputs) that nothing saved, e.g. the logits gathered whole when no loss parallel is used.
- ``activations``: what autograd holds. ``sp_gathered`` says how much of it is sequence
  parallel's all-gathered block inputs, which DTensor's linears save whole, where the formula
  (Megatron-LM's sequence parallel) keeps them split over t and gathers them again in backward.
- ``workspace``: kernel scratch live at the peak (gloo's collective temporaries on the CPU target).
- ``other``: temporaries, inputs, the loss.

Each communication storage is assigned the unit whose parameters feed the op that fills it (an
all-gather buffer is made by the unit that issues the all-gather, which for a prefetch is the
unit before), else the unit of the module that made it.

Known limitations: the two peaks may fall at different points of the step (each side is taken
at its own peak, so a cause's difference can be negative); the formula's gathered parameters
are one number, not split by unit.
"""
from __future__ import annotations

from dataclasses import dataclass

from graphmem.jsontypes import JSON
from graphmem.passes.budget import Budget, later_steps_peak_at
from graphmem.passes.liveness import Liveness
from graphmem.passes.saved import SavedSet
from graphmem.stepgraph import StepGraph, Storage, arg_sids

_ALL_GATHER = "all-gather buffer"
_RS_INPUT = "reduce-scatter input"
_RS_OUTPUT = "reduce-scatter output"
_GATHERED = "all-gather output (unsharded parameter)"
_FUNCTIONAL_GATHER = "all_gather_into_tensor output"
_CHUNK_CAT = "fsdp.chunk_cat.default"  # packs a unit's gradients into the reduce-scatter input


@dataclass(frozen=True)
class GapCause:
    key: str
    real: int  # bytes of this cause live at the rank's peak
    formula: int  # bytes the formula counts for it at its peak
    why: str  # one line: what the wrappers hold that the formula does not (or less)
    units: tuple[tuple[str, str, int], ...] = ()  # (unit, role, bytes): FSDP2's buffers by unit; role: running,
    # prefetched (the next to run), previous (the one before), root or kept
    largest: tuple[tuple[str, str, int], ...] = ()  # (what made it, module, bytes): the cause's 3 largest tensors

    @property
    def delta(self) -> int:
        return self.real - self.formula


@dataclass(frozen=True)
class RankGap:
    real_peak: int
    formula_peak: int
    peak_unit: str  # the unit running at the rank's peak ("" the root)
    causes: tuple[GapCause, ...]
    sp_gathered: int  # of the activations at the peak: sequence parallel's all-gathered inputs, saved whole

    @property
    def gap(self) -> int:
        return self.real_peak - self.formula_peak

    def to_dict(self) -> dict[str, JSON]:
        return {"gap_bytes": self.gap, "peak_unit": self.peak_unit, "sp_gathered_bytes": self.sp_gathered,
                "causes": [{"cause": c.key, "real_bytes": c.real, "formula_bytes": c.formula, "delta_bytes": c.delta,
                            "why": c.why, "units": [{"unit": u, "role": r, "bytes": b} for u, r, b in c.units],
                            "largest": [{"name": n, "module": m, "bytes": b} for n, m, b in c.largest]}
                           for c in self.causes]}


def unit_of(path: str, units: tuple[str, ...]) -> str:
    """The FSDP unit (a block of the chain) holding module or parameter ``path``; "" the root."""
    for u in units:
        if path == u or path.startswith(u + "."):
            return u
    return ""


def buffer_units(g: StepGraph, units: tuple[str, ...]) -> dict[int, str]:
    """Communication storage id -> the unit it belongs to (see the module docstring)."""
    param_unit = {s.sid: unit_of(s.name, units) for s in g.storages.values() if s.kind == "parameter"}
    comm = {s.sid for s in g.storages.values() if s.kind in ("communication", "gathered parameter")}
    out: dict[int, str] = {}
    for op in g.ops:
        sids = arg_sids(op) + [x for _, _, x in op.meta.get("outputs", ())]
        mine = [x for x in sids if x in comm]
        if not mine:
            continue
        known = {param_unit[x] for x in sids if x in param_unit} or {out[x] for x in mine if x in out}
        if len(known) == 1:
            u = known.pop()
            for x in mine:
                out.setdefault(x, u)
    for sid in comm:
        out.setdefault(sid, unit_of(g.storages[sid].module, units))
    return out


def _role(unit: str, running: str, backward: bool, units: tuple[str, ...]) -> str:
    if unit == running:
        return "running"
    if not unit:
        return "root"
    if running in units and unit in units:
        step = -1 if backward else 1
        if units.index(unit) == units.index(running) + step:
            return "prefetched"
        if units.index(unit) == units.index(running) - step:
            return "previous"
    return "kept"


def rank_gap(g: StepGraph, lv: Liveness, sv: SavedSet, formula: Budget, units: tuple[str, ...],
             later: bool = False) -> RankGap:
    """Rank r's peak (``g``, ``lv``, ``sv``) against ``formula`` (passes/budget.py over the
    single-device step), cause by cause; ``units``: the FSDP units' module paths. ``later``: the
    peak of every step after the first on both sides, where the optimizer states the traced step
    makes live from the start (passes/later_steps.py ``later_steps_peak``)."""
    saved_sids = {t.sid for t in sv.tensors}
    real_peak, index = later_steps_peak_at(g, lv) if later else (lv.peak_bytes, lv.peak_index)
    live = _later_live(g, lv, index) if later else [t.sid for t in lv.live_at_peak]
    running = unit_of(g.ops[index].meta.get("module", ""), units) if index >= 0 else ""
    backward = g.phase_of(index) == "backward"
    owners = buffer_units(g, units)
    pending = {x for op in g.ops if str(op.target) == _CHUNK_CAT for x in arg_sids(op)}
    gathered = _gathered_by_dtensor(g)
    real: dict[str, int] = {}
    by_unit: dict[tuple[str, str], int] = {}
    largest: dict[str, list[tuple[str, str, int]]] = {}
    sp = 0
    for sid in live:  # (largest first)
        s = g.storages[sid]
        key = _cause(s, sid in saved_sids, pending, gathered)
        real[key] = real.get(key, 0) + s.nbytes
        if len(largest.setdefault(key, [])) < 3:
            largest[key].append((s.name, s.module, s.nbytes))
        if key == "activations" and sid in gathered:
            sp += s.nbytes
        if key in ("gathered", "all-gather buffers", "reduce-scatter buffers"):
            u = owners.get(sid, "")
            by_unit[(key, u)] = by_unit.get((key, u), 0) + s.nbytes
    rows = dict(formula.later_at_peak) if later else {r.name: r.at_peak for r in formula.rows}
    peak = formula.later_peak_bytes if later else formula.peak_bytes
    counted = {"parameters": rows.get("parameters", 0) + rows.get("buffers", 0), "gradients": rows.get("gradients", 0),
               "gathered": rows.get("gathered parameters", 0), "activations": rows.get("activations", 0),
               "optimizer states": rows.get("optimizer states", 0) + rows.get("master copies", 0)}
    counted["other"] = peak - sum(counted.values())  # temporaries, and every row's rounding up
    causes = []
    for key in ("parameters", "gradients", "optimizer states", "gathered", "all-gather buffers",
                "reduce-scatter buffers", "unsharded gradients", "redistribute outputs", "activations", "workspace",
                "other"):
        r, f = real.get(key, 0), counted.get(key, 0)
        if not r and not f:
            continue
        roles = tuple(sorted(((u or "the root", _role(u, running, backward, units), b)
                              for (k, u), b in by_unit.items() if k == key), key=lambda x: -x[2]))
        causes.append(GapCause(key, r, f, _why(key, r - f, sp), roles, tuple(largest.get(key, ()))))
    return RankGap(real_peak, peak, running, tuple(causes), sp)


def _later_live(g: StepGraph, lv: Liveness, index: int) -> list[int]:
    """The storages a later step holds at op ``index`` (passes/later_steps.py ``later_steps_peak_at``):
    the traced step's live ones, and the optimizer states it makes after that op, which a later
    step holds from its start; largest first."""
    live = [t.sid for t in lv.live_at_peak] if index < 0 else \
        [sid for sid, (a, b) in lv.intervals.items() if a <= index <= b]
    live += [s.sid for s in g.storages.values() if s.kind == "optimizer state" and index < s.created]
    return sorted(live, key=lambda sid: (-g.storages[sid].nbytes, sid))


def _gathered_by_dtensor(g: StepGraph) -> set[int]:
    """Storages holding what DTensor's all-gathers brought in: the functional all-gather's output,
    and the cat of its chunks (gathering along a dim other than 0 cats the chunks of the gathered
    buffer: torch/distributed/_functional_collectives.py, ``all_gather_tensor``)."""
    out = {s.sid for s in g.storages.values() if s.name.startswith(_FUNCTIONAL_GATHER)}
    for op in g.ops:
        args = arg_sids(op)
        if str(op.target) == "aten.cat.default" and args and all(x in out for x in args):
            out.update(x for _, _, x in op.meta.get("outputs", ()))
    return out


def _cause(s: Storage, saved: bool, pending: set[int], gathered: set[int]) -> str:
    if s.kind in ("parameter", "buffer"):
        return "parameters"
    if s.kind == "gradient":
        return "gradients"
    if s.kind in ("optimizer state", "master"):
        return "optimizer states"
    if saved:
        return "activations"
    if s.sid in pending and s.kind not in ("communication", "gathered parameter"):
        return "unsharded gradients"
    if s.kind == "gathered parameter":
        return "gathered"
    if s.sid in gathered:
        return "redistribute outputs"
    if s.kind == "workspace":
        return "workspace"
    if s.kind == "communication":
        if s.name.startswith(_ALL_GATHER):
            return "all-gather buffers"
        if s.name.startswith((_RS_INPUT, _RS_OUTPUT)):
            return "reduce-scatter buffers"
        return "redistribute outputs"
    return "other"


def _why(key: str, delta: int, sp: int) -> str:
    if key == "parameters":
        if delta > 0:
            return "FSDP2 pads dim 0 of each parameter to a multiple of the data-parallel size"
        return "the wrappers shard weights the formula keeps whole (e.g. a vocabulary-parallel embedding)" if delta else ""
    if key == "gradients" and delta < 0:
        return "FSDP2 makes a unit's sharded gradients at its reduce-scatter, the formula as each is computed"
    if key == "workspace":
        return "kernel scratch live at the peak: on the CPU target, gloo's collective temporaries (the formula counts none)"
    if key == "gathered":
        return "unsharded parameters copied out of the all-gathers (the formula: root, running and prefetched unit)"
    if key == "all-gather buffers":
        return "flat all-gather buffers in flight or not yet freed, e.g. the next unit's prefetch (the formula counts none)"
    if key == "reduce-scatter buffers":
        return "reduce-scatter inputs kept until the next reduce-scatter, outputs not yet gradients (the formula counts none)"
    if key == "unsharded gradients":
        return ("gradients held whole until their unit's reduce-scatter (FSDP2's post-backward; the root's at the "
                "end of backward); the formula counts each whole only while it is made")
    if key == "redistribute outputs":
        return "DTensor's collective outputs live at the peak (the formula counts none)"
    if key == "activations" and sp:
        return ("sequence parallel: DTensor's linears save their all-gathered (whole-sequence) inputs, where the "
                "formula keeps them split over t and gathers them again in backward")
    return ""
