"""``print(report)``, ``print(plan)`` and ``print(report.plans(...))`` give the text views the
command line prints (graphmem/render/), not dataclass dumps; ``repr(report)`` is one short line."""
from __future__ import annotations

import torch

import graphmem
from graphmem.render import render_text
from graphmem.render.plan import not_composing, render_chosen, render_plan
from tests.cases import tiny_gpt, tokens


def test_str_of_a_report_is_its_text_view_and_repr_one_short_line() -> None:
    report = graphmem.analyze(tiny_gpt(), tokens())
    assert str(report) == render_text(report)
    assert str(report).startswith("graphmem · GPT · input 2x16")
    line = repr(report)
    assert "\n" not in line and len(line) < 200 and len(report.saved) > 10
    assert line == (f"Report(model='GPT', input_shapes='2x16', device='cpu', activation_bytes={report.activation_bytes}, "
                    f"peak_bytes={report.peak_bytes}, saved=<{len(report.saved)} tensors>)")


def test_str_of_plans_is_what_plan_prints() -> None:
    report = graphmem.analyze(tiny_gpt(n_layer=4), tokens())
    summary = report.plans(max_overhead="50%", points=5)
    assert str(summary) == render_plan(summary)
    plan = summary.chosen
    assert plan is not None and str(plan) == render_chosen(plan)
    text = str(plan)
    assert text.startswith("Checkpoint plan (recompute cap 50.0%): peak ") and plan.code().splitlines()[0] in text
    assert "verified: captured peak" in text
    kept = report.keeping(plans=summary)  # as `graphmem analyze --plan` prints it: the report, then the plans
    assert str(kept) == render_text(kept) + "\n" + render_plan(summary)


def test_pieces_that_do_not_compose_are_explained_with_what_to_do() -> None:
    # the check's own words (passes/checkpoint_model.py), as the README's Llama LoRA plan gave them
    because = ("checkpoint: blocks 0..0 checkpointed change memory by 1048572 B over the step but 34603004 B "
               "stored; the chain's pieces do not compose")
    lines = not_composing(because)
    text = " ".join(lines)
    assert "block 0 leaves 1024.00 KiB behind over the step when checkpointed, 33.00 MiB when stored" in text
    assert "Not proven optimal" in text and "best of the plans captured" in text  # what it means for the plan
    assert "Use the chosen plan" in text and "use_cache=False" in text and "--use-cache off" in text  # what to do
    assert "1048572 B" not in text
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    summary = graphmem.analyze(net, (torch.randn(2, 8),)).plans(budget="1GiB", points=3)
    assert not summary.exact and "Not proven optimal: " in str(summary)
