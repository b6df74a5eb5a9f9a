"""Report: the frozen result of one analysis (pass results + what was analyzed), data only: nothing in it
captures again. ``graphmem.analyze`` returns its live subclass, graphmem/report/live.py ``Analysis`` (the captured
step, and the questions that capture it again: plans, formulas, fits, advise, memory budgets); ``from_dict``
gives a Report back."""
from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn, Optional, Protocol, Self

from graphmem.capture.target import Target
from graphmem.errors import UsageError
from graphmem.formula import AnyCoefficients
from graphmem.jsontypes import JSON
from graphmem.passes import LiveTensor, ModuleSaved, SavedTensor
from graphmem.passes.allocator import AllocatorResult
from graphmem.passes.memory_budget import BudgetSweep
from graphmem.passes.modes import ModeComparison
from graphmem.passes.run_memory import FIGURE_NAMES, RunMemory, figure_for  # noqa: F401 (graphmem/ci.py)
from graphmem.planning.planner import PlanSummary
from graphmem.report.jsondata import field_types, from_json, to_json
from graphmem.training.spec import StepBudget

# the fields whose JSON under their own key is a view (derived numbers, names): to_dict writes them
# once more, exactly, under "exact" (graphmem/report/jsondata.py), so that from_dict gives them back
EXACT = ("device", "target", "cuda_allocator", "memory", "budget", "compiled", "sharding", "known_coefficients",
         "known_plans", "known_memory_budgets")

# what only a live analysis has (graphmem/report/live.py): its capture, and the questions that capture again
LIVE = frozenset({"step", "liveness", "source", "recapture", "answers", "coefficients", "formula", "fit", "max_batch",
                  "sweep", "planner", "planner_for", "plan", "plans", "advise", "memory_budgets"})


class NotLive(UsageError, AttributeError):
    """A Report read back from JSON asked what only a live Analysis answers (``getattr(r, name, None)`` and
    ``hasattr`` still see it as missing)."""


class RankScope(Protocol):
    """Which rank of a parallel step a report is (``Report.sharding``): graphmem/distributed/view.py's
    RankView (its wrappers, the formula beside it) or graphmem/distributed/pipeline_stages.py's
    Pipeline (its schedule). Defined here, not there: the report layer imports no
    graphmem.distributed (tests/layout/test_layout.py)."""

    def describe(self) -> str:
        """One line naming the rank and how the step is split (the first line of every view)."""
        ...

    def to_dict(self) -> dict[str, JSON]:
        """JSON-ready, under the report's ``sharding`` key."""
        ...


@dataclass(frozen=True)
class Held:
    """The bytes the step holds by kind: parameters, buffers and the batch from before it (its first op), and
    the gradients it makes (distinct storages, each once)."""

    parameters: int
    buffers: int
    inputs: int
    gradients: int


@dataclass(frozen=True)
class Peak:
    """The first step's peak: its bytes, where it falls (op index, phase, op, module), the tensors live there
    and the bytes held before the step (parameters, buffers, the batch)."""

    bytes: int
    index: int
    phase: str
    op: str
    module: str
    live: tuple[LiveTensor, ...]
    baseline_bytes: int


@dataclass(frozen=True)
class Kept:
    """Answers asked for and kept with the report (``Report.keeping``): renderers and ``to_dict`` show them."""

    coefficients: Optional[AnyCoefficients] = None
    plans: Optional[PlanSummary] = None
    memory_budgets: Optional[BudgetSweep] = None


