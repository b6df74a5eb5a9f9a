"""The figures README.md quotes, rerun: each documented command runs, the lines the README quotes are
taken from what it prints, and the README's block is compared with them (or rewritten from them).

    python benchmarks/readme_figures.py                  # check: exit 1 with a diff where a block drifted
    python benchmarks/readme_figures.py --write          # rewrite the drifted blocks from the output
    python benchmarks/readme_figures.py --only l4-lora   # some figures (names below)

A figure names its command, how its README block is found (the command's own line: the block that
holds it as ``$ graphmem ...``, else the first fenced block after the one that holds it) and which
output lines the block quotes: ``Screen`` (the whole output, its long tables cut to their first rows and
``...``) or ``Pick`` (the first line matching each pattern, ``...`` between lines the output does not
print together). ``Quote`` ties a number in the README's prose to the output's. The README itself is
changed only inside those blocks and quotes. tests/layout/test_readme_figures.py runs the check.
"""
from __future__ import annotations

import argparse
import difflib
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FENCE = "```"


@dataclass(frozen=True)
class Screen:
    """The whole output; a section (lines between blank lines) whose title starts with a key of ``cut``
    keeps its title, header, rule and that many rows, then ``...`` in place of the rest and of the
    blank line after it (as the README shows a cut table)."""
    cut: dict[str, int] = field(default_factory=dict)

    def lines(self, out: list[str]) -> list[str]:
        sections: list[list[str]] = [[]]
        for line in out:
            if line.strip():
                sections[-1].append(line)
            elif sections[-1]:
                sections.append([])
        kept: list[str] = []
        for section in filter(None, sections):
            if kept and kept[-1] != "...":
                kept.append("")
            rows = next((n for title, n in self.cut.items() if section[0].startswith(title)), None)
            kept += section if rows is None or len(section) <= 3 + rows else section[:3 + rows] + ["..."]
        return kept


@dataclass(frozen=True)
class Pick:
    """The first output line matching each pattern (in the output's order), ``...`` between lines the
    output does not print next to each other."""
    patterns: tuple[str, ...]

    def lines(self, out: list[str]) -> list[str]:
        found = set()
        for pattern in self.patterns:
            at = next((i for i, line in enumerate(out) if re.search(pattern, line)), None)
            if at is None:
                raise LookupError(f"no output line matches {pattern!r}")
            found.add(at)
        kept: list[str] = []
        for i in sorted(found):
            if kept and i - 1 not in found:
                kept.append("...")
            kept.append(out[i])
        return kept


@dataclass(frozen=True)
class Quote:
    """A number in the README's prose: ``readme`` matches it (group 1), ``output`` finds it in the output."""
    readme: str
    output: str


Select = Union[Screen, Pick]


@dataclass(frozen=True)
class Figure:
    name: str
    args: tuple[str, ...]  # graphmem's command line, as the README writes it
    select: Optional[Select]  # None: the README quotes only prose figures of this command
    quotes: tuple[Quote, ...] = ()
    exit: int = 0  # the command's exit status (1: the plan the README shows failing to fit)

    @property
    def command(self) -> str:
        return "graphmem " + " ".join(self.args)


L4 = ("analyze", "llama-3.1-8b", "--input-shape", "1x8192", "--device", "cuda", "--gpu", "l4", "--lora-rank", "16",
      "--lora-targets", "all-linear", "--optimizer", "adamw", "--plan", "--budget", "24GB")
