"""StepBudget -> text: the whole step's memory per rank, like the seeds' breakdowns (parameters,
gradients, optimizer states, master copies, activations, temporaries, peak), and why the peak
is where it is. Takes the budget, returns text; never prints."""
from __future__ import annotations

from typing import TYPE_CHECKING

from tabulate import tabulate

from graphmem.passes.budget import HOST, BudgetRow
from graphmem.units import fmt_bytes

if TYPE_CHECKING:
    from graphmem.training.spec import StepBudget

_WHY = {
    "optimizer": "the optimizer step: its states (made on the first step) and the intermediates of "
                 "its update are live beside the parameters and all the gradients",
    "backward": "backward: gradients are being made while the activations not yet used are still held",
    "accumulate": "an earlier micro-step: the gradients of the micro-steps before it are held",
    "forward": "forward: the activations saved so far are held",
    "loss": "the loss: every activation is held",
}


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def budget_title(b: StepBudget) -> str:
    t = b.training
    parts = []
    if t.train.optimizer:
        parts.append(t.train.describe(b.device))
    elif t.train.micro_batches > 1:
        parts.append(f"{t.train.micro_batches} micro-batches, no optimizer step")
        parts += t.train.describe(b.device).split(", ")[1:]
    elif t.train.loop_options:
        parts.append(t.train.describe(b.device))
    if t.quantization is not None:
        parts.append(t.quantization.describe())
    if t.lora is not None:
        parts.append(f"{t.lora.describe()} ({len(b.lora_layers)} layers)")
    parts.append(b.whose or b.layout.describe())
    return "Training step · " + " · ".join(parts)


def budget_table(b: StepBudget) -> tuple[list[str], list[list[str]]]:
    """The budget table's headers and rows (one rank; all ranks hold the same), bytes in human
    units: what the text and Markdown views both show."""
    r, single = b.rank, b.single
    headers = ["", "one device"] if single is not None else [""]
    headers += ["per rank" if single is not None else "size", "live at the peak", ""]
    rows = []
    for row in r.rows:
        if row.name == "buffers" and not row.size:
            continue
        line = [row.name]
        if single is not None:
            other = next((x for x in single.rows if x.name == row.name), None)
            line.append(fmt_bytes(other.size) if other is not None else "-")
        note = row.note
        if row.name == "optimizer states" and r.states_by_name:
            note = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in r.states_by_name.items()) + (f"; {note}" if note else "")
        if row.name == "temporaries":
            note = "at the peak: inputs, outputs, backward and optimizer intermediates"
        rows.append(line + [fmt_bytes(row.size), fmt_bytes(row.at_peak), note])
        rows += [_detail(d, single is not None) for d in r.details if d.within == row.name]
    rows += [_detail(d, single is not None) for d in r.details if d.within == HOST]
    # the step's peaks, one row each: (name, one device's, this rank's, where)
    peaks = [("peak (first step)", single.peak_bytes if single is not None else None, r.peak_bytes,
              f"op {r.peak_index} ({r.peak_phase}, {r.peak_op})"),
             ("peak (later steps)", single.later_peak_bytes if single is not None else None, r.later_peak_bytes,
              f"op {r.later_peak_index} ({r.later_peak_phase}); optimizer states live from the start")]
    for name, one, mine, where in peaks:
        rows.append([name] + ([fmt_bytes(one or 0)] if single is not None else []) + [fmt_bytes(mine), "", where])
    return headers, rows


def _detail(d: BudgetRow, single: bool) -> list[str]:
    """A detail row, under the row it details (``BudgetRow.within``), marked "· "; host memory's unmarked."""
    return [d.name if d.within == HOST else "· " + d.name] + (["-"] if single else []) + \
        [fmt_bytes(d.size), fmt_bytes(d.at_peak), d.note]


def render_budget(b: StepBudget) -> str:
    """The budget table (one rank; all ranks hold the same) and the peak's explanation."""
    headers, rows = budget_table(b)
    lines = [budget_title(b), tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)]
    return "\n".join(lines + budget_notes(b)) + "\n"


