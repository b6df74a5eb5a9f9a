"""Every golden report (tests/report_cases.py) equals its saved ``to_dict()`` field by field, and
``Report.from_dict`` gives the report back from that JSON."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import UPDATE_GOLDEN
from report_cases import CASES

from graphmem.report import Report

GOLDEN = Path(__file__).parent / "golden" / "reports"
# Reports whose numbers come from graphmem's oneDNN convolution rules, which follow the CPU's ISA
# (graphmem/oprules/conv_gemm.py ``simd_w``): on an AVX2 CPU they are checked against golden/reports/avx2/
AVX2_CASES = {"acc_hf_vit", "acc_timm_convnext_atto", "acc_timm_resnet18", "acc_timm_vit_tiny",
              "acc_torchvision_mobilenet_v3_small", "acc_torchvision_resnet18", "zoo_convnext"}
AVX2 = torch.backends.cpu.get_cpu_capability() == "AVX2"


def _diff(a: object, b: object, path: str = "") -> list[str]:
    """Where two JSON values differ (the first few paths)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: only in {'new' if k in a else 'golden'}" for k in set(a) ^ set(b)]
        for k in a.keys() & b.keys():
            out += _diff(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {str(a)[:120]} != {str(b)[:120]}"]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_report_equals_golden(name: str) -> None:
    report = CASES[name]()
    got = json.loads(json.dumps(report.to_dict()))
    path = GOLDEN / "avx2" / f"{name}.json" if AVX2 and name in AVX2_CASES else GOLDEN / f"{name}.json"
    if UPDATE_GOLDEN:
        path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    assert path.exists(), f"{path} is missing; create it with GRAPHMEM_UPDATE_GOLDEN=1"
    golden = json.loads(path.read_text(encoding="utf-8"))
    diffs = _diff(got, golden)
    assert not diffs, f"{name} differs from its golden report: " + "; ".join(sorted(diffs)[:10])
    assert Report.from_dict(golden) == report  # the saved file gives the report back
