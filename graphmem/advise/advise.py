"""``Analysis.advise``: what to change so the step fits in ``memory``, ranked. Every row's peak is a
capture of the changed step (graphmem/advise/setting.py), the checkpoint plan's is the planner's
verified plan (graphmem/planning), the batch's the fit's confirmation capture (graphmem/formula)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import graphmem.advise.levers as L
from graphmem.advise.deepspeed_levers import NOTE as DEEPSPEED_NOTE
from graphmem.advise.deepspeed_levers import deepspeed_levers, job_of
from graphmem.advise.levers import COST_RANK, Change, LeftOut
from graphmem.advise.setting import Measurer
from graphmem.analysis import AnalysisView
from graphmem.capture.target import memory_limit
from graphmem.errors import GraphmemError
from graphmem.passes.budget import later_steps_peak
from graphmem.passes.run_memory import FIGURE_NAMES
from graphmem.planning.figures import figure_of, plan_memory
from graphmem.step.measure import Measured, single_steps_once
from graphmem.step.spec import StepSpec
from graphmem.training.spec import preparing_once
from graphmem.units import fmt_bytes

# a changed setting's capture -> its report (graphmem/report/live.py report_of), with the user's device rows
ReportFor = Callable[[Measured, dict[str, int]], AnalysisView]

COSTS_NOTE = ("costs are graphmem's measures (recompute FLOPs from the recorded ops, bytes moved by collectives) "
              "or a stated trade-off, not times")
SHARDING_NOTE = ("sharding rows: FSDP2 is rank 0's step captured through torch.distributed's fully_shard under a fake "
                 "process group; ZeRO-1/2 are passes/budget.py's per-rank formulas on the captured step (DeepSpeed is "
                 "not run); communication: ring collectives, (N-1)/N of each buffer")
STOP_AT_FIT = ("micro-batches",)  # tried in increasing order: once one fits, the larger ones are not captured


@dataclass(frozen=True)
class Lever:
    kind: str
    name: str
    how: str
    peak_bytes: int  # measured: a capture of the changed step
    saving_bytes: int
    cost: str
    cost_class: str
    fits: bool
    parts: tuple[str, ...] = ()  # a combination: the levers' names
    extent: float = 0.0  # within the cost class: the recompute share, micro-steps, bytes communicated

    @property
    def rank(self) -> tuple:
        """Cheapest first: the cost class, then how much of it, fewer levers, the lower peak."""
        return (COST_RANK[self.cost_class], self.extent, len(self.parts), self.peak_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "how": self.how, "peak_bytes": self.peak_bytes,
                "saving_bytes": self.saving_bytes, "cost": self.cost, "cost_class": self.cost_class,
                "fits": self.fits, **({"parts": list(self.parts)} if self.parts else {}),
                "cost_extent": self.extent}


@dataclass(frozen=True)
class Advice:
    memory: int
    base_peak: int
    levers: tuple[Lever, ...]  # single levers, lowest peak first
    combinations: tuple[Lever, ...]
    left_out: tuple[LeftOut, ...]
    captures: int  # captures run for the advice (the report's own not counted)
    notes: tuple[str, ...] = field(default=(COSTS_NOTE, SHARDING_NOTE))
    # the figure of each setting's run that "peak" names and ``memory`` is compared with (passes/run_memory.py):
    # "allocated" (the CPU target's default), "reserved", or "device", the device total (the CUDA target's)
    figure: str = "allocated"

    @property
    def figure_name(self) -> str:
        return FIGURE_NAMES[self.figure]

    @property
    def choice(self) -> Optional[Lever]:
        """The cheapest single lever that fits, else the cheapest fitting combination, else None."""
        for rows in (self.levers, self.combinations):
            fitting = [r for r in rows if r.fits]
            if fitting:
                return min(fitting, key=lambda r: r.rank)
        return None

    @property
    def smallest(self) -> Optional[Lever]:
        rows = [*self.levers, *self.combinations]
        return min(rows, key=lambda r: r.peak_bytes) if rows else None

    @property
    def answer(self) -> str:
        memory = fmt_bytes(self.memory)
        peak = "peak" if self.figure == "allocated" else self.figure_name
        if self.base_peak <= self.memory:
            return f"the step already fits: {peak} {fmt_bytes(self.base_peak)} <= {memory}"
        choice = self.choice
        if choice is not None:
            what = "combination" if choice.parts else "lever"
            return (f"cheapest {what} that fits {memory}: {choice.name} ({peak} {fmt_bytes(choice.peak_bytes)}; "
                    f"cost: {choice.cost})")
        best = self.smallest
        reached = f"; the smallest {peak} reached is {fmt_bytes(best.peak_bytes)} ({best.name})" if best else ""
        return f"no lever or combination tried fits {memory}{reached}"

    def to_dict(self) -> dict[str, Any]:
        choice = self.choice
        return {"memory": self.memory, "figure": self.figure, "base_peak_bytes": self.base_peak, "answer": self.answer,
                "choice": choice.name if choice is not None else None,
                "levers": [r.to_dict() for r in self.levers],
                "combinations": [r.to_dict() for r in self.combinations],
                "left_out": [{"kind": x.kind, "why": x.why} for x in self.left_out],
                "captures": self.captures, "notes": list(self.notes)}


def advise(report: AnalysisView, memory: Any, ranks: int = 8, lora_rank: int = 16,
           tick: Optional[Callable[[], None]] = None, combine: bool = False, figure: Optional[str] = None,
           report_for: Optional[ReportFor] = None) -> Advice:
    """The levers of ``report``'s step, each captured, ranked, and the best few combined (when no
    single lever fits, or ``combine``); every setting judged on ``figure`` of its run (the device
    total on the CUDA target, allocated on the CPU's: graphmem/planning/figures.py). ``report_for`` makes the
    report of a changed setting's capture (graphmem/report/live.py ``report_of``, handed down by
    ``Analysis.advise``): the checkpoint plan of a step whose KV cache is turned off is that report's plan."""
    # one adapted (LoRA, QLoRA) model for every lever that keeps the model, one single-device step beside the FSDP2 rows
    with preparing_once(), single_steps_once():
        return _advise(report, memory_limit(memory, report.target), memory if isinstance(memory, str) else None, ranks, lora_rank,
                       tick, combine, figure_of(report, figure), report_for)


