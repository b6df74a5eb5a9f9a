"""Report: the frozen result of one analysis (pass results + what was analyzed)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from graphmem.passes import Liveness, LiveTensor, ModuleSaved, SavedSet, SavedTensor
from graphmem.planning import memory_budget as memory_budget_api
from graphmem.planning import report_api as planning_api
from graphmem.stepgraph import StepGraph


class RankScope(Protocol):
    """Which rank of a parallel step a report is (``Report.sharding``): graphmem/distributed/view.py's
    RankView (its wrappers, the formula beside it) or graphmem/distributed/pipeline_stages.py's
    Pipeline (its schedule). Defined here, not there: the report layer imports no
    graphmem.distributed (tests/test_layout.py)."""

    def describe(self) -> str:
        """One line naming the rank and how the step is split (the first line of every view)."""
        ...

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, under the report's ``sharding`` key."""
        ...


@dataclass(frozen=True)
class Report:
    model: str
    device: str
    input_shapes: tuple[tuple[int, ...], ...]
    loss: str  # how the loss was made
    parameter_bytes: int
    buffer_bytes: int
    input_bytes: int
    gradient_bytes: int
    activation_bytes: int
    by_category: dict[str, int]
    peak_bytes: int
    peak_index: int
    peak_phase: str
    peak_op: str
    peak_module: str
    live_at_peak: tuple[LiveTensor, ...]
    baseline_bytes: int
    saved: tuple[SavedTensor, ...]
    modules: tuple[ModuleSaved, ...]
    num_ops: int
    phase_start: dict[str, int]
    notes: tuple[str, ...] = ()
    target: Any = None  # graphmem.capture.Target
    attention_backends: dict = field(default_factory=dict)  # CUDA target: SDPA kernel -> calls
    cuda_allocator: Any = None  # CUDA target: passes.allocator.AllocatorResult (caching allocator model)
    budget: Any = None  # graphmem.training.spec.StepBudget: optimizer, precision, LoRA, per-rank budget
    compiled: Any = None  # compiled mode: passes.modes.ModeComparison (eager beside compiled)
    sharding: Optional[RankScope] = None  # the rank this report is (a per-rank or pipeline-stage capture)
    batch: dict[str, str] = field(default_factory=dict)  # choices in the batch graphmem made (hf_batch.settings)
    step: Optional[StepGraph] = field(default=None, repr=False, compare=False)
    liveness: Optional[Liveness] = field(default=None, repr=False, compare=False)
    source: Any = field(default=None, repr=False, compare=False)  # graphmem.recapture.Recapture: capture again

    # -- questions that capture again: a thin facade over graphmem/formula and graphmem/planning
    @property
    def coefficients(self) -> Any:
        """Exact formulas (graphmem.formula.Coefficients): ``.activation`` / ``.peak`` polynomials
        in the input's dimensions and, for a block chain, ``.alpha``, ``.beta``, ``.gamma``."""

        from graphmem.formula import report_api as formula_api  # sympy only when formulas are asked for

        return formula_api.coefficients(self)

    @property
    def known_coefficients(self) -> Any:
        """The formulas if they were computed (``coefficients``, ``formula(keep=True)``), else None:
        renderers show them only when asked for."""
        return self.source.kept.get("coefficients") if self.source is not None else None

    def formula(self, d_model: Optional[int] = None, n_heads: Optional[int] = None, checks: int = 5,
                tick: Any = None, keep: bool = False) -> Any:
        """Fit the exact formulas (see ``coefficients``), with overrides; ``keep`` stores them
        as this report's ``coefficients``."""

        from graphmem.formula import report_api as formula_api  # sympy only when formulas are asked for

        return formula_api.formula(self, d_model, n_heads, checks, tick, keep)

    def fit(self, memory: Any, seq: Optional[int] = None, batch: Optional[int] = None, tick: Any = None) -> Any:
        """The largest batch (at sequence length ``seq``, default: this report's) or, given
        ``batch``, the largest sequence length whose peak fits in ``memory`` (bytes or a string
        like "80GiB"): a graphmem.formula.FitAnswer, exact from the peak formula and confirmed
        by captures at the answer and one above."""

        from graphmem.formula import report_api as formula_api  # sympy only when formulas are asked for

        return formula_api.fit(self, memory, seq, batch, tick)

    def max_batch(self, memory: Any, seq: Optional[int] = None) -> int:
        """Largest batch size whose predicted peak fits in ``memory``, e.g. ``max_batch("80GiB", seq=1024)``."""
        return int(self.fit(memory, seq=seq).value)

    def sweep(self, batches: Any, seqs: Any, tick: Any = None) -> Any:
        """Activation and peak bytes over a grid of (batch, seq) from the exact formulas, with
        the first point spot-checked by a capture: a graphmem.formula.Sweep."""

        from graphmem.formula import report_api as formula_api  # sympy only when formulas are asked for

        return formula_api.sweep(self, batches, seqs, tick)

    @property
    def planner(self) -> Any:
        """graphmem.planning.Planner for the model's chain of blocks (measured once, a few captures)."""

        return planning_api.planner(self, False)

    def plan(self, budget: Any = None, max_overhead: Any = None, selective: Any = False) -> Any:
        """The checkpoint plan (graphmem.planning.CheckpointPlan) with the fewest recompute FLOPs
        whose predicted peak fits ``budget`` (bytes or "40GiB"), or the lowest-peak plan whose
        recompute stays within ``max_overhead`` of the step's FLOPs (0.2 or "20%").
        ``selective=True`` (or a number of levels) also lets each checkpointed segment keep
        some ops' outputs (graphmem/planning/selective.py).

        >>> plan = report.plan(budget="40GiB")            # doctest: +SKIP
        >>> plan.segments, plan.peak_bytes, plan.overhead  # doctest: +SKIP
        >>> handle = plan.apply(model)                     # torch.utils.checkpoint; handle.remove() undoes
        """

        return planning_api.plan(self, budget, max_overhead, selective)

    def plans(self, budget: Any = None, max_overhead: Any = None, points: int = 50, keep: bool = False,
              selective: Any = False) -> Any:
        """graphmem.planning.PlanSummary: the chosen plan (if a limit is given), the baselines beside
        graphmem's plan at their own peak, and the Pareto frontier; ``keep`` adds it to JSON."""

        return planning_api.plans(self, budget, max_overhead, points, keep, selective)

    def advise(self, memory: Any, ranks: int = 8, lora_rank: int = 16, tick: Any = None, combine: bool = False) -> Any:
        """What to change so the step's peak fits ``memory`` (bytes or "80GiB"): a
        graphmem.advise.Advice, its levers ranked, each lever's peak a capture of the changed
        step, and the cheapest lever or combination that fits (``advice.answer``). ``ranks``:
        the GPUs the sharding levers split over; ``lora_rank``: the LoRA lever's rank; the best
        levers are combined (each combination captured) when no single one fits, or ``combine``.

        >>> advice = report.advise(memory="80GiB")          # doctest: +SKIP
        >>> advice.answer, [(r.name, r.peak_bytes) for r in advice.levers]  # doctest: +SKIP
        """

        from graphmem.advise import advise  # captures again: loaded on use

        return advise(self, memory, ranks, lora_rank, tick, combine)

    def memory_budgets(self, values: Any, keep: bool = False, tick: Any = None) -> Any:
        """Compiled mode: the step at each value of torch.compile's activation memory budget
        (``torch._functorch.config.activation_memory_budget``, 0 to 1), each partitioned by the
        real min-cut partitioner: a graphmem.passes.memory_budget.BudgetSweep (saved bytes, peak,
        recompute FLOPs per value, and where the peak is not monotonic). ``keep`` adds it to
        the rendered report.

        >>> sweep = report.memory_budgets([1, 0.8, 0.5, 0.2])  # doctest: +SKIP
        >>> [(p.budget, p.peak_bytes) for p in sweep.points], sweep.rises  # doctest: +SKIP
        """

        return memory_budget_api.memory_budgets(self, values, keep, tick)

    @property
    def known_memory_budgets(self) -> Any:
        return self.source.kept.get("memory_budgets") if self.source is not None else None

    @property
    def known_plans(self) -> Any:
        return self.source.kept.get("plan_summary") if self.source is not None else None

    @staticmethod
    def build(g: StepGraph, lv: Liveness, sv: SavedSet, model: str, input_shapes: tuple, loss: str,
              notes: tuple[str, ...] = (), source: Any = None, cuda_allocator: Any = None,
              budget: Any = None, sharding: Optional[RankScope] = None) -> "Report":
        kinds: dict[str, int] = {}
        for s in g.storages.values():
            if s.created < 0:
                kinds[s.kind] = kinds.get(s.kind, 0) + s.nbytes
        node = g.ops[lv.peak_index] if lv.peak_index >= 0 else None
        return Report(
            model=model, device=g.device, input_shapes=input_shapes, loss=loss,
            parameter_bytes=kinds.get("parameter", 0), buffer_bytes=kinds.get("buffer", 0),
            input_bytes=kinds.get("input", 0),
            gradient_bytes=sum(g.storages[s].nbytes for s in g.gradients),
            activation_bytes=sv.activation_bytes, by_category=dict(sv.by_category),
            peak_bytes=lv.peak_bytes, peak_index=lv.peak_index, peak_phase=lv.peak_phase,
            peak_op=str(node.target) if node is not None else "(before the step)",
            peak_module=node.meta["module"] if node is not None else "",
            live_at_peak=lv.live_at_peak, baseline_bytes=lv.baseline_bytes,
            saved=sv.tensors, modules=sv.modules, num_ops=g.num_ops,
            phase_start=dict(g.phase_start), notes=notes, target=g.target,
            attention_backends=dict(g.attention_backends), cuda_allocator=cuda_allocator, budget=budget, step=g, liveness=lv, source=source,
            sharding=sharding,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: exact integers, no units."""
        return {
            "model": self.model,
            "target": {**(self.target.to_dict() if self.target is not None else {"device": self.device}),
                       "attention_backends": dict(self.attention_backends)},
            "input_shapes": [list(s) for s in self.input_shapes],
            **({"batch": dict(self.batch)} if self.batch else {}),
            "loss": self.loss,
            "activation_bytes": self.activation_bytes,
            "peak_bytes": self.peak_bytes,
            "parameter_bytes": self.parameter_bytes,
            "buffer_bytes": self.buffer_bytes,
            "input_bytes": self.input_bytes,
            "gradient_bytes": self.gradient_bytes,
            "by_category": dict(self.by_category),
            "peak": {
                "index": self.peak_index, "phase": self.peak_phase, "op": self.peak_op,
                "module": self.peak_module, "baseline_bytes": self.baseline_bytes,
                "live": [{"name": t.name, "kind": t.kind, "module": t.module, "shape": list(t.shape),
                          "dtype": t.dtype, "bytes": t.nbytes, "created": t.created, "freed": t.freed}
                         for t in self.live_at_peak],
            },
            "saved": [{"op": t.op, "module": t.module, "shape": list(t.shape), "dtype": t.dtype,
                       "bytes": t.bytes, "category": t.category, "created": t.created,
                       "released": t.released, "saved_by": list(t.saved_by)} for t in self.saved],
            "modules": [{"path": m.path, "activation_bytes": m.activation_bytes, "self_bytes": m.self_bytes,
                         "count": m.count} for m in self.modules],
            "num_ops": self.num_ops,
            "phases": dict(self.phase_start),
            "notes": list(self.notes),
            **({"cuda_allocator": {"max_allocated": self.cuda_allocator.max_allocated,
                                   "max_reserved": self.cuda_allocator.max_reserved,
                                   "fragmentation": self.cuda_allocator.fragmentation,
                                   "segments": self.cuda_allocator.segments}} if self.cuda_allocator is not None else {}),
            **({"coefficients": self.known_coefficients.to_dict()} if self.known_coefficients is not None else {}),
            **({"budget": self.budget.to_dict()} if self.budget is not None else {}),
            **({"compiled": self.compiled.to_dict()} if self.compiled is not None else {}),
            **({"sharding": self.sharding.to_dict()} if self.sharding is not None else {}),
            **({"plan": self.known_plans.to_dict()} if self.known_plans is not None else {}),
            **({"memory_budgets": self.known_memory_budgets.to_dict()} if self.known_memory_budgets is not None else {}),
        }
