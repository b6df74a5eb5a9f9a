"""The module tree and Markdown renderers (golden output, numbers by hand) and the analyze
output flags (--format, --json, --tree, --plot, --snapshot).

Golden files are tests/golden/*_tree.txt and *.md; rewrite them with
``GRAPHMEM_UPDATE_GOLDEN=1 pytest tests/render/test_report_views.py`` after an intended layout change
and check the diff by hand.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import check_golden
from paths import ROOT, TESTS
from test_render import MODELS, analyze

import graphmem
from graphmem import cli
from graphmem.render import render_text
from graphmem.render.markdown import render_markdown
from graphmem.render.tree import render_tree

GOLDEN = TESTS / "golden"
MLP_FILE = ROOT / "models" / "mlp.py"


def _check_golden(filename: str, text: str) -> None:
    check_golden(text, GOLDEN / filename)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_render_tree_matches_golden(name: str) -> None:
    _check_golden(f"{name}_tree.txt", render_tree(analyze(name)))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_render_markdown_matches_golden(name: str) -> None:
    _check_golden(f"{name}.md", render_markdown(analyze(name)))


def test_markdown_shows_the_training_step_table() -> None:
    """golden/sequential_adamw.md: with an optimizer step the report carries the training-step
    table (report.budget); Markdown shows it as the text view does, row for row."""
    torch.manual_seed(0)
    report = graphmem.analyze(MODELS["sequential"](), (torch.randn(8, 16),), optimizer="adamw")
    md = render_markdown(report)
    _check_golden("sequential_adamw.md", md)
    text = render_text(report)
    table = text[text.index("Training step · "):text.index("model states (")].splitlines()
    assert f"### {table[0]}" in md  # the title, as a heading
    for row in table[3:]:  # every row's cells (below the title, headers and rule), in order, in one pipe row
        cells = [c for c in row.split("  ") if c.strip()]
        assert any(all(f" {c.strip()} " in line for c in cells) for line in md.splitlines() if line.startswith("|")), row
    for line in text[text.index("model states ("):text.index("\nNotes") if "\nNotes" in text else None].splitlines():
        assert line.strip() in md  # the lines under the table, each one list item


def test_tree_nested_by_hand() -> None:
    """golden/nested_tree.txt: the saved bytes of test_render_text_nested_numbers_by_hand, as a tree."""
    text = render_tree(analyze("nested"))
    # total 3648 B = 3.56 KiB; ln: batch 512 + output 512 + mean 32 + rstd 32 = 1088 B (29.8%),
    # fc and act 1024 B each (28.1%), proj 512 B (14.0%); head saves nothing and is left out
    assert text.splitlines()[-6:] == [
        "(model)       3.56 KiB   100.0%       0 B          7",
        "└── block     3.56 KiB   100.0%       0 B          7",
        "    ├── ln    1.06 KiB    29.8%  1.06 KiB          4",
        "    ├── fc    1.00 KiB    28.1%  1.00 KiB          1",
        "    ├── act   1.00 KiB    28.1%  1.00 KiB          1",
        "    └── proj     512 B    14.0%     512 B          1",
    ]
    assert "activations 3.56 KiB saved for backward · peak 11.73 KiB at op 44 (backward)" in text
    assert 1088 / 3648 == pytest.approx(0.298, abs=5e-4) and 512 / 3648 == pytest.approx(0.140, abs=5e-4)


def test_tree_depth_folds_children() -> None:
    rows = render_tree(analyze("nested"), depth=1).splitlines()
    assert rows[-2:] == ["(model)    3.56 KiB   100.0%     0 B          7",
                         "└── block  3.56 KiB   100.0%     0 B          7"]  # ln, fc, act, proj folded in


def test_markdown_nested_by_hand() -> None:
    """golden/nested.md: exact bytes beside the human ones (test_render_text_nested_numbers_by_hand)."""
    md = render_markdown(analyze("nested"))
    assert "| parameters      |      4.58 KiB |  4,688 B |" in md  # (16+16+512+32+512+16+64+4) * 4
    assert "| **activations** |  **3.56 KiB** |  3,648 B |" in md  # 1088 + 1024 + 1024 + 512
    assert ("| **peak (run)**  | **11.73 KiB** | 12,008 B | first and later steps alike: op 44 (backward, "
            "aten.sum.dim_IntList, block.fc) |") in md  # no optimizer: the first step is the run's
    assert "| block.ln   | 1.06 KiB |   29.8% |         4 |" in md
    assert md.count("\n|:") == 4  # four pipe tables, each with its alignment row


# -- analyze output flags ---------------------------------------------------------------------

def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["analyze", str(MLP_FILE), "--input-shape", "4x784", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_format_json_is_the_json_flag(capsys: pytest.CaptureFixture[str]) -> None:
    code, by_format, err = _run(capsys, "--format", "json")
    assert code == 0 and err == ""
    assert json.loads(by_format) == json.loads(_run(capsys, "--json")[1])
    assert json.loads(_run(capsys, "--json", "--format", "json")[1]) == json.loads(by_format)


def test_format_markdown_and_tree(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "--format", "markdown", "--depth", "2")
    assert code == 0 and err == "" and out.startswith("## graphmem · mlp.py · input 4x784 · target cpu\n")
    assert "### Saved for backward by module (depth ≤ 2)" in out
    code, out, err = _run(capsys, "--tree")
    assert code == 0 and err == "" and "└── net" in out and "Largest saved tensors" not in out
    assert _run(capsys, "--format", "text")[1] == _run(capsys)[1]  # text is the default


@pytest.mark.parametrize("args, message", [
    (["--json", "--format", "markdown"], "--json and --format markdown disagree"),
    (["--tree", "--format", "json"], "--tree draws the text module tree"),
    (["--format", "html"], "invalid choice: 'html'"),
    (["--plot", "/no/such/folder/x.png"], "--plot /no/such/folder/x.png: the folder /no/such/folder does not exist"),
    (["--snapshot", "/no/such/folder/x.pickle"], "the folder /no/such/folder does not exist"),
])
def test_bad_output_flags_are_one_line_usage_errors(capsys: pytest.CaptureFixture[str], args: list[str],
                                                    message: str) -> None:
    code, out, err = _run(capsys, *args)
    assert code == 2 and out == ""
    assert err.startswith("graphmem: error: ") and message in err and err.count("\n") == 1


def test_plot_and_snapshot_files(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png, pickle_path = tmp_path / "step.png", tmp_path / "step.pickle"
    code, out, err = _run(capsys, "--json", "--plot", str(png), "--snapshot", str(pickle_path))
    assert code == 0 and json.loads(out)["model"] == "mlp.py"  # stdout stays pure JSON
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and pickle_path.stat().st_size > 0
    assert err.splitlines() == [f"graphmem: wrote the memory plot to {png}",
                                "graphmem: wrote the memory snapshot (open it at https://pytorch.org/memory_viz) "
                                f"to {pickle_path}"]