def _advise(report: AnalysisView, limit: int, budget: Optional[str], ranks: int, lora_rank: int,
            tick: Optional[Callable[[], None]], combine: bool, figure: str, report_for: Optional[ReportFor]) -> Advice:
    measurer = Measurer(report, tick)
    base = measurer.base
    base_peak = measurer.figure(base, figure)
    changes: list[Change] = []
    left_out: list[LeftOut] = []
    levers: tuple[tuple[str, Callable[[], tuple[list[Change], list[LeftOut]]]], ...] = (
        ("loss", lambda: L.loss(report, base, measurer.source.make)), ("cache", lambda: L.cache(report, base)),
        ("attention", lambda: L.attention(report, base)),
        ("precision", lambda: L.precision(report, base)), ("optimizer", lambda: L.optimizer(report, base)),
        ("micro-batches", lambda: L.micro_batches(report, base)), ("sharding", lambda: L.sharding(report, base, ranks)),
        ("pipeline", lambda: L.pipeline(report, base, ranks)), ("lora", lambda: L.lora(report, base, lora_rank))) \
        if job_of(base) is None else deepspeed_levers(report, base, measurer.source.make)  # its config's levers
    for kind, levers_of in levers:
        try:  # a lever that cannot be set up on this step is a row of its own, the others still weighed
            found, why = levers_of()
        except GraphmemError as e:
            found, why = [], [LeftOut(kind, f"not applicable: {e}")]
        changes += found
        left_out += why
    rows, measured = _singles(measurer, changes, base_peak, limit, left_out, figure)
    if job_of(base) is None:  # (a DeepSpeed job's rows say why the planner and the batch formula do not apply)
        rows, left_out = _formula_levers(report, measurer, limit, budget, base_peak, figure, rows, left_out, report_for)
    # combinations only when no single lever fits: the answer needs them then, and each is a capture
    fits = base_peak <= limit or any(r.fits for r in rows)
    combos = [] if fits and not combine else _combinations(measurer, base, measured, base_peak, limit, left_out, figure)
    rows.sort(key=lambda r: (r.peak_bytes, r.rank))
    notes = (COSTS_NOTE, SHARDING_NOTE) if job_of(base) is None else (COSTS_NOTE, DEEPSPEED_NOTE)
    return Advice(limit, base_peak, tuple(rows), tuple(combos), tuple(left_out), measurer.captures, notes, figure)


def _formula_levers(report: AnalysisView, measurer: Measurer, limit: int, budget: Optional[str], base_peak: int,
                    figure: str, rows: list[Lever], left_out: list[LeftOut],
                    report_for: Optional[ReportFor]) -> tuple[list[Lever], list[LeftOut]]:
    """The batch (when the step does not fit) and the checkpoint plan: the fit's formula and the planner."""
    if base_peak > limit:
        row, skipped = _batch_lever(report, measurer, limit, base_peak, figure)
        rows += [row] if row is not None else []
        left_out += [skipped] if skipped is not None else []
    plan, skipped = _plan_lever(report, measurer, limit, budget or f"{limit}B", base_peak, figure, report_for)
    rows += [plan] if plan is not None else []
    left_out += [skipped] if skipped is not None else []
    return rows, left_out


