"""``Analysis``: what ``graphmem.analyze`` returns. It is a Report (graphmem/report/__init__.py: the data, equal
field by field to the one ``Report.from_dict`` reads back) plus the live capture: the step graph, its liveness,
the Recapture that captures the same step again (graphmem/step/recapture.py) and a typed cache of the answers
computed once. The questions that capture again live here, each returning a typed result: ``formula`` /
``coefficients``, ``fit`` / ``max_batch``, ``sweep`` (graphmem/formula), ``planner`` / ``plan`` / ``plans``
(graphmem/planning), ``advise`` (graphmem/advise) and ``memory_budgets`` (compiled mode).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Optional, Sequence, Union

import torch

from graphmem.capture.target import CARD, memory_limit
from graphmem.errors import GraphmemError, UsageError, no_source
from graphmem.formula import AnyCoefficients, FitAnswer, NotPolynomialError, Sweep, largest_fitting
from graphmem.formula.fit import fit as fit_formula
from graphmem.formula.piecewise import fit_windowed, window_of
from graphmem.formula.sweep import sweep as sweep_formula
from graphmem.noise import quiet  # third-party notes on the captures these answers run (graphmem/noise.py)
from graphmem.passes import Liveness, SavedSet, allocator, compare_modes, saved
from graphmem.passes.allocator import AllocatorResult
from graphmem.passes.memory_budget import BudgetSweep
from graphmem.passes.run_memory import RunMemory, figure_for, step_memory
from graphmem.planning import memory_budget as memory_budget_api
from graphmem.planning.figures import figure_of, plan_within
from graphmem.planning.pieces import PlanError
from graphmem.planning.planner import CheckpointPlan, Planner, PlanSummary, parse_limits, summarize
from graphmem.planning.selective import LEVELS, SelectivePlanner
from graphmem.report import Held, Peak, RankScope, Report
from graphmem.step.measure import Measured, step_graph
from graphmem.step.recapture import Recapture
from graphmem.step.spec import Single, StepSpec
from graphmem.stepgraph import StepGraph
from graphmem.training.spec import StepBudget

if TYPE_CHECKING:
    from graphmem.advise import Advice

Tick = Optional[Callable[[], None]]  # a progress callback, called once per capture
Memory = Union[int, str, None]  # bytes, a size such as "80GiB", or "gpu" / None: the CUDA target card's capacity


@dataclass
class Answers:
    """What an Analysis computed once and keeps (shared by the copies ``dataclasses.replace`` makes): the
    formulas at the defaults, and the checkpoint planners by selective levels (0: the plain planner)."""

    coefficients: Optional[AnyCoefficients] = None
    planners: dict[int, Planner] = field(default_factory=dict)


@dataclass(frozen=True, eq=False, repr=False, kw_only=True)  # (Report's one-line repr and field equality)
class Analysis(Report):
    step: StepGraph = field(repr=False, compare=False)
    liveness: Liveness = field(repr=False, compare=False)
    source: Optional[Recapture] = field(default=None, repr=False, compare=False)  # None: one rank's step, not captured again
    answers: Answers = field(default_factory=Answers, repr=False, compare=False)

    @staticmethod
    def build(g: StepGraph, lv: Liveness, sv: SavedSet, model: str, input_shapes: tuple, loss: str,
              notes: tuple[str, ...] = (), source: Optional[Recapture] = None,
              cuda_allocator: Optional[AllocatorResult] = None, budget: Optional[StepBudget] = None,
              sharding: Optional[RankScope] = None, memory: Optional[RunMemory] = None) -> "Analysis":
        kinds: dict[str, int] = {}
        for s in g.storages.values():
            if s.created < 0:
                kinds[s.kind] = kinds.get(s.kind, 0) + s.nbytes
        node = g.ops[lv.peak_index] if lv.peak_index >= 0 else None
        return Analysis(
            model=model, device=g.device, input_shapes=input_shapes, loss=loss,
            held=Held(kinds.get("parameter", 0), kinds.get("buffer", 0), kinds.get("input", 0),
                      sum(g.storages[s].nbytes for s in g.gradients)),
            activation_bytes=sv.activation_bytes, by_category=dict(sv.by_category),
            peak=Peak(lv.peak_bytes, lv.peak_index, lv.peak_phase,
                      str(node.target) if node is not None else "(before the step)",
                      node.meta["module"] if node is not None else "", lv.live_at_peak, lv.baseline_bytes),
            saved=sv.tensors, modules=sv.modules, num_ops=g.num_ops,
            phase_start=dict(g.phase_start), notes=notes, target=g.target,
            attention_backends=dict(g.attention_backends), cuda_allocator=cuda_allocator, budget=budget,
            sharding=sharding, memory=memory, step=g, liveness=lv, source=source)

    @property
    def recapture(self) -> Recapture:
        """What captures this step again; one rank's step has none (``no_source`` says what to do)."""
        if self.source is None:
            raise no_source(self.sharding)
        return self.source

    # -- formulas (graphmem/formula): the step captured again at other input sizes
    @property
    def coefficients(self) -> AnyCoefficients:
        """Exact formulas (graphmem.formula.Coefficients): ``.activation`` / ``.peak`` polynomials
        in the input's dimensions and, for a block chain, ``.alpha``, ``.beta``, ``.gamma``."""
        if self.known_coefficients is not None:
            return self.known_coefficients
        if self.answers.coefficients is None:
            self.answers.coefficients = self.formula()
        return self.answers.coefficients

    @quiet
    def formula(self, d_model: Optional[int] = None, n_heads: Optional[int] = None, checks: int = 5,
                tick: Tick = None) -> AnyCoefficients:
        """Fit the exact formulas (see ``coefficients``), with overrides; ``report.keeping(coefficients=...)``
        keeps them with the report (renderers and JSON show them). One polynomial on each side of a
        sliding attention window where one polynomial does not hold (graphmem/formula/piecewise.py)."""
        source = self.recapture
        try:
            return fit_formula(source.sampler(tick), source.names, d_model=d_model, n_heads=n_heads, checks=checks)
        except NotPolynomialError:
            window = window_of(source.module)
            if window is None:
                raise
            return fit_windowed(lambda base: source.sampler_for(base, source.dims, tick), source.names, source.dims,
                                source.base_shape, window, checks, d_model=d_model, n_heads=n_heads)

    @quiet
    def fit(self, memory: Memory, seq: Optional[int] = None, batch: Optional[int] = None, tick: Tick = None,
            figure: Optional[str] = None) -> FitAnswer:
        """The largest batch (at sequence length ``seq``, default: this report's) or, given
        ``batch``, the largest sequence length whose peak fits in ``memory`` (bytes or a string
        like "80GiB"): a graphmem.formula.FitAnswer, exact from the peak formula and confirmed
        by captures at the answer and one above; then judged on ``figure`` of the run
        (passes/run_memory.py: "allocated", "reserved" or "device", the device total, default on the
        CUDA target; "allocated" on the CPU's), the whole step captured at each value tried."""
        source = self.recapture
        if seq is not None and batch is not None:
            raise UsageError("give seq= (to find the batch) or batch= (to find the sequence length), not both")
        memory_bytes = memory_limit(memory, self.target)
        base = list(source.base_shape)
        if (seq is not None or batch is not None) and tuple(source.names[:2]) != ("b", "s"):
            raise UsageError(f"this model's input {tuple(base)} has no sequence dimension; use fit without seq/batch")
        dim = 0 if batch is None else 1  # the dimension searched; the other one fixed where given
        given = seq if dim == 0 else batch
        if given is not None:
            if len(base) < 2:
                raise UsageError(f"{'seq' if dim == 0 else 'batch'}= needs a (batch, seq, ...) input")
            base[1 - dim] = given
        sampler, name = source.sampler_for(tuple(base), (dim,), tick), "bs"[dim]
        coeffs: AnyCoefficients
        try:
            coeffs = fit_formula(sampler, (name,), checks=0)  # the confirming captures check it
        except NotPolynomialError:
            window = window_of(source.module) if name == "s" else None
            if window is None:
                raise
            coeffs = fit_windowed(lambda b: source.sampler_for(b, (1,), tick), ("s",), (1,), tuple(base), window, 0)
        answer = largest_fitting(coeffs, sampler, memory_bytes, name, {})
        device = self.target.device if self.target is not None else "cpu"
        return self._judged(answer, tuple(base), dim, figure_for(device, figure))

    def _judged(self, a: FitAnswer, base: tuple[int, ...], dim: int, figure: str) -> FitAnswer:
        """``a`` judged on the run's ``figure`` (passes/run_memory.py): the whole step (its optimizer
        states, the allocator's reserved bytes, the device rows) captured at each value tried; the
        formula's first-step answer bounds it from above, bisected down by captures."""
        source, seen = self.recapture, {}
        assert self.memory is not None  # analyze gives every step its run's figures
        rows = self.memory.rows

        def value_at(v: int) -> Optional[int]:
            if v not in seen:
                shape = list(base)
                shape[dim] = v
                try:
                    seen[v] = step_memory(source.capture(tuple(shape)), rows, source.parallel).figure(figure)
                except GraphmemError:  # the model refuses the size
                    seen[v] = None
            return seen[v]

        def fits(v: int) -> bool:
            got = value_at(v)
            return got is not None and got <= a.memory

        good, bad = 0, a.value + 1
        if a.value >= 1 and fits(a.value):
            good = a.value
        else:
            while bad - good > 1:
                mid = (good + bad) // 2
                good, bad = (mid, bad) if fits(mid) else (good, mid)
        return dataclasses.replace(a, value=good, figure=figure, figure_bytes=value_at(good) if good else None,
                                   figure_above=value_at(good + 1), tensors_value=a.value)

    def max_batch(self, memory: Memory, seq: Optional[int] = None) -> int:
        """Largest batch size whose predicted peak fits in ``memory``, e.g. ``max_batch("80GiB", seq=1024)``."""
        return int(self.fit(memory, seq=seq).value)

    @quiet
    def sweep(self, batches: Iterable[int], seqs: Iterable[int], tick: Tick = None) -> Sweep:
        """Activation and peak bytes over a grid of (batch, seq) from the exact formulas, with
        the first point spot-checked by a capture: a graphmem.formula.Sweep."""
        return sweep_formula(self.recapture, list(batches), list(seqs), tick)

    # -- checkpoint plans (graphmem/planning): the step captured again with segments checkpointed
    @property
    def planner(self) -> Planner:
        """graphmem.planning.Planner for the model's chain of blocks (measured once, a few captures)."""
        return self.planner_for(False)

    def planner_for(self, selective: Union[bool, int, None] = False) -> Planner:
        """The planner for ``selective`` (False: plain; True: LEVELS levels; an int: that many), measured once."""
        if self.source is None:  # one rank's step: say what to do before measuring
            raise no_source(self.sharding)
        if selective is False or selective is None:
            count = 0
        else:
            count = LEVELS if selective is True else selective
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise UsageError(f"selective must be True, False or a number of levels >= 1, not {selective!r}")
        if count not in self.answers.planners:
            self.answers.planners[count] = Planner(self) if count == 0 else SelectivePlanner(self, self.planner, count)
        return self.answers.planners[count]

    def _card(self, budget: Memory) -> Memory:
        """``budget="gpu"``: the CUDA target card's capacity in bytes (graphmem/capture/target.py ``CAPACITY``)."""
        return memory_limit(budget, self.target, "budget") if isinstance(budget, str) and \
            budget.strip().lower() == CARD else budget

    @quiet
    def plan(self, budget: Memory = None, max_overhead: Union[float, str, None] = None,
             selective: Union[bool, int, None] = False,
             figure: Optional[str] = None) -> CheckpointPlan:
        """The checkpoint plan (graphmem.planning.CheckpointPlan) with the fewest recompute FLOPs
        whose predicted peak fits ``budget`` (bytes or "40GiB"), or the lowest-peak plan whose
        recompute stays within ``max_overhead`` of the step's FLOPs (0.2 or "20%").
        ``selective=True`` (or a number of levels) also lets each checkpointed segment keep
        some ops' outputs (graphmem/planning/selective.py). The budget is compared with ``figure`` of
        the run (passes/run_memory.py): "allocated", "reserved" or "device" (the device total; the
        default on the CUDA target, "allocated" on the CPU's), captured with the plan applied.

        >>> plan = report.plan(budget="40GiB")            # doctest: +SKIP
        >>> plan.segments, plan.peak_bytes, plan.overhead  # doctest: +SKIP
        >>> handle = plan.apply(model)                     # torch.utils.checkpoint; handle.remove() undoes
        """
        limit, cap = parse_limits(self._card(budget), max_overhead)
        p = self.planner_for(selective)
        if limit is None:
            return p.plan(limit, cap)
        return plan_within(self, p, limit, figure_of(self, figure))[0]

    @quiet
    def plans(self, budget: Memory = None, max_overhead: Union[float, str, None] = None, points: int = 50,
              selective: Union[bool, int, None] = False,
              figure: Optional[str] = None) -> PlanSummary:
        """graphmem.planning.PlanSummary: the chosen plan (if a limit is given), the baselines beside
        graphmem's plan at their own peak, and the Pareto frontier; ``report.keeping(plans=...)``
        keeps it with the report (renderers and JSON show it)."""
        limit, cap = parse_limits(self._card(budget), max_overhead, required=False)
        p = self.planner_for(selective)
        if limit is None:
            return summarize(p, limit, cap, points=points)
        try:
            chosen, inner = plan_within(self, p, limit, figure_of(self, figure))
        except PlanError as e:
            return dataclasses.replace(summarize(p, None, None, points=points), problem=str(e))
        return dataclasses.replace(summarize(p, inner, None, points=points), chosen=chosen)

    # -- what to change (graphmem/advise) and compiled mode's budget knob
    @quiet
    def advise(self, memory: Memory, ranks: int = 8, lora_rank: int = 16, tick: Tick = None, combine: bool = False,
               figure: Optional[str] = None) -> Advice:
        """What to change so the step's peak fits ``memory`` (bytes or "80GiB"): a
        graphmem.advise.Advice, its levers ranked, each lever's peak a capture of the changed
        step, and the cheapest lever or combination that fits (``advice.answer``). ``ranks``:
        the GPUs the sharding levers split over; ``lora_rank``: the LoRA lever's rank; the best
        levers are combined (each combination captured) when no single one fits, or ``combine``.
        Each setting is judged on ``figure`` of its run (passes/run_memory.py: "allocated", "reserved"
        or "device", the device total: the default on the CUDA target, "allocated" on the CPU's);
        ``memory="gpu"`` is the CUDA target card's capacity (graphmem/capture/target.py ``CAPACITY``).

        >>> advice = report.advise(memory="80GiB")          # doctest: +SKIP
        >>> advice.answer, [(r.name, r.peak_bytes) for r in advice.levers]  # doctest: +SKIP
        """
        from graphmem.advise import advise  # captures again: loaded on use

        return advise(self, memory, ranks, lora_rank, tick, combine, figure, report_of)

    def memory_budgets(self, values: Union[str, float, Sequence[float]], tick: Tick = None) -> BudgetSweep:
        """Compiled mode: the step at each value of torch.compile's activation memory budget
        (``torch._functorch.config.activation_memory_budget``, 0 to 1), each partitioned by the
        real min-cut partitioner: a graphmem.passes.memory_budget.BudgetSweep (saved bytes, peak,
        recompute FLOPs per value, and where the peak is not monotonic). ``report.keeping(memory_budgets=...)``
        keeps it with the report (renderers and JSON show it).

        >>> sweep = report.memory_budgets([1, 0.8, 0.5, 0.2])  # doctest: +SKIP
        >>> [(p.budget, p.peak_bytes) for p in sweep.points], sweep.rises  # doctest: +SKIP
        """
        return memory_budget_api.memory_budgets(self, values, tick)




