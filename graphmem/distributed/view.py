"""What a per-rank report adds: which rank, which wrappers, the communication buffers live at its
peak, and the per-rank formula over the single-device step beside it (the cross-check), with the
difference split by cause (passes/rank_gap.py): what the wrappers hold that the formula does not see."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from graphmem.distributed.spec import Sharding
from graphmem.jsontypes import JSON
from graphmem.passes import Liveness
from graphmem.passes.budget import Budget, Parallel, budget, later_steps_peak
from graphmem.passes.rank_gap import RankGap, rank_gap
from graphmem.passes.saved import SavedSet
from graphmem.passes.timeline import category_timeline
from graphmem.stepgraph import StepGraph
from graphmem.units import fmt_bytes


@dataclass(frozen=True)
class RankView:
    sharding: Sharding
    communication_at_peak: tuple[tuple[str, str, int], ...]  # (unit module, buffer name, bytes) live at the peak
    communication_max: int  # the most communication bytes live during any op
    formula: Optional[Parallel]  # the formula's options (passes/budget.py), None if none applies
    formula_peak: Optional[int]  # its peak over the single-device step
    peak_bytes: int  # rank r's real peak (the report's)
    tp_engine: str = "parallelize_module"  # what split the layers (graphmem/distributed/tensor_parallel.py, tp_engine)
    # (parameter, its gradient's bytes, its local shard's bytes): gradients larger than their parameter's shard
    full_gradients: tuple[tuple[str, int, int], ...] = ()
    later_peak: Optional[int] = None  # with an optimizer step: rank r's peak of every later step (states from the start)
    formula_later: Optional[int] = None  # and the formula's
    breakdown: Optional[RankGap] = None  # the gap cause by cause (passes/rank_gap.py)
    later_breakdown: Optional[RankGap] = None  # the later steps' gap cause by cause (optimizer states from the start)

    @property
    def gap(self) -> Optional[int]:
        """Real peak minus the formula's: what the wrappers hold that the formula does not."""
        return None if self.formula_peak is None else self.peak_bytes - self.formula_peak

    def describe(self) -> str:
        s = self.sharding
        return f"rank {s.rank} of {s.world_size} ({self.wrappers()})"

    def wrappers(self) -> str:
        """What split the step: the tensor-parallel engine and fully_shard with its policies."""
        s = self.sharding
        wrappers = []
        if s.tp > 1:
            wrappers.append(f"{self.tp_engine} tp={s.tp}" + (" + sequence parallel" if s.sp else ""))
        if s.fsdp:
            mp = ", ".join(f"{k}={v}" for k, v in (("param_dtype", s.param_dtype), ("reduce_dtype", s.reduce_dtype)) if v)
            wrappers.append(f"fully_shard over {s.dp}, reshard_after_forward={s.reshard_after_forward}"
                            + (f", {mp}" if mp else "") + (", CPUOffloadPolicy" if s.offload else ""))
        return "; ".join(wrappers)

    def lines(self) -> tuple[str, ...]:
        out = [self.describe()]
        held = sum(b for _, _, b in self.communication_at_peak)
        if held:
            parts: dict[str, tuple[int, set[str]]] = {}
            for unit, name, b in self.communication_at_peak:
                key = name.split(" (")[0]
                total, units = parts.get(key, (0, set()))
                parts[key] = (total + b, units | {unit or "the root"})
            out.append(f"communication at the peak: {fmt_bytes(held)} (" + ", ".join(
                f"{k} of {', '.join(sorted(u)) if len(u) <= 2 else f'{len(u)} modules'}: {fmt_bytes(v)}"
                for k, (v, u) in sorted(parts.items(), key=lambda kv: -kv[1][0])) + ")")
        for name, grad, shard in self.full_gradients:
            out.append(f"gradient of {name}: {fmt_bytes(grad)} on this rank for a {fmt_bytes(shard)} shard (DTensor's "
                       "backward returns it unsharded, e.g. a vocabulary-parallel embedding's: +"
                       f"{fmt_bytes(grad - shard)})")
        if self.formula is not None and self.formula_peak is not None and self.gap is not None:
            sign = "+" if self.gap >= 0 else "-"
            out.append(f"formula cross-check ({self.formula.describe()}, passes/budget.py over the single-device "
                       f"step): peak {fmt_bytes(self.formula_peak)}; the wrappers' step: {sign}{fmt_bytes(abs(self.gap))}"
                       + (" (the buffers above: the formula counts no collective buffers and at most one gathered unit)"
                          if self.gap > 0 and held else "")
                       + (f"; later steps (optimizer states from the start): formula {fmt_bytes(self.formula_later)}, "
                          f"the wrappers' {_signed(self.later_peak - self.formula_later)}"
                          if self.later_peak is not None and self.formula_later is not None else ""))
        if self.breakdown is not None and self.gap:
            out += _cause_lines(self.breakdown)
        if self.later_breakdown is not None and self.later_breakdown.gap:
            out += _cause_lines(self.later_breakdown, "the later steps' gap")
        return tuple(out)

    def to_dict(self) -> dict[str, JSON]:
        return {**self.sharding.to_dict(),
                "communication_at_peak": [{"unit": u, "name": n, "bytes": b} for u, n, b in self.communication_at_peak],
                "communication_max_bytes": self.communication_max,
                "formula": self.formula.to_dict() if self.formula is not None else None,
                "formula_peak_bytes": self.formula_peak, "gap_bytes": self.gap,
                "full_gradients": [{"parameter": n, "bytes": g, "shard_bytes": p} for n, g, p in self.full_gradients],
                "later_peak_bytes": self.later_peak, "formula_later_peak_bytes": self.formula_later,
                "gap_by_cause": self.breakdown.to_dict() if self.breakdown is not None else None,
                "later_gap_by_cause": self.later_breakdown.to_dict() if self.later_breakdown is not None else None}