def _singles(measurer: Measurer, changes: list[Change], base_peak: int, limit: int,
             left_out: list[LeftOut], figure: str) -> tuple[list[Lever], dict[str, tuple[Change, int]]]:
    """Each change captured (micro-batch counts: until one fits); one that fails or does not lower
    the peak goes to ``left_out`` with the reason."""
    base = measurer.base
    base_flops = measurer.flops(base)
    rows: list[Lever] = []
    measured: dict[str, tuple[Change, int]] = {}
    for change in changes:
        if change.kind in STOP_AT_FIT and any(r.kind == change.kind and r.fits for r in rows):
            continue
        try:
            spec = change.apply(base)
            peak = measurer.figure(spec, figure)
            cost, extent = change.cost, change.extent
            if change.cost_class == "recompute":  # the FLOPs the changed step records beyond the step's own
                extent = max(0, measurer.flops(spec) - base_flops) / base_flops
                cost = f"recompute {extent:.1%} of the step's FLOPs: {cost}"
        except GraphmemError as e:
            left_out.append(LeftOut(change.kind, f"{change.name}: not applicable: {e}"))
            continue
        if change.kind != "cache":  # (the step without the KV cache is the checkpoint plan's: _plan_lever)
            measurer.release(spec)
        if peak >= base_peak:  # measured, and the step's peak does not drop: not a lever here
            left_out.append(LeftOut(change.kind, f"{change.name}: the peak does not drop ({fmt_bytes(peak)})"))
            continue
        measured[change.name] = (change, peak)
        rows.append(_row(change.kind, change.name, change.how, peak, base_peak, limit, cost, change.cost_class,
                         extent=extent))
    return rows, measured


def _row(kind: str, name: str, how: str, peak: int, base_peak: int, limit: int, cost: str, cost_class: str,
         parts: tuple[str, ...] = (), extent: float = 0.0) -> Lever:
    return Lever(kind, name, how, peak, base_peak - peak, cost, cost_class, peak <= limit, parts, extent)


def _batch_lever(report: AnalysisView, measurer: Measurer, limit: int, base_peak: int, figure: str,
                 tries: int = 3) -> tuple[Optional[Lever], Optional[LeftOut]]:
    """The largest batch that fits: the exact formula's answer (``report.fit``, graphmem/formula;
    forward and backward), then captured with the whole step (a later step's optimizer states
    too) and lowered in proportion while the capture does not fit (``tries`` captures at most)."""
    base = measurer.base
    b = base.shape[0]
    if b == 1:  # nothing smaller to try: no formula sampled, no capture
        return None, LeftOut("batch", f"even a batch of 1 does not fit {fmt_bytes(limit)}")
    try:
        value = min(report.fit(memory=limit, figure=figure).value, b - 1)
    except GraphmemError as e:
        return None, LeftOut("batch", f"no formula in the batch size: {e}")
    peak = base_peak
    for _ in range(tries):
        if value < 1:
            break
        try:
            peak = measurer.figure(base.at((value, *base.shape[1:])), figure)
        except GraphmemError as e:
            return None, LeftOut("batch", f"batch {value}: not applicable: {e}")
        if peak <= limit:
            break
        value = min(value - 1, value * limit // peak)
    if value < 1:
        return None, LeftOut("batch", f"even a batch of 1 does not fit {fmt_bytes(limit)}")
    shape = "x".join(map(str, (value, *base.shape[1:])))
    how = (f"--input-shape {shape}: {value} samples a step instead of {b} (graphmem fit gives the largest batch from "
           "the exact formulas)")
    return _row("batch", f"batch {value} instead of {b}", how, peak, base_peak, limit,
                f"{value / b:.0%} of the samples per optimizer step (fewer samples per step, not fewer bytes per "
                "sample: micro-batches keep them)", "changes the run"), None


def _plan_lever(report: AnalysisView, measurer: Measurer, limit: int, budget: str, base_peak: int,
                figure: str, report_for: Optional[ReportFor]) -> tuple[Optional[Lever], Optional[LeftOut]]:
    """The planner's cheapest plan whose ``figure`` fits (else its lowest-peak plan), verified by a capture.
    A transformers decoder whose step fills its KV cache is planned with the cache off (``--use-cache off``), as
    transformers' own gradient checkpointing runs it: the cache keeps only the stored blocks' keys and values to the
    step's end, so with it the blocks' memory does not add up block by block and every plan is a search among
    captured plans (graphmem/planning/verify.py); without it the plan is the proven optimum, confirmed by one capture."""
    spec, off = measurer.base, None
    if report_for is not None and (off := L.without_cache(measurer.base)) is not None:
        try:
            report, spec = report_for(Measured(off, measurer.captured(off)), measurer.overrides), off
        except GraphmemError:  # the step does not run without its cache: planned with it
            off = None
    one_device = later_steps_peak(report.step, report.liveness)  # what the planner plans: every step's peak
    allocated = measurer.peak(spec)
    if allocated != one_device:
        return None, LeftOut("checkpoint", f"the step's peak is one rank's ({fmt_bytes(allocated)}); the planner plans "
                             f"the step on one device ({fmt_bytes(one_device)}): run graphmem plan without the "
                             "sharding options to see its plans")
    try:
        try:
            plan = report.plan(budget=limit, figure=figure)
            call = f"report.plan(budget={budget!r})"
        except GraphmemError:  # none fits: the lowest peak any plan reaches (recompute at most the forward)
            plan = report.plan(max_overhead=1.0)
            call = "report.plan(max_overhead=1.0)"
    except GraphmemError as e:
        return None, LeftOut("checkpoint", f"no checkpoint plan: {e}")
    peak = plan.figure_bytes if plan.figure == figure and plan.figure_bytes is not None \
        else plan_memory(report, plan).figure(figure)  # the lowest-peak plan, captured with it applied
    if peak >= base_peak or not plan.segments:
        return None, LeftOut("checkpoint", f"no checkpoint plan of {plan.chain} lowers the peak (at {report.peak_op}, "
                             f"{report.peak_phase}): checkpoints free activations, not what is live there")
    segments = ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in plan.segments) or "none"
    cache = " --use-cache off" if off is not None else ""
    how = (f"graphmem plan ...{cache} --budget {budget} (or {call}.apply(model)): torch.utils.checkpoint over "
           f"{plan.chain} blocks {segments}" +
           (", the model called with use_cache=False (as transformers' gradient checkpointing calls it)" if cache else ""))
    cost = f"recompute {plan.overhead:.1%} of the step's FLOPs"
    count = len(plan.segments)
    name = f"checkpoint plan ({count} segment{'s' if count != 1 else ''})" + (", KV cache off" if cache else "")
    return _row("checkpoint", name, how, peak, base_peak, limit, cost, "recompute", extent=plan.overhead), None


