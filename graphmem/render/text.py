"""Report -> text tables (tabulate). Takes a Report, returns a str; never prints."""
from __future__ import annotations

from tabulate import tabulate

from graphmem.render.budget import render_budget
from graphmem.render.collapse import ModuleRow, collapsed, each, label
from graphmem.render.compiled import render_modes
from graphmem.render.formula import render_coefficients
from graphmem.render.memory_budget import render_memory_budgets
from graphmem.report import Report
from graphmem.units import fmt_bytes, fmt_share

ROOT = "(model)"


PHASES = ("accumulate", "forward", "loss", "backward", "optimizer")  # in the order a step runs them


def op_counts(phase_start: dict[str, int], num_ops: int) -> str:
    """"forward 5, loss 1, backward 24": ops per phase, each from its start to the next phase's
    (accumulate: the micro-steps before the last; optimizer: the optimizer step), phases the step
    has, in the order it runs them."""
    starts = sorted((phase_start[p], i, p) for i, p in enumerate(PHASES) if p in phase_start)
    bounds = [s for s, _, _ in starts[1:]] + [num_ops]
    return ", ".join(f"{p} {end - start}" for (start, _, p), end in zip(starts, bounds))


def _where(report: Report, index: int) -> str:
    if index < 0:
        return "before"
    for phase, short in (("optimizer", "opt"), ("backward", "bwd"), ("loss", "loss"), ("forward", "fwd"),
                         ("accumulate", "acc")):
        if report.phase_start.get(phase, report.num_ops) <= index:
            return f"{short} {index}"
    return str(index)


def _lifetime(report: Report, created: int, released: int | None) -> str:
    end = _where(report, released) if released is not None else "end"
    return f"{_where(report, created)} → {end}"


def _module(path: str, report: Report | None = None, created: int = -1) -> str:
    if not path and report is not None and created >= report.phase_start.get("optimizer", report.num_ops):
        return "(optimizer)"  # made by the optimizer step (graphmem/training/loop.py)
    if not path and report is not None and created >= report.phase_start.get("loss", report.num_ops):
        return "(loss)"  # made by the loss function, outside every module
    return path or ROOT


def _shapes(report: Report) -> str:
    shapes = ", ".join("x".join(map(str, s)) for s in report.input_shapes) or "-"
    made = "".join(f" · {k} {v}" for k, v in report.batch.items())  # the batch graphmem made: its choices
    return shapes + made


def _shown_modules(report: Report, depth: int, expand: bool = False) -> list[ModuleRow]:
    """Rows of a module table: the root, and the modules above ``depth`` that saved something;
    runs of identical sibling blocks folded into one row unless ``expand`` (render/collapse.py)."""
    return [m for m in collapsed(report.modules, expand)
            if m.path == "" or (m.activation_bytes and m.path.count(".") < depth)]