def _signed(n: int) -> str:
    return ("+" if n >= 0 else "-") + fmt_bytes(abs(n))


def _cause_lines(gap: RankGap, what: str = "the gap") -> tuple[str, ...]:
    """One line per cause that differs, largest difference first."""
    out = []
    for c in sorted((c for c in gap.causes if c.delta), key=lambda c: -abs(c.delta)):
        detail = c.why
        if c.key == "activations" and gap.sp_gathered:
            detail = f"{fmt_bytes(gap.sp_gathered)} of them all-gathered block inputs; {detail}"
        if c.key in ("other", "redistribute outputs", "unsharded gradients") and c.largest:
            detail = "largest: " + ", ".join(f"{name.removeprefix('aten.')} in {module or 'the root'} ({fmt_bytes(b)})"
                                             for name, module, b in c.largest) + (f"; {detail}" if detail else "")
        if c.units:
            detail = ", ".join(f"{u} ({role}): {fmt_bytes(b)}" for u, role, b in c.units[:4]) \
                + (f" and {len(c.units) - 4} more" if len(c.units) > 4 else "") + (f"; {detail}" if detail else "")
        out.append(f"  {c.key}: {_signed(c.delta)} (rank {fmt_bytes(c.real)}, formula {fmt_bytes(c.formula)})"
                   + (f": {detail}" if detail else ""))
    return (f"{what} by cause, tensors live at each peak (passes/rank_gap.py; peak in "
            f"{gap.peak_unit or 'the root'}):", *out)


def formula_of(sharding: Sharding) -> Parallel:
    """The per-rank formula for the same layout: FSDP with resharding after forward is
    FULL_SHARD (ZeRO-3), without it SHARD_GRAD_OP; tensor parallel is Korthikanti's split."""
    fsdp = ("full" if sharding.reshard_after_forward else "grad-op") if sharding.fsdp else None
    return Parallel(sharding.world_size, 0, fsdp, sharding.tp, sharding.sp)


def rank_view(g: StepGraph, lv: Liveness, sv: SavedSet, sharding: Sharding,
              single: Optional[tuple[StepGraph, Liveness, SavedSet]], units: tuple[str, ...],
              tp_engine: str = "parallelize_module") -> RankView:
    """``g``/``lv``/``sv``: rank r's capture; ``single``: the single-device step (for the formula)."""
    tl = category_timeline(g, lv, sv.tensors)
    comm = tuple((t.module, t.name, t.nbytes) for t in lv.live_at_peak if tl.category_of.get(t.sid) == "communication")
    formula: Optional[Parallel] = None
    formula_peak: Optional[int] = None
    formula_later: Optional[int] = None
    breakdown: Optional[RankGap] = None
    later_breakdown: Optional[RankGap] = None
    stepped = g.train is not None and g.train.optimizer is not None
    if single is not None:
        formula = formula_of(sharding)
        b: Budget = budget(*single, formula, units)
        formula_peak = b.peak_bytes
        formula_later = b.later_peak_bytes if stepped else None
        breakdown = rank_gap(g, lv, sv, b, units)
        later_breakdown = rank_gap(g, lv, sv, b, units, later=True) if stepped else None
    # tensor parallel alone: each gradient is its own storage (FSDP2's are flat reduce-scatter outputs)
    full = () if sharding.fsdp else tuple(
        (g.storages[s.owner].name, s.nbytes, g.storages[s.owner].nbytes) for s in (g.storages[sid] for sid in g.gradients)
        if s.owner is not None and s.nbytes > g.storages[s.owner].nbytes)
    return RankView(sharding, comm, max(tl.by_category["communication"], default=0), formula, formula_peak,
                    lv.peak_bytes, tp_engine, full, later_steps_peak(g, lv) if stepped else None, formula_later,
                    breakdown, later_breakdown)
