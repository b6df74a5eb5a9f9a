"""Report -> PNG: live memory over the step, stacked by category, with the phase boundaries and
the peak (and what is live there). matplotlib is optional: ``pip install 'graphmem[plot]'``.

``plot_timeline(report, other)`` draws a second report's total as a line over the first one's
stacked areas, so a variant of the same step (a checkpoint plan, another attention kernel, a
smaller batch) can be compared on one figure.
"""
from __future__ import annotations

import io
from typing import TYPE_CHECKING, Optional

from graphmem.errors import UsageError
from graphmem.passes.timeline import CATEGORIES, CategoryTimeline, category_timeline
from graphmem.render.text import _module, _shapes
from graphmem.report import Report
from graphmem.report.live import Analysis
from graphmem.units import _BINARY, fmt_bytes

if TYPE_CHECKING:  # (matplotlib is optional: imported where a figure is drawn)
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

LABELS = {
    "parameters": "parameters + buffers",
    "gradients": "gradients (.grad)",
    "optimizer": "optimizer states + master copies",
    "activations": "activations (saved for backward)",
    "communication": "communication (all-gather / reduce-scatter buffers, gathered parameters)",
    "workspace": "kernel workspace (scratch inside an op)",
    "other": "other (inputs, temporaries, outputs)",
}
COLORS = {"parameters": "#4e79a7", "gradients": "#59a14f", "optimizer": "#b07aa1", "activations": "#f28e2c",
          "communication": "#76b7b2", "workspace": "#e15759", "other": "#bab0ab"}
OVERLAY = "#c0392b"
# the most steps drawn across the plot: fewer than the axes' pixel columns (about 1,000 at 13 in x 110
# dpi), so every step is at least a pixel wide. A step narrower than a pixel is antialiased away:
# a one-op spike (the peak of torchtitan's llama3 8B FSDP rank, 15,378 ops) drew its top a GiB and
# more below the peak marker, which sat at the right height above a curve that did not reach it
COLUMNS = 800
INSTALL = "pip install 'graphmem[plot]'"


