"""``AnalysisView``: what the layers below graphmem/report/ (formula, planning, advise) read of a live
analysis, as a Protocol, so that they take a typed value without importing graphmem.report
(tests/layout/test_layout.py: the report layer sits above them). graphmem/report/live.py ``Analysis`` satisfies it.

``step``, ``liveness`` and ``source`` are the live capture: the step graph, its liveness and the
graphmem/step/recapture.py Recapture that captures the same step again (at other sizes, with a plan
applied); a report read back from JSON has none of them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Union

from graphmem.errors import UsageError

if TYPE_CHECKING:
    from graphmem.passes import Liveness
    from graphmem.stepgraph import StepGraph


class AnalysisView(Protocol):
    @property
    def model(self) -> str: ...

    @property
    def activation_bytes(self) -> int: ...

    @property
    def baseline_bytes(self) -> int: ...

    @property
    def parameter_bytes(self) -> int: ...

    @property
    def gradient_bytes(self) -> int: ...

    @property
    def peak_bytes(self) -> int: ...

    @property
    def peak_op(self) -> str: ...

    @property
    def peak_phase(self) -> str: ...

    @property
    def attention_backends(self) -> dict[str, int]: ...

    @property
    def target(self) -> Any: ...  # graphmem.capture.target.Target

    @property
    def budget(self) -> Any: ...  # graphmem.training.spec.StepBudget, with a training spec

    @property
    def sharding(self) -> Any: ...  # the rank a per-rank or pipeline-stage report is (graphmem.report.RankScope)

    @property
    def memory(self) -> Any: ...  # graphmem.passes.run_memory.RunMemory: the run's figures

    @property
    def step(self) -> Optional[StepGraph]: ...

    @property
    def liveness(self) -> Optional[Liveness]: ...

    @property
    def source(self) -> Any: ...  # graphmem.step.recapture.Recapture (recapture sits above formula and planning)

    def fit(self, memory: Union[int, str, None], seq: Optional[int] = None, batch: Optional[int] = None,
            tick: Optional[Callable[[], None]] = None, figure: Optional[str] = None) -> Any:
        """graphmem.formula.FitAnswer (Analysis.fit)."""
        ...

    def plan(self, budget: Union[int, str, None] = None, max_overhead: Union[float, str, None] = None,
             selective: Union[bool, int, None] = False, figure: Optional[str] = None) -> Any:
        """graphmem.planning.CheckpointPlan (Analysis.plan)."""
        ...


def captured(report: AnalysisView) -> tuple[StepGraph, Liveness]:
    """The report's step graph and its liveness; a report read back from JSON has neither."""
    if report.step is None or report.liveness is None:
        raise UsageError("this report was loaded from JSON (Report.from_dict) and holds no captured step: "
                         "analyze the model again with graphmem.analyze")
    return report.step, report.liveness


__all__ = ["AnalysisView", "captured"]