def _combinations(measurer: Measurer, base: StepSpec, measured: dict[str, tuple[Change, int]], base_peak: int,
                  limit: int, left_out: list[LeftOut], figure: str, most: int = 4) -> list[Lever]:
    """Greedy, each step captured: start from the best lever of the kind that saves most, add the
    best lever of each other kind (capture-only kinds first, sharding last: it needs more GPUs)
    while it lowers the peak, until the step fits or ``most`` levers are tried. A lever that cannot
    join the others (it refuses their setting, or the capture fails) goes to ``left_out`` with the
    reason, and the next kind is tried."""
    best: dict[str, tuple[Change, int]] = {}
    for change, peak in measured.values():
        if peak < base_peak and change.cost_class in ("none", "trade-off", "recompute", "communication"):
            if change.kind not in best or peak < best[change.kind][1]:
                best[change.kind] = (change, peak)
    order = sorted(best.values(), key=lambda cp: (cp[0].cost_class == "communication", cp[1]))
    if len(order) < 2:
        return []
    out: list[Lever] = []
    (first, peak_now), parts = order[0], [order[0][0]]
    setting = first.apply(base)
    for change, _ in order[1:most]:
        trying = [*parts, change]
        cls = max((c.cost_class for c in trying), key=lambda c: COST_RANK[c])
        extent = sum(c.extent for c in trying if c.cost_class == cls)
        cost = "; ".join(c.cost for c in trying)
        try:  # a lever may refuse the others' setting (Adafactor on FSDP2's DTensor parameters): not this combination
            trial = change.apply(setting)
            peak = measurer.figure(trial, figure)
            if cls == "recompute" and peak < peak_now:
                extent = max(0, measurer.flops(trial) - measurer.flops(base)) / measurer.flops(base)
                cost = f"recompute {extent:.1%} of the step's FLOPs; " + \
                    "; ".join(c.cost for c in trying if c.cost_class != cls)
        except GraphmemError as e:
            left_out.append(LeftOut("combination", f"{' + '.join(c.name for c in trying)}: not applicable: {e}"))
            continue
        measurer.release(trial)
        if peak >= peak_now:  # this lever does not help on top of the others
            continue
        setting, peak_now, parts = trial, peak, trying
        out.append(_row("combination", " + ".join(c.name for c in parts), "; ".join(c.how.split(":")[0] for c in parts),
                        peak, base_peak, limit, cost.rstrip("; "), cls, tuple(c.name for c in parts), extent))
        if peak <= limit:
            break
    return out
