"""README.md's figures are what graphmem prints now (benchmarks/readme_figures.py reruns each documented
command and compares the blocks the README quotes; ``--write`` rewrites them)."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from paths import ROOT


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("readme_figures", ROOT / "benchmarks" / "readme_figures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["readme_figures"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


README = """# x

```
$ graphmem analyze m.py --input-shape 2x2
head 1
head 2

Table A (top 3)
name  size
----  ----
a     1
...
Table B
x
```
Prose: the peak is 9.99 GiB here. Small: 10 ops.

```
graphmem analyze big --plan
```
```
peak  1.00 GiB
...
No plan chosen: 2.00 GiB
```
"""
SCREEN = ["head 1", "head 2", "", "Table A (top 3)", "name  size", "----  ----", "a     1", "b     2", "c     3", "",
          "Table B", "x"]
PLAN = ["graphmem · big", "", "peak  3.50 GiB  op 7", "parameters  1 B", "  smallest 4.25 GiB",
        "No plan chosen: 4.25 GiB"]


def test_blocks_and_quotes_are_rebuilt_from_the_output(tmp_path: Path, capsys: Any) -> None:
    rf = _script()
    figures = (rf.Figure("screen", ("analyze", "m.py", "--input-shape", "2x2"), rf.Screen({"Table A": 1})),
               rf.Figure("plan", ("analyze", "big", "--plan"), rf.Pick((r"^peak", r"^\s+smallest", r"^No plan")),
                         (rf.Quote(r"the peak is (\S+ \S+) here", r"smallest (\S+ \S+)"),)),
               rf.Figure("prose", ("analyze", "small"), None, (rf.Quote(r"Small: (\S+) ops", r"ops recorded: (\d+)"),)))
    outputs = {"screen": SCREEN, "plan": PLAN, "prose": ["ops recorded: 12"]}
    path = tmp_path / "README.md"
    path.write_text(README, encoding="utf-8")
    runner = lambda figure: outputs[figure.name]
    saved, rf.FIGURES = rf.FIGURES, figures
    try:
        assert rf.main([], readme_path=path, runner=runner) == 1  # drifted: a diff, the file untouched
        assert "+peak  3.50 GiB  op 7" in capsys.readouterr().out and path.read_text(encoding="utf-8") == README
        assert rf.main(["--write"], readme_path=path, runner=runner) == 0
        assert rf.main([], readme_path=path, runner=runner) == 0  # as printed now
    finally:
        rf.FIGURES = saved
    text = path.read_text(encoding="utf-8")
    assert "Table A (top 3)\nname  size\n----  ----\na     1\n...\nTable B\nx\n```" in text  # cut to one row
    assert "```\npeak  3.50 GiB  op 7\n...\n  smallest 4.25 GiB\nNo plan chosen: 4.25 GiB\n```" in text
    assert "the peak is 4.25 GiB here. Small: 12 ops." in text and text.startswith("# x\n\n```\n$ graphmem analyze m.py")


def test_every_readme_figure_is_found() -> None:
    rf = _script()
    readme = rf.README.read_text(encoding="utf-8").split("\n")
    text = "\n".join(readme)
    for figure in rf.FIGURES:
        if figure.select is not None:
            first, end = rf.block_span(readme, figure)
            assert 0 < first <= end, figure.name
        for quote in figure.quotes:
            assert len(re.findall(quote.readme, text)) == 1, (figure.name, quote.readme)


FIGURE_NAMES = ("gpt2-screen", "l4-lora", "l4-lora-4096", "l4-lora-3072", "l4-qlora")  # benchmarks/readme_figures.py


def test_every_figure_is_checked() -> None:
    assert tuple(f.name for f in _script().FIGURES) == FIGURE_NAMES


# The figures a test reruns: the GPT-2 screen and the L4 LoRA answer at 1x8192. The other three L4 figures are
# 8B captures with their plans' bisection too (4 to 9 CPU-minutes each on two cores, which CI's time limit
# has no room for): `python benchmarks/readme_figures.py` reruns all five before the README changes.
CHECKED = ("gpt2-screen", pytest.param("l4-lora", marks=pytest.mark.heavy))  # heavy: 5 minutes, an 8B capture


@pytest.mark.slow  # minutes each: the README's commands, 8B models on the CUDA target included
@pytest.mark.parametrize("name", CHECKED)  # one case a figure, so that pytest-xdist spreads them
def test_readme_figures_are_what_graphmem_prints(name: str) -> None:
    rf = _script()
    assert rf.main(["--only", name]) == 0, f"README.md's {name} drifted: python benchmarks/readme_figures.py --write"