def budget_notes(b: StepBudget) -> list[str]:
    """The lines under the table: model states per parameter, offloading, LoRA, 4-bit weights, why
    the peak is where it is (its detail lines indented by two spaces), tensor parallel, micro-steps."""
    r, p = b.rank, b.layout
    lines = []
    psi = r.parameters
    states = r.model_state_bytes - r.step_counter_bytes
    per = f"{states / psi:.2f} B per parameter" if psi else ""
    lines.append(f"model states (parameters + gradients + optimizer states + master copies): "
                 f"{fmt_bytes(r.model_state_bytes)} per rank; without the step counters ({fmt_bytes(r.step_counter_bytes)}) "
                 f"{fmt_bytes(states)} ({states / 1e9:.2f} GB) = {per} ({_count(r.trainable)} trainable of {_count(r.parameters)})")
    if b.training.train.offload_activations:
        lines.append(f"offloaded activations: {fmt_bytes(b.host_bytes)} of saved tensors copied to host memory in forward "
                     "and back in backward (save_on_cpu's hooks; parameters stay): not in the rows above")
    if b.training.lora is not None:
        frozen = r.parameters - r.trainable
        lines.append(f"LoRA: {len(b.lora_layers)} layers adapted; {_count(frozen)} frozen parameters get no gradient "
                     f"and no optimizer state; activations are still saved wherever a gradient needs them "
                     f"({fmt_bytes(r.row('activations').size)} here: autograd skips only what a frozen weight's own "
                     "gradient would need; the input gradient still flows back through the frozen layers above each adapter)")
    if b.quantized is not None:
        q = b.quantized
        lines.append(f"4-bit: {q.layers} linear layers, {_count(q.weights)} weights held as {fmt_bytes(q.packed_bytes)} "
                     f"packed (2 per byte; counted above as {_count(q.weights)} parameters) + "
                     f"{fmt_bytes(q.state_bytes)} of block scales and codes (in buffers); each matmul dequantizes its "
                     "weight to the compute dtype inside bitsandbytes' gemm_4bit (its scratch, in temporaries)")
    lines += _why_peak(b)
    if p.tp > 1:
        lines.append(f"tensor parallel: {r.tp_split[0]} column-parallel and {r.tp_split[1]} row-parallel linear ops "
                     "found in the graph; their outputs up to the row-parallel linear are split over the ranks")
    k, traced = b.training.train.micro_batches, b.training.train.trace_micro_steps
    if k > traced:
        lines.append(f"micro-steps 3..{k} repeat micro-step 2 (same live tensors), so 2 are traced" if traced == 2 else
                     f"micro-steps 3..{k - 1} repeat micro-step 2 (same live tensors), so {traced} are traced: the last "
                     "one reduce-scatters the accumulated gradients (set_requires_gradient_sync)")
    return lines


def _why_peak(b: StepBudget) -> list[str]:
    """Why the peak is where it is: the op and its phase, the rows live there, the largest
    temporaries, and the tensors that make the peak (none when the step has no ops)."""
    r = b.rank
    if r.peak_index < 0:
        return []
    lines: list[str] = []
    module = f", module {r.peak_module}" if r.peak_module else ""
    lines.append(f"why the peak: op {r.peak_index} ({r.peak_phase}: {r.peak_op}{module}) is {_WHY.get(r.peak_phase, r.peak_phase)}")
    live = [f"{row.name} {fmt_bytes(row.at_peak)}" for row in r.rows if row.at_peak]
    lines.append("  live there: " + " + ".join(live) + f" = {fmt_bytes(r.peak_bytes)}")
    if r.top_temporaries:
        lines.append("  largest temporaries, by the op that made them: "
                     + ", ".join(f"{name} {fmt_bytes(v)}" for name, v in r.top_temporaries))
    for t in b.spike[:3]:
        if t.nbytes * 100 < r.peak_bytes:  # under 1 % of the peak: not what makes it
            break
        freed = (f"the last freed after op {t.last_freed} ({t.freed_by}, {t.freed_phase})"
                 if t.last_freed is not None else "alive when the step ends")
        lines.append(f"  {t.made_by}: {fmt_bytes(t.nbytes)} in {t.count} tensor{'s' if t.count > 1 else ''}, "
                     f"made from op {t.first_made} ({t.phase}), {freed}")
    return lines