@dataclass(frozen=True)
class Report:
    model: str
    device: str
    input_shapes: tuple[tuple[int, ...], ...]
    loss: str  # how the loss was made
    held: Held  # parameters, buffers, the batch, the gradients (the ``*_bytes`` properties read it)
    activation_bytes: int  # saved for backward (distinct storages)
    by_category: dict[str, int]  # activation bytes by kind of saved tensor
    peak: Peak  # the FIRST step's peak (``peak_bytes``, ``first_step_peak_bytes``); the run's is ``run_peak_bytes``
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
    kept: Kept = Kept()  # answers asked for and kept with the report (``keeping``)
    batch: dict[str, str] = field(default_factory=dict)  # choices in the batch graphmem made (hf_batch.settings)

    # the groups' figures under the names the JSON, the renderers and the layers below read (AnalysisView)
    @property
    def parameter_bytes(self) -> int:
        """Bytes of parameters, held before the step."""
        return self.held.parameters

    @property
    def buffer_bytes(self) -> int:
        """Bytes of buffers, held before the step."""
        return self.held.buffers

    @property
    def input_bytes(self) -> int:
        """Bytes of the batch, held before the step."""
        return self.held.inputs

    @property
    def gradient_bytes(self) -> int:
        """Bytes of the gradients the step makes."""
        return self.held.gradients

    @property
    def peak_bytes(self) -> int:
        """The first step's peak (``first_step_peak_bytes``)."""
        return self.peak.bytes

    @property
    def peak_index(self) -> int:
        """The op at the first step's peak (-1: before the step)."""
        return self.peak.index

    @property
    def peak_phase(self) -> str:
        """The phase of the op at the peak."""
        return self.peak.phase

    @property
    def peak_op(self) -> str:
        """The op at the peak."""
        return self.peak.op

    @property
    def peak_module(self) -> str:
        """The module running at the peak."""
        return self.peak.module

    @property
    def live_at_peak(self) -> tuple[LiveTensor, ...]:
        """The tensors live at the peak."""
        return self.peak.live

    @property
    def baseline_bytes(self) -> int:
        """Bytes held before the step."""
        return self.peak.baseline_bytes

    @property
    def known_coefficients(self) -> Optional[AnyCoefficients]:
        """Formulas kept with the report."""
        return self.kept.coefficients

    @property
    def known_plans(self) -> Optional[PlanSummary]:
        """A plan summary kept with the report."""
        return self.kept.plans

    @property
    def known_memory_budgets(self) -> Optional[BudgetSweep]:
        """A budget sweep kept with the report."""
        return self.kept.memory_budgets

    def __eq__(self, other: object) -> bool:
        """Field by field, over the Report's own fields: a report read back from JSON equals the live
        Analysis it was written from (graphmem/report/live.py adds the captured step, which is not data)."""
        if not isinstance(other, Report):
            return NotImplemented
        return all(getattr(self, f.name) == getattr(other, f.name) for f in dataclasses.fields(Report))

    if not TYPE_CHECKING:  # (at run time only: to a type checker a Report has its fields and methods, no more)
        def __getattr__(self, name: str) -> NoReturn:
            """A question that captures again (``plan``, ``formula``, ``fit``, ``advise``, ...), asked of a Report
            read back from JSON: it holds no captured step (graphmem/report/live.py ``Analysis`` does)."""
            if name in LIVE:
                raise NotLive(f"this report was loaded from JSON (Report.from_dict) and holds no captured step to "
                              f"answer {name}: analyze the model again with graphmem.analyze")
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

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

    def keeping(self, coefficients: Optional[AnyCoefficients] = None, plans: Optional[PlanSummary] = None,
                memory_budgets: Optional[BudgetSweep] = None) -> Self:
        """This report with answers kept beside it (formulas, a plan summary, a budget sweep), which
        renderers and ``to_dict`` then show; the ones not given stay as they were.

        >>> report = report.keeping(plans=report.plans(budget="40GiB"))  # doctest: +SKIP
        """
        k = self.kept
        return dataclasses.replace(self, kept=Kept(coefficients if coefficients is not None else k.coefficients,
                                                   plans if plans is not None else k.plans,
                                                   memory_budgets if memory_budgets is not None else k.memory_budgets))

    def to_dict(self) -> dict[str, JSON]:
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
    def from_dict(d: object) -> "Report":
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
        known = {name: from_json(_FIELD_TYPES[name], exact.get(name)) for name in EXACT}
        return Report(
            model=d["model"], input_shapes=tuple(tuple(s) for s in d["input_shapes"]), loss=d["loss"],
            held=Held(d["parameter_bytes"], d["buffer_bytes"], d["input_bytes"], d["gradient_bytes"]),
            activation_bytes=d["activation_bytes"], by_category=dict(d["by_category"]),
            peak=Peak(d["peak_bytes"], p["index"], p["phase"], p["op"], p["module"], live, p["baseline_bytes"]),
            saved=tuple(from_json(SavedTensor, t) for t in d["saved"]),
            modules=tuple(from_json(ModuleSaved, m) for m in d["modules"]), num_ops=d["num_ops"],
            phase_start=dict(d["phases"]), notes=tuple(d["notes"]),
            attention_backends=dict(d["target"]["attention_backends"]),
            kept=Kept(*(known.pop(f"known_{k}") for k in ("coefficients", "plans", "memory_budgets"))), **known)


# each EXACT name's declared type (the kept answers' under their ``known_`` names)
_FIELD_TYPES = {**field_types(Report), **{f"known_{k}": t for k, t in field_types(Kept).items()}}
