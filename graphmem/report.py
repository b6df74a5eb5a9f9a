"""Report: the frozen result of one analysis (pass results + what was analyzed)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from graphmem.passes import LiveTensor, Liveness, ModuleSaved, SavedSet, SavedTensor
from graphmem.stepgraph import StepGraph


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
    target: Any = None  # graphmem.target.Target
    attention_backends: dict = field(default_factory=dict)  # CUDA target: SDPA kernel -> calls
    cuda_allocator: Any = None  # CUDA target: passes.allocator.AllocatorResult (caching allocator model)
    budget: Any = None  # graphmem.whole_step.StepBudget: optimizer, precision, LoRA, per-rank budget
    compiled: Any = None  # compiled mode: passes.modes.ModeComparison (eager beside compiled)
    step: Optional[StepGraph] = field(default=None, repr=False, compare=False)
    liveness: Optional[Liveness] = field(default=None, repr=False, compare=False)
    source: Any = field(default=None, repr=False, compare=False)  # how to capture at other sizes
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def coefficients(self) -> Any:
        """Exact formulas (graphmem.formula.Coefficients): ``.activation`` / ``.peak`` polynomials
        in the input's dimensions and, for a block chain, ``.alpha``, ``.beta``, ``.gamma``."""
        if "coefficients" not in self._cache:
            self._cache["coefficients"] = self.formula()
        return self._cache["coefficients"]

    @property
    def known_coefficients(self) -> Any:
        """The formulas if they were computed (``coefficients``, ``formula(keep=True)``), else None:
        renderers show them only when asked for."""
        return self._cache.get("coefficients")

    def formula(self, d_model: Optional[int] = None, n_heads: Optional[int] = None, checks: int = 5,
                tick: Any = None, keep: bool = False) -> Any:
        """Fit the exact formulas (see ``coefficients``), with overrides; ``keep`` stores them
        as this report's ``coefficients``."""
        from graphmem import formula

        if self.source is None:
            raise formula.UsageError("this report has no model to capture again (built by hand)")
        sampler = self.source.sampler(tick)
        result: Any  # formula.Coefficients, or piecewise.PiecewiseCoefficients around a sliding window
        try:
            result = formula.fit(sampler, self.source.names, d_model=d_model, n_heads=n_heads, checks=checks)
        except formula.NotPolynomialError:  # one polynomial on each side of a sliding window?
            from graphmem.piecewise import fit_windowed, window_of

            window = window_of(self.source.module)
            if window is None:
                raise
            src = self.source
            result = fit_windowed(lambda base: src.sampler_for(base, src.dims, tick), src.names, src.dims,
                                  src.base_shape, window, checks, d_model=d_model, n_heads=n_heads)
        if keep:
            self._cache["coefficients"] = result
        return result

    def fit(self, memory: Any, seq: Optional[int] = None, batch: Optional[int] = None, tick: Any = None) -> Any:
        """The largest batch (at sequence length ``seq``, default: this report's) or, given
        ``batch``, the largest sequence length whose peak fits in ``memory`` (bytes or a string
        like "80GiB"): a graphmem.formula.FitAnswer, exact from the peak formula and confirmed
        by captures at the answer and one above."""
        from graphmem import formula
        from graphmem.load import parse_bytes

        if self.source is None:
            raise formula.UsageError("this report has no model to capture again (built by hand)")
        if seq is not None and batch is not None:
            raise formula.UsageError("give seq= (to find the batch) or batch= (to find the sequence length), not both")
        memory_bytes = parse_bytes(memory)
        base = list(self.source.base_shape)
        if (seq is not None or batch is not None) and tuple(self.source.names[:2]) != ("b", "s"):
            raise formula.UsageError(f"this model's input {tuple(base)} has no sequence dimension; use fit without seq/batch")
        if batch is None:
            if seq is not None:
                if len(base) < 2:
                    raise formula.UsageError("seq= needs a (batch, seq, ...) input")
                base[1] = seq
            sampler, name = self.source.sampler_for(tuple(base), (0,), tick), "b"
        else:
            if len(base) < 2:
                raise formula.UsageError("batch= needs a (batch, seq, ...) input")
            base[0] = batch
            sampler, name = self.source.sampler_for(tuple(base), (1,), tick), "s"
        try:
            coeffs: Any = formula.fit(sampler, (name,), checks=0)  # the confirming captures check it
        except formula.NotPolynomialError:
            from graphmem.piecewise import fit_windowed, window_of

            window = window_of(self.source.module) if name == "s" else None
            if window is None:
                raise
            src = self.source
            coeffs = fit_windowed(lambda b: src.sampler_for(b, (1,), tick), ("s",), (1,), tuple(base), window, 0)
        return formula.largest_fitting(coeffs, sampler, memory_bytes, name, {})

    def max_batch(self, memory: Any, seq: Optional[int] = None) -> int:
        """Largest batch size whose predicted peak fits in ``memory``, e.g. ``max_batch("80GiB", seq=1024)``."""
        return int(self.fit(memory, seq=seq).value)

    def sweep(self, batches: Any, seqs: Any, tick: Any = None) -> Any:
        """Activation and peak bytes over a grid of (batch, seq) from the exact formulas, with
        the first point spot-checked by a capture: a graphmem.formula.Sweep."""
        from graphmem import formula

        if self.source is None:
            raise formula.UsageError("this report has no model to capture again (built by hand)")
        return formula.sweep(self.source, list(batches), list(seqs), tick)

    @property
    def planner(self) -> Any:
        """graphmem.plan.Planner for the model's chain of blocks (measured once, a few captures)."""
        if "planner" not in self._cache:
            from graphmem.plan import Planner

            self._cache["planner"] = Planner(self)
        return self._cache["planner"]

    def plan(self, budget: Any = None, max_overhead: Any = None, selective: Any = False) -> Any:
        """The checkpoint plan (graphmem.plan.CheckpointPlan) with the fewest recompute FLOPs
        whose predicted peak fits ``budget`` (bytes or "40GiB"), or the lowest-peak plan whose
        recompute stays within ``max_overhead`` of the step's FLOPs (0.2 or "20%").
        ``selective=True`` (or a number of levels) also lets each checkpointed segment keep
        some ops' outputs (graphmem/selective.py).

        >>> plan = report.plan(budget="40GiB")            # doctest: +SKIP
        >>> plan.segments, plan.peak_bytes, plan.overhead  # doctest: +SKIP
        >>> handle = plan.apply(model)                     # torch.utils.checkpoint; handle.remove() undoes
        """
        from graphmem.plan import parse_limits
        from graphmem.selective import selective_planner

        limits = parse_limits(budget, max_overhead)
        return selective_planner(self, selective).plan(*limits)

    def plans(self, budget: Any = None, max_overhead: Any = None, points: int = 50, keep: bool = False,
              selective: Any = False) -> Any:
        """graphmem.plan.PlanSummary: the chosen plan (if a limit is given), the baselines beside
        graphmem's plan at their own peak, and the Pareto frontier; ``keep`` adds it to JSON."""
        from graphmem.plan import parse_limits, summarize
        from graphmem.selective import selective_planner

        limits = parse_limits(budget, max_overhead, required=False)
        summary = summarize(selective_planner(self, selective), *limits, points=points)
        if keep:
            self._cache["plan_summary"] = summary
        return summary

    @property
    def known_plans(self) -> Any:
        return self._cache.get("plan_summary")

    @staticmethod
    def build(g: StepGraph, lv: Liveness, sv: SavedSet, model: str, input_shapes: tuple, loss: str,
              notes: tuple[str, ...] = (), source: Any = None, cuda_allocator: Any = None,
              budget: Any = None) -> "Report":
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
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: exact integers, no units."""
        return {
            "model": self.model,
            "target": {**(self.target.to_dict() if self.target is not None else {"device": self.device}),
                       "attention_backends": dict(self.attention_backends)},
            "input_shapes": [list(s) for s in self.input_shapes],
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
            **({"plan": self.known_plans.to_dict()} if self.known_plans is not None else {}),
        }
