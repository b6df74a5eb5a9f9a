"""Deep reports stay readable: runs of identical sibling blocks are one row in the text,
Markdown and tree views (``layers.1-3 ×3, ... each``) unless ``expand``."""
from __future__ import annotations

import torch
import torch.nn as nn

import graphmem
from graphmem.passes import ModuleSaved as M
from graphmem.render import render_markdown, render_text, render_tree
from graphmem.render.collapse import collapsed


def test_runs_fold_and_a_differing_block_stays_its_own_row() -> None:
    # GIVEN four blocks, the first saving one byte more (say, the batch)
    mods = [M("", 100, 0, 10), M("m", 90, 0, 9), M("m.layers", 80, 0, 8)]
    for i in range(4):
        b = 21 if i == 0 else 20
        mods += [M(f"m.layers.{i}", b, 0, 2), M(f"m.layers.{i}.mlp", 10, 10, 1), M(f"m.layers.{i}.attn", b - 10, b - 10, 1)]
    rows = collapsed(mods)
    # THEN block 0 stays; blocks 1-3 are one row with one block's numbers, children once
    assert [(r.path, r.activation_bytes, r.times) for r in rows] == [
        ("", 100, 1), ("m", 90, 1), ("m.layers", 80, 1),
        ("m.layers.0", 21, 1), ("m.layers.0.mlp", 10, 1), ("m.layers.0.attn", 11, 1),
        ("m.layers.1-3", 20, 3), ("m.layers.1-3.mlp", 10, 3), ("m.layers.1-3.attn", 10, 3)]
    assert len(collapsed(mods, expand=True)) == len(mods)


def test_nested_runs_multiply() -> None:
    mods = [M("", 0, 0, 0), M("h", 0, 0, 0)]
    for i in range(2):
        mods.append(M(f"h.{i}", 8, 0, 4))
        mods += [M(f"h.{i}.experts.{j}", 2, 2, 1) for j in range(4)]
    rows = collapsed(mods)
    assert [(r.path, r.times) for r in rows] == [("", 1), ("h", 1), ("h.0-1", 2), ("h.0-1.experts.0-3", 8)]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.act = nn.Linear(16, 16), nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


def test_text_markdown_and_tree_fold_the_same_blocks() -> None:
    net = nn.Sequential(nn.Linear(8, 16), *[Block() for _ in range(6)])
    report = graphmem.analyze(net, (torch.randn(4, 8),))
    text, md, tree = render_text(report), render_markdown(report), render_tree(report)
    # blocks 1-5 are alike; the last one's GELU output is not saved (nothing after it needs it)
    assert "1-5 ×5" in text and "1-5 ×5" in md and "1-5 ×5" in tree
    assert "  1-5.fc ×5" in text and "256 B each" in text and "| 1-5.act ×5 |" in md and "6.fc" in text
    for view in (render_text(report, expand=True), render_markdown(report, expand=True)):
        assert "×5" not in view and "5.fc" in view
    assert "×5" not in render_tree(report, expand=True) and "├── 5 " in render_tree(report, expand=True)