def require_matplotlib() -> None:
    """Raise UsageError (naming the install command) when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise UsageError(f"the memory plot needs matplotlib, which is not installed: {INSTALL}") from e


def report_timeline(report: Report, purpose: str = "to plot it") -> CategoryTimeline:
    """The category timeline of a report made by ``graphmem.analyze`` (an Analysis: it keeps its step graph)."""
    if not isinstance(report, Analysis):
        raise UsageError("this report has no step graph (it was not made by graphmem.analyze); "
                         f"analyze the model again {purpose}")
    return category_timeline(report.step, report.liveness, report.saved)


def _unit(nbytes: int) -> tuple[str, int]:
    k = 0
    while k + 1 < len(_BINARY) and nbytes >= 1024 ** (k + 1):
        k += 1
    return _BINARY[k], 1024 ** k


def _steps(values: tuple[int, ...], picks: list[int], scale: int) -> list[float]:
    """The values of the ops ``picks`` chose, one step each: one more point so the last has a width."""
    ys = [values[i] / scale for i in picks]
    return ys + ys[-1:]


def _columns(totals: tuple[int, ...], columns: int = COLUMNS) -> tuple[list[int], list[int]]:
    """(xs, picks): the ops in runs of equal length, at most ``columns`` runs, each drawn as the op
    with the most live bytes in it (its categories as they are at that op), from the run's first op
    to the next run's (xs, one more to close the last). The upper envelope keeps every op's
    maximum, the peak's included; one op a run when the step has no more ops than ``columns``."""
    n = len(totals)
    k = max(1, -(-n // columns))  # ceil(n / columns) ops a run
    starts = list(range(0, n, k))
    picks = [max(range(s, min(s + k, n)), key=totals.__getitem__) for s in starts]
    return starts + [n], picks


def _peak_x(report: Report) -> float:
    return max(report.peak_index, 0) + 0.5


def _fit(text: str, width: int = 44) -> str:
    """Shorten from the middle so the side panel keeps both ends of a long module path."""
    return text if len(text) <= width else text[: width // 2 - 1] + "…" + text[-(width - width // 2):]


def _peak_panel(report: Report, tl: CategoryTimeline, top: int) -> str:
    where = (f"op {report.peak_index} ({report.peak_phase})\n{report.peak_op}\nin {_module(report.peak_module)}"
             if report.peak_index >= 0 else "before the step")
    at = tl.at(report.peak_index) if report.peak_index >= 0 else {}
    made_of = [f"  {fmt_bytes(v):>10}  {c}" for c, v in at.items() if v]
    live = [f"  {fmt_bytes(t.nbytes):>10}  {tl.category_of.get(t.sid, t.kind)}\n    {_fit(t.name)}\n"
            f"    {_fit(_module(t.module, report, t.created) + ' · ' + ('x'.join(map(str, t.shape)) or 'scalar'))}"
            for t in report.live_at_peak[:top]]
    return "\n".join([f"Peak {fmt_bytes(report.peak_bytes)}", where, ""]
                     + (["made of"] + made_of + [""] if made_of else [])
                     + [f"largest live there ({min(top, len(report.live_at_peak))} of {len(report.live_at_peak)})"]
                     + live)


def _phases(ax: Axes, report: Report) -> None:
    import matplotlib.transforms as mtransforms

    top = mtransforms.blended_transform_factory(ax.transData, ax.transAxes)
    n = report.num_ops
    loss, bwd = report.phase_start.get("loss", n), report.phase_start.get("backward", n)
    fwd, opt = report.phase_start.get("forward", 0), report.phase_start.get("optimizer", n)  # graphmem/training/loop.py
    for x in (fwd, loss, bwd, opt):
        if 0 < x < n:
            ax.axvline(x, color="0.35", lw=0.9, ls="--", zorder=3)
    ax.text((fwd + loss) / 2, 0.97, "forward", transform=top, ha="center", va="top", fontsize=10, color="0.25")
    ax.text((bwd + opt) / 2, 0.97, "backward", transform=top, ha="center", va="top", fontsize=10, color="0.25")
    if fwd > 0:
        ax.text(fwd / 2, 0.97, "earlier micro-steps", transform=top, ha="center", va="top", fontsize=10, color="0.25")
    if opt < n:
        ax.text((opt + n) / 2, 0.90, "optimizer", transform=top, ha="center", va="top", fontsize=8, color="0.25",
                rotation=90, bbox={"fc": "white", "ec": "none", "pad": 1}, zorder=4)
    if bwd > loss:
        ax.text((loss + bwd) / 2, 0.97, "loss", transform=top, ha="center", va="top", fontsize=8,
                color="0.25", rotation=90, bbox={"fc": "white", "ec": "none", "pad": 1}, zorder=4)


def plot_timeline(report: Report, other: Optional[Report] = None, labels: Optional[tuple[str, str]] = None,
                  top: int = 5) -> bytes:
    """The PNG (bytes) of the report's memory timeline; ``other`` is drawn over it as a line.

    >>> import torch, graphmem
    >>> from graphmem.render.plot import plot_timeline
    >>> net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    >>> png = plot_timeline(graphmem.analyze(net, (torch.randn(8, 16),)))
    >>> png[:4]
    b'\\x89PNG'
    """
    buf = io.BytesIO()
    timeline_figure(report, other, labels, top).savefig(buf, format="png")
    return buf.getvalue()


def timeline_figure(report: Report, other: Optional[Report] = None, labels: Optional[tuple[str, str]] = None,
                    top: int = 5) -> Figure:
    """The matplotlib Figure behind :func:`plot_timeline` (no pyplot state involved)."""
    require_matplotlib()
    from matplotlib.figure import Figure

    tl = report_timeline(report)
    other_tl = report_timeline(other) if other is not None else None
    name, other_name = labels or (report.model, other.model if other is not None else "")
    top_bytes = max(report.run_peak_bytes, other.run_peak_bytes if other is not None else 0)
    unit, scale = _unit(top_bytes)

    fig = Figure(figsize=(13, 6), dpi=110, layout="constrained")
    ax, side = fig.subplots(1, 2, width_ratios=[3, 1])
    n = report.num_ops
    xs, picks = _columns(tuple(sum(v) for v in zip(*tl.by_category.values())))
    shown = [c for c in CATEGORIES if c not in ("optimizer", "communication", "workspace") or any(tl.by_category[c])]  # when present
    ax.stackplot(xs, *[_steps(tl.by_category[c], picks, scale) for c in shown], step="post",
                 colors=[COLORS[c] for c in shown], labels=[LABELS[c] for c in shown],
                 linewidth=0, zorder=2)
    ax.plot([_peak_x(report)], [report.peak_bytes / scale], marker="v", color="black", ms=8, zorder=5)
    ax.annotate(f"peak {fmt_bytes(report.peak_bytes)}", (_peak_x(report), report.peak_bytes / scale),
                xytext=(0, 9), textcoords="offset points", ha="center", fontsize=9, zorder=5,
                bbox={"fc": "white", "ec": "none", "pad": 1, "alpha": 0.85})
    if report.run_peak_bytes > report.peak_bytes:  # later steps hold the optimizer states from their start
        ax.axhline(report.run_peak_bytes / scale, color="black", ls=":", lw=1, zorder=3,
                   label=f"peak (run) {fmt_bytes(report.run_peak_bytes)}: later steps, states from the start")
    if other is not None and other_tl is not None:
        totals = tuple(sum(v) for v in zip(*other_tl.by_category.values()))
        other_xs, other_picks = _columns(totals)
        ax.step(other_xs, _steps(totals, other_picks, scale), where="post", color=OVERLAY,
                lw=1.6, zorder=4, label=f"{other_name}: total (peak {fmt_bytes(other.peak_bytes)})")
        ax.plot([_peak_x(other)], [other.peak_bytes / scale], marker="v", color=OVERLAY, ms=8, zorder=5)
        n = max(n, other.num_ops)
    _phases(ax, report)
    ax.set_xlim(0, max(n, 1))
    ax.set_ylim(0, top_bytes / scale * 1.15 or 1)
    ax.set_xlabel("op index (execution order)")
    ax.set_ylabel(f"live memory ({unit})")
    ax.grid(axis="y", color="0.88", zorder=0)
    handles, names = ax.get_legend_handles_labels()
    fig.legend(handles, names, loc="outside lower center", ncol=len(handles) if len(handles) <= 4 else 3,
               fontsize=9, frameon=False)
    title = f"{name} · input {_shapes(report)} · target {report.target.describe() if report.target is not None else report.device}: memory during one training step"
    if other is not None:
        title += f"\nstacked: {name}    line: {other_name}"
    ax.set_title(title, fontsize=11, loc="left")
    side.axis("off")
    side.text(0.0, 1.0, _peak_panel(report, tl, top), transform=side.transAxes, va="top", ha="left",
              family="monospace", fontsize=8.5)
    return fig
