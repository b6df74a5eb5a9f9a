"""Units of a chain, for depth reuse (graphmem/capture/widen_map.py): the chain's blocks grouped
into units that repeat, and which captured unit each unit of the widened step copies.

A plain chain's unit is one block, and every block is alike (graphmem/capture/reuse.py). A chain
with a checkpoint plan applied (graphmem/planning/apply.py) is a chain of units again: each
checkpointed segment is one unit (its blocks run forward together, and again, recomputed, right
before their backward) and each block outside the segments is one; units of the same kind (a
segment of the same length under the same policy, or a plain block) are alike. ``Layout`` says
how a capture of such a chain, with one run of alike units cut to ``kept`` units and every other
unit kept, widens to the chain with the run at full length: the units before the run and after
it are their own, and within the run the first two and last two are their own and every other
one copies the run's third (``block_copies``: the scheme of reuse.py, where the run is the whole
chain of one-block units).
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from functools import cached_property
from typing import Optional


def block_copies(j: int, k: int, n: int) -> list[int]:
    """The blocks of an n-block step that block j of a k-block capture becomes: the first two
    and last two are their own, block 2 is every other one."""
    if j in (0, 1):
        return [j]
    if j >= k - 2:
        return [n - (k - j)]
    return list(range(2, n - 2)) if j == 2 else []


@dataclass(frozen=True)
class Layout:
    """The widened chain's units (``sizes``: blocks per unit) and the run of alike units that the
    capture cuts: units ``first .. first + run - 1`` of the widened chain, of which the capture
    holds the first ``kept``; the units before and after the run are captured as they are."""

    sizes: tuple[int, ...]
    first: int
    run: int
    kept: int

    @staticmethod
    def blocks(k: int, n: int) -> "Layout":
        """A chain of one-block units, captured with k blocks and widened to n (reuse.py's)."""
        return Layout((1,) * n, 0, n, k)

    @property
    def n(self) -> int:
        """Units of the widened chain."""
        return len(self.sizes)

    @property
    def k(self) -> int:
        """Units of the captured chain."""
        return self.n - self.run + self.kept

    @cached_property
    def captured_sizes(self) -> tuple[int, ...]:
        s = self.sizes
        return s[:self.first + self.kept] + s[self.first + self.run:]

    @cached_property
    def _captured_starts(self) -> list[int]:
        return [0, *itertools.accumulate(self.captured_sizes)]

    @cached_property
    def _starts(self) -> list[int]:
        return [0, *itertools.accumulate(self.sizes)]

    def captured_blocks(self) -> list[int]:
        """The widened chain's blocks the capture keeps, in order (graphmem/chains.py ``selected``)."""
        keep = [u for u in range(self.n) if not self.first + self.kept <= u < self.first + self.run]
        return [i for u in keep for i in range(self._starts[u], self._starts[u + 1])]

    def unit_of(self, block: int) -> int:
        """The captured unit that captured block ``block`` is part of (past the chain: numbered on)."""
        total = self._captured_starts[-1]
        if block >= total:
            return self.k + block - total
        return bisect.bisect_right(self._captured_starts, block) - 1

    def copies(self, j: int) -> list[int]:
        """The widened units that captured unit j becomes."""
        if j < self.first:
            return [j]
        if j >= self.first + self.kept:
            return [j + self.run - self.kept]
        return [self.first + b for b in block_copies(j - self.first, self.kept, self.run)]

    def template(self, b: int) -> int:
        """The captured unit that widened unit b copies: the run's ends and their neighbours are
        their own (they touch what is around the run), every other unit of the run copies its third."""
        if b < self.first:
            return b
        if b >= self.first + self.run:
            return b - self.run + self.kept
        q = b - self.first
        if q in (0, 1):
            return b
        if q >= self.run - 2:
            return self.first + self.kept - (self.run - q)
        return self.first + 2

    def rename(self, path: str, prefix: str, j: Optional[int], b: Optional[int], captured: bool = False) -> str:
        """A module path of captured unit j's blocks as unit b's: of the widened chain, or of the
        capture (``captured``); other paths unchanged."""
        if j is None or b is None or not path.startswith(prefix):
            return path
        head, dot, rest = path[len(prefix):].partition(".")
        if not head.isdigit():
            return path
        start = self._captured_starts[j]
        if not start <= int(head) < self._captured_starts[j + 1]:
            return path
        to = (self._captured_starts if captured else self._starts)[b] + int(head) - start
        return f"{prefix}{to}{dot}{rest}"
