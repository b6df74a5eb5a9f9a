"""The golden reports (tests/report_cases.py) as tests/render/test_report_golden.py checks them and
tests/golden/regen.py writes them: each case analyzed under a named oneDNN ISA (graphmem/oprules/isa.py
``assume``) and two CPU threads, so a golden file is the same on every machine; compared with its file
up to the numbering of storage ids.

Storage ids are numbered in creation order, kernel scratch included, so a rule that adds or drops one
scratch storage renumbers every storage after it without changing a byte. ``canonical`` renumbers them by
first appearance (keys sorted, as the files are written): two reports equal up to ids compare equal,
and every byte, shape, op, module and which storage is which must still match.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conftest import torch_settings
from report_cases import CASES

import graphmem.oprules.isa as isa

GOLDEN = Path(__file__).parent / "golden" / "reports"
# Reports whose numbers come from graphmem's oneDNN convolution rules, which follow the ISA oneDNN runs
# (graphmem/oprules/conv_gemm.py ``simd_w``): kept for both ISAs, the AVX2 ones under golden/reports/avx2/.
ISA_CASES = frozenset({"acc_hf_vit", "acc_timm_convnext_atto", "acc_timm_resnet18", "acc_timm_vit_tiny",
                       "acc_torchvision_mobilenet_v3_small", "acc_torchvision_resnet18", "zoo_convnext"})
THREADS = 2  # the thread count the per-thread scratch rules read (graphmem/oprules/conv_gemm.py ``threads``)


def golden_cases() -> list[tuple[str, str]]:
    """(case, ISA) for every golden file: each case under AVX-512's rules, ISA_CASES under AVX2's too."""
    return sorted([(name, isa.AVX512) for name in CASES] + [(name, isa.AVX2) for name in ISA_CASES])


def golden_path(name: str, kernels: str) -> Path:
    return GOLDEN / "avx2" / f"{name}.json" if kernels == isa.AVX2 else GOLDEN / f"{name}.json"


def analyze_case(name: str, kernels: str) -> tuple[Any, Any]:
    """The case's Report and its ``to_dict()`` as JSON reads it back, under ``kernels``' rules."""
    with isa.assume(kernels), torch_settings(num_threads=THREADS):
        report = CASES[name]()
    return report, json.loads(json.dumps(report.to_dict()))


def write_golden(name: str, kernels: str, got: Any) -> Path:
    path = golden_path(name, kernels)
    path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return path


def canonical(value: Any) -> Any:
    """``value`` with every ``sid`` renumbered 0, 1, 2, ... by first appearance (sorted keys, list order)."""
    ids: dict[Any, int] = {}

    def walk(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: ids.setdefault(v[k], len(ids)) if k == "sid" else walk(v[k]) for k in sorted(v)}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v
    return walk(value)


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two JSON values differ (paths; the caller shows the first few)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: only in {'new' if k in a else 'golden'}" for k in set(a) ^ set(b)]
        for k in a.keys() & b.keys():
            out += differences(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {str(a)[:120]} != {str(b)[:120]}"]
