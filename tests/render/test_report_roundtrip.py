"""``Report.from_dict(r.to_dict()) == r`` for every golden report (tests/report_cases.py) and for a
report with kept plans, formulas and a memory-budget sweep; a report read back from JSON renders
to the same text and refuses, in one line, the questions that capture again."""
from __future__ import annotations

import json
from fractions import Fraction
from typing import Any, Optional

import pytest
import torch
from cases import tiny_gpt, tokens
from report_cases import CASES

import graphmem
from graphmem.errors import GraphmemError, UsageError
from graphmem.passes.saved import ModuleSaved
from graphmem.render import render_markdown, render_text
from graphmem.report import Report
from graphmem.report.jsondata import from_json, to_json
from graphmem.report.live import Analysis


def _through_json(report: Report) -> Report:
    return Report.from_dict(json.loads(json.dumps(report.to_dict())))


def _same(a: Report, b: Report) -> None:
    diffs = [f for f in a.__dataclass_fields__ if a.__dataclass_fields__[f].compare and getattr(a, f) != getattr(b, f)]
    assert not diffs, f"fields that differ after the round trip: {diffs}"
    assert a == b


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_report_round_trips_through_json(name: str) -> None:
    report = CASES[name]()
    back = _through_json(report)
    _same(report, back)
    assert back.to_dict() == report.to_dict()
    # the data only: a Report, not the live Analysis (no step graph, nothing that captures again)
    assert type(back) is Report and isinstance(report, Analysis) and not hasattr(back, "step")
    assert render_text(back) == render_text(report)
    assert render_markdown(back) == render_markdown(report)


def test_kept_answers_round_trip_and_render() -> None:
    """Plans and formulas kept with ``keeping`` travel in the JSON and render as before."""
    torch.manual_seed(0)
    report = graphmem.analyze(tiny_gpt(), tokens())
    kept = report.keeping(plans=report.plans(budget=report.peak_bytes - 1024), coefficients=report.formula(checks=1))
    assert report.known_plans is None and report.known_coefficients is None  # the report asked is unchanged
    back = _through_json(kept)
    _same(kept, back)
    assert back.known_coefficients.peak_at(report.input_shapes[0]) == report.peak_bytes
    assert render_text(back) == render_text(kept)
    assert back.to_dict()["plan"] == kept.to_dict()["plan"] and "coefficients" in back.to_dict()


def test_compiled_memory_budgets_round_trip() -> None:
    torch.manual_seed(0)
    report = graphmem.analyze(tiny_gpt(), tokens(), mode="compiled")
    kept = report.keeping(memory_budgets=report.memory_budgets([1, 0]))
    back = _through_json(kept)
    _same(kept, back)
    assert render_text(back) == render_text(kept)


def test_loaded_report_refuses_to_capture_again() -> None:
    torch.manual_seed(0)
    back = _through_json(graphmem.analyze(tiny_gpt(), tokens()))
    for ask in (lambda: back.plan(budget="1GiB"), lambda: back.formula(), lambda: back.coefficients,
                lambda: back.fit("1GiB"), lambda: back.sweep([1], [8]), lambda: back.planner,
                lambda: back.plans(), lambda: back.advise("1GiB"), lambda: back.memory_budgets([1])):
        with pytest.raises(UsageError, match="loaded from JSON .* analyze the model again") as e:
            ask()
        assert "\n" not in str(e.value)


def test_from_dict_refuses_other_json() -> None:
    with pytest.raises(GraphmemError, match="not a JSON report written by this graphmem"):
        Report.from_dict({"model": "x"})


# -- the codec (graphmem/report/jsondata.py) on its own
def test_codec_rebuilds_declared_types() -> None:
    hint: Any = dict[int, tuple[tuple[int, int], ...]]
    value = {3: ((1, 2),), 7: ()}
    assert from_json(hint, json.loads(json.dumps(to_json(value, hint)))) == value
    assert from_json(Optional[Fraction], to_json(Fraction(1, 3), Optional[Fraction])) == Fraction(1, 3)
    assert from_json(Any, to_json(frozenset({("a", 1)}))) == frozenset({("a", 1)})
    assert from_json(Any, to_json([1, (2, 3)])) == [1, (2, 3)]  # a list stays a list, a tuple a tuple
    m = ModuleSaved("h.0", 4096, 0, 2)
    assert to_json(m, ModuleSaved) == {"path": "h.0", "activation_bytes": 4096, "self_bytes": 0, "count": 2}
    assert from_json(Any, to_json(m)) == m  # under Any the class travels as "__type__"


def test_codec_imports_only_graphmem() -> None:
    with pytest.raises(UsageError, match="not a graphmem class"):
        from_json(Any, {"__type__": "os:system"})
    with pytest.raises(UsageError, match="not a polynomial"):
        from_json(Any, {"__sympy__": "__import__('os')"})


def test_a_report_is_data_and_the_analysis_is_live() -> None:
    """Report's own methods never capture: every question that captures again is the live Analysis's
    (graphmem/report/live.py), and no Report field is typed Any."""
    import dataclasses
    import typing

    live = {name for name, v in vars(Analysis).items() if callable(v) or isinstance(v, property)}
    for name in ("plan", "plans", "planner", "formula", "coefficients", "fit", "max_batch", "sweep", "advise",
                 "memory_budgets"):
        assert name in live and name not in vars(Report), name
    hints = typing.get_type_hints(Report)
    assert not [f.name for f in dataclasses.fields(Report) if "Any" in str(hints[f.name])]
    # about 20 fields (issue 37): the peak, the held bytes and the kept answers are one field each, read under
    # their old names through typed properties (33 fields before)
    assert len(dataclasses.fields(Report)) <= 22, [f.name for f in dataclasses.fields(Report)]
    assert {"peak", "held", "kept"} <= {f.name for f in dataclasses.fields(Report)}
    props = {n for n, v in vars(Report).items() if isinstance(v, property)}
    assert {"peak_bytes", "live_at_peak", "parameter_bytes", "known_plans"} <= props