# -- the report of a measured step: what graphmem.analyze returns, and what advise makes of a changed setting
def report_of(m: Measured, overrides: Optional[dict[str, int]] = None) -> Analysis:
    """The Report of a measured step: the passes' results, the spec it came from (``source``:
    what plans, formulas and fits capture again) and, in compiled mode, eager beside it."""
    spec, step = m.spec, m.step
    g = step.graph
    shapes = tuple(g.storages[n.meta["storage"]].shape for n in g.placeholders if n.meta.get("kind") == "input")
    example = tuple(g.storages[n.meta["storage"]] for n in g.placeholders if n.meta.get("kind") == "input")
    source: Optional[Recapture] = None
    if example and m.recapturable:
        probe = tuple(torch.empty(s.shape, dtype=getattr(torch, s.dtype), device="meta") for s in example)
        source = Recapture(spec, step, probe)
    alloc = allocator(g) if step.target.device == "cuda" else None  # the caching allocator's view of the step
    report = Analysis.build(g, step.liveness, step.saved, spec.name, shapes, m.loss_name, m.notes, source, alloc,
                          budget=step.budget, sharding=m.scope, memory=m.memory(overrides, alloc))
    if spec.inputs.settings:  # the choices in a batch graphmem made for an input shape (graphmem/capture/hf_batch.py)
        report = dataclasses.replace(report, batch=dict(spec.inputs.settings))
    if spec.target.mode == "compiled":  # eager beside it: saved bytes per module, what was recomputed
        report = _beside_eager(report, spec, step.eager if step.module is spec.module else None)
    return report


def _beside_eager(report: Analysis, spec: StepSpec, eager: Optional[StepGraph] = None) -> Analysis:
    """``report`` (compiled mode) with ``compiled``: the same step captured eagerly, side by side
    (``eager``: already captured by compiled depth reuse's check, graphmem/capture/reuse_compiled.py;
    a trainer's step, ``train.runner()``: its own step, run eagerly)."""
    g = report.step
    assert g is not None  # analyze keeps the step graph
    twin = spec.replace(parallel=Single(), target=dataclasses.replace(g.target, mode="eager", compile_backend="aot_eager"))
    train = spec.training.train
    with train.runner(twin.target) as runner:
        if eager is None and runner is not None:  # a transformers Trainer's step (graphmem/training/hf_trainer.py)
            eager = step_graph(twin, runner=runner.run).graph
    if eager is None:
        eager = step_graph(twin, reuse=True).graph
    return dataclasses.replace(report, compiled=compare_modes(g, saved(g), saved(eager)))


__all__ = ["Analysis", "Answers", "report_of"]
