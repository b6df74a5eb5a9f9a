"""graphmem.assert_activation_bytes: a memory budget for a test suite."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

import graphmem
from graphmem.ci import Baseline
from graphmem.errors import UsageError
from graphmem.render import render_json

X = (torch.randn(8, 16),)
RELU_BYTES = 8 * 16 * 4 + 8 * 32 * 4  # the batch (for Linear 0) + ReLU's output (ReLU and Linear 2): 1536


def net(act: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), act, nn.Linear(32, 4))


def test_within_budget_returns_the_report() -> None:
    report = graphmem.assert_activation_bytes(net(nn.ReLU()), X, max_bytes=RELU_BYTES)  # the limit is inclusive
    assert report.activation_bytes == RELU_BYTES == 1536


def test_over_budget_names_the_largest_contributors() -> None:
    # GIVEN a budget that fits the ReLU net WHEN ReLU becomes GELU, which also saves its input
    with pytest.raises(AssertionError) as failure:
        graphmem.assert_activation_bytes(net(nn.GELU()), X, max_bytes=RELU_BYTES)
    # THEN the message says by how much, and which tensors and modules hold the bytes
    lines = str(failure.value).splitlines()
    assert lines[0] == ("Sequential saves 2.50 KiB (2,560 B) for backward, over the budget of 1.50 KiB (1,536 B) "
                        "by 1.00 KiB (1,024 B)")
    assert lines[2] == "largest saved tensors (top 3 of 3):"
    assert [line.split()[:3] for line in lines[5:8]] == [["aten.addmm.default", "0", "8x32"],
                                                        ["aten.gelu.default", "1", "8x32"], ["input", "0", "8x16"]]
    assert lines[9] == "modules saving the most (their own ops):"
    assert [line.split() for line in lines[12:14]] == [["0", "1.50", "KiB", "60.0%"], ["1", "1.00", "KiB", "40.0%"]]
    assert len(lines) == 14  # no baseline, no comparison


@pytest.mark.parametrize("form", ["report", "dict", "file"])
def test_over_budget_with_a_baseline_shows_what_changed(form: str, tmp_path: Path) -> None:
    base = graphmem.assert_activation_bytes(net(nn.ReLU()), X, max_bytes=RELU_BYTES)
    path = tmp_path / "baseline.json"
    path.write_text(render_json(base))
    forms: dict[str, Baseline] = {"report": base, "dict": base.to_dict(), "file": str(path)}
    baseline = forms[form]
    with pytest.raises(AssertionError) as failure:
        graphmem.assert_activation_bytes(net(nn.GELU()), X, max_bytes=RELU_BYTES, baseline=baseline)
    text = str(failure.value)
    assert "what changed since the baseline:" in text
    assert "Saved only in now: 2 tensors, 2.00 KiB" in text  # net.0's output (GELU's input) and GELU's output
    assert "Saved only in baseline: 1 tensor, 1.00 KiB" in text  # ReLU's output
    assert "activations    1.50 KiB  2.50 KiB  +1.00 KiB  +1,024 B  +66.7%" in text


def test_max_bytes_as_a_size() -> None:
    assert graphmem.assert_activation_bytes(net(nn.ReLU()), X, max_bytes="1.5KiB").activation_bytes == 1536
    with pytest.raises(AssertionError, match=r"over the budget of 1.00 KiB \(1,024 B\) by 512 B"):
        graphmem.assert_activation_bytes(net(nn.ReLU()), X, max_bytes="1KiB")


@pytest.mark.parametrize("bad", [-1, 1.5, True, None])
def test_max_bytes_must_be_bytes(bad: object) -> None:
    with pytest.raises(UsageError, match="max_bytes must be a non-negative int \\(bytes\\) or a size like '3GiB'"):
        graphmem.assert_activation_bytes(net(nn.ReLU()), X, max_bytes=bad)  # type: ignore[arg-type]