FIGURES = (
    Figure("gpt2-screen", ("analyze", "models/gpt2.py", "--input-shape", "32x1024", "--top", "5", "--depth", "2"),
           Screen({"Largest saved tensors": 2, "Live at the peak": 2})),
    Figure("l4-lora", L4,
           Pick((r"^peak\s", r"^peak \(later steps\)", r"^\s+peak without checkpoints", r"^No plan chosen")),
           (Quote(r"No: even with every block checkpointed the peak is (\d+\.\d+ \w+)",
                  r"^\s+peak without checkpoints .* (\d+\.\d+ \S+)$"),), exit=1),
    Figure("l4-lora-4096", L4[:3] + ("1x4096",) + L4[4:], None,
           (Quote(r"At `1x4096` the smallest peak is (\d+\.\d+ \w+)", r"^\s+peak without checkpoints .* (\d+\.\d+ \S+)$"),),
           exit=1),
    Figure("l4-lora-3072", L4[:3] + ("1x3072",) + L4[4:], None,
           (Quote(r"at `1x3072` the lowest-peak plan's device total is (\d+\.\d+ \w+)",
                  r"the lowest-peak plan's is (\S+ \S+) \("),), exit=1),
    Figure("l4-qlora", L4[:8] + ("--qlora",) + L4[8:],
           Pick((r"^\s+peak without checkpoints", r"^No plan chosen")),
           (Quote(r"the weights take (\d+\.\d+ \w+) instead", r"^parameters\s+(\d+\.\d+ \S+)$"),
            Quote(r"without\s+checkpoints every step after the first peaks at (\d+\.\d+ \w+)",
                  r"^\s+peak without checkpoints (\d+\.\d+ \S+);")), exit=1),
)


def _trim(lines: list[str]) -> list[str]:
    while lines and not lines[-1].strip():
        lines.pop()
    return lines


def run(figure: Figure) -> list[str]:
    """What the figure's command prints (stdout), run as a user runs it."""
    cli = "import sys; from graphmem.cli.main import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-c", cli, *figure.args], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != figure.exit:
        raise RuntimeError(f"{figure.command} exited {done.returncode}, not {figure.exit}: "
                           f"{done.stderr.strip()[-500:]}")
    return _trim([line.rstrip() for line in done.stdout.splitlines()])


def block_span(readme: list[str], figure: Figure) -> tuple[int, int]:
    """(first, end) line indexes of the figure's quoted lines in the README (a fenced block's inside,
    after its ``$ graphmem ...`` line when it has one)."""
    at = next((i for i, line in enumerate(readme) if line.strip().endswith(figure.command)), None)
    if at is None:
        raise LookupError(f"README.md does not show `{figure.command}`")
    if readme[at].startswith("$ "):
        first = at + 1
    else:
        close = next(i for i in range(at + 1, len(readme)) if readme[i].startswith(FENCE))
        opening = next(i for i in range(close + 1, len(readme)) if readme[i].startswith(FENCE))
        first = opening + 1
    return first, next(i for i in range(first, len(readme)) if readme[i].startswith(FENCE))


def regenerate(readme: list[str], figure: Figure, out: list[str]) -> list[str]:
    """The README's lines with the figure's block and prose quotes made from ``out``."""
    if figure.select is not None:
        first, end = block_span(readme, figure)
        readme = readme[:first] + figure.select.lines(out) + readme[end:]
    text = "\n".join(readme)
    for quote in figure.quotes:
        found = next((m for m in map(re.compile(quote.output).search, out) if m), None)
        if found is None:
            raise LookupError(f"{figure.name}: no output line matches {quote.output!r}")
        where = re.search(quote.readme, text)
        if where is None:
            raise LookupError(f"{figure.name}: README.md has no {quote.readme!r}")
        text = text[:where.start(1)] + found.group(1) + text[where.end(1):]
    return text.split("\n")


def main(argv: Optional[list[str]] = None, readme_path: Path = README,
         runner: Callable[[Figure], list[str]] = run) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite README.md's drifted blocks")
    parser.add_argument("--only", default="", help="comma-separated figure names: " + ", ".join(f.name for f in FIGURES))
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = set(names) - {f.name for f in FIGURES}
    if unknown:
        parser.error(f"no figure {', '.join(sorted(unknown))}")
    old = readme_path.read_text(encoding="utf-8").split("\n")
    new = old
    for figure in FIGURES:
        if not names or figure.name in names:
            new = regenerate(new, figure, runner(figure))
    if new == old:
        print(f"{readme_path.name}: every figure as printed")
        return 0
    diff = difflib.unified_diff(old, new, f"{readme_path.name} (as written)", f"{readme_path.name} (as printed now)",
                                lineterm="")
    print("\n".join(diff))
    if args.write:
        readme_path.write_text("\n".join(new), encoding="utf-8")
        print(f"{readme_path.name}: rewritten")
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
