"""Report: the frozen result of one analysis (pass results + what was analyzed)."""
from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from graphmem.capture.target import Target
from graphmem.errors import UsageError
from graphmem.passes import Liveness, LiveTensor, ModuleSaved, SavedSet, SavedTensor
from graphmem.passes.allocator import AllocatorResult
from graphmem.passes.memory_budget import BudgetSweep
from graphmem.passes.modes import ModeComparison
from graphmem.passes.run_memory import FIGURE_NAMES, RunMemory, figure_for  # noqa: F401 (graphmem/ci.py)
from graphmem.planning import memory_budget as memory_budget_api
from graphmem.planning import report_api as planning_api
from graphmem.planning.planner import PlanSummary
from graphmem.report.jsondata import field_types, from_json, to_json
from graphmem.stepgraph import StepGraph
from graphmem.training.spec import StepBudget

# the fields whose JSON under their own key is a view (derived numbers, names): to_dict writes them
# once more, exactly, under "exact" (graphmem/report/jsondata.py), so that from_dict gives them back
EXACT = ("device", "target", "cuda_allocator", "memory", "budget", "compiled", "sharding", "known_coefficients",
         "known_plans", "known_memory_budgets")


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
    peak_bytes: int  # the FIRST step's peak (``first_step_peak_bytes``); the run's is ``run_peak_bytes``
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
    target: Optional[Target] = None
    attention_backends: dict[str, int] = field(default_factory=dict)  # CUDA target: SDPA kernel -> calls
    cuda_allocator: Optional[AllocatorResult] = None  # CUDA target: the caching allocator model
    budget: Optional[StepBudget] = None  # optimizer, precision, LoRA, per-rank budget
    compiled: Optional[ModeComparison] = None  # compiled mode: eager beside compiled
    sharding: Optional[RankScope] = None  # the rank this report is (a per-rank or pipeline-stage capture)
    memory: Optional[RunMemory] = None  # the run: first and later steps, allocated, reserved, device total
    # answers asked for and kept with the report (``keeping``): renderers and to_dict show them
    known_coefficients: Any = None  # graphmem.formula Coefficients or PiecewiseCoefficients
    known_plans: Optional[PlanSummary] = None
    known_memory_budgets: Optional[BudgetSweep] = None
    batch: dict[str, str] = field(default_factory=dict)  # choices in the batch graphmem made (hf_batch.settings)
    step: Optional[StepGraph] = field(default=None, repr=False, compare=False)
    liveness: Optional[Liveness] = field(default=None, repr=False, compare=False)
    source: Any = field(default=None, repr=False, compare=False)  # graphmem.step.recapture.Recapture: capture again

    def __str__(self) -> str:
        """The text view, as ``graphmem analyze`` prints it (graphmem/render/text.py), with the plans
        kept beside the report after it. (The renderers sit a layer above the report: loaded by name.)"""
        text = str(importlib.import_module("graphmem.render.text").render_text(self))
        return text + (f"\n{self.known_plans}" if self.known_plans is not None else "")

    def __repr__(self) -> str:
        """One line (the generated one would list every saved and live tensor): what and where, the headline bytes."""
        shapes = ", ".join("x".join(map(str, s)) for s in self.input_shapes)
        return (f"Report(model={self.model!r}, input_shapes={shapes!r}, device={self.device!r}, "
                f"activation_bytes={self.activation_bytes}, peak_bytes={self.peak_bytes}, "
                f"saved=<{len(self.saved)} tensors>)")

    @property
    def first_step_peak_bytes(self) -> int:
        """The first step's peak: parameters, buffers and the batch at its start, the optimizer's
        states made during it (``peak_bytes`` is the same figure, under its older name)."""
        return self.peak_bytes

    @property
    def run_peak_bytes(self) -> int:
        """The run's max allocated: the larger of the first step's and the later steps' (which hold
        the optimizer states from their start), what ``torch.cuda.max_memory_allocated()`` reads
        after a few steps (the allocator model's block bytes on the CUDA target)."""
        return self.memory.run_max_allocated if self.memory is not None else self.peak_bytes

    # -- questions that capture again: a thin facade over graphmem/formula and graphmem/planning
    def _live(self, question: str) -> "Report":
        """This report, when it holds its captured step; a report read back from JSON
        (``from_dict``) has none, and ``question`` (what was asked) needs one."""
        if self.step is None:
            raise UsageError(f"this report was loaded from JSON (Report.from_dict) and holds no captured step to "
                             f"answer {question}: analyze the model again with graphmem.analyze")
        return self

    @property
    def coefficients(self) -> Any:
        """Exact formulas (graphmem.formula.Coefficients): ``.activation`` / ``.peak`` polynomials
        in the input's dimensions and, for a block chain, ``.alpha``, ``.beta``, ``.gamma``."""
        if self.known_coefficients is not None:
            return self.known_coefficients
        from graphmem.formula import report_api as formula_api  # sympy only when formulas are asked for

        return formula_api.coefficients(self._live("its formulas"))

    def formula(self, d_model: Optional[int] = None, n_heads: Optional[int] = None, checks: int = 5,
                tick: Any = None) -> Any:
        """Fit the exact formulas (see ``coefficients``), with overrides; ``report.keeping(coefficients=...)``
        keeps them with the report (renderers and JSON show them)."""

        from graphmem.formula import report_api as formula_api  # sympy only when formulas are asked for

        return formula_api.formula(self._live("formula()"), d_model, n_heads, checks, tick)

    def fit(self, memory: Any, seq: Optional[int] = None, batch: Optional[int] = None, tick: Any = None,
            figure: Optional[str] = None) -> Any:
        """The largest batch (at sequence length ``seq``, default: this report's) or, given
        ``batch``, the largest sequence length whose peak fits in ``memory`` (bytes or a string
        like "80GiB"): a graphmem.formula.FitAnswer, exact from the peak formula and confirmed
        by captures at the answer and one above; then judged on ``figure`` of the run
        (passes/run_memory.py: "allocated", "reserved" or "device", the device total, default on the
        CUDA target; "allocated" on the CPU's), the whole step captured at each value tried."""

        from graphmem.formula import report_api as formula_api  # sympy only when formulas are asked for

        return formula_api.fit(self._live("fit()"), memory, seq, batch, tick, figure)

    def max_batch(self, memory: Any, seq: Optional[int] = None) -> int:
        """Largest batch size whose predicted peak fits in ``memory``, e.g. ``max_batch("80GiB", seq=1024)``."""
        return int(self.fit(memory, seq=seq).value)

    def sweep(self, batches: Any, seqs: Any, tick: Any = None) -> Any:
        """Activation and peak bytes over a grid of (batch, seq) from the exact formulas, with
        the first point spot-checked by a capture: a graphmem.formula.Sweep."""

        from graphmem.formula import report_api as formula_api  # sympy only when formulas are asked for

        return formula_api.sweep(self._live("sweep()"), batches, seqs, tick)

    @property
    def planner(self) -> Any:
        """graphmem.planning.Planner for the model's chain of blocks (measured once, a few captures)."""

        return planning_api.planner(self._live("its planner"), False)

    def plan(self, budget: Any = None, max_overhead: Any = None, selective: Any = False,
             figure: Optional[str] = None) -> Any:
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

        return planning_api.plan(self._live("plan()"), budget, max_overhead, selective, figure)

    def plans(self, budget: Any = None, max_overhead: Any = None, points: int = 50, selective: Any = False,
              figure: Optional[str] = None) -> Any:
        """graphmem.planning.PlanSummary: the chosen plan (if a limit is given), the baselines beside
        graphmem's plan at their own peak, and the Pareto frontier; ``report.keeping(plans=...)``
        keeps it with the report (renderers and JSON show it)."""

        return planning_api.plans(self._live("plans()"), budget, max_overhead, points, selective, figure)

    def advise(self, memory: Any, ranks: int = 8, lora_rank: int = 16, tick: Any = None, combine: bool = False,
               figure: Optional[str] = None) -> Any:
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

        return advise(self._live("advise()"), memory, ranks, lora_rank, tick, combine, figure)

    def memory_budgets(self, values: Any, tick: Any = None) -> Any:
        """Compiled mode: the step at each value of torch.compile's activation memory budget
        (``torch._functorch.config.activation_memory_budget``, 0 to 1), each partitioned by the
        real min-cut partitioner: a graphmem.passes.memory_budget.BudgetSweep (saved bytes, peak,
        recompute FLOPs per value, and where the peak is not monotonic). ``report.keeping(memory_budgets=...)``
        keeps it with the report (renderers and JSON show it).

        >>> sweep = report.memory_budgets([1, 0.8, 0.5, 0.2])  # doctest: +SKIP
        >>> [(p.budget, p.peak_bytes) for p in sweep.points], sweep.rises  # doctest: +SKIP
        """

        return memory_budget_api.memory_budgets(self._live("memory_budgets()"), values, tick)

    def keeping(self, coefficients: Any = None, plans: Optional[PlanSummary] = None,
                memory_budgets: Optional[BudgetSweep] = None) -> "Report":
        """This report with answers kept beside it (formulas, a plan summary, a budget sweep), which
        renderers and ``to_dict`` then show; the ones not given stay as they were.

        >>> report = report.keeping(plans=report.plans(budget="40GiB"))  # doctest: +SKIP
        """
        return dataclasses.replace(
            self, known_coefficients=coefficients if coefficients is not None else self.known_coefficients,
            known_plans=plans if plans is not None else self.known_plans,
            known_memory_budgets=memory_budgets if memory_budgets is not None else self.known_memory_budgets)

    @staticmethod
    def build(g: StepGraph, lv: Liveness, sv: SavedSet, model: str, input_shapes: tuple, loss: str,
              notes: tuple[str, ...] = (), source: Any = None, cuda_allocator: Optional[AllocatorResult] = None,
              budget: Optional[StepBudget] = None, sharding: Optional[RankScope] = None,
              memory: Optional[RunMemory] = None) -> "Report":
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
            sharding=sharding, memory=memory,
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
                          "dtype": t.dtype, "bytes": t.nbytes, "created": t.created, "freed": t.freed, "sid": t.sid}
                         for t in self.live_at_peak],
            },
            "saved": [{"op": t.op, "module": t.module, "shape": list(t.shape), "dtype": t.dtype,
                       "bytes": t.bytes, "category": t.category, "created": t.created,
                       "released": t.released, "saved_by": list(t.saved_by), "sid": t.sid} for t in self.saved],
            "modules": [{"path": m.path, "activation_bytes": m.activation_bytes, "self_bytes": m.self_bytes,
                         "count": m.count} for m in self.modules],
            "num_ops": self.num_ops,
            "phases": dict(self.phase_start),
            "notes": list(self.notes),
            **({"cuda_allocator": {"max_allocated": self.cuda_allocator.max_allocated,
                                   "max_reserved": self.cuda_allocator.max_reserved,
                                   "fragmentation": self.cuda_allocator.fragmentation,
                                   "segments": self.cuda_allocator.segments}} if self.cuda_allocator is not None else {}),
            **({"memory": self.memory.to_dict()} if self.memory is not None else {}),
            **({"coefficients": self.known_coefficients.to_dict()} if self.known_coefficients is not None else {}),
            **({"budget": self.budget.to_dict()} if self.budget is not None else {}),
            **({"compiled": self.compiled.to_dict()} if self.compiled is not None else {}),
            **({"sharding": self.sharding.to_dict()} if self.sharding is not None else {}),
            **({"plan": self.known_plans.to_dict()} if self.known_plans is not None else {}),
            **({"memory_budgets": self.known_memory_budgets.to_dict()} if self.known_memory_budgets is not None else {}),
            "exact": {name: to_json(getattr(self, name), _FIELD_TYPES[name]) for name in EXACT
                      if getattr(self, name) is not None},
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Report":
        """The report ``to_dict`` wrote (``graphmem analyze --json``), equal to it field by field; it
        holds no captured step, so questions that capture again (plans, formulas, fits, advise)
        ask to analyze the model again."""
        if not isinstance(d, dict) or "exact" not in d:
            raise UsageError("not a JSON report written by this graphmem (no \"exact\" key): write it again with "
                             "Report.to_dict() (`json` on the command line)")
        try:
            return Report._from_dict(d)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise UsageError(f"not a complete graphmem JSON report ({type(e).__name__}: {e}): write it again with "
                             "Report.to_dict() (`json` on the command line)") from None

    @staticmethod
    def _from_dict(d: dict[str, Any]) -> "Report":
        p, exact = d["peak"], d["exact"]
        live = tuple(from_json(LiveTensor, {**t, "nbytes": t["bytes"]}) for t in p["live"])
        return Report(
            model=d["model"], input_shapes=tuple(tuple(s) for s in d["input_shapes"]), loss=d["loss"],
            parameter_bytes=d["parameter_bytes"], buffer_bytes=d["buffer_bytes"], input_bytes=d["input_bytes"],
            gradient_bytes=d["gradient_bytes"], activation_bytes=d["activation_bytes"],
            by_category=dict(d["by_category"]), peak_bytes=d["peak_bytes"], peak_index=p["index"],
            peak_phase=p["phase"], peak_op=p["op"], peak_module=p["module"], live_at_peak=live,
            baseline_bytes=p["baseline_bytes"], saved=tuple(from_json(SavedTensor, t) for t in d["saved"]),
            modules=tuple(from_json(ModuleSaved, m) for m in d["modules"]), num_ops=d["num_ops"],
            phase_start=dict(d["phases"]), notes=tuple(d["notes"]),
            attention_backends=dict(d["target"]["attention_backends"]),
            **{name: from_json(_FIELD_TYPES[name], exact.get(name)) for name in EXACT})


_FIELD_TYPES = field_types(Report)
