"""A memory budget for tests: fail when a change makes a model save more for backward.

``assert_activation_bytes`` analyzes one training step (fake tensors, nothing allocated) and
raises AssertionError when the activation bytes exceed the budget, with the largest saved
tensors and modules in the message, and what changed when a baseline report is given.
``assert_peak_bytes`` does the same for one named figure of the run (passes/run_memory.py):
its max allocated, max reserved or device total.
"""
from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch
from tabulate import tabulate

from graphmem.api import ModelLike, UserInputs, analyze
from graphmem.errors import UsageError
from graphmem.render.compare import render_comparison
from graphmem.render.text import _module
from graphmem.report import Report
from graphmem.report.compare import compare, load_json_report
from graphmem.training.step import LossFn
from graphmem.units import fmt_bytes, fmt_share, parse_bytes

Baseline = Union[Report, dict, str, "os.PathLike[str]"]


def _contributors(report: Report, top: int) -> list[str]:
    rows = [[t.op, _module(t.module, report, t.created), "x".join(map(str, t.shape)) or "scalar", t.dtype,
             fmt_bytes(t.bytes), fmt_share(t.bytes, report.activation_bytes)] for t in report.saved[:top]]
    lines = [f"largest saved tensors (top {min(top, len(report.saved))} of {len(report.saved)}):",
             tabulate(rows, headers=["op", "module", "shape", "dtype", "bytes", "share"], tablefmt="simple",
                      colalign=("left", "left", "left", "left", "right", "right"))]
    mods = sorted((m for m in report.modules if m.self_bytes), key=lambda m: (-m.self_bytes, m.path))
    rows = [[_module(m.path), fmt_bytes(m.self_bytes), fmt_share(m.self_bytes, report.activation_bytes)]
            for m in mods[:top]]
    lines += ["", "modules saving the most (their own ops):",
              tabulate(rows, headers=["module", "saved", "share"], tablefmt="simple",
                       colalign=("left", "right", "right"))]
    return lines


def assert_activation_bytes(
    model: ModelLike,
    inputs: Optional[UserInputs] = None,
    *,
    max_bytes: Union[int, str],
    loss: Optional[LossFn] = None,
    input_shape: Union[str, tuple, list, None] = None,
    device: Union[str, torch.device] = "cpu",
    baseline: Optional[Baseline] = None,
    top: int = 5,
) -> Report:
    """Assert that one training step saves at most ``max_bytes`` (an int, or a size such as
    ``"3GiB"``) for backward; return the Report.

    On failure the AssertionError names the excess and lists the largest saved tensors and the
    modules saving the most; with ``baseline`` (a Report, its ``to_dict()``, or a JSON file
    written by ``graphmem analyze --json``) it also shows what changed since.

    >>> import torch, graphmem
    >>> net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    >>> graphmem.assert_activation_bytes(net, (torch.randn(8, 16),), max_bytes=1536).activation_bytes
    1536
    """
    budget = parse_bytes(max_bytes) if isinstance(max_bytes, str) else max_bytes
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise UsageError(f"max_bytes must be a non-negative int (bytes) or a size like '3GiB', not {max_bytes!r}")
    report = analyze(model, inputs, input_shape=input_shape, loss=loss, device=device)
    if report.activation_bytes <= budget:
        return report
    over = report.activation_bytes - budget
    lines = [f"{report.model} saves {fmt_bytes(report.activation_bytes)} ({report.activation_bytes:,} B) for "
             f"backward, over the budget of {fmt_bytes(budget)} ({budget:,} B) by {fmt_bytes(over)} "
             f"({over:,} B)", ""]
    lines += _contributors(report, top)
    if baseline is not None:
        base = load_json_report(baseline) if isinstance(baseline, (str, os.PathLike)) else baseline
        lines += ["", "what changed since the baseline:", "",
                  render_comparison(compare(base, report, ("baseline", "now")), top=top).rstrip("\n")]
    raise AssertionError("\n".join(lines))


def assert_peak_bytes(model: ModelLike, inputs: Optional[UserInputs] = None, *, max_bytes: Union[int, str], figure: Optional[str] = None,
                      top: int = 5, **options: Any) -> Report:
    """Assert that the run's ``figure`` stays within ``max_bytes``: "allocated" (what
    ``torch.cuda.max_memory_allocated()`` reads after a few steps), "reserved" or "device" (the device
    total, what nvidia-smi shows); default "device" on the CUDA target, "allocated" on the CPU's (equal
    there). ``options`` are ``graphmem.analyze``'s (``optimizer``, ``device``, ...). Returns the Report.

    >>> import torch, graphmem
    >>> net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    >>> graphmem.assert_peak_bytes(net, (torch.randn(8, 16),), max_bytes="1MiB", optimizer="adamw").memory.figure("allocated")
    15584
    """
    from graphmem.report import FIGURE_NAMES, figure_for

    budget = parse_bytes(max_bytes) if isinstance(max_bytes, str) else max_bytes
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise UsageError(f"max_bytes must be a non-negative int (bytes) or a size like '3GiB', not {max_bytes!r}")
    report = analyze(model, inputs, **options)
    name, memory = figure_for(report.device, figure), report.memory
    assert memory is not None  # analyze gives every report its run memory
    value = memory.figure(name)
    if value <= budget:
        return report
    lines = [f"{report.model}'s {FIGURE_NAMES[name]} is {fmt_bytes(value)} ({value:,} B), over the budget of "
             f"{fmt_bytes(budget)} ({budget:,} B) by {fmt_bytes(value - budget)} (compared: the {FIGURE_NAMES[name]}; "
             f"first step {fmt_bytes(memory.first_allocated)}, later steps {fmt_bytes(memory.later_allocated)} "
             "allocated)", ""]
    raise AssertionError("\n".join(lines + _contributors(report, top)))