def render_text(report: Report, depth: int = 3, top: int = 10, expand: bool = False) -> str:
    shapes = _shapes(report)
    target = report.target.describe() if report.target is not None else report.device
    lines = [f"graphmem · {report.model} · input {shapes} · target {target} · {_scope(report)}"]
    if report.attention_backends:
        lines.append("SDPA kernels: " + ", ".join(f"{k} × {v}" for k, v in report.attention_backends.items()))
    cats = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in report.by_category.items() if v)
    summary: list[list[str]] = [
        ["parameters", fmt_bytes(report.parameter_bytes), ""],
        ["buffers", fmt_bytes(report.buffer_bytes), ""],
        ["inputs", fmt_bytes(report.input_bytes), ""],
        ["gradients", fmt_bytes(report.gradient_bytes), "after backward"],
        ["activations", fmt_bytes(report.activation_bytes), f"saved for backward: {cats}" if cats else "nothing saved"],
    ]
    summary += run_rows(report)
    lines += ["", tabulate(summary, tablefmt="plain"),
              f"ops recorded: {report.num_ops} ({op_counts(report.phase_start, report.num_ops)})"]

    total = report.activation_bytes
    rows = [["  " * (m.path.count(".") + 1 if m.path else 0) + label(m, _module(m.path)),
             each(m, fmt_bytes(m.activation_bytes)), fmt_share(m.activation_bytes, total), m.count]
            for m in _shown_modules(report, depth, expand)]
    lines += ["", f"Saved for backward by module (depth ≤ {depth})",
              tabulate(rows, headers=["module", "saved", "share", "tensors"], tablefmt="simple",
                       colalign=("left", "right", "right", "right"), preserve_whitespace=True)]

    rows = [[t.op, _module(t.module, report, t.created), "x".join(map(str, t.shape)) or "scalar", t.dtype, fmt_bytes(t.bytes),
             t.category, _lifetime(report, t.created, t.released)] for t in report.saved[:top]]
    lines += ["", f"Largest saved tensors (top {min(top, len(report.saved))} of {len(report.saved)})",
              tabulate(rows, headers=["op", "module", "shape", "dtype", "bytes", "category", "lifetime"],
                       tablefmt="simple", colalign=("left", "left", "left", "left", "right", "left", "left"))]

    rows = [[t.name, t.kind, _module(t.module, report, t.created),
             "x".join(map(str, t.shape)) or "scalar", fmt_bytes(t.nbytes)] for t in report.live_at_peak[:top]]
    lines += ["", f"Live at the peak (top {min(top, len(report.live_at_peak))} of {len(report.live_at_peak)})",
              tabulate(rows, headers=["tensor", "kind", "module", "shape", "bytes"], tablefmt="simple",
                       colalign=("left", "left", "left", "left", "right"))]
    if report.compiled is not None:
        lines += ["", render_modes(report.compiled, depth, top).rstrip("\n")]
    if report.known_memory_budgets is not None:
        lines += ["", render_memory_budgets(report.known_memory_budgets).rstrip("\n")]
    if report.known_coefficients is not None:
        lines += ["", render_coefficients(report.known_coefficients).rstrip("\n")]
    if report.budget is not None:
        lines += ["", render_budget(report.budget).rstrip("\n")]
    if report.notes:
        lines += ["", "Notes"] + [f"- {n}" for n in report.notes]
    return "\n".join(lines) + "\n"


def run_rows(report: Report) -> list[list[str]]:
    """The headline: the run's max allocated with the first step beside it; on the CUDA target the
    run's max reserved and the device total with its rows (passes/run_memory.py)."""
    where = (f"op {report.peak_index} ({report.peak_phase}, {report.peak_op}, {_module(report.peak_module)})"
             + _scratch(report) if report.peak_index >= 0 else "before the step")
    m = report.memory
    if m is None:  # a report written before the run's figures
        return [["peak", fmt_bytes(report.peak_bytes), where]]
    cuda = report.device == "cuda" or bool(m.rows)
    first = f"first step {fmt_bytes(m.first_allocated)} at {where}"
    rows = [["peak (run)", fmt_bytes(m.run_max_allocated),
             ("max_memory_allocated after a few steps: later steps (optimizer states from the start); " + first
              if m.later_allocated > m.first_allocated else "first and later steps alike: " + where)]]
    if cuda:
        a = report.cuda_allocator
        frag = f", fragmentation at the first step's peak {fmt_bytes(a.fragmentation)}" if a is not None else ""
        rows.append(["reserved (run)", fmt_bytes(m.run_max_reserved),
                     f"max_memory_reserved after a few steps; first step {fmt_bytes(m.first_reserved)}{frag} "
                     + ("(caching allocator model)" if m.reserved_from.startswith("the caching") else f"({m.reserved_from})")])
        parts = ", ".join(f"{r.name} {fmt_bytes(r.bytes)}" + (" (estimate)" if r.estimate else "")
                          + (" (given)" if r.overridden else "") for r in m.rows if r.bytes)
        card = report.target
        fits = (f"; the {card.gpu}'s capacity {fmt_bytes(card.capacity)} (CUDA's total), "
                + ("fits" if m.device_total <= card.capacity else "does not fit")) \
            if card is not None and card.device == "cuda" else ""
        rows.append(["device total", fmt_bytes(m.device_total), f"what nvidia-smi shows: reserved + {parts}{fits}"])
    return rows


def _scratch(report: Report) -> str:
    """The kernel workspace live inside the peak op (graphmem/oprules/registry.py), when there is some."""
    nbytes = sum(t.nbytes for t in report.live_at_peak if t.kind == "workspace" and t.freed == t.created)
    return f"; kernel workspace {fmt_bytes(nbytes)} inside it" if nbytes else ""


def _scope(report: Report) -> str:
    """What the report is of: one training step, or one rank's (graphmem/distributed/)."""
    return "one training step" if report.sharding is None else f"{report.sharding.describe()}: one training step"
