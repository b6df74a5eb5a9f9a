"""The memory plot: a readable PNG of one report, a second report overlaid, and a one-line
error naming ``pip install 'graphmem[plot]'`` when matplotlib is missing."""
from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from paths import ROOT

import graphmem
from graphmem import cli
from graphmem.errors import UsageError
from graphmem.report import Report
from graphmem.units import fmt_bytes

MLP_FILE = ROOT / "models" / "mlp.py"


def _mlp(act: nn.Module) -> Report:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), act, nn.Linear(32, 4))
    return graphmem.analyze(net, (torch.randn(8, 16),))


def _texts(fig: Any) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def test_plot_one_report() -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    from graphmem.render.plot import plot_timeline, timeline_figure

    r = _mlp(nn.ReLU())
    png = plot_timeline(r)
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert imread(io.BytesIO(png)).shape[:2] == (660, 1430)  # 13 x 6 in at 110 dpi
    fig = timeline_figure(r)
    ax = fig.axes[0]
    assert [t.get_text() for t in fig.legends[0].texts] == [
        "parameters + buffers", "gradients (.grad)", "activations (saved for backward)",
        "kernel workspace (scratch inside an op)", "other (inputs, temporaries, outputs)"]
    # the five stacked bands (workspace: the last linear's backward copies sum()'s expanded
    # gradient for BLAS), the phase lines at the loss (op 5) and backward (op 6) boundaries
    assert len(ax.collections) == 5
    assert sorted(line.get_xdata()[0] for line in ax.lines if line.get_linestyle() == "--") == [5, 6]
    texts = _texts(fig)
    assert {"forward", "loss", "backward", "peak 6.91 KiB"} <= set(texts)  # 7080 B, op 25
    panel = next(t for t in texts if t.startswith("Peak"))
    # the peak's parts, from test_render_text_sequential_numbers_by_hand (7080 B at op 25):
    # parameters 2704; gradients 512 + 16 (Linear 2) + 2048 + 128 (Linear 0, its bias grad being
    # made) = 2704; still saved: the batch 512 (the ReLU output was released by ReLU's backward);
    # other: output 128 + loss 4 + its grad 4 + ReLU's grad 1024 = 1160 B = 1.13 KiB
    assert "op 25 (backward)" in panel and "aten.sum.dim_IntList" in panel
    assert "2.64 KiB  parameters\n    2.64 KiB  gradients\n       512 B  activations\n    1.13 KiB  other" in panel
    assert "largest live there (5 of 13)" in panel and "0.weight" in panel


def test_plot_overlays_a_second_report() -> None:
    pytest.importorskip("matplotlib")
    from graphmem.render.plot import plot_timeline, timeline_figure

    gelu, relu = _mlp(nn.GELU()), _mlp(nn.ReLU())
    fig = timeline_figure(gelu, relu, labels=("GELU", "ReLU"))
    ax = fig.axes[0]
    overlay = next(line for line in ax.lines if line.get_label().startswith("ReLU"))
    assert overlay.get_label() == "ReLU: total (peak 6.91 KiB)"
    # the line is ReLU's own timeline (KiB), one point per op plus one to close the last step
    assert list(overlay.get_ydata()) == [v / 1024 for v in relu.liveness.timeline + relu.liveness.timeline[-1:]]  # type: ignore[union-attr]
    assert "stacked: GELU    line: ReLU" in ax.get_title(loc="left")
    assert "ReLU: total (peak 6.91 KiB)" in [t.get_text() for t in fig.legends[0].texts]
    assert ax.get_xlim() == (0, max(gelu.num_ops, relu.num_ops))
    assert plot_timeline(gelu, relu) != plot_timeline(gelu)


def test_plot_without_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # GIVEN matplotlib cannot be imported
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    from graphmem.render.plot import plot_timeline

    # WHEN the library is asked for a plot THEN a UsageError names the install command
    with pytest.raises(UsageError, match=r"pip install 'graphmem\[plot\]'"):
        plot_timeline(_mlp(nn.ReLU()))
    # AND the CLI says it in one line, exit code 2, before analyzing anything, and writes nothing
    code = cli.main(["analyze", str(MLP_FILE), "--input-shape", "4x784", "--plot", str(tmp_path / "x.png")])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and not (tmp_path / "x.png").exists()
    assert err == ("graphmem: error: the memory plot needs matplotlib, which is not installed: "
                   "pip install 'graphmem[plot]'\n")


def test_peak_marker_sits_on_the_curve_of_a_long_step() -> None:
    """A step of more ops than the plot has pixel columns: each drawn step is the largest op of its
    run, so the curve's top is the peak, where the marker is, and no step is narrower than a pixel
    (one was antialiased away: the marker of torchtitan's llama3 8B rank sat above a curve that did
    not reach it)."""
    pytest.importorskip("matplotlib")
    from graphmem.render.plot import COLUMNS, timeline_figure

    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(150) for m in (nn.Linear(8, 8), nn.ReLU())])
    r = graphmem.analyze(net, (torch.randn(4, 8),))
    assert r.num_ops > 2 * COLUMNS  # several ops a column
    fig = timeline_figure(r)
    ax = fig.axes[0]
    marker = next(line for line in ax.lines if line.get_marker() == "v")
    (x,), (y,) = marker.get_xdata(), marker.get_ydata()
    top = ax.collections[-1].get_paths()[0].vertices  # the last band stacked: its upper edge is the total
    scale = r.peak_bytes / y
    assert top[:, 1].max() * scale == pytest.approx(r.peak_bytes, rel=1e-12)  # float sums of the stacked bands
    # the curve is at the peak right under the marker: the step holding x is drawn at the marker's height
    under = top[(top[:, 0] <= x + r.num_ops / COLUMNS) & (top[:, 0] >= x - r.num_ops / COLUMNS), 1]
    assert under.max() == pytest.approx(y, rel=1e-12)
    steps = sorted(set(top[:, 0]))
    fig.canvas.draw()
    pixels = ax.transData.transform([(steps[0], 0), (steps[1], 0)])
    assert len(steps) <= COLUMNS + 1 and pixels[1][0] - pixels[0][0] >= 1.0  # every step a pixel or wider


def test_the_runs_peak_is_drawn_when_later_steps_hold_more() -> None:
    """GIVEN an MLP stepped by AdamW, whose later steps hold the states from their start
    WHEN it is plotted THEN a dotted line sits at the run's peak (report.run_peak_bytes, held equal
    to a real second step in tests/passes/test_run_memory.py), above the first step's marker."""
    pytest.importorskip("matplotlib")
    from graphmem.render.plot import timeline_figure

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    r = graphmem.analyze(net, (torch.randn(512, 16),), optimizer="adamw")
    assert r.run_peak_bytes > r.peak_bytes
    fig = timeline_figure(r)
    ax = fig.axes[0]
    dotted = [line for line in ax.lines if line.get_linestyle() == ":"]
    assert len(dotted) == 1
    scale = r.run_peak_bytes / dotted[0].get_ydata()[0]
    assert scale in (1, 1024, 1024 ** 2, 1024 ** 3)  # the axis' unit
    assert any(t.get_text().startswith(f"peak (run) {fmt_bytes(r.run_peak_bytes)}")
               for t in fig.legends[0].texts)
    assert ax.get_ylim()[1] >= r.run_peak_bytes / scale
