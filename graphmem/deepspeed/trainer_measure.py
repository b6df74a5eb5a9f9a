"""A Trainer's DeepSpeed rank measured (graphmem/step/measure.py dispatches here): the first step captured
through the Trainer's own code (graphmem/deepspeed/trainer_capture.py), the whole step's table over rank r's
graph, and the later steps' peak from a second capture whose first step ran unrecorded, as for DeepSpeed's
engine called directly (graphmem/step/measure.py ``_deepspeed``)."""
from __future__ import annotations

import dataclasses
from typing import Any

from graphmem.passes import liveness, notes, saved
from graphmem.step.recapture import Captured
from graphmem.training.hf_trainer_deepspeed import TrainerDeepSpeed


def trainer_deepspeed(spec: Any, p: TrainerDeepSpeed) -> tuple[Captured, tuple[str, ...]]:
    """Rank ``p.rank``'s captured step and the report's notes (DeepSpeed's held tensors by where it keeps them)."""
    from graphmem.deepspeed.report import engine_lines
    from graphmem.deepspeed.trainer_capture import capture_trainer_engine
    from graphmem.training.spec import step_budget

    g = capture_trainer_engine(spec.module, spec.inputs.captured, spec.target, p)
    g.train = spec.training.train
    lv, sv = liveness(g), saved(g)
    budget = step_budget(g, lv, sv, spec.training, spec.module, (), p.describe())
    later = capture_trainer_engine(spec.module, spec.inputs.captured, spec.target, p, warm=True)
    lv_later = liveness(later)
    budget = dataclasses.replace(budget, rank=dataclasses.replace(
        budget.rank, later_peak_bytes=lv_later.peak_bytes, later_peak_index=lv_later.peak_index,
        later_peak_phase=lv_later.peak_phase if lv_later.peak_index >= 0 else "before the step"))
    step = Captured(g, lv, sv, budget, spec.module, (), spec.target)
    return step, notes(g) + (p.describe(),) + engine_lines(g, lv, p)  # type: ignore[arg-type]  # (reads the graph only)


__all__ = ["trainer_deepspeed"]
