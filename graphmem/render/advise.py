"""``graphmem advise`` as text: the answer line, the ranked levers (peak measured by a capture of
the changed step, saving, cost), the exact change for each, the combinations, what was left out."""
from __future__ import annotations

from tabulate import tabulate

from graphmem.advise import Advice, Lever
from graphmem.jsontypes import JSON
from graphmem.report import Report
from graphmem.units import fmt_bytes


def _rows(levers: tuple[Lever, ...]) -> list[list[object]]:
    return [[i, r.name, fmt_bytes(r.peak_bytes), fmt_bytes(r.saving_bytes) if r.saving_bytes >= 0
             else f"-{fmt_bytes(-r.saving_bytes)}", "yes" if r.fits else "no", r.cost]
            for i, r in enumerate(levers, 1)]


def render_advice(advice: Advice, title: str = "") -> str:
    peak = "peak" if advice.figure == "allocated" else advice.figure_name
    head = ["#", "lever", peak, "saving", "fits", "cost"]
    compared = "" if advice.figure == "allocated" else f" (compared: the {advice.figure_name} of each setting's run)"
    out = [f"{title}{peak} {fmt_bytes(advice.base_peak)}; memory {fmt_bytes(advice.memory)}{compared}", "",
           advice.answer, ""]
    if advice.levers:
        out += [f"Levers (each {peak}: a capture of the changed step)",
                tabulate(_rows(advice.levers), head, disable_numparse=True), ""]
        out += ["How to make each change"] + [f"{i:>3}. {r.name}: {r.how}" for i, r in enumerate(advice.levers, 1)]
        out.append("")
    if advice.combinations:
        out += ["Combinations (captured)", tabulate(_rows(advice.combinations), head, disable_numparse=True), ""]
    if advice.left_out:
        out += ["Left out"] + [f"  {x.kind}: {x.why}" for x in advice.left_out] + [""]
    out += [f"Note: {n}." for n in advice.notes]
    out.append(f"({advice.captures} captures of changed steps)")
    return "\n".join(out) + "\n"


def advice_json(report: Report, advice: Advice) -> dict[str, JSON]:
    return {"model": report.model, "input_shapes": [list(s) for s in report.input_shapes], **advice.to_dict()}
