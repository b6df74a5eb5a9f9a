"""Every golden report (tests/report_cases.py) equals its saved ``to_dict()`` field by field, up to the
numbering of storage ids (tests/golden_reports.py ``canonical``), and ``Report.from_dict`` gives the
report back from its JSON. The cases whose numbers come from oneDNN's convolution rules are checked
under the AVX-512 and the AVX2 rules on every machine (graphmem/oprules/isa.py ``assume``).
``python tests/golden/regen.py`` rewrites the files (so does ``GRAPHMEM_UPDATE_GOLDEN=1`` here): check the diff.
"""
from __future__ import annotations

import json

import pytest
from conftest import UPDATE_GOLDEN
from golden_reports import analyze_case, canonical, differences, golden_cases, golden_path, write_golden

from graphmem.report import Report


@pytest.mark.slow
@pytest.mark.parametrize("name,kernels", golden_cases())
def test_report_equals_golden(name: str, kernels: str) -> None:
    report, got = analyze_case(name, kernels)
    path = golden_path(name, kernels)
    if UPDATE_GOLDEN:
        write_golden(name, kernels, got)
    assert path.exists(), f"{path} is missing; create it with python tests/golden/regen.py {name}"
    golden = json.loads(path.read_text(encoding="utf-8"))
    diffs = differences(canonical(got), canonical(golden))
    assert not diffs, f"{name} ({kernels}) differs from its golden report: " + "; ".join(sorted(diffs)[:10])
    assert Report.from_dict(got) == report  # the JSON gives the report back
    assert json.loads(json.dumps(Report.from_dict(golden).to_dict())) == golden  # and the saved file its own


def test_canonical_ids_ignore_numbering_not_identity() -> None:
    """A shifted numbering compares equal; two storages swapped, or one storage split in two, do not."""
    a = {"peak": {"live": [{"sid": 7, "bytes": 4}, {"sid": 9, "bytes": 8}]}, "saved": [{"sid": 9}]}
    shifted = {"peak": {"live": [{"sid": 8, "bytes": 4}, {"sid": 11, "bytes": 8}]}, "saved": [{"sid": 11}]}
    swapped = {"peak": {"live": [{"sid": 7, "bytes": 4}, {"sid": 9, "bytes": 8}]}, "saved": [{"sid": 7}]}
    split = {"peak": {"live": [{"sid": 7, "bytes": 4}, {"sid": 9, "bytes": 8}]}, "saved": [{"sid": 10}]}
    assert canonical(a) == canonical(shifted)
    assert canonical(a) != canonical(swapped) and canonical(a) != canonical(split)
